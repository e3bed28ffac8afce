"""Verifiable reward functions: registered by name, or user code named by import path.

``TaskConfig.reward_fn`` is a registered name (:data:`REWARD_FNS`), ``module:function``, a
function importable from the Python path, or a weighted sum of those (``math_verify +
0.1*boxed_format``: :mod:`jrlhf.tasks.math_rewards`). A function of one argument is called once
per batch with a :class:`RewardBatch` (prompts and responses as ids and as text, and each
record's meta) and returns one score per sample; a function of two or three arguments is called
per sample as ``(prompt_ids, response_ids, meta) -> float``. :class:`BatchReward` runs either
form, and an exception or a non-finite score in user code stops the run with one
:class:`RewardError` line naming the function and the sample that caused it.

``meta`` is the prompt record's extra fields (:attr:`jrlhf.data.PromptRecord.meta`: e.g. an id,
a reference answer as ``meta["answer_ids"]``), carried from the prompt file through the loader
and the rollout to the scorer; it is ``{}`` for prompts without one (the synthetic task's).
Functions of ``(prompt_ids, response_ids)`` only are still accepted: :func:`with_meta` adapts
them, and :func:`register_reward_fn` does so on registration.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from jrlhf.data import ANSWER_IDS
from jrlhf.tasks import math_rewards
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


def _positional_count(fn: Callable) -> int | None:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return None
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)


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


def required_meta(fn: Callable[..., float]) -> tuple[str | tuple[str, ...], ...]:
    """The meta keys ``fn`` reads from every prompt (its ``required_meta`` attribute, if any),
    so a run can check its prompt files before any model is built. An entry that is a tuple of
    keys asks for any one of them."""
    return tuple(getattr(fn, "required_meta", ()))


def env_reward(
    prompt_ids: Sequence[int], response_ids: Sequence[int], meta: Mapping[str, Any] | None = None
) -> float:
    """The environment's reward of a multi-turn episode (the sum of its steps' rewards, which
    jrlhf.envs hands over as ``meta["env_reward"]``); 0.0 when it gave none."""
    del prompt_ids, response_ids
    return float((meta or {}).get("env_reward", 0.0))


def missing_meta(fn: Callable[..., float], meta: Mapping[str, Any]) -> list[str]:
    """The :func:`required_meta` entries ``meta`` lacks, each as ``'key'`` or ``'a' or 'b'``."""
    out = []
    for need in required_meta(fn):
        keys = need if isinstance(need, tuple) else (need,)
        if not any(meta.get(k) is not None for k in keys):
            out.append(" or ".join(repr(k) for k in keys))
    return out


REWARD_FNS: dict[str, RewardFn] = {
    "synthetic_ground_truth": synthetic_ground_truth,
    "answer_match": answer_match,
    "env_reward": env_reward,
    "math_verify": math_rewards.math_verify,
    "boxed_format": math_rewards.boxed_format,
    "format": math_rewards.format_reward(),
}


def register_reward_fn(name: str, fn: Callable[..., float]) -> RewardFn:
    """Add a reward function under ``name`` (an existing name is an error); returns it in its
    ``(prompt_ids, response_ids, meta)`` form."""
    if name in REWARD_FNS:
        raise ValueError(f"reward function {name!r} is already registered")
    REWARD_FNS[name] = with_meta(fn)
    return REWARD_FNS[name]


# ----------------------------------------------------------------------------- combinations
_TERM = re.compile(
    r"^\s*(?:(?P<w1>[-+]?\d*\.?\d+(?:[eE][-+]?\d+)?)\s*\*\s*)?(?P<name>[^*+\s][^*+]*?)"
    r"(?:\s*\*\s*(?P<w2>[-+]?\d*\.?\d+(?:[eE][-+]?\d+)?))?\s*$"
)


def is_combination(spec: str) -> bool:
    """Whether ``TaskConfig.reward_fn`` names a weighted sum (``a + 0.1*b``)."""
    return "+" in spec or "*" in spec


def parse_combination(spec: str) -> list[tuple[float, str]]:
    """``"math_verify + 0.1*boxed_format"`` -> ``[(1.0, "math_verify"), (0.1,
    "boxed_format")]``; a weight may stand on either side of its name. One-line errors."""
    terms = []
    for part in spec.split("+"):
        m = _TERM.match(part)
        if not m or (m["w1"] and m["w2"]):
            raise ValueError(
                f"TaskConfig.reward_fn {spec!r}: cannot read the term {part.strip()!r} (write "
                "a weighted sum like 'math_verify + 0.1*boxed_format', a negative weight as "
                "'+ -0.5*name')"
            )
        weight = float(m["w1"] or m["w2"] or 1.0)
        terms.append((weight, m["name"].strip()))
    names = [n for _, n in terms]
    if len(set(names)) != len(names):
        raise ValueError(f"TaskConfig.reward_fn {spec!r}: a reward appears twice")
    return terms


class WeightedSum:
    """A batch reward: the weighted sum of ``terms`` ((weight, name, function) each, run with
    :class:`BatchReward` so per-sample and batch functions mix, and an error names
    the term)."""

    def __init__(self, spec: str, terms: Sequence[tuple[float, str, Callable[..., Any]]]):
        self.__name__ = spec
        self.terms = [(w, BatchReward(fn, name)) for w, name, fn in terms]
        needs: list[Any] = []
        for _, _, fn in terms:
            needs += [k for k in getattr(fn, "required_meta", ()) if k not in needs]
        self.required_meta = tuple(needs)

    def __call__(self, batch) -> list[float]:
        total = None
        for weight, reward in self.terms:
            scores = weight * reward(batch)
            total = scores if total is None else total + scores
        return [float(s) for s in total]


def get_reward_fn(name: str, task: Any = None) -> Callable[..., Any]:
    """The reward function ``name``: a registered name, ``module:function`` imported from the
    Python path, or a weighted sum of those (``"math_verify + 0.1*format"``). ``task`` (a
    TaskConfig) gives the ``format`` reward its ``format_pattern``. Errors are one line naming
    ``TaskConfig.reward_fn``."""
    if is_combination(name):
        terms = [(w, n, get_reward_fn(n, task)) for w, n in parse_combination(name)]
        return WeightedSum(name, terms)
    pattern = getattr(task, "format_pattern", "")
    if name == "format" and pattern:
        return math_rewards.format_reward(pattern)
    if ":" in name:
        module, _, attr = name.partition(":")
        try:
            fn = getattr(importlib.import_module(module), attr)
        except ImportError as e:
            raise ValueError(
                f"TaskConfig.reward_fn {name!r}: cannot import {module!r} ({e})"
            ) from None
        except AttributeError:
            raise ValueError(f"TaskConfig.reward_fn {name!r}: {module!r} has no {attr!r}") from None
        except Exception as e:  # user code at import time
            raise ValueError(
                f"TaskConfig.reward_fn {name!r}: importing {module!r} raised "
                f"{type(e).__name__}: {e}"
            ) from None
        if not callable(fn):
            raise ValueError(f"TaskConfig.reward_fn {name!r}: not a function")
        return fn
    try:
        return REWARD_FNS[name]
    except KeyError:
        known = ", ".join(sorted(REWARD_FNS))
        raise ValueError(
            f"TaskConfig.reward_fn: unknown reward function {name!r} (known: {known}; or "
            "module:function)"
        ) from None


class RewardError(RuntimeError):
    """User reward code raised or returned a non-finite score; one line naming the sample."""


@dataclasses.dataclass
class RewardBatch:
    """What a batch reward function receives: sample ``i`` is ``prompt_ids[i]``,
    ``response_ids[i]`` (up to and including ``<eos>`` when it stopped), their text
    ``prompts[i]`` / ``responses[i]`` (decoded with the task's tokenizer; ids joined by spaces
    without one), and ``meta[i]``, the prompt record's extra fields (e.g. a reference answer)."""

    prompt_ids: Sequence[Sequence[int]]
    response_ids: Sequence[Sequence[int]]
    meta: Sequence[Mapping[str, Any]]
    decode: Callable[[Sequence[int]], str] | None = None

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def _text(self, ids: Sequence[int]) -> str:
        if self.decode is None:
            return " ".join(str(int(t)) for t in ids)
        return self.decode([int(t) for t in ids])

    @functools.cached_property
    def prompts(self) -> list[str]:
        return [self._text(p) for p in self.prompt_ids]

    @functools.cached_property
    def responses(self) -> list[str]:
        return [self._text(r) for r in self.response_ids]

    def sample(self, i: int) -> RewardBatch:
        """Sample ``i`` alone, as a batch of one."""
        return RewardBatch(
            [self.prompt_ids[i]], [self.response_ids[i]], [self.meta[i]], self.decode
        )

    def describe(self, i: int) -> str:
        def cut(text: str) -> str:
            return text if len(text) <= 120 else text[:117] + "..."

        return f"sample {i} (prompt {cut(self.prompts[i])!r}, response {cut(self.responses[i])!r})"


