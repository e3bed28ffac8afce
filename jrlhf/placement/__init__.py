"""Where every model call runs: execution plans, their cost model, the plan search, and the
effective plan a run executes.

plan.py (plans and strategies) -> workload.py + profile.py + estimator.py (cost model) ->
candidates.py + search.py (exhaustive / MCMC search) -> effective.py (the config's plan, with
RoleConfig meshes merged in). ``python -m jrlhf.plan`` (jrlhf.cli.plan) searches from the shell.
"""

from jrlhf.placement.effective import effective_plan
from jrlhf.placement.plan import (
    CALLS,
    INFERENCE_CALLS,
    STAGE_CALLS,
    STRATEGIES,
    CallPlacement,
    ExecutionPlan,
    ReshardEdge,
    flatten,
    interleave,
    separate,
    strategy,
)

__all__ = [
    "CALLS",
    "INFERENCE_CALLS",
    "STAGE_CALLS",
    "STRATEGIES",
    "CallPlacement",
    "ExecutionPlan",
    "ReshardEdge",
    "effective_plan",
    "flatten",
    "interleave",
    "separate",
    "strategy",
]
