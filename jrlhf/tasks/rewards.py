"""Registry of verifiable reward functions: ``(prompt_ids, response_ids, meta) -> float``.

``meta`` is the prompt record's extra fields (:attr:`jrlhf.data.PromptRecord.meta`: e.g. an id,
a reference answer as ``meta["answer_ids"]``), carried from the prompt file through the loader
and the rollout to the scorer; it is ``{}`` for prompts without one (the synthetic task's).
Functions of ``(prompt_ids, response_ids)`` only are still accepted: :func:`with_meta` adapts
them, and :func:`register_reward_fn` does so on registration.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jrlhf.data import ANSWER_IDS
from jrlhf.tasks.synthetic import SyntheticTask

RewardFn = Callable[[Sequence[int], Sequence[int], Mapping[str, Any]], float]


def _takes_meta(fn: Callable) -> bool:
    """Whether ``fn`` accepts a third positional argument (``meta``)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # some builtins have no signature: assume the old form
        return False
    positional = 0
    for p in params:
        if p.kind == p.VAR_POSITIONAL:
            return True
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            positional += 1
    return positional >= 3


def with_meta(fn: Callable[..., float]) -> RewardFn:
    """``fn`` as a ``(prompt_ids, response_ids, meta)`` reward; a two-argument ``fn`` ignores
    ``meta``. Idempotent."""
    if _takes_meta(fn):
        return fn

    @functools.wraps(fn)
    def reward(prompt_ids, response_ids, meta=None):
        del meta  # a reward of the ids alone
        return fn(prompt_ids, response_ids)

    # inspect.signature follows __wrapped__ to fn's two arguments; dropping it keeps the
    # adapter's own three, so with_meta(with_meta(f)) does not wrap twice.
    del reward.__wrapped__
    return reward


@functools.cache
def _default_synthetic_task() -> SyntheticTask:
    # The score depends only on the vocabulary layout, not on the seed.
    return SyntheticTask()


def synthetic_ground_truth(
    prompt_ids: Sequence[int], response_ids: Sequence[int], meta: Mapping[str, Any] | None = None
) -> float:
    """True score of the default :class:`~jrlhf.tasks.SyntheticTask` layout, in [0, 1]."""
    del meta  # the synthetic task's truth is a function of the ids
    return _default_synthetic_task().score(prompt_ids, response_ids)


def answer_match(
    prompt_ids: Sequence[int], response_ids: Sequence[int], meta: Mapping[str, Any] | None = None
) -> float:
    """1.0 if the response is exactly the record's reference answer, else 0.0.

    The answer is ``meta["answer_ids"]``: a prompt file's ``answer`` text tokenized like a
    response (so it ends with ``<eos>``, as a response the policy stopped does) or its
    ``answer_ids`` as given. A prompt without an answer is an error, not a silent zero.
    """
    del prompt_ids
    if not meta or ANSWER_IDS not in meta:
        raise ValueError(
            "reward 'answer_match' needs a reference answer: give each prompt record an "
            "'answer' or 'answer_ids' field"
        )
    return float([int(t) for t in response_ids] == [int(t) for t in meta[ANSWER_IDS]])


# The meta keys answer_match reads: build_task_data checks every prompt has them before training.
answer_match.required_meta = (ANSWER_IDS,)


def required_meta(fn: Callable[..., float]) -> tuple[str, ...]:
    """The meta keys ``fn`` reads from every prompt (its ``required_meta`` attribute, if any),
    so a run can check its prompt files before any model is built."""
    return tuple(getattr(fn, "required_meta", ()))


REWARD_FNS: dict[str, RewardFn] = {
    "synthetic_ground_truth": synthetic_ground_truth,
    "answer_match": answer_match,
}


def register_reward_fn(name: str, fn: Callable[..., float]) -> RewardFn:
    """Add a reward function under ``name`` (an existing name is an error); returns it in its
    ``(prompt_ids, response_ids, meta)`` form."""
    if name in REWARD_FNS:
        raise ValueError(f"reward function {name!r} is already registered")
    REWARD_FNS[name] = with_meta(fn)
    return REWARD_FNS[name]


def get_reward_fn(name: str) -> RewardFn:
    """The reward function registered as ``name``; unknown names list the known ones."""
    try:
        return REWARD_FNS[name]
    except KeyError:
        known = ", ".join(sorted(REWARD_FNS))
        raise ValueError(f"unknown reward function {name!r} (known: {known})") from None
