"""The bounded-staleness schedule (``Asynchrony.max_staleness = k``; see jrlhf.ppo.staleness).

At the start of iteration ``i`` the batches due are generated with the current weights (batch
``i + k`` once the pipeline is full), then batch ``i``, generated with version ``max(i - k, 0)``,
is scored and trained on. With ``k = 0`` this is the synchronous loop without dynamic sampling,
number for number. With ``Asynchrony.partial_rollout_tokens`` every unfinished sample in flight
takes one pass of that many tokens per iteration under the newest weights (jrlhf.ppo.partial).

A batch is one or more *rounds* of prompts. With ``SampleFilters.dynamic_sampling`` (DAPO) each
round is scored once it has been generated (its reference log-probs and rewards: the models that
give them never change), and a batch whose rounds hold fewer groups with signal than it has prompts
gets another round of the loader's next prompts at the next iteration's generation, under that
iteration's weights, up to ``max_sampling_rounds`` rounds; a batch still short when it is due
gets its remaining rounds at once, under the weights it is trained from. With
``Fusion.enabled`` rounds are scored as they are generated too: in one process the rollout
scores finished rows while the rest decode (jrlhf.ppo.fusion); where the scoring models live on
other processes, the training group scores each round when it arrives. A critic's values are
always taken when the batch is trained, by the critic being trained.

Where the plan gives generation processes of its own (jrlhf.ppo.groups), the generating and
the training group run at the same time and meet once per iteration: rounds go to the training
group through the sample channel as soon as they are generated, weights come back through the
weight channel (a cross-host transfer both make), and the update's metrics, the KL coefficient,
the rounds' signal counts and the further rounds wanted follow, so the generating group (process
0 writes logs and checkpoint meta) knows them. Every decision is taken from the same facts in
both layouts, so a run of several processes equals the one-process run of its plan.
"""

from __future__ import annotations

import logging

import numpy as np

from jrlhf.meshes.batch import process_group
from jrlhf.meshes.processes import stored_keys
from jrlhf.metrics import PhaseTimer
from jrlhf.ppo import partial
from jrlhf.ppo.groups import RoleGroups, sample_channel
from jrlhf.ppo.producer import Draw, Producer
from jrlhf.ppo.residency import Residency
from jrlhf.ppo.rollout import Rollout
from jrlhf.ppo.schedules.synchronous import Learn
from jrlhf.ppo.scoring import Scorer
from jrlhf.ppo.staleness import (
    GeneratedBatch,
    StalenessError,
    check_staleness,
    staleness_metrics,
    versions_bt,
)
from jrlhf.ppo.update import Update
from jrlhf.ppo.weights import WeightChannel
from jrlhf.runtime.preempt import exit_if_asked

log = logging.getLogger("jrlhf")

# Sent with an iteration's metrics to the generating side: the KL coefficient after the update,
# the signal counts of the rounds scored, and the rounds dynamic sampling wants next.
_KL_NEXT = "_kl_coef_next"
_SIGNALS = "_signals"
_WANTED = "_wanted"


