"""A tiny transformers Llama trained under DeepSpeed on packloader batches, 2 gloo ranks on CPU, then resumed exactly.

    python examples/train_deepspeed.py --out /tmp/ds            # relaunches itself on 2 ranks with torchrun

Run 1 trains the whole epoch of a small corpus (the stdlib's json package, `bytes` tokenizer) and, after step
`--resume-at`, saves DeepSpeed's checkpoint and each rank's loader state. Run 2, in the same processes, builds a
fresh engine (another init) and a fresh `PackedLoader`, loads both and trains the rest of the epoch. `result.json`
holds both runs' per-step losses and every rank's trained pieces, so a test can check that run 2 repeats run 1's
steps exactly and that the epoch trained every token once.

What a first DeepSpeed run on CPU needs, and why:
- `disable_shm_comm_op()`: DeepSpeed's CPU backend would JIT-build a shared-memory all-reduce op on first use
  (minutes); marked unavailable, DeepSpeed all-reduces through torch.distributed's gloo.
- `"torch_adam": True` in the optimizer's params: DeepSpeed's "AdamW" otherwise builds its `fused_adam` C++ op
  the first time `deepspeed.initialize` runs (about a minute, silently); torch's AdamW needs no build.
- `position_ids` restart at 0 at every packed document and `use_cache=False`: transformers then keeps attention
  inside each document (with a KV cache it drops the packed mask, and attention crosses documents).
- `gradient_accumulation_steps` equals `PlanConfig.num_micro_batches`: one packloader step is one optimizer step.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from two_ranks import corpus, gather, global_loss, relaunch, say, segments_of, write_result  # noqa: E402

from packloader import PackedLoader, ParallelConfig, PlanConfig  # noqa: E402
from packloader.loader.step_metrics import format_step_metrics  # noqa: E402

NPROC = 2


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--resume-at", type=int, default=3, help="steps run 1 trains before the checkpoint it resumes")
    ap.add_argument("--tokens-per-step", type=int, default=4096)
    ap.add_argument("--micro-batches", type=int, default=2, help="per rank; DeepSpeed's gradient_accumulation_steps")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def make_loader(args) -> PackedLoader:
    cfg = PlanConfig(strategy="wlb", parallel=ParallelConfig(dp=NPROC), max_tokens=1024, context=256,
                     tokens_per_step=args.tokens_per_step, num_micro_batches=args.micro_batches,
                     allow_slicing=False, model="tiny")
    return PackedLoader(corpus(), tokenizer="bytes", config=cfg, seed=args.seed, epochs=1)


def make_engine(args, init_seed: int):
    import deepspeed
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(init_seed)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=257, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                         attn_implementation="sdpa", use_cache=False))
    ds_config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": args.micro_batches,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "torch_adam": True}},  # no fused_adam build
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    return engine


def loss_sum(engine, b) -> torch.Tensor:
    """The micro-batch's summed next-token loss (packloader's labels are already shifted: the target of each token)."""
    logits = engine(input_ids=b["input_ids"], position_ids=b["position_ids"], use_cache=False).logits
    return torch.nn.functional.cross_entropy(logits[0].float(), b["labels"][0], ignore_index=-100, reduction="sum")


def train(args, engine, loader, *, stop_after: int | None = None, ckpt: Path | None = None) -> dict:
    """Steps of `loader` through `engine` until the epoch ends (or after `stop_after` steps, then checkpoint)."""
    from packloader_integrations.deepspeed import steps, train_step

    losses, pieces = {}, {}
    for n, micro_batches in enumerate(steps(loader), start=1):
        step = micro_batches[0].step
        metrics = micro_batches[0].step_metrics
        loss = global_loss(train_step(engine, micro_batches, loss_sum))
        losses[step], pieces[step] = loss, segments_of(b.segments for b in micro_batches)
        say(f"step {step}: loss {loss:.5f}" + (f" | {format_step_metrics(metrics)}" if metrics is not None else ""))
        if n == stop_after:
            engine.save_checkpoint(str(ckpt), tag="resume")
            torch.save(loader.state_dict(), ckpt / f"loader-rank{torch.distributed.get_rank()}.pt")
    # DP replicas whose gradients DeepSpeed averaged stay identical: the same sum on both ranks
    checksum = float(sum(p.detach().double().sum() for p in engine.module.parameters()))
    return {"losses": losses, "pieces": pieces, "checksum": checksum}


def main(argv=None) -> int:
    args = parse_args(argv)
    if "RANK" not in os.environ:  # not launched by torchrun yet
        return relaunch(__file__, sys.argv[1:] if argv is None else list(argv), NPROC)
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    from packloader_integrations.deepspeed import disable_shm_comm_op

    disable_shm_comm_op()
    ckpt = args.out / "checkpoint"
    ckpt.mkdir(parents=True, exist_ok=True)  # every rank writes its loader state beside DeepSpeed's files

    say("run 1: the whole epoch, checkpoint after step", args.resume_at)
    first = train(args, make_engine(args, args.seed), make_loader(args), stop_after=args.resume_at, ckpt=ckpt)
    torch.distributed.barrier()

    say("run 2: a new engine and loader from the checkpoint")
    engine = make_engine(args, args.seed + 1)  # another init: only the checkpoint can make run 2 agree
    engine.load_checkpoint(str(ckpt), tag="resume")
    loader = make_loader(args)
    loader.load_state_dict(torch.load(ckpt / f"loader-rank{rank}.pt", weights_only=False))
    second = train(args, engine, loader)

    write_result(args.out, {"world": torch.distributed.get_world_size(), "resume_at": args.resume_at,
                            "first": gather(first), "second": gather(second)})
    return 0  # no destroy_process_group: the loaders' threads must not outlive the process (issue 33)


if __name__ == "__main__":
    sys.exit(main())
