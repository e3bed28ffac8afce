"""Native CPU kernels: the few-row panel matmul against NumPy, its fallback, and its refusals;
the token pick against the XLA sampler and NumPy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrlhf.decode.sampling import sample_tokens
from jrlhf.kernels.panels import LANES, from_panels, panel_matmul, panel_matmuls, to_panels
from jrlhf.native import matmul as native_matmul
from jrlhf.native import token_pick


@pytest.mark.parametrize(
    "rows,k,panels",
    [(1, 7, 1), (5, 33, 2), (8, 64, 3), (13, 96, 4), (16, 128, 5), (27, 40, 7), (3, 1, 1)],
)
def test_panel_matmul_matches_numpy(rows, k, panels):
    """Every row-block tail (the kernel takes rows 8 at a time) and panel-block tail (3 panels
    at a time) against a float64 product, in the kernel and in its XLA fallback; leading axes
    of x are kept."""
    rng = np.random.default_rng(rows * 100 + k)
    n = panels * LANES
    x = rng.standard_normal((rows, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    packed = to_panels(jnp.asarray(w))
    assert packed.shape == (panels, k, LANES)
    np.testing.assert_array_equal(np.asarray(from_panels(packed)), w)
    want = x.astype(np.float64) @ w.astype(np.float64)
    if jax.default_backend() == "cpu":
        assert native_matmul.available(), native_matmul.unavailable_reason()
    got = np.asarray(jax.jit(panel_matmul)(jnp.asarray(x), packed))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    batched = jax.jit(panel_matmul)(jnp.asarray(x).reshape(1, rows, k), packed)
    assert batched.shape == (1, rows, n)
    np.testing.assert_array_equal(np.asarray(batched)[0], got)


@pytest.mark.parametrize("rows", [1, 9, 16, 20])
def test_panel_matmuls_of_several_weights_in_one_call(rows):
    """Several weights in one call (the threads' runs of blocks cross from one weight into the
    next, and a weight of 1 or 2 panels ends in a short block): each output equals its own
    single-weight call bit for bit (the same sums in the same order) and a float64 product."""
    rng = np.random.default_rng(rows)
    k = 48
    x = rng.standard_normal((rows, k)).astype(np.float32)
    ws = [rng.standard_normal((k, p * LANES)).astype(np.float32) for p in (1, 5, 2, 3, 4, 7)]
    packed = [to_panels(jnp.asarray(w)) for w in ws]
    together = jax.jit(panel_matmuls)(jnp.asarray(x), packed)
    assert len(together) == len(ws)
    for w, p, got in zip(ws, packed, together):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(panel_matmul(x, p)))
        want = x.astype(np.float64) @ w.astype(np.float64)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    with pytest.raises(ValueError, match="panel matmuls of no weights"):
        panel_matmuls(jnp.asarray(x), [])
    with pytest.raises(ValueError, match="panel matmul of x"):
        panel_matmuls(jnp.asarray(x), [packed[0], to_panels(jnp.asarray(ws[1][:40]))])


def test_panel_matmul_falls_back_to_xla_and_refuses_bad_shapes(monkeypatch):
    """Without the kernel the same products (one weight or several) run in XLA; shapes that do
    not agree, and weights whose outputs do not fill whole panels, are refused in one line."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((4, 24)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((24, 32)), jnp.float32)
    native = np.asarray(panel_matmul(x, to_panels(w)))
    both = [np.asarray(o) for o in panel_matmuls(x, [to_panels(w), to_panels(w[:, :16])])]
    monkeypatch.setattr(native_matmul, "_registered", lambda: "no C++ compiler found")
    assert not native_matmul.available()
    np.testing.assert_allclose(np.asarray(panel_matmul(x, to_panels(w))), native, rtol=1e-5)
    fallback = panel_matmuls(x, [to_panels(w), to_panels(w[:, :16])])
    for got, want in zip(fallback, both, strict=True):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    with pytest.raises(ValueError, match="panel matmul of x \\(4, 23\\)"):
        panel_matmul(x[:, :23], to_panels(w))
    with pytest.raises(ValueError, match="30 output columns does not pack into panels of 16"):
        to_panels(w[:, :30])


