"""Megatron-core adapter against the real megatron-core package (CPU): the batch types Megatron's THD path uses,
megatron's own packed-sequence utilities run on packloader batches (per-sequence label roll, THD RoPE frequency
selection per CP rank), and per-token loss through megatron's `forward_step_calc_loss` against an unpacked
reference."""

from __future__ import annotations

import subprocess
import sys
from functools import partial

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core")

from packloader.contracts import PlanConfig  # noqa: E402
from packloader.loader.loader import PackedLoader  # noqa: E402
from packloader.sources.base import IterableSource  # noqa: E402
from packloader_integrations import megatron as pm  # noqa: E402

VOCAB = 97


def docs(n=60, seed=0, max_len=150):
    rng = np.random.default_rng(seed)
    lengths = np.minimum(rng.pareto(1.1, size=n) * 25 + 2, max_len).astype(int)
    return [rng.integers(0, VOCAB, size=int(k)).astype(np.int32) for k in lengths]


def loader(ds, *, strategy="fixed", context=256, **kw):
    cfg = PlanConfig(strategy=strategy, max_tokens=256, context=context, tokens_per_step=768, allow_slicing=False)
    return PackedLoader(IterableSource(ds), config=cfg, num_threads=0, append_eos=False, **kw)


@pytest.fixture(scope="module")
def corpus():
    return docs()


@pytest.fixture(scope="module")
def batches(corpus):
    return list(loader(corpus))


def test_batch_types_shapes_and_dtypes_are_megatron_thd(batches):
    from megatron.core.packed_seq_params import PackedSeqParams

    for b in batches[:6]:
        d = pm.megatron_batch(b)
        n = b.num_tokens
        for k in ("tokens", "labels", "position_ids"):
            assert d[k].shape == (1, n) and d[k].dtype == torch.int64, k
        assert d["loss_mask"].shape == (1, n) and d["loss_mask"].dtype == torch.float32
        assert d["attention_mask"] is None
        p = d["packed_seq_params"]
        assert isinstance(p, PackedSeqParams) and p.qkv_format == "thd"
        for name in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
            t = getattr(p, name)
            assert t.dtype == torch.int32 and t.dim() == 1 and int(t[0]) == 0 and int(t[-1]) == n, name
        assert type(p.max_seqlen_q) is int and type(p.max_seqlen_kv) is int
        seqlens = torch.diff(p.cu_seqlens_q)
        assert p.max_seqlen_q == int(seqlens.max())
        # labels are valid vocabulary indices everywhere (megatron's cross-entropy gathers every one)
        assert int(d["labels"].min()) >= 0


def test_megatron_packed_roll_reproduces_labels_and_loss_mask(batches, corpus):
    """megatron's own `roll_tensor(..., packed_seq_params=...)` (per-sequence next-token shift, 0 at each sequence
    end) applied to the tokens gives the labels and, where it zero-fills, the loss mask."""
    from megatron.core.transformer.multi_token_prediction import roll_tensor

    for b in batches:
        d = pm.megatron_batch(b)
        rolled, _ = roll_tensor(d["tokens"], shifts=-1, dims=-1, packed_seq_params=d["packed_seq_params"])
        assert torch.equal(rolled, d["labels"])
        cu = d["packed_seq_params"].cu_seqlens_q.long()
        ends = cu[1:] - 1
        expected_mask = torch.ones(b.num_tokens)
        expected_mask[ends] = 0  # whole documents here (context > longest): last token predicts nothing
        assert torch.equal(d["loss_mask"][0], expected_mask)


