"""Megatron's loss with a report per mixture entry: `packloader/loss/<entry>` as [loss sum, loss tokens], the form
Megatron's training log reduces over micro-batches and data-parallel ranks and divides (as it does `lm loss`)."""

from __future__ import annotations

from functools import partial
from typing import Sequence

import torch

from ..entry_loss import PREFIX, entry_sums
from .batch import loss_func


def loss_func_by_entry(loss_mask: torch.Tensor, token_entries: torch.Tensor | None,
                       entry_names: Sequence[str] | None, output_tensor: torch.Tensor):
    """`loss_func`'s (loss sum, loss tokens, report), the report with one [sum, count] per entry of a mixture."""
    loss, num_tokens, report = loss_func(loss_mask, output_tensor)
    if token_entries is not None and entry_names:
        sums, counts = entry_sums(output_tensor, loss_mask, token_entries, len(entry_names))
        for name, s, c in zip(entry_names, sums, counts):
            report[f"{PREFIX}{name}"] = torch.stack([s, c]).to(loss.dtype)
    return loss, num_tokens, report


def forward_step_by_entry(data_iterator, model):
    """`forward_step` whose loss reports each mixture entry's loss (the batch dict read whole, for its entries)."""
    b = next(data_iterator)
    output = model(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"],
                   packed_seq_params=b["packed_seq_params"])
    return output, partial(loss_func_by_entry, b["loss_mask"], b.get("token_entries"), b.get("entry_names"))
