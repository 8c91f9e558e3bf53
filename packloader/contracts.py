"""The structs that cross module boundaries: configs, plans, planner state and cost profiles.

Everything here is a msgspec Struct so that it validates on the way in (clear errors naming the field) and
serialises to JSON Lines or msgpack on the way out (plans can be inspected, diffed and replayed).
Tensors never live here: the collated batch is in `packloader.collate.batch`.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

import msgspec

PosInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0.0)]

# Upper bounds of the config's numbers: far beyond any real run, low enough that a plan over them fits in memory
# (a plan of millions of ranks or stages, or token counts past 2^40, is refused rather than attempted).
TOKENS_MAX = 1 << 40
DP_MAX = 1 << 17
DEGREE_MAX = 1 << 10  # pipeline, context and tensor parallel degrees
VPP_MAX = 64
MICRO_BATCHES_MAX = 1 << 16
SEED_MAX = 2**63 - 1
TokenCount = Annotated[int, msgspec.Meta(ge=1, le=TOKENS_MAX)]
Degree = Annotated[int, msgspec.Meta(ge=1, le=DEGREE_MAX)]


class Segment(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Tokens `start..end-1` of document `doc`, each attending causally from `attend_from` up to itself.

    `attend_from == start` for a whole document or an independent context-window piece; `attend_from < start`
    for a SlimPack slice, which needs the keys and values of its document's earlier slices (same step, same
    DP rank, earlier micro-batch).
    """

    doc: int
    start: int
    end: int
    attend_from: int

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


class CPPlacement(msgspec.Struct, frozen=True, array_like=True):
    """Where one segment of a per-document-CP micro-batch runs: on GPUs `first .. first + size - 1` of its
    DP x CP pool, `size` a power of two and `first` a multiple of it (aligned subgroups, as megatron-core's hybrid
    context parallelism forms them). The segment's shard on pool GPU g is `g - first` of `size`."""

    size: int
    first: int


class MicroBatch(msgspec.Struct, kw_only=True):
    """One forward/backward unit on one DP rank (or on a DP-Merge group of ranks)."""

    segments: list[Segment]
    fwd_cost: float = 0.0
    bwd_cost: float = 0.0
    # DP-Merge (SlimPack): the DP ranks that run this micro-batch together as context parallelism. None means
    # the micro-batch belongs to the rank whose list holds it.
    dp_group: list[int] | None = None
    # Per-document context parallelism (StepPlan.cp_mode == "dynamic"): one placement per segment, aligned with
    # `segments`. None for fixed CP, where every segment is sharded over the rank's whole CP group.
    cp: list[CPPlacement] | None = None

    @property
    def num_tokens(self) -> int:
        return sum(s.end - s.start for s in self.segments)


class RankPlan(msgspec.Struct, kw_only=True):
    micro_batches: list[MicroBatch]
    # SlimPack asymmetric partitioning: the order in which the backward pass should visit micro-batches (a
    # permutation of range(len(micro_batches))) when it differs from reverse forward order; None = default.
    backward_order: list[int] | None = None


class StepPlan(msgspec.Struct, kw_only=True):
    """What every rank agrees to do in one optimizer step."""

    step: int
    ranks: list[RankPlan]
    # Documents drawn for this step but held back for a later one (outlier delay), by doc id.
    delayed: list[int] = []
    # Tokens that carry a loss target in this global step (all ranks, all micro-batches): the per-token loss
    # normaliser. Filled by the loader (it knows document boundaries); planners may leave 0.
    loss_tokens: int = 0
    # The planner whose packing this is (for `auto`, the candidate it chose).
    planner: str = ""
    # Simulated peak memory of one GPU over the device's usable limit (> 1) when no candidate fit; 0 otherwise.
    memory_over: float = 0.0
    # The pipeline schedule the planner chose for this step under PlanConfig.schedule "auto" ("" otherwise:
    # the configured one); the simulator, scores and action lists follow it.
    schedule: str = ""
    # "fixed": `ranks` holds one RankPlan per DP rank, each sharded over its whole CP group. "dynamic" (per-document
    # CP): `ranks` holds one RankPlan per GPU of the DP x CP pool (index dp_rank * cp + cp_rank); micro-batch m of
    # every pool GPU runs in the same slot, and a segment placed on `size` GPUs appears, with the same placement,
    # in micro-batch m of each of them.
    cp_mode: Literal["fixed", "dynamic"] = "fixed"
    extra: dict[str, float] = {}  # for planners registered from outside; packloader's own leave it empty


