"""Scoring rollouts: reference log-probs, rewards and critic values, and their summary.

One implementation serves the trainer (every iteration, and its held-out evaluation) and
``python -m jrlhf.evaluate``. Each scoring call runs on its own role's mesh; the calls are
dispatched back to back and only then fetched, so calls on disjoint devices can overlap.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from jrlhf.envs import episode_meta
from jrlhf.meshes.batch import to_host
from jrlhf.ppo import batch as rl_batch
from jrlhf.tasks.rewards import BatchReward, RewardBatch, RewardFn

# arrays (the packed layout of jrlhf.ppo.batch) -> per-row or per-token device values
InferFn = Callable[[dict[str, np.ndarray]], Any]
# The keys of jrlhf.data.batch.pack: what the scoring models read of a scored batch.
_PACKED = ("tokens", "positions", "segment_ids", "response_tokens", "mask", "last_index")
# A task's true score of (prompt_ids, response_ids), when it knows one (the synthetic task).
GroundTruthFn = Callable[[Sequence[int], Sequence[int]], float]


def sample_meta(
    meta: Sequence[Mapping[str, Any]] | None,
    prompt_index: Sequence[int],
    episodes: Mapping[str, np.ndarray] | None = None,
) -> list[Mapping[str, Any]] | None:
    """Per-prompt meta repeated for each sample (``prompt_index[i]``: sample i's prompt), the
    form :meth:`Scorer.__call__` takes, with what each sample's episode adds (multi-turn:
    ``episodes``, per sample, e.g. the environment's reward); None stays None."""
    if episodes is not None:
        base = meta if meta is not None else [{}] * (max(map(int, prompt_index), default=-1) + 1)
        return [{**base[int(p)], **episode_meta(episodes, i)} for i, p in enumerate(prompt_index)]
    return None if meta is None else [meta[int(i)] for i in prompt_index]


@dataclasses.dataclass
class PendingScores:
    """A scoring call dispatched but not yet fetched (:meth:`Scorer.dispatch`): the packed
    arrays with the rollout's log-probs, and the reference, critic and reward outputs (device
    values, possibly longer than the rows when padded; the reward function's already on host)."""

    arrays: dict[str, np.ndarray]
    ref_lp: Any
    values: Any
    scores: Any


class Scorer:
    """Packs prompt/response pairs and scores them with the frozen and critic models.

    ``reward_model`` (a learned reward, scored at each row's last token) and ``reward_fn`` (a
    verifiable Python reward, per sample ``(prompt_ids, response_ids, meta)`` or per batch of a
    :class:`~jrlhf.tasks.RewardBatch`, see jrlhf.tasks.rewards; ``decode`` gives the batch its
    text, ``reward_name`` names it in errors) are alternatives; ``critic`` is optional (GRPO), and
    so is ``reference`` (a run without a KL term): without one, ``ref_logprobs`` and the KL to it
    are left out rather than reported as 0. ``reward_required=False`` allows neither reward (the
    evaluation of a run that had none): then ``scores`` and the reward are left out the same way.
    """

    def __init__(
        self,
        max_prompt_len: int,
        max_response_len: int,
        pad_id: int,
        reference: InferFn | None,
        *,
        reward_model: InferFn | None = None,
        reward_fn: RewardFn | None = None,
        critic: InferFn | None = None,
        reward_scale: float = 1.0,
        ground_truth: GroundTruthFn | None = None,
        decode: Callable[[Sequence[int]], str] | None = None,
        reward_name: str | None = None,
        reward_required: bool = True,
    ):
        if reward_model is not None and reward_fn is not None:
            raise ValueError("give at most one of reward_model and reward_fn")
        if reward_required and reward_model is None and reward_fn is None:
            raise ValueError("give one of reward_model and reward_fn")
        self.P, self.R, self.pad_id = max_prompt_len, max_response_len, pad_id
        self.reference, self.reward_model = reference, reward_model
        # Per-sample (two or three arguments) or batch rewards; errors name the sample.
        self.reward_fn = BatchReward(reward_fn, reward_name) if reward_fn is not None else None
        self.decode = decode
        self.critic, self.reward_scale, self.ground_truth = critic, reward_scale, ground_truth

    def __call__(
        self,
        prompts: Sequence[Sequence[int]],
        responses: Sequence[Sequence[int]],
        rollout_logprobs: Sequence[np.ndarray],
        meta: Sequence[Mapping[str, Any]] | None = None,
        policy_masks: Sequence[np.ndarray] | None = None,
        episodes: Mapping[str, np.ndarray] | None = None,
    ) -> dict[str, np.ndarray]:
        """The packed batch plus ``old_logprobs`` (the rollout's), ``ref_logprobs`` (with a
        reference),
        ``old_values`` (zeros without a critic) and ``scores`` (B,).

        ``meta``: one prompt-record meta per row (row i is sample i, so a prompt's meta repeats
        for each of its samples), handed to ``reward_fn``; None means ``{}`` for every row.
        """
        pending = self.dispatch(
            prompts, responses, rollout_logprobs, meta, policy_masks=policy_masks, episodes=episodes
        )
        return self.collect(pending)

    def dispatch(
        self,
        prompts: Sequence[Sequence[int]],
        responses: Sequence[Sequence[int]],
        rollout_logprobs: Sequence[np.ndarray],
        meta: Sequence[Mapping[str, Any]] | None = None,
        pad_to: int = 0,
        policy_masks: Sequence[np.ndarray] | None = None,
        episodes: Mapping[str, np.ndarray] | None = None,
    ) -> PendingScores:
        """The first half of :meth:`__call__`: pack the rows, dispatch every device call and run
        the reward function, without waiting for the devices. With ``pad_to`` > len(rows) the
        device calls see the rows repeated up to ``pad_to`` rows (one compiled shape for every
        chunk of jrlhf.ppo.fusion); the reward function sees only the real rows.
        ``policy_masks`` (multi-turn rollouts: per response, True at the tokens the policy
        sampled) add ``loss_mask``, the response mask without the observations' tokens, which
        the losses, advantages and KL read instead of ``mask``; ``episodes`` (their per-sample
        records, jrlhf.envs.EPISODE_FIELDS) ride along as ``episode/<field>`` rows."""
        if meta is not None and len(meta) != len(prompts):
            raise ValueError(f"{len(meta)} meta entries for {len(prompts)} rows")
        arrays = rl_batch.pack(prompts, responses, self.P, self.R, self.pad_id)
        rows = len(responses)
        device_arrays = arrays
        if pad_to > rows:
            idx = np.arange(pad_to) % rows
            device_arrays = {k: v[idx] for k, v in arrays.items()}
        # Dispatch every device call before fetching any result.
        ref_lp = self.reference(device_arrays) if self.reference is not None else None
        values = self.critic(device_arrays) if self.critic is not None else None
        if self.reward_model is not None:
            scores = self.reward_model(device_arrays)
        elif self.reward_fn is None:
            scores = None
        else:
            metas = meta if meta is not None else [{}] * len(prompts)
            scores = self.reward_fn(RewardBatch(prompts, responses, metas, self.decode))
        old_lp = np.zeros((rows, self.R), np.float32)
        for i, lp in enumerate(rollout_logprobs):
            old_lp[i, : len(lp)] = lp
        arrays["old_logprobs"] = old_lp
        if policy_masks is not None:
            policy = np.zeros_like(arrays["mask"])
            for i, m in enumerate(policy_masks):
                policy[i, : len(m)] = m
            arrays["loss_mask"] = arrays["mask"] * policy
        for k, v in (episodes or {}).items():
            arrays[f"episode/{k}"] = np.asarray(v, np.float64)
        return PendingScores(arrays, ref_lp, values, scores)

    def collect(self, pending: PendingScores) -> dict[str, np.ndarray]:
        """The second half of :meth:`__call__`: wait for the device calls of ``pending`` and
        return its scored arrays (padding rows dropped)."""
        arrays = pending.arrays
        old_lp = arrays["old_logprobs"]
        rows = len(old_lp)
        ref_lp, values, scores = to_host((pending.ref_lp, pending.values, pending.scores))
        if ref_lp is not None:
            arrays["ref_logprobs"] = np.asarray(ref_lp, np.float32)[:rows]
        arrays["old_values"] = (
            np.asarray(values, np.float32)[:rows] if values is not None else np.zeros_like(old_lp)
        )
        if scores is not None:
            arrays["scores"] = np.asarray(scores, np.float32)[:rows] * self.reward_scale
        return arrays

    def values(self, arrays: dict[str, np.ndarray]) -> np.ndarray:
        """The critic's values of packed, scored ``arrays`` now (a batch scored before the
        critic's latest update takes its values again before training); zeros without one."""
        if self.critic is None:
            return np.zeros_like(arrays["old_logprobs"])
        packed = {k: arrays[k] for k in _PACKED}
        return np.asarray(to_host(self.critic(packed)), np.float32)[: len(arrays["mask"])]

    def summarize(self, arrays, prompts, responses) -> dict[str, float]:
        """Mean reward (only with one), KL to the reference (per-sequence sum of log pi - log
        ref; only with a reference), response length, and the ground-truth score when the task
        knows it."""
        mask = arrays["mask"]
        policy = arrays.get("loss_mask", mask)  # the policy's own tokens (multi-turn)
        out = {"reward": float(np.mean(arrays["scores"]))} if "scores" in arrays else {}
        if "ref_logprobs" in arrays:
            kl = np.sum((arrays["old_logprobs"] - arrays["ref_logprobs"]) * policy, axis=1)
            out["kl_to_ref"] = float(np.mean(kl))
        out["response_len"] = float(np.mean(mask.sum(axis=1)))
        out["num_samples"] = float(len(responses))
        if self.ground_truth is not None:
            truth = [self.ground_truth(p, r) for p, r in zip(prompts, responses)]
            out["gt_score"] = float(np.mean(truth))
        return out
