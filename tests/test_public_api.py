"""The public API: every name packloader exports resolves, and importing the package stays light."""

import subprocess
import sys

import pytest

import packloader


def test_every_export_resolves():
    missing = []
    for name in packloader.__all__:
        try:
            getattr(packloader, name)
        except (AttributeError, ImportError) as e:  # pragma: no cover - the failure message is the point
            missing.append(f"{name}: {e}")
    assert not missing, missing


@pytest.mark.multiprocess
def test_import_does_not_load_torch_or_numba():
    code = "import sys, packloader; print(sorted(m for m in ('torch', 'numba', 'pyarrow') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"
