"""The bounded-staleness schedule (``RLConfig.max_staleness = k``; see jrlhf.ppo.staleness).

At the start of iteration ``i`` the batches due are generated with the current weights (batch
``i + k`` once the pipeline is full), then batch ``i``, generated with version ``max(i - k, 0)``,
is scored and trained on. With ``k = 0`` this is the synchronous loop without dynamic sampling,
number for number. With ``RLConfig.partial_rollout_tokens`` every unfinished sample in flight
takes one pass of that many tokens per iteration under the newest weights (jrlhf.ppo.partial).

Where the plan gives generation processes of its own (jrlhf.ppo.groups), the generating and
the training group run at the same time and meet once per iteration: batches go to the training
group through the sample channel as soon as they are generated, weights come back through the
weight channel (a cross-host transfer both make), and the update's metrics and KL coefficient
follow, so the generating group (process 0 writes logs and checkpoint meta) knows them.
"""

from __future__ import annotations

import collections
import logging

import numpy as np

from jrlhf.meshes.batch import process_group
from jrlhf.meshes.processes import stored_keys
from jrlhf.metrics import PhaseTimer
from jrlhf.ppo import partial
from jrlhf.ppo.groups import RoleGroups, sample_channel
from jrlhf.ppo.residency import Residency
from jrlhf.ppo.rollout import Rollout
from jrlhf.ppo.schedules.synchronous import Draw, Learn
from jrlhf.ppo.scoring import Scorer
from jrlhf.ppo.staleness import (
    GeneratedBatch,
    StalenessError,
    batches_ahead,
    check_staleness,
    staleness_metrics,
    versions_bt,
)
from jrlhf.ppo.update import Update, shaped_scores
from jrlhf.ppo.weights import WeightChannel

log = logging.getLogger("jrlhf")

# The KL coefficient after an update, sent with the iteration's metrics to the generating side.
_KL_NEXT = "_kl_coef_next"


