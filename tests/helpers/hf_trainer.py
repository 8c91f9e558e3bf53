"""One optimizer step of transformers' Trainer on CPU, and its first gradients: what the PackedTrainer tests
(tests/test_integration_hf.py, tests/test_integration_slices.py) run. transformers is imported where it is used,
so importing this module needs none."""

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
