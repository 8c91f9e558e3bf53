"""Model shapes and device constants from which the analytic cost profile is derived.

The analytic profile (`analytic_profile`) turns a model shape into the per-pipeline-stage polynomials of
`contracts.CostProfile`:

* attention of a segment with q query tokens and p earlier keys does ``q*(q+1)/2 + q*p ~ (q^2 + 2*q*p)/2``
  causal (query, key) pairs; each pair costs ``4 * heads * head_dim`` FLOPs forward (Q.K^T and P.V, two
  multiply-adds of head_dim per head) and ``2.5x`` that backward (flash attention recomputes the scores and
  does five matmuls instead of two). So ``attn.a = 2 * heads * head_dim * layers_per_stage / (tp * cp) / rate``.
* attention also moves each token's rows through HBM once per pass, whatever the document's length: forward
  reads Q, K, V and writes O; backward reads Q, O, dO, K, V, reads O and dO once more for the softmax
  correction, writes dK, dV and accumulates dQ in fp32 (counted twice). ``attn.b`` is those bytes at HBM
  bandwidth: the per-document ``b*l`` that makes short documents dearer per (query, key) pair than long ones
  (about 4x at 256 tokens on a measured H100, of which this term gives about three quarters). ``attn.c``
  (a per-document latency) is 0: varlen kernels run every document of a micro-batch in one launch.
* linear work is ``2 * (linear parameters of a layer)`` FLOPs per token forward (``2x`` that backward), plus
  the memory-bound element-wise work (norms, rotary, SwiGLU, residual adds) at HBM bandwidth, plus the LM
  head spread evenly over the pipeline stages (``include_head``). ``lin.a = 0`` analytically.
* floors: a per-layer launch/latency floor for each micro-batch (``lin.c``), and the flash kernel's tile for
  short segments (a 64-token document costs what a 128-token one does): ``CostProfile.tile``.

Device constants (`devices.DeviceSpec`, the ``rates`` of a device profile file, packloader/profiles/devices/) are
*achieved* rates, not datasheet peaks; the shipped h100.json holds one H100 SXM's in bf16 (h200.json the same
with the H200's HBM3e bandwidth, 3.6 TB/s):

=====================  ==========  ===========================================================================
constant               value       where it comes from
=====================  ==========  ===========================================================================
attn_fwd_tflops        310         FlashAttention-2 varlen causal forward, head_dim 128, 8K-64K tokens (counting
                                   only the causal half's FLOPs); set so the 7B anchor below holds
attn_bwd_tflops        287         backward does 2.5x the FLOPs at a lower rate: time ratio ~2.7x
gemm_fwd_tflops        600         cuBLAS bf16 GEMMs of a 4K-8K hidden model at large token counts
gemm_bwd_tflops        571         two GEMMs per forward one (dgrad + wgrad): time ratio ~2.1x
hbm_tbps               2.6         achieved HBM3 bandwidth for element-wise kernels (3.35 TB/s peak)
layer_floor_fwd_us     15          launch + latency floor of one layer's forward at tiny token counts
layer_floor_bwd_us     30          the same for backward (about twice as many kernels)
=====================  ==========  ===========================================================================

With these the 7B preset gives the anchor: a 32K micro-batch holding one 32K document costs about
2.3x one holding 32 documents of 1K (tests/test_cost_model.py checks it), and the forward/backward ratios are
2.7x (attention) and 2.1x (GEMM).
"""

from __future__ import annotations

import msgspec

from packloader.balancers.cost.devices import DEFAULT_DEVICE, DeviceSpec, load_device
from packloader.contracts import CostProfile, ParallelConfig, Poly


