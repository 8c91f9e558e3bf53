"""Chat templates for the SFT source: a conversation in, token ids and which of them are the assistant's out.

Two kinds, both offline:
- `HFChat`: a transformers tokenizer (an object, or a local folder with its `chat_template`, loaded with
  `local_files_only`). The assistant mask is transformers' own (`apply_chat_template(...,
  return_assistant_tokens_mask=True)`), which needs a template that marks the assistant's text with
  `{% generation %}`; one without is refused, since every token would otherwise read as "not the assistant's".
  Plain text is tokenized as `tokenizer(text)` does (its special tokens included), as TRL does.
- `MistralChat`: Mistral's Tekken through mistral-common's instruct tokenizer (`MistralTokenizer.from_file` on the
  Tekken file mistral-common ships, or a path). The tokens are `encode_chat_completion`'s; the assistant's are
  those its assistant-message encoder produced (the content and its `</s>`), found by recording each message
  encoder's output during that same call, and checked to add up to the request's tokens. Conversations are
  validated as for fine-tuning (they end with the assistant's turn); a pair's prompt alone, as for inference.
"""

from __future__ import annotations

import functools
import os
import threading
from typing import Any, Protocol, Sequence


class ChatTokenizer(Protocol):
    name: str
    vocab_size: int
    eos_id: int | None

    def render(self, messages: list[dict], *, add_generation_prompt: bool = False,
               assistant_mask: bool = True) -> tuple[list[int], list[int]]:
        """Token ids of a conversation and, per token, 1 where the assistant wrote it (all 0 without
        `assistant_mask`)."""
        ...

    def encode_text(self, text: str, *, end: bool = False) -> list[int]:
        """Plain text's ids (the tokenizer's own special tokens included); `end`: ending in EOS (a completion)."""
        ...


class HFChat:
    """A transformers tokenizer with a chat template (see the module)."""

    def __init__(self, tokenizer: Any, *, chat_template: str | None = None) -> None:
        if isinstance(tokenizer, (str, os.PathLike)):
            from transformers import AutoTokenizer

            path = str(tokenizer)
            if not os.path.isdir(path):
                raise FileNotFoundError(f"tokenizer folder not found: {path} (a local folder with tokenizer files; "
                                        "the Hub is never asked)")
            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.tok = tokenizer
        self.template = chat_template or getattr(tokenizer, "chat_template", None)
        self.name = f"hf-chat:{getattr(tokenizer, 'name_or_path', type(tokenizer).__name__)}"
        if self.template is None:
            raise ValueError(f"{self.name}: the tokenizer has no chat_template; pass chat_template=...")
        self.has_generation = "generation" in self.template and "endgeneration" in self.template
        self.vocab_size = len(tokenizer)
        self.eos_id = tokenizer.eos_token_id

    def render(self, messages, *, add_generation_prompt=False, assistant_mask=True):
        if assistant_mask and not self.has_generation:
            raise ValueError(f"{self.name}: its chat template has no {{% generation %}} block, so the assistant's "
                             "tokens cannot be found; use a template that marks them, or loss_on='all'")
        out = self.tok.apply_chat_template(messages, tokenize=True, return_dict=True, chat_template=self.template,
                                           add_generation_prompt=add_generation_prompt,
                                           return_assistant_tokens_mask=assistant_mask)
        ids = list(out["input_ids"])
        return ids, list(out["assistant_masks"]) if assistant_mask else [0] * len(ids)

    def encode_text(self, text, *, end=False):
        eos = self.tok.eos_token
        if end and eos is not None and not text.endswith(eos):
            text = text + eos  # as TRL does: the completion ends in the EOS token's text
        return list(self.tok(text=text)["input_ids"])

    def __reduce__(self):
        return functools.partial(HFChat, chat_template=self.template), (self.tok,)


