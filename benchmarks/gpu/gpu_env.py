"""The environment a GPU proof ran in: torch, CUDA, driver, GPU, the attention backend and the packages the
loader needs, so every figure in the JSON says what produced it."""

from __future__ import annotations

import importlib.metadata as md
import platform
import subprocess

import torch

PACKAGES = ("numpy", "numba", "pyarrow", "msgspec", "torchdata", "tokenizers", "tiktoken", "mosaicml-streaming",
            "flash-attn", "packloader")


def _version(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def _driver() -> str | None:
    """The NVIDIA driver version from nvidia-smi (None where there is none)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def environment(device: torch.device, dtype: torch.dtype) -> dict:
    from packloader.runtime.attention import available_backends, select_backend

    env = {
        "python": platform.python_version(), "platform": platform.platform(), "torch": torch.__version__,
        "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None,
        "device": str(device), "dtype": str(dtype).removeprefix("torch."), "driver": None, "gpu": None,
        "gpu_memory_gib": None, "gpu_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "attention_backends": available_backends(), "attention_backend": select_backend(device, None, dtype),
        "packages": {p: _version(p) for p in PACKAGES},
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(driver=_driver(), gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                   capability=f"{props.major}.{props.minor}", sms=props.multi_processor_count)
    return env
