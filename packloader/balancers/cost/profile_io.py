"""Reading and writing cost profiles (msgspec JSON), and where the bundled ones live."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec

from packloader.contracts import CostProfile

PROFILES_DIR = Path(__file__).resolve().parents[2] / "profiles"


def load_profile(path: str | os.PathLike) -> CostProfile:
    """A CostProfile from a JSON file (as `packloader calibrate` writes it); clear errors on a bad file."""
    data = Path(path).read_bytes()
    try:
        return msgspec.json.decode(data, type=CostProfile)
    except msgspec.ValidationError as e:
        raise ValueError(f"{path}: not a cost profile: {e}") from None
    except msgspec.DecodeError as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from None


def check_profile(profile: CostProfile) -> CostProfile:
    """A CostProfile built in code, held to the rules a file is (msgspec checks constraints only when decoding):
    every coefficient >= 0 and finite; a ValueError naming the profile and the field otherwise."""
    try:
        return msgspec.convert(msgspec.to_builtins(profile), CostProfile)
    except msgspec.ValidationError as e:
        raise ValueError(f"cost profile {profile.name!r}: {e}") from None


def save_profile(profile: CostProfile, path: str | os.PathLike) -> None:
    Path(path).write_bytes(msgspec.json.format(msgspec.json.encode(profile), indent=2) + b"\n")