class BoundedStaleness:
    """Generate ahead, train on the batch due; ``pending`` holds the rounds generated (or
    started, with partial rollouts) and not yet trained on (part of the resume state)."""

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
        # Rounds scored as soon as they are generated (see the module docstring).
        self.early = bool(rl.fusion.enabled or rl.filters.dynamic_sampling)
        fused = bool(rl.fusion.enabled and self.side is None and rollout.fusion_rows)
        self.producer = Producer(rl, max_response_len, run_seed, rollout, scorer, weights, fused)

    @property
    def pending(self) -> list[GeneratedBatch]:
        """The rounds generated or started and not yet trained on, oldest first (part of the
        resume state)."""
        return self.producer.pending

    def restore(self, pending: list[GeneratedBatch], iteration: int) -> None:
        """Continue from a checkpoint's rounds generated and not yet trained on."""
        self.producer.restore(pending, iteration)

    def __call__(self, iteration: int, draw: Draw) -> dict[str, float]:
        """Iteration ``iteration``; ``draw()`` gives the next batch's prompts and meta."""
        if self.side == "generate":
            return self._generating_side(iteration, draw)
        if self.side == "train":
            return self._training_side(iteration)
        timer = PhaseTimer()
        with timer.phase("generate"):
            self.residency.enter("generate")
            new = self.producer.fill(iteration, draw)
        self._score_early(new, timer)
        while self.producer.short(iteration):  # the due batch's last chances
            with timer.phase("generate"):
                self.residency.enter("generate")
                new = self.producer.extra_round(iteration, draw)
            self._score_early(new, timer)
        rounds = self.producer.take(iteration)
        metrics = self._train(iteration, rounds, timer)
        self.producer.wanted += self.producer.refills(after=iteration)
        return metrics

    def _score_early(self, rounds: list[GeneratedBatch], timer: PhaseTimer) -> None:
        if self.early and rounds:
            with timer.phase("score"):
                self.residency.enter("score")
                for g in rounds:
                    self.producer.score(g)

    def _train(
        self, iteration: int, rounds: list[GeneratedBatch], timer, before_sync=None
    ) -> dict[str, float]:
        with timer.phase("score"):
            self.residency.enter("score")
            for g in rounds:
                self.producer.score(g)
                if self.early and self.scorer.critic is not None:  # the critic being trained
                    g.arrays["old_values"] = self.scorer.values(g.arrays)
        versions = versions_bt([v for g in rounds for v in g.token_versions], self.R)
        mask = np.concatenate([g.arrays["mask"] for g in rounds])
        # The bound, checked on the tokens themselves, whatever produced them.
        check_staleness(versions, mask, iteration, self.rl.asynchrony.max_staleness)
        scored = [(g.sample_prompts, g.completions, g.arrays) for g in rounds]
        metrics = self.learn(scored, len(rounds[0].prompts), timer, iteration, before_sync)
        if self.rl.asynchrony.max_staleness:
            metrics.update(staleness_metrics(versions, mask, iteration))
        if self.rl.asynchrony.partial_rollout_tokens:
            metrics.update(partial.continuation_metrics(rounds))
            metrics.update({name: float(v) for name, v in self.producer.partial_stats.items()})
        return metrics

    # -- the two sides of a separated plan ---------------------------------------------------
    # Each runs its own calls with process-local host reads; they meet once per iteration.
    def _generating_side(self, iteration: int, draw: Draw) -> dict[str, float]:
        timer = PhaseTimer()
        with process_group(self.groups.generate), timer.phase("generate"):
            new = self.producer.fill(iteration, draw)
        exit_if_asked(iteration)  # a test's preemption, between generating and sending
        self.channel.send(f"{iteration}", new)
        step = 0
        while self.rl.filters.dynamic_sampling and self.channel.asked(iteration, step):
            step += 1  # the batch due is still short: one more round of it, now
            with process_group(self.groups.generate), timer.phase("generate"):
                more = self.producer.extra_round(iteration, draw)
            new += more
            self.channel.send(f"{iteration}.{step}", more)
        with timer.phase("wait_for_update") as ph:
            moved = self.weights.sync(self.update.states)
            ph.block_on(self.weights.gen_params)
        remote = self.channel.receive_result(iteration)
        self.producer.take(iteration)  # the training group trained on it this iteration
        self.channel.release_through(iteration)
        self.update.set_kl_coef(remote.pop(_KL_NEXT))
        self.producer.learn_signals(remote.pop(_SIGNALS))
        self.producer.wanted += [(int(j), int(r)) for j, r in remote.pop(_WANTED)]
        tokens = sum(len(c) for g in new for c in g.completions)
        mine = timer.summary()
        return {
            **remote,
            "time/generate": mine["time/generate"],
            "time/wait_for_update": mine["time/wait_for_update"],
            "tokens_per_sec": float(tokens / max(mine["time/generate"], 1e-9)),
            "reshard/bytes": float(moved),
            **{name: float(v) for name, v in self.producer.partial_stats.items()},
            **self.channel.counts(),
            "samples/stored_keys": float(stored_keys()),
        }

    def _arrive(self, g: GeneratedBatch) -> None:
        """Training group: a round from the generating group; scored now where rounds are
        scored early."""
        self.producer.arrive(g)
        if self.early:
            self.residency.enter("score")
            self.producer.score(g)

    def _training_side(self, iteration: int) -> dict[str, float]:
        timer = PhaseTimer()
        tag = f"{iteration}"
        with process_group(self.groups.train):
            with timer.phase("wait_for_samples"):
                # Rounds restored from a checkpoint or sent earlier are here already.
                while not self.producer.ready(iteration):
                    g = self.channel.receive_next(tag)
                    if g is None:
                        raise StalenessError(f"batch {iteration} did not arrive in time")
                    self._arrive(g)
                if self.rl.filters.dynamic_sampling:
                    step = 0
                    # Still short: the rest of this iteration's rounds come first.
                    if self.producer.short(iteration):
                        for g in self.channel.receive_all(tag):
                            self._arrive(g)
                    while self.producer.short(iteration):
                        self.channel.ask(iteration, step, more=True)
                        step += 1
                        for g in self.channel.receive_all(f"{iteration}.{step}"):
                            self._arrive(g)
                    self.channel.ask(iteration, step, more=False)
            rounds = self.producer.take(iteration)

            def before_sync() -> None:
                # The rest of what the generating group sent this iteration, before the weights
                # move (the transfers' order: see SampleChannel).
                for g in self.channel.receive_all(tag):
                    self._arrive(g)

            metrics = self._train(iteration, rounds, timer, before_sync)
        self.channel.forget_through(iteration)
        wanted = self.producer.refills(after=iteration)
        self.producer.wanted += wanted
        signals = self.producer.signals()
        message = {
            **metrics,
            _KL_NEXT: float(self.update.kl_ctl.value),
            _SIGNALS: signals,
            _WANTED: wanted,
        }
        self.channel.send_result(iteration, message)
        return metrics