class QueuedDoc(msgspec.Struct, frozen=True, array_like=True):
    """A document (or the context-window piece of one starting at `offset`) held back for a later step."""

    doc: int
    offset: int
    length: int
    drawn_step: int


class PlannerState(msgspec.Struct, kw_only=True):
    """Everything a planner carries from one step to the next; saved in the loader's state_dict."""

    queued: list[QueuedDoc] = []
    extra: dict[str, list[int]] = {}


class ParallelConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    dp: Annotated[int, msgspec.Meta(ge=1, le=DP_MAX)] = 1
    pp: Degree = 1
    cp: Degree = 1
    tp: Degree = 1
    vpp: Annotated[int, msgspec.Meta(ge=1, le=VPP_MAX)] = 1  # virtual pipeline stages per rank (interleaved 1F1B)


DeviceName = Annotated[str, msgspec.Meta(min_length=1)]  # a device profile name (balancers.cost.devices.load_device)
Strategy = Annotated[str, msgspec.Meta(min_length=1)]  # a name in the planner registry (available_strategies())
# a name in the schedule registry (balancers.cost.schedules: 1f1b, gpipe, interleaved, zb-h1, zb-v and any registered
# later) or "auto" (`auto` picks, schedule_choice); validate_config refuses an unregistered one, naming it
Schedule = str


class PlanConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """How to turn a window of document lengths into a StepPlan."""

    strategy: Strategy = "auto"
    parallel: ParallelConfig = ParallelConfig()
    max_tokens: TokenCount = 8192  # tokens one micro-batch may hold (per DP rank, before CP sharding)
    context: TokenCount = 8192  # documents longer than this are cut into independent pieces
    tokens_per_step: TokenCount = 65536  # global tokens drawn per optimizer step, all DP ranks together
    num_micro_batches: Annotated[int, msgspec.Meta(ge=1, le=MICRO_BATCHES_MAX)] | None = None  # per DP rank; None lets the planner choose
    allow_slicing: bool = True  # only where the runtime that runs the plan supports slices
    schedule: Schedule = "1f1b"
    model: str = "llama3-8b"  # a preset name or a calibration profile path
    # The GPU the plan is for: a device profile name (packloader/profiles/devices/: h100, h200; more from
    # PACKLOADER_DEVICE_PATH or register_device). A preset is priced with the device's measured profile scaled
    # to it where the device file names one (h100), else with the analytic model, unless `model` is a profile path.
    device: DeviceName = "h100"
    # "measured": the shipped H100 timings (packloader/profiles/); "analytic": the FLOP-rate model of presets.py.
    cost: Literal["measured", "analytic"] = "measured"
    seed: Annotated[int, msgspec.Meta(ge=0, le=SEED_MAX)] = 0
    # GPU memory the memory check allows, in GiB; None = the device file's (80 GiB h100, 141 GiB h200)
    memory_gib: Annotated[float, msgspec.Meta(gt=0.0)] | None = None
    # options per planner name, each checked against that planner's options Struct (its registry entry); `auto`
    # passes each candidate its own
    planner_options: dict[str, dict[str, Any]] = {}
    # Context parallelism per document (issue 26): "fixed" shards every micro-batch over the whole CP group;
    # "dynamic" plans every document on its own power-of-two subgroup of the DP x CP pool (the "dynamic-cp"
    # planner, StepPlan.cp_mode "dynamic"); "auto" plans both when cp > 1 and keeps the faster on simulated
    # step time. The runtime that runs the plan must accept dynamic plans for anything but "fixed".
    cp_mode: Literal["fixed", "dynamic", "auto"] = "fixed"


