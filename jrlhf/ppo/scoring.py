"""Scoring rollouts: reference log-probs, rewards and critic values, and their summary.

One implementation serves the trainer (every iteration, and its held-out evaluation) and
``python -m jrlhf.evaluate``. Each scoring call runs on its own role's mesh; the calls are
dispatched back to back and only then fetched, so calls on disjoint devices can overlap.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from jrlhf.meshes.batch import to_host
from jrlhf.ppo import batch as rl_batch
from jrlhf.tasks.rewards import BatchReward, RewardBatch, RewardFn

# arrays (the packed layout of jrlhf.ppo.batch) -> per-row or per-token device values
InferFn = Callable[[dict[str, np.ndarray]], Any]
# A task's true score of (prompt_ids, response_ids), when it knows one (the synthetic task).
GroundTruthFn = Callable[[Sequence[int], Sequence[int]], float]


def sample_meta(
    meta: Sequence[Mapping[str, Any]] | None, prompt_index: Sequence[int]
) -> list[Mapping[str, Any]] | None:
    """Per-prompt meta repeated for each sample (``prompt_index[i]``: sample i's prompt), the
    form :meth:`Scorer.__call__` takes; None stays None."""
    return None if meta is None else [meta[int(i)] for i in prompt_index]


class Scorer:
    """Packs prompt/response pairs and scores them with the frozen and critic models.

    ``reward_model`` (a learned reward, scored at each row's last token) and ``reward_fn`` (a
    verifiable Python reward, per sample ``(prompt_ids, response_ids, meta)`` or per batch of a
    :class:`~jrlhf.tasks.RewardBatch`, see jrlhf.tasks.rewards; ``decode`` gives the batch its
    text, ``reward_name`` names it in errors) are alternatives; ``critic`` is optional (GRPO), and
    so is ``reference`` (a run without a KL term): without one, ``ref_logprobs`` and the KL to it
    are left out rather than reported as 0.
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
    ):
        if (reward_model is None) == (reward_fn is None):
            raise ValueError("give exactly one of reward_model and reward_fn")
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
    ) -> dict[str, np.ndarray]:
        """The packed batch plus ``old_logprobs`` (the rollout's), ``ref_logprobs`` (with a
        reference),
        ``old_values`` (zeros without a critic) and ``scores`` (B,).

        ``meta``: one prompt-record meta per row (row i is sample i, so a prompt's meta repeats
        for each of its samples), handed to ``reward_fn``; None means ``{}`` for every row.
        """
        if meta is not None and len(meta) != len(prompts):
            raise ValueError(f"{len(meta)} meta entries for {len(prompts)} rows")
        arrays = rl_batch.pack(prompts, responses, self.P, self.R, self.pad_id)
        # Dispatch every device call before fetching any result.
        ref_lp = self.reference(arrays) if self.reference is not None else None
        values = self.critic(arrays) if self.critic is not None else None
        if self.reward_model is not None:
            scores = self.reward_model(arrays)
        else:
            metas = meta if meta is not None else [{}] * len(prompts)
            scores = self.reward_fn(RewardBatch(prompts, responses, metas, self.decode))
        old_lp = np.zeros((len(responses), self.R), np.float32)
        for i, lp in enumerate(rollout_logprobs):
            old_lp[i, : len(lp)] = lp
        arrays["old_logprobs"] = old_lp
        ref_lp, values, scores = to_host((ref_lp, values, scores))
        if ref_lp is not None:
            arrays["ref_logprobs"] = np.asarray(ref_lp, np.float32)
        arrays["old_values"] = (
            np.asarray(values, np.float32) if values is not None else np.zeros_like(old_lp)
        )
        arrays["scores"] = np.asarray(scores, np.float32) * self.reward_scale
        return arrays

    def summarize(self, arrays, prompts, responses) -> dict[str, float]:
        """Mean reward, KL to the reference (per-sequence sum of log pi - log ref; only with a
        reference), response length, and the ground-truth score when the task knows it."""
        mask = arrays["mask"]
        out = {"reward": float(np.mean(arrays["scores"]))}
        if "ref_logprobs" in arrays:
            kl = np.sum((arrays["old_logprobs"] - arrays["ref_logprobs"]) * mask, axis=1)
            out["kl_to_ref"] = float(np.mean(kl))
        out["response_len"] = float(np.mean(mask.sum(axis=1)))
        out["num_samples"] = float(len(responses))
        if self.ground_truth is not None:
            truth = [self.ground_truth(p, r) for p, r in zip(prompts, responses)]
            out["gt_score"] = float(np.mean(truth))
        return out
