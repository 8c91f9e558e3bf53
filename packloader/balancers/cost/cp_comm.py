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
rates from the device file's `cp_link` (`devices.CPLink`). The formula and `CPComm` live in `cp_price` (CP is priced
there once); this module builds a model's `CPComm`.
"""

from __future__ import annotations

from packloader.balancers.cost import presets
from packloader.balancers.cost.cp_price import BYTES_PER_VALUE, CPComm, Exchange
from packloader.balancers.cost.devices import DEFAULT_DEVICE, load_device
from packloader.contracts import ParallelConfig

__all__ = ["BYTES_PER_VALUE", "CPComm", "Exchange", "cp_comm_for"]


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
