"""packloader: a data loader for long-context LLM training that balances attention cost, not token counts.

The public API is re-exported here; submodules are imported lazily so `import packloader` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# name -> module that defines it
_EXPORTS: dict[str, str] = {
    "Segment": "packloader.contracts",
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
    "Window": "packloader.balancers.planners.registry",
    "Planner": "packloader.balancers.planners.registry",
    "make_planner": "packloader.balancers.planners.registry",
    "register_planner": "packloader.balancers.planners.registry",
    "available_strategies": "packloader.balancers.planners.registry",
    "DocKey": "packloader.sources.base",
    "Document": "packloader.sources.base",
    "IterableSource": "packloader.sources.base",
    "Source": "packloader.sources.base",
    "Tokenizer": "packloader.sources.base",
    "open_source": "packloader.sources.open",
    "stdlib_corpus": "packloader.sources.directory",
    "get_tokenizer": "packloader.sources.tokenizers",
    "tokenize_to_parquet": "packloader.sources.pretokenize",
    "PackedLoader": "packloader.loader.loader",
    "PackedDataset": "packloader.loader.dataset",
    "LoaderStats": "packloader.contracts",
    "PackedBatch": "packloader.collate.batch",
    "collate": "packloader.collate.collate",
    "collate_step": "packloader.collate.collate",
    "plan_cp_shards": "packloader.collate.cp_shard",
    "shard_micro_batch": "packloader.collate.cp_shard",
    "CostModel": "packloader.balancers.cost.model",
    "load_cost_model": "packloader.balancers.cost.resolve",
    "measured_profile": "packloader.balancers.cost.measured",
    "simulate_step": "packloader.balancers.sim.simulator",
    "step_actions": "packloader.balancers.sim.actions",
    "score_plans": "packloader.balancers.sim.metrics",
    "verify_plan": "packloader.balancers.sim.verify",
    "varlen_attention": "packloader.runtime.attention",
    "cp_attention": "packloader.runtime.cp_attention",
    "cp_cost": "packloader.runtime.cp_cost",
    "require_no_slices": "packloader.runtime.slices",
    "SliceExecutor": "packloader.runtime.slices",
    "SlicedPipelineStage": "packloader.runtime.pipeline",
    "PlanPipelineSchedule": "packloader.runtime.pipeline",
    "ZeppelinContext": "packloader.runtime.zeppelin",
    "build_report": "packloader.report.build",
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
