"""The update: one scored batch in, trained actor (and critic) states out.

Group selection (dynamic sampling), DAPO's overlong shaping of the scores, advantages, the
off-policy correction (proximal log-probs and importance weights), the epochs of minibatch
steps on the training meshes with donated state, the KL controller, and the update's metrics.
Everything the update reads comes in as arguments; what it keeps across iterations is the
training state, the KL controller and the non-finite update guard.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from jrlhf import checkpoint
from jrlhf.config import Config, ConfigError
from jrlhf.data.batch import fit_microbatches
from jrlhf.meshes.batch import batch_shards, to_host
from jrlhf.meshes.rules import axis_size, logical_to_spec
from jrlhf.models import fused_schedule
from jrlhf.models.moe import rollout_routing_metrics
from jrlhf.ppo import batch as rl_batch
from jrlhf.ppo import core_algos as algos
from jrlhf.ppo.losses import actor_loss, critic_loss, make_advantage_fn
from jrlhf.runtime.fused_step import make_fused_train_step
from jrlhf.runtime.guard import UpdateGuard
from jrlhf.runtime.model_source import load_weights
from jrlhf.runtime.roles import RoleSetup, make_infer
from jrlhf.runtime.steps import (
    OptimizerConfig,
    init_train_state,
    make_optimizer,
    make_train_step,
    state_shardings,
)

_ACTOR_FIELDS = (
    "tokens",
    "positions",
    "segment_ids",
    "response_tokens",
    "mask",
    "old_logprobs",
    "advantages",
    "ref_logprobs",
)
_CRITIC_FIELDS = ("tokens", "positions", "segment_ids", "mask", "old_values", "returns")


def loss_mask(arrays: Mapping[str, np.ndarray]) -> np.ndarray:
    """The tokens the losses, advantages and KL count: the policy's own (``loss_mask``, in a
    multi-turn rollout's arrays), else every response token (``mask``)."""
    return arrays.get("loss_mask", arrays["mask"])


def optimizer_config(setup: RoleSetup) -> OptimizerConfig:
    """The optimizer a role's ``RoleConfig`` asks for."""
    rc = setup.config
    return OptimizerConfig(
        learning_rate=rc.learning_rate,
        warmup_steps=rc.warmup_steps,
        weight_decay=rc.weight_decay,
        grad_clip=rc.grad_clip,
    )


def shaped_scores(rl, max_response_len: int, arrays: Mapping[str, np.ndarray]) -> np.ndarray:
    """The scores advantages see: the reward's, minus DAPO's overlong penalty when
    ``SampleFilters.overlong_buffer`` is set."""
    if not rl.filters.overlong_buffer:
        return arrays["scores"]
    penalty = algos.overlong_penalty(
        arrays["mask"], rl.filters.overlong_buffer, rl.filters.overlong_penalty, max_response_len
    )
    return (arrays["scores"] - np.asarray(penalty)).astype(np.float32)


def fused_step(
    roles: Mapping[str, RoleSetup], opts: Mapping[str, Any], losses: Mapping[str, Any], rows: int
):
    """The fused actor-critic train step of ``rows``-row minibatches on the actor's and
    critic's shared training mesh, on the schedule ``fused_schedule.step_schedule`` picks
    (unit costs, a memory limit of what either model's 1F1B step alone keeps; the estimator
    prices the same one). One ConfigError when the meshes differ, have no stage
    axis, or the rows do not split into a model's pipeline micro-batches."""
    actor, critic = roles["actor"], roles["critic"]
    setting = "critic/RoleConfig.pipeline_schedule"
    meshes = [r.meshes["train"] for r in (actor, critic)]
    same = (
        meshes[0].shape == meshes[1].shape
        and np.array_equal(meshes[0].device_ids, meshes[1].device_ids)
        and actor.rules["train"] == critic.rules["train"]
    )
    if not same:
        raise ConfigError(
            f"{setting}: 'fused' needs the actor and the critic on one training mesh and rule "
            f"set; actor {dict(meshes[0].shape)}, critic {dict(meshes[1].shape)}"
        )
    mesh, rules = meshes[0], actor.rules["train"]
    stages = axis_size(mesh, logical_to_spec(("layers",), mesh, rules)[0])
    if stages < 2:
        raise ConfigError(
            f"{setting}: 'fused' needs a stage axis of 2 or more in the actor's and critic's "
            f"training mesh, got {dict(mesh.shape)}"
        )
    micro = []
    for r in (actor, critic):
        m = r.model.config.pipeline_microbatches or stages
        if rows % m:
            raise ConfigError(
                f"{r.name}/RoleConfig.pipeline_microbatches: the fused schedule cuts each "
                f"minibatch's {rows} rows (RLConfig.minibatch_size) into {m} equal "
                "micro-batches, which they do not make"
            )
        micro.append(m)
    hidden = (actor.model.config.hidden_size, critic.model.config.hidden_size)
    found = fused_schedule.step_schedule(stages, (micro[0], micro[1]), rows, hidden)
    return make_fused_train_step(
        (actor.model, opts["actor"], losses["actor"]),
        (critic.model, opts["critic"], losses["critic"]),
        mesh,
        rules,
        found.schedule,
    )


