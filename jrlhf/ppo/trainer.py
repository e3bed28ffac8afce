"""The PPO / GRPO trainer: builds the parts of an RL iteration and runs them, a story in order.

One iteration::

    prompts -> actor generate (generation mesh, paged-KV decode)     rollout.py
            -> reference log-probs, reward scores, critic values       scoring.py
            -> group selection, advantages, off-policy correction,
               epochs of minibatch steps (training meshes, donated)    update.py
            -> trained weights to the layouts that read them next      weights.py

A schedule (jrlhf.ppo.schedules) decides which batch each part works on and who waits for whom:
synchronous, or bounded staleness (``Asynchrony.max_staleness``), where generation of the next
batches runs while this one trains and batches cross between process groups through the sample
channel (jrlhf.ppo.samples). :meth:`RLTrainer.fit` is the loop: schedule -> log -> checkpoint.

Everything random is a function of (seed, iteration, generation round), and the checkpoint
holds the loader position (past every prompt an iteration drew), the KL controller and the
batches generated but not yet trained on, so a resumed run repeats the uninterrupted one exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jrlhf import checkpoint
from jrlhf.config import Config
from jrlhf.envs import EnvSetup, env_metrics
from jrlhf.meshes.mesh import mesh_devices
from jrlhf.metrics import PhaseTimer
from jrlhf.placement.plan import ExecutionPlan
from jrlhf.ppo import batch as rl_batch
from jrlhf.ppo.fusion import fusion_score_rows, tail_migration
from jrlhf.ppo.groups import role_groups
from jrlhf.ppo.producer import Draw
from jrlhf.ppo.residency import Residency
from jrlhf.ppo.rollout import Rollout
from jrlhf.ppo.schedules import BoundedStaleness, Synchronous
from jrlhf.ppo.schedules.synchronous import Round
from jrlhf.ppo.scoring import Scorer
from jrlhf.ppo.staleness import GeneratedBatch
from jrlhf.ppo.update import Update
from jrlhf.ppo.weights import WeightChannel
from jrlhf.runtime.guard import check_finite
from jrlhf.runtime.preempt import exit_if_asked
from jrlhf.runtime.roles import RoleSetup, frozen_infer, make_infer
from jrlhf.tasks.rewards import RewardFn


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
        env: EnvSetup | None = None,
    ):
        self.cfg, self.rl, self.algorithm = cfg, cfg.rl, algorithm
        self.roles, self.data = roles, data
        self.run_dir = Path(run_dir)
        self.P, self.R = cfg.task.max_prompt_len, cfg.task.max_response_len
        self.plan = plan
        # First, before any program or transfer: the process groups of an asynchronous run, and
        # their refusals (every process refuses at the same point, none waiting on another).
        groups = role_groups(self.rl, roles)
        # The trained roles' states and steps, on their training meshes.
        self.update = Update(cfg, algorithm, roles)
        self.trained = self.update.trained
        self.scorer = self._build_scorer(reward_fn)
        # Generation: the engine lives on the actor's generation mesh; trained weights follow
        # the plan's reshard edges through the weight channel.
        actor = roles["actor"]
        scoring = [roles[r] for r in ("reference", "reward", "critic") if r in roles]
        fusion_rows = 0
        if (
            self.rl.fusion.enabled
        ):  # scoring calls of this many rows must split over every scoring mesh
            fusion_rows = fusion_score_rows(
                self.rl.fusion.score_rows,
                self.rl.prompts_per_iteration * self.rl.samples_per_prompt,
                [(r.meshes["infer"], r.rules["infer"]) for r in scoring],
            )
        self.rollout = Rollout.build(
            actor.model.base, actor.meshes["generate"], actor.rules["generate"], self.scorer, cfg,
            data.stop_ids, fusion_rows, env=env,
        )  # fmt: skip
        self.weights = WeightChannel(plan, roles, self.trained)
        if self.rl.fusion.migrate_rows:  # RLHFuse's migration: the tail leaves the scoring devices
            self.rollout.migration = tail_migration(
                self.rollout.engine,
                self.rl.fusion.migrate_rows,
                self.rl.fusion.migrate_replicas,
                avoid=set().union(*(mesh_devices(r.meshes["infer"]) for r in scoring)),
                transfer=self.weights.resharder,
            )
        self.weights.sync(self.states)
        # The memory knobs (Memory.offload, generation_copy): idle state off the devices.
        self.residency = Residency(self)
        self.iteration = 0
        parts = (self.rollout, self.scorer, self.residency, self.weights)
        self.synchronous = Synchronous(self.rl, self.R, *parts, self.learn)
        self.bounded = BoundedStaleness(
            self.rl, self.R, cfg.run.seed, *parts, self.update, self.learn,
            groups=groups,
        )  # fmt: skip
        self.ckpt = checkpoint.trainer_checkpoint_manager(
            self.run_dir,
            max_to_keep=self.rl.keep_checkpoints,
            async_save=self.rl.async_checkpoint,
        )

    def _build_scorer(self, reward_fn: RewardFn | None) -> Scorer:
        """Reference log-probs, reward (a frozen model or ``reward_fn``) and critic values on
        their inference meshes; the critic reads the weight channel's inference copy."""
        cfg, roles, batch_size = self.cfg, self.roles, self.rl.memory.infer_batch_size

        def frozen(role: str, fn):
            setup = roles[role]
            return frozen_infer(
                setup.source, setup.meshes["infer"], setup.rules["infer"], fn, cfg.run.seed,
                batch_size,
            )  # fmt: skip

        critic_fn = None
        if self.update.use_critic:
            critic = roles["critic"]
            critic_values = make_infer(
                self.weights_model("critic"),
                critic.meshes["infer"],
                critic.rules["infer"],
                rl_batch.values_fn(self.P),
                batch_size,
            )
            critic_fn = lambda arrays: critic_values(self.critic_infer_params, arrays)  # noqa: E731
        reference = None
        if self.update.use_reference:
            reference = frozen("reference", rl_batch.logprobs_fn(self.P))
        return Scorer(
            self.P,
            self.R,
            self.data.pad_id,
            reference,
            reward_model=None if reward_fn else frozen("reward", rl_batch.sequence_scores),
            reward_fn=reward_fn,
            critic=critic_fn,
            reward_scale=self.rl.reward_scale,
            ground_truth=self.data.ground_truth,
            decode=self.data.decode,
            reward_name=cfg.task.reward_fn or None,
        )

    def weights_model(self, role: str):
        """The model that reads ``role``'s weights outside its train step: the plain (merged)
        model where the weight channel moves them (a LoRA role's copies are merged,
        jrlhf.ppo.weights), else the role's own, reading its training state."""
        model = self.roles[role].model
        moved = any(edge.role == role for edge in self.plan.reshard_edges())
        return model.base if moved else model

    # -- the parts' state, by the names the rest of the package reads ------------------------------
    @property
    def states(self) -> dict[str, Any]:
        """The trained roles' train states (params and optimizer state) on their training meshes."""
        return self.update.states

    @property
    def steps(self) -> dict[str, Any]:
        return self.update.steps

    @property
    def moved(self) -> dict[str, Any]:
        return self.weights.moved

    @property
    def resharder(self):
        return self.weights.resharder

    @property
    def pending(self):
        """Batches generated and not yet trained on (bounded staleness), oldest first."""
        return self.bounded.pending

    @property
    def gen_params(self):
        """The actor's parameters in its generation layout."""
        return self.weights.gen_params

    @property
    def critic_infer_params(self):
        """The critic's parameters in its inference layout; None without a critic."""
        return self.weights.infer_params("critic", self.states) if self.update.use_critic else None

    def sync_weights(self, roles: Sequence[str] | None = None) -> int:
        """Refresh the weight channel from the training states; returns the bytes moved."""
        return self.weights.sync(self.states, roles)

    # -- the loop ------------------------------------------------------------------------------
    def fit(self, draw: Draw, on_iteration: Callable[[dict[str, float]], None]) -> None:
        """Run the configured schedule until ``RLConfig.iterations``; ``draw()`` gives the next
        prompts and their meta, ``on_iteration(metrics)`` logs and checkpoints."""
        while self.iteration < self.rl.iterations:
            if self.rl.asynchrony.max_staleness:
                metrics = self.run_async_iteration(draw)
            else:
                # Dynamic sampling draws more batches from the loader through ``draw``.
                metrics = self.run_iteration(*draw(), refill=draw)
            on_iteration(metrics)

    def run_iteration(
        self,
        prompts: list[list[int]],
        meta: Sequence[Mapping[str, Any]] | None = None,
        refill: Draw | None = None,
    ) -> dict[str, float]:
        """One synchronous iteration on ``prompts`` (jrlhf.ppo.schedules.Synchronous)."""
        metrics = self.synchronous(self.iteration, prompts, meta, refill)
        self.iteration += 1
        return metrics

    def run_async_iteration(self, draw: Draw) -> dict[str, float]:
        """One iteration of the bounded-staleness schedule (jrlhf.ppo.schedules.BoundedStaleness);
        with ``k = 0`` it equals :meth:`run_iteration` without dynamic sampling."""
        metrics = self.bounded(self.iteration, draw)
        self.iteration += 1
        return metrics

    def learn(
        self,
        rounds: list[Round],
        n_groups: int,
        timer: PhaseTimer,
        iteration: int,
        before_sync: Callable[[], None] | None = None,
    ) -> dict[str, float]:
        """The rest of an iteration once its rounds are generated and scored: the update, the
        weight transition (after ``before_sync()``, where given), the iteration's metrics."""
        # Everything generated describes the policy (reward, KL, lengths); the groups selected
        # from it are what the update trains on, always prompts_per_iteration groups.
        prompts = [p for r in rounds for p in r[0]]
        responses = [c for r in rounds for c in r[1]]
        arrays = rounds[0][2]
        if len(rounds) > 1:
            arrays = {k: np.concatenate([r[2][k] for r in rounds]) for k in arrays}
        with timer.phase("score"):
            batch, kl_coef, update_metrics = self.update.prepare(arrays, n_groups, len(rounds))
        exit_if_asked(iteration)  # a test's preemption, while this iteration trains
        with timer.phase("train"):
            self.residency.enter("train")
            train_metrics = self.update.step(batch, kl_coef, iteration)
        if before_sync is not None:
            before_sync()
        with timer.phase("reshard") as ph:
            self.residency.enter("reshard")
            moved = self.sync_weights()
            ph.block_on((self.gen_params, self.critic_infer_params))
        summary = self.scorer.summarize(arrays, prompts, responses)
        kl_token = self.update.observe_kl(arrays, len(batch["mask"]))
        # none without a reference, rather than a made-up 0
        kl = {} if kl_token is None else {"kl": summary["kl_to_ref"], "kl_token_mean": kl_token}
        lengths = arrays["mask"].sum(axis=1)
        metrics = {
            "reward": summary["reward"],
            **kl,
            "kl_coef": float(kl_coef),
            "response_len": summary["response_len"],
            # a synchronous rollout decodes until its longest response ends
            "response_len_max": float(lengths.max()) if lengths.size else 0.0,
            "tokens_per_sec": float(lengths.sum() / max(timer.totals["generate"], 1e-9)),
            **timer.summary(),
            # The weight transition's bytes that crossed devices; its time is time/reshard
            # (process 0's, which receives the actor when processes are separated).
            "reshard/bytes": float(moved),
            **train_metrics,
        }
        if "gt_score" in summary:
            metrics["gt_score"] = summary["gt_score"]
        if self.rl.filters.overlong_buffer:
            penalty = arrays["scores"] - arrays["train_scores"]
            metrics["overlong/frac"] = float(np.mean(penalty > 0))
            metrics["overlong/penalty_mean"] = float(np.mean(penalty))
        metrics.update(update_metrics)
        if self.rollout.fusion_rows:  # Fusion.enabled: chunks scored early, rows migrated
            metrics.update({k: float(v) for k, v in self.rollout.fusion_stats.items()})
        metrics.update(env_metrics(arrays))  # multi-turn: turns, tool calls, tokens by source
        return metrics

    # -- evaluation and checkpoints ------------------------------------------------------------
    def evaluate(
        self,
        prompts: list[list[int]],
        samples: int = 1,
        meta: Sequence[Mapping[str, Any]] | None = None,
    ) -> dict[str, float]:
        """Sampled completions on held-out prompts: ground truth, reward model and KL to ref
        (the same rollout and sampling as ``python -m jrlhf.evaluate``)."""
        self.residency.fetch_all()
        return self.rollout.evaluate(self.gen_params, prompts, samples, meta=meta)

    def save(self, loader_state: dict[str, int]) -> None:
        """Asynchronous save of everything a resume needs (layout: jrlhf.checkpoint); Orbax
        renames the step into place only once every item is written, so a crash mid-save
        leaves the last good step."""
        self.residency.fetch_all()
        meta = {
            "iteration": self.iteration,
            "algorithm": self.algorithm,
            "loader": loader_state,
            "kl_coef": float(self.update.kl_ctl.value),
            "seed": self.cfg.run.seed,
        }
        if self.rl.asynchrony.max_staleness:
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
            self.update.bases,
        )

    def restore(self) -> dict[str, int] | None:
        """Restore the latest complete checkpoint; returns the loader state (None if none)."""
        self.residency.fetch_all()
        restored = checkpoint.restore_trainer_state(self.ckpt, self.update.state_targets())
        if restored is None:
            return None
        meta, states = restored
        self.update.with_restored(states)
        self.update.set_kl_coef(meta["kl_coef"])
        self.iteration = int(meta["iteration"])
        pending = [GeneratedBatch.from_json(g) for g in meta.get("pending", [])]
        self.bounded.restore(pending, self.iteration)
        self.sync_weights()
        return meta["loader"]

    def wait_for_checkpoints(self) -> None:
        self.ckpt.wait_until_finished()
