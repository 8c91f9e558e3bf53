"""Devices as profile files: a GPU is one JSON file, found by name on a search path, so adding one edits no code.

A device file (`Device`) states the GPU's memory and the share of it a run may use, the achieved rates of the
analytic cost model (`DeviceSpec`), and, when kernels were timed on it, the measured one-layer cost profile and
the model shape that layer had (`MeasuredKernels`): presets are then priced by that profile scaled to their shape
(`measured.measured_profile`), otherwise by the analytic model. The search path, first to last: files given to
`register_device`, the folders and files of ``PACKLOADER_DEVICE_PATH`` (separated by ``os.pathsep``; set it for
DataLoader workers and other processes, which do not see this process's registrations), and the package's
packloader/profiles/devices/ (h100, h200). A name is the file's stem and must equal its ``name`` field; a name
found in two files is an error naming both, never a silent override.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import msgspec

from packloader.balancers.cost.profile_io import PROFILES_DIR

DEVICES_DIR = PROFILES_DIR / "devices"
ENV_PATH = "PACKLOADER_DEVICE_PATH"
DEFAULT_DEVICE = "h100"  # PlanConfig.device's default

Positive = Annotated[float, msgspec.Meta(gt=0.0)]


class DeviceSpec(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Achieved rates of one accelerator for the analytic model (presets.py's docstring derives the H100's)."""

    name: str  # the analytic profiles' device label, e.g. "h100-bf16"
    attn_fwd_tflops: Positive
    attn_bwd_tflops: Positive
    gemm_fwd_tflops: Positive
    gemm_bwd_tflops: Positive
    hbm_tbps: Positive
    layer_floor_fwd_us: Annotated[float, msgspec.Meta(ge=0.0)]
    layer_floor_bwd_us: Annotated[float, msgspec.Meta(ge=0.0)]
    attn_bwd_flops_ratio: Positive = 2.5  # flash attention's backward FLOPs over its forward's
    tile: Annotated[int, msgspec.Meta(ge=1)] = 128  # the attention kernel's tile: shorter segments cost one tile


