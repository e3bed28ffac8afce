"""The rollout producer: the rounds of batches in flight, generated ahead of training.

It owns what bounded staleness (jrlhf.ppo.schedules.bounded) generates and has not yet trained
on: rounds keyed by (batch, round), each generated whole or, with partial rollouts
(jrlhf.ppo.partial), a pass at a time; their scores where they are scored as they are generated;
and dynamic sampling's bookkeeping (which batches are short of groups with signal, the further
rounds wanted). Every decision is a function of the rounds and their signal counts, which a
checkpoint keeps, so a resumed run and a run of several processes decide as the uninterrupted
one-process run does.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from jrlhf.ppo import core_algos as algos
from jrlhf.ppo import partial
from jrlhf.ppo.rollout import Rollout
from jrlhf.ppo.scoring import Scorer
from jrlhf.ppo.staleness import GeneratedBatch, StalenessError, batches_ahead
from jrlhf.ppo.update import shaped_scores
from jrlhf.ppo.weights import WeightChannel

# The next prompts and their meta, for another generation round (dynamic sampling) or the next
# batch.
Draw = Callable[[], tuple[list[list[int]], Sequence[Mapping[str, Any]] | None]]


class Producer:
    """Rounds in flight (``pending``), generated with ``rollout`` on the weight channel's
    generation weights and scored with ``scorer``; ``fused``: generate and score in one fused
    rollout (one process with Fusion.enabled)."""

    def __init__(
        self,
        rl,
        max_response_len: int,
        run_seed: int,
        rollout: Rollout,
        scorer: Scorer,
        weights: WeightChannel,
        fused: bool = False,
    ):
        self.rl, self.R, self.run_seed = rl, max_response_len, run_seed
        self.rollout, self.scorer, self.weights, self.fused = rollout, scorer, weights, fused
        self.rounds: dict[tuple[int, int], GeneratedBatch] = {}  # by (batch, round)
        # Rounds dynamic sampling wants and that have not reached this process yet (the
        # generating side starts them at its next generation).
        self.wanted: list[tuple[int, int]] = []
        self.next_batch = 0  # the index of the next batch to start
        self.partial_stats: dict[str, int] = {}
        # Multi-turn episodes that span partial passes: their environments, round by round.
        self.episodes = (
            partial.EpisodesInFlight(rollout.env)
            if rollout.env is not None and rl.asynchrony.partial_rollout_tokens
            else None
        )

    @property
    def pending(self) -> list[GeneratedBatch]:
        """The rounds generated or started and not yet trained on, oldest first."""
        return [self.rounds[key] for key in sorted(self.rounds)]

    def restore(self, pending: list[GeneratedBatch], iteration: int) -> None:
        """Continue from a checkpoint's rounds generated and not yet trained on."""
        self.rounds = {(g.index, g.round): g for g in pending}
        self.next_batch = max((g.index for g in pending), default=iteration - 1) + 1
        if self.episodes is not None:  # the environments of episodes under way, replayed
            for g in pending:
                if not g.complete:
                    self.episodes.restore(g)
        self.wanted = []
        self.wanted = self.refills(after=iteration - 1)

    def take(self, iteration: int) -> list[GeneratedBatch]:
        """Remove and return the rounds of batch ``iteration`` (every one complete)."""
        rounds = self.batch_rounds(iteration)
        if not rounds or not all(g.complete for g in rounds):
            raise StalenessError(f"iteration {iteration} would train on an unfinished batch")
        for g in rounds:
            del self.rounds[(g.index, g.round)]
            if self.episodes is not None:
                self.episodes.drop(g)
        return rounds

    # -- dynamic sampling -------------------------------------------------------------------------
    def batch_rounds(self, index: int) -> list[GeneratedBatch]:
        """The rounds of batch ``index`` this process holds, in order."""
        return [self.rounds[key] for key in sorted(self.rounds) if key[0] == index]

    def short(self, index: int) -> bool:
        """Dynamic sampling: whether batch ``index`` takes another round now: every round it
        has is generated and scored, and they hold fewer groups with signal than the batch has
        prompts, with rounds left (``SampleFilters.max_sampling_rounds``)."""
        rounds = self.batch_rounds(index)
        if not self.rl.filters.dynamic_sampling or not rounds:
            return False
        if any(j == index for j, _ in self.wanted):
            return False
        if not all(g.complete and g.signal is not None for g in rounds):
            return False
        signal = sum(g.signal for g in rounds)
        return signal < len(rounds[0].prompts) and len(rounds) < self.rl.filters.max_sampling_rounds

    def signals(self) -> dict[str, int]:
        """The signal counts of the rounds scored, by ``"batch/round"`` (what the training
        group sends the generating group, which keeps them for its checkpoints)."""
        return {f"{j}/{r}": g.signal for (j, r), g in self.rounds.items() if g.signal is not None}

    def learn_signals(self, signals: dict[str, int]) -> None:
        """Generating group: the training group's :meth:`signals`."""
        for key, signal in signals.items():
            j, r = map(int, key.split("/"))
            if (j, r) in self.rounds:
                self.rounds[(j, r)].signal = int(signal)

    def refills(self, after: int) -> list[tuple[int, int]]:
        """One more round of every batch after ``after`` that is short (started at the next
        iteration's generation)."""
        batches = sorted({j for j, _ in self.rounds if j > after})
        return [(j, len(self.batch_rounds(j))) for j in batches if self.short(j)]

    # -- generation ------------------------------------------------------------------------------
    def generate_round(
        self, index: int, round: int, prompts: list[list[int]], meta, version: int
    ) -> GeneratedBatch:
        """Generate round ``round`` of batch ``index`` (the one iteration ``index`` trains on)
        with the current generation weights, policy ``version``; the sampling seed is that of
        round ``round`` of the synchronous iteration ``index``. Fused (one process with
        ``Fusion.enabled``): scored as its rows finish."""
        sampling = self.rollout.sampling(index, salt=round)
        params = self.weights.gen_params
        arrays = None
        if self.fused:
            fused = self.rollout(params, prompts, sampling, meta=meta)
            result, arrays = fused.result, fused.arrays
        else:
            _, result = self.rollout.generate(params, prompts, sampling, meta)
        g = GeneratedBatch(
            index=index,
            prompts=[list(p) for p in prompts],
            meta=None if meta is None else list(meta),
            prompt_index=np.asarray(result.prompt_index),
            completions=result.completion_ids,
            raw_logprobs=result.raw_logprobs,
            token_versions=[np.full(len(c), version, np.int64) for c in result.completion_ids],
            round=round,
            policy_masks=result.policy_masks,
            episodes=result.episodes,
        )
        if arrays is not None:
            self._scored(g, arrays)
        return g

    def fill(self, iteration: int, draw: Draw) -> list[GeneratedBatch]:
        """Start the rounds dynamic sampling wants and every batch due before iteration
        ``iteration`` trains (jrlhf.ppo.staleness.batches_ahead), and generate with the current
        weights (version ``iteration``); returns the rounds that became complete (also kept in
        ``pending``), batch by batch."""
        starts, self.wanted = list(self.wanted), []
        for j in batches_ahead(iteration, self.rl.asynchrony.max_staleness, self.rl.iterations):
            if j >= self.next_batch:
                starts.append((j, 0))
                self.next_batch = j + 1
        return self._generate(iteration, starts, draw, every_round=True)

    def extra_round(self, iteration: int, draw: Draw) -> list[GeneratedBatch]:
        """One more round of the batch due, generated to its end now (its last chances)."""
        start = (iteration, len(self.batch_rounds(iteration)))
        return self._generate(iteration, [start], draw, every_round=False)

    def _generate(
        self, iteration: int, starts: list[tuple[int, int]], draw: Draw, every_round: bool
    ) -> list[GeneratedBatch]:
        """Draw and start the rounds ``starts`` and generate. Without partial rollouts each
        round is generated whole; with them, one pass over every unfinished round in flight
        (only the new ones unless ``every_round``), then more passes over the batch due until
        it has ended (only while the pipeline fills: later batches have had k passes)."""
        if not self.rl.asynchrony.partial_rollout_tokens:
            new = []
            for j, r in starts:
                prompts, meta = draw()
                new.append(self.generate_round(j, r, prompts, meta, version=iteration))
                self.rounds[(j, r)] = new[-1]
            return new
        before = {key: g.complete for key, g in self.rounds.items()}
        for j, r in starts:
            prompts, meta = draw()
            self.rounds[(j, r)] = partial.start_batch(
                j, prompts, meta, self.rl.samples_per_prompt, round=r,
                episodes=self.episodes is not None,
            )  # fmt: skip
        sampling = self.rollout.sampling(iteration, salt=0)
        engine = self.rollout.engine

        def one_pass(rounds):
            counts = partial.run_pass(
                rounds,
                lambda contexts, sp, turns: engine.generate(
                    self.weights.gen_params, contexts, sp, turns=turns
                ),
                sampling,
                version=iteration,
                tokens=self.rl.asynchrony.partial_rollout_tokens,
                max_len=self.R,
                run_seed=self.run_seed,
                episodes=self.episodes,
            )
            self.partial_stats["partial/recomputed_tokens"] += counts["recomputed_tokens"]

        if every_round:
            self.partial_stats = {"partial/recomputed_tokens": 0}
        one_pass(self.pending if every_round else [self.rounds[key] for key in starts])
        while unfinished := [g for g in self.batch_rounds(iteration) if not g.complete]:
            one_pass(unfinished)
        return [g for key, g in sorted(self.rounds.items()) if g.complete and not before.get(key)]

    # -- scoring ---------------------------------------------------------------------------------
    def score(self, g: GeneratedBatch) -> None:
        """Score round ``g`` unless it is: reference, reward, critic; shaped scores; its groups
        with signal (dynamic sampling)."""
        if g.arrays is None:
            arrays = self.scorer(
                g.sample_prompts, g.completions, g.raw_logprobs, g.sample_meta, g.policy_masks,
                g.episodes,
            )  # fmt: skip
            self._scored(g, arrays)

    def _scored(self, g: GeneratedBatch, arrays: dict[str, np.ndarray]) -> None:
        arrays["train_scores"] = shaped_scores(self.rl, self.R, arrays)
        g.arrays = arrays
        if self.rl.filters.dynamic_sampling:
            group = self.rl.samples_per_prompt
            g.signal = int(np.sum(algos.groups_with_signal(arrays["train_scores"], group)))

    def arrive(self, g: GeneratedBatch) -> None:
        """Training group: a round from the generating group (it replaces a copy restored
        unfinished from a checkpoint)."""
        self.rounds[(g.index, g.round)] = g
        if (g.index, g.round) in self.wanted:
            self.wanted.remove((g.index, g.round))

    def ready(self, iteration: int) -> bool:
        """Training group: every round of batch ``iteration`` is here, complete."""
        rounds = self.batch_rounds(iteration)
        waiting = any(j == iteration for j, _ in self.wanted)
        return bool(rounds) and all(g.complete for g in rounds) and not waiting
