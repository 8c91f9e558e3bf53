"""PackedTrainer runs for the tests on CPU: one optimizer step and its first gradients (tests/test_integration_hf.py,
tests/test_integration_slices.py), and a checkpointed run in a process of its own that can kill itself mid-step and
resume (``python tests/helpers/hf_trainer.py SPEC_JSON``). transformers is imported where it is used, so importing
this module needs none."""

from __future__ import annotations

from typing import Any


def one_step_args(output_dir, grad_accum: int, **extra: Any):
    """TrainingArguments for one optimizer step of `grad_accum` micro-batches on the CPU: no reporting, saving,
    logging, gradient clipping or DataLoader workers; `extra` adds to or overrides these."""
    import transformers

    kw = dict(output_dir=str(output_dir), max_steps=1, gradient_accumulation_steps=grad_accum, learning_rate=1e-3,
              use_cpu=True, report_to=[], save_strategy="no", logging_strategy="no", max_grad_norm=0.0,
              dataloader_num_workers=0)
    return transformers.TrainingArguments(**{**kw, **extra})


def first_grads_callback(model, into: dict):
    """A TrainerCallback that fills `into` with a copy of every parameter's gradient of `model`, by name, before the
    first optimizer step (left as it is after that)."""
    import transformers

    class FirstGrads(transformers.TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kw):
            if not into:
                into.update({n: p.grad.clone() for n, p in model.named_parameters()})

    return FirstGrads()


# --- a PackedTrainer run in a process of its own (tests/test_integration_hf.py kills one and resumes it) -----------

VOCAB = 101


def tiny_llama(seed: int = 0):
    """A 2-layer random Llama (float32, sdpa) built from a config: no download."""
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)


def trainer_run(spec: dict) -> None:
    """Train a tiny Llama with PackedTrainer on spec["shards"] (Parquet token shards) for spec["max_steps"] steps,
    checkpointing every spec["save_steps"]; resume from the last checkpoint in spec["out"] with spec["resume"].
    Appends one JSON line per forward to spec["record"] (step, input ids, loss) and flushes it, so what a killed
    run trained is on disk. With spec["kill_at"] = N the process SIGKILLs itself after the first micro-batch of
    optimizer step N (after the checkpoints before it, in the middle of a step)."""
    import json
    import os
    import signal

    import torch
    import transformers

    from packloader.contracts import PlanConfig
    from packloader.loader.loader import PackedLoader
    from packloader_integrations.hf import PackedTrainer

    torch.set_num_threads(1)
    ga = spec["ga"]
    cfg = PlanConfig(strategy="wlb", max_tokens=200, context=150, tokens_per_step=500, allow_slicing=False,
                     num_micro_batches=ga)
    loader = PackedLoader(spec["shards"], config=cfg, num_threads=0, epochs=None, append_eos=False)
    model = tiny_llama()
    record = open(spec["record"], "a")
    state = {"step": 0}

    def on_forward(module, args, kwargs, out):
        record.write(json.dumps({"step": state["step"], "ids": kwargs["input_ids"][0].tolist(),
                                 "loss": float(out.loss)}) + "\n")
        record.flush()

    model.register_forward_hook(on_forward, with_kwargs=True)

    class Kill(transformers.TrainerCallback):
        def on_step_begin(self, args, st, control, **kw):
            state["step"] = st.global_step + 1  # the optimizer step this window trains (1-based, as the Trainer)

        def on_substep_end(self, args, st, control, **kw):
            if st.global_step + 1 == spec.get("kill_at"):
                os.kill(os.getpid(), signal.SIGKILL)

    args = one_step_args(spec["out"], ga, max_steps=spec["max_steps"], save_strategy="steps",
                         save_steps=spec["save_steps"], logging_strategy="steps", logging_steps=1, seed=0)
    trainer = PackedTrainer(model=model, args=args, packed_loader=loader, callbacks=[Kill()])
    trainer.train(resume_from_checkpoint=True if spec.get("resume") else None)
    with open(spec["logs"], "w") as f:
        json.dump(trainer.state.log_history, f)


if __name__ == "__main__":
    import json
    import sys

    trainer_run(json.loads(sys.argv[1]))