class MeasuredKernels(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """A one-layer cost profile timed on the device (no LM head), and the model preset whose layer it timed."""

    profile: str  # a cost profile JSON, relative to the device file's folder
    shape: str  # a model preset name (the scaling reference: heads x head_dim, GEMM weights)


class CPLink(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """What context-parallel K/V exchange achieves per GPU (`cost.cp_comm` prices it): bus bandwidth in GB/s and
    latency per ring step, within a node and across nodes. The defaults are an HGX H100 board's, estimated, not
    measured here: NVLink 4 carries 450 GB/s each way per GPU, of which NCCL's ring all-gather reaches about 80 %;
    across nodes one 400 Gb/s NDR InfiniBand port per GPU (50 GB/s) at about 90 %. `packloader calibrate` on a GPU
    is where measured numbers belong."""

    intra_node_gbps: Positive = 360.0
    inter_node_gbps: Positive = 45.0
    intra_node_latency_us: Annotated[float, msgspec.Meta(ge=0.0)] = 8.0
    inter_node_latency_us: Annotated[float, msgspec.Meta(ge=0.0)] = 15.0
    gpus_per_node: Annotated[int, msgspec.Meta(ge=1)] = 8


Factor = Annotated[float, msgspec.Meta(ge=1.0)]


class CPShardOverhead(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """How much slower one GPU's CP shard of a document runs than 1/s of the whole document's attention, per CP
    size s (2, 4, 8, 16: JSON keys "2", ...), forward and backward: the slowest rank's zigzag shard (two chunks of
    L/(2s) queries against their prefix keys) times s over the whole document's time, as `packloader calibrate
    --cp-shards` measures it on one GPU. Fixed and per-document CP both price a shard by it
    (`cost.cp_shard_attention.shard_attention`); no `cp_shard` in a device file prices a shard at exactly 1/s."""

    fwd: dict[int, Factor]
    bwd: dict[int, Factor]
    mean_fwd: dict[int, Factor] = {}  # the mean rank's factor (information: CP ranks wait for the slowest)
    mean_bwd: dict[int, Factor] = {}
    source: str = ""  # where and how it was measured

    def __post_init__(self) -> None:
        for name in ("fwd", "bwd", "mean_fwd", "mean_bwd"):
            bad = [s for s in getattr(self, name) if s < 2 or s & (s - 1)]
            if bad:
                raise ValueError(f"cp_shard.{name}: CP sizes must be powers of two >= 2, got {sorted(bad)}")


class Device(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """One GPU as its profile file describes it."""

    name: str
    description: str = ""
    memory_gib: Positive
    usable_fraction: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 0.92  # allocator fragmentation, CUDA context
    reserve_gib: Annotated[float, msgspec.Meta(ge=0.0)] = 2.0  # NCCL buffers, workspaces, temporaries
    rates: DeviceSpec
    measured: MeasuredKernels | None = None
    cp_link: CPLink = CPLink()  # context-parallel links (per-document CP prices its K/V exchange with them)
    cp_shard: CPShardOverhead | None = None  # measured CP-shard attention overhead (None: a shard costs 1/s)
    file: str = ""  # where it was read from (set on loading, not in the file)

    def measured_profile_path(self) -> Path | None:
        """The measured profile's file, or None when the device has none (the analytic model prices it)."""
        if self.measured is None:
            return None
        return (Path(self.file).parent / self.measured.profile).resolve()


_REGISTERED: list[Path] = []
_CACHE: dict[tuple[str, int, int], Device] = {}


def read_device(path: str | os.PathLike) -> Device:
    """The Device of one file; an error naming the file and what is wrong with it."""
    p = Path(path)
    try:
        st = p.stat()
    except OSError as e:
        raise FileNotFoundError(f"device profile {p}: cannot be read ({e.strerror})") from None
    key = (str(p.resolve()), st.st_mtime_ns, st.st_size)
    if key in _CACHE:
        return _CACHE[key]
    try:
        dev = msgspec.json.decode(p.read_bytes(), type=Device)
    except msgspec.ValidationError as e:
        raise ValueError(f"device profile {p}: not a device profile: {e}") from None
    except msgspec.DecodeError as e:
        raise ValueError(f"device profile {p}: not valid JSON: {e}") from None
    if dev.name != p.stem:
        raise ValueError(f"device profile {p}: its name field is {dev.name!r}; expected the file's name {p.stem!r}")
    dev = msgspec.structs.replace(dev, file=key[0])
    mp = dev.measured_profile_path()
    if mp is not None and not mp.is_file():
        raise ValueError(f"device profile {p}: measured.profile {dev.measured.profile!r} is not a file ({mp})")  # type: ignore[union-attr]
    _CACHE[key] = dev
    return dev


def register_device(path: str | os.PathLike) -> Device:
    """Add a device profile file to the search path for this process (checked now, so a bad file fails here)."""
    p = Path(path).resolve()
    dev = read_device(p)
    if p not in _REGISTERED:
        _REGISTERED.insert(0, p)
        try:
            known_devices()  # a name clash with another file is an error now, not at first use
        except ValueError:
            _REGISTERED.remove(p)
            raise
    return dev


def search_path() -> list[Path]:
    """Files and folders searched for device profiles, first to last."""
    env = [Path(x) for x in os.environ.get(ENV_PATH, "").split(os.pathsep) if x.strip()]
    return [*_REGISTERED, *env, DEVICES_DIR]


def known_devices() -> dict[str, Path]:
    """Device name -> its file, over the whole search path; a name in two files is an error naming both."""
    out: dict[str, Path] = {}
    for entry in search_path():
        if entry.is_dir():
            files = sorted(entry.glob("*.json"))
        elif entry.suffix == ".json" and entry.is_file():
            files = [entry]
        else:
            raise FileNotFoundError(f"device path entry {entry} (from {ENV_PATH} or register_device) is neither a folder "
                                    "nor a device profile .json file")
        for f in files:
            f = f.resolve()
            if f.stem in out and out[f.stem] != f:
                raise ValueError(f"device {f.stem!r} is defined twice: {out[f.stem]} and {f}; rename one (file and name field)")
            out[f.stem] = f
    return out


def load_device(name: str) -> Device:
    """The device of that name; an unknown name is an error listing the known ones and where they were looked for."""
    known = known_devices()
    key = name if name in known else name.strip().lower()
    if key not in known:
        where = ", ".join(str(p) for p in search_path())
        raise ValueError(f"unknown device {name!r}; known devices: {', '.join(sorted(known))} (looked in {where}; add a "
                         f"<name>.json device profile to a folder on {ENV_PATH} or call register_device)")
    return read_device(known[key])