class Update:
    """The trained roles' states and the steps that update them (``trained``: the actor, and the
    critic for PPO), built on their training meshes from their configured sources."""

    def __init__(self, cfg: Config, algorithm: str, roles: Mapping[str, RoleSetup]):
        self.rl, self.algorithm, self.roles = cfg.rl, algorithm, roles
        self.P, self.R = cfg.task.max_prompt_len, cfg.task.max_response_len
        self.seed = seed = cfg.run.seed
        self.use_critic = algorithm == "ppo"
        # Without a KL term (algos.uses_reference) the reference is neither built nor scored.
        self.use_reference = algos.uses_reference(cfg.rl)
        kl_in_loss = algos.kl_in_loss(cfg.rl, algorithm)
        kl_estimator = algos.kl_estimator_name(cfg.rl, algorithm)
        self.kl_estimator = kl_estimator
        self.trained = ["actor", "critic"] if self.use_critic else ["actor"]
        losses = {
            "actor": actor_loss(self.P, self.rl, kl_in_loss, kl_estimator),
            "critic": critic_loss(self.P, self.rl),
        }
        self.opts, self.states, self.steps = {}, {}, {}
        # Where each trained role's weights came from: a LoRA role's checkpoints hold only its
        # adapters, and name this to find the frozen base again (jrlhf.checkpoint.model_entry).
        self.bases = {}
        for i, role in enumerate(self.trained):
            setup = roles[role]
            mesh, rules = setup.meshes["train"], setup.rules["train"]
            self.opts[role] = make_optimizer(optimizer_config(setup))
            self.bases[role] = checkpoint.base_entry(setup.source.weights, seed + i)
            params = load_weights(setup.source, mesh, rules, seed + i)
            self.states[role] = init_train_state(
                setup.model, self.opts[role], mesh, rules, params=params
            )
            self.steps[role] = make_train_step(
                setup.model, self.opts[role], losses[role], mesh, rules,
                microbatches=setup.config.microbatches,
            )  # fmt: skip
        # critic/RoleConfig.pipeline_schedule='fused': each minibatch's actor and critic steps
        # as one fused pipeline program (jrlhf.runtime.fused_step) instead of the two steps.
        self.fused = None
        if self.use_critic and roles["critic"].config.pipeline_schedule == "fused":
            self.fused = fused_step(roles, self.opts, losses, self.rl.minibatch_size)
        # Off-policy correction: the actor's proximal log-probs, recomputed on its training mesh
        # with the weights the update starts from.
        self.prox_logprobs = None
        if self.rl.off_policy.correction != "none":
            actor = roles["actor"]
            self.prox_logprobs = make_infer(
                actor.model,
                actor.meshes["train"],
                actor.rules["train"],
                rl_batch.logprobs_fn(self.P),
                self.rl.memory.infer_batch_size,
            )
        # A mixture-of-experts actor whose rollouts record their routes (DecodeConfig.
        # record_routes): the training pass's routes and log-probs, compared in the metrics.
        self.route_probe = None
        if cfg.decode.record_routes:
            actor = roles["actor"]
            self.route_probe = make_infer(
                actor.model,
                actor.meshes["train"],
                actor.rules["train"],
                rl_batch.routes_fn(self.P),
                self.rl.memory.infer_batch_size,
            )
        self.group = cfg.rl.samples_per_prompt
        self.advantages = make_advantage_fn(self.rl, algorithm, self.group)
        self.kl_ctl = algos.make_kl_controller(
            "adaptive" if self.rl.adaptive_kl_target > 0 else "fixed",
            self.rl.kl_coef,
            target=self.rl.adaptive_kl_target or None,
            horizon=self.rl.adaptive_kl_horizon,
        )
        self.guard = UpdateGuard(cfg.run.max_nonfinite_updates, algorithm)

    def set_kl_coef(self, value: float) -> None:
        """Take the KL coefficient another process's update reached (or a checkpoint's)."""
        self.kl_ctl = dataclasses.replace(self.kl_ctl, value=jnp.float32(value))

    # -- before the steps ----------------------------------------------------------------------
    def prepare(
        self, arrays: dict[str, np.ndarray], n_groups: int, rounds: int
    ) -> tuple[dict[str, np.ndarray], np.float32, dict[str, float]]:
        """The batch the steps train on, the KL coefficient they use, and the sampling and
        off-policy metrics: groups selected, advantages and returns added, the off-policy
        correction applied."""
        batch, metrics = self.select_groups(arrays, n_groups, rounds)
        # The update's own copy: the off-policy correction replaces its old_logprobs with the
        # proximal ones, while the metrics and the KL controller read the log-probs of the
        # policy that sampled (arrays).
        batch = dict(batch)
        routes = batch.pop("rollout_routes", None)  # metrics only: never reaches the steps
        if routes is not None and self.route_probe is not None:
            metrics.update(self.compare_routes(batch, routes))
        if not self.use_reference:
            # The rollout's own log-probs stand in for the reference's: the KL is exactly 0 and
            # so is its coefficient, and advantages and the compiled step stay those of a run
            # that scores the reference (the same programs give bit-identical updates).
            batch = dict(batch, ref_logprobs=batch["old_logprobs"])
        kl_coef = np.float32(self.kl_ctl.value)
        # Multi-turn: observation tokens are not the policy's steps; GAE steps over them.
        adv, returns = self.advantages(
            batch["train_scores"],
            batch["old_logprobs"],
            batch["ref_logprobs"],
            batch["old_values"],
            loss_mask(batch),
            kl_coef,
        )
        batch["advantages"] = np.asarray(adv)
        batch["returns"] = np.asarray(returns)
        metrics.update(self.correct_off_policy(batch))
        return batch, kl_coef, metrics

    def select_groups(
        self, arrays: dict[str, np.ndarray], n_groups: int, rounds: int
    ) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """The ``n_groups`` groups to train on, and the sampling metrics (none without dynamic
        sampling, which trains on everything generated)."""
        if not self.rl.filters.dynamic_sampling:
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

    def compare_routes(self, batch: dict[str, np.ndarray], routes: np.ndarray) -> dict[str, float]:
        """The ``moe/*`` metrics: how often the training pass (the actor's training weights,
        before this update) routes the batch's response tokens differently from the rollout
        that recorded ``routes`` (B, R, layers, top_k), and the log-prob gaps that go with it
        (jrlhf.models.moe.rollout_routing_metrics)."""
        keys = ("tokens", "positions", "segment_ids", "response_tokens", "mask")
        out = np.asarray(
            to_host(self.route_probe(self.states["actor"].params, {k: batch[k] for k in keys})),
            np.float32,
        )
        train = out[..., 1:].astype(np.int32).reshape(routes.shape)
        return rollout_routing_metrics(
            routes, train, batch["old_logprobs"], out[..., 0], loss_mask(batch)
        )

    def correct_off_policy(self, batch: dict[str, np.ndarray]) -> dict[str, float]:
        """With ``OffPolicy.correction``: recompute the proximal log-probs with the
        actor's training weights, make them the ``old_logprobs`` the PPO ratio is taken against,
        keep the generation's as ``behaviour_logprobs``, and add the per-token importance
        weights (``is_weights``). Returns the ``offpolicy/*`` metrics (none when off)."""
        if self.prox_logprobs is None:
            return {}
        keys = ("tokens", "positions", "segment_ids", "response_tokens", "mask")
        prox = self.prox_logprobs(self.states["actor"].params, {k: batch[k] for k in keys})
        prox = np.asarray(to_host(prox), np.float32)
        weights, m = algos.behaviour_importance_weights(
            prox, batch["old_logprobs"], loss_mask(batch), self.rl.off_policy.correction,
            self.rl.off_policy.is_cap,
        )  # fmt: skip
        batch["behaviour_logprobs"] = batch["old_logprobs"]
        batch["old_logprobs"] = prox
        batch["is_weights"] = np.asarray(weights, np.float32)
        return {f"offpolicy/{k}": float(v) for k, v in to_host(m).items()}

    # -- the steps -------------------------------------------------------------------------------
    def pack(self, batch: dict[str, np.ndarray], role: str) -> tuple[dict[str, np.ndarray], int]:
        """(batch, micro-batches) for the role's train step. With ``Memory.pack_samples``,
        the minibatch's samples packed into rows without padding (jrlhf.ppo.batch.pack_segments),
        one block per micro-batch. With ``RoleConfig.microbatch_tokens``, the fewest
        micro-batches within that many tokens per device (jrlhf.data.batch.fit_microbatches),
        else ``RoleConfig.microbatches``."""
        setup = self.roles[role]
        shards = batch_shards(setup.meshes["train"], setup.rules["train"])
        budget = setup.config.microbatch_tokens
        if budget:
            m, batch = fit_microbatches(
                batch, budget, shards, self.P, pack=self.rl.memory.pack_samples
            )
            return batch, m
        m = setup.config.microbatches
        if not self.rl.memory.pack_samples:
            return batch, m
        packed = rl_batch.pack_segments(batch, self.P, self.P + self.R, m, shards)
        return packed, m

    def step(self, arrays: dict[str, np.ndarray], kl_coef, iteration: int) -> dict[str, float]:
        """The epochs of minibatch steps of iteration ``iteration`` on ``arrays``; returns the
        ``train/*`` metrics (fetched: the call is synchronous)."""
        rows = arrays["mask"].shape[0]
        mb = self.rl.minibatch_size
        fields = _ACTOR_FIELDS + tuple(k for k in ("is_weights", "loss_mask") if k in arrays)
        critic_fields = _CRITIC_FIELDS + (("loss_mask",) if "loss_mask" in arrays else ())
        rng = np.random.default_rng([self.seed, iteration, 7])
        # Metrics stay on device until the end, so actor and critic steps (which may run on
        # different devices) are dispatched back to back without a host sync in between.
        collected: list[dict] = []
        splits: dict[str, list[int]] = collections.defaultdict(list)
        for _ in range(self.rl.epochs):
            order = rng.permutation(rows)
            for start in range(0, rows, mb):
                idx = order[start : start + mb]
                batch, split = self.pack({k: arrays[k][idx] for k in fields}, "actor")
                batch["kl_coef"] = np.full((len(idx),), kl_coef, np.float32)
                if self.fused is not None:
                    cbatch, csplit = self.pack({k: arrays[k][idx] for k in critic_fields}, "critic")
                    actor, critic, m, cm = self.fused(
                        self.states["actor"], self.states["critic"], batch, cbatch
                    )
                    self.states["actor"], self.states["critic"] = actor, critic
                    splits["train/microbatches"].append(split)
                    splits["train/critic/microbatches"].append(csplit)
                    collected.append({**m, **{f"critic/{k}": v for k, v in cm.items()}})
                    continue
                step = self.steps["actor"]
                self.states["actor"], m = step(self.states["actor"], batch, split)
                splits["train/microbatches"].append(split)
                if self.use_critic:
                    cbatch, split = self.pack({k: arrays[k][idx] for k in critic_fields}, "critic")
                    step = self.steps["critic"]
                    self.states["critic"], cm = step(self.states["critic"], cbatch, split)
                    splits["train/critic/microbatches"].append(split)
                    m = {**m, **{f"critic/{k}": v for k, v in cm.items()}}
                collected.append(m)
        stacked = to_host({k: [m[k] for m in collected] for k in collected[0]})
        where = f"iteration {iteration + 1}"  # as metrics and checkpoints number it
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

    # -- after the steps -------------------------------------------------------------------------
    def observe_kl(self, arrays: Mapping[str, np.ndarray], rows: int) -> float | None:
        """Feed the adaptive KL controller the sampled policy's per-token KL to the reference
        (the configured estimator's; see ``RLConfig.adaptive_kl_target``); returns it (None
        without a reference)."""
        if not self.use_reference:
            return None
        kl_token = float(
            algos.observed_kl(
                arrays["old_logprobs"], arrays["ref_logprobs"], loss_mask(arrays), self.kl_estimator
            )
        )
        self.kl_ctl = self.kl_ctl.update(kl_token, rows)
        return kl_token

    def state_targets(self) -> dict[str, Any]:
        """Abstract restore targets of the trained states on their training shardings."""
        targets = {}
        for role in self.trained:
            setup = self.roles[role]
            shardings = state_shardings(
                setup.model, self.opts[role], setup.meshes["train"], setup.rules["train"]
            )
            target = checkpoint.restore_target(self.states[role], shardings)
            # A LoRA role's checkpoint holds its trainable part only (jrlhf.checkpoint).
            targets[role] = target.replace(params=setup.model.trainable(target.params))
        return targets

    def with_restored(self, states: Mapping[str, Any]) -> None:
        """Take restored train states (``state_targets``' trainable parameters) on top of the
        frozen parameters these states hold."""
        for role, state in states.items():
            model = self.roles[role].model
            params = model.with_trainable(self.states[role].params, state.params)
            self.states[role] = state.replace(params=params)
