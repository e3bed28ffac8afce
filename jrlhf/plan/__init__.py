"""Execution plans: per-call placements, strategies, cost estimation and plan search."""

from jrlhf.plan.plan import (
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