class BatchReward:
    """Runs a reward function of either form on a :class:`RewardBatch`; returns float32 scores.

    An exception, a wrong number of scores or a non-finite score is a :class:`RewardError`
    naming the function and the first sample at fault (a batch function that raises is retried
    one sample at a time to find it)."""

    def __init__(self, fn: Callable[..., Any], name: str | None = None):
        self.name = name or getattr(fn, "__name__", repr(fn))
        self.batched = _positional_count(fn) == 1
        self.fn = fn if self.batched else with_meta(fn)

    def _fail(self, batch: RewardBatch, i: int | None, what: str) -> RewardError:
        where = batch.describe(i) if i is not None else f"a batch of {len(batch)} samples"
        return RewardError(f"reward function {self.name!r} {what} on {where}")

    def _call_batch(self, batch: RewardBatch) -> list[Any]:
        out = self.fn(batch)
        try:
            values = list(out)
        except TypeError:
            raise self._fail(batch, None, f"returned {type(out).__name__}, not scores") from None
        if len(values) != len(batch):
            raise self._fail(batch, None, f"returned {len(values)} scores") from None
        return values

    def __call__(self, batch: RewardBatch) -> np.ndarray:
        values: list[Any] = []
        if self.batched:
            try:
                values = self._call_batch(batch)
            except RewardError:
                raise
            except Exception as e:
                for i in range(len(batch)):  # find the sample that makes it raise
                    try:
                        self._call_batch(batch.sample(i))
                    except Exception as e_i:
                        raise self._fail(batch, i, f"raised {type(e_i).__name__}: {e_i}") from None
                raise self._fail(batch, None, f"raised {type(e).__name__}: {e}") from None
        else:
            for i in range(len(batch)):
                try:
                    values.append(
                        self.fn(batch.prompt_ids[i], batch.response_ids[i], batch.meta[i])
                    )
                except Exception as e:
                    raise self._fail(batch, i, f"raised {type(e).__name__}: {e}") from None
        scores = np.zeros(len(values), np.float32)
        for i, v in enumerate(values):
            try:
                scores[i] = float(v)
            except (TypeError, ValueError):
                raise self._fail(batch, i, f"returned {v!r}, not a number") from None
            if not math.isfinite(float(v)):
                raise self._fail(batch, i, f"returned {v!r}")
        return scores


