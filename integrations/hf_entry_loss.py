"""PackedTrainer's loss per mixture entry: each micro-batch's token losses summed per entry (from the logits the
loss was computed from, no second forward) and logged with the Trainer's own logs as `packloader/loss/<entry>`,
the mean per loss token over the logging interval on this process."""

from __future__ import annotations

from .entry_loss import EntryLossMeter, entry_sums, token_losses

META_KEY = "packloader_meta"  # hf.META_KEY (hf imports this module)


class _EntryLossMixin:
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        meta = inputs.get(META_KEY) or {}
        entries = meta.get("token_entries")
        if entries is None or not model.training:
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        losses, mask = token_losses(outputs["logits"], inputs["shift_labels"])
        names = meta["entry_names"]
        sums, counts = entry_sums(losses, mask, entries, len(names))
        if not hasattr(self, "_pl_entry_meter"):
            self._pl_entry_meter = EntryLossMeter()
        self._pl_entry_meter.add(names, sums, counts)
        return (loss, outputs) if return_outputs else loss

    def log(self, logs, *args, **kwargs):
        meter = getattr(self, "_pl_entry_meter", None)
        if meter is not None and "loss" in logs:  # the training logs, not evaluation's
            logs = {**logs, **meter.logs()}
        return super().log(logs, *args, **kwargs)
