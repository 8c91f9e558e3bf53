"""Supervised fine-tuning data as a Source: conversations and prompt/completion pairs, with the loss on some tokens.

Formats (`SftOptions.format`, "auto" decides from the first row's fields):
- "messages": `{"messages": [{"role", "content"}, ...]}`, rendered with the chat template;
- "prompt-completion": `{"prompt", "completion"}`, both text (tokenized as `tokenizer(text)` does, the completion
  ending in EOS) or both messages (the prompt rendered with the generation prompt, then prompt + completion). The
  completion starts where the two token sequences part, as in TRL;
- "tokens": pre-tokenized `input_ids` with a mask column: `assistant_masks`, `loss_mask` or `completion_mask`
  (1 = trains), or `labels` (-100 = does not train; any other label must equal the token). With several, the one
  `loss_on` names (`assistant_masks` for "assistant", `completion_mask` for "completion") wins, then that order.

`loss_on`: "assistant" (the tokens the assistant wrote, by the chat template's `{% generation %}` marks or
Mistral's assistant messages), "completion" (the completion of a prompt/completion pair), "all" (every token), or
None: "assistant" for messages, "completion" for pairs, the mask column for tokens. The mask rides on the tokens
(`loss_mask.MaskedTokens`) to collate, which sets labels to -100 where the target token does not train; the
step's loss normaliser counts trained targets only, and the cost model still prices every token.

A row with no token to train (`on_no_loss`): "error" (default: a SourceError naming the row), "drop" (an empty
document, counted in LoaderStats.dropped_no_loss) or "keep" (trained with no loss token: it costs compute and adds
nothing; counted in LoaderStats.no_loss_documents). A row longer than `context` tokens (`on_too_long`): "slice"
(default: the loader cuts it into independent pieces, each keeping its part of the mask, counted in
LoaderStats.split_documents), "drop" (counted in LoaderStats.dropped_too_long) or "error".
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
import numpy as np

from packloader.sources.base import ShardInfo
from packloader.sources.chat import chat_tokenizer, common_prefix
from packloader.sources.errors import SourceError
from packloader.sources.loss_mask import MaskedTokens
from packloader.sources.sft_rows import open_rows

MASK_COLUMNS = ("assistant_masks", "loss_mask", "completion_mask", "labels")


class SftOptions(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """How the SFT source reads rows and which tokens train (see the module)."""

    format: Literal["auto", "messages", "prompt-completion", "tokens"] = "auto"
    loss_on: Literal["assistant", "completion", "all"] | None = None
    on_no_loss: Literal["error", "drop", "keep"] = "error"
    on_too_long: Literal["slice", "drop", "error"] = "slice"
    context: int | None = None  # tokens; on_too_long "drop" and "error" need it (PlanConfig.context)


def detect_format(row: dict, where: str) -> str:
    if "messages" in row:
        return "messages"
    if "prompt" in row and "completion" in row:
        return "prompt-completion"
    if "input_ids" in row:
        return "tokens"
    raise SourceError(f"{where}: fields {sorted(row)}; expected 'messages', 'prompt' and 'completion', or 'input_ids' "
                      "with a mask column")


def _messages(value: Any, where: str, field: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise SourceError(f"{where}, field {field!r}: expected a non-empty list of messages, got {type(value).__name__}")
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise SourceError(f"{where}, field {field!r}, message {i}: expected {{'role': str, 'content': str}}, got "
                              f"{m!r:.80}")
    return value


class SftSource:
    """Rows of any kind `sft_rows.open_rows` reads, rendered to masked tokens (see the module).

    `tokenizer`: "mistral" (Tekken through mistral-common), a local transformers tokenizer folder, or a transformers
    tokenizer object (`chat.chat_tokenizer`); unused for the "tokens" format but for its vocabulary size."""

    pretokenized = True
    loss_masked = True  # the loader counts loss tokens from the masks (`loader.loss_masks`)

    def __init__(self, data, tokenizer: Any = None, *, options: SftOptions | dict | None = None,
                 name: str | None = None, **kw) -> None:
        opts = options if isinstance(options, SftOptions) else msgspec.convert({**(options or {}), **kw}, SftOptions)
        if opts.on_too_long != "slice" and opts.context is None:
            raise ValueError(f"SftOptions.on_too_long={opts.on_too_long!r} needs context= (the PlanConfig's context)")
        self.options = opts
        self.reader = open_rows(data, name=name)
        self.chat = None if tokenizer is None else chat_tokenizer(tokenizer)
        self.vocab_size = None if self.chat is None else int(self.chat.vocab_size)
        first = next((i for i, s in enumerate(self.reader.shards) if s.num_rows), None)
        if first is None:
            raise SourceError(f"{self.reader.shards[0].name if self.reader.shards else 'the SFT data'}: no rows")
        self.format = opts.format if opts.format != "auto" else \
            detect_format(self.reader.rows(first, [0])[0], self.reader.location(first, 0))
        if self.format != "tokens" and self.chat is None:
            raise ValueError(f"format {self.format!r} needs a tokenizer with a chat template (tokenizer=...)")
        default = {"messages": "assistant", "prompt-completion": "completion", "tokens": "completion"}
        self.loss_on = opts.loss_on or default[self.format]

    @property
    def shards(self) -> list[ShardInfo]:
        return self.reader.shards

    def lengths(self, shard: int) -> None:
        return None  # known only after rendering

    def location(self, shard: int, row: int) -> str:
        return self.reader.location(shard, row)

    def read(self, shard: int, rows: np.ndarray):
        rows = np.asarray(rows).tolist()
        for r, row in zip(rows, self.reader.rows(shard, rows)):
            where = self.location(shard, r)
            ids, mask = self._render(row, where)
            yield self._policy(ids, mask, where)

    # --- one row -------------------------------------------------------------------------------------------------

    def _render(self, row: dict, where: str) -> tuple[list[int], list[int]]:
        fmt, on = self.format, self.loss_on
        if fmt == "messages":
            if "messages" not in row:
                raise SourceError(f"{where}: no field 'messages' (fields {sorted(row)})")
            if on == "completion":
                raise SourceError(f"{where}: loss_on='completion' needs prompt/completion rows; a 'messages' row "
                                  "trains on 'assistant' or 'all'")
            ids, amask = self._chat(_messages(row["messages"], where, "messages"), where, on == "assistant")
            return ids, amask if on == "assistant" else [1] * len(ids)
        if fmt == "prompt-completion":
            return self._pair(row, where)
        return self._tokens(row, where)

    def _chat(self, messages, where, assistant_mask, add_generation_prompt=False):
        try:
            return self.chat.render(messages, add_generation_prompt=add_generation_prompt,
                                    assistant_mask=assistant_mask)
        except Exception as e:  # noqa: BLE001 - templates and mistral-common raise many kinds; name the row
            raise SourceError(f"{where}: the chat template refused the conversation ({type(e).__name__}: {e})") from e

    def _pair(self, row: dict, where: str) -> tuple[list[int], list[int]]:
        missing = [f for f in ("prompt", "completion") if f not in row]
        if missing:
            raise SourceError(f"{where}: no field {missing[0]!r} (fields {sorted(row)})")
        prompt, completion = row["prompt"], row["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            if self.loss_on == "assistant":
                raise SourceError(f"{where}: loss_on='assistant' needs conversations; this prompt/completion pair is "
                                  "plain text: use loss_on='completion'")
            prompt_ids = self.chat.encode_text(prompt)
            ids = self.chat.encode_text(prompt + completion, end=True)
            amask = [0] * len(ids)
        else:
            prompt = _messages(prompt, where, "prompt")
            both = prompt + _messages(completion, where, "completion")
            prompt_ids, _ = self._chat(prompt, where, False, add_generation_prompt=True)
            ids, amask = self._chat(both, where, self.loss_on == "assistant")
        if self.loss_on == "all":
            return ids, [1] * len(ids)
        if self.loss_on == "assistant":
            return ids, amask
        at = common_prefix(prompt_ids, ids)
        return ids, [0] * at + [1] * (len(ids) - at)

    def _tokens(self, row: dict, where: str) -> tuple[list[int], list[int]]:
        ids = row.get("input_ids")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise SourceError(f"{where}, field 'input_ids': expected a list of token ids, got {type(ids).__name__}")
        if self.vocab_size is not None:
            bad = next((i for i, t in enumerate(ids) if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise SourceError(f"{where}, field 'input_ids', position {bad}: token id {ids[bad]}, expected an id in "
                                  f"[0, {self.vocab_size}) (the tokenizer's vocabulary)")
        if self.loss_on == "all":
            return ids, [1] * len(ids)
        prefer = {"assistant": "assistant_masks", "completion": "completion_mask"}[self.loss_on]
        col = next((c for c in (prefer, *MASK_COLUMNS) if row.get(c) is not None), None)
        if col is None:
            raise SourceError(f"{where}: no mask column among {list(MASK_COLUMNS)} (fields {sorted(row)}); "
                              "pass loss_on='all' to train every token")
        values = row[col]
        if not isinstance(values, list) or len(values) != len(ids):
            n = len(values) if isinstance(values, list) else type(values).__name__
            raise SourceError(f"{where}, field {col!r}: {n} entries for {len(ids)} input_ids; expected one per token")
        if col == "labels":
            bad = next((i for i, (t, lab) in enumerate(zip(ids, values)) if lab not in (-100, t)), None)
            if bad is not None:
                raise SourceError(f"{where}, field 'labels', position {bad}: {values[bad]!r}, expected -100 or the "
                                  f"token itself ({ids[bad]}); labels in the unshifted convention, as TRL writes them")
            return ids, [0 if lab == -100 else 1 for lab in values]
        bad = next((i for i, v in enumerate(values) if v not in (0, 1)), None)
        if bad is not None:
            raise SourceError(f"{where}, field {col!r}, position {bad}: {values[bad]!r}, expected 0 or 1")
        return ids, [int(v) for v in values]

    def _policy(self, ids: list[int], mask: list[int], where: str) -> MaskedTokens:
        opts = self.options
        if not ids:
            raise SourceError(f"{where}: renders to no tokens")
        if opts.context is not None and len(ids) > opts.context and opts.on_too_long != "slice":
            if opts.on_too_long == "error":
                raise SourceError(f"{where}: {len(ids)} tokens, longer than context={opts.context}; pass "
                                  "on_too_long='slice' (pieces) or 'drop' (counted)")
            return MaskedTokens([], [], dropped="too_long")
        if not any(mask[1:]):  # a document's first token is never a target
            if opts.on_no_loss == "error":
                raise SourceError(f"{where}: no token to train on (loss_on={self.loss_on!r}); pass "
                                  "on_no_loss='drop' or 'keep' (both counted in the loader's stats)")
            if opts.on_no_loss == "drop":
                return MaskedTokens([], [], dropped="no_loss")
        return MaskedTokens(ids, mask)
