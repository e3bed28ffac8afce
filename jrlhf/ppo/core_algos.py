"""Pure RL maths for RLHF: masked statistics, GAE, KL penalties and controllers, losses.

Every function here is a pure function of arrays and safe to call under ``jax.jit`` (string and
other configuration arguments must be static). No orchestration lives here.

Conventions:

* Shape suffixes: ``b`` batch (one row per sampled response), ``t`` response token position,
  ``v`` vocabulary. ``mask_bt`` is 1 (or True) at valid response tokens and 0 elsewhere. Masks are
  usually left-aligned with trailing padding, but may be ragged (holes inside a row, e.g. tool
  output spliced into a multi-turn response); all functions accept both.
* Masks may be bool, int or float; float masks act as weights in the masked statistics.
* Values at masked positions never leak into results, even if they are NaN or inf.
* Losses, log-probs and statistics are computed in at least float32 regardless of input dtype.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import chex
import jax
import jax.numpy as jnp

from jrlhf.models.logprobs import token_logprobs

Array = jax.Array

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_KINDS = ("k1", "k2", "k3", "abs")
# Log-ratios are clamped to [-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP] before exp (as verl and OpenRLHF
# do): exp(20) ~ 5e8 is finite in fp32 and far outside any trust region, so nothing but the
# gradient of an already hopeless token changes.
LOG_RATIO_CLAMP = 20.0


def _same_bt(*arrays: Any) -> None:
    """Per-token inputs of a loss or estimator are [batch, time] and of one shape: checked at
    trace time, because broadcasting would otherwise turn a [B] or [B, 1] mistake into a
    silently wrong loss."""
    present = [a for a in arrays if a is not None]
    chex.assert_rank(present, 2)
    chex.assert_equal_shape(present)


def _f32(x: Any) -> Array:
    """Promotes to at least float32 (keeps float64 when x64 is enabled)."""
    x = jnp.asarray(x)
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def _mask_like(mask: Any, x: Array) -> Array:
    return jnp.asarray(mask).astype(x.dtype)


def _safe_div(num: Array, den: Array) -> Array:
    """num / den where den != 0, else 0; the inner where keeps gradients finite too."""
    ok = den != 0
    return jnp.where(ok, num / jnp.where(ok, den, 1), 0)


# ----------------------------------------------------------------------------- masked statistics


def masked_sum(x: Array, mask: Array, axis: int | tuple[int, ...] | None = None) -> Array:
    """Sum of ``x * mask`` over ``axis`` (all axes if None); masked NaN/inf do not leak."""
    x = _f32(x)
    m = _mask_like(mask, x)
    return jnp.sum(jnp.where(m != 0, x * m, 0), axis=axis)


def masked_mean(x: Array, mask: Array, axis: int | tuple[int, ...] | None = None) -> Array:
    """Mean of ``x`` over the masked entries along ``axis``; 0 where the mask is all zero."""
    x = _f32(x)
    m = _mask_like(mask, x)
    return _safe_div(masked_sum(x, m, axis), jnp.sum(m, axis=axis))


def masked_var(
    x: Array,
    mask: Array,
    axis: int | tuple[int, ...] | None = None,
    unbiased: bool = True,
) -> Array:
    """Variance of ``x`` over the masked entries.

    With ``unbiased=True`` (the default, as in common RLHF implementations) the biased variance is
    multiplied by the Bessel correction ``n / (n - 1)`` where ``n = sum(mask)``. When ``n <= 1``
    the correction is skipped, so a single valid element gives 0 and an empty mask gives 0 (never
    NaN or inf).
    """
    x = _f32(x)
    m = _mask_like(mask, x)
    mean = masked_mean(x, m, axis)
    if axis is not None:
        mean = jnp.expand_dims(mean, axis)
    var = masked_mean(jnp.square(x - mean), m, axis)
    if unbiased:
        n = jnp.sum(m, axis=axis)
        var = jnp.where(n > 1, var * _safe_div(n, n - 1), var)
    return var


def masked_whiten(x: Array, mask: Array, shift_mean: bool = True, eps: float = 1e-8) -> Array:
    """Normalises ``x`` to unit (unbiased, see ``masked_var``) variance over the whole masked set.

    ``(x - mean) / sqrt(var + eps)``; with ``shift_mean=False`` the mean is added back so only the
    scale changes. Positions outside the mask, and every position when the mask is all zero, are
    returned unchanged.
    """
    x = _f32(x)
    m = _mask_like(mask, x)
    mean = masked_mean(x, m)
    var = masked_var(x, m, unbiased=True)
    out = (x - mean) * jax.lax.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return jnp.where(m != 0, out, x)


def aggregate_loss(loss_bt: Array, mask_bt: Array, mode: str = "token-mean") -> Array:
    """Reduces a per-token loss to a scalar; shared by every loss in this module.

    * ``"token-mean"``: mean over all valid tokens of the batch (long responses weigh more).
    * ``"seq-mean-token-sum"``: per-row sum over valid tokens, then mean over rows.
    * ``"seq-mean-token-mean"``: per-row mean over valid tokens, then mean over rows.
    * ``"seq-mean-token-sum-norm"``: per-row sum over valid tokens divided by the constant
      ``T = mask_bt.shape[-1]`` (the maximum response length), then mean over rows: Dr. GRPO's
      length-unbiased aggregation (every token weighs the same whatever its row's length).

    The seq-mean modes average only over rows with at least one valid token, so fully masked rows
    (e.g. padding rows added to fill a batch) do not dilute the loss. Empty masks give 0.
    ``aggregation_weight`` is what each mode averages over, for accumulating micro-batches.
    """
    loss_bt = _f32(loss_bt)
    m = _mask_like(mask_bt, loss_bt)
    if mode == "token-mean":
        return masked_mean(loss_bt, m)
    row_valid_b = (jnp.sum(m, axis=-1) > 0).astype(loss_bt.dtype)
    if mode == "seq-mean-token-sum":
        return masked_mean(masked_sum(loss_bt, m, axis=-1), row_valid_b)
    if mode == "seq-mean-token-mean":
        return masked_mean(masked_mean(loss_bt, m, axis=-1), row_valid_b)
    if mode == "seq-mean-token-sum-norm":
        return masked_mean(masked_sum(loss_bt, m, axis=-1) / m.shape[-1], row_valid_b)
    raise ValueError(f"unknown loss aggregation mode {mode!r}; valid modes: {list(AGG_MODES)}")


def aggregation_weight(mask_bt: Array, mode: str = "token-mean") -> Array:
    """How many items ``aggregate_loss(., mask_bt, mode)`` averages over: valid tokens for
    ``"token-mean"``, rows with at least one valid token for the seq-mean modes.

    Gradient accumulation weights each micro-batch's loss by this, so the accumulated loss is the
    whole minibatch's aggregate however the minibatch is split.
    """
    m = _mask_like(mask_bt, _f32(jnp.zeros((), jnp.float32)))
    if mode == "token-mean":
        return jnp.sum(m)
    if mode in AGG_MODES:
        return jnp.sum((jnp.sum(m, axis=-1) > 0).astype(m.dtype))
    raise ValueError(f"unknown loss aggregation mode {mode!r}; valid modes: {list(AGG_MODES)}")


# ----------------------------------------------------------------------------- advantages


def compute_gae(
    rewards_bt: Array,
    values_bt: Array,
    mask_bt: Array,
    gamma: float | Array,
    lam: float | Array,
) -> tuple[Array, Array]:
    """Generalised advantage estimation over response tokens.

    Runs backwards over time with ``lax.scan(reverse=True)``:
    ``delta_t = r_t + gamma * V_next - V_t`` and ``A_t = delta_t + gamma * lam * A_next``, where
    ``V_next`` / ``A_next`` belong to the next *valid* position of the row. Masked positions are
    skipped (they neither contribute rewards nor break the recursion), so trailing padding makes the
    last valid token bootstrap from 0 and holes in ragged masks are stepped over.

    Returns ``(advantages_bt, returns_bt)`` with ``returns = advantages + values``; both are 0 at
    masked positions (and everywhere in fully masked rows). No whitening is applied.
    """
    _same_bt(rewards_bt, values_bt, mask_bt)
    rewards_bt = _f32(rewards_bt)
    values_bt = _f32(values_bt)
    m_bt = _mask_like(mask_bt, rewards_bt) != 0
    gamma = jnp.asarray(gamma, rewards_bt.dtype)
    lam = jnp.asarray(lam, rewards_bt.dtype)

    def step(carry, xs):
        next_value_b, next_adv_b = carry
        r_b, v_b, m_b = xs
        delta_b = r_b + gamma * next_value_b - v_b
        adv_b = delta_b + gamma * lam * next_adv_b
        adv_b = jnp.where(m_b, adv_b, next_adv_b)
        next_value_b = jnp.where(m_b, v_b, next_value_b)
        return (next_value_b, adv_b), jnp.where(m_b, adv_b, 0)

    zeros_b = jnp.zeros(rewards_bt.shape[:1], rewards_bt.dtype)
    xs = (jnp.where(m_bt, rewards_bt, 0).T, jnp.where(m_bt, values_bt, 0).T, m_bt.T)
    _, adv_tb = jax.lax.scan(step, (zeros_b, zeros_b), xs, reverse=True)
    advantages_bt = adv_tb.T
    returns_bt = jnp.where(m_bt, advantages_bt + values_bt, 0)
    return advantages_bt, returns_bt


def grpo_advantages(
    scores_b: Array,
    group_size: int,
    eps: float = 1e-6,
    normalize_std: bool = True,
    unbiased: bool = True,
) -> Array:
    """Group-relative advantages (GRPO): ``(r - mean_group) / (std_group + eps)`` per sample.

    ``scores_b`` is ordered prompt-major: ``[p0 s0, ..., p0 s(S-1), p1 s0, ...]`` with
    ``S = group_size``. The std is unbiased (ddof=1) by default, matching common implementations;
    a group of one has std 0. ``normalize_std=False`` returns the mean-centred scores only
    (Dr. GRPO). A constant group gives advantages of exactly 0.
    """
    scores_b = _f32(scores_b)
    (b,) = scores_b.shape
    scores_gs = _groups(scores_b, group_size)
    centred_gs = scores_gs - jnp.mean(scores_gs, axis=1, keepdims=True)
    if normalize_std:
        ddof = 1 if (unbiased and group_size > 1) else 0
        var_g1 = jnp.sum(jnp.square(centred_gs), axis=1, keepdims=True) / (group_size - ddof)
        centred_gs = centred_gs / (jnp.sqrt(var_g1) + eps)
    return centred_gs.reshape(b)


def _groups(scores_b: Array, group_size: int) -> Array:
    """Prompt-major scores (B,) as (B / group_size, group_size); one-line error otherwise."""
    (b,) = scores_b.shape
    if group_size <= 0 or b % group_size:
        raise ValueError(f"batch of {b} scores is not a multiple of group_size={group_size}")
    return scores_b.reshape(b // group_size, group_size)


def rloo_advantages(scores_b: Array, group_size: int) -> Array:
    """REINFORCE leave-one-out (Ahmadian et al. 2024): each sample's score minus the mean score
    of the *other* samples of its prompt, ``r_i - (sum_j r_j - r_i) / (S - 1)``.

    Prompt-major order as in ``grpo_advantages``. A group of one has no other sample: 0. A constant
    group gives exactly 0.
    """
    scores_gs = _groups(_f32(scores_b), group_size)
    if group_size == 1:
        return jnp.zeros_like(scores_gs).reshape(-1)
    # = S / (S - 1) * (r_i - mean): the centred form keeps a constant group at exactly 0.
    centred_gs = scores_gs - jnp.mean(scores_gs, axis=1, keepdims=True)
    return (centred_gs * (group_size / (group_size - 1))).reshape(-1)


def discounted_returns(rewards_bt: Array, mask_bt: Array, gamma: float | Array) -> Array:
    """``G_t = r_t + gamma * G_next`` over each row's valid tokens (holes stepped over), 0 at
    masked positions: GAE with zero values and ``lam = 1``."""
    returns_bt, _ = compute_gae(rewards_bt, jnp.zeros_like(_f32(rewards_bt)), mask_bt, gamma, 1.0)
    return returns_bt


def broadcast_to_tokens(values_b: Array, mask_bt: Array) -> Array:
    """Per-sequence values as per-token values: ``values_b[:, None]`` at valid tokens, else 0."""
    values_b = _f32(values_b)
    m = _mask_like(mask_bt, values_b)
    return jnp.where(m != 0, values_b[:, None] * m, 0)


def gae_estimator(
    *, rewards_bt: Array, values_bt: Array, mask_bt: Array, gamma: float, lam: float, **_: Any
) -> tuple[Array, Array]:
    """Registry adapter for ``compute_gae`` (keyword-only, ignores unrelated keywords)."""
    return compute_gae(rewards_bt, values_bt, mask_bt, gamma, lam)


def grpo_estimator(
    *,
    scores_b: Array,
    mask_bt: Array,
    group_size: int,
    eps: float = 1e-6,
    normalize_std: bool = True,
    **_: Any,
) -> tuple[Array, Array]:
    """Registry adapter for GRPO: per-token advantages; returns equal advantages (no critic)."""
    adv_bt = broadcast_to_tokens(grpo_advantages(scores_b, group_size, eps, normalize_std), mask_bt)
    return adv_bt, adv_bt


def drgrpo_estimator(*, scores_b: Array, mask_bt: Array, group_size: int, **_: Any):
    """Dr. GRPO (Liu et al. 2025): group-mean-centred scores without the division by the group's
    std, which over-weights prompts that are almost always right or wrong. Pair it with
    ``loss_agg="seq-mean-token-sum-norm"`` for the paper's length-unbiased loss."""
    adv_bt = broadcast_to_tokens(
        grpo_advantages(scores_b, group_size, normalize_std=False), mask_bt
    )
    return adv_bt, adv_bt


def rloo_estimator(*, scores_b: Array, mask_bt: Array, group_size: int, **_: Any):
    """Registry adapter for ``rloo_advantages``: per-token advantages, returns equal to them."""
    adv_bt = broadcast_to_tokens(rloo_advantages(scores_b, group_size), mask_bt)
    return adv_bt, adv_bt


def reinforce_pp_estimator(
    *, rewards_bt: Array, mask_bt: Array, gamma: float | Array, eps: float = 1e-8, **_: Any
) -> tuple[Array, Array]:
    """REINFORCE++ (Hu 2025): discounted returns of the token rewards (the score at the last
    token, minus the KL penalty per token when the KL is a reward), normalized to zero mean and
    unit variance over every valid token of the batch (no critic, no per-prompt baseline).

    Returns ``(advantages_bt, returns_bt)``; masked positions are 0.
    """
    m_bt = _mask_like(mask_bt, _f32(rewards_bt))
    returns_bt = discounted_returns(rewards_bt, m_bt, gamma)
    adv_bt = jnp.where(m_bt != 0, masked_whiten(returns_bt, m_bt, eps=eps), 0)
    return adv_bt, returns_bt


def reinforce_pp_baseline_estimator(
    *, rewards_bt: Array, mask_bt: Array, group_size: int, eps: float = 1e-8, **_: Any
) -> tuple[Array, Array]:
    """REINFORCE++ with a per-prompt baseline: each row's total reward minus its prompt group's
    mean, broadcast to the row's tokens, then normalized over every valid token of the batch.

    Returns ``(advantages_bt, advantages_bt)``; masked positions are 0.
    """
    rewards_bt = _f32(rewards_bt)
    m_bt = _mask_like(mask_bt, rewards_bt)
    centred_b = grpo_advantages(
        masked_sum(rewards_bt, m_bt, axis=-1), group_size, normalize_std=False
    )
    adv_bt = broadcast_to_tokens(centred_b, m_bt)
    adv_bt = jnp.where(m_bt != 0, masked_whiten(adv_bt, m_bt, eps=eps), 0)
    return adv_bt, adv_bt


# ----------------------------------------------------------------------------- DAPO shaping


def response_extent(mask_bt: Array) -> Array:
    """Each row's length as generated: 1 + the position of its last valid token, 0 for a row
    without any. Equal to the number of valid tokens for left-aligned masks; a ragged row's holes
    (e.g. spliced tool output) count, as they fill the context too."""
    m_bt = jnp.asarray(mask_bt) != 0
    t = m_bt.shape[-1]
    last_b = t - jnp.argmax(m_bt[:, ::-1], axis=-1)
    return jnp.where(jnp.any(m_bt, axis=-1), last_b, 0).astype(jnp.int32)


def overlong_penalty(
    mask_bt: Array, buffer: int, max_penalty: float | Array, max_len: int | None = None
) -> Array:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13) as a penalty >= 0 per row, to be
    subtracted from the row's score.

    With ``L`` the response length (``response_extent``: the stop token included),
    ``L_max = max_len`` (default ``mask_bt.shape[-1]``, the generation limit) and
    ``L_cache = buffer``::

        0                                          L <= L_max - buffer
        max_penalty * (L - (L_max - buffer)) / buffer   L_max - buffer < L <= L_max
        max_penalty                                L >= L_max

    so the penalty grows linearly over the last ``buffer`` tokens. A truncated response (no stop
    token: the generation limit cut it off) is ``L_max`` long and gets the full penalty, as the
    paper gives -1 to every response of ``L_max`` or more; one that ends with its stop token
    exactly at ``L_max`` gets it too (the paper's formula at ``|y| = L_max``). ``buffer == 0``
    turns it off (0 everywhere); empty rows get 0.
    """
    max_len = jnp.shape(mask_bt)[-1] if max_len is None else max_len
    if not 0 <= buffer <= max_len:
        raise ValueError(f"overlong buffer {buffer} must be in [0, max_len={max_len}]")
    length_b = response_extent(mask_bt).astype(jnp.float32)
    if buffer == 0:
        return jnp.zeros_like(length_b)
    excess_b = jnp.clip((length_b - (max_len - buffer)) / buffer, 0.0, 1.0)
    return _f32(max_penalty) * excess_b


def groups_with_signal(scores_b: Array, group_size: int) -> Array:
    """DAPO's dynamic-sampling filter: True for each prompt's group (prompt-major, as in
    ``grpo_advantages``) whose scores are not all exactly equal.

    An all-equal group has an advantage of exactly 0 under every group baseline (grpo, drgrpo,
    rloo), so it adds no policy gradient while still counting in the loss's average. A group of
    one is always all equal.
    """
    scores_gs = _groups(_f32(scores_b), group_size)
    return jnp.max(scores_gs, axis=1) > jnp.min(scores_gs, axis=1)


def select_groups(keep_g: Array, num_groups: int) -> Array:
    """Indices of the ``num_groups`` groups a dynamically sampled batch trains on: the kept
    groups in the order they were generated, then, when fewer than ``num_groups`` were kept, the
    dropped ones in order (fillers, so the batch keeps its compiled shape)."""
    keep_g = jnp.asarray(keep_g).astype(bool)
    if keep_g.shape[0] < num_groups:
        raise ValueError(f"{keep_g.shape[0]} groups, fewer than the {num_groups} to select")
    return jnp.argsort(~keep_g, stable=True)[:num_groups]


# ----------------------------------------------------------------------------- KL


def kl_penalty(logprobs: Array, ref_logprobs: Array, kind: str = "k1") -> Array:
    """Per-token estimate of KL(policy || reference) from samples of the policy.

    With ``d = logprobs - ref_logprobs``:
    ``k1 = d``; ``abs = |d|``; ``k2 = d**2 / 2``;
    ``k3 = exp(-d) + d - 1`` (Schulman's non-negative, unbiased, low-variance estimator), with
    ``d`` clamped to ``[-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP]`` first so a far-off token gives a
    large finite value instead of inf (identical wherever ``|d| <= LOG_RATIO_CLAMP``).
    """
    d = _f32(logprobs) - _f32(ref_logprobs)
    if kind == "k1":
        return d
    if kind == "abs":
        return jnp.abs(d)
    if kind == "k2":
        return 0.5 * jnp.square(d)
    if kind == "k3":
        d = jnp.clip(d, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        return jnp.exp(-d) + d - 1.0
    raise ValueError(f"unknown KL penalty kind {kind!r}; valid kinds: {list(KL_KINDS)}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FixedKLController:
    """A constant KL coefficient. ``value`` is the (checkpointable) pytree leaf."""

    value: Array | float

    def update(self, current_kl: Array | float, n_steps: int | Array) -> FixedKLController:
        """Returns the state unchanged."""
        del current_kl, n_steps
        return self


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. (2019).

    ``err = clip(current_kl / target - 1, -0.2, 0.2)``;
    ``value <- value * (1 + err * n_steps / horizon)``.

    ``value`` is the pytree leaf (checkpointed, traceable); ``target`` and ``horizon`` are static
    configuration.
    """

    value: Array | float
    target: float = dataclasses.field(metadata=dict(static=True), default=6.0)
    horizon: float = dataclasses.field(metadata=dict(static=True), default=10000.0)

    def update(self, current_kl: Array | float, n_steps: int | Array) -> AdaptiveKLController:
        """Returns the new state after observing ``current_kl`` over ``n_steps`` samples."""
        err = jnp.clip(_f32(current_kl) / self.target - 1.0, -0.2, 0.2)
        mult = 1.0 + err * jnp.asarray(n_steps, err.dtype) / self.horizon
        return dataclasses.replace(self, value=_f32(self.value) * mult)


KLController = FixedKLController | AdaptiveKLController


def observed_kl(logprobs_bt: Array, ref_logprobs_bt: Array, mask_bt: Array, kind: str) -> Array:
    """What the KL controller observes: the ``kind`` estimator's per-token KL, averaged over each
    row's valid tokens and then over the rows that have any (verl's choice). Per token, so an
    adaptive target does not depend on the response length."""
    kl_bt = kl_penalty(logprobs_bt, ref_logprobs_bt, kind)
    return aggregate_loss(kl_bt, mask_bt, "seq-mean-token-mean")


def update_kl_controller(
    state: KLController, current_kl: Array | float, n_steps: int | Array
) -> KLController:
    """Pure functional form of ``state.update(current_kl, n_steps)``."""
    return state.update(current_kl, n_steps)


def make_kl_controller(
    kind: str, init_coef: float, target: float | None = None, horizon: float | None = None
) -> KLController:
    """Builds a controller from config: ``kind`` is ``"fixed"`` or ``"adaptive"``."""
    if kind == "fixed":
        return FixedKLController(value=init_coef)
    if kind == "adaptive":
        if target is None or horizon is None:
            raise ValueError("adaptive KL controller needs target and horizon")
        return AdaptiveKLController(value=init_coef, target=float(target), horizon=float(horizon))
    raise ValueError(f"unknown KL controller kind {kind!r}; valid kinds: ['fixed', 'adaptive']")


def last_token_onehot(mask_bt: Array) -> Array:
    """1.0 at the last valid position of each row (rows without valid tokens are all 0)."""
    m_bt = jnp.asarray(mask_bt) != 0
    t = m_bt.shape[-1]
    last_b = t - 1 - jnp.argmax(m_bt[:, ::-1], axis=-1)
    onehot_bt = jnp.arange(t)[None, :] == last_b[:, None]
    return (onehot_bt & jnp.any(m_bt, axis=-1, keepdims=True)).astype(jnp.float32)


def apply_kl_to_rewards(
    scores_b: Array,
    logprobs_bt: Array,
    ref_logprobs_bt: Array,
    mask_bt: Array,
    kl_coef: float | Array,
    kind: str = "k1",
) -> Array:
    """Token-level rewards: ``-kl_coef * kl_t`` at every valid token plus the sequence score at
    the last valid token of each row; 0 at masked positions. Rows with no valid token drop their
    score."""
    kl_bt = kl_penalty(logprobs_bt, ref_logprobs_bt, kind)
    m_bt = _mask_like(mask_bt, kl_bt)
    rewards_bt = -_f32(kl_coef) * kl_bt + _f32(scores_b)[:, None] * last_token_onehot(m_bt)
    return jnp.where(m_bt != 0, rewards_bt, 0)


# ----------------------------------------------------------------------------- losses


def policy_loss_ppo(
    logprobs_bt: Array,
    old_logprobs_bt: Array,
    advantages_bt: Array,
    mask_bt: Array,
    clip_eps: float,
    clip_eps_high: float | None = None,
    dual_clip_c: float | None = None,
    agg: str = "token-mean",
    is_weights_bt: Array | None = None,
) -> tuple[Array, dict[str, Array]]:
    """Clipped PPO surrogate loss (to minimise).

    ``ratio = exp(logp - old_logp)``; per token
    ``max(-A * ratio, -A * clip(ratio, 1 - clip_eps, 1 + clip_eps_high))``, where
    ``clip_eps_high`` defaults to ``clip_eps`` (set it larger for DAPO-style clip-higher).
    With ``dual_clip_c`` (Ye et al. 2020, must be > 1) tokens with ``A < 0`` are further bounded by
    ``-A * c``, so a huge ratio on a bad action cannot blow up the loss. The log-ratio is clamped
    to ``[-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP]`` before ``exp`` so the ratio stays finite.
    ``is_weights_bt`` (no gradient; :func:`behaviour_importance_weights`) multiplies each token's
    clipped term: ``old_logp`` is then the proximal policy's, not the behaviour policy's.

    Metrics (no gradient): ``clipfrac`` (fraction of valid tokens where the clipped term is active),
    ``clipfrac_dual`` (where the dual clip is active), ``approx_kl`` (mean of ``old_logp - logp``,
    a k1 estimate of KL(old || new), unclamped), ``ratio_mean``, ``log_ratio_clampfrac`` (fraction
    of valid tokens whose log-ratio was clamped).
    """
    _same_bt(logprobs_bt, old_logprobs_bt, advantages_bt, mask_bt, is_weights_bt)
    if clip_eps_high is None:
        clip_eps_high = clip_eps
    if dual_clip_c is not None and not dual_clip_c > 1.0:
        raise ValueError(f"dual_clip_c must be > 1, got {dual_clip_c}")
    logprobs_bt = _f32(logprobs_bt)
    m_bt = _mask_like(mask_bt, logprobs_bt)
    adv_bt = _f32(advantages_bt)
    log_ratio_bt = logprobs_bt - _f32(old_logprobs_bt)
    ratio_bt = jnp.exp(jnp.clip(log_ratio_bt, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))

    loss1_bt = -adv_bt * ratio_bt
    loss2_bt = -adv_bt * jnp.clip(ratio_bt, 1.0 - clip_eps, 1.0 + clip_eps_high)
    loss_bt = jnp.maximum(loss1_bt, loss2_bt)
    clipped_bt = loss2_bt > loss1_bt
    dual_bt = jnp.zeros_like(clipped_bt)
    if dual_clip_c is not None:
        loss3_bt = -adv_bt * dual_clip_c
        dual_bt = (adv_bt < 0) & (loss3_bt < loss_bt)
        loss_bt = jnp.where(adv_bt < 0, jnp.minimum(loss_bt, loss3_bt), loss_bt)
    if is_weights_bt is not None:  # off-policy correction (behaviour_importance_weights)
        loss_bt = jax.lax.stop_gradient(_f32(is_weights_bt)) * loss_bt

    loss = aggregate_loss(loss_bt, m_bt, agg)
    metrics = {
        "clipfrac": masked_mean(clipped_bt, m_bt),
        "clipfrac_dual": masked_mean(dual_bt, m_bt),
        "approx_kl": masked_mean(-log_ratio_bt, m_bt),
        "ratio_mean": masked_mean(ratio_bt, m_bt),
        "log_ratio_clampfrac": masked_mean(jnp.abs(log_ratio_bt) > LOG_RATIO_CLAMP, m_bt),
    }
    return loss, jax.lax.stop_gradient(metrics)


def policy_loss_gspo(
    logprobs_bt: Array,
    old_logprobs_bt: Array,
    advantages_bt: Array,
    mask_bt: Array,
    clip_eps: float,
    clip_eps_high: float | None = None,
    dual_clip_c: float | None = None,
    agg: str = "seq-mean-token-mean",
    is_weights_bt: Array | None = None,
) -> tuple[Array, dict[str, Array]]:
    """GSPO (Zheng et al. 2025): PPO clipping on the sequence-level importance ratio
    ``s_i = exp(mean_t(logp - old_logp))`` over each response's valid tokens.

    Per token ``max(-A * s, -A * clip(s, 1 - clip_eps, 1 + clip_eps_high))``, written in the
    GSPO-token form ``s_it = sg(s_i) * p_t / sg(p_t)``: equal to ``s_i`` in value and, for
    advantages constant along a row, in gradient (``s_i * mean_t grad log p_t`` under
    ``agg="seq-mean-token-mean"``, the paper's objective). The paper's clip ranges are far smaller
    than PPO's (3e-4 / 4e-4). ``dual_clip_c`` is accepted for a common signature and unused, as in
    the paper. The sequence log-ratio is clamped to ``[-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP]``.

    Metrics (no gradient): ``clipfrac`` (fraction of valid tokens whose row is clipped),
    ``approx_kl`` and ``log_ratio_clampfrac`` as in ``policy_loss_ppo``, ``ratio_mean`` (mean
    sequence ratio over rows with valid tokens).
    """
    del dual_clip_c
    _same_bt(logprobs_bt, old_logprobs_bt, advantages_bt, mask_bt, is_weights_bt)
    if clip_eps_high is None:
        clip_eps_high = clip_eps
    logprobs_bt = _f32(logprobs_bt)
    m_bt = _mask_like(mask_bt, logprobs_bt)
    adv_bt = _f32(advantages_bt)
    log_ratio_bt = logprobs_bt - _f32(old_logprobs_bt)
    seq_log_ratio_b = masked_mean(log_ratio_bt, m_bt, axis=-1)
    clamped_b = jnp.clip(seq_log_ratio_b, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    over_b = jnp.abs(seq_log_ratio_b) > LOG_RATIO_CLAMP
    sg = jax.lax.stop_gradient
    # Each token's ratio has the row's value s_i and the gradient s_i * grad log p_t; a clamped
    # row has none, as jnp.clip gives PPO's clamped tokens.
    token_bt = jnp.where(over_b[:, None], 0.0, logprobs_bt - sg(logprobs_bt))
    ratio_bt = jnp.exp(token_bt + sg(clamped_b)[:, None])

    loss1_bt = -adv_bt * ratio_bt
    loss2_bt = -adv_bt * jnp.clip(ratio_bt, 1.0 - clip_eps, 1.0 + clip_eps_high)
    loss_bt = jnp.maximum(loss1_bt, loss2_bt)
    if is_weights_bt is not None:  # token-level off-policy correction, as in policy_loss_ppo
        loss_bt = jax.lax.stop_gradient(_f32(is_weights_bt)) * loss_bt
    loss = aggregate_loss(loss_bt, m_bt, agg)
    row_valid_b = jnp.sum(m_bt, axis=-1) > 0
    metrics = {
        "clipfrac": masked_mean(loss2_bt > loss1_bt, m_bt),
        "approx_kl": masked_mean(-log_ratio_bt, m_bt),
        "ratio_mean": masked_mean(jnp.exp(clamped_b), row_valid_b),
        "log_ratio_clampfrac": masked_mean(jnp.broadcast_to(over_b[:, None], m_bt.shape), m_bt),
    }
    return loss, jax.lax.stop_gradient(metrics)


# Off-policy correction (OffPolicy.correction): how the loss accounts for samples drawn
# from a behaviour policy other than the one the update starts from (stale weights, a
# generation engine whose numerics differ from training's).
OFF_POLICY_CORRECTIONS = ("none", "tis", "decoupled")


def behaviour_importance_weights(
    prox_logprobs_bt: Array,
    behaviour_logprobs_bt: Array,
    mask_bt: Array,
    correction: str,
    cap: float = 2.0,
) -> tuple[Array, dict[str, Array]]:
    """Per-token importance weights ``w = pi_prox / pi_behaviour`` of the sampled tokens, and
    metrics of how far the two policies are apart.

    ``prox`` is the proximal policy the PPO ratio is taken against (the trainer's own forward
    with the weights the update starts from); ``behaviour`` the policy that sampled (the
    generation engine's log-probs). ``correction``:

    - ``"none"``: ``w = 1`` (the PPO ratio is then usually taken against the behaviour
      log-probs themselves);
    - ``"tis"``: token-level truncated importance sampling, ``w = min(w, cap)``: bounded
      variance, biased when the cap binds;
    - ``"decoupled"``: the decoupled PPO objective (Hilton et al. 2022), ``w`` untruncated: the
      clip keeps the update near the proximal policy while ``w`` corrects for the behaviour one.

    The log-ratio is clamped to ``[-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP]`` before ``exp``; masked
    tokens get ``w = 0``. Metrics: ``is_clipfrac`` (valid tokens whose weight the cap cut),
    ``mismatch_abs`` (mean ``|log pi_prox - log pi_behaviour|``), ``mismatch_k3`` (the k3
    estimate of KL(behaviour || prox) per token), ``is_weight_mean`` and ``is_weight_max``.
    """
    if correction not in OFF_POLICY_CORRECTIONS:
        raise ValueError(
            f"unknown off-policy correction {correction!r}; valid: {list(OFF_POLICY_CORRECTIONS)}"
        )
    if correction == "tis" and not cap >= 1.0:
        raise ValueError(f"the truncated IS cap must be >= 1, got {cap}")
    _same_bt(prox_logprobs_bt, behaviour_logprobs_bt, mask_bt)
    prox_bt = _f32(prox_logprobs_bt)
    m_bt = _mask_like(mask_bt, prox_bt)
    valid_bt = m_bt != 0
    log_w_bt = jnp.where(valid_bt, prox_bt - _f32(behaviour_logprobs_bt), 0.0)
    w_bt = jnp.exp(jnp.clip(log_w_bt, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    capped_bt = jnp.zeros_like(valid_bt)
    if correction == "tis":
        capped_bt = w_bt > cap
        w_bt = jnp.minimum(w_bt, cap)
    elif correction == "none":
        w_bt = jnp.ones_like(w_bt)
    w_bt = jnp.where(valid_bt, w_bt, 0.0)
    metrics = {
        "is_clipfrac": masked_mean(capped_bt, m_bt),
        "mismatch_abs": masked_mean(jnp.abs(log_w_bt), m_bt),
        # k3 with log r = log pi_prox - log pi_behaviour on tokens the behaviour policy sampled.
        "mismatch_k3": masked_mean(kl_penalty(-log_w_bt, jnp.zeros_like(log_w_bt), "k3"), m_bt),
        "is_weight_mean": masked_mean(w_bt, m_bt),
        "is_weight_max": jnp.max(jnp.where(valid_bt, w_bt, 0.0)),
    }
    return w_bt, jax.lax.stop_gradient(metrics)


def value_loss_clipped(
    values_bt: Array,
    old_values_bt: Array,
    returns_bt: Array,
    mask_bt: Array,
    clip_eps: float,
    agg: str = "token-mean",
) -> tuple[Array, dict[str, Array]]:
    """Clipped value loss: ``0.5 * agg(max((V - R)**2, (V_clip - R)**2))`` with
    ``V_clip = clip(V, V_old - clip_eps, V_old + clip_eps)``.

    ``V`` is clipped directly rather than as ``V_old + clip(V - V_old)``: in float32 the latter
    can differ from ``V`` by rounding when nothing is clipped, which counted such tokens as clipped
    and (the max picking the rounded copy) dropped their gradient.

    Metrics (no gradient): ``vf_clipfrac`` (fraction of valid tokens where the clipped error is the
    larger, which needs ``V_clip != V``), ``vpred_mean``.
    """
    _same_bt(values_bt, old_values_bt, returns_bt, mask_bt)
    values_bt = _f32(values_bt)
    old_values_bt = _f32(old_values_bt)
    returns_bt = _f32(returns_bt)
    m_bt = _mask_like(mask_bt, values_bt)
    v_clip_bt = jnp.clip(values_bt, old_values_bt - clip_eps, old_values_bt + clip_eps)
    err1_bt = jnp.square(values_bt - returns_bt)
    err2_bt = jnp.square(v_clip_bt - returns_bt)
    loss = 0.5 * aggregate_loss(jnp.maximum(err1_bt, err2_bt), m_bt, agg)
    metrics = {
        "vf_clipfrac": masked_mean((v_clip_bt != values_bt) & (err2_bt > err1_bt), m_bt),
        "vpred_mean": masked_mean(values_bt, m_bt),
    }
    return loss, jax.lax.stop_gradient(metrics)


def entropy_bonus(entropy_bt: Array, mask_bt: Array, agg: str = "token-mean") -> Array:
    """Aggregated entropy; trainers subtract ``entropy_coef * entropy_bonus(...)`` from the loss."""
    return aggregate_loss(entropy_bt, mask_bt, agg)


def sft_loss(
    logits_btv: Array, targets_bt: Array, mask_bt: Array, agg: str = "token-mean"
) -> tuple[Array, dict[str, Array]]:
    """Masked next-token cross-entropy (log-softmax in float32).

    Metrics (no gradient): ``nll`` (token-mean), ``accuracy`` (argmax == target, token-mean),
    ``num_tokens``.
    """
    logp_bt = token_logprobs(logits_btv, targets_bt)
    m_bt = _mask_like(mask_bt, logp_bt)
    loss = aggregate_loss(-logp_bt, m_bt, agg)
    correct_bt = jnp.argmax(logits_btv, axis=-1) == jnp.asarray(targets_bt)
    metrics = {
        "nll": masked_mean(-logp_bt, m_bt),
        "accuracy": masked_mean(correct_bt, m_bt),
        "num_tokens": jnp.sum(m_bt),
    }
    return loss, jax.lax.stop_gradient(metrics)


def bradley_terry_loss(
    chosen_scores_b: Array, rejected_scores_b: Array, margin: Array | float | None = None
) -> tuple[Array, dict[str, Array]]:
    """Pairwise reward-model loss: ``mean(-log_sigmoid(chosen - rejected - margin))``.

    Metrics (no gradient): ``accuracy`` (fraction with chosen > rejected, ties count as wrong),
    ``reward_margin`` (mean of chosen - rejected), ``chosen_mean``, ``rejected_mean``.
    """
    chosen_b = _f32(chosen_scores_b)
    rejected_b = _f32(rejected_scores_b)
    diff_b = chosen_b - rejected_b
    logits_b = diff_b if margin is None else diff_b - _f32(margin)
    loss = -jnp.mean(jax.nn.log_sigmoid(logits_b))
    metrics = {
        "accuracy": jnp.mean((diff_b > 0).astype(diff_b.dtype)),
        "reward_margin": jnp.mean(diff_b),
        "chosen_mean": jnp.mean(chosen_b),
        "rejected_mean": jnp.mean(rejected_b),
    }
    return loss, jax.lax.stop_gradient(metrics)


# ----------------------------------------------------------------------------- DPO


def sequence_logprobs(logprobs_bt: Array, mask_bt: Array, mean: bool = False) -> Array:
    """Each row's response log-probability: the sum of its valid tokens' log-probs, or with
    ``mean=True`` their mean (the length-normalized form IPO compares). A row without a valid
    token gives 0; masked NaN/inf do not leak."""
    logprobs_bt = _f32(logprobs_bt)
    if mean:
        return masked_mean(logprobs_bt, mask_bt, axis=-1)
    return masked_sum(logprobs_bt, mask_bt, axis=-1)


def dpo_sigmoid_loss(logits_b: Array, beta: float | Array, label_smoothing: float | Array = 0.0):
    """DPO (Rafailov et al. 2023): ``-log sigmoid(beta * h)`` per pair, ``h`` the log-ratio
    margin. With ``label_smoothing = eps`` (conservative DPO) each label is taken to be wrong
    with probability ``eps``: ``-(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)``."""
    z_b = _f32(beta) * logits_b
    eps = _f32(label_smoothing)
    return -(1.0 - eps) * jax.nn.log_sigmoid(z_b) - eps * jax.nn.log_sigmoid(-z_b)


def dpo_ipo_loss(logits_b: Array, beta: float | Array, label_smoothing: float | Array = 0.0):
    """IPO (Azar et al. 2023): ``(h - 1 / (2 beta))**2`` per pair: the margin is regressed to a
    finite target instead of pushed to infinity, so deterministic preferences cannot drive the
    policy arbitrarily far from the reference. ``h`` compares per-token mean log-probs (the
    paper's and TRL's choice, ``DPO_MEAN_LOGPROBS``); label smoothing does not apply."""
    del label_smoothing
    return jnp.square(logits_b - 1.0 / (2.0 * _f32(beta)))


DPO_LOSSES: dict[str, Callable[..., Array]] = {
    "sigmoid": dpo_sigmoid_loss,
    "ipo": dpo_ipo_loss,
}
# Loss types whose sequence log-probs are per-token means (sequence_logprobs(mean=True)).
DPO_MEAN_LOGPROBS = ("ipo",)


def dpo_loss(
    policy_chosen_b: Array,
    policy_rejected_b: Array,
    ref_chosen_b: Array,
    ref_rejected_b: Array,
    beta: float | Array,
    loss_type: str = "sigmoid",
    label_smoothing: float | Array = 0.0,
    pair_mask_b: Array | None = None,
) -> tuple[Array, dict[str, Array]]:
    """Direct preference optimization on per-sequence log-probs (``sequence_logprobs``: sums,
    or per-token means for the types in ``DPO_MEAN_LOGPROBS``) under the policy and the frozen
    reference.

    Each response's implicit reward is ``beta * (log pi - log ref)``; the pair's log-ratio
    margin is ``h = (pi_c - ref_c) - (pi_r - ref_r)`` and the loss is the mean over pairs of
    ``DPO_LOSSES[loss_type](h, beta, label_smoothing)``. ``pair_mask_b`` (1 on pairs to count)
    leaves out pairs, e.g. those whose chosen or rejected response has no valid token: the
    loss and metrics average over the pairs it keeps, and are 0 (with finite gradients) when it
    keeps none.

    Metrics (no gradient, over the kept pairs): ``accuracy`` (fraction whose chosen reward
    exceeds the rejected one; ties count as wrong, so a policy equal to its reference scores 0),
    ``reward_margin`` (mean ``beta * h``), ``chosen_reward`` and ``rejected_reward`` (mean
    implicit rewards), ``chosen_logp`` and ``rejected_logp`` (mean policy log-probs, in the form
    given).
    """
    loss_of = get_dpo_loss(loss_type)
    pi_c, pi_r = _f32(policy_chosen_b), _f32(policy_rejected_b)
    ref_c, ref_r = _f32(ref_chosen_b), _f32(ref_rejected_b)
    m_b = jnp.ones_like(pi_c) if pair_mask_b is None else _mask_like(pair_mask_b, pi_c)
    valid_b = m_b != 0
    # Invalid pairs (e.g. an empty response's log-prob) are zeroed before the loss so that
    # neither a NaN there nor its gradient can reach the result.
    logits_b = jnp.where(valid_b, (pi_c - ref_c) - (pi_r - ref_r), 0.0)
    loss = masked_mean(loss_of(logits_b, beta, label_smoothing), m_b)
    beta = _f32(beta)
    chosen_b, rejected_b = beta * (pi_c - ref_c), beta * (pi_r - ref_r)
    metrics = {
        "accuracy": masked_mean(chosen_b > rejected_b, m_b),
        "reward_margin": masked_mean(beta * logits_b, m_b),
        "chosen_reward": masked_mean(chosen_b, m_b),
        "rejected_reward": masked_mean(rejected_b, m_b),
        "chosen_logp": masked_mean(pi_c, m_b),
        "rejected_logp": masked_mean(pi_r, m_b),
    }
    return loss, jax.lax.stop_gradient(metrics)


# ----------------------------------------------------------------------------- registries

POLICY_LOSSES: dict[str, Callable[..., tuple[Array, dict[str, Array]]]] = {
    "ppo": policy_loss_ppo,
    "gspo": policy_loss_gspo,
}

ADVANTAGE_ESTIMATORS: dict[str, Callable[..., tuple[Array, Array]]] = {
    "gae": gae_estimator,
    "grpo": grpo_estimator,
    "drgrpo": drgrpo_estimator,
    "rloo": rloo_estimator,
    "reinforce++": reinforce_pp_estimator,
    "reinforce++-baseline": reinforce_pp_baseline_estimator,
}
# Estimators that compare the samples of one prompt: they need RLConfig.samples_per_prompt >= 2.
GROUP_ESTIMATORS = ("grpo", "drgrpo", "rloo", "reinforce++-baseline")


def _lookup(registry: dict[str, Any], what: str, name: str) -> Any:
    try:
        return registry[name]
    except KeyError:
        raise ValueError(f"unknown {what} {name!r}; valid names: {sorted(registry)}") from None


def get_policy_loss(name: str) -> Callable[..., tuple[Array, dict[str, Array]]]:
    """Looks up a policy loss by name; raises ValueError listing the valid names."""
    return _lookup(POLICY_LOSSES, "policy loss", name)


def get_dpo_loss(name: str) -> Callable[..., Array]:
    """Looks up a DPO loss type by name; raises ValueError listing the valid names."""
    return _lookup(DPO_LOSSES, "DPO loss type", name)


def get_advantage_estimator(name: str) -> Callable[..., tuple[Array, Array]]:
    """Looks up an advantage estimator by name; raises ValueError listing the valid names."""
    return _lookup(ADVANTAGE_ESTIMATORS, "advantage estimator", name)


def check_algorithm_config(rl: Any, algorithm: str) -> None:
    """One-line ValueError naming the RLConfig field whose loss or estimator no registry knows,
    or ``samples_per_prompt`` when a group estimator would have no group to compare."""
    try:
        get_policy_loss(rl.policy_loss)
    except ValueError as e:
        raise ValueError(f"RLConfig.policy_loss: {e}") from None
    name = advantage_estimator_name(rl, algorithm)
    try:
        get_advantage_estimator(name)
    except ValueError as e:
        raise ValueError(f"RLConfig.advantage_estimator: {e}") from None
    if name in GROUP_ESTIMATORS and rl.samples_per_prompt < 2:
        raise ValueError(
            f"RLConfig.samples_per_prompt: advantage estimator {name!r} compares the samples of a "
            f"prompt and needs >= 2, got {rl.samples_per_prompt}"
        )


def kl_in_loss(rl: Any, algorithm: str) -> bool:
    """Whether the KL to the reference is a loss term (GRPO, or RLConfig.kl_in_loss) rather than
    a per-token reward penalty."""
    return bool(rl.kl_in_loss) or algorithm == "grpo"


def uses_reference(rl: Any) -> bool:
    """Whether the reference model's log-probs reach the loss: a KL coefficient above 0 (as a
    reward penalty or a loss term), or an adaptive controller (which observes the KL). Otherwise
    the reference is neither built nor scored, and no KL metric is reported."""
    return rl.kl_coef > 0 or rl.adaptive_kl_target > 0


def kl_estimator_name(rl: Any, algorithm: str) -> str:
    """RLConfig.kl_estimator, or by default k3 where the KL is a loss term (k1's gradient is zero
    in expectation there) and k1 where it is a reward penalty."""
    return rl.kl_estimator or ("k3" if kl_in_loss(rl, algorithm) else "k1")


def advantage_estimator_name(rl: Any, algorithm: str) -> str:
    """RLConfig.advantage_estimator, or the stage's own (GAE for PPO, group baselines for GRPO)."""
    return rl.advantage_estimator or ("gae" if algorithm == "ppo" else "grpo")
