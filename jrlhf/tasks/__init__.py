"""Built-in tasks (a synthetic task with a known true preference, and its variant with
long-tailed response lengths; arithmetic with exact answers) and verifiable rewards."""

from jrlhf.tasks.arithmetic import ArithmeticTask
from jrlhf.tasks.calculator import CalculatorEnv, CalculatorTask
from jrlhf.tasks.guessing import GuessEnv, GuessTask
from jrlhf.tasks.longtail import LongTailTask
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

# TaskConfig.name -> the built-in task class (constructed with the run's seed).
BUILTIN_TASKS = {
    "synthetic": SyntheticTask,
    "arithmetic": ArithmeticTask,
    "longtail": LongTailTask,
    "calculator": CalculatorTask,
    "guess_number": GuessTask,
}

__all__ = [
    "BUILTIN_TASKS",
    "REWARD_FNS",
    "ArithmeticTask",
    "BatchReward",
    "CalculatorEnv",
    "CalculatorTask",
    "GuessEnv",
    "GuessTask",
    "LongTailTask",
    "RewardBatch",
    "RewardError",
    "RewardFn",
    "SyntheticTask",
    "get_reward_fn",
    "register_reward_fn",
    "required_meta",
    "with_meta",
]
