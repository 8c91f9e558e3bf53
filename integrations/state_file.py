"""Reading a loader state file that PackedTrainer wrote into a checkpoint folder, with an error naming the file
when it is cut short or is not one: torch's own messages ("failed reading zip archive", "Unsupported operand")
name neither the file nor what to do, and the one for garbage bytes suggests `weights_only=False`, which would
run whatever a damaged or foreign file holds."""

from __future__ import annotations

import torch


class LoaderStateFileError(ValueError):
    """A loader state file that cannot be read as one."""


def _first_sentence(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    cut = text.find(". ")
    text = text[: cut + 1] if cut > 0 else text
    return f"{type(e).__name__}: {text[:160]}"


def read_state_file(path: str) -> dict:
    """The loader state saved at `path` (torch.save of `state_dict()`, read with weights_only)."""
    try:
        state = torch.load(path, weights_only=True)
    except OSError:
        raise
    except Exception as e:  # noqa: BLE001 - torch raises RuntimeError, UnpicklingError, EOFError, ... by damage
        raise LoaderStateFileError(
            f"{path}: not a readable packloader loader state ({_first_sentence(e)}); the file is truncated or "
            "damaged (a copy cut short, a disk filled up?). Resume from an earlier checkpoint, or restore the file "
            "from the run's storage") from None
    if not isinstance(state, dict):
        raise LoaderStateFileError(f"{path}: holds a {type(state).__name__}, expected the dict of a loader's "
                                   "state_dict() (PackedTrainer writes one per process)")
    return state
