"""packloader: a data loader for long-context LLM training that balances attention cost, not token counts.

The public API is re-exported here; submodules are imported lazily so `import packloader` stays cheap.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any


def _version() -> str:
    """The version, in one place: pyproject.toml's `version`. A source checkout reads that file (right before any
    install); an installed package reads its distribution's metadata, which was built from it."""
    import re
    from pathlib import Path

    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    if pyproject.is_file():
        text = pyproject.read_text(encoding="utf-8")
        m = re.search(r'^version\s*=\s*"([^"]+)"', text, re.MULTILINE)
        if m and re.search(r'^name\s*=\s*"packloader"', text, re.MULTILINE):
            return m.group(1)
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("packloader")
    except PackageNotFoundError:
        return "0+unknown"


__version__ = _version()

# One logger for the package, quiet unless the application configures logging (the CLIs: --log-level).
logging.getLogger("packloader").addHandler(logging.NullHandler())

# Module paths renamed by issue 34 still import, with a DeprecationWarning, for one release.
from packloader.renamed_modules import install as _install_renamed  # noqa: E402

_install_renamed()

# name -> module that defines it
_EXPORTS: dict[str, str] = {
    "Segment": "packloader.contracts",
    "CPPlacement": "packloader.contracts",
    "MicroBatch": "packloader.contracts",
    "RankPlan": "packloader.contracts",
    "StepPlan": "packloader.contracts",
    "PlannerState": "packloader.contracts",
    "QueuedDoc": "packloader.contracts",
    "ParallelConfig": "packloader.contracts",
    "PlanConfig": "packloader.contracts",
    "CostProfile": "packloader.contracts",
    "Poly": "packloader.contracts",
    "LinTable": "packloader.contracts",
    "SliceCoeffs": "packloader.contracts",
    "ConfigError": "packloader.contracts",
    "validate_config": "packloader.balancers.planners.config_rules",
    "Window": "packloader.balancers.planners.registry",
    "Planner": "packloader.balancers.planners.registry",
    "make_planner": "packloader.balancers.factory",
    "register_planner": "packloader.balancers.planners.registry",
    "available_strategies": "packloader.balancers.planners.registry",
    "AutoUse": "packloader.balancers.planners.registry",
    "StepLayout": "packloader.balancers.planners.registry",
    "PackingPlanner": "packloader.balancers.planners.base",
    "DocKey": "packloader.sources.base",
    "Document": "packloader.sources.base",
    "IterableSource": "packloader.sources.base",
    "Source": "packloader.sources.base",
    "Tokenizer": "packloader.sources.base",
    "open_source": "packloader.sources.open",
    "stdlib_corpus": "packloader.sources.directory",
    "get_tokenizer": "packloader.sources.tokenizers",
    "tokenize_to_parquet": "packloader.sources.pretokenize",
    "SftSource": "packloader.sources.sft",
    "SftOptions": "packloader.sources.sft",
    "MaskedTokens": "packloader.sources.loss_mask",
    "MegatronIndexedSource": "packloader.sources.megatron_indexed",
    "Storage": "packloader.sources.storage",
    "RetryPolicy": "packloader.sources.remote",
    "IterableDatasetSource": "packloader.sources.hf_iterable",
    "UnsupportedSourceError": "packloader.sources.unsupported",
    "Format": "packloader.sources.format_registry",
    "register_format": "packloader.sources.format_registry",
    "Mixture": "packloader.sources.mixture",
    "MixtureEntry": "packloader.sources.mixture",
    "MixtureError": "packloader.sources.mixture",
    "MixedStream": "packloader.sources.mixed_stream",
    "PackedLoader": "packloader.loader.loader",
    "PackedDataset": "packloader.loader.dataset",
    "merge_states": "packloader.loader.elastic",
    "dataloader_state_for": "packloader.loader.worker_resume",
    "LoaderStats": "packloader.contracts",
    "StepMetrics": "packloader.contracts",
    "PackedBatch": "packloader.collate.batch",
    "collate": "packloader.collate.collate",
    "collate_step": "packloader.collate.collate",
    "plan_cp_shards": "packloader.collate.cp_sequence_shards",
    "shard_micro_batch": "packloader.collate.cp_sequence_shards",
    "plan_dynamic_cp": "packloader.collate.cp_document_shards",
    "DynamicCPShard": "packloader.collate.cp_document_shards",
    "CostModel": "packloader.balancers.cost.model",
    "load_cost_model": "packloader.balancers.cost.resolve",
    "model_spec": "packloader.balancers.cost.from_config",
    "shape_from_config": "packloader.balancers.cost.from_config",
    "measured_profile": "packloader.balancers.cost.measured",
    "scale_profile_to_cp": "packloader.balancers.cost.cp_shard_attention",
    "Device": "packloader.balancers.cost.devices",
    "register_device": "packloader.balancers.cost.devices",
    "load_device": "packloader.balancers.cost.devices",
    "known_devices": "packloader.balancers.cost.devices",
    "simulate_step": "packloader.balancers.sim.simulator",
    "step_actions": "packloader.balancers.sim.actions",
    "score_plans": "packloader.balancers.sim.metrics",
    "verify_plan": "packloader.balancers.sim.verify",
    "check_step_plan": "packloader.balancers.planners.contract",
    "PlanContractError": "packloader.balancers.planners.contract",
    "varlen_attention": "packloader.runtime.attention",
    "cp_attention": "packloader.runtime.cp_attention",
    "cp_cost": "packloader.runtime.cp_cost",
    "dynamic_cp_attention": "packloader.runtime.cp_document_attention",
    "DynamicCPExecutor": "packloader.runtime.cp_chains",
    "prepare_cp_pool_groups": "packloader.runtime.groups",
    "require_no_slices": "packloader.runtime.slices",
    "SliceExecutor": "packloader.runtime.slices",
    "SlicedPipelineStage": "packloader.runtime.pipeline",
    "PlanPipelineSchedule": "packloader.runtime.pipeline",
    "ZeppelinContext": "packloader.runtime.zeppelin",
    "build_report": "packloader.report.build",
    "balance_rollouts": "packloader.balancers.planners.rollouts",
    "RolloutPlan": "packloader.balancers.planners.rollouts",
    "ReportOptions": "packloader.report.build",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'packloader' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