def _megatron_rope_positions(cu_padded: torch.Tensor, cp_size: int, cp_rank: int, max_len: int) -> torch.Tensor:
    """The positions megatron's THD RoPE gives each local token of a CP rank (its frequency selection, run on a
    frequency table that holds the position itself)."""
    from megatron.core.models.common.embeddings.rope_utils import _get_thd_freqs_on_this_cp_rank

    freqs = torch.arange(max_len, dtype=torch.float64).view(-1, 1, 1, 1)
    seqlens = (torch.diff(cu_padded) // cp_size).tolist()
    x = torch.zeros(sum(seqlens), 1, 1)
    parts = [_get_thd_freqs_on_this_cp_rank(cp_rank, cp_size, xs, freqs) for xs in torch.split(x, seqlens)]
    return torch.cat(parts).view(-1).long()


@pytest.mark.parametrize("cp_size,context", [(1, 256), (2, 256), (2, 64)])
def test_te_layout_matches_megatron_thd_rope_per_cp_rank(corpus, cp_size, context):
    """The "te" CP layout (padded to 2 x CP) gives each rank the tokens whose positions megatron's THD RoPE assumes,
    and together the ranks hold every token once. Context 64 cuts long documents into pieces, which restart at
    position 0 as megatron's RoPE (from cu_seqlens) assumes for every segment."""
    m = 2 * cp_size
    batches = list(loader(corpus, pad_to_multiple=m, context=context))[:5]
    assert context == 256 or any(s.start > 0 for b in batches for s in b.segments)
    for b in batches:
        seen = []
        for r in range(cp_size):
            d = pm.megatron_batch(b, cp_size=cp_size, cp_rank=r, cp_layout="te")
            p = d["packed_seq_params"]
            assert torch.equal(p.cu_seqlens_q_padded, b.cu_seqlens_padded)
            pos = _megatron_rope_positions(p.cu_seqlens_q_padded, cp_size, r, 4096)
            assert torch.equal(d["position_ids"][0], pos)
            seen.append(d["tokens"][0])
        assert sum(t.numel() for t in seen) == b.num_tokens


def test_te_layout_refuses_unpadded_segments(batches):
    b = next(x for x in batches if any((s.end - s.start) % 4 for s in x.segments))
    with pytest.raises(ValueError, match="pad_to_multiple=4"):
        pm.megatron_batch(b, cp_size=2, cp_rank=0, cp_layout="te")
    with pytest.raises(ValueError, match="not a multiple of 2 x CP = 4"):
        pm.te_partition_index(torch.tensor([0, 6, 10], dtype=torch.int32), 2, 0)


def _per_token_losses(table: torch.Tensor, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A 'model' whose logits are a fixed table row per input token: per-token CE, shape [1, n] like GPTModel's."""
    return torch.nn.functional.cross_entropy(table[tokens[0]], labels[0], reduction="none").unsqueeze(0)


@pytest.mark.parametrize("cp_size,context", [(1, 256), (2, 256), (3, 256), (1, 40), (2, 40)])
def test_per_token_loss_through_megatron_forward_step_calc_loss(corpus, cp_size, context):
    """Sum of megatron's per-micro-batch loss over the step (all micro-batches, all CP ranks) / its token count
    equals the mean next-token loss over the documents computed unpacked, one document at a time. At context 40
    long documents are cut into pieces: a piece's last token predicts the next piece's first, so the loss tokens
    are still every document's length - 1, and the steps' loss_tokens_in_step add up to them."""
    from megatron.core.pipeline_parallel.schedules import forward_step_calc_loss
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, calculate_per_token_loss=True)
    table = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(1))
    ref_sum = sum(float(torch.nn.functional.cross_entropy(table[torch.from_numpy(x[:-1]).long()],
                                                          torch.from_numpy(x[1:]).long(), reduction="sum"))
                  for x in corpus)
    ref_tokens = sum(len(x) - 1 for x in corpus)

    total_loss, total_tokens, step_tokens = 0.0, 0, {}
    for b in loader(corpus, context=context):
        step_tokens[b.step] = b.loss_tokens_in_step
        for r in range(cp_size):
            d = pm.megatron_batch(b, cp_size=cp_size, cp_rank=r)
            out = _per_token_losses(table, d["tokens"], d["labels"])
            store: list = []
            loss, num = forward_step_calc_loss(torch.nn.Identity(), out, partial(pm.loss_func, d["loss_mask"]), cfg,
                                               None, False, b.micro_batches_in_step, store, cp_group_size=cp_size,
                                               is_last_stage=True)
            total_loss += float(loss)
            total_tokens += int(num)
            assert store and store[0]["lm loss"].shape == (2,)
    assert total_tokens == ref_tokens == sum(step_tokens.values())
    assert total_loss / total_tokens == pytest.approx(ref_sum / ref_tokens, rel=1e-5)


def test_packloader_cp_layout_metadata(batches):
    """CP shards need no padding: ranks' tokens partition the micro-batch, cu_seqlens_q counts local tokens, and
    the shard travels with PackedSeqParams for packloader's CP attention."""
    for b in batches[:5]:
        idx = []
        for r in range(2):
            d = pm.megatron_batch(b, cp_size=2, cp_rank=r)
            p = d["packed_seq_params"]
            assert int(p.cu_seqlens_q[-1]) == d["tokens"].shape[1]
            assert p.packloader_shard is d["cp_shard"]
            ids = torch.from_numpy(d["cp_shard"].token_index)
            assert torch.equal(d["tokens"][0], b.input_ids[ids])
            idx.append(ids)
        assert torch.equal(torch.sort(torch.cat(idx)).values, torch.arange(b.num_tokens))


