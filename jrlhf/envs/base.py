"""The environment interface: what the policy's turns are answered by.

A user names an environment by a registered name or ``module:attr`` (``EnvConfig.name``). It is
either a class, instantiated once per episode, with ``reset(meta)`` (the prompt record's meta,
e.g. a secret a game keeps) and ``step(conversation) -> Step``; or a function ``fn(conversation)
-> Step`` for environments without state (the conversation carries the meta). ``Step`` says
what to append (text, tokenized with the run's tokenizer, or token ids), whether the episode is
done, optionally a reward (summed over the episode and handed to the reward function as
``meta["env_reward"]``) and whether the tool call was an error the policy made (a malformed
expression: counted, and the episode goes on with whatever the observation says).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from jrlhf.decode.turns import current_turn_tokens


class EnvFailure(RuntimeError):
    """Environments failed in more episodes than ``EnvConfig.failure_limit`` allows."""


@dataclasses.dataclass(frozen=True)
class Step:
    """An environment's answer to a turn (see the module docstring)."""

    observation: str | Sequence[int] = ""
    done: bool = False
    reward: float | None = None
    error: bool = False


@dataclasses.dataclass(frozen=True)
class Conversation:
    """The episode so far, as an environment sees it after a turn of the policy.

    ``response_ids``: every token after the prompt (the policy's and earlier observations');
    ``policy_mask``: which of them the policy sampled; ``turn``: the number of the turn that
    just ended (1 for the first); ``meta``: the prompt record's other fields.
    """

    prompt_ids: list[int]
    response_ids: list[int]
    policy_mask: np.ndarray
    turn: int
    meta: Mapping[str, Any]
    decode: Callable[[Sequence[int]], str] | None = None

    @property
    def last_turn_ids(self) -> list[int]:
        """The policy's tokens since the last observation."""
        n = current_turn_tokens(self.policy_mask)
        return self.response_ids[len(self.response_ids) - n :]

    def text(self, ids: Sequence[int]) -> str:
        if self.decode is None:
            raise ValueError("this run has no tokenizer to decode the conversation with")
        return self.decode(ids)

    @property
    def last_turn_text(self) -> str:
        return self.text(self.last_turn_ids)

    @property
    def response_text(self) -> str:
        return self.text(self.response_ids)


class _Stateless:
    """A function environment as a per-episode object."""

    def __init__(self, fn: Callable[[Conversation], Step]):
        self.fn = fn

    def reset(self, meta: Mapping[str, Any]) -> None:
        pass

    def step(self, conversation: Conversation) -> Step:
        return self.fn(conversation)


# name -> class or function (see the module docstring); built-ins register from jrlhf.tasks.
ENVIRONMENTS: dict[str, Any] = {}


def register_environment(name: str, env: Any) -> Any:
    """Make ``env`` (a class or function, see the module docstring) available as ``name``."""
    ENVIRONMENTS[name] = env
    return env


def _resolve(name: str) -> Any:
    if ":" not in name:
        try:
            return ENVIRONMENTS[name]
        except KeyError:
            known = ", ".join(sorted(ENVIRONMENTS)) or "none"
            raise ValueError(
                f"EnvConfig.name: unknown environment {name!r} (known: {known}; or module:attr)"
            ) from None
    module, _, attr = name.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except ImportError as e:
        raise ValueError(f"EnvConfig.name {name!r}: cannot import {module!r} ({e})") from None
    except AttributeError:
        raise ValueError(f"EnvConfig.name {name!r}: {module!r} has no {attr!r}") from None
    except Exception as e:  # user code at import time
        raise ValueError(
            f"EnvConfig.name {name!r}: importing {module!r} raised {type(e).__name__}: {e}"
        ) from None


def load_environment(name: str) -> Callable[[], Any]:
    """A factory of per-episode environments for ``name`` (registered or ``module:attr``);
    errors are one line naming ``EnvConfig.name``."""
    env = _resolve(name)
    if inspect.isclass(env):
        missing = [m for m in ("reset", "step") if not callable(getattr(env, m, None))]
        if missing:
            raise ValueError(f"EnvConfig.name {name!r}: the class has no {', '.join(missing)}")
        return env
    if callable(env):
        return lambda: _Stateless(env)
    raise ValueError(f"EnvConfig.name {name!r}: not a class or function")