@pytest.mark.parametrize(
    "t,heads,kv_heads,dim", [(5, 2, 2, 16), (70, 8, 4, 16), (33, 4, 1, 24), (19, 6, 2, 32)]
)
def test_native_masked_attention_matches_the_xla_form(t, heads, kv_heads, dim, monkeypatch):
    """Forward and gradients of the native kernel against masked_attention's XLA form: packed
    rows (two segments and padding, whose rows attend to nothing and average every value),
    grouped-query heads, head dims it unrolls (16, 32) and one it does not (24), key counts
    below and above its 64-key blocks."""
    from jrlhf.models import attention
    from jrlhf.native import attention as native

    rng = np.random.default_rng(t)
    b = 3
    q = jnp.asarray(rng.standard_normal((b, t, heads, dim)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((b, t, kv_heads, dim)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((b, t, kv_heads, dim)), jnp.float32)
    cut = max(1, t // 2)
    segments = np.ones((b, t), np.int32)
    segments[1, cut:] = 2
    segments[2, cut:] = 0  # padding
    positions = np.where(np.arange(t) < cut, np.arange(t), np.arange(t) - cut)
    positions = jnp.asarray(np.broadcast_to(positions, (b, t)))
    mask = attention.attention_mask(positions, positions, segments, segments, 0)
    weights = jnp.asarray(rng.standard_normal((b, t, heads, dim)), jnp.float32)

    def loss(fn):
        return jax.value_and_grad(lambda q, k, v: (fn(q, k, v, mask) * weights).sum(), (0, 1, 2))

    assert native.available(), native.unavailable_reason()
    want_loss, want = loss(attention.masked_attention)(q, k, v)
    got_out = native.masked_attention(q, k, v, mask, attention.MASK_VALUE)
    monkeypatch.setattr(attention, "USE_KERNEL", False)
    ref_out = attention.masked_attention(q, k, v, mask)
    np.testing.assert_allclose(np.asarray(got_out), np.asarray(ref_out), atol=2e-6, rtol=0)
    ref_loss, ref = loss(attention.masked_attention)(q, k, v)
    np.testing.assert_allclose(float(want_loss), float(ref_loss), rtol=1e-5)
    for got_grad, ref_grad in zip(want, ref):
        np.testing.assert_allclose(np.asarray(got_grad), np.asarray(ref_grad), atol=5e-6, rtol=0)


def test_native_attention_only_where_it_fits():
    """The native kernel runs for float32 on one device; bfloat16, or a trace under a mesh of
    several devices (XLA does not partition the custom call), keep the XLA form."""
    from jrlhf.meshes import make_mesh
    from jrlhf.meshes.context import activation_sharding
    from jrlhf.models import attention

    q = jnp.zeros((2, 4, 2, 16), jnp.float32)
    assert attention.kernel_fits(q, q, q) == (jax.default_backend() == "cpu")
    half = q.astype(jnp.bfloat16)
    assert not attention.kernel_fits(half, half, half)
    with activation_sharding(make_mesh("data=2,tensor=1"), "dp_tp"):
        assert not attention.kernel_fits(q, q, q)
    with activation_sharding(make_mesh("data=1,tensor=1"), "dp_tp"):
        assert attention.kernel_fits(q, q, q) == (jax.default_backend() == "cpu")


def test_native_attention_in_a_rematerialized_model_gradient(monkeypatch):
    """A whole model's loss gradient on one device, its layers rematerialized (the native
    attention's custom VJP inside jax.checkpoint), equals the XLA form's within 1e-5."""
    import dataclasses

    from jrlhf.models import attention
    from jrlhf.models.config import tiny_config
    from jrlhf.models.model_def import ModelDef

    cfg = dataclasses.replace(tiny_config(), remat_policy="full", layer_loop="scan")
    model = ModelDef(cfg)
    params = jax.jit(model.init)(jax.random.key(0))
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 12)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(12), tokens.shape)
    segments = jnp.asarray(np.r_[np.ones(12), np.r_[np.ones(7), np.zeros(5)]].reshape(2, 12))

    def loss(p):
        logits = model.apply(p, tokens, positions, segments.astype(jnp.int32))
        return (jax.nn.log_softmax(logits) * (segments[..., None] > 0)).sum()

    q = jnp.zeros((2, 12, cfg.num_heads, cfg.head_dim), jnp.float32)
    assert attention.kernel_fits(q, q, q) == (jax.default_backend() == "cpu")
    native = jax.jit(jax.grad(loss))(params)
    monkeypatch.setattr(attention, "USE_KERNEL", False)
    xla = jax.jit(jax.grad(loss))(params)
    for a, b in zip(jax.tree.leaves(native), jax.tree.leaves(xla)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)


def _log_softmax64(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    top = x.max(-1, keepdims=True)
    return x - top - np.log(np.exp(x - top).sum(-1, keepdims=True))


@pytest.mark.parametrize("vocab", [5, 33, 300, 8197])
@pytest.mark.parametrize("greedy,temperature", [(True, 1.0), (False, 1.0), (False, 0.7)])
def test_token_pick_matches_the_xla_sampler(vocab, greedy, temperature):
    """The native token pick (one call: argmax and log-probs) against ``sample_tokens``'s XLA
    form on the same keys: the same tokens (ties to the first index, rows all -inf, an infinite
    logit, vocabularies that are not a multiple of 16 lanes; a NaN wins), log-probs within 1e-5
    of it and of a float64 log-softmax."""
    assert token_pick.available(), token_pick.unavailable_reason()
    rng = np.random.default_rng(vocab)
    rows = 12
    x = (3 * rng.standard_normal((rows, vocab))).astype(np.float32)
    x[1] = np.round(x[1])  # many ties
    x[2, [vocab // 2, vocab - 1]] = np.nan
    x[3] = -np.inf
    x[4, vocab // 3] = np.inf
    x[5, -1] = 40.0  # the maximum in the tail past the last whole 16 lanes
    logits = jnp.asarray(x)
    keys = jax.random.key_data(jax.random.split(jax.random.key(vocab), rows))
    t = jnp.float32(temperature)

    def pick(native):
        fn = lambda lg, k, t: sample_tokens(  # noqa: E731
            lg,
            k,
            t,
            jnp.int32(0),
            jnp.float32(1.0),
            greedy=greedy,
            filtered=False,
            kernel_pick=native,
        )
        return [np.asarray(a) for a in jax.jit(fn)(logits, keys, t)]

    tok, slp, rlp = pick(True)
    want_tok, want_slp, want_rlp = pick(False)
    assert tok.dtype == np.int32
    # A NaN row's token is its first NaN, as jnp.argmax and NumPy give, in both forms
    assert tok[2] == vocab // 2 and np.isnan(rlp[2])
    np.testing.assert_array_equal(tok, want_tok)
    ok = ~np.isnan(x).any(-1)
    np.testing.assert_allclose(rlp[ok], want_rlp[ok], atol=1e-5, rtol=0)
    np.testing.assert_allclose(slp[ok], want_slp[ok], atol=1e-5, rtol=0)
    finite = np.isfinite(x).all(-1)
    assert finite.sum() >= rows - 4
    rows_f = np.flatnonzero(finite)
    raw64 = _log_softmax64(x[rows_f])[np.arange(len(rows_f)), tok[rows_f]]
    np.testing.assert_allclose(rlp[rows_f], raw64, atol=1e-5, rtol=0)
    if greedy:
        np.testing.assert_array_equal(tok, np.argmax(x, -1))  # NumPy's argmax: a NaN wins too
        np.testing.assert_array_equal(slp, 0.0)
    else:
        scaled64 = _log_softmax64(x[rows_f] / np.float32(temperature))
        want = scaled64[np.arange(len(rows_f)), tok[rows_f]]
        np.testing.assert_allclose(slp[rows_f], want, atol=1e-5, rtol=0)


def test_token_pick_refusals_and_where_the_sampler_keeps_xla():
    """Shapes that do not agree are refused in one line; filtered sampling (top-k / top-p) keeps
    the XLA form under ``kernel_pick=True``, the same arrays bit for bit."""
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((4, 40)), jnp.float32)
    with pytest.raises(ValueError, match=r"noise of shape \(4, 39\) for logits of \(4, 40\)"):
        token_pick.pick_tokens(logits, jnp.zeros((4, 39)), jnp.float32(1.0))
    keys = jax.random.key_data(jax.random.split(jax.random.key(0), 4))
    args = (logits, keys, jnp.float32(0.9), jnp.int32(5), jnp.float32(0.8))
    native = sample_tokens(*args, greedy=False, filtered=True, kernel_pick=True)
    xla = sample_tokens(*args, greedy=False, filtered=True, kernel_pick=False)
    for a, b in zip(native, xla, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