class ModelShape(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """A decoder-only transformer with grouped-query attention and a SwiGLU MLP (the Llama family)."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    gated_mlp: bool = True  # SwiGLU: three FFN matrices (gate, up, down) instead of two
    head_size: int = 0  # the attention head's dimension where it is not hidden / heads (0: hidden / heads)

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden // self.heads

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    def spec(self) -> str:
        """The shape as a `PlanConfig.model` string (`get_shape` reads it back): plain text, so a config holding
        it is the same on every rank and in every DataLoader worker, and serialises with the config."""
        return (f"shape:{self.name}:hidden={self.hidden},layers={self.layers},heads={self.heads},"
                f"kv_heads={self.kv_heads},head_dim={self.head_dim},ffn={self.ffn},vocab={self.vocab},"
                f"gated_mlp={int(self.gated_mlp)}")

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def linear_params_per_layer(self) -> int:
        """Weights of the GEMMs of one layer: Q, K, V, O projections and the MLP."""
        attn = self.hidden * (self.q_dim + 2 * self.kv_dim) + self.q_dim * self.hidden
        mlp = (3 if self.gated_mlp else 2) * self.hidden * self.ffn
        return attn + mlp

    def params_per_layer(self) -> int:
        return self.linear_params_per_layer() + 2 * self.hidden  # + two RMSNorm weights

    def total_params(self) -> int:
        return self.layers * self.params_per_layer() + 2 * self.vocab * self.hidden + self.hidden

    def elementwise_bytes_per_token_per_layer(self) -> int:
        """Bytes the memory-bound kernels of one layer's forward move per token (bf16): two RMSNorms (read +
        write), rotary on Q and K, the SwiGLU product (read gate and up, write one), two residual adds."""
        h, kv, f = self.hidden, self.kv_dim, self.ffn
        norms = 2 * (2 * h) * 2
        rotary = 2 * (self.q_dim + kv) * 2
        swiglu = 3 * f * 2 if self.gated_mlp else 2 * f * 2
        residual = 2 * (3 * h) * 2
        return norms + rotary + swiglu + residual


MODEL_SHAPES: dict[str, ModelShape] = {
    s.name: s
    for s in (
        ModelShape(name="llama2-7b", hidden=4096, layers=32, heads=32, kv_heads=32, ffn=11008, vocab=32000),
        ModelShape(name="llama2-13b", hidden=5120, layers=40, heads=40, kv_heads=40, ffn=13824, vocab=32000),
        ModelShape(name="llama2-70b", hidden=8192, layers=80, heads=64, kv_heads=8, ffn=28672, vocab=32000),
        ModelShape(name="llama3-8b", hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336, vocab=128256),
        ModelShape(name="llama3-70b", hidden=8192, layers=80, heads=64, kv_heads=8, ffn=28672, vocab=128256),
        # For tests: small enough that nothing about it is expensive, same formulas.
        ModelShape(name="tiny", hidden=256, layers=4, heads=4, kv_heads=2, ffn=688, vocab=1024),
    )
}

_ALIASES = {
    "llama-2-7b": "llama2-7b", "llama7b": "llama2-7b", "llama-7b": "llama2-7b", "7b": "llama2-7b",
    "llama-2-13b": "llama2-13b", "llama-2-70b": "llama2-70b",
    "llama-3-8b": "llama3-8b", "llama3.1-8b": "llama3-8b", "llama-3.1-8b": "llama3-8b",
    "llama-3-70b": "llama3-70b", "llama3.1-70b": "llama3-70b", "llama-3.1-70b": "llama3-70b",
}


def preset_names() -> list[str]:
    return sorted(MODEL_SHAPES)


SHAPE_KEYS = ("hidden", "layers", "heads", "kv_heads", "head_dim", "ffn", "vocab", "gated_mlp")


def parse_shape_spec(text: str) -> ModelShape:
    """`ModelShape.spec()`'s string back: ``shape:NAME:hidden=...,layers=...,...`` (every key of SHAPE_KEYS)."""
    parts = text.split(":", 2)
    if len(parts) != 3:
        raise KeyError(f"model {text!r}: expected 'shape:NAME:key=value,...' with keys {', '.join(SHAPE_KEYS)}")
    values: dict[str, int] = {}
    for item in filter(None, parts[2].split(",")):
        key, sep, value = item.partition("=")
        if not sep or key.strip() not in SHAPE_KEYS or not value.strip().isdigit():
            raise KeyError(f"model {text!r}: {item!r} is not one of {', '.join(SHAPE_KEYS)} = a whole number")
        values[key.strip()] = int(value)
    missing = [k for k in SHAPE_KEYS if k not in values]
    low = [k for k in SHAPE_KEYS[:-1] if values.get(k, 1) < 1] + (["gated_mlp"] if values.get("gated_mlp", 0) > 1 else [])
    if missing or low:
        raise KeyError(f"model {text!r}: needs {', '.join(SHAPE_KEYS[:-1])} (each >= 1) and gated_mlp (0 or 1); "
                       f"missing: {', '.join(missing) or 'none'}; out of range: {', '.join(low) or 'none'}")
    return ModelShape(name=parts[1] or "model", hidden=values["hidden"], layers=values["layers"],
                      heads=values["heads"], kv_heads=values["kv_heads"], ffn=values["ffn"], vocab=values["vocab"],
                      gated_mlp=bool(values["gated_mlp"]), head_size=values["head_dim"])


def get_shape(name: str) -> ModelShape:
    if name.startswith("shape:"):
        return parse_shape_spec(name)
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    if key not in MODEL_SHAPES:
        raise KeyError(f"unknown model preset {name!r}; expected one of {preset_names()} or a profile JSON path")
    return MODEL_SHAPES[key]


def layers_per_stage(shape: ModelShape, parallel: ParallelConfig) -> float:
    """Layers one pipeline stage runs (fractional when pp does not divide the layer count: the mean)."""
    return shape.layers / parallel.pp