# How many prompts the start-up check scores (check_reward_fn): enough to meet a few records'
# meta, few enough to cost nothing next to a run.
CHECK_SAMPLES = 4


def check_reward_fn(
    name: str,
    prompts: Sequence[Sequence[int]],
    metas: Sequence[Mapping[str, Any]],
    decode: Callable[[Sequence[int]], str] | None,
    eos_id: int | None,
    max_response_len: int,
    task: Any = None,
) -> None:
    """Score dummy samples with the reward function ``name`` before any training: the first
    :data:`CHECK_SAMPLES` prompts, each answered with its own tokens (in-vocabulary ids the
    tokenizer decodes; ended with ``eos_id``), the last with ``<eos>`` alone (a policy that
    stops at once). A function that raises or returns no finite score on them would fail the
    same way in the RL stage, after the stages before it: a :class:`RewardError` now, naming
    ``TaskConfig.reward_fn``, the function and the sample, in one line."""
    n = min(CHECK_SAMPLES, len(prompts))
    if not n:
        return
    responses = []
    for i in range(n):
        ids = [int(t) for t in prompts[i]][: max(max_response_len - 1, 1)]
        responses.append(ids + ([] if eos_id is None else [int(eos_id)]))
    if eos_id is not None:
        responses[-1] = [int(eos_id)]
    batch = RewardBatch(
        [list(p) for p in prompts[:n]], responses, [dict(m) for m in metas[:n]], decode
    )
    try:
        BatchReward(get_reward_fn(name, task), name)(batch)
    except RewardError as e:
        raise RewardError(
            f"TaskConfig.reward_fn: {e}: a dummy sample scored at start-up, before any stage "
            "(its response is the prompt's own tokens, or <eos> alone)"
        ) from None
