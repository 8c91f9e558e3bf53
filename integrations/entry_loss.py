"""Loss per mixture entry, for the trainers' logs (`packloader/loss/<entry>`): each token's entry from the batch
(`PackedBatch.entries`, one per segment), the token losses summed per entry with their loss-token counts, so a
mean over any window (a logging interval, a global step, every rank) is sum / count, as the loss itself is."""

from __future__ import annotations

from typing import Sequence

import torch

from packloader.collate.batch import IGNORE_INDEX, PackedBatch

PREFIX = "packloader/loss/"


def token_entries(batch: PackedBatch) -> torch.Tensor | None:
    """int64 [T]: the mixture entry of each token of the micro-batch (padding: its segment's entry); None for a single
    source or an empty micro-batch."""
    offsets = (batch.cu_seqlens_padded if batch.cu_seqlens_padded is not None else batch.cu_seqlens).long()
    if batch.entries is None or batch.num_tokens == 0 or batch.entries.numel() != offsets.numel() - 1:
        return None  # one source, or an empty slot's placeholder row
    counts = torch.diff(offsets)
    out = torch.repeat_interleave(batch.entries.long(), counts)
    tail = batch.num_tokens - out.numel()  # pad_to_tokens: the micro-batch's padding after its last segment
    if tail > 0:
        out = torch.cat([out, out[-1:].expand(tail)])
    return out


def entry_sums(token_losses: torch.Tensor, mask: torch.Tensor, entries: torch.Tensor,
               num_entries: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss sum, loss tokens) per entry, float64 [num_entries] each, of per-token losses where `mask` is set."""
    losses = token_losses.reshape(-1).detach().double()
    mask = mask.reshape(-1).to(losses.dtype)
    ent = entries.reshape(-1).to(losses.device)
    sums = torch.zeros(num_entries, dtype=torch.float64, device=losses.device).index_add_(0, ent, losses * mask)
    counts = torch.zeros(num_entries, dtype=torch.float64, device=losses.device).index_add_(0, ent, mask)
    return sums, counts


def token_losses(logits: torch.Tensor, shift_labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token cross entropy of logits [.., T, V] against targets already shifted (packloader's labels), and the
    mask of tokens that carry a target."""
    logits = logits.reshape(-1, logits.shape[-1]).float()
    labels = shift_labels.reshape(-1).to(logits.device)
    losses = torch.nn.functional.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="none")
    return losses, labels != IGNORE_INDEX


class EntryLossMeter:
    """Loss sums and loss-token counts per entry name, accumulated over micro-batches until `logs()` empties it."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.counts: dict[str, float] = {}

    def add(self, names: Sequence[str], sums: torch.Tensor, counts: torch.Tensor) -> None:
        for name, s, c in zip(names, sums.tolist(), counts.tolist()):
            self.sums[name] = self.sums.get(name, 0.0) + s
            self.counts[name] = self.counts.get(name, 0.0) + c

    def logs(self) -> dict[str, float]:
        """{`packloader/loss/<entry>`: mean loss per loss token since the last call} for entries that had tokens."""
        out = {f"{PREFIX}{n}": self.sums[n] / self.counts[n] for n in self.sums if self.counts[n] > 0}
        self.sums, self.counts = {}, {}
        return out
