"""The synchronous schedule: an iteration generates, scores and trains on the same batch.

With ``SampleFilters.dynamic_sampling`` (DAPO) an iteration generates and scores more rounds, from
the loader's next prompts, until ``prompts_per_iteration`` groups with unequal scores are there (or
``max_sampling_rounds`` ran out). With ``Fusion.enabled`` finished samples are scored while the
rest still generate (the rollout's fused call).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from jrlhf.metrics import PhaseTimer
from jrlhf.ppo import core_algos as algos
from jrlhf.ppo.producer import Draw
from jrlhf.ppo.residency import Residency
from jrlhf.ppo.rollout import Rollout, padded_routes
from jrlhf.ppo.scoring import Scorer, sample_meta
from jrlhf.ppo.update import shaped_scores
from jrlhf.ppo.weights import WeightChannel

# One generated and scored round: per-sample prompts, completions, scored arrays.
Round = tuple[list[Sequence[int]], list[list[int]], dict[str, np.ndarray]]
# The rest of an iteration once its rounds are scored (RLTrainer.learn).
Learn = Callable[..., dict[str, float]]


class Synchronous:
    """Generate -> score -> ``learn`` on one batch per iteration."""

    def __init__(
        self,
        rl,
        max_response_len: int,
        rollout: Rollout,
        scorer: Scorer,
        residency: Residency,
        weights: WeightChannel,
        learn: Learn,
    ):
        self.rl, self.R = rl, max_response_len
        self.rollout, self.scorer, self.residency = rollout, scorer, residency
        self.weights, self.learn = weights, learn

    def __call__(
        self,
        iteration: int,
        prompts: list[list[int]],
        meta: Sequence[Mapping[str, Any]] | None = None,
        refill: Draw | None = None,
    ) -> dict[str, float]:
        """Iteration ``iteration`` on ``prompts``; ``meta`` (one per prompt) reaches the reward
        function with each of the prompt's samples; ``refill()`` gives dynamic sampling's next
        prompts (without it the iteration has one round)."""
        timer = PhaseTimer()
        n_groups = len(prompts)
        rounds: list[Round] = []
        kept = 0
        while True:
            with timer.phase("generate"):
                self.residency.enter("generate")
                # Round 0 samples as an iteration without dynamic sampling does.
                sampling = self.rollout.sampling(iteration, salt=len(rounds))
                params = self.weights.gen_params
                if self.rollout.fusion_rows:  # Fusion.enabled: scored as they finish
                    fused = self.rollout(params, prompts, sampling, meta=meta)
                    rep_prompts, result, arrays = fused.prompts, fused.result, fused.arrays
                else:
                    rep_prompts, result = self.rollout.generate(params, prompts, sampling, meta)
            with timer.phase("score"):
                self.residency.enter("score")
                if not self.rollout.fusion_rows:
                    rep_meta = sample_meta(meta, result.prompt_index, result.episodes)
                    arrays = self.scorer(
                        rep_prompts,
                        result.completion_ids,
                        result.raw_logprobs,
                        rep_meta,
                        result.policy_masks,
                        result.episodes,
                    )
                arrays["train_scores"] = shaped_scores(self.rl, self.R, arrays)
                if result.routes is not None:  # DecodeConfig.record_routes: moe/* metrics
                    arrays["rollout_routes"] = padded_routes(result.routes, self.R)
            rounds.append((rep_prompts, result.completion_ids, arrays))
            if not self.rl.filters.dynamic_sampling:
                break
            group = self.rl.samples_per_prompt
            kept += int(np.sum(algos.groups_with_signal(arrays["train_scores"], group)))
            if (
                kept >= n_groups
                or len(rounds) >= self.rl.filters.max_sampling_rounds
                or refill is None
            ):
                break
            prompts, meta = refill()
        return self.learn(rounds, n_groups, timer, iteration)
