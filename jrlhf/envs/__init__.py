"""Environments for multi-turn, tool-using rollouts.

An environment answers the policy between turns (a tool's output, a game's reply); the decode
engine appends the answer to the episode's KV and the policy goes on (jrlhf.decode.turns). This
package holds the interface users implement (:mod:`jrlhf.envs.base`), how a name or import path
becomes one (:func:`load_environment`), and the runner that drives one environment per episode
from the engine's turn ends, with timeouts and failures recorded (:mod:`jrlhf.envs.runner`).
Built-in environments (a calculator, a guessing game) live with their tasks in jrlhf.tasks.
"""

from jrlhf.envs.base import (
    ENVIRONMENTS,
    Conversation,
    EnvFailure,
    Step,
    load_environment,
    register_environment,
)
from jrlhf.envs.runner import (
    EPISODE_FIELDS,
    EnvSetup,
    EpisodeRunner,
    EpisodeStats,
    env_metrics,
    episode_meta,
)

__all__ = [
    "ENVIRONMENTS",
    "EPISODE_FIELDS",
    "Conversation",
    "EnvFailure",
    "EnvSetup",
    "EpisodeRunner",
    "EpisodeStats",
    "Step",
    "env_metrics",
    "episode_meta",
    "load_environment",
    "register_environment",
]
