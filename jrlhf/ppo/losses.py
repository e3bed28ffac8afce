"""The RL losses and the advantage function: what an update optimizes, built from config alone.

The actor's policy loss (with the entropy bonus and, for GRPO-style runs, the KL term), the
critic's clipped value loss, and the jitted advantage function over scored rollouts. Each is a
pure function of its ``RLConfig`` fields (``LossSettings``), so runs that differ elsewhere share
the traced and compiled train steps (``shared_program``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jrlhf.models import moe
from jrlhf.ppo import batch as rl_batch
from jrlhf.ppo import core_algos as algos
from jrlhf.shared_programs import shared_program


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
        """The settings of the RLConfig ``rl`` (logprob_chunk from its Memory section)."""
        own = {f.name for f in dataclasses.fields(cls)} - {"logprob_chunk"}
        return cls(
            **{name: getattr(rl, name) for name in own}, logprob_chunk=rl.memory.logprob_chunk
        )


def actor_loss(P: int, rl, kl_in_loss: bool, kl_estimator: str | None = None):
    """The actor's training loss on a minibatch: the configured policy loss
    (``RLConfig.policy_loss``, core_algos' registry), minus the entropy bonus, plus the KL term
    (``kl_estimator``, default ``RLConfig.kl_estimator`` or k3) when the KL is a loss term (GRPO),
    plus, for a mixture-of-experts actor, its router losses times the model's
    ``router_aux_loss_coef`` / ``router_z_loss_coef`` (reported in the metrics either way).

    Its ``weight`` metric is what ``RLConfig.loss_agg`` averages over (tokens or sequences), so
    gradient accumulation over micro-batches gives the minibatch's loss however it is split.
    """
    estimator = (kl_estimator or rl.kl_estimator or "k3") if kl_in_loss else None
    return _actor_loss(P, LossSettings.of(rl), kl_in_loss, estimator)


@shared_program()
def _actor_loss(P: int, rl: LossSettings, kl_in_loss: bool, kl_estimator: str | None):
    policy_loss = algos.get_policy_loss(rl.policy_loss)

    def loss_fn(module, batch):
        hidden, stats = rl_batch.response_hidden(module, batch, P, with_stats=True)
        logp, entropy = rl_batch.hidden_logprobs(
            module, hidden, batch["response_tokens"], True, rl.logprob_chunk
        )
        # Multi-turn rollouts train on the policy's own tokens only (jrlhf.decode.turns).
        mask = batch.get("loss_mask", batch["mask"])
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
        # a routed model: its router losses over every real token of the rows
        loss, metrics = moe.add_router_losses(
            module.config, stats, batch["segment_ids"] > 0, loss, metrics
        )
        return loss, dict(metrics, weight=algos.aggregation_weight(mask, rl.loss_agg))

    return loss_fn


def critic_loss(P: int, rl):
    """The critic's clipped value loss on a minibatch (``weight`` as in :func:`actor_loss`)."""
    return _critic_loss(P, LossSettings.of(rl))


@shared_program()
def _critic_loss(P: int, rl: LossSettings):
    def loss_fn(module, batch):
        values, stats = rl_batch.response_values(module, batch, P, with_stats=True)
        mask = batch.get("loss_mask", batch["mask"])  # the policy's tokens (multi-turn)
        loss, metrics = algos.value_loss_clipped(
            values, batch["old_values"], batch["returns"], mask, rl.value_clip_eps, agg=rl.loss_agg
        )
        metrics = dict(metrics, value_loss=loss)
        loss, metrics = moe.add_router_losses(
            module.config, stats, batch["segment_ids"] > 0, loss, metrics
        )
        return loss, dict(metrics, weight=algos.aggregation_weight(mask, rl.loss_agg))

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
