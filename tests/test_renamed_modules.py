"""Issue 34 renamed the CP modules for their jobs; the old import paths keep working for one release, each access
warning with the new path, and each name the same object as the new module's."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

import packloader
from packloader.renamed_modules import RENAMED

ROOT = Path(__file__).resolve().parent.parent
# a name each old module was imported for, by hand from the docs and the tests before the renames
USED = {
    "packloader.collate.cp_shard": "plan_cp_shards",
    "packloader.collate.cp_dynamic": "DynamicCPShard",
    "packloader.balancers.cost.cp_shard": "scale_profile_to_cp",
    "packloader.runtime.cp_dynamic": "dynamic_cp_attention",
    "packloader.report.dynamic_cp": "dynamic_cp_row",
    "packloader_integrations.megatron.dynamic_cp": "megatron_dynamic_cp_batches",
    "packloader.balancers.planners.dynamic_cp": "DynamicCPPlanner",
    "packloader.balancers.planners.dynamic_cp_choice": "CPModeChoice",
    "packloader.balancers.planners.dynamic_cp_price": "DynamicCPCost",
}


@pytest.mark.parametrize("old", sorted(USED))
def test_old_path_warns_and_gives_the_new_object(old):
    name = USED[old]
    new = importlib.import_module(RENAMED[old])
    with pytest.warns(DeprecationWarning, match=RENAMED[old].replace(".", r"\.")):
        got = getattr(importlib.import_module(old), name)
    assert got is getattr(new, name)


def test_from_import_of_an_old_path_warns():
    with pytest.warns(DeprecationWarning, match="cp_sequence_shards"):
        from packloader.collate.cp_shard import shard_micro_batch
    assert shard_micro_batch is packloader.shard_micro_batch


def test_no_file_is_left_at_an_old_path_and_every_new_path_is_one():
    roots = {"packloader": ROOT / "packloader", "packloader_integrations": ROOT / "integrations"}

    def file_of(dotted: str) -> Path:
        top, *rest = dotted.split(".")
        return roots[top].joinpath(*rest).with_suffix(".py")

    assert [o for o in RENAMED if file_of(o).exists()] == []
    assert [n for n in RENAMED.values() if not file_of(n).is_file()] == []


def test_an_unknown_name_on_an_old_path_is_an_attribute_error():
    mod = importlib.import_module("packloader.collate.cp_dynamic")
    with pytest.warns(DeprecationWarning), pytest.raises(AttributeError):
        mod.no_such_name  # noqa: B018
