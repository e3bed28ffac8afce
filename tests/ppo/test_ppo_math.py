"""jrlhf.ppo.core_algos against independent NumPy re-derivations (float64 references)."""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrlhf.config import (
    DPO_LOSS_TYPES,
    ConfigError,
    OffPolicy,
    RLConfig,
    SampleFilters,
    load_config,
)
from jrlhf.models import logprobs
from jrlhf.ppo import core_algos as ca

TOL = dict(rtol=1e-5, atol=1e-6)
AGGS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def close(actual, expected, **tol):
    np.testing.assert_allclose(np.asarray(actual, np.float64), expected, **(tol or TOL))


# ----------------------------------------------------------------------------- fixtures

B, T = 6, 7


def left_aligned_mask() -> np.ndarray:
    # Row lengths cover: full, partial, length-1, empty.
    lengths = [7, 5, 3, 1, 0, 6]
    return (np.arange(T)[None, :] < np.array(lengths)[:, None]).astype(np.float32)


def ragged_mask() -> np.ndarray:
    return np.array(
        [
            [1, 1, 0, 0, 1, 1, 0],  # hole in the middle, trailing padding
            [0, 0, 1, 1, 1, 1, 1],  # leading gap
            [1, 0, 1, 0, 1, 0, 1],  # alternating
            [0, 0, 0, 1, 0, 0, 0],  # single valid token inside the row
            [0, 0, 0, 0, 0, 0, 0],  # empty
            [1, 1, 1, 1, 1, 1, 1],  # full
        ],
        np.float32,
    )


MASKS = {"left": left_aligned_mask, "ragged": ragged_mask}


def rand(seed, *shape, scale=1.0):
    return (np.random.default_rng(seed).normal(size=shape) * scale).astype(np.float32)


# ----------------------------------------------------------------------------- numpy references


def np_masked_values(x, m):
    return np.asarray(x, np.float64)[np.asarray(m) != 0]


def np_agg(loss_bt, mask_bt, mode):
    loss_bt = np.asarray(loss_bt, np.float64)
    if mode == "token-mean":
        sel = np_masked_values(loss_bt, mask_bt)
        return sel.mean() if sel.size else 0.0
    per_row = []
    for b in range(loss_bt.shape[0]):
        sel = np_masked_values(loss_bt[b], mask_bt[b])
        if sel.size == 0:
            continue
        if mode == "seq-mean-token-sum":
            per_row.append(sel.sum())
        elif mode == "seq-mean-token-sum-norm":  # Dr. GRPO: over the constant row width
            per_row.append(sel.sum() / loss_bt.shape[1])
        else:
            per_row.append(sel.mean())
    return float(np.mean(per_row)) if per_row else 0.0


def np_agg_weight(mask_bt, mode):
    """Tokens for token-mean, non-empty rows otherwise."""
    m = np.asarray(mask_bt) != 0
    return float(m.sum()) if mode == "token-mean" else float(m.any(axis=1).sum())


def np_gae(rewards, values, mask, gamma, lam):
    """Compacts each row to its valid tokens and runs textbook GAE backwards over them."""
    adv = np.zeros(rewards.shape, np.float64)
    ret = np.zeros(rewards.shape, np.float64)
    for b in range(rewards.shape[0]):
        idx = np.nonzero(mask[b])[0]
        r = rewards[b, idx].astype(np.float64)
        v = values[b, idx].astype(np.float64)
        n = len(idx)
        a = np.zeros(n)
        running = 0.0
        for k in reversed(range(n)):
            next_v = v[k + 1] if k + 1 < n else 0.0
            delta = r[k] + gamma * next_v - v[k]
            running = delta + gamma * lam * running
            a[k] = running
        adv[b, idx] = a
        ret[b, idx] = a + v
    return adv, ret


def np_kl(logp, ref, kind):
    logp = np.asarray(logp, np.float64)
    ref = np.asarray(ref, np.float64)
    if kind == "k1":
        return logp - ref
    if kind == "k2":
        return 0.5 * (logp - ref) ** 2
    if kind == "abs":
        return np.abs(logp - ref)
    r = np.exp(ref - logp)  # q/p
    return r - np.log(r) - 1.0


def np_ppo_token_losses(logp, old, adv, eps_low, eps_high, dual_c):
    """Pessimistic-bound form: A >= 0 uses min(r, 1 + eps_high), A < 0 uses max(r, 1 - eps_low)."""
    loss = np.zeros(logp.shape, np.float64)
    clipped = np.zeros(logp.shape, bool)
    dual = np.zeros(logp.shape, bool)
    for i in np.ndindex(logp.shape):
        r = np.exp(np.float64(logp[i]) - np.float64(old[i]))
        a = np.float64(adv[i])
        if a >= 0:
            loss[i] = -a * min(r, 1 + eps_high)
            clipped[i] = a > 0 and r > 1 + eps_high
        else:
            loss[i] = -a * max(r, 1 - eps_low)
            clipped[i] = r < 1 - eps_low
            if dual_c is not None and -a * dual_c < loss[i]:
                loss[i] = -a * dual_c
                dual[i] = True
    return loss, clipped, dual


def np_log_softmax(logits):
    logits = np.asarray(logits, np.float64)
    mx = logits.max(-1, keepdims=True)
    return logits - mx - np.log(np.exp(logits - mx).sum(-1, keepdims=True))


# ----------------------------------------------------------------------------- masked statistics


@pytest.mark.parametrize("mask_name", sorted(MASKS))
def test_masked_stats_match_numpy(mask_name):
    m = MASKS[mask_name]()
    x = rand(0, B, T)
    x_nan = np.where(m != 0, x, np.nan).astype(np.float32)  # masked NaN must not leak
    sel = np_masked_values(x, m)
    close(ca.masked_sum(x_nan, m), sel.sum())
    close(ca.masked_mean(x_nan, m), sel.mean())
    close(ca.masked_var(x_nan, m), sel.var(ddof=1))
    close(ca.masked_var(x_nan, m, unbiased=False), sel.var(ddof=0))

    row_mean, row_var, row_sum = [], [], []
    for b in range(B):
        s = np_masked_values(x[b], m[b])
        row_sum.append(s.sum())
        row_mean.append(s.mean() if s.size else 0.0)
        row_var.append(s.var(ddof=1) if s.size > 1 else 0.0)
    close(ca.masked_sum(x_nan, m, axis=1), row_sum)
    close(ca.masked_mean(x_nan, m, axis=1), row_mean)
    close(ca.masked_var(x_nan, m, axis=1), row_var)


def test_masked_stats_all_masked_are_zero_with_finite_grads():
    x = rand(1, 3, 4)
    m = np.zeros((3, 4), np.float32)
    for fn in (ca.masked_sum, ca.masked_mean, ca.masked_var):
        assert float(fn(x, m)) == 0.0
        g = jax.grad(lambda x_, fn=fn: fn(x_, m))(jnp.asarray(x))
        np.testing.assert_array_equal(np.asarray(g), 0.0)
    np.testing.assert_array_equal(np.asarray(ca.masked_whiten(x, m)), x)


def test_masked_mean_accepts_bool_mask_and_weights():
    x = rand(2, 2, 3)
    mb = np.array([[True, False, True], [False, False, True]])
    close(ca.masked_mean(x, mb), x[mb].astype(np.float64).mean())
    w = np.array([[0.5, 0.0, 2.0], [0.0, 0.0, 1.0]], np.float32)
    expected = (x.astype(np.float64) * w).sum() / w.sum()
    close(ca.masked_mean(x, w), expected)


@pytest.mark.parametrize("shift_mean", [True, False])
@pytest.mark.parametrize("mask_name", sorted(MASKS))
def test_masked_whiten(mask_name, shift_mean):
    m = MASKS[mask_name]()
    x = rand(3, B, T, scale=3.0) + 2.0
    sel = np_masked_values(x, m)
    mean, var = sel.mean(), sel.var(ddof=1)
    expected = (x.astype(np.float64) - mean) / np.sqrt(var + 1e-8)
    if not shift_mean:
        expected += mean
    expected = np.where(m != 0, expected, x)
    out = np.asarray(ca.masked_whiten(x, m, shift_mean=shift_mean))
    close(out, expected)
    w = np_masked_values(out, m)
    close(w.var(ddof=1), 1.0, rtol=1e-5)
    close(w.mean(), 0.0 if shift_mean else mean, atol=1e-5)


