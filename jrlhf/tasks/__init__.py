"""Built-in tasks: a synthetic RLHF task with a known true preference, and verifiable rewards."""

from jrlhf.tasks.rewards import (
    REWARD_FNS,
    BatchReward,
    RewardBatch,
    RewardError,
    RewardFn,
    get_reward_fn,
    register_reward_fn,
    required_meta,
    with_meta,
)
from jrlhf.tasks.synthetic import SyntheticTask

__all__ = [
    "REWARD_FNS",
    "BatchReward",
    "RewardBatch",
    "RewardError",
    "RewardFn",
    "SyntheticTask",
    "get_reward_fn",
    "register_reward_fn",
    "required_meta",
    "with_meta",
]
