"""The PPO / GRPO iteration over actor, critic, reference and reward on their own meshes.

One iteration::

    prompts -> actor generate (generation mesh, paged-KV decode)
            -> reference log-probs, reward scores, critic values (inference; dispatched
               back to back so calls on disjoint devices overlap)
            -> [DAPO: overlong penalty on the scores; dynamic sampling: groups of equal scores
               dropped, more prompts generated and scored until the batch is full]
            -> advantages (GAE with a KL-shaped reward, or GRPO group baselines)
            -> epochs of minibatch updates of actor and critic (training meshes, donated state)
            -> actor weights resharded to the generation layout (jrlhf.reshard, cached)

With ``RLConfig.max_staleness = k >= 1`` (``run_async_iteration``, jrlhf.ppo.staleness) the
batch an iteration trains on was generated up to k updates earlier, and generation of the next
batches runs while this one trains.

Everything random is a function of (seed, iteration, generation round), and the checkpoint
holds the loader position (past every prompt an iteration drew), the KL controller and the
batches generated but not yet trained on, so a resumed run repeats the uninterrupted one exactly.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jrlhf import checkpoint
from jrlhf.config import Config
from jrlhf.data.batch import fit_microbatches
from jrlhf.meshes.batch import batch_shards, process_local, to_host
from jrlhf.meshes.mesh import mesh_devices
from jrlhf.meshes.processes import fetch, post
from jrlhf.metrics import PhaseTimer
from jrlhf.placement.plan import ExecutionPlan
from jrlhf.ppo import batch as rl_batch
from jrlhf.ppo import core_algos as algos
from jrlhf.ppo import partial
from jrlhf.ppo.fusion import fusion_score_rows, tail_migration
from jrlhf.ppo.residency import Residency
from jrlhf.ppo.rollout import Rollout
from jrlhf.ppo.scoring import Scorer, sample_meta
from jrlhf.ppo.staleness import (
    GeneratedBatch,
    StalenessError,
    batches_ahead,
    check_staleness,
    staleness_metrics,
    versions_bt,
)
from jrlhf.reshard import Resharder
from jrlhf.runtime.guard import UpdateGuard, check_finite
from jrlhf.runtime.model_source import load_weights
from jrlhf.runtime.roles import RoleSetup, frozen_infer, make_infer
from jrlhf.runtime.shared_programs import shared_program
from jrlhf.runtime.steps import (
    OptimizerConfig,
    init_train_state,
    make_optimizer,
    make_train_step,
    state_shardings,
)
from jrlhf.tasks.rewards import RewardFn

log = logging.getLogger("jrlhf")

# The next prompts and their meta, for another generation round (dynamic sampling).
Refill = Callable[[], tuple[list[list[int]], Sequence[Mapping[str, Any]] | None]]
# The next batch's prompts and meta (asynchronous iterations draw ahead of training).
Draw = Refill

# Test hooks: exit abruptly (no cleanup, like a preempted job) while this iteration is training;
# with several processes, only the process whose index the second variable names (default: all).
_EXIT_AT_ENV = "JRLHF_DEBUG_EXIT_AT_ITERATION"
_EXIT_PROCESS_ENV = "JRLHF_DEBUG_EXIT_PROCESS"
# The KL coefficient after an update, sent with the iteration's metrics to the generation process.
_KL_NEXT = "_kl_coef_next"


@dataclasses.dataclass(frozen=True)
class LossSettings:
    """The ``RLConfig`` fields the training losses read. The losses are built from these alone,
    so runs whose configs differ elsewhere (iterations, checkpointing, staleness, sampling)
    share the loss functions and with them the traced and compiled train steps
    (``shared_program``)."""

    policy_loss: str
    clip_eps: float
    clip_eps_high: float
    dual_clip_c: float
    value_clip_eps: float
    entropy_coef: float
    loss_agg: str
    logprob_chunk: int

    @classmethod
    def of(cls, rl) -> LossSettings:
        return cls(**{f.name: getattr(rl, f.name) for f in dataclasses.fields(cls)})


def actor_loss(P: int, rl, kl_in_loss: bool, kl_estimator: str | None = None):
    """The actor's training loss on a minibatch: the configured policy loss
    (``RLConfig.policy_loss``, core_algos' registry), minus the entropy bonus, plus the KL term
    (``kl_estimator``, default ``RLConfig.kl_estimator`` or k3) when the KL is a loss term (GRPO).

    Its ``weight`` metric is what ``RLConfig.loss_agg`` averages over (tokens or sequences), so
    gradient accumulation over micro-batches gives the minibatch's loss however it is split.
    """
    estimator = (kl_estimator or rl.kl_estimator or "k3") if kl_in_loss else None
    return _actor_loss(P, LossSettings.of(rl), kl_in_loss, estimator)


@shared_program()
def _actor_loss(P: int, rl: LossSettings, kl_in_loss: bool, kl_estimator: str | None):
    policy_loss = algos.get_policy_loss(rl.policy_loss)

    def loss_fn(module, batch):
        logp, entropy = rl_batch.response_logprobs(
            module, batch, P, with_entropy=True, chunk=rl.logprob_chunk
        )
        mask = batch["mask"]
        loss, metrics = policy_loss(
            logp,
            batch["old_logprobs"],
            batch["advantages"],
            mask,
            rl.clip_eps,
            clip_eps_high=rl.clip_eps_high or None,
            dual_clip_c=rl.dual_clip_c or None,
            agg=rl.loss_agg,
            is_weights_bt=batch.get("is_weights"),
        )
        ent = algos.entropy_bonus(entropy, mask, rl.loss_agg)
        metrics = dict(metrics, policy_loss=loss, entropy=ent)
        if rl.entropy_coef:
            loss = loss - rl.entropy_coef * ent
        if kl_in_loss:
            kl = algos.kl_penalty(logp, batch["ref_logprobs"], kl_estimator)
            kl_term = algos.aggregate_loss(kl, mask, rl.loss_agg)
            loss = loss + batch["kl_coef"][0] * kl_term
            metrics["kl_loss"] = kl_term
            if kl_estimator == "k3":  # the only estimator that exponentiates, hence clamps
                d = jnp.abs(logp - batch["ref_logprobs"]) > algos.LOG_RATIO_CLAMP
                metrics["kl_clampfrac"] = jax.lax.stop_gradient(algos.masked_mean(d, mask))
        return loss, dict(metrics, weight=algos.aggregation_weight(mask, rl.loss_agg))

    return loss_fn


def critic_loss(P: int, rl):
    """The critic's clipped value loss on a minibatch (``weight`` as in :func:`actor_loss`)."""
    return _critic_loss(P, LossSettings.of(rl))


@shared_program()
def _critic_loss(P: int, rl: LossSettings):
    def loss_fn(module, batch):
        values = rl_batch.response_values(module, batch, P)
        loss, metrics = algos.value_loss_clipped(
            values,
            batch["old_values"],
            batch["returns"],
            batch["mask"],
            rl.value_clip_eps,
            agg=rl.loss_agg,
        )
        weight = algos.aggregation_weight(batch["mask"], rl.loss_agg)
        return loss, dict(metrics, value_loss=loss, weight=weight)

    return loss_fn


def make_advantage_fn(rl, algorithm: str, group_size: int):
    """A jitted pure function from scored rollouts to (advantages, returns).

    The estimator comes from core_algos' registry (``RLConfig.advantage_estimator``): by default
    GAE over KL-shaped token rewards for PPO (the score lands on the last response token),
    group-normalized scores for GRPO. Every estimator gets the same keywords and reads the ones it
    needs: token rewards (KL-shaped unless the KL is a loss term), scores, values, the mask,
    gamma, lambda and the group size (``samples_per_prompt``; samples are prompt-major).
    """
    estimator = algos.get_advantage_estimator(algos.advantage_estimator_name(rl, algorithm))
    kl_estimator = algos.kl_estimator_name(rl, algorithm)

    def advantages(scores_b, logp_bt, ref_logp_bt, values_bt, mask_bt, kl_coef):
        if algos.kl_in_loss(rl, algorithm):
            rewards_bt = scores_b[:, None] * algos.last_token_onehot(mask_bt)
        else:
            rewards_bt = algos.apply_kl_to_rewards(
                scores_b, logp_bt, ref_logp_bt, mask_bt, kl_coef, kl_estimator
            )
        adv, returns = estimator(
            rewards_bt=rewards_bt,
            values_bt=values_bt,
            scores_b=scores_b,
            mask_bt=mask_bt,
            gamma=rl.gamma,
            lam=rl.lam,
            group_size=group_size,
        )
        if algorithm == "ppo" and rl.whiten_advantages:
            adv = algos.masked_whiten(adv, mask_bt)
        return adv, returns

    return jax.jit(advantages)


class RLTrainer:
    """Runs PPO (``algorithm="ppo"``) or GRPO (``"grpo"``) for ``cfg.rl.iterations``."""

    def __init__(
        self,
        cfg: Config,
        algorithm: str,
        roles: dict[str, RoleSetup],
        plan: ExecutionPlan,
        data: Any,
        run_dir: Path,
        reward_fn: RewardFn | None = None,
    ):
        self.cfg, self.rl, self.algorithm = cfg, cfg.rl, algorithm
        self.roles, self.data = roles, data
        self.run_dir = Path(run_dir)
        self.P, self.R = cfg.task.max_prompt_len, cfg.task.max_response_len
        self.group = cfg.rl.samples_per_prompt
        self.use_critic = algorithm == "ppo"
        # Without a KL term (algos.uses_reference) the reference is neither built nor scored.
        self.use_reference = algos.uses_reference(cfg.rl)
        self.kl_in_loss = algos.kl_in_loss(cfg.rl, algorithm)
        self.kl_estimator = algos.kl_estimator_name(cfg.rl, algorithm)
        self.seed = seed = cfg.run.seed
        batch_size = self.rl.infer_batch_size

        # Trained roles: optimizer, sharded state and jitted step on their training mesh.
        self.trained = ["actor", "critic"] if self.use_critic else ["actor"]
        losses = {
            "actor": actor_loss(self.P, self.rl, self.kl_in_loss, self.kl_estimator),
            "critic": critic_loss(self.P, self.rl),
        }
        self.opts, self.states, self.steps = {}, {}, {}
        for i, role in enumerate(self.trained):
            setup = roles[role]
            mesh, rules = setup.meshes["train"], setup.rules["train"]
            self.opts[role] = make_optimizer(self._opt_config(setup))
            params = load_weights(setup.source, mesh, rules, seed + i)
            self.states[role] = init_train_state(
                setup.model, self.opts[role], mesh, rules, params=params
            )
            self.steps[role] = make_train_step(
                setup.model, self.opts[role], losses[role], mesh, rules,
                microbatches=setup.config.microbatches,
            )  # fmt: skip

        def frozen(role: str, fn):
            setup = roles[role]
            return frozen_infer(
                setup.source, setup.meshes["infer"], setup.rules["infer"], fn, seed, batch_size
            )

        # Off-policy correction: the actor's proximal log-probs, recomputed on its training mesh
        # with the weights the update starts from.
        self.prox_logprobs = None
        if self.rl.off_policy_correction != "none":
            actor = roles["actor"]
            self.prox_logprobs = make_infer(
                actor.model,
                actor.meshes["train"],
                actor.rules["train"],
                rl_batch.logprobs_fn(self.P),
                batch_size,
            )

        critic_fn = None
        if self.use_critic:
            critic = roles["critic"]
            critic_values = make_infer(
                critic.model,
                critic.meshes["infer"],
                critic.rules["infer"],
                rl_batch.values_fn(self.P),
                batch_size,
            )
            critic_fn = lambda arrays: critic_values(self.critic_infer_params, arrays)  # noqa: E731
        self.scorer = Scorer(
            self.P,
            self.R,
            data.pad_id,
            frozen("reference", rl_batch.logprobs_fn(self.P)) if self.use_reference else None,
            reward_model=None if reward_fn else frozen("reward", rl_batch.sequence_scores),
            reward_fn=reward_fn,
            critic=critic_fn,
            reward_scale=self.rl.reward_scale,
            ground_truth=data.ground_truth,
            decode=data.decode,
            reward_name=cfg.task.reward_fn or None,
        )

        # Generation: the engine lives on the actor's generation mesh; trained weights follow
        # the plan's reshard edges (the actor to its generation layout after every update, the
        # critic to its inference layout when that differs) through the cached resharder.
        actor = roles["actor"]
        fusion_rows = 0
        if self.rl.fusion:  # scoring calls of this many rows must split over every scoring mesh
            scoring = [roles[r] for r in ("reference", "reward", "critic") if r in roles]
            fusion_rows = fusion_score_rows(
                self.rl.fusion_score_rows,
                self.rl.prompts_per_iteration * self.group,
                [(r.meshes["infer"], r.rules["infer"]) for r in scoring],
            )
        self.rollout = Rollout.build(
            actor.model, actor.meshes["generate"], actor.rules["generate"], self.scorer, cfg,
            data.eos_id, fusion_rows,
        )  # fmt: skip
        self.edges = [e for e in plan.reshard_edges() if e.role in self.trained]
        self.resharder = Resharder()
        if self.rl.migrate_rows:  # RLHFuse's migration: the tail leaves the scoring devices
            self.rollout.migration = tail_migration(
                self.rollout.engine,
                self.rl.migrate_rows,
                self.rl.migrate_replicas,
                avoid=set().union(*(mesh_devices(r.meshes["infer"]) for r in scoring)),
                transfer=self.resharder,
            )
        self.moved: dict[str, Any] = {}
        self.sync_weights()
        # The memory knobs (RLConfig.offload, generation_copy): idle state off the devices.
        self.residency = Residency(self)

        self.advantages = make_advantage_fn(self.rl, algorithm, self.group)
        self.kl_ctl = algos.make_kl_controller(
            "adaptive" if self.rl.adaptive_kl_target > 0 else "fixed",
            self.rl.kl_coef,
            target=self.rl.adaptive_kl_target or None,
            horizon=self.rl.adaptive_kl_horizon,
        )
        self.iteration = 0
        # Asynchronous schedule: batches generated and not yet trained on, oldest first, and
        # the index of the next batch to generate.
        self.pending: collections.deque[GeneratedBatch] = collections.deque()
        self.partial_stats: dict[str, int] = {}
        self.next_batch = 0
        self.side = self._async_side()
        self.guard = UpdateGuard(cfg.run.max_nonfinite_updates, algorithm)
        self.ckpt = checkpoint.trainer_checkpoint_manager(
            self.run_dir,
            max_to_keep=self.rl.keep_checkpoints,
            async_save=self.rl.async_checkpoint,
        )

    def _async_side(self) -> str | None:
        """The part of an asynchronous iteration this process runs: ``"generate"`` or
        ``"train"`` when ``RLConfig.max_staleness >= 1`` and the plan gives generation to
        process 0 alone and every other call to process 1 alone (``separate`` on 2 processes);
        the two sides then run at the same time and meet once per iteration (samples through the
        coordination service's key-value store, weights through the resharder's cross-host
        transfer). None: every process runs every call (SPMD), without overlap."""
        if not self.rl.max_staleness or jax.process_count() != 2:
            return None

        def procs(mesh) -> set[int]:
            return {d.process_index for d in mesh.devices.flat}

        gen = procs(self.roles["actor"].meshes["generate"])
        rest = set().union(*(
            procs(mesh)
            for role, setup in self.roles.items()
            for phase, mesh in setup.meshes.items()
            if (role, phase) != ("actor", "generate")
        ))  # fmt: skip
        if gen != {0} or rest != {1}:
            log.info(
                "max_staleness=%d: generation (processes %s) and the other calls (processes %s) "
                "are not one process each: every process runs every call, without overlap",
                self.rl.max_staleness, sorted(gen), sorted(rest),
            )  # fmt: skip
            return None
        if self.rl.partial_rollout_tokens:
            raise ValueError(
                "RLConfig.partial_rollout_tokens with generation and training on separate "
                "processes is not supported yet (samples in flight live on the generating side)"
            )
        if self.rl.offload or self.rl.generation_copy != "kept":
            # Each side holds only its own process's state; the memory knobs move state of
            # both sides at phase boundaries the two processes no longer share.
            raise ValueError(
                "RLConfig.max_staleness >= 1 with generation and training on separate processes "
                "does not support RLConfig.offload or RLConfig.generation_copy='dropped' yet"
            )
        return "generate" if jax.process_index() == 0 else "train"

    def sync_weights(self, roles: Sequence[str] | None = None) -> int:
        """Follow the plan's reshard edges (of ``roles``, default all): each trained role's
        parameters move from its training layout to the layout of the call that reads them next
        (between processes when the plan separates them: jrlhf.reshard). Returns the bytes that
        crossed devices."""
        moved = 0
        for edge in self.edges:
            if roles is not None and edge.role not in roles:
                continue
            setup = self.roles[edge.role]
            phase = "generate" if edge.dst.endswith("_generate") else "infer"
            params = self.states[edge.role].params
            transition = self.resharder.plan(params, setup.shardings(phase))
            self.moved[edge.role] = transition.run(params)
            moved += transition.bytes_moved
        return moved

    @property
    def gen_params(self):
        """The actor's parameters in its generation layout."""
        return self.moved["actor"]

    @property
    def critic_infer_params(self):
        """The critic's parameters in its inference layout (its training copy when the plan
        scores where it trains); None without a critic."""
        if not self.use_critic:
            return None
        return self.moved.get("critic", self.states["critic"].params)

    def _opt_config(self, setup: RoleSetup) -> OptimizerConfig:
        rc = setup.config
        return OptimizerConfig(
            learning_rate=rc.learning_rate,
            warmup_steps=rc.warmup_steps,
            weight_decay=rc.weight_decay,
            grad_clip=rc.grad_clip,
        )

    # -- one iteration -------------------------------------------------------------------------
    def run_iteration(
        self,
        prompts: list[list[int]],
        meta: Sequence[Mapping[str, Any]] | None = None,
        refill: Refill | None = None,
    ) -> dict[str, float]:
        """One iteration on ``prompts``; ``meta`` (one per prompt: the prompt records' extra
        fields) reaches the reward function with each of the prompt's samples.

        With ``RLConfig.dynamic_sampling``, ``refill()`` gives the next prompts and their meta
        (the trainer's loader advances, so the saved loader position covers them and a resumed
        run draws the same) whenever fewer than ``prompts_per_iteration`` groups with unequal
        scores have been generated; without ``refill`` the iteration has one round.
        """
        it = self.iteration
        timer = PhaseTimer()
        n_groups = len(prompts)
        rounds: list[tuple[list[Sequence[int]], list[list[int]], dict[str, np.ndarray]]] = []
        kept = 0
        while True:
            with timer.phase("generate"):
                self.residency.enter("generate")
                # Round 0 samples as an iteration without dynamic sampling does.
                sampling = self.rollout.sampling(it, salt=len(rounds))
                if self.rollout.fusion_rows:  # RLConfig.fusion: scored as they finish
                    fused = self.rollout(self.gen_params, prompts, sampling, meta=meta)
                    rep_prompts, result, arrays = fused.prompts, fused.result, fused.arrays
                else:
                    rep_prompts, result = self.rollout.generate(self.gen_params, prompts, sampling)
            with timer.phase("score"):
                self.residency.enter("score")
                if not self.rollout.fusion_rows:
                    rep_meta = sample_meta(meta, result.prompt_index)
                    arrays = self.scorer(
                        rep_prompts, result.completion_ids, result.raw_logprobs, meta=rep_meta
                    )
                arrays["train_scores"] = self._shaped_scores(arrays)
            rounds.append((rep_prompts, result.completion_ids, arrays))
            if not self.rl.dynamic_sampling:
                break
            kept += int(np.sum(algos.groups_with_signal(arrays["train_scores"], self.group)))
            if kept >= n_groups or len(rounds) >= self.rl.max_sampling_rounds or refill is None:
                break
            prompts, meta = refill()

        return self._train_on_rounds(rounds, n_groups, timer)

    # -- asynchronous iterations (bounded staleness) ------------------------------------------
    def generate_batch(
        self, index: int, prompts: list[list[int]], meta: Sequence[Mapping[str, Any]] | None
    ) -> GeneratedBatch:
        """Generate batch ``index`` (the one iteration ``index`` trains on) with the current
        generation weights; every token records the current policy version. The sampling seed
        is batch ``index``'s, as in the synchronous iteration ``index``."""
        sampling = self.rollout.sampling(index, salt=0)
        _, result = self.rollout.generate(self.gen_params, prompts, sampling)
        version = self.iteration
        return GeneratedBatch(
            index=index,
            prompts=[list(p) for p in prompts],
            meta=None if meta is None else list(meta),
            prompt_index=np.asarray(result.prompt_index),
            completions=result.completion_ids,
            raw_logprobs=result.raw_logprobs,
            token_versions=[np.full(len(c), version, np.int64) for c in result.completion_ids],
        )

    def fill_pipeline(self, draw: Draw) -> list[GeneratedBatch]:
        """Generate, with the current weights, every batch the schedule wants ready before this
        iteration trains (jrlhf.ppo.staleness.batches_ahead), drawing prompts from ``draw``;
        returns the new batches (also queued in ``self.pending``)."""
        if self.rl.partial_rollout_tokens:
            return self._fill_partial(draw)
        new = []
        for j in batches_ahead(self.iteration, self.rl.max_staleness, self.rl.iterations):
            if j < self.next_batch:
                continue
            prompts, meta = draw()
            new.append(self.generate_batch(j, prompts, meta))
            self.pending.append(new[-1])
            self.next_batch = j + 1
        return new

    def _fill_partial(self, draw: Draw) -> list[GeneratedBatch]:
        """Partial rollouts (jrlhf.ppo.partial): start the batches the schedule wants, run one
        pass over every unfinished sample in flight with the current weights, then more passes
        over the batch this iteration trains until it has ended (only while the pipeline fills:
        later batches have had k passes). Returns the batches that ended in this call."""
        for j in batches_ahead(self.iteration, self.rl.max_staleness, self.rl.iterations):
            if j >= self.next_batch:
                prompts, meta = draw()
                self.pending.append(
                    partial.start_batch(j, prompts, meta, self.rl.samples_per_prompt)
                )
                self.next_batch = j + 1
        before = {g.index: g.complete for g in self.pending}
        sampling = self.rollout.sampling(self.iteration, salt=0)

        def one_pass(batches):
            counts = partial.run_pass(
                batches,
                lambda contexts, sp: self.rollout.engine.generate(self.gen_params, contexts, sp),
                sampling,
                version=self.iteration,
                tokens=self.rl.partial_rollout_tokens,
                max_len=self.R,
                run_seed=self.cfg.run.seed,
            )
            self.partial_stats["partial/recomputed_tokens"] += counts["recomputed_tokens"]

        self.partial_stats = {"partial/recomputed_tokens": 0}
        one_pass(list(self.pending))
        while self.pending and self.pending[0].index == self.iteration:
            if self.pending[0].complete:
                break
            one_pass([self.pending[0]])
        return [g for g in self.pending if g.complete and not before[g.index]]

    def run_async_iteration(self, draw: Draw) -> dict[str, float]:
        """One iteration of the bounded-staleness schedule (``RLConfig.max_staleness``, see
        jrlhf.ppo.staleness): generate the batches due (batch ``iteration + k`` with the current
        weights), then score and train on batch ``iteration``, which was generated with version
        ``max(iteration - k, 0)``. ``draw()`` gives the next prompts and their meta. With
        ``k = 0`` this is :meth:`run_iteration` without dynamic sampling, number for number."""
        if self.side == "generate":
            return self._generate_side_iteration(draw)
        if self.side == "train":
            return self._train_side_iteration()
        it, k = self.iteration, self.rl.max_staleness
        timer = PhaseTimer()
        with timer.phase("generate"):
            self.residency.enter("generate")
            self.fill_pipeline(draw)
        gen = self.pending.popleft()
        if gen.index != it or not gen.complete:
            raise StalenessError(f"iteration {it} would train on batch {gen.index} (unfinished)")
        with timer.phase("score"):
            self.residency.enter("score")
            arrays = self.score_batch(gen)
        versions = versions_bt(gen.token_versions, self.R)
        # The bound, checked on the tokens themselves, whatever produced them.
        check_staleness(versions, arrays["mask"], it, k)
        rounds = [(gen.sample_prompts, gen.completions, arrays)]
        metrics = self._train_on_rounds(rounds, len(gen.prompts), timer)
        if k:
            metrics.update(staleness_metrics(versions, arrays["mask"], it))
        if self.rl.partial_rollout_tokens:
            metrics.update(partial.continuation_metrics(gen))
            metrics.update({name: float(v) for name, v in self.partial_stats.items()})
        return metrics

    # Process 0 (generation) and process 1 (everything else) of a separated plan: each runs its
    # own calls with process-local host reads, and they meet once per iteration. Samples go
    # 0 -> 1 through the key-value store as soon as generated; weights go 1 -> 0 through the
    # resharder (a cross-host transfer both make, then a host barrier); the iteration's metrics
    # and KL coefficient follow 1 -> 0, so process 0 (which writes logs and checkpoint meta)
    # knows them.
    def _generate_side_iteration(self, draw: Draw) -> dict[str, float]:
        it = self.iteration
        timer = PhaseTimer()
        with process_local(), timer.phase("generate"):
            new = self.fill_pipeline(draw)
        for g in new:
            post(f"async/batch/{g.index}", json.dumps(g.to_json()).encode())
        with timer.phase("wait_for_update") as ph:
            moved = self.sync_weights()
            ph.block_on(self.gen_params)
        remote = json.loads(fetch(f"async/metrics/{it}"))
        trained = self.pending.popleft()  # process 1 trained on it this iteration
        assert trained.index == it, (trained.index, it)
        self.kl_ctl = dataclasses.replace(self.kl_ctl, value=jnp.float32(remote.pop(_KL_NEXT)))
        self.iteration += 1
        tokens = sum(len(c) for g in new for c in g.completions)
        mine = timer.summary()
        return {
            **remote,
            "time/generate": mine["time/generate"],
            "time/wait_for_update": mine["time/wait_for_update"],
            "tokens_per_sec": float(tokens / max(mine["time/generate"], 1e-9)),
            "reshard/bytes": float(moved),
        }

    def _train_side_iteration(self) -> dict[str, float]:
        it, k = self.iteration, self.rl.max_staleness
        timer = PhaseTimer()
        with timer.phase("wait_for_samples"):
            if not self.pending:  # batches restored from a checkpoint are here already
                self.pending.append(
                    GeneratedBatch.from_json(json.loads(fetch(f"async/batch/{it}")))
                )
        gen = self.pending.popleft()
        if gen.index != it:
            raise StalenessError(f"iteration {it} would train on batch {gen.index}")
        with process_local():
            with timer.phase("score"):
                arrays = self.score_batch(gen)
            versions = versions_bt(gen.token_versions, self.R)
            check_staleness(versions, arrays["mask"], it, k)
            rounds = [(gen.sample_prompts, gen.completions, arrays)]
            metrics = self._train_on_rounds(rounds, len(gen.prompts), timer)
        metrics.update(staleness_metrics(versions, arrays["mask"], it))
        message = {**metrics, _KL_NEXT: float(self.kl_ctl.value)}
        post(f"async/metrics/{it}", json.dumps(message).encode())
        return metrics

    def score_batch(self, gen: GeneratedBatch) -> dict[str, np.ndarray]:
        """The scored arrays of a generated batch (reference, reward, critic; shaped scores)."""
        arrays = self.scorer(
            gen.sample_prompts, gen.completions, gen.raw_logprobs, meta=gen.sample_meta
        )
        arrays["train_scores"] = self._shaped_scores(arrays)
        return arrays

    def _train_on_rounds(
        self,
        rounds: list[tuple[list[Sequence[int]], list[list[int]], dict[str, np.ndarray]]],
        n_groups: int,
        timer: PhaseTimer,
    ) -> dict[str, float]:
        """The rest of an iteration once its rounds are generated and scored: group selection,
        advantages, the off-policy correction, the update, the weight transition and the
        iteration's metrics; advances ``self.iteration``."""
        it = self.iteration
        # Everything generated describes the policy (reward, KL, lengths); the groups selected
        # from it are what the update trains on, always prompts_per_iteration groups.
        if len(rounds) == 1:
            rep_prompts, responses, arrays = rounds[0]
        else:
            rep_prompts = [p for r in rounds for p in r[0]]
            responses = [c for r in rounds for c in r[1]]
            arrays = {k: np.concatenate([r[2][k] for r in rounds]) for k in rounds[0][2]}
        batch, sampling_metrics = self._select_groups(arrays, n_groups, len(rounds))
        # The update's own copy: the off-policy correction replaces its old_logprobs with the
        # proximal ones, while the metrics and the KL controller below read the log-probs of
        # the policy that sampled (arrays).
        batch = dict(batch)
        if not self.use_reference:
            # The rollout's own log-probs stand in for the reference's: the KL is exactly 0 and
            # so is its coefficient, and advantages and the compiled step stay those of a run
            # that scores the reference (the same programs give bit-identical updates).
            batch = dict(batch, ref_logprobs=batch["old_logprobs"])
        mask = arrays["mask"]

        with timer.phase("score"):
            kl_coef = np.float32(self.kl_ctl.value)
            adv, returns = self.advantages(
                batch["train_scores"],
                batch["old_logprobs"],
                batch["ref_logprobs"],
                batch["old_values"],
                batch["mask"],
                kl_coef,
            )
            batch["advantages"] = np.asarray(adv)
            batch["returns"] = np.asarray(returns)
            offpolicy_metrics = self._correct_off_policy(batch)

        me = str(jax.process_index())
        if os.environ.get(_EXIT_AT_ENV) == str(it) and os.environ.get(_EXIT_PROCESS_ENV, me) == me:
            os._exit(137)

        with timer.phase("train"):
            self.residency.enter("train")
            train_metrics = self.update(batch, kl_coef)  # fetches its metrics: synchronous

        with timer.phase("reshard") as ph:
            self.residency.enter("reshard")
            moved = self.sync_weights()
            ph.block_on((self.gen_params, self.critic_infer_params))

        summary = self.scorer.summarize(arrays, rep_prompts, responses)
        kl_metrics = {}  # none without a reference, rather than a made-up 0
        if self.use_reference:
            # The adaptive controller observes the configured estimator's per-token KL (see
            # RLConfig.adaptive_kl_target); the reported "kl" stays the per-sequence sum of k1.
            kl_token = float(
                algos.observed_kl(
                    arrays["old_logprobs"], arrays["ref_logprobs"], mask, self.kl_estimator
                )
            )
            self.kl_ctl = self.kl_ctl.update(kl_token, len(batch["mask"]))
            kl_metrics = {"kl": summary["kl_to_ref"], "kl_token_mean": kl_token}
        lengths = mask.sum(axis=1)
        metrics = {
            "reward": summary["reward"],
            **kl_metrics,
            "kl_coef": float(kl_coef),
            "response_len": summary["response_len"],
            # a synchronous rollout decodes until its longest response ends
            "response_len_max": float(lengths.max()) if lengths.size else 0.0,
            "tokens_per_sec": float(lengths.sum() / max(timer.totals["generate"], 1e-9)),
            **timer.summary(),
            # The weight transition after the update: its time is time/reshard (this
            # process's wall time; process 0's is logged, which with separated processes
            # receives the actor, so it includes the cross-host transfer); these are the bytes
            # that crossed devices (shard-for-shard copies and layout changes).
            "reshard/bytes": float(moved),
            **train_metrics,
        }
        if "gt_score" in summary:
            metrics["gt_score"] = summary["gt_score"]
        if self.rl.overlong_buffer:
            penalty = arrays["scores"] - arrays["train_scores"]
            metrics["overlong/frac"] = float(np.mean(penalty > 0))
            metrics["overlong/penalty_mean"] = float(np.mean(penalty))
        metrics.update(sampling_metrics)
        metrics.update(offpolicy_metrics)
        if self.rollout.fusion_rows:  # RLConfig.fusion: chunks scored early, rows migrated
            metrics.update({k: float(v) for k, v in self.rollout.fusion_stats.items()})
        self.iteration += 1
        return metrics

    def _correct_off_policy(self, batch: dict[str, np.ndarray]) -> dict[str, float]:
        """With ``RLConfig.off_policy_correction``: recompute the proximal log-probs with the
        actor's training weights, make them the ``old_logprobs`` the PPO ratio is taken against,
        keep the generation's as ``behaviour_logprobs``, and add the per-token importance
        weights (``is_weights``). Returns the ``offpolicy/*`` metrics (none when off)."""
        if self.prox_logprobs is None:
            return {}
        keys = ("tokens", "positions", "segment_ids", "response_tokens", "mask")
        prox = self.prox_logprobs(self.states["actor"].params, {k: batch[k] for k in keys})
        prox = np.asarray(to_host(prox), np.float32)
        weights, m = algos.behaviour_importance_weights(
            prox, batch["old_logprobs"], batch["mask"], self.rl.off_policy_correction,
            self.rl.is_cap,
        )  # fmt: skip
        batch["behaviour_logprobs"] = batch["old_logprobs"]
        batch["old_logprobs"] = prox
        batch["is_weights"] = np.asarray(weights, np.float32)
        return {f"offpolicy/{k}": float(v) for k, v in to_host(m).items()}

    def _shaped_scores(self, arrays: dict[str, np.ndarray]) -> np.ndarray:
        """The scores advantages see: the reward's, minus DAPO's overlong penalty when
        ``RLConfig.overlong_buffer`` is set."""
        if not self.rl.overlong_buffer:
            return arrays["scores"]
        penalty = algos.overlong_penalty(
            arrays["mask"], self.rl.overlong_buffer, self.rl.overlong_penalty, self.R
        )
        return (arrays["scores"] - np.asarray(penalty)).astype(np.float32)

    def _select_groups(
        self, arrays: dict[str, np.ndarray], n_groups: int, rounds: int
    ) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """The ``n_groups`` groups to train on, and the sampling metrics (none without dynamic
        sampling, which trains on everything generated)."""
        if not self.rl.dynamic_sampling:
            return arrays, {}
        keep_g = np.asarray(algos.groups_with_signal(arrays["train_scores"], self.group))
        chosen_g = np.asarray(algos.select_groups(keep_g, n_groups))
        rows = (chosen_g[:, None] * self.group + np.arange(self.group)).reshape(-1)
        kept = int(keep_g.sum())
        metrics = {
            "sampling/rounds": float(rounds),
            "sampling/groups_kept": float(kept),
            "sampling/groups_dropped": float(len(keep_g) - kept),
            # Dropped groups trained on because max_sampling_rounds ran out (under a group
            # baseline their advantage is 0: they add only the KL and entropy terms' gradients).
            "sampling/filler_groups": float(max(n_groups - kept, 0)),
        }
        return {k: v[rows] for k, v in arrays.items()}, metrics

    def _pack(self, batch: dict[str, np.ndarray], role: str) -> tuple[dict[str, np.ndarray], int]:
        """(batch, micro-batches) for the role's train step. With ``RLConfig.pack_samples``,
        the minibatch's samples packed into rows without padding (jrlhf.ppo.batch.pack_segments),
        one block per micro-batch. With ``RoleConfig.microbatch_tokens``, the fewest
        micro-batches within that many tokens per device (jrlhf.data.batch.fit_microbatches),
        else ``RoleConfig.microbatches``."""
        setup = self.roles[role]
        shards = batch_shards(setup.meshes["train"], setup.rules["train"])
        budget = setup.config.microbatch_tokens
        if budget:
            m, batch = fit_microbatches(batch, budget, shards, self.P, pack=self.rl.pack_samples)
            return batch, m
        m = setup.config.microbatches
        if not self.rl.pack_samples:
            return batch, m
        packed = rl_batch.pack_segments(batch, self.P, self.P + self.R, m, shards)
        return packed, m

    def update(self, arrays: dict[str, np.ndarray], kl_coef) -> dict[str, float]:
        rows = arrays["mask"].shape[0]
        mb = self.rl.minibatch_size
        fields = (
            "tokens",
            "positions",
            "segment_ids",
            "response_tokens",
            "mask",
            "old_logprobs",
            "advantages",
            "ref_logprobs",
        ) + (("is_weights",) if "is_weights" in arrays else ())
        critic_fields = ("tokens", "positions", "segment_ids", "mask", "old_values", "returns")
        rng = np.random.default_rng([self.seed, self.iteration, 7])
        # Metrics stay on device until the end, so actor and critic steps (which may run on
        # different devices) are dispatched back to back without a host sync in between.
        collected: list[dict] = []
        splits: dict[str, list[int]] = collections.defaultdict(list)
        for _ in range(self.rl.epochs):
            order = rng.permutation(rows)
            for start in range(0, rows, mb):
                idx = order[start : start + mb]
                batch, split = self._pack({k: arrays[k][idx] for k in fields}, "actor")
                batch["kl_coef"] = np.full((len(idx),), kl_coef, np.float32)
                step = self.steps["actor"]
                self.states["actor"], m = step(self.states["actor"], batch, split)
                splits["train/microbatches"].append(split)
                if self.use_critic:
                    cbatch, split = self._pack({k: arrays[k][idx] for k in critic_fields}, "critic")
                    step = self.steps["critic"]
                    self.states["critic"], cm = step(self.states["critic"], cbatch, split)
                    splits["train/critic/microbatches"].append(split)
                    m = {**m, **{f"critic/{k}": v for k, v in cm.items()}}
                collected.append(m)
        stacked = to_host({k: [m[k] for m in collected] for k in collected[0]})
        where = f"iteration {self.iteration + 1}"  # as metrics and checkpoints number it
        out = {
            "train/skipped_updates": float(self.guard.record("actor", stacked["skipped"], where))
        }
        if self.use_critic:
            skipped = self.guard.record("critic", stacked["critic/skipped"], where)
            out["train/critic/skipped_updates"] = float(skipped)
        skip = {"weight", "critic/weight", "num_tokens", "skipped", "critic/skipped"}
        if not self.use_reference:  # the KL loss term against the stand-in is 0 by construction
            skip |= {"kl_loss", "kl_clampfrac"}
        out.update({f"train/{k}": float(np.mean(v)) for k, v in stacked.items() if k not in skip})
        # With a token budget the split varies with the batch: its mean over the minibatches.
        for role, key in (("actor", "train/microbatches"), ("critic", "train/critic/microbatches")):
            if key in splits and self.roles[role].config.microbatch_tokens:
                out[key] = float(np.mean(splits[key]))
        return out

    # -- evaluation ------------------------------------------------------------------------
    def evaluate(
        self,
        prompts: list[list[int]],
        samples: int = 1,
        meta: Sequence[Mapping[str, Any]] | None = None,
    ) -> dict[str, float]:
        """Sampled completions on held-out prompts: ground truth, reward model and KL to ref
        (the same rollout and sampling as ``python -m jrlhf.evaluate``); ``meta`` as in
        :meth:`run_iteration`."""
        self.residency.fetch_all()
        return self.rollout.evaluate(self.gen_params, prompts, samples, meta=meta)

    # -- checkpoints -----------------------------------------------------------------------
    def save(self, loader_state: dict[str, int]) -> None:
        """Asynchronous save of everything a resume needs (layout: jrlhf.checkpoint); Orbax
        renames the step into place only once every item is written, so a crash mid-save
        leaves the last good step."""
        self.residency.fetch_all()
        meta = {
            "iteration": self.iteration,
            "algorithm": self.algorithm,
            "loader": loader_state,
            "kl_coef": float(self.kl_ctl.value),
            "seed": self.seed,
        }
        if self.rl.max_staleness:
            # Generated, not yet trained on: a resume trains on these very samples.
            meta["pending"] = [g.to_json() for g in self.pending]
        for role in self.trained:
            check_finite(
                self.states[role], f"{self.algorithm} {role} at iteration {self.iteration}"
            )
        checkpoint.save_trainer_state(
            self.ckpt,
            self.iteration,
            meta,
            {role: self.states[role] for role in self.trained},
            {role: self.roles[role].model for role in self.trained},
        )

    def restore(self) -> dict[str, int] | None:
        """Restore the latest complete checkpoint; returns the loader state (None if none)."""
        self.residency.fetch_all()
        targets = {}
        for role in self.trained:
            setup = self.roles[role]
            shardings = state_shardings(
                setup.model, self.opts[role], setup.meshes["train"], setup.rules["train"]
            )
            targets[role] = checkpoint.restore_target(self.states[role], shardings)
        restored = checkpoint.restore_trainer_state(self.ckpt, targets)
        if restored is None:
            return None
        meta, states = restored
        self.states.update(states)
        self.kl_ctl = dataclasses.replace(self.kl_ctl, value=jnp.float32(meta["kl_coef"]))
        self.iteration = int(meta["iteration"])
        self.pending = collections.deque(
            GeneratedBatch.from_json(g) for g in meta.get("pending", [])
        )
        self.next_batch = self.iteration + len(self.pending)
        self.sync_weights()
        return meta["loader"]

    def wait_for_checkpoints(self) -> None:
        self.ckpt.wait_until_finished()
