"""Registry of verifiable reward functions: ``(prompt_ids, response_ids) -> float``."""

from __future__ import annotations

import functools
from collections.abc import Callable

RewardFn = Callable[[list[int], list[int]], float]


@functools.cache
def _default_synthetic_task():
    from jrlhf.tasks.synthetic import SyntheticTask

    # The score depends only on the vocabulary layout, not on the seed.
    return SyntheticTask()


def synthetic_ground_truth(prompt_ids: list[int], response_ids: list[int]) -> float:
    """True score of the default :class:`~jrlhf.tasks.SyntheticTask` layout, in [0, 1]."""
    return _default_synthetic_task().score(prompt_ids, response_ids)


REWARD_FNS: dict[str, RewardFn] = {
    "synthetic_ground_truth": synthetic_ground_truth,
}


def register_reward_fn(name: str, fn: RewardFn) -> RewardFn:
    """Add a reward function under ``name`` (an existing name is an error)."""
    if name in REWARD_FNS:
        raise ValueError(f"reward function {name!r} is already registered")
    REWARD_FNS[name] = fn
    return fn


def get_reward_fn(name: str) -> RewardFn:
    """The reward function registered as ``name``; unknown names list the known ones."""
    try:
        return REWARD_FNS[name]
    except KeyError:
        known = ", ".join(sorted(REWARD_FNS))
        raise ValueError(f"unknown reward function {name!r} (known: {known})") from None