# ----------------------------------------------------------------------------- aggregation


@pytest.mark.parametrize("mode", AGGS)
@pytest.mark.parametrize("mask_name", sorted(MASKS))
def test_aggregate_loss(mask_name, mode):
    m = MASKS[mask_name]()
    loss = rand(4, B, T)
    close(ca.aggregate_loss(loss, m, mode), np_agg(loss, m, mode))
    # All-masked batch: 0, never NaN.
    assert float(ca.aggregate_loss(loss, np.zeros_like(m), mode)) == 0.0


@pytest.mark.parametrize("mode", AGGS)
@pytest.mark.parametrize("mask_name", sorted(MASKS))
def test_aggregation_weight_splits_consistently(mask_name, mode):
    """Weighting each part's aggregate by its weight recovers the whole batch's aggregate, for
    any split of the rows (what gradient accumulation relies on)."""
    m = MASKS[mask_name]()
    loss = rand(40, B, T)
    close(ca.aggregation_weight(m, mode), np_agg_weight(m, mode))
    for parts in ([0, 2, 4, 6], [0, 3, 6], [0, 1, 4, 5, 6]):
        num = den = 0.0
        for lo, hi in itertools.pairwise(parts):
            w = float(ca.aggregation_weight(m[lo:hi], mode))
            num += w * float(ca.aggregate_loss(loss[lo:hi], m[lo:hi], mode))
            den += w
        close(num / den, np_agg(loss, m, mode))
    with pytest.raises(ValueError, match="loss aggregation"):
        ca.aggregation_weight(m, "sum")


def test_aggregate_loss_modes_differ_and_unknown_raises():
    m = left_aligned_mask()
    loss = rand(5, B, T) + 3.0
    vals = [float(ca.aggregate_loss(loss, m, mode)) for mode in AGGS]
    assert len({round(v, 4) for v in vals}) == len(AGGS)
    with pytest.raises(ValueError, match="seq-mean-token-sum"):
        ca.aggregate_loss(loss, m, "sum")


# ----------------------------------------------------------------------------- GAE


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
@pytest.mark.parametrize("mask_name", sorted(MASKS))
def test_gae_matches_backward_loop(mask_name, gamma, lam):
    m = MASKS[mask_name]()
    r = rand(6, B, T)
    v = rand(7, B, T)
    # Garbage at masked positions must not affect valid ones.
    r_in = np.where(m != 0, r, 1e3).astype(np.float32)
    v_in = np.where(m != 0, v, -1e3).astype(np.float32)
    adv, ret = ca.compute_gae(r_in, v_in, m, gamma, lam)
    adv_ref, ret_ref = np_gae(r, v, m, gamma, lam)
    close(adv, adv_ref, rtol=1e-5, atol=1e-5)
    close(ret, ret_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(adv)[m == 0], 0.0)
    np.testing.assert_array_equal(np.asarray(ret)[m == 0], 0.0)


def test_gae_hand_computed_cases():
    m = np.array([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], np.float32)
    r = np.array([[0.0, 0.0, 1.0, 9.0], [2.0, 9.0, 9.0, 9.0], [9.0] * 4], np.float32)
    # gamma = lam = 1, zero values: advantages are reverse cumulative rewards.
    adv, ret = ca.compute_gae(r, np.zeros_like(r), m, 1.0, 1.0)
    close(adv, [[1, 1, 1, 0], [2, 0, 0, 0], [0, 0, 0, 0]])
    close(ret, adv)
    # Length-1 response: A = r - V (bootstraps to 0 past the last valid token).
    v = np.full_like(r, 0.5)
    adv, ret = ca.compute_gae(r, v, m, 0.9, 0.8)
    close(adv[1, 0], 1.5)
    close(ret[1, 0], 2.0)
    # Last valid token of row 0: delta = 1 - 0.5; previous: 0 + 0.9*0.5 - 0.5 + 0.72*0.5.
    close(adv[0, 2], 0.5)
    close(adv[0, 1], 0.9 * 0.5 - 0.5 + 0.72 * 0.5)


