"""Asynchronous RL with bounded staleness: the schedule, per-token policy versions, and the check.

A *policy version* counts the actor's updates: the weights an iteration ``i`` starts from are
version ``i``. With ``Asynchrony.max_staleness = k``, the batch iteration ``i`` trains on is
generated with version :func:`generation_version` ``(i, k) = max(i - k, 0)``: at the start of
iteration ``i`` the trainer generates batch ``i + k`` with the current weights (version ``i``)
and then trains on batch ``i``, generated ``k`` updates ago. With ``k = 0`` this is the
synchronous loop. Generation of batch ``i + k`` and training on batch ``i`` do not depend on each
other, so they run at the same time where generation and training have their own processes.

Every generated token records the version that produced it (:class:`GeneratedBatch`), so a
sample whose tokens came from several versions (a rollout continued across an update) is
measured and bounded by its oldest token. Batches generated but not yet trained on are part of
the trainer's resume state (:meth:`GeneratedBatch.to_json`): a resumed run trains on exactly the
samples the uninterrupted run would have.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jrlhf.envs import episode_meta


class StalenessError(RuntimeError):
    """A batch would be trained on with a policy more than ``max_staleness`` versions newer
    than one of its tokens' (a scheduling bug: never expected)."""


def generation_version(index: int, max_staleness: int) -> int:
    """The policy version batch ``index`` is generated with."""
    return max(index - max_staleness, 0)


def batches_ahead(iteration: int, max_staleness: int, iterations: int) -> range:
    """The batch indices that must have been generated before iteration ``iteration`` trains:
    up to ``iteration + max_staleness``, never past the run's last iteration."""
    return range(iteration, min(iteration + max_staleness, iterations - 1) + 1)


