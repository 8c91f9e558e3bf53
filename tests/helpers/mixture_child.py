"""A trainer process over a mixture for tests/test_mixture_kill.py: resumes from the last saved state (truncating its
log to where that state was saved), logs one line per micro-batch (step, index, a hash of its tensors), saves its
state atomically every `save_every` micro-batches, and SIGKILLs itself after logging micro-batch `kill_at`.

    python tests/helpers/mixture_child.py SPEC_JSON
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import signal
import sys


def main(spec: dict) -> None:
    from packloader import Mixture, MixtureEntry, PackedLoader, PlanConfig

    mix = Mixture(entries=[MixtureEntry(**e) for e in spec["entries"]])
    cfg = PlanConfig(strategy="wlb", max_tokens=256, context=256, tokens_per_step=1024)
    loader = PackedLoader(mix, tokenizer=None, config=cfg, num_threads=2, epochs=spec["epochs"])
    state_file, log_file = spec["state"], spec["log"]
    done = 0
    if os.path.exists(state_file):
        with open(state_file, "rb") as f:
            saved = pickle.load(f)
        loader.load_state_dict(saved["state"])
        done = saved["done"]
    with open(log_file, "a+") as log:
        log.seek(0)
        lines = log.read().splitlines()[:done]  # what came after the state is trained again
        log.seek(0)
        log.truncate()
        log.write("".join(line + "\n" for line in lines))
        for b in loader:
            h = hashlib.blake2b(digest_size=8)
            for t in (b.input_ids, b.labels, b.position_ids, b.cu_seqlens, b.doc_ids, b.entries):
                h.update(t.numpy().tobytes())
            log.write(f"{b.step} {b.index_in_step} {b.epoch} {h.hexdigest()}\n")
            log.flush()
            done += 1
            if done == spec.get("kill_at"):
                os.kill(os.getpid(), signal.SIGKILL)
            if done % spec["save_every"] == 0:
                tmp = state_file + ".tmp"
                with open(tmp, "wb") as f:
                    pickle.dump({"state": loader.state_dict(), "done": done}, f)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, state_file)
    loader.close()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