def test_gae_jit_with_traced_gamma_lambda():
    m = ragged_mask()
    r, v = rand(8, B, T), rand(9, B, T)
    fn = jax.jit(ca.compute_gae)
    adv, ret = fn(r, v, m, jnp.float32(0.97), jnp.float32(0.9))
    adv_ref, ret_ref = np_gae(r, v, m, 0.97, 0.9)
    close(adv, adv_ref, rtol=1e-5, atol=1e-5)
    close(ret, ret_ref, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- KL


@pytest.mark.parametrize("kind", ca.KL_KINDS)
def test_kl_penalty_pointwise(kind):
    logp, ref = rand(10, 3, 5), rand(11, 3, 5)
    close(ca.kl_penalty(logp, ref, kind), np_kl(logp, ref, kind))
    assert ca.kl_penalty(jnp.asarray(logp, jnp.bfloat16), ref, kind).dtype == jnp.float32


def test_kl_estimators_are_exact_in_expectation():
    # Under samples from p, E[k1] = E[k3] = KL(p || q): check with exact expectations over a
    # categorical distribution.
    rng = np.random.default_rng(12)
    logp = np_log_softmax(rng.normal(size=11)).astype(np.float32)
    logq = np_log_softmax(rng.normal(size=11)).astype(np.float32)
    p = np.exp(logp.astype(np.float64))
    kl = float(np.sum(p * (logp.astype(np.float64) - logq)))
    for kind in ("k1", "k3"):
        est = np.asarray(ca.kl_penalty(logp, logq, kind), np.float64)
        close(np.sum(p * est), kl, rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(ca.kl_penalty(logp, logq, "k3")) >= 0)


def test_kl_k3_clamps_large_log_ratios_and_is_unchanged_otherwise():
    d = np.array([-100.0, -20.0, -19.5, -3.0, 0.0, 2.5, 19.9, 20.0, 80.0], np.float32)
    ref = np.zeros_like(d)
    out = np.asarray(ca.kl_penalty(d, ref, "k3"))
    assert np.all(np.isfinite(out))
    inside = np.abs(d) <= ca.LOG_RATIO_CLAMP
    # Bit-identical to the unclamped formula wherever nothing clamps.
    unclamped = np.asarray(jnp.exp(-jnp.asarray(d)) + jnp.asarray(d) - 1.0)
    np.testing.assert_array_equal(out[inside], unclamped[inside])
    close(out[~inside], np_kl(np.clip(d, -20, 20), ref, "k3")[~inside])
    assert not np.isfinite(unclamped[0])  # what the clamp prevents


def test_kl_estimator_defaults_follow_where_the_kl_goes():
    rl = RLConfig()
    assert ca.kl_estimator_name(rl, "grpo") == "k3"  # a loss term: k1's gradient is 0 on average
    assert ca.kl_estimator_name(rl, "ppo") == "k1"  # a reward penalty
    assert ca.kl_estimator_name(dataclasses.replace(rl, kl_in_loss=True), "ppo") == "k3"
    for kind in ca.KL_KINDS:  # explicit values are honoured
        explicit = dataclasses.replace(rl, kl_estimator=kind)
        assert ca.kl_estimator_name(explicit, "grpo") == ca.kl_estimator_name(explicit, "ppo")
        assert ca.kl_estimator_name(explicit, "grpo") == kind


def test_kl_penalty_unknown_kind():
    with pytest.raises(ValueError, match="k3"):
        ca.kl_penalty(jnp.zeros(2), jnp.zeros(2), "k4")


def test_adaptive_kl_controller_several_updates():
    target, horizon, init = 6.0, 1000.0, 0.2
    ctrl = ca.make_kl_controller("adaptive", init, target=target, horizon=horizon)
    assert isinstance(ctrl, ca.AdaptiveKLController)
    observed = [(6.0, 64), (12.0, 64), (0.0, 128), (6.6, 32), (5.1, 256), (100.0, 64)]
    expected = init
    update = jax.jit(ca.update_kl_controller)
    for kl, n in observed:
        err = min(max(kl / target - 1.0, -0.2), 0.2)
        expected = expected * (1.0 + err * n / horizon)
        ctrl = update(ctrl, kl, n)
        assert isinstance(ctrl, ca.AdaptiveKLController)
        assert (ctrl.target, ctrl.horizon) == (target, horizon)
        close(ctrl.value, expected, rtol=1e-6)
    # The value is the only pytree leaf: the checkpointable state.
    leaves, treedef = jax.tree_util.tree_flatten(ctrl)
    assert len(leaves) == 1
    restored = jax.tree_util.tree_unflatten(treedef, [np.float32(0.5)])
    assert restored.target == target and float(restored.value) == 0.5
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctrl.value = 1.0


@pytest.mark.parametrize("kind", ["k1", "k3"])
def test_observed_kl_is_per_token_mean_of_the_estimator(kind):
    m = left_aligned_mask()  # has an empty row, which must not count
    logp, ref = rand(42, B, T), rand(43, B, T)
    kl = np_kl(logp, ref, kind)
    rows = [kl[b][m[b] != 0].mean() for b in range(B) if m[b].any()]
    close(ca.observed_kl(logp, ref, m, kind), np.mean(rows))


def test_fixed_kl_controller_and_factory_errors():
    ctrl = ca.make_kl_controller("fixed", 0.05)
    assert ca.update_kl_controller(ctrl, 100.0, 10) is ctrl
    assert ctrl.update(0.0, 10).value == 0.05
    with pytest.raises(ValueError, match="adaptive"):
        ca.make_kl_controller("pid", 0.1)
    with pytest.raises(ValueError):
        ca.make_kl_controller("adaptive", 0.1)


@pytest.mark.parametrize("kind", ["k1", "k3"])
@pytest.mark.parametrize("mask_name", sorted(MASKS))
def test_apply_kl_to_rewards(mask_name, kind):
    m = MASKS[mask_name]()
    scores = rand(13, B)
    logp, ref = rand(14, B, T), rand(15, B, T)
    coef = 0.1
    expected = np.zeros((B, T))
    kl = np_kl(logp, ref, kind)
    for b in range(B):
        valid = np.nonzero(m[b])[0]
        for t in valid:
            expected[b, t] = -coef * kl[b, t]
        if len(valid):
            expected[b, valid[-1]] += scores[b]
    close(ca.apply_kl_to_rewards(scores, logp, ref, m, coef, kind), expected)


# ----------------------------------------------------------------------------- PPO policy loss


def ppo_inputs(mask_name):
    m = MASKS[mask_name]()
    logp = rand(16, B, T, scale=0.5)
    old = (logp + rand(17, B, T, scale=0.4)).astype(np.float32)
    adv = rand(18, B, T)
    adv[0, 0] = 0.0  # zero advantage: never "clipped"
    # Row 5 is fully valid under both masks: plant a large ratio on a negative advantage (the
    # dual-clip regime) and on a positive one.
    old[5, 2], adv[5, 2] = logp[5, 2] - 1.5, -1.0
    old[5, 3], adv[5, 3] = logp[5, 3] - 1.5, 1.0
    return logp, old, adv, m


@pytest.mark.parametrize(
    "eps,eps_high,dual_c",
    [(0.2, None, None), (0.2, 0.28, None), (0.1, None, 3.0), (0.2, 0.3, 1.5)],
)
@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("mask_name", sorted(MASKS))
def test_policy_loss_ppo(mask_name, agg, eps, eps_high, dual_c):
    logp, old, adv, m = ppo_inputs(mask_name)
    loss, metrics = ca.policy_loss_ppo(logp, old, adv, m, eps, eps_high, dual_c, agg)
    tok, clipped, dual = np_ppo_token_losses(
        logp, old, adv, eps, eps if eps_high is None else eps_high, dual_c
    )
    close(loss, np_agg(tok, m, agg))
    sel = m != 0
    close(metrics["clipfrac"], clipped[sel].mean())
    close(metrics["clipfrac_dual"], dual[sel].mean())
    close(metrics["approx_kl"], (old.astype(np.float64) - logp)[sel].mean())
    # The fixture must exercise the branches under test.
    assert 0 < clipped[sel].mean() < 1
    if dual_c is not None:
        assert dual[sel].any()


@pytest.mark.parametrize("eps_high,dual_c", [(None, None), (0.3, 2.0)])
def test_policy_loss_grad_zero_on_clipped_tokens(eps_high, dual_c):
    eps = 0.2
    logp, old, adv, m = ppo_inputs("ragged")
    grad = jax.grad(lambda lp: ca.policy_loss_ppo(lp, old, adv, m, eps, eps_high, dual_c)[0])(
        jnp.asarray(logp)
    )
    _, clipped, dual = np_ppo_token_losses(
        logp, old, adv, eps, eps if eps_high is None else eps_high, dual_c
    )
    ratio = np.exp(logp.astype(np.float64) - old)
    active = (m != 0) & ~clipped & ~dual
    expected = np.where(active, -adv * ratio / m.sum(), 0.0)
    close(grad, expected, rtol=1e-5, atol=1e-7)
    assert np.any((m != 0) & clipped) and np.all(np.asarray(grad)[clipped] == 0)


def test_policy_loss_on_policy_and_bad_dual_clip():
    _, _, adv, m = ppo_inputs("left")
    logp = rand(19, B, T)
    loss, metrics = ca.policy_loss_ppo(logp, logp, adv, m, 0.2)
    close(loss, -np_masked_values(adv, m).mean())
    assert float(metrics["clipfrac"]) == 0.0 and float(metrics["approx_kl"]) == 0.0
    with pytest.raises(ValueError, match="dual_clip_c"):
        ca.policy_loss_ppo(logp, logp, adv, m, 0.2, dual_clip_c=1.0)


def test_policy_loss_clamps_log_ratio():
    logp, old, adv, m = ppo_inputs("left")
    ref_loss, ref_metrics = ca.policy_loss_ppo(logp, old, adv, m, 0.2, dual_clip_c=3.0)
    assert float(ref_metrics["log_ratio_clampfrac"]) == 0.0
    # Nothing clamps: identical to the unclamped computation.
    lr = jnp.asarray(logp) - jnp.asarray(old)
    ratio = jnp.exp(lr)
    a = jnp.asarray(adv)
    tok = jnp.maximum(-a * ratio, -a * jnp.clip(ratio, 0.8, 1.2))
    tok = jnp.where(a < 0, jnp.minimum(tok, -a * 3.0), tok)
    assert float(ref_loss) == float(ca.aggregate_loss(tok, m, "token-mean"))
    # A log-ratio of 200 would make exp overflow to inf (and 0 * inf = NaN); clamped it is finite.
    huge = logp.copy()
    huge[1, 0], huge[2, 1] = old[1, 0] + 200.0, old[2, 1] - 200.0
    for agg in AGGS:
        loss, metrics = ca.policy_loss_ppo(huge, old, adv, m, 0.2, agg=agg)
        grad = jax.grad(lambda x, agg=agg: ca.policy_loss_ppo(x, old, adv, m, 0.2, agg=agg)[0])(
            jnp.asarray(huge)
        )
        assert np.isfinite(float(loss)) and np.all(np.isfinite(np.asarray(grad)))
        assert all(np.isfinite(float(v)) for v in metrics.values())
        close(metrics["log_ratio_clampfrac"], 2 / m.sum())


def test_dual_clip_is_on_by_default_and_validated():
    rl = RLConfig()
    assert rl.dual_clip_c == 3.0  # verl's default; 0 disables
    RLConfig(dual_clip_c=0.0).validate("ppo")
    with pytest.raises(ConfigError, match=r"^RLConfig.dual_clip_c: must be > 1"):
        RLConfig(dual_clip_c=1.0).validate("ppo")
    with pytest.raises(ConfigError, match=r"^RLConfig.kl_estimator: unknown estimator 'k4'"):
        RLConfig(kl_estimator="k4").validate("ppo")
    # The default bounds a negative-advantage token with a huge ratio at -A * c.
    logp, old, adv, m = ppo_inputs("left")
    _, on = ca.policy_loss_ppo(logp, old, adv, m, 0.2, dual_clip_c=rl.dual_clip_c)
    assert float(on["clipfrac_dual"]) > 0


def test_policy_loss_all_masked_is_zero_not_nan():
    logp, old, adv, _ = ppo_inputs("left")
    m = np.zeros((B, T), np.float32)
    for agg in AGGS:
        loss, metrics = ca.policy_loss_ppo(logp, old, adv, m, 0.2, dual_clip_c=3.0, agg=agg)
        assert float(loss) == 0.0
        assert all(np.isfinite(float(v)) for v in metrics.values())


# ----------------------------------------------------------------------------- value loss


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("mask_name", sorted(MASKS))
def test_value_loss_clipped(mask_name, agg):
    m = MASKS[mask_name]()
    v, old, ret = rand(20, B, T), rand(21, B, T), rand(22, B, T)
    eps = 0.3
    v64, old64, ret64 = (a.astype(np.float64) for a in (v, old, ret))
    v_clip = np.empty_like(v64)
    for i in np.ndindex(v.shape):
        v_clip[i] = min(max(v64[i], old64[i] - eps), old64[i] + eps)
    e1, e2 = (v64 - ret64) ** 2, (v_clip - ret64) ** 2
    loss, metrics = ca.value_loss_clipped(v, old, ret, m, eps, agg)
    close(loss, 0.5 * np_agg(np.maximum(e1, e2), m, agg))
    close(metrics["vf_clipfrac"], (e2 > e1)[m != 0].mean())
    assert 0 < float(metrics["vf_clipfrac"]) < 1

    if agg == "token-mean":
        grad = jax.grad(lambda x: ca.value_loss_clipped(x, old, ret, m, eps)[0])(jnp.asarray(v))
        expected = np.where((m != 0) & (e1 >= e2), (v64 - ret64) / m.sum(), 0.0)
        close(grad, expected, rtol=1e-5, atol=1e-7)


def test_vf_clipfrac_does_not_count_float_rounding():
    """``V_old + clip(V - V_old)`` rounds away from ``V`` in float32 even when nothing is clipped;
    the clipped value is ``clip(V, V_old - eps, V_old + eps)``, which equals ``V`` then."""
    rng = np.random.default_rng(41)
    eps = np.float32(0.2)
    old = (rng.uniform(-0.1, 0.1, 4096) * 10.0 ** rng.integers(-4, 1, 4096)).astype(np.float32)
    v = (old + rng.uniform(-0.19, 0.19, 4096)).astype(np.float32)  # all inside the clip range
    rounded = (old + np.clip(v - old, -eps, eps)).astype(np.float32)
    # Put the return one ulp from V, away from its rounded copy: the old formula counts these.
    ret = np.where(rounded > v, np.nextafter(v, -np.inf), np.nextafter(v, np.inf))
    m = np.ones_like(v)
    old_count = ((rounded - ret) ** 2 > (v - ret) ** 2).mean()
    assert old_count > 0.01  # the case the fix is about
    loss, metrics = ca.value_loss_clipped(v[None], old[None], ret[None], m[None], float(eps))
    assert float(metrics["vf_clipfrac"]) == 0.0
    close(loss, 0.5 * np.mean((v.astype(np.float64) - ret) ** 2))
    # Every token keeps its gradient (the max no longer picks a rounded, clipped copy).
    grad = jax.grad(lambda x: ca.value_loss_clipped(x, old[None], ret[None], m[None], 0.2)[0])(
        jnp.asarray(v[None])
    )
    close(grad[0], (v.astype(np.float64) - ret) / v.size, rtol=1e-5, atol=0)


# ----------------------------------------------------------------------------- entropy, SFT


def test_entropy_from_logits_and_bonus():
    logits = rand(23, B, T, 9, scale=2.0)
    logp = np_log_softmax(logits)
    expected = -(np.exp(logp) * logp).sum(-1)
    ent = logprobs.entropy_from_logits(jnp.asarray(logits, jnp.bfloat16))
    assert ent.dtype == jnp.float32
    close(logprobs.entropy_from_logits(logits), expected)
    close(logprobs.entropy_from_logits(np.zeros((1, 2, 9), np.float32)), np.full((1, 2), np.log(9)))
    m = ragged_mask()
    for agg in AGGS:
        close(ca.entropy_bonus(expected.astype(np.float32), m, agg), np_agg(expected, m, agg))


def test_token_logprobs_fp32_and_stable():
    logits = rand(24, B, T, 11, scale=3.0) + 500.0  # large offset: needs the max-shift
    targets = np.random.default_rng(25).integers(0, 11, size=(B, T))
    expected = np.take_along_axis(np_log_softmax(logits), targets[..., None], -1)[..., 0]
    out = logprobs.token_logprobs(logits, targets)
    assert out.dtype == jnp.float32
    close(out, expected, rtol=1e-5, atol=2e-5)
    out_bf16 = logprobs.token_logprobs(jnp.asarray(logits - 500.0, jnp.bfloat16), targets)
    assert out_bf16.dtype == jnp.float32


@pytest.mark.parametrize("agg", AGGS)
def test_sft_loss_and_grad(agg):
    m = left_aligned_mask()
    logits = rand(26, B, T, 7)
    targets = np.random.default_rng(27).integers(0, 7, size=(B, T))
    targets[m == 0] = -100  # ignore-index style padding must be harmless when masked
    logp = np_log_softmax(logits)
    nll = -np.take_along_axis(logp, np.clip(targets, 0, 6)[..., None], -1)[..., 0]
    loss, metrics = ca.sft_loss(logits, targets, m, agg)
    close(loss, np_agg(nll, m, agg))
    close(metrics["nll"], nll[m != 0].mean())
    close(metrics["num_tokens"], m.sum())
    acc = (logits.argmax(-1) == targets)[m != 0].mean()
    close(metrics["accuracy"], acc)
    if agg == "token-mean":
        grad = jax.grad(lambda x: ca.sft_loss(x, targets, m)[0])(jnp.asarray(logits))
        onehot = np.eye(7)[np.clip(targets, 0, 6)]
        expected = (np.exp(logp) - onehot) * (m / m.sum())[..., None]
        close(grad, expected, rtol=1e-5, atol=1e-7)


# ----------------------------------------------------------------------------- GRPO, BT


@pytest.mark.parametrize("normalize_std", [True, False])
def test_grpo_advantages(normalize_std):
    s = 4
    scores = rand(28, 3 * s)
    scores[s : 2 * s] = 1.5  # constant group: std 0 -> advantages 0, no NaN
    out = np.asarray(ca.grpo_advantages(scores, s, eps=1e-6, normalize_std=normalize_std))
    expected = np.zeros(3 * s)
    for g in range(3):
        grp = scores[g * s : (g + 1) * s].astype(np.float64)
        for i in range(s):
            a = grp[i] - grp.mean()
            expected[g * s + i] = a / (grp.std(ddof=1) + 1e-6) if normalize_std else a
    close(out, expected)
    assert np.all(np.isfinite(out))
    np.testing.assert_array_equal(out[s : 2 * s], 0.0)


def test_grpo_edge_cases_and_token_broadcast():
    np.testing.assert_array_equal(np.asarray(ca.grpo_advantages(rand(29, 5), 1)), 0.0)
    with pytest.raises(ValueError, match="group_size"):
        ca.grpo_advantages(jnp.zeros(6), 4)
    m = ragged_mask()
    vals = rand(30, B)
    close(ca.broadcast_to_tokens(vals, m), vals[:, None].astype(np.float64) * m)


def test_bradley_terry_loss():
    chosen, rejected = rand(31, 16, scale=3.0), rand(32, 16, scale=3.0)
    c64, r64 = chosen.astype(np.float64), rejected.astype(np.float64)
    loss, metrics = ca.bradley_terry_loss(chosen, rejected)
    close(loss, np.mean(np.logaddexp(0.0, -(c64 - r64))))
    close(metrics["accuracy"], np.mean(c64 > r64))
    close(metrics["reward_margin"], np.mean(c64 - r64))
    margin = np.abs(rand(33, 16))
    loss_m, _ = ca.bradley_terry_loss(chosen, rejected, margin)
    close(loss_m, np.mean(np.logaddexp(0.0, -(c64 - r64 - margin))))
    assert float(loss_m) > float(loss)
    # Gradient w.r.t. chosen: -sigmoid(-(c - r)) / n.
    g = jax.grad(lambda c: ca.bradley_terry_loss(c, rejected)[0])(jnp.asarray(chosen))
    close(g, -1.0 / (1.0 + np.exp(c64 - r64)) / 16)


# ----------------------------------------------------------------------------- registries


def test_registries():
    assert ca.get_policy_loss("ppo") is ca.policy_loss_ppo
    assert ca.get_policy_loss("gspo") is ca.policy_loss_gspo
    with pytest.raises(ValueError, match=r"'nope'.*\['gspo', 'ppo'\]"):
        ca.get_policy_loss("nope")
    with pytest.raises(ValueError, match=r"'gea'.*\['drgrpo', 'gae', 'grpo', 'reinforce\+\+', "):
        ca.get_advantage_estimator("gea")

    m = ragged_mask()
    r, v = rand(34, B, T), rand(35, B, T)
    adv, ret = ca.get_advantage_estimator("gae")(
        rewards_bt=r, values_bt=v, mask_bt=m, gamma=0.9, lam=0.8, scores_b=None
    )
    adv_ref, ret_ref = np_gae(r, v, m, 0.9, 0.8)
    close(adv, adv_ref, rtol=1e-5, atol=1e-5)
    close(ret, ret_ref, rtol=1e-5, atol=1e-5)

    scores = rand(36, B)
    adv, ret = ca.get_advantage_estimator("grpo")(
        scores_b=scores, mask_bt=m, group_size=3, rewards_bt=None
    )
    per_seq = np.asarray(ca.grpo_advantages(scores, 3))
    close(adv, per_seq[:, None].astype(np.float64) * m)
    close(ret, np.asarray(adv))


def test_losses_jit_with_traced_hyperparameters():
    logp, old, adv, m = ppo_inputs("ragged")

    @jax.jit
    def step(lp, eps, coef):
        pg, pg_metrics = ca.policy_loss_ppo(
            lp,
            old,
            adv,
            m,
            eps,
            clip_eps_high=eps + 0.1,
            dual_clip_c=3.0,
            agg="seq-mean-token-mean",
        )
        rewards = ca.apply_kl_to_rewards(adv[:, 0], lp, old, m, coef, "k3")
        return pg, pg_metrics["clipfrac"], rewards

    pg, clipfrac, rewards = step(jnp.asarray(logp), jnp.float32(0.2), jnp.float32(0.05))
    eager_pg, eager_metrics = ca.policy_loss_ppo(
        logp, old, adv, m, 0.2, 0.3, 3.0, "seq-mean-token-mean"
    )
    close(pg, float(eager_pg))
    close(clipfrac, float(eager_metrics["clipfrac"]))
    close(rewards, np.asarray(ca.apply_kl_to_rewards(adv[:, 0], logp, old, m, 0.05, "k3")))


# ----------------------------------------------------------------------------- RLOO, REINFORCE++,
# Dr. GRPO, GSPO

GROUP = 3  # B = 6 rows: two prompts of three samples


def group_scores():
    scores = rand(50, B)
    scores[GROUP:] = 0.7  # the second prompt's samples all score the same
    return scores


def np_rloo(scores, s):
    out = np.zeros(len(scores))
    for g in range(0, len(scores), s):
        grp = scores[g : g + s].astype(np.float64)
        for i in range(s):
            others = np.delete(grp, i)
            out[g + i] = grp[i] - others.mean() if s > 1 else 0.0
    return out


def np_whiten_tokens(x, m):
    sel = np_masked_values(x, m)
    out = (np.asarray(x, np.float64) - sel.mean()) / np.sqrt(sel.var(ddof=1) + 1e-8)
    return np.where(m != 0, out, 0.0)


@pytest.mark.parametrize("mask_name", sorted(MASKS))
def test_rloo_and_drgrpo_estimators(mask_name):
    m = MASKS[mask_name]()
    scores = group_scores()
    expected = np_rloo(scores, GROUP)
    close(ca.rloo_advantages(scores, GROUP), expected)
    np.testing.assert_array_equal(np.asarray(ca.rloo_advantages(scores, GROUP))[GROUP:], 0.0)
    # S / (S - 1) times the group-centred score: the textbook identity.
    close(expected[:GROUP], GROUP / (GROUP - 1) * (scores[:GROUP] - scores[:GROUP].mean()))
    np.testing.assert_array_equal(np.asarray(ca.rloo_advantages(scores, 1)), 0.0)
    adv, ret = ca.get_advantage_estimator("rloo")(
        scores_b=scores, mask_bt=m, group_size=GROUP, rewards_bt=None, gamma=1.0
    )
    close(adv, expected[:, None] * m)
    close(ret, np.asarray(adv))
    assert np.all(np.asarray(adv)[m.sum(1) == 0] == 0)  # an all-masked row stays 0

    # Dr. GRPO: centred, never divided by the group's std.
    adv, _ = ca.get_advantage_estimator("drgrpo")(scores_b=scores, mask_bt=m, group_size=GROUP)
    centred = np.concatenate(
        [scores[g : g + GROUP] - scores[g : g + GROUP].astype(np.float64).mean() for g in (0, 3)]
    )
    close(adv, centred[:, None] * m)


def np_discounted_returns(rewards, m, gamma):
    out = np.zeros(rewards.shape)
    for b in range(rewards.shape[0]):
        running = 0.0
        for t in reversed(np.nonzero(m[b])[0]):
            running = rewards[b, t] + gamma * running
            out[b, t] = running
    return out


@pytest.mark.parametrize("gamma", [1.0, 0.9])
@pytest.mark.parametrize("mask_name", sorted(MASKS))
def test_reinforce_pp_estimators(mask_name, gamma):
    m = MASKS[mask_name]()
    # A score at each row's last valid token plus a per-token KL-style penalty everywhere valid;
    # garbage at masked positions must not leak.
    rewards = np.where(m != 0, rand(51, B, T, scale=0.1), 1e3).astype(np.float32)
    last = np.asarray(ca.last_token_onehot(m))
    rewards = (rewards + group_scores()[:, None] * last).astype(np.float32)
    clean = np.where(m != 0, rewards, 0.0)

    returns = np_discounted_returns(clean, m, gamma)
    adv, ret = ca.get_advantage_estimator("reinforce++")(
        rewards_bt=rewards, mask_bt=m, gamma=gamma, group_size=GROUP, scores_b=None
    )
    close(ret, returns, rtol=1e-5, atol=1e-5)
    close(adv, np_whiten_tokens(returns, m), rtol=1e-5, atol=1e-5)
    sel = np_masked_values(np.asarray(adv), m)
    close([sel.mean(), sel.std(ddof=1)], [0.0, 1.0], atol=1e-5)
    np.testing.assert_array_equal(np.asarray(adv)[m == 0], 0.0)

    totals = clean.sum(1)
    centred = np.concatenate([totals[g : g + GROUP] - totals[g : g + GROUP].mean() for g in (0, 3)])
    adv, ret = ca.get_advantage_estimator("reinforce++-baseline")(
        rewards_bt=rewards, mask_bt=m, gamma=gamma, group_size=GROUP
    )
    close(adv, np_whiten_tokens(centred[:, None] * m, m), rtol=1e-5, atol=1e-5)
    close(ret, np.asarray(adv))
    np.testing.assert_array_equal(np.asarray(adv)[m == 0], 0.0)


def test_reinforce_pp_equal_rewards_and_length_one():
    m = np.zeros((4, 5), np.float32)
    m[:, 0] = 1.0  # every response one token long (empty rows: the parametrized tests above)
    rewards = np.full((4, 5), 0.5, np.float32)
    for name in ("reinforce++", "reinforce++-baseline"):
        adv, _ = ca.get_advantage_estimator(name)(
            rewards_bt=rewards, mask_bt=m, gamma=1.0, group_size=2
        )
        np.testing.assert_array_equal(np.asarray(adv), 0.0)  # nothing to prefer: no NaN either


def np_gspo(logp, old, adv, m, eps, eps_high, agg):
    """Sequence ratios exp(mean log-ratio), the clipped surrogate on them, aggregated."""
    loss = np.zeros(logp.shape)
    clipped = np.zeros(logp.shape, bool)
    for b in range(logp.shape[0]):
        idx = np.nonzero(m[b])[0]
        if not len(idx):
            continue
        s = np.exp(np.mean(logp[b, idx].astype(np.float64) - old[b, idx]))
        for t in idx:
            a = np.float64(adv[b, t])
            l1, l2 = -a * s, -a * min(max(s, 1 - eps), 1 + eps_high)
            loss[b, t], clipped[b, t] = max(l1, l2), l2 > l1
    return np_agg(loss, m, agg), clipped


def gspo_inputs(mask_name):
    m = MASKS[mask_name]()
    logp = rand(52, B, T, scale=0.5)
    old = (logp + rand(53, B, T, scale=0.05)).astype(np.float32)
    adv = np.repeat(rand(54, B)[:, None], T, axis=1)  # one advantage per sequence
    return logp, old, adv, m


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("mask_name", sorted(MASKS))
def test_policy_loss_gspo_matches_numpy(mask_name, agg):
    logp, old, adv, m = gspo_inputs(mask_name)
    eps, eps_high = 0.01, 0.02
    loss, metrics = ca.policy_loss_gspo(logp, old, adv, m, eps, eps_high, 3.0, agg)
    expected, clipped = np_gspo(logp, old, adv, m, eps, eps_high, agg)
    close(loss, expected)
    close(metrics["clipfrac"], clipped[m != 0].mean())
    assert 0 < clipped[m != 0].mean() < 1  # both branches exercised
    assert float(metrics["log_ratio_clampfrac"]) == 0.0
    # On-policy: s = 1 everywhere, the loss is -agg(A), never clipped.
    loss, metrics = ca.policy_loss_gspo(logp, logp, adv, m, eps, agg=agg)
    close(loss, np_agg(-adv, m, agg))
    assert float(metrics["clipfrac"]) == 0.0


@pytest.mark.parametrize("mask_name", sorted(MASKS))
def test_policy_loss_gspo_gradient_is_the_sequence_level_one(mask_name):
    """GSPO-token's gradient equals that of the plain sequence-level objective (paper eq. 5):
    ``s_i = exp(mean_t log-ratio)`` differentiated through the mean."""
    logp, old, adv, m = gspo_inputs(mask_name)
    eps, eps_high = 0.01, 0.02
    mj, oldj, advj = jnp.asarray(m), jnp.asarray(old), jnp.asarray(adv[:, 0])

    def sequence_level(lp):
        n = mj.sum(1)
        s = jnp.exp(jnp.where(n > 0, ((lp - oldj) * mj).sum(1) / jnp.maximum(n, 1), 0.0))
        per_row = jnp.maximum(-advj * s, -advj * jnp.clip(s, 1 - eps, 1 + eps_high))
        valid = n > 0
        return jnp.sum(jnp.where(valid, per_row, 0)) / valid.sum()

    def gspo(lp):
        return ca.policy_loss_gspo(lp, old, adv, m, eps, eps_high, agg="seq-mean-token-mean")[0]

    close(gspo(jnp.asarray(logp)), float(sequence_level(jnp.asarray(logp))))
    g = np.asarray(jax.grad(gspo)(jnp.asarray(logp)))
    close(g, np.asarray(jax.grad(sequence_level)(jnp.asarray(logp))), rtol=1e-5, atol=1e-7)
    assert np.any(g != 0) and np.all(g[m == 0] == 0)


def test_policy_loss_gspo_length_one_all_masked_and_clamp():
    logp, old, adv, m = gspo_inputs("left")  # row 3 has one token, row 4 none
    for agg in AGGS:
        loss, _ = ca.policy_loss_gspo(logp, old, adv, np.zeros_like(m), 0.2, agg=agg)
        assert float(loss) == 0.0
    # A length-1 response: the sequence ratio is the token ratio, as in PPO.
    one = np.zeros_like(m)
    one[3, 0] = 1.0
    close(
        ca.policy_loss_gspo(logp, old, adv, one, 0.2)[0],
        ca.policy_loss_ppo(logp, old, adv, one, 0.2)[0],
    )
    huge = logp.copy()
    huge[0] = old[0] + 100.0
    loss, metrics = ca.policy_loss_gspo(huge, old, adv, m, 0.2)
    grad = jax.grad(lambda x: ca.policy_loss_gspo(x, old, adv, m, 0.2)[0])(jnp.asarray(huge))
    assert np.isfinite(float(loss)) and np.all(np.isfinite(np.asarray(grad)))
    close(metrics["log_ratio_clampfrac"], m[0].sum() / m.sum())
    np.testing.assert_array_equal(np.asarray(grad)[0], 0.0)


def test_group_estimators_need_a_group():
    rl = RLConfig(advantage_estimator="rloo", samples_per_prompt=1)
    with pytest.raises(
        ValueError, match=r"^RLConfig.samples_per_prompt: advantage estimator 'rloo'"
    ):
        ca.check_algorithm_config(rl, "ppo")
    ca.check_algorithm_config(dataclasses.replace(rl, samples_per_prompt=2), "ppo")
    ca.check_algorithm_config(dataclasses.replace(rl, advantage_estimator="reinforce++"), "ppo")
    with pytest.raises(ValueError, match=r"^RLConfig.policy_loss: unknown policy loss 'gpso'"):
        ca.check_algorithm_config(dataclasses.replace(rl, policy_loss="gpso"), "grpo")


# ----------------------------------------------------------------------------- DAPO


def np_extent(m):
    """1 + the last valid position per row, 0 for an empty row."""
    return np.array([np.nonzero(row)[0].max() + 1 if np.any(row) else 0 for row in m])


def np_overlong(m, buffer, max_penalty, max_len):
    """DAPO eq. 13 per row, as a penalty: 0 up to max_len - buffer, then linear to max_penalty
    at max_len, max_penalty beyond."""
    out = []
    for length in np_extent(m):
        start = max_len - buffer
        if buffer == 0 or length <= start:
            out.append(0.0)
        elif length >= max_len:
            out.append(max_penalty)
        else:
            out.append(max_penalty * (length - start) / buffer)
    return np.array(out)


@pytest.mark.parametrize("buffer", [0, 1, 3, T])
@pytest.mark.parametrize("mask_name", sorted(MASKS))
def test_overlong_penalty_matches_numpy(mask_name, buffer):
    m = MASKS[mask_name]()  # both have an empty row, a one-token row and a full (truncated) row
    close(ca.response_extent(m), np_extent(m))
    close(ca.overlong_penalty(m, buffer, 0.7), np_overlong(m, buffer, 0.7, T))
    # A generation limit longer than the mask's width: nothing is truncated at the width.
    close(ca.overlong_penalty(m, buffer, 0.7, max_len=T + 2), np_overlong(m, buffer, 0.7, T + 2))
    # Under jit, with the penalty traced.
    jitted = jax.jit(lambda mm, p: ca.overlong_penalty(mm, buffer, p))(m, jnp.float32(0.7))
    close(jitted, np_overlong(m, buffer, 0.7, T))


def test_overlong_penalty_boundaries():
    R, buffer = 8, 4
    lengths = np.array([0, 1, R - buffer, R - buffer + 1, R - 1, R])
    m = (np.arange(R)[None, :] < lengths[:, None]).astype(np.float32)
    # Exactly at the buffer's start: no penalty; one token past it: 1/buffer of it; a response
    # cut off at the generation limit (no stop token) or ending there: all of it.
    close(ca.overlong_penalty(m, buffer, 2.0), [0, 0, 0, 0.5, 1.5, 2.0])
    np.testing.assert_array_equal(np.asarray(ca.overlong_penalty(np.zeros((3, R)), 2, 1.0)), 0)
    # The buffer spans the whole length: a one-token response already pays 1/R of the penalty.
    close(ca.overlong_penalty(m, R, 1.0), lengths / R)
    for bad in (-1, R + 1):
        with pytest.raises(ValueError, match="overlong buffer"):
            ca.overlong_penalty(m, bad, 1.0)


def np_groups_with_signal(scores, s):
    return np.array([np.ptp(scores[g : g + s]) > 0 for g in range(0, len(scores), s)])


def np_select(keep, n):
    kept = [g for g in range(len(keep)) if keep[g]]
    return (kept + [g for g in range(len(keep)) if not keep[g]])[:n]


def test_group_filter_and_selection_match_numpy():
    s = 4
    scores = np.round(rand(60, 6 * s), 1)
    scores[0:s] = 1.0  # all equal
    scores[2 * s : 3 * s] = 0.0  # all equal, zero
    scores[4 * s : 5 * s] = [0.5, 0.5, 0.5, 0.5 + 1e-6]  # one tie breaker is enough
    keep = np_groups_with_signal(scores, s)
    assert keep.tolist() == [False, True, False, True, True, True]
    np.testing.assert_array_equal(np.asarray(ca.groups_with_signal(scores, s)), keep)
    # The groups dropped are exactly those whose GRPO advantages are all zero.
    adv = np.asarray(ca.grpo_advantages(scores, s)).reshape(-1, s)
    np.testing.assert_array_equal(np.any(adv != 0, axis=1), keep)
    for n in range(1, 7):  # enough kept groups, then short of them: fillers in order
        np.testing.assert_array_equal(np.asarray(ca.select_groups(keep, n)), np_select(keep, n))
    # Every group equal: nothing kept, the batch is the first groups as generated.
    flat = np.full(3 * s, 0.25, np.float32)
    assert not np.any(np.asarray(ca.groups_with_signal(flat, s)))
    np.testing.assert_array_equal(np.asarray(ca.select_groups(np.zeros(3, bool), 2)), [0, 1])
    # A group of one never has signal; too few groups or a ragged batch is an error.
    assert not np.any(np.asarray(ca.groups_with_signal(scores, 1)))
    with pytest.raises(ValueError, match="fewer than the 4"):
        ca.select_groups(keep[:3], 4)
    with pytest.raises(ValueError, match="group_size"):
        ca.groups_with_signal(scores[:-1], s)


def test_dapo_config_is_validated_in_one_line():
    RLConfig(filters=SampleFilters(dynamic_sampling=True), samples_per_prompt=2).validate("grpo")
    with pytest.raises(ConfigError, match=r"^SampleFilters.dynamic_sampling: .*>= 2, got 1$"):
        RLConfig(filters=SampleFilters(dynamic_sampling=True)).validate("ppo")
    for field, value in (("overlong_buffer", -1), ("overlong_penalty", -0.5)):
        with pytest.raises(ConfigError, match=f"^SampleFilters.{field}: must be >= 0"):
            RLConfig(filters=SampleFilters(**{field: value})).validate()
    with pytest.raises(ConfigError, match="^SampleFilters.max_sampling_rounds: must be >= 1"):
        RLConfig(filters=SampleFilters(max_sampling_rounds=0)).validate()
    with pytest.raises(ConfigError, match="^SampleFilters.overlong_buffer: 17 exceeds TaskConf"):
        load_config([], ["SampleFilters.overlong_buffer=17", "TaskConfig.max_response_len=16"])


# ----------------------------------------------------------------------------- DPO


def np_sequence_logprobs(logp, m, mean):
    sums = np.where(m != 0, np.asarray(logp, np.float64) * m, 0.0).sum(-1)
    n = np.asarray(m, np.float64).sum(-1)
    return np.where(n > 0, sums / np.maximum(n, 1), 0.0) if mean else sums


def np_dpo(pc, pr, rc, rr, valid, beta, loss_type, smoothing):
    h = (pc - rc) - (pr - rr)
    if loss_type == "sigmoid":  # -log sigmoid(x) = log(1 + exp(-x))
        losses = (1 - smoothing) * np.logaddexp(0.0, -beta * h) + smoothing * np.logaddexp(
            0.0, beta * h
        )
    else:
        losses = (h - 1.0 / (2.0 * beta)) ** 2
    chosen, rejected = beta * (pc - rc), beta * (pr - rr)
    pick = lambda x: float(np.mean(x[valid])) if valid.any() else 0.0  # noqa: E731
    return pick(losses), {
        "accuracy": pick(chosen > rejected),
        "reward_margin": pick(beta * h),
        "chosen_reward": pick(chosen),
        "rejected_reward": pick(rejected),
        "chosen_logp": pick(pc),
    }


def dpo_inputs():
    """Per-token log-probs of B pairs: chosen rows masked like left_aligned_mask (lengths 7, 5,
    3, 1, 0, 6: a length-1 row and an all-masked one), rejected rows like the ragged mask read
    backwards (an all-masked row at 1, a single token at 2); NaN wherever a mask is 0."""
    mc, mr = left_aligned_mask(), ragged_mask()[::-1].copy()
    tokens = [
        np.where(m != 0, -np.abs(rand(60 + i, B, T)), np.nan) for i, m in enumerate((mc, mr) * 2)
    ]
    return (*tokens, mc, mr)


@pytest.mark.parametrize("loss_type,smoothing", [("sigmoid", 0.0), ("sigmoid", 0.2), ("ipo", 0.0)])
def test_dpo_loss_matches_numpy(loss_type, smoothing):
    pc_t, pr_t, rc_t, rr_t, mc, mr = dpo_inputs()
    mean = loss_type in ca.DPO_MEAN_LOGPROBS
    beta = 0.3
    seqs = [
        ca.sequence_logprobs(x, m, mean=mean)
        for x, m in ((pc_t, mc), (pr_t, mr), (rc_t, mc), (rr_t, mr))
    ]
    expected = [
        np_sequence_logprobs(x, m, mean)
        for x, m in ((pc_t, mc), (pr_t, mr), (rc_t, mc), (rr_t, mr))
    ]
    for got, want in zip(seqs, expected):
        close(got, want)
    valid = (mc.sum(-1) > 0) & (mr.sum(-1) > 0)
    assert valid.tolist() == [True, False, True, True, False, True]  # pairs 1 and 4 left out
    loss, metrics = ca.dpo_loss(*seqs, beta, loss_type, smoothing, valid)
    ref_loss, ref_metrics = np_dpo(*expected, valid, beta, loss_type, smoothing)
    close(loss, ref_loss)
    for k, v in ref_metrics.items():
        close(metrics[k], v, err_msg=k, **TOL)
    # The gradient reaches only the kept pairs' log-probs; for sigmoid DPO it is
    # -beta * sigmoid(-beta * h) / n per chosen log-prob (+ for the rejected one).
    grad = np.asarray(
        jax.grad(lambda pc: ca.dpo_loss(pc, *seqs[1:], beta, loss_type, smoothing, valid)[0])(
            seqs[0]
        )
    )
    assert np.all(np.isfinite(grad)) and np.all(grad[~valid] == 0)
    if loss_type == "sigmoid" and smoothing == 0.0:
        h = (expected[0] - expected[2]) - (expected[1] - expected[3])
        close(grad[valid], (-beta / (1 + np.exp(beta * h)) / valid.sum())[valid])


def test_dpo_loss_edge_cases_and_registry():
    pc_t, pr_t, rc_t, rr_t, mc, mr = dpo_inputs()
    seqs = [ca.sequence_logprobs(x, m) for x, m in ((pc_t, mc), (pr_t, mr), (rc_t, mc), (rr_t, mr))]
    # Every pair left out: 0, with finite (zero) gradients, though every log-prob is there.
    none = np.zeros(B, bool)
    loss, metrics = ca.dpo_loss(*seqs, 0.1, "sigmoid", 0.0, none)
    grad = jax.grad(lambda pc: ca.dpo_loss(pc, *seqs[1:], 0.1, "sigmoid", 0.0, none)[0])(seqs[0])
    assert float(loss) == 0.0 and all(float(v) == 0.0 for v in metrics.values())
    np.testing.assert_array_equal(np.asarray(grad), 0.0)
    # Length-1 responses: the sequence log-prob is the token's, summed or averaged alike.
    one = np.zeros((2, T), np.float32)
    one[:, 3] = 1.0
    lp = rand(70, 2, T)
    close(ca.sequence_logprobs(lp, one), lp[:, 3])
    close(ca.sequence_logprobs(lp, one, mean=True), lp[:, 3])
    # A policy equal to its reference: loss log 2 (sigmoid), margin 0, accuracy 0 (ties lose);
    # IPO's loss there is (1 / (2 beta))^2.
    x = rand(71, B)
    loss, metrics = ca.dpo_loss(x, x + 1, x, x + 1, 0.5)
    close(loss, np.log(2.0))
    assert float(metrics["accuracy"]) == 0.0 and float(metrics["reward_margin"]) == 0.0
    close(ca.dpo_loss(x, x + 1, x, x + 1, 0.5, "ipo")[0], 1.0)
    # The registry, and the config's list of loss types, name the same losses.
    assert ca.get_dpo_loss("sigmoid") is ca.dpo_sigmoid_loss
    assert ca.get_dpo_loss("ipo") is ca.dpo_ipo_loss
    assert tuple(ca.DPO_LOSSES) == DPO_LOSS_TYPES
    with pytest.raises(ValueError, match=r"unknown DPO loss type 'kto'.*\['ipo', 'sigmoid'\]"):
        ca.dpo_loss(x, x, x, x, 0.1, "kto")


# ----------------------------------------------------------------------------- off-policy


def np_importance_weights(prox, behav, m, correction, cap):
    log_w = np.where(m != 0, np.float64(1) * prox - behav, 0.0)
    w = np.exp(log_w)
    capped = (w > cap) & (m != 0) if correction == "tis" else np.zeros(w.shape, bool)
    if correction == "tis":
        w = np.minimum(w, cap)
    elif correction == "none":
        w = np.ones_like(w)
    return np.where(m != 0, w, 0.0), capped, log_w


@pytest.mark.parametrize("correction", ca.OFF_POLICY_CORRECTIONS)
@pytest.mark.parametrize("mask_name", sorted(MASKS))
def test_behaviour_importance_weights_match_numpy(mask_name, correction):
    m = MASKS[mask_name]()
    prox = rand(60, B, T, scale=0.5)
    behav = (prox + rand(61, B, T, scale=0.6)).astype(np.float32)
    cap = 1.5
    w, metrics = ca.behaviour_importance_weights(prox, behav, m, correction, cap)
    ew, capped, log_w = np_importance_weights(prox, behav, m, correction, cap)
    close(w, ew)
    sel = m != 0
    close(metrics["is_clipfrac"], capped[sel].mean())
    close(metrics["mismatch_abs"], np.abs(log_w)[sel].mean())
    r = np.exp(log_w)  # pi_prox / pi_behaviour on the behaviour's samples: k3 = r - 1 - log r
    close(metrics["mismatch_k3"], (r - 1 - log_w)[sel].mean())
    close(metrics["is_weight_max"], ew[sel].max())
    if correction == "tis":
        assert 0 < capped[sel].mean() < 1  # the cap binds on some tokens, not all
    # The empty row (index 4 in both masks) has weight 0 everywhere; nothing is NaN.
    assert not np.any(np.asarray(w)[4]) and np.all(np.isfinite(np.asarray(w)))


def test_importance_weights_edge_cases_and_errors():
    m = np.zeros((2, 3), np.float32)
    w, metrics = ca.behaviour_importance_weights(np.zeros((2, 3)), np.zeros((2, 3)), m, "tis")
    assert not np.any(np.asarray(w)) and all(np.isfinite(float(v)) for v in metrics.values())
    # On-policy (prox == behaviour): weight 1 on every valid token, no mismatch, nothing capped.
    m = left_aligned_mask()
    lp = rand(62, B, T)
    for correction in ("tis", "decoupled"):
        w, metrics = ca.behaviour_importance_weights(lp, lp, m, correction)
        close(w, m)
        assert float(metrics["mismatch_abs"]) == 0 == float(metrics["is_clipfrac"])
    # A huge log-ratio is clamped before exp: a finite weight.
    big = np.full((1, 2), 100.0, np.float32)
    w, _ = ca.behaviour_importance_weights(big, -big, np.ones((1, 2)), "decoupled")
    assert np.all(np.isfinite(np.asarray(w)))
    with pytest.raises(ValueError, match="unknown off-policy correction 'is'"):
        ca.behaviour_importance_weights(lp, lp, m, "is")
    with pytest.raises(ValueError, match="cap must be >= 1"):
        ca.behaviour_importance_weights(lp, lp, m, "tis", cap=0.5)
    with pytest.raises(ConfigError, match="^OffPolicy.correction: unknown correction"):
        RLConfig(off_policy=OffPolicy(correction="is")).validate()
    with pytest.raises(ConfigError, match="^OffPolicy.is_cap: must be >= 1"):
        RLConfig(off_policy=OffPolicy(is_cap=0.5)).validate()


@pytest.mark.parametrize("loss_name", ["ppo", "gspo"])
@pytest.mark.parametrize("agg", AGGS)
def test_policy_losses_weight_each_token_by_the_importance_weight(loss_name, agg):
    """The weighted loss is agg(w * token loss), with no gradient through w; w = 1 gives the
    unweighted loss exactly."""
    logp, old, adv, m = ppo_inputs("ragged")
    w = np.abs(rand(63, B, T)) + 0.1
    fn = ca.get_policy_loss(loss_name)
    loss_w, _ = fn(logp, old, adv, m, 0.2, None, 3.0, agg, is_weights_bt=w)
    if loss_name == "ppo":
        tok, _, _ = np_ppo_token_losses(logp, old, adv, 0.2, 0.2, 3.0)
        close(loss_w, np_agg(w * tok, m, agg))
    loss_1, _ = fn(logp, old, adv, m, 0.2, None, 3.0, agg, is_weights_bt=np.ones_like(w))
    loss_0, _ = fn(logp, old, adv, m, 0.2, None, 3.0, agg)
    assert float(loss_1) == float(loss_0)

    def weighted(lp, weights):
        return fn(lp, old, adv, m, 0.2, None, 3.0, agg, is_weights_bt=weights)[0]

    assert not np.any(np.asarray(jax.grad(weighted, argnums=1)(jnp.asarray(logp), w)))


def test_the_reference_is_used_only_with_a_kl_term():
    rl = RLConfig()
    assert ca.uses_reference(rl)  # kl_coef 0.05 by default
    off = dataclasses.replace(rl, kl_coef=0.0)
    assert not ca.uses_reference(off)
    assert not ca.uses_reference(dataclasses.replace(off, kl_in_loss=True))  # 0 x the term
    assert ca.uses_reference(dataclasses.replace(off, adaptive_kl_target=6.0))  # it observes KL


def test_per_token_inputs_of_a_different_shape_are_refused():
    """A [B] advantage (or a [B, 1] one) would broadcast against [B, T] log-probs into a loss of
    the wrong meaning; the losses and GAE refuse it when traced."""
    lp = jnp.zeros((2, 3))
    for bad in (jnp.zeros(2), jnp.zeros((2, 1)), jnp.zeros((2, 4))):
        with pytest.raises(AssertionError):
            ca.policy_loss_ppo(lp, lp, bad, jnp.ones((2, 3)), 0.2)
        with pytest.raises(AssertionError):
            ca.value_loss_clipped(lp, lp, bad, jnp.ones((2, 3)), 0.2)
        with pytest.raises(AssertionError):
            ca.compute_gae(lp, bad, jnp.ones((2, 3)), 1.0, 0.95)
    with pytest.raises(AssertionError):
        ca.behaviour_importance_weights(lp, jnp.zeros(2), jnp.ones((2, 3)), "tis")
    ca.policy_loss_ppo(lp, lp, lp, jnp.ones((2, 3)), 0.2)  # the same shapes pass