def test_iterator_provider_and_config_checks(corpus):
    from megatron.core.model_parallel_config import ModelParallelConfig

    provider = pm.make_datasets_provider(lambda dp, split: loader(corpus) if split == "train" else None)
    assert provider.is_distributed
    train, valid, test = provider([100, 0, 0])
    assert valid is None and test is None
    t, lab, mask, am, pos, params = pm.get_batch(train)
    assert t.shape == lab.shape == mask.shape == pos.shape and am is None and params.qkv_format == "thd"
    assert pm.get_batch(None) == (None,) * 6

    it = pm.MegatronDataIterator(loader(corpus), num_microbatches=99)
    with pytest.raises(ValueError, match="num_micro_batches=99"):
        next(it)

    with pytest.raises(ValueError, match="variable_seq_lengths=True"):
        pm.check_megatron_config(ModelParallelConfig(pipeline_model_parallel_size=2, pipeline_dtype=torch.float32))
    pm.check_megatron_config(ModelParallelConfig(pipeline_model_parallel_size=2, pipeline_dtype=torch.float32,
                                                 variable_seq_lengths=True))


def test_variable_seq_lengths_needs_the_alltoall_dispatcher_and_the_check_says_so():
    """megatron-core's own TransformerConfig refuses variable_seq_lengths with its default dispatcher, in a model
    without MoE; check_megatron_config names the dispatcher in its PP message and refuses a config that reached it
    with 'allgather' (a field set after construction escapes megatron's own check)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    common = dict(num_layers=2, hidden_size=16, num_attention_heads=2, pipeline_model_parallel_size=2,
                  pipeline_dtype=torch.float32, calculate_per_token_loss=True)
    with pytest.raises(ValueError, match="allgather does not support variable sequence length"):
        TransformerConfig(variable_seq_lengths=True, **common)
    ok = TransformerConfig(variable_seq_lengths=True, moe_token_dispatcher_type="alltoall", **common)
    pm.check_megatron_config(ok)
    without = TransformerConfig(**common)
    with pytest.raises(ValueError, match="variable_seq_lengths=True and, in a TransformerConfig, "
                                         "moe_token_dispatcher_type='alltoall'"):
        pm.check_megatron_config(without)
    without.variable_seq_lengths = True  # set after __post_init__: megatron's check never ran
    with pytest.raises(ValueError, match="moe_token_dispatcher_type='allgather'.*'alltoall'"):
        pm.check_megatron_config(without)


@pytest.mark.multiprocess
def test_adapters_import_lazily_and_name_the_extra():
    code = (
        "import sys\n"
        "import packloader_integrations.hf, packloader_integrations.megatron, packloader_integrations.deepspeed\n"
        "assert not any(m.split('.')[0] in ('megatron', 'deepspeed', 'transformers') for m in sys.modules), "
        "sorted(m for m in sys.modules if m.split('.')[0] in ('megatron', 'deepspeed', 'transformers'))\n"
        "sys.modules['megatron.core.packed_seq_params'] = None\n"
        "import torch\n"
        "from packloader_integrations._lazy import MissingExtraError\n"
        "try:\n"
        "    packloader_integrations.megatron.batch._packed_seq_params_cls()\n"
        "except MissingExtraError as e:\n"
        "    assert \"packloader[megatron]\" in str(e), str(e)\n"
        "    print('OK')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-2000:]


@pytest.mark.parametrize("cp_size,cp_layout", [(1, "packloader"), (2, "packloader"), (3, "packloader"), (2, "te")])
def test_an_empty_micro_batch_runs_as_a_placeholder_without_loss(cp_size, cp_layout):
    """An empty slot (a DP rank with fewer pieces than the fullest one) becomes 2 x CP padding tokens with loss mask
    0: every CP rank gets tokens to run, and megatron's loss over it is 0 with 0 tokens."""
    from megatron.core.pipeline_parallel.schedules import forward_step_calc_loss
    from megatron.core.transformer.transformer_config import TransformerConfig

    from packloader.collate.collate import collate, collate_padded

    empty = collate([], {}, loss_tokens_in_step=11) if cp_layout == "packloader" else collate_padded(
        [], {}, pad_to_multiple=2 * cp_size)
    assert empty.num_tokens == 0
    cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, calculate_per_token_loss=True)
    table = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(1))
    held = 0
    for r in range(cp_size):
        d = pm.megatron_batch(empty, cp_size=cp_size, cp_rank=r, cp_layout=cp_layout)
        n = d["tokens"].shape[1]
        assert n >= 1 and float(d["loss_mask"].sum()) == 0.0
        # the packloader layout describes this rank's tokens, the te layout the whole (global) row
        assert int(d["packed_seq_params"].cu_seqlens_q[-1]) == (n if cp_layout == "packloader" else 2 * cp_size)
        held += n
        out = _per_token_losses(table, d["tokens"], d["labels"])
        loss, num = forward_step_calc_loss(torch.nn.Identity(), out, partial(pm.loss_func, d["loss_mask"]), cfg,
                                           None, False, 1, [], cp_group_size=cp_size, is_last_stage=True)
        assert float(loss) == 0.0 and int(num) == 0
    assert held == 2 * cp_size