class BoundedStaleness:
    """Generate ahead, train on the batch due; ``pending`` holds the batches generated and not
    yet trained on (part of the resume state)."""

    def __init__(
        self,
        rl,
        max_response_len: int,
        run_seed: int,
        rollout: Rollout,
        scorer: Scorer,
        residency: Residency,
        weights: WeightChannel,
        update: Update,
        learn: Learn,
        groups: RoleGroups | None = None,
    ):
        self.rl, self.R, self.run_seed = rl, max_response_len, run_seed
        self.rollout, self.scorer, self.residency = rollout, scorer, residency
        self.weights, self.update, self.learn = weights, update, learn
        # Generation on processes of its own: this process runs its group's side.
        self.groups = groups
        self.side = groups.side if groups else None
        self.channel = sample_channel(update.roles, groups) if groups else None
        self.pending: collections.deque[GeneratedBatch] = collections.deque()
        self.next_batch = 0  # the index of the next batch to generate
        self.partial_stats: dict[str, int] = {}

    def restore(self, pending: list[GeneratedBatch], iteration: int) -> None:
        """Continue from a checkpoint's batches generated and not yet trained on."""
        self.pending = collections.deque(pending)
        self.next_batch = iteration + len(self.pending)

    def __call__(self, iteration: int, draw: Draw) -> dict[str, float]:
        """Iteration ``iteration``; ``draw()`` gives the next batch's prompts and meta."""
        if self.side == "generate":
            return self._generating_side(iteration, draw)
        if self.side == "train":
            return self._training_side(iteration)
        timer = PhaseTimer()
        with timer.phase("generate"):
            self.residency.enter("generate")
            self.fill(iteration, draw)
        gen = self.pending.popleft()
        if gen.index != iteration or not gen.complete:
            raise StalenessError(
                f"iteration {iteration} would train on batch {gen.index} (unfinished)"
            )
        with timer.phase("score"):
            self.residency.enter("score")
            arrays = self.score_batch(gen)
        return self._train(iteration, gen, arrays, timer)

    def _train(
        self, iteration: int, gen: GeneratedBatch, arrays, timer, before_sync=None
    ) -> dict[str, float]:
        versions = versions_bt(gen.token_versions, self.R)
        # The bound, checked on the tokens themselves, whatever produced them.
        check_staleness(versions, arrays["mask"], iteration, self.rl.max_staleness)
        rounds = [(gen.sample_prompts, gen.completions, arrays)]
        metrics = self.learn(rounds, len(gen.prompts), timer, iteration, before_sync)
        if self.rl.max_staleness:
            metrics.update(staleness_metrics(versions, arrays["mask"], iteration))
        if self.rl.partial_rollout_tokens:
            metrics.update(partial.continuation_metrics(gen))
            metrics.update({name: float(v) for name, v in self.partial_stats.items()})
        return metrics

    # -- generation ------------------------------------------------------------------------------
    def generate_batch(
        self, index: int, prompts: list[list[int]], meta, version: int
    ) -> GeneratedBatch:
        """Generate batch ``index`` (the one iteration ``index`` trains on) with the current
        generation weights, policy ``version``; the sampling seed is batch ``index``'s, as in the
        synchronous iteration ``index``."""
        sampling = self.rollout.sampling(index, salt=0)
        _, result = self.rollout.generate(self.weights.gen_params, prompts, sampling)
        return GeneratedBatch(
            index=index,
            prompts=[list(p) for p in prompts],
            meta=None if meta is None else list(meta),
            prompt_index=np.asarray(result.prompt_index),
            completions=result.completion_ids,
            raw_logprobs=result.raw_logprobs,
            token_versions=[np.full(len(c), version, np.int64) for c in result.completion_ids],
        )

    def fill(self, iteration: int, draw: Draw) -> list[GeneratedBatch]:
        """Generate, with the current weights (version ``iteration``), every batch due before
        iteration ``iteration`` trains (jrlhf.ppo.staleness.batches_ahead); returns the batches
        that became complete (also queued in ``pending``)."""
        if self.rl.partial_rollout_tokens:
            return self._fill_partial(iteration, draw)
        new = []
        for j in batches_ahead(iteration, self.rl.max_staleness, self.rl.iterations):
            if j < self.next_batch:
                continue
            prompts, meta = draw()
            new.append(self.generate_batch(j, prompts, meta, version=iteration))
            self.pending.append(new[-1])
            self.next_batch = j + 1
        return new

    def _fill_partial(self, iteration: int, draw: Draw) -> list[GeneratedBatch]:
        """Partial rollouts: start the batches due, run one pass over every unfinished sample in
        flight with the current weights, then more passes over the batch this iteration trains
        until it has ended (only while the pipeline fills: later batches have had k passes)."""
        for j in batches_ahead(iteration, self.rl.max_staleness, self.rl.iterations):
            if j >= self.next_batch:
                prompts, meta = draw()
                self.pending.append(
                    partial.start_batch(j, prompts, meta, self.rl.samples_per_prompt)
                )
                self.next_batch = j + 1
        before = {g.index: g.complete for g in self.pending}
        sampling = self.rollout.sampling(iteration, salt=0)
        engine = self.rollout.engine

        def one_pass(batches):
            counts = partial.run_pass(
                batches,
                lambda contexts, sp: engine.generate(self.weights.gen_params, contexts, sp),
                sampling,
                version=iteration,
                tokens=self.rl.partial_rollout_tokens,
                max_len=self.R,
                run_seed=self.run_seed,
            )
            self.partial_stats["partial/recomputed_tokens"] += counts["recomputed_tokens"]

        self.partial_stats = {"partial/recomputed_tokens": 0}
        one_pass(list(self.pending))
        while self.pending and self.pending[0].index == iteration:
            if self.pending[0].complete:
                break
            one_pass([self.pending[0]])
        return [g for g in self.pending if g.complete and not before[g.index]]

    def score_batch(self, gen: GeneratedBatch) -> dict[str, np.ndarray]:
        """The scored arrays of a generated batch (reference, reward, critic; shaped scores)."""
        arrays = self.scorer(
            gen.sample_prompts, gen.completions, gen.raw_logprobs, meta=gen.sample_meta
        )
        arrays["train_scores"] = shaped_scores(self.rl, self.R, arrays)
        return arrays

    # -- the two sides of a separated plan ---------------------------------------------------
    # Each runs its own calls with process-local host reads; they meet once per iteration.
    def _generating_side(self, iteration: int, draw: Draw) -> dict[str, float]:
        timer = PhaseTimer()
        with process_group(self.groups.generate), timer.phase("generate"):
            new = self.fill(iteration, draw)
        self.channel.send(iteration, new)
        with timer.phase("wait_for_update") as ph:
            moved = self.weights.sync(self.update.states)
            ph.block_on(self.weights.gen_params)
        remote = self.channel.receive_result(iteration)
        trained = self.pending.popleft()  # the training group trained on it this iteration
        assert trained.index == iteration, (trained.index, iteration)
        self.channel.release_through(iteration)
        self.update.set_kl_coef(remote.pop(_KL_NEXT))
        tokens = sum(len(c) for g in new for c in g.completions)
        mine = timer.summary()
        return {
            **remote,
            "time/generate": mine["time/generate"],
            "time/wait_for_update": mine["time/wait_for_update"],
            "tokens_per_sec": float(tokens / max(mine["time/generate"], 1e-9)),
            "reshard/bytes": float(moved),
            **{name: float(v) for name, v in self.partial_stats.items()},
            **self.channel.counts(),
            "samples/stored_keys": float(stored_keys()),
        }

    def _training_side(self, iteration: int) -> dict[str, float]:
        timer = PhaseTimer()
        with timer.phase("wait_for_samples"):
            if self.pending:  # batches restored from a checkpoint are here already
                gen = self.pending.popleft()
            else:
                gen = self.channel.receive(iteration, index=iteration)
        if gen is None or gen.index != iteration:
            got = None if gen is None else gen.index
            raise StalenessError(f"iteration {iteration} would train on batch {got}")

        def before_sync() -> None:
            # The rest of what the generating group sent this iteration, before the weights
            # move (the transfers' order: see SampleChannel).
            self.channel.receive(iteration)

        with process_group(self.groups.train):
            with timer.phase("score"):
                self.residency.enter("score")
                arrays = self.score_batch(gen)
            metrics = self._train(iteration, gen, arrays, timer, before_sync)
        message = {**metrics, _KL_NEXT: float(self.update.kl_ctl.value)}
        self.channel.send_result(iteration, message)
        return metrics