class MistralChat:
    """Mistral's instruct tokenizer (Tekken by default; see the module)."""

    def __init__(self, path: str | None = None) -> None:
        import mistral_common
        from mistral_common.protocol.instruct.validator import ValidationMode
        from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

        self.path = path or os.path.join(os.path.dirname(mistral_common.__file__), "data", "tekken_240911.json")
        self.mt = MistralTokenizer.from_file(self.path, mode=ValidationMode.finetuning)
        inner = self.mt.instruct_tokenizer.tokenizer
        self.name = f"mistral:{os.path.basename(self.path)}"
        self.vocab_size = inner.n_words
        self.eos_id = inner.eos_id
        self.bos_id = inner.bos_id
        self._record = threading.local()
        self._lock = threading.Lock()
        it = self.mt.instruct_tokenizer
        for kind in ("user", "assistant", "system", "tool"):
            method = getattr(it, f"encode_{kind}_message")
            setattr(it, f"encode_{kind}_message", self._recording(kind, method))

    def _recording(self, kind: str, method):
        def call(*args, **kwargs):
            out = method(*args, **kwargs)
            toks = out[0] if isinstance(out, tuple) else out
            log = getattr(self._record, "log", None)
            if log is not None:
                log.append((kind, len(toks) if toks is not None else 0))
            return out
        return call

    def render(self, messages, *, add_generation_prompt=False, assistant_mask=True):
        from mistral_common.protocol.instruct.request import ChatCompletionRequest

        if add_generation_prompt:  # a prompt alone, ending in the user's turn ([/INST]): validated as a request
            tokens = self._requests().encode_chat_completion(ChatCompletionRequest(messages=messages)).tokens
            return list(tokens), [0] * len(tokens)
        self._record.log = []
        try:
            tokens = self.mt.encode_chat_completion(ChatCompletionRequest(messages=messages)).tokens
            log = self._record.log
        finally:
            self._record.log = None
        mask = [0] * len(tokens)
        at = len(self.mt.instruct_tokenizer.start())  # <s>, then each message's tokens in order
        if at + sum(n for _, n in log) != len(tokens):
            raise RuntimeError(f"{self.name}: the message encoders gave {sum(n for _, n in log)} tokens after {at} "
                               f"start tokens, the request holds {len(tokens)}: the assistant's cannot be located")
        for kind, n in log:
            if kind == "assistant":
                mask[at : at + n] = [1] * n
            at += n
        return list(tokens), mask

    def _requests(self):
        """The same tokenizer validating as for inference (a conversation may end with the user's turn)."""
        if getattr(self, "_test_mt", None) is None:
            from mistral_common.protocol.instruct.validator import ValidationMode
            from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

            self._test_mt = MistralTokenizer.from_file(self.path, mode=ValidationMode.test)
        return self._test_mt

    def encode_text(self, text, *, end=False):
        inner = self.mt.instruct_tokenizer.tokenizer
        return list(inner.encode(text, bos=True, eos=bool(end)))

    def __reduce__(self):
        return MistralChat, (self.path,)


def chat_tokenizer(spec: Any) -> ChatTokenizer:
    """"mistral" or "tekken" (Mistral's instruct Tekken), "mistral:PATH" (a Tekken or SentencePiece file), a local
    folder of a transformers tokenizer, a transformers tokenizer object, or a ChatTokenizer as it is."""
    if isinstance(spec, (HFChat, MistralChat)):
        return spec
    if isinstance(spec, str) and spec in ("mistral", "tekken"):
        return MistralChat()
    if isinstance(spec, str) and spec.startswith("mistral:"):
        return MistralChat(spec[len("mistral:"):])
    if isinstance(spec, (str, os.PathLike)) or hasattr(spec, "apply_chat_template"):
        return HFChat(spec)
    if hasattr(spec, "render") and hasattr(spec, "encode_text"):
        return spec
    raise TypeError(f"{type(spec).__name__}: expected 'mistral', a tokenizer folder or a transformers tokenizer")


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Leading ids `a` and `b` share: where a completion starts when the prompt alone renders differently."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
