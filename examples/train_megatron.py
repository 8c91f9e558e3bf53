"""A small megatron-core GPTModel trained on packloader batches, 2 gloo ranks on CPU, then resumed exactly: megatron-core
alone, no Megatron-LM (`pretrain()` and `megatron.training` are Megatron-LM's, not megatron-core's).

    python examples/train_megatron.py --out /tmp/mg            # DP 2 (PP 1); relaunches itself with torchrun
    python examples/train_megatron.py --out /tmp/mg2 --pp 2    # 2 pipeline stages (DP 1)

Run 1 trains the whole epoch of a small corpus (the stdlib's json package, `bytes` tokenizer) and, after step
`--resume-at`, saves each rank's model, optimizer and loader state. Run 2, in the same processes, builds a fresh
model (another init), loads the three and trains the rest of the epoch. `result.json` holds both runs' per-step
losses and the pieces every rank trained.

What megatron-core needs here, and why:
- The training loop is this file's: megatron-core has the model, the parallel state, DDP, `finalize_model_grads`
  and the schedules, but no `pretrain()`.
- On a GPU, `get_forward_backward_func()` gives Megatron's own schedule. Those allocate on CUDA (their token
  counter, the p2p shape exchange), so on CPU this example runs packloader's drop-ins with the same keyword
  arguments: `sliced_forward_backward` (PP 1) and `sliced_pipeline_forward_backward` (PP > 1), with
  `PackloaderCoreAttention` as the layer spec's core attention (THD packed attention without TransformerEngine).
- `variable_seq_lengths=True` (micro-batches of different token counts between pipeline stages) needs
  `moe_token_dispatcher_type="alltoall"`: megatron-core 0.16's TransformerConfig refuses it with the default
  "allgather" dispatcher, even without MoE. `check_megatron_config` checks both.
- RoPE on CPU: Megatron's `RotaryEmbedding` puts its frequencies on `torch.cuda.current_device()` at every
  forward ("Found no NVIDIA driver"); without CUDA this example makes that the CPU (`rope_on_cpu`), which also
  places DDP's gradient buffers on the CPU.
- DP gradient reduction: the model is wrapped in megatron-core's `DistributedDataParallel`, and the config gets
  `no_sync_func=model.no_sync` and `finalize_model_grads_func=finalize_model_grads`; the schedule calls the latter
  once per step with the step's loss-token count: it all-reduces the gradients over DP (and the tied embedding
  between the first and last stage), all-reduces the count and divides by it (`calculate_per_token_loss=True`).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from two_ranks import corpus, gather, relaunch, say, segments_of, write_result  # noqa: E402

from packloader import PackedLoader, ParallelConfig, PlanConfig  # noqa: E402
from packloader.loader.step_metrics import format_step_metrics  # noqa: E402

NPROC = 2
VOCAB = 257  # the bytes tokenizer's ids, EOS 256


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--pp", type=int, default=1, choices=(1, 2), help="pipeline stages (DP = 2 / PP)")
    ap.add_argument("--resume-at", type=int, default=3, help="steps run 1 trains before the checkpoint it resumes")
    ap.add_argument("--tokens-per-step", type=int, default=4096)
    ap.add_argument("--micro-batches", type=int, default=None,
                    help="per DP rank; Megatron's num_microbatches (default 2 x PP: the step's tokens fit either way)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.micro_batches is None:
        args.micro_batches = 2 * args.pp
    return args


def rope_on_cpu() -> None:
    """Megatron's RotaryEmbedding (and DDP's buffers) ask `torch.cuda.current_device()`; without CUDA: the CPU."""
    if not torch.cuda.is_available():
        torch.cuda.current_device = lambda: "cpu"


def make_config(args):
    from megatron.core.transformer.transformer_config import TransformerConfig

    from packloader_integrations.megatron import check_megatron_config

    cfg = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                            ffn_hidden_size=128, use_cpu_initialization=True, calculate_per_token_loss=True,
                            hidden_dropout=0.0, attention_dropout=0.0, pipeline_model_parallel_size=args.pp,
                            pipeline_dtype=torch.float32, variable_seq_lengths=True,
                            moe_token_dispatcher_type="alltoall")
    check_megatron_config(cfg)
    return cfg


def make_model(args, cfg, init_seed: int):
    """This rank's stage of the GPTModel (RoPE, local layer spec, packloader's core attention) in Megatron's DDP."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from packloader_integrations.megatron import PackloaderCoreAttention

    spec = get_gpt_layer_local_spec()
    spec.submodules.self_attention.submodules.core_attention = PackloaderCoreAttention
    torch.manual_seed(init_seed)
    gpt = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=256,
                   position_embedding_type="rope", pre_process=ps.is_pipeline_first_stage(),
                   post_process=ps.is_pipeline_last_stage())
    model = DistributedDataParallel(cfg, DistributedDataParallelConfig(), gpt)
    cfg.no_sync_func = model.no_sync
    cfg.finalize_model_grads_func = finalize_model_grads
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    return model, optimizer


