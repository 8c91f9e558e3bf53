"""Supervised fine-tuning through packloader on CPU: conversations, the loss on the assistant's tokens only, a
plain PyTorch loop that checkpoints and resumes exactly.

    python examples/train_sft.py --out /tmp/sft                       # 2 epochs, ~30 s on 2 cores
    python examples/train_sft.py --out /tmp/sft --stop-after 6        # stop after 6 steps (a checkpoint at step 6)
    python examples/train_sft.py --out /tmp/sft --resume              # go on from the last checkpoint

Data: small arithmetic conversations generated from `--data-seed` (one to three user/assistant turns, some with a
system prompt), written as JSONL `{"messages": [...]}`, rendered with Mistral's Tekken instruct format through
mistral-common (offline) by `packloader.SftSource(..., loss_on="assistant")`. The model's vocabulary is the ids the
data uses (a fixed relabelling; a 131k-entry output layer would dominate CPU time).

Model: a 2-layer `transformers.LlamaConfig` at random init (seeded), fed each packed micro-batch as one row with
`position_ids` (sdpa keeps the documents apart). Loss: cross-entropy summed over the micro-batch's labels (-100
wherever the target is not the assistant's) and divided by `loss_tokens_in_step`, the trained targets of the whole
step, so a step's gradient is the mean over exactly the tokens that train. One AdamW step per packloader step.

Checkpoint (`--save-every` steps, and at `--stop-after`): the model, the optimizer and `loader.state_dict()`;
`--resume` loads them and the loader continues with the micro-batch that followed, so a stopped-and-resumed run
trains the same tokens with the same losses as one that ran through (tests/test_example_sft.py checks it).
Outputs in `--out`: `data.jsonl`, `log.jsonl` (per step: loss, loss tokens, tokens, the documents' pieces),
`ckpt.pt`.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import numpy as np
import torch

from packloader import PackedLoader, PlanConfig, SftSource


def conversations(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        msgs = [{"role": "system", "content": "Answer with the number only."}] if rng.random() < 0.3 else []
        for _ in range(rng.randint(1, 3)):
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            op = rng.choice("+-*")
            msgs.append({"role": "user", "content": f"What is {a} {op} {b}?"})
            msgs.append({"role": "assistant", "content": str(eval(f"{a} {op} {b}"))})
        rows.append({"messages": msgs})
    return rows


def make_loader(args, data: Path) -> PackedLoader:
    source = SftSource(str(data), "mistral", loss_on="assistant")
    cfg = PlanConfig(strategy=args.strategy, max_tokens=args.max_tokens, context=args.max_tokens,
                     tokens_per_step=args.tokens_per_step, num_micro_batches=args.micro_batches, seed=args.seed)
    return PackedLoader(source, tokenizer=None, config=cfg, epochs=args.epochs, num_threads=1)


def vocab_table(loader: PackedLoader) -> torch.Tensor:
    """Tekken id -> model id, for every id of the data (read once through the loader's stream)."""
    stream = loader.stream
    ids = np.unique(np.concatenate(stream.read(np.arange(stream.num_docs))))
    table = torch.full((int(ids.max()) + 1,), -1, dtype=torch.int64)
    table[torch.from_numpy(ids.astype(np.int64))] = torch.arange(len(ids))
    return table


def build_model(vocab: int, seed: int):
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    return transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)


def loss_sum(model, batch, table: torch.Tensor) -> torch.Tensor:
    """Summed next-token loss of one micro-batch over the targets that train (labels -100 elsewhere)."""
    hf = batch.to_hf()
    ids = table[hf["input_ids"]]
    target = hf["shift_labels"][0]
    target = torch.where(target == -100, target, table[target.clamp(min=0)])
    logits = model(input_ids=ids, position_ids=hf["position_ids"], use_cache=False).logits[0]
    return torch.nn.functional.cross_entropy(logits, target, ignore_index=-100, reduction="sum")


def train(args) -> list[dict]:
    from packloader_integrations.deepspeed import steps

    torch.set_num_threads(1)  # the same float sums in a run and in its resumed twin
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = out / "data.jsonl"
    if not data.exists():
        data.write_text("".join(json.dumps(r) + "\n" for r in conversations(args.rows, args.data_seed)))
    loader = make_loader(args, data)
    table = vocab_table(loader)
    model = build_model(int(table.max()) + 1, args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    log_path, ckpt = out / "log.jsonl", out / "ckpt.pt"
    done = 0
    if args.resume:
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        loader.load_state_dict(state["loader"])
        done = state["steps"]
        lines = log_path.read_text().splitlines()[:done]  # what a killed run logged after its checkpoint goes
        log_path.write_text("".join(line + "\n" for line in lines))
    elif log_path.exists():
        log_path.unlink()
    model.train()
    with open(log_path, "a") as log:
        for micro_batches in steps(loader):
            n_step = micro_batches[0].loss_tokens_in_step
            opt.zero_grad(set_to_none=True)
            total = 0.0
            for b in micro_batches:
                if n_step == 0 or b.num_tokens == 0:
                    continue
                loss = loss_sum(model, b, table)
                (loss / n_step).backward()
                total += float(loss.detach())
            opt.step()
            done += 1
            rec = {"step": micro_batches[0].step, "loss": total / max(1, n_step), "loss_tokens": n_step,
                   "tokens": sum(b.num_tokens for b in micro_batches),
                   "pieces": [[s.doc, s.start, s.end] for b in micro_batches for s in b.segments]}
            log.write(json.dumps(rec) + "\n")
            log.flush()
            if args.verbose:
                print(f"step {rec['step']:3d} loss {rec['loss']:.4f} loss tokens {n_step}", file=sys.stderr)
            if done % args.save_every == 0 or done == args.stop_after:
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                            "loader": loader.state_dict(), "steps": done}, ckpt)
            if done == args.stop_after:
                break
    loader.close()
    return [json.loads(line) for line in log_path.read_text().splitlines()]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--rows", type=int, default=400)
    p.add_argument("--data-seed", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--strategy", default="wlb")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--tokens-per-step", type=int, default=2048)
    p.add_argument("--micro-batches", type=int, default=None)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--stop-after", type=int, default=0, help="stop (with a checkpoint) after this many steps")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--verbose", action="store_true")
    return p.parse_args(argv)


if __name__ == "__main__":
    curve = train(parse_args())
    first, last = curve[0]["loss"], curve[-1]["loss"]
    print(json.dumps({"steps": len(curve), "first_loss": first, "last_loss": last}))
