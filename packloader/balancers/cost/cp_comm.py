"""The price of context-parallel communication per CP size: what a document sharded over s GPUs pays for its
keys and values, so a per-document CP planner can weigh s against the compute it divides.

Two exchanges, both per layer of the pipeline stage, per GPU of the CP group:

* ``allgather`` (what packloader's runtime does, `runtime.cp_attention`): forward all-gathers the group's K/V,
  each GPU receiving the (s - 1)/s of the rows it lacks; backward reduce-scatters their gradients, the same
  volume. A ring collective takes s - 1 steps, each paying the link's latency. Not overlapped with compute.
* ``ring`` (ring attention, TransformerEngine's P2P CP): s - 1 steps each passing one shard of K/V (forward) or
  of K/V and their gradients (backward, twice the volume); each step overlaps the attention of the shard in hand,
  so only the transfer beyond the attention share is exposed.

K/V bytes per token per layer on one GPU: 2 (K and V) x kv_dim x 2 (bf16) / tp. A group of tp x s GPUs that fits
in one node talks over NVLink, a larger one over the inter-node fabric (TP innermost, then CP: Megatron's order);
rates from the device file's `cp_link` (`devices.CPLink`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from packloader.balancers.cost import presets
from packloader.balancers.cost.cp_price import exchange_seconds, link_rates
from packloader.balancers.cost.devices import DEFAULT_DEVICE, CPLink, load_device
from packloader.contracts import ParallelConfig

Exchange = Literal["allgather", "ring"]
BYTES_PER_VALUE = 2  # bf16


@dataclass(frozen=True)
class CPComm:
    """Seconds of CP communication on one GPU of one pipeline stage, forward and backward, for a document of n
    tokens sharded over s GPUs (`times`); the model shape and link rates it came from."""

    kv_bytes_per_token: float  # K and V of one token, all layers of the stage, on one GPU (its TP share)
    layers: float  # layers per pipeline stage
    tp: int
    link: CPLink
    exchange: Exchange = "allgather"

    def bandwidth_latency(self, s: int) -> tuple[float, float]:
        """(bytes per second, seconds per ring step) of a CP group of s GPUs (`cp_price.link_rates`)."""
        return link_rates(self, s)

    def times(self, n: float, s: int, attn_fwd: float = 0.0, attn_bwd: float = 0.0) -> tuple[float, float]:
        """(forward, backward) seconds of one document of n tokens at CP size s on each of its GPUs; the ring's
        overlap needs the GPU's attention share of that document (`attn_fwd`, `attn_bwd`, seconds). Priced by
        `cp_price.exchange_seconds`."""
        f, b = exchange_seconds(self, n, s, attn_fwd, attn_bwd)
        return float(f[0]), float(b[0])

    def times_array(self, n: np.ndarray, s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`times` of many documents at once (no overlap credit)."""
        return exchange_seconds(self, n, s)


def cp_comm_for(model: str, parallel: ParallelConfig | None = None, *, device: str = DEFAULT_DEVICE,
                exchange: Exchange = "allgather") -> CPComm:
    """The CP communication price of a model preset (or a `presets.parse_shape_spec` text) on `device`, per
    pipeline stage of `parallel`. A calibrated profile path carries no model shape: its CP traffic is priced as
    the default preset's (llama3-8b), which the caller should say where it reports numbers."""
    parallel = parallel or ParallelConfig()
    try:
        shape = presets.get_shape(model)
    except (KeyError, ValueError):
        shape = presets.get_shape("llama3-8b")
    layers = presets.layers_per_stage(shape, parallel)
    kv = 2 * shape.kv_dim * BYTES_PER_VALUE / parallel.tp * layers
    return CPComm(kv_bytes_per_token=kv, layers=layers, tp=parallel.tp, link=load_device(device).cp_link, exchange=exchange)