def analytic_profile(
    shape: ModelShape,
    parallel: ParallelConfig | None = None,
    device: DeviceSpec | None = None,
    *,
    include_head: bool = True,
    layers: float | None = None,
    memory_cap: int | None = None,
    head_fraction: float | None = None,
) -> CostProfile:
    """Per-pipeline-stage cost polynomials (seconds) of `shape` on `device` under `parallel`.

    Attention and GEMM work are divided by tp * cp (ideal sharding; the per-layer floor is not). `layers`
    overrides the layers per stage (e.g. 1 for a one-layer profile); `include_head` spreads the LM head's
    GEMM evenly over the stages (it runs on the last one; the mean keeps every stage's time equal, which is
    what the per-micro-batch balance needs); `head_fraction` puts that share of it on this stage instead.
    `device`: the rates of a device profile (default: the default device's).
    """
    parallel = parallel or ParallelConfig()
    device = device or load_device(DEFAULT_DEVICE).rates
    L = layers_per_stage(shape, parallel) if layers is None else float(layers)
    shard = parallel.tp * parallel.cp
    # attention: pairs = (q^2 + 2qp)/2, 4*heads*head_dim FLOPs per pair forward
    attn_flops_per_unit = 0.5 * 4.0 * shape.heads * shape.head_dim * L / shard
    a_fwd = attn_flops_per_unit / (device.attn_fwd_tflops * 1e12)
    a_bwd = attn_flops_per_unit * device.attn_bwd_flops_ratio / (device.attn_bwd_tflops * 1e12)
    # per token: the rows each pass reads and writes once (bf16; dQ accumulated in fp32)
    qd, kvd = shape.heads * shape.head_dim, shape.kv_dim
    bytes_fwd = 2 * (2 * qd + 2 * kvd)  # Q, K, V read, O written
    bytes_bwd = 2 * (5 * qd + 4 * kvd + 2 * qd)  # Q, O, dO, O, dO read (qd x5), K, V read + dK, dV written, dQ fp32
    b_attn_fwd = bytes_fwd * L / shard / (device.hbm_tbps * 1e12)
    b_attn_bwd = bytes_bwd * L / shard / (device.hbm_tbps * 1e12)
    # linear: 2 FLOPs per weight per token forward, 4 backward
    lin_params = shape.linear_params_per_layer() * L
    if head_fraction is not None:
        lin_params += shape.vocab * shape.hidden * head_fraction
    elif include_head:
        lin_params += shape.vocab * shape.hidden / parallel.pp
    gemm_flops = 2.0 * lin_params / shard
    ew_bytes = shape.elementwise_bytes_per_token_per_layer() * L / shard
    b_fwd = gemm_flops / (device.gemm_fwd_tflops * 1e12) + ew_bytes / (device.hbm_tbps * 1e12)
    b_bwd = 2.0 * gemm_flops / (device.gemm_bwd_tflops * 1e12) + 2.0 * ew_bytes / (device.hbm_tbps * 1e12)
    c_fwd = device.layer_floor_fwd_us * 1e-6 * L
    c_bwd = device.layer_floor_bwd_us * 1e-6 * L
    par = f"tp{parallel.tp}-cp{parallel.cp}-pp{parallel.pp}"
    return CostProfile(
        name=f"{shape.name}@{device.name}/{par}",
        tile=device.tile,
        attn_fwd=Poly(a_fwd, b_attn_fwd, 0.0),
        attn_bwd=Poly(a_bwd, b_attn_bwd, 0.0),
        lin_fwd=Poly(0.0, b_fwd, c_fwd),
        lin_bwd=Poly(0.0, b_bwd, c_bwd),
        device="analytic:" + device.name,
        memory_cap=memory_cap,
    )


def stage_layers(shape: ModelShape, pp: int) -> list[int]:
    """Layers of each pipeline stage when pp does not divide the layer count: the first stages take one more."""
    base, extra = divmod(shape.layers, pp)
    return [base + (1 if s < extra else 0) for s in range(pp)]


def analytic_stage_profiles(shape: ModelShape, parallel: ParallelConfig | None = None,
                            device: DeviceSpec | None = None) -> list[CostProfile]:
    """One profile per pipeline stage: its own layer count, the LM head on the last stage (for
    `simulator.simulate_rank(stage_models=...)`, where stage times differ)."""
    parallel = parallel or ParallelConfig()
    out = []
    for s, n in enumerate(stage_layers(shape, parallel.pp)):
        head = 1.0 if s == parallel.pp - 1 else 0.0
        pr = analytic_profile(shape, parallel, device, layers=n, head_fraction=head)
        out.append(msgspec.structs.replace(pr, name=f"{pr.name}/stage{s}"))
    return out