@dataclasses.dataclass
class GeneratedBatch:
    """One generated round of a batch: what iteration ``index`` trains on.

    ``prompts``/``meta``: the loader's draw (one per prompt); ``prompt_index[i]``: sample i's
    prompt; ``completions``/``raw_logprobs``: per sample, the tokens and their behaviour
    log-probs; ``token_versions``: per sample, the policy version of each token. ``round``:
    0 for the batch's first draw; dynamic sampling (DAPO) adds rounds 1, 2, ... of further
    prompts while the batch holds too few groups with signal (``signal``: this round's count,
    once scored). ``arrays``: its scored arrays when scored before training (never saved:
    scoring is a pure function of the samples and the frozen models, so a resume rescores).
    Multi-turn rounds (jrlhf.envs) carry, per sample, which tokens the policy sampled
    (``policy_masks``) and what its episode recorded (``episodes``, jrlhf.envs.EPISODE_FIELDS).
    """

    index: int
    prompts: list[list[int]]
    meta: list[Mapping[str, Any]] | None
    prompt_index: np.ndarray
    completions: list[list[int]]
    raw_logprobs: list[np.ndarray]
    token_versions: list[np.ndarray]
    # Partial rollouts (jrlhf.ppo.partial): which samples have ended, and how many passes each
    # took; None for a batch generated in one go (every sample ended, one pass).
    finished: list[bool] | None = None
    passes: list[int] | None = None
    round: int = 0
    signal: int | None = None
    policy_masks: list[np.ndarray] | None = None
    episodes: dict[str, np.ndarray] | None = None
    arrays: dict[str, np.ndarray] | None = dataclasses.field(
        default=None, repr=False, compare=False
    )

    @property
    def complete(self) -> bool:
        """Whether every sample has ended (what training needs)."""
        return self.finished is None or all(self.finished)

    @property
    def sample_prompts(self) -> list[list[int]]:
        """Each sample's prompt."""
        return [self.prompts[int(i)] for i in self.prompt_index]

    @property
    def sample_meta(self) -> list[Mapping[str, Any]] | None:
        """Each sample's meta (its prompt's, with what its episode adds)."""
        if self.episodes is None:
            return None if self.meta is None else [self.meta[int(i)] for i in self.prompt_index]
        meta = self.meta if self.meta is not None else [{}] * len(self.prompts)
        return [
            {**meta[int(p)], **episode_meta(self.episodes, i)}
            for i, p in enumerate(self.prompt_index)
        ]

    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable form; float32 log-probs survive the round trip exactly (a float32
        is a float64 exactly, and JSON writes float64 in full)."""
        return {
            "index": self.index,
            "prompts": [list(map(int, p)) for p in self.prompts],
            "meta": None if self.meta is None else [dict(m) for m in self.meta],
            "prompt_index": [int(i) for i in self.prompt_index],
            "completions": [list(map(int, c)) for c in self.completions],
            "raw_logprobs": [np.asarray(x, np.float32).tolist() for x in self.raw_logprobs],
            "token_versions": [np.asarray(v).tolist() for v in self.token_versions],
            **({} if self.finished is None else {"finished": list(map(bool, self.finished))}),
            **({} if self.passes is None else {"passes": list(map(int, self.passes))}),
            **({"round": self.round} if self.round else {}),
            **({} if self.signal is None else {"signal": int(self.signal)}),
            **(
                {}
                if self.policy_masks is None
                else {"policy_masks": [np.asarray(m, bool).tolist() for m in self.policy_masks]}
            ),
            **(
                {}
                if self.episodes is None
                else {"episodes": {k: np.asarray(v).tolist() for k, v in self.episodes.items()}}
            ),
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> GeneratedBatch:
        return cls(
            index=int(d["index"]),
            prompts=[list(p) for p in d["prompts"]],
            meta=None if d["meta"] is None else list(d["meta"]),
            prompt_index=np.asarray(d["prompt_index"], np.int64),
            completions=[list(c) for c in d["completions"]],
            raw_logprobs=[np.asarray(x, np.float32) for x in d["raw_logprobs"]],
            token_versions=[np.asarray(v, np.int64) for v in d["token_versions"]],
            finished=None if "finished" not in d else [bool(x) for x in d["finished"]],
            passes=None if "passes" not in d else [int(x) for x in d["passes"]],
            round=int(d.get("round", 0)),
            signal=None if d.get("signal") is None else int(d["signal"]),
            policy_masks=(
                None
                if "policy_masks" not in d
                else [np.asarray(m, bool) for m in d["policy_masks"]]
            ),
            episodes=(
                None
                if "episodes" not in d
                else {k: np.asarray(v, np.float64) for k, v in d["episodes"].items()}
            ),
        )


def versions_bt(token_versions: Sequence[np.ndarray], width: int) -> np.ndarray:
    """Per-token versions as a [B, width] array aligned with the response mask (0 past the end:
    the mask excludes those positions)."""
    out = np.zeros((len(token_versions), width), np.int64)
    for i, v in enumerate(token_versions):
        out[i, : len(v)] = v
    return out


def staleness_bt(versions: np.ndarray, mask_bt: np.ndarray, current: int) -> np.ndarray:
    """Per-token staleness: how many updates separate the policy being updated (``current``)
    from the one that generated the token; 0 where the mask is 0."""
    return np.where(np.asarray(mask_bt) > 0, current - versions, 0)


def staleness_metrics(versions: np.ndarray, mask_bt: np.ndarray, current: int) -> dict[str, float]:
    """``staleness/mean`` (over response tokens) and ``staleness/max``."""
    s = staleness_bt(versions, mask_bt, current)
    n = max(float(np.sum(mask_bt)), 1.0)
    return {
        "staleness/mean": float(np.sum(s * (np.asarray(mask_bt) > 0)) / n),
        "staleness/max": float(np.max(s, initial=0)),
    }


def check_staleness(
    versions: np.ndarray, mask_bt: np.ndarray, current: int, max_staleness: int
) -> None:
    """Raise :class:`StalenessError` unless every response token was generated at most
    ``max_staleness`` versions before ``current`` (and not by a version from the future)."""
    s = staleness_bt(versions, mask_bt, current)
    worst, newest = int(np.max(s, initial=0)), int(np.min(s, initial=0))
    if worst > max_staleness or newest < 0:
        raise StalenessError(
            f"training version {current} on tokens {worst if worst > max_staleness else newest} "
            f"versions old (Asynchrony.max_staleness={max_staleness})"
        )
