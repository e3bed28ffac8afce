"""The PPO / GRPO iteration over actor, critic, reference and reward on their own meshes.

One iteration::

    prompts -> actor generate (generation mesh, paged-KV decode)
            -> reference log-probs, reward scores, critic values (inference; dispatched
               back to back so calls on disjoint devices overlap)
            -> advantages (GAE with a KL-shaped reward, or GRPO group baselines)
            -> epochs of minibatch updates of actor and critic (training meshes, donated state)
            -> actor weights resharded to the generation layout (jrlhf.reshard, cached)

Everything random is a function of (seed, iteration), and the checkpoint holds the loader
position and the KL controller, so a resumed run repeats the uninterrupted one exactly.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from jrlhf.config import Config
from jrlhf.decode import DecodeEngine, EngineConfig, SamplingParams, round_slots
from jrlhf.metrics import PhaseTimer
from jrlhf.ppo import batch as rl_batch
from jrlhf.ppo import core_algos as algos
from jrlhf.ppo.scoring import Scorer
from jrlhf.reshard import Resharder
from jrlhf.runtime.roles import RoleSetup, frozen_infer, load_weights, make_infer
from jrlhf.runtime.steps import (
    OptimizerConfig,
    TrainState,
    init_train_state,
    make_optimizer,
    make_train_step,
    state_shardings,
)

log = logging.getLogger("jrlhf")

# Test hook: exit abruptly (no cleanup, like a preempted job) while this iteration is training.
_EXIT_AT_ENV = "JRLHF_DEBUG_EXIT_AT_ITERATION"

RewardFn = Callable[[Sequence[int], Sequence[int]], float]


def _actor_loss(P: int, rl, kl_in_loss: bool):
    def loss_fn(module, batch):
        logp, entropy = rl_batch.response_logprobs(module, batch, P, with_entropy=True)
        mask = batch["mask"]
        loss, metrics = algos.policy_loss_ppo(
            logp,
            batch["old_logprobs"],
            batch["advantages"],
            mask,
            rl.clip_eps,
            clip_eps_high=rl.clip_eps_high or None,
            dual_clip_c=rl.dual_clip_c or None,
            agg=rl.loss_agg,
        )
        ent = algos.entropy_bonus(entropy, mask, rl.loss_agg)
        metrics = dict(metrics, policy_loss=loss, entropy=ent)
        if rl.entropy_coef:
            loss = loss - rl.entropy_coef * ent
        if kl_in_loss:
            kl = algos.kl_penalty(logp, batch["ref_logprobs"], rl.kl_estimator)
            kl_term = algos.aggregate_loss(kl, mask, rl.loss_agg)
            loss = loss + batch["kl_coef"][0] * kl_term
            metrics["kl_loss"] = kl_term
        return loss, dict(metrics, weight=mask.sum())

    return loss_fn


def _critic_loss(P: int, rl):
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
        return loss, dict(metrics, value_loss=loss, weight=batch["mask"].sum())

    return loss_fn


def make_advantage_fn(rl, algorithm: str, group_size: int):
    """A jitted pure function from scored rollouts to (advantages, returns).

    The estimator comes from core_algos' registry: GAE over KL-shaped token rewards for PPO
    (the score lands on the last response token), group-normalized scores for GRPO.
    """
    estimator = algos.get_advantage_estimator("gae" if algorithm == "ppo" else "grpo")

    def advantages(scores_b, logp_bt, ref_logp_bt, values_bt, mask_bt, kl_coef):
        if rl.kl_in_loss or algorithm == "grpo":
            rewards_bt = scores_b[:, None] * algos.last_token_onehot(mask_bt)
        else:
            rewards_bt = algos.apply_kl_to_rewards(
                scores_b, logp_bt, ref_logp_bt, mask_bt, kl_coef, rl.kl_estimator
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
        sources: dict[str, str | None],
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
        self.kl_in_loss = cfg.rl.kl_in_loss or algorithm == "grpo"
        self.seed = seed = cfg.run.seed
        batch_size = self.rl.infer_batch_size

        # Trained roles: optimizer, sharded state and jitted step on their training mesh.
        self.trained = ["actor", "critic"] if self.use_critic else ["actor"]
        losses = {
            "actor": _actor_loss(self.P, self.rl, self.kl_in_loss),
            "critic": _critic_loss(self.P, self.rl),
        }
        self.opts, self.states, self.steps = {}, {}, {}
        for i, role in enumerate(self.trained):
            setup = roles[role]
            mesh, rules = setup.meshes["train"], setup.rules["train"]
            self.opts[role] = make_optimizer(self._opt_config(setup))
            params = load_weights(setup.model, sources[role], mesh, rules, seed + i)
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
                setup.model, sources[role], setup.meshes["infer"], setup.rules["infer"], fn,
                seed, batch_size,
            )  # fmt: skip

        critic_fn = None
        if self.use_critic:
            critic = roles["critic"]
            critic_values = make_infer(
                critic.model,
                critic.meshes["infer"],
                critic.rules["infer"],
                lambda m, b: rl_batch.response_values(m, b, self.P),
                batch_size,
            )
            critic_fn = lambda arrays: critic_values(self.critic_infer_params, arrays)  # noqa: E731
            # The critic scores on its inference layout; when that differs from its training
            # layout (e.g. an interleaved plan), its weights follow each update there.
            self.critic_infer_shardings = critic.shardings("infer")
            self.critic_moves = jax.tree.leaves(critic.shardings("train")) != jax.tree.leaves(
                self.critic_infer_shardings
            )
        self.scorer = Scorer(
            self.P,
            self.R,
            data.pad_id,
            frozen("reference", lambda m, b: rl_batch.response_logprobs(m, b, self.P)),
            reward_model=None if reward_fn else frozen("reward", rl_batch.sequence_scores),
            reward_fn=reward_fn,
            critic=critic_fn,
            reward_scale=self.rl.reward_scale,
            ground_truth=data.ground_truth,
        )

        # Generation: the engine lives on the actor's generation mesh; the actor's weights are
        # moved there by the (cached) resharder after every update.
        actor = roles["actor"]
        gen_mesh = actor.meshes["generate"]
        rows = cfg.rl.prompts_per_iteration * self.group
        slots = round_slots(cfg.decode.num_slots or rows, gen_mesh, actor.rules["generate"])
        self.engine = DecodeEngine(
            actor.model,
            gen_mesh,
            actor.rules["generate"],
            EngineConfig(
                num_slots=slots,
                page_size=cfg.decode.page_size,
                num_pages=cfg.decode.num_pages,
                max_prompt_len=self.P,
                max_new_tokens=self.R,
                chunk_steps=cfg.decode.chunk_steps,
                max_prefill_rows=min(slots, 64),
                min_prefill_len=min(16, self.P),
            ),
        )
        self.gen_shardings = actor.shardings("generate")
        self.resharder = Resharder()
        self.sync_weights()

        self.advantages = make_advantage_fn(self.rl, algorithm, self.group)
        self.kl_ctl = algos.make_kl_controller(
            "adaptive" if self.rl.adaptive_kl_target > 0 else "fixed",
            self.rl.kl_coef,
            target=self.rl.adaptive_kl_target or None,
            horizon=self.rl.adaptive_kl_horizon,
        )
        self.iteration = 0
        self.ckpt = ocp.CheckpointManager(
            (self.run_dir / "checkpoints").absolute(),
            options=ocp.CheckpointManagerOptions(
                max_to_keep=self.rl.keep_checkpoints,
                enable_async_checkpointing=self.rl.async_checkpoint,
            ),
        )

    def sync_weights(self) -> None:
        """Follow the plan's reshard edges: actor train -> generate, critic train -> infer."""
        self.gen_params = self.resharder(self.states["actor"].params, self.gen_shardings)
        self.critic_infer_params = None
        if self.use_critic:
            critic = self.states["critic"].params
            self.critic_infer_params = (
                self.resharder(critic, self.critic_infer_shardings) if self.critic_moves else critic
            )

    def _opt_config(self, setup: RoleSetup) -> OptimizerConfig:
        rc = setup.config
        return OptimizerConfig(
            learning_rate=rc.learning_rate,
            warmup_steps=rc.warmup_steps,
            weight_decay=rc.weight_decay,
            grad_clip=rc.grad_clip,
        )

    # -- rollout and scoring -----------------------------------------------------------------
    def sampling(self, iteration: int, *, greedy: bool = False, seed_salt: int = 0):
        rl = self.rl
        return SamplingParams(
            greedy=greedy,
            temperature=rl.temperature,
            top_k=rl.top_k,
            top_p=rl.top_p,
            num_samples=self.group,
            seed=int(np.random.default_rng([self.seed, iteration, seed_salt]).integers(2**31)),
            stop_ids=(self.data.eos_id,) if self.data.eos_id is not None else None,
            max_new_tokens=self.R,
        )

    def generate(self, prompts: list[list[int]], sampling: SamplingParams):
        result = self.engine.generate(self.gen_params, prompts, sampling)
        rep_prompts = [prompts[int(i)] for i in result.prompt_index]
        return rep_prompts, result

    # -- one iteration -------------------------------------------------------------------------
    def run_iteration(self, prompts: list[list[int]]) -> dict[str, float]:
        it = self.iteration
        timer = PhaseTimer()
        with timer.phase("generate"):
            rep_prompts, result = self.generate(prompts, self.sampling(it))
            responses = result.completion_ids

        with timer.phase("score"):
            arrays = self.scorer(rep_prompts, responses, result.raw_logprobs)
            mask = arrays["mask"]
            kl_coef = np.float32(self.kl_ctl.value)
            adv, returns = self.advantages(
                arrays["scores"],
                arrays["old_logprobs"],
                arrays["ref_logprobs"],
                arrays["old_values"],
                mask,
                kl_coef,
            )
            arrays["advantages"] = np.asarray(adv)
            arrays["returns"] = np.asarray(returns)

        if os.environ.get(_EXIT_AT_ENV) == str(it):
            os._exit(137)

        with timer.phase("train"):
            train_metrics = self.update(arrays, kl_coef)  # fetches its metrics: synchronous

        with timer.phase("reshard") as ph:
            self.sync_weights()
            ph.block_on((self.gen_params, self.critic_infer_params))

        summary = self.scorer.summarize(arrays, rep_prompts, responses)
        self.kl_ctl = self.kl_ctl.update(summary["kl_to_ref"], len(responses))
        lengths = mask.sum(axis=1)
        metrics = {
            "reward": summary["reward"],
            "kl": summary["kl_to_ref"],
            "kl_coef": float(kl_coef),
            "response_len": summary["response_len"],
            "tokens_per_sec": float(lengths.sum() / max(timer.totals["generate"], 1e-9)),
            **timer.summary(),
            **train_metrics,
        }
        if "gt_score" in summary:
            metrics["gt_score"] = summary["gt_score"]
        self.iteration += 1
        return metrics

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
        )
        critic_fields = ("tokens", "positions", "segment_ids", "mask", "old_values", "returns")
        rng = np.random.default_rng([self.seed, self.iteration, 7])
        # Metrics stay on device until the end, so actor and critic steps (which may run on
        # different devices) are dispatched back to back without a host sync in between.
        collected: list[dict] = []
        for _ in range(self.rl.epochs):
            order = rng.permutation(rows)
            for start in range(0, rows, mb):
                idx = order[start : start + mb]
                batch = {k: arrays[k][idx] for k in fields}
                batch["kl_coef"] = np.full((len(idx),), kl_coef, np.float32)
                self.states["actor"], m = self.steps["actor"](self.states["actor"], batch)
                if self.use_critic:
                    cbatch = {k: arrays[k][idx] for k in critic_fields}
                    self.states["critic"], cm = self.steps["critic"](self.states["critic"], cbatch)
                    m = {**m, **{f"critic/{k}": v for k, v in cm.items()}}
                collected.append(m)
        stacked = jax.device_get({k: [m[k] for m in collected] for k in collected[0]})
        skip = {"weight", "critic/weight", "num_tokens"}
        return {f"train/{k}": float(np.mean(v)) for k, v in stacked.items() if k not in skip}

    # -- evaluation ------------------------------------------------------------------------
    def evaluate(self, prompts: list[list[int]], samples: int = 1) -> dict[str, float]:
        """Sampled completions on held-out prompts: ground truth, reward model and KL to ref."""
        sp = dataclasses.replace(self.sampling(10**6, seed_salt=99), num_samples=samples)
        rep_prompts, result = self.generate(prompts, sp)
        arrays = self.scorer(rep_prompts, result.completion_ids, result.raw_logprobs)
        return self.scorer.summarize(arrays, rep_prompts, result.completion_ids)

    # -- checkpoints -----------------------------------------------------------------------
    def save(self, loader_state: dict[str, int]) -> None:
        """Asynchronous save of everything a resume needs; Orbax renames the step into place
        only once every item is written, so a crash mid-save leaves the last good step."""
        meta = {
            "iteration": self.iteration,
            "algorithm": self.algorithm,
            "loader": loader_state,
            "kl_coef": float(self.kl_ctl.value),
            "seed": self.seed,
            "models": {
                role: {
                    "head": self.roles[role].model.head,
                    "config": json.loads(self.roles[role].model.config.to_json()),
                }
                for role in self.trained
            },
        }
        args = {"meta": ocp.args.JsonSave(meta)}
        for role in self.trained:
            # Parameters apart from the optimizer state, so jrlhf.checkpoint.load_model (evaluate,
            # convert) restores a role without knowing the optimizer.
            state = self.states[role]
            args[f"{role}_params"] = ocp.args.StandardSave(state.params)
            args[f"{role}_opt_state"] = ocp.args.StandardSave(
                {"step": state.step, "opt_state": state.opt_state}
            )
        self.ckpt.save(self.iteration, args=ocp.args.Composite(**args))

    def restore(self) -> dict[str, int] | None:
        """Restore the latest complete checkpoint; returns the loader state (None if none)."""
        step = self.ckpt.latest_step()
        if step is None:
            return None
        args = {"meta": ocp.args.JsonRestore()}
        for role in self.trained:
            setup = self.roles[role]
            shardings = state_shardings(
                setup.model, self.opts[role], setup.meshes["train"], setup.rules["train"]
            )
            target = jax.tree.map(
                lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                self.states[role],
                shardings,
            )
            args[f"{role}_params"] = ocp.args.StandardRestore(target.params)
            args[f"{role}_opt_state"] = ocp.args.StandardRestore(
                {"step": target.step, "opt_state": target.opt_state}
            )
        restored = self.ckpt.restore(step, args=ocp.args.Composite(**args))
        for role in self.trained:
            opt = restored[f"{role}_opt_state"]
            self.states[role] = TrainState(
                opt["step"], restored[f"{role}_params"], opt["opt_state"]
            )
        meta = restored["meta"]
        self.kl_ctl = dataclasses.replace(self.kl_ctl, value=jnp.float32(meta["kl_coef"]))
        self.iteration = int(meta["iteration"])
        self.sync_weights()
        return meta["loader"]

    def wait_for_checkpoints(self) -> None:
        self.ckpt.wait_until_finished()