class ConfigError(ValueError):
    """A PlanConfig refused: the message says what is expected; `fields` names the PlanConfig fields involved
    (`parallel.dp` for a nested one), so a CLI can name its flags."""

    def __init__(self, message: str, *, fields: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.fields = fields


def check_plan_config(config: PlanConfig) -> None:
    """The rules between PlanConfig fields that a run needs (msgspec checks each field alone), as a ValueError
    naming the fields and what is expected. Not in `__post_init__`: planners derive sub-configs (e.g. `auto`'s
    non-slicing candidates) that break these rules and never see an over-long piece. The rules that depend on
    the planner (a known strategy, one that slices when context > max_tokens) are the planner registry's
    (`balancers.planners.registry.check_strategy`); `balancers.planners.config_rules.validate_config` applies
    them all."""
    if config.tokens_per_step < config.max_tokens:
        raise ConfigError(
            f"PlanConfig.tokens_per_step={config.tokens_per_step} is below max_tokens={config.max_tokens}: expected "
            "tokens_per_step >= max_tokens (a step draws at least one full micro-batch of tokens)",
            fields=("tokens_per_step", "max_tokens"),
        )
    if config.schedule == "zb-v" and config.parallel.vpp != 2:
        raise ConfigError(
            f"PlanConfig.schedule='zb-v' with parallel.vpp={config.parallel.vpp}: expected vpp=2 (ZB-V places two "
            "model chunks on each pipeline rank, as a V)", fields=("schedule", "parallel.vpp"))


class Poly(msgspec.Struct, frozen=True, array_like=True):
    """time = a*x^2 + b*x + c, in seconds. Each coefficient >= 0 and finite: a negative one prices some token
    counts below zero, which the planners take for free work and the simulator for a deadlock."""

    a: NonNegFloat = 0.0
    b: NonNegFloat = 0.0
    c: NonNegFloat = 0.0

    def __post_init__(self) -> None:
        if not all(map(math.isfinite, (self.a, self.b, self.c))):
            raise ValueError(f"expected finite coefficients, got [{self.a}, {self.b}, {self.c}]")


class LinTable(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Measured linear-part time of a micro-batch at a few token counts (seconds, ascending `tokens`).

    lin(n) is the first time for n up to the first count (the per-micro-batch floor: small GEMMs are bound by
    reading the weights, not by tokens), linear between counts, and the last count's per-token rate beyond it.
    Measured GEMM times are not smooth in n (cuBLAS picks a different kernel per shape), which no per-token
    rate plus floor matches within a few percent; the table does, and stays per-token-plus-floor in spirit.
    """

    tokens: list[float]
    fwd: list[NonNegFloat]
    bwd: list[NonNegFloat]

    def __post_init__(self) -> None:
        k = len(self.tokens)
        if not 1 <= k <= MAX_LIN_KNOTS or len(self.fwd) != k or len(self.bwd) != k:
            raise ValueError(f"lin_table: 1..{MAX_LIN_KNOTS} token counts with one fwd and one bwd time each, got "
                             f"{k}, {len(self.fwd)}, {len(self.bwd)}")
        if any(b <= a for a, b in zip(self.tokens, self.tokens[1:])) or self.tokens[0] <= 0:
            raise ValueError(f"lin_table.tokens must be positive and strictly increasing, got {self.tokens}")
        if not all(0 <= t < math.inf for t in (*self.fwd, *self.bwd)):
            raise ValueError(f"lin_table times must be >= 0 and finite, got fwd {self.fwd}, bwd {self.bwd}")


MAX_LIN_KNOTS = 16


class SliceCoeffs(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """A measured slice term (`packloader calibrate --slices`): a segment of q query tokens after p > 0 earlier
    keys costs attn(q, 0) + x*2*qs*p + y*p per pass, qs = q rounded up to `tile`, instead of the rule's q*p
    extra pairs at the document's own per-pair rate. x: seconds per extra (query, key) pair (counted as 2*qs*p
    like a); y: seconds per earlier key read, whatever q (a short slice still reads, and in the runtime
    assembles, every earlier key)."""

    tile: PosInt = 1
    x_fwd: NonNegFloat
    y_fwd: NonNegFloat
    x_bwd: NonNegFloat
    y_bwd: NonNegFloat

    def scaled(self, factor: float) -> "SliceCoeffs":
        """The same term `factor` times slower (more layers, a slower device, 1/g of a CP group)."""
        return msgspec.structs.replace(self, x_fwd=self.x_fwd * factor, y_fwd=self.y_fwd * factor,
                                       x_bwd=self.x_bwd * factor, y_bwd=self.y_bwd * factor)


class CostProfile(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Per-pipeline-stage time of a micro-batch, forward and backward separately.

    Attention of a segment with q query tokens and p earlier keys (p = start - attend_from), q rounded up to
    the kernel's tile: attn(q, p) = a*(q^2 + 2*q*p) + b*q + c. For p = 0 this is a*l^2 + b*l + c per document
    (Hydraulis' form: b and c carry what short documents cost beyond their (query, key) pairs); a slice's q*p
    extra pairs cost the same per pair as the document's own (2a per pair, as l^2/2 pairs cost a*l^2), unless
    `slice_term` holds a measured price of slices (`SliceCoeffs`).
    Linear part of a micro-batch of n tokens: lin(n) = a*n^2 + b*n + c, whose c is the per-micro-batch floor,
    or `lin_table` where one was measured (the polynomials then summarise it for the planners' per-document
    workload: their b is the per-token rate, c the floor). A micro-batch's time is the sum of its segments'
    attention plus lin(n). As flat float64 for numba: COEFF_LAYOUT below.
    """

    name: str
    tile: PosInt = 128
    attn_fwd: Poly
    attn_bwd: Poly
    lin_fwd: Poly
    lin_bwd: Poly
    device: str = "analytic"
    # Most tokens a micro-batch may hold on one rank given memory (Hydraulis MaxLen); None = no memory cap known.
    # Named memory_cap in code; the JSON key stays "max_tokens" so profiles written before still load.
    memory_cap: PosInt | None = msgspec.field(default=None, name="max_tokens")
    fit_error: dict[str, float] = {}
    lin_table: LinTable | None = None
    # Where the numbers come from (measurement, scaling applied), for reports.
    source: str = ""
    # Measured price of slices (segments with p > 0); None: the rule above (q*p pairs at 2a each).
    slice_term: SliceCoeffs | None = None
    # The fixed-CP group size whose K/V all-gather the linear part already carries (`cost.cp_price`); 1: none.
    cp_traffic: PosInt = 1


COEFF_LAYOUT = (
    "tile",
    "attn_fwd.a", "attn_fwd.b", "attn_fwd.c",
    "attn_bwd.a", "attn_bwd.b", "attn_bwd.c",
    "lin_fwd.a", "lin_fwd.b", "lin_fwd.c",
    "lin_bwd.a", "lin_bwd.b", "lin_bwd.c",
    "lin_table.knots",
    *(f"lin_table.tokens[{i}]" for i in range(MAX_LIN_KNOTS)),
    *(f"lin_table.fwd[{i}]" for i in range(MAX_LIN_KNOTS)),
    *(f"lin_table.bwd[{i}]" for i in range(MAX_LIN_KNOTS)),
    "slice_term.tile",  # 0: no term (the rule)
    "slice_term.x_fwd", "slice_term.y_fwd", "slice_term.x_bwd", "slice_term.y_bwd",
)


def plan_encoder() -> msgspec.json.Encoder:
    return msgspec.json.Encoder()


def decode_step_plan(line: bytes | str) -> StepPlan:
    return msgspec.json.decode(line, type=StepPlan)


class LoaderStats(msgspec.Struct, kw_only=True):
    """Counts up to and including one step (cumulative since the start of training, carried in the state).

    Documents longer than PlanConfig.context are cut into independent pieces, never dropped: `split_documents`
    counts them and `split_pieces` the pieces they became. `empty_documents` counts documents with no tokens
    (nothing to train on; skipped).
    """

    steps: int = 0
    epochs_completed: int = 0
    documents: int = 0  # documents drawn (all ranks' plans together)
    tokens: int = 0  # tokens drawn
    split_documents: int = 0
    split_pieces: int = 0
    empty_documents: int = 0
    # pieces held back for a later step, counted once per step held: by a planner (outlier delay), or the rest of
    # a document a step ended inside (a step holds tokens_per_step within one piece)
    delayed_pieces: int = 0
    rank_micro_batches: int = 0  # this rank's micro-batches
    rank_tokens: int = 0  # tokens in this rank's micro-batches
    # SFT sources (`sources.sft`), counted when a document is first drawn: rows their policy emptied (also counted
    # in empty_documents) because they had no loss token or were longer than the context, and documents that
    # train with no loss token (on_no_loss="keep": priced and run, adding nothing to the loss)
    dropped_no_loss: int = 0
    dropped_too_long: int = 0
    no_loss_documents: int = 0

    def copy(self) -> "LoaderStats":
        return msgspec.structs.replace(self)


class StepMetrics(msgspec.Struct, kw_only=True, frozen=True):
    """What the loader knows about one optimizer step, for the trainer's logs (`PackedBatch.step_metrics`, the
    same record on every micro-batch of the step, every rank computing the same one).

    Times are the cost model's predictions (`cost_model` names it), not measurements: a team compares them with
    its measured step times to see whether the plans it trains are priced right. Balance measures as in
    `balancers.sim.metrics` (1.0 = perfectly even); token counts cover all ranks of the step.
    """

    step: int
    epoch: int
    planner: str  # the planner whose packing this is (auto: the candidate it chose)
    micro_batches: int  # per DP rank (the fullest rank)
    step_time: float  # predicted seconds: the slowest DP rank's simulated pipeline time, bubbles included
    bound_time: float  # predicted seconds at perfect balance with this many micro-batches
    imbalance: float  # imbalance degree (max micro-batch cost x micro-batches / total) of the worst rank
    dp_spread: float  # slowest DP rank's simulated time / the mean rank's
    bubble_share: float  # idle share of all DP x PP GPUs over the step
    tokens: int  # tokens trained in this step
    loss_tokens: int  # of which carry a loss target (the per-token normaliser)
    padding_tokens: int  # padding the collated micro-batches carry (pad_to_multiple / pad_to_tokens); 0 without
    queued_tokens: int  # tokens the planner holds back for later steps after this one (outlier delay)
    # tokens trained in this step whose document was first drawn in an earlier one: pieces the planner held back,
    # and the rest of a long document that a step ended inside (it follows in the next steps in order;
    # LoaderStats.delayed_pieces counts those pieces); the delay of `packloader plan`, step by step
    delayed_tokens: int
    delay_mean: float  # mean delay in steps over this step's tokens (0 for one trained in its document's first step)
    delay_max: int  # the largest delay in steps of a token trained in this step
    memory_over: float  # simulated peak memory over the device's usable limit when no plan fit; 0 otherwise
    cost_model: str  # the cost profile that priced the plan (model, device, layout)
    # a mixture's entries (by name): tokens and loss tokens each trained in this step, all ranks; empty for a single
    # source. Pieces held back and the rest of a long document count toward their own entry when they train.
    entry_tokens: dict[str, int] = {}
    entry_loss_tokens: dict[str, int] = {}