def make_loader(args) -> PackedLoader:
    from megatron.core import parallel_state as ps

    dp = NPROC // args.pp
    cfg = PlanConfig(strategy="wlb", parallel=ParallelConfig(dp=dp, pp=args.pp), max_tokens=1024, context=256,
                     tokens_per_step=args.tokens_per_step, num_micro_batches=args.micro_batches,
                     allow_slicing=False, model="tiny")
    # every pipeline stage of a DP rank reads the same loader (plans are deterministic)
    return PackedLoader(corpus(), tokenizer="bytes", config=cfg, dp_rank=ps.get_data_parallel_rank(),
                        seed=args.seed, epochs=1)


def train_step(args, model, optimizer, micro_batches) -> float:
    """One optimizer step over one packloader step; the step's per-token loss over every rank."""
    from packloader_integrations import megatron as pm

    schedule = pm.sliced_forward_backward if args.pp == 1 else pm.sliced_pipeline_forward_backward
    model.zero_grad_buffer()
    optimizer.zero_grad(set_to_none=True)
    store = schedule(forward_step_func=pm.forward_step, data_iterator=iter(micro_batches),
                     model=model if args.pp == 1 else [model], num_microbatches=args.micro_batches, seq_length=0,
                     micro_batch_size=1)
    for p in model.parameters():  # Megatron's DDP reduces into main_grad; a torch optimizer reads .grad
        p.grad = p.main_grad
    optimizer.step()
    # the loss sum and its token count from the last stage of every DP rank, added over all ranks
    t = torch.tensor([sum(float(r["lm loss"][0]) for r in store), sum(float(r["lm loss"][1]) for r in store)],
                     dtype=torch.float64)
    torch.distributed.all_reduce(t)
    return float(t[0] / t[1])


def steps_of(args, loader):
    """The loader's micro-batches as Megatron batch dicts, grouped by step (MegatronDataIterator: THD batches)."""
    from packloader_integrations.megatron import MegatronDataIterator

    it = MegatronDataIterator(loader, num_microbatches=args.micro_batches, slices=True)
    group = []
    for b in it:
        group.append(b)
        if len(group) == args.micro_batches:
            yield group
            group = []


def param_checksum(model) -> float:
    return float(sum(p.detach().double().sum() for p in model.parameters()))


def train(args, model, optimizer, loader, *, stop_after=None, ckpt=None) -> dict:
    losses, pieces = {}, {}
    rank = torch.distributed.get_rank()
    for n, micro_batches in enumerate(steps_of(args, loader), start=1):
        metrics = micro_batches[0]["step_metrics"]
        loss = train_step(args, model, optimizer, micro_batches)
        losses[metrics.step] = loss
        pieces[metrics.step] = segments_of([b["segments"] for b in micro_batches])
        say(f"step {metrics.step}: loss {loss:.5f} | {format_step_metrics(metrics)}")
        if n == stop_after:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "loader": loader.state_dict()}, ckpt / f"rank{rank}.pt")
    # DP replicas that reduced their gradients stay identical: the same sum on every DP rank of a stage
    return {"losses": losses, "pieces": pieces, "checksum": param_checksum(model)}


def main(argv=None) -> int:
    args = parse_args(argv)
    if "RANK" not in os.environ:  # not launched by torchrun yet
        return relaunch(__file__, sys.argv[1:] if argv is None else list(argv), NPROC)
    torch.distributed.init_process_group("gloo")
    rope_on_cpu()
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=args.pp)
    args.out.mkdir(parents=True, exist_ok=True)
    ckpt = args.out / "checkpoint"
    ckpt.mkdir(exist_ok=True)
    cfg = make_config(args)

    say(f"run 1 (DP {NPROC // args.pp} x PP {args.pp}): the whole epoch, checkpoint after step {args.resume_at}")
    model, optimizer = make_model(args, cfg, args.seed)
    first = train(args, model, optimizer, make_loader(args), stop_after=args.resume_at, ckpt=ckpt)
    torch.distributed.barrier()

    say("run 2: a new model and loader from the checkpoint")
    model, optimizer = make_model(args, cfg, args.seed + 1)  # another init: only the checkpoint can make it agree
    saved = torch.load(ckpt / f"rank{torch.distributed.get_rank()}.pt", weights_only=False)
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    loader = make_loader(args)
    loader.load_state_dict(saved["loader"])
    second = train(args, model, optimizer, loader)

    write_result(args.out, {"world": torch.distributed.get_world_size(), "pp": args.pp,
                            "pp_rank": gather(ps.get_pipeline_model_parallel_rank()),
                            "resume_at": args.resume_at, "first": gather(first), "second": gather(second)})
    ps.destroy_model_parallel()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
