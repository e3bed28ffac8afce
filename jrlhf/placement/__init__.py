"""Execution plans: per-call placements, strategies, cost estimation and plan search.

plan.py (plans and strategies) -> workload.py + profile.py + estimator.py (cost model) ->
candidates.py + search.py (exhaustive / MCMC search) -> __main__.py (``python -m jrlhf.plan``).
"""

from jrlhf.placement.plan import (
    CALLS,
    INFERENCE_CALLS,
    STRATEGIES,
    CallPlacement,
    ExecutionPlan,
    ReshardEdge,
    flatten,
    interleave,
    separate,
    strategy,
)


def __getattr__(name):
    # The cost model and search import more (estimator, presets); load them on first use.
    lazy = {
        "estimate": "jrlhf.placement.estimator",
        "PlanEstimate": "jrlhf.placement.estimator",
        "Workload": "jrlhf.placement.workload",
        "DeviceProfile": "jrlhf.placement.profile",
        "search": "jrlhf.placement.search",
        "SearchResult": "jrlhf.placement.search",
        "search_for_config": "jrlhf.placement.search",
    }
    if name in lazy:
        import importlib

        return getattr(importlib.import_module(lazy[name]), name)
    raise AttributeError(name)


__all__ = [
    "CALLS",
    "INFERENCE_CALLS",
    "STRATEGIES",
    "CallPlacement",
    "ExecutionPlan",
    "ReshardEdge",
    "flatten",
    "interleave",
    "separate",
    "strategy",
]
