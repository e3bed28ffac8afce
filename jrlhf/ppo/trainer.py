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
import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from jrlhf.config import Config
from jrlhf.decode import DecodeEngine, EngineConfig, SamplingParams
from jrlhf.ppo import batch as rl_batch
from jrlhf.ppo import core_algos as algos
from jrlhf.reshard import Resharder
from jrlhf.roles import RoleSetup, load_weights, make_infer
from jrlhf.train_step import (
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


@dataclasses.dataclass
class RolloutBatch:
    prompts: list[list[int]]
    responses: list[list[int]]
    arrays: dict[str, np.ndarray]  # packed layout + per-token RL quantities


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
    """A jitted pure function from scored rollouts to (advantages, returns, token rewards)."""

    def ppo(scores_b, logp_bt, ref_logp_bt, values_bt, mask_bt, kl_coef):
        if rl.kl_in_loss:
            rewards = scores_b[:, None] * algos.last_token_onehot(mask_bt)
        else:
            rewards = algos.apply_kl_to_rewards(
                scores_b, logp_bt, ref_logp_bt, mask_bt, kl_coef, rl.kl_estimator
            )
        adv, returns = algos.compute_gae(rewards, values_bt, mask_bt, rl.gamma, rl.lam)
        if rl.whiten_advantages:
            adv = algos.masked_whiten(adv, mask_bt)
        return adv, returns, rewards

    def grpo(scores_b, logp_bt, ref_logp_bt, values_bt, mask_bt, kl_coef):
        del logp_bt, ref_logp_bt, values_bt, kl_coef
        adv_b = algos.grpo_advantages(scores_b, group_size)
        adv = algos.broadcast_to_tokens(adv_b, mask_bt)
        rewards = scores_b[:, None] * algos.last_token_onehot(mask_bt)
        return adv, adv, rewards

    return jax.jit(ppo if algorithm == "ppo" else grpo)


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
        logger: Any,
        reward_fn: RewardFn | None = None,
        progress: Any = None,
    ):
        self.cfg, self.rl, self.algorithm = cfg, cfg.rl, algorithm
        self.roles, self.data, self.logger = roles, data, logger
        self.run_dir = Path(run_dir)
        self.reward_fn = reward_fn
        self.progress = progress
        self.P, self.R = cfg.task.max_prompt_len, cfg.task.max_response_len
        self.group = cfg.rl.samples_per_prompt
        self.use_critic = algorithm == "ppo"
        self.kl_in_loss = cfg.rl.kl_in_loss or algorithm == "grpo"
        seed = cfg.run.seed
        self.seed = seed

        actor = roles["actor"]
        self.actor_opt = make_optimizer(self._opt_config(actor))
        params = load_weights(
            actor.model, sources["actor"], actor.meshes["train"], actor.rules["train"], seed
        )
        self.actor_state = init_train_state(
            actor.model, self.actor_opt, actor.meshes["train"], actor.rules["train"], params=params
        )
        self.actor_step = make_train_step(
            actor.model,
            self.actor_opt,
            _actor_loss(self.P, self.rl, self.kl_in_loss),
            actor.meshes["train"],
            actor.rules["train"],
            microbatches=actor.config.microbatches,
        )
        ref = roles["reference"]
        self.ref_params = load_weights(
            ref.model, sources["reference"], ref.meshes["infer"], ref.rules["infer"], seed
        )
        self.ref_logprobs = make_infer(
            ref.model,
            ref.meshes["infer"],
            ref.rules["infer"],
            lambda m, b: rl_batch.response_logprobs(m, b, self.P),
            batch_size=self.rl.infer_batch_size,
        )

        self.reward_params = None
        if reward_fn is None:
            rw = roles["reward"]
            self.reward_params = load_weights(
                rw.model, sources["reward"], rw.meshes["infer"], rw.rules["infer"], seed
            )
            self.reward_scores = make_infer(
                rw.model,
                rw.meshes["infer"],
                rw.rules["infer"],
                rl_batch.sequence_scores,
                batch_size=self.rl.infer_batch_size,
            )

        self.critic_state = None
        if self.use_critic:
            critic = roles["critic"]
            self.critic_opt = make_optimizer(self._opt_config(critic))
            cparams = load_weights(
                critic.model,
                sources["critic"],
                critic.meshes["train"],
                critic.rules["train"],
                seed + 1,
            )
            self.critic_state = init_train_state(
                critic.model,
                self.critic_opt,
                critic.meshes["train"],
                critic.rules["train"],
                params=cparams,
            )
            self.critic_step = make_train_step(
                critic.model,
                self.critic_opt,
                _critic_loss(self.P, self.rl),
                critic.meshes["train"],
                critic.rules["train"],
                microbatches=critic.config.microbatches,
            )
            self.critic_values = make_infer(
                critic.model,
                critic.meshes["infer"],
                critic.rules["infer"],
                lambda m, b: rl_batch.response_values(m, b, self.P),
                batch_size=self.rl.infer_batch_size,
            )
            # The critic scores on its inference layout; when that differs from its training
            # layout (e.g. an interleaved plan), its weights follow each update there.
            self.critic_infer_shardings = critic.shardings("infer")
            self.critic_moves = jax.tree.leaves(critic.shardings("train")) != jax.tree.leaves(
                self.critic_infer_shardings
            )

        # Generation: the engine lives on the actor's generation mesh; the actor's weights are
        # moved there by the (cached) resharder after every update.
        rows = cfg.rl.prompts_per_iteration * self.group
        gen_mesh = actor.meshes["generate"]
        data_shards = int(np.prod([gen_mesh.shape.get(a, 1) for a in ("data", "fsdp")]))
        slots = cfg.decode.num_slots or rows
        slots = -(-slots // data_shards) * data_shards
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
        self.gen_params = self.resharder(self.actor_state.params, self.gen_shardings)
        self.critic_infer_params = None
        if self.use_critic:
            self.critic_infer_params = (
                self.resharder(self.critic_state.params, self.critic_infer_shardings)
                if self.critic_moves
                else self.critic_state.params
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

    def score(self, prompts, responses, raw_logprobs):
        """Reference log-probs, rewards and values for a packed batch (device work overlaps)."""
        arrays = rl_batch.pack(prompts, responses, self.P, self.R, self.data.pad_id)
        ref_lp = self.ref_logprobs(self.ref_params, arrays)
        values = self.critic_values(self.critic_infer_params, arrays) if self.use_critic else None
        if self.reward_fn is None:
            scores = self.reward_scores(self.reward_params, arrays)
        else:
            scores = np.array([self.reward_fn(p, r) for p, r in zip(prompts, responses)])
        old_lp = np.zeros((len(responses), self.R), np.float32)
        for i, lp in enumerate(raw_logprobs):
            old_lp[i, : len(lp)] = lp
        arrays["old_logprobs"] = old_lp
        arrays["ref_logprobs"] = np.asarray(ref_lp)
        arrays["old_values"] = np.asarray(values) if values is not None else np.zeros_like(old_lp)
        arrays["scores"] = np.asarray(scores, np.float32) * self.rl.reward_scale
        return arrays

    # -- one iteration -------------------------------------------------------------------------
    def run_iteration(self, prompts: list[list[int]]) -> dict[str, float]:
        it = self.iteration
        times = {}
        t0 = time.perf_counter()
        rep_prompts, result = self.generate(prompts, self.sampling(it))
        responses = result.completion_ids
        times["generate"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        arrays = self.score(rep_prompts, responses, result.raw_logprobs)
        mask = arrays["mask"]
        kl_coef = np.float32(self.kl_ctl.value)
        adv, returns, _rewards = self.advantages(
            arrays["scores"],
            arrays["old_logprobs"],
            arrays["ref_logprobs"],
            arrays["old_values"],
            mask,
            kl_coef,
        )
        arrays["advantages"] = np.asarray(adv)
        arrays["returns"] = np.asarray(returns)
        times["score"] = time.perf_counter() - t0

        if os.environ.get(_EXIT_AT_ENV) == str(it):
            os._exit(137)

        t0 = time.perf_counter()
        train_metrics = self.update(arrays, kl_coef)
        times["train"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        self.sync_weights()
        jax.block_until_ready((self.gen_params, self.critic_infer_params))
        times["reshard"] = time.perf_counter() - t0

        kl_tokens = arrays["old_logprobs"] - arrays["ref_logprobs"]
        kl_seq = float(np.mean(np.sum(kl_tokens * mask, axis=1)))
        self.kl_ctl = self.kl_ctl.update(kl_seq, len(responses))
        lengths = mask.sum(axis=1)
        metrics = {
            "reward": float(np.mean(arrays["scores"])),
            "kl": kl_seq,
            "kl_coef": float(kl_coef),
            "response_len": float(np.mean(lengths)),
            "tokens_per_sec": float(lengths.sum() / max(times["generate"], 1e-9)),
            **{f"time/{k}": v for k, v in times.items()},
            **train_metrics,
        }
        if self.data.ground_truth is not None:
            metrics["gt_score"] = float(
                np.mean([self.data.ground_truth(p, r) for p, r in zip(rep_prompts, responses)])
            )
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
                self.actor_state, m = self.actor_step(self.actor_state, batch)
                if self.use_critic:
                    cbatch = {k: arrays[k][idx] for k in critic_fields}
                    self.critic_state, cm = self.critic_step(self.critic_state, cbatch)
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
        arrays = self.score(rep_prompts, result.completion_ids, result.raw_logprobs)
        return summarize_samples(arrays, rep_prompts, result.completion_ids, self.data.ground_truth)

    # -- checkpoints -----------------------------------------------------------------------
    def save(self, loader_state: dict[str, int]) -> None:
        """Asynchronous save of everything a resume needs; Orbax renames the step into place
        only once every item is written, so a crash mid-save leaves the last good step."""
        models = {"actor": self.roles["actor"].model}
        if self.use_critic:
            models["critic"] = self.roles["critic"].model
        meta = {
            "iteration": self.iteration,
            "algorithm": self.algorithm,
            "loader": loader_state,
            "kl_coef": float(self.kl_ctl.value),
            "seed": self.seed,
            "models": {
                role: {"head": m.head, "config": json_config(m)} for role, m in models.items()
            },
        }
        args = {"meta": ocp.args.JsonSave(meta)}
        args["actor_params"] = ocp.args.StandardSave(self.actor_state.params)
        args["actor_opt_state"] = ocp.args.StandardSave(
            {"step": self.actor_state.step, "opt_state": self.actor_state.opt_state}
        )
        if self.use_critic:
            args["critic_params"] = ocp.args.StandardSave(self.critic_state.params)
            args["critic_opt_state"] = ocp.args.StandardSave(
                {"step": self.critic_state.step, "opt_state": self.critic_state.opt_state}
            )
        self.ckpt.save(self.iteration, args=ocp.args.Composite(**args))

    def restore(self) -> dict[str, int] | None:
        """Restore the latest complete checkpoint; returns the loader state (None if none)."""
        step = self.ckpt.latest_step()
        if step is None:
            return None

        def target(state: TrainState, role: str):
            setup = self.roles[role]
            opt = self.actor_opt if role == "actor" else self.critic_opt
            sh = state_shardings(setup.model, opt, setup.meshes["train"], setup.rules["train"])
            abstract = jax.tree.map(
                lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, sh
            )
            return abstract

        actor_t = target(self.actor_state, "actor")
        args = {
            "meta": ocp.args.JsonRestore(),
            "actor_params": ocp.args.StandardRestore(actor_t.params),
            "actor_opt_state": ocp.args.StandardRestore(
                {"step": actor_t.step, "opt_state": actor_t.opt_state}
            ),
        }
        if self.use_critic:
            critic_t = target(self.critic_state, "critic")
            args["critic_params"] = ocp.args.StandardRestore(critic_t.params)
            args["critic_opt_state"] = ocp.args.StandardRestore(
                {"step": critic_t.step, "opt_state": critic_t.opt_state}
            )
        restored = self.ckpt.restore(step, args=ocp.args.Composite(**args))
        meta = restored["meta"]
        a = restored["actor_opt_state"]
        self.actor_state = TrainState(a["step"], restored["actor_params"], a["opt_state"])
        if self.use_critic:
            c = restored["critic_opt_state"]
            self.critic_state = TrainState(c["step"], restored["critic_params"], c["opt_state"])
        self.kl_ctl = dataclasses.replace(self.kl_ctl, value=jnp.float32(meta["kl_coef"]))
        self.iteration = int(meta["iteration"])
        self.sync_weights()
        return meta["loader"]

    def wait_for_checkpoints(self) -> None:
        self.ckpt.wait_until_finished()


def json_config(model) -> dict:
    import json

    return json.loads(model.config.to_json())


def summarize_samples(arrays, prompts, responses, ground_truth=None) -> dict[str, float]:
    """Mean reward, KL to the reference (sum over tokens of log pi - log ref), length, and the
    ground-truth score when the task knows it."""
    mask = arrays["mask"]
    kl = np.sum((arrays["old_logprobs"] - arrays["ref_logprobs"]) * mask, axis=1)
    out = {
        "kl_to_ref": float(np.mean(kl)),
        "reward": float(np.mean(arrays["scores"])),
        "response_len": float(np.mean(mask.sum(axis=1))),
        "num_samples": float(len(responses)),
    }
    if ground_truth is not None:
        out["gt_score"] = float(np.mean([ground_truth(p, r) for p, r in zip(prompts, responses)]))
    return out
