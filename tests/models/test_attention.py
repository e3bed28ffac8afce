"""Full-sequence attention: the einsum form against JAX's own attention, the cuDNN fused form
against the einsum form (GPU), and the ``ModelConfig.attention`` choice."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrlhf.data.batch import pack
from jrlhf.models import attention
from jrlhf.models.attention import (
    aligned_causal_attention,
    attention_mask,
    dense_attend,
    fused_attention_fits,
    masked_attention,
)
from jrlhf.models.config import tiny_config
from jrlhf.models.model_def import ModelDef

_GPU_ONLY = pytest.mark.skipif(
    jax.default_backend() != "gpu", reason="cuDNN flash attention needs a GPU"
)


def _batch(b=3, t=16, h=4, kv=2, d=16, dtype=jnp.float32, seed=0):
    """q, k, v and (positions, segments) for a left-padded row, a packed row and a full row."""
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.standard_normal((b, t, n, d)), dtype) for n in (h, kv, kv))
    seg = np.ones((b, t), np.int32)
    pos = np.tile(np.arange(t, dtype=np.int32), (b, 1))
    seg[0, :5] = 0  # left padding: segment 0, position 0
    pos[0, :5] = 0
    pos[0, 5:] = np.arange(t - 5)
    seg[1, 7:] = 2  # two packed segments, positions restarting
    pos[1, 7:] = np.arange(t - 7)
    return q, k, v, jnp.asarray(pos), jnp.asarray(seg)


@pytest.mark.parametrize("window", [0, 4])
def test_einsum_attention_matches_jax_dot_product_attention(window):
    """The call ``fused_attention`` makes (mask broadcast over heads as (B, 1, T, S), grouped
    KV heads, default 1/sqrt(d) scale), through JAX's XLA implementation, equals ours."""
    q, k, v, pos, seg = _batch()
    mask = attention_mask(pos, pos, seg, seg, window)
    ours = masked_attention(q, k, v, mask)
    theirs = jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], implementation="xla")
    np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=2e-6, atol=2e-6)


def test_attention_choice():
    assert not tiny_config().fused_attention or jax.default_backend() == "gpu"
    assert not tiny_config(attention="auto", dtype="bfloat16").fused_attention or (
        jax.default_backend() == "gpu"
    )
    assert not tiny_config(attention="auto").fused_attention  # float32: einsum everywhere
    assert tiny_config(attention="cudnn", dtype="bfloat16").fused_attention
    assert not tiny_config(attention="einsum", dtype="bfloat16").fused_attention
    with pytest.raises(ValueError, match="attention 'flash' unknown"):
        tiny_config(attention="flash")
    with pytest.raises(ValueError, match="16-bit compute dtype"):
        tiny_config(attention="cudnn")
    assert fused_attention_fits(16, 16, 64)
    assert not fused_attention_fits(15, 15, 64)  # cuDNN's bias path wants even lengths
    assert not fused_attention_fits(16, 16, 12)
    assert not fused_attention_fits(16, 16, 256)


def test_aligned_attention_equals_the_masked_form(monkeypatch):
    """cuDNN's causal call (run through JAX's XLA implementation here) on rows whose tokens fill
    columns [0, length): the masked form's outputs on every real query (the padding after them
    is never seen), and finite outputs on the padding (a row of length 0 included)."""
    monkeypatch.setattr(attention, "FUSED_IMPLEMENTATION", "xla")
    q, k, v, _, _ = _batch(b=4, t=16)
    v = v.at[1, 9:].set(1e4)  # padding values that would show if a real query saw them
    lengths = jnp.asarray([16, 9, 1, 0], jnp.int32)
    cols = jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), (4, 16))
    seg = (cols < lengths[:, None]).astype(jnp.int32)
    want = masked_attention(q, k, v, attention_mask(cols, cols, seg, seg))
    got = aligned_causal_attention(q, k, v)
    real = np.asarray(seg) > 0
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], atol=2e-6)
    assert np.isfinite(np.asarray(got)).all()


def test_one_segment_rows_run_shifted_with_the_same_states(monkeypatch):
    """A bf16 model with fused attention on rows laid out by ``pack`` (left padding, right
    padding, an empty response): ``one_segment`` shifts the rows and runs the causal + length
    call; the real tokens' logits and the parameters' gradients are the bias path's."""
    monkeypatch.setattr(attention, "FUSED_IMPLEMENTATION", "xla")
    calls = []
    real_call = attention.aligned_causal_attention
    monkeypatch.setattr(
        attention, "aligned_causal_attention", lambda *a: calls.append(1) or real_call(*a)
    )
    cfg = tiny_config(dtype="bfloat16", attention="cudnn", num_layers=2)
    model = ModelDef(cfg)
    params = model.init(jax.random.key(0))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in (3, 8, 5)]
    responses = [rng.integers(3, cfg.vocab_size, n).tolist() for n in (6, 2, 0)]
    batch = pack(prompts, responses, 8, 6)
    tokens, pos, seg = (jnp.asarray(batch[k]) for k in ("tokens", "positions", "segment_ids"))
    real = np.asarray(seg) > 0

    def loss(params, one_segment):
        logits = model.apply(params, tokens, pos, seg, one_segment)
        return jnp.sum(jnp.where(real[..., None], logits.astype(jnp.float32), 0.0) ** 2)

    out = {}
    for one in (False, True):
        logits = jax.jit(model.apply, static_argnums=4)(params, tokens, pos, seg, one)
        grads = jax.jit(jax.grad(loss), static_argnums=1)(params, one)
        out[one] = (np.asarray(logits, np.float32), grads)
    assert calls  # the shifted path ran (once per layer per trace)
    np.testing.assert_allclose(out[True][0][real], out[False][0][real], atol=2e-2)
    assert np.isfinite(out[True][0]).all()
    for g_bias, g_aligned in zip(jax.tree.leaves(out[False][1]), jax.tree.leaves(out[True][1])):
        g_bias, g_aligned = np.asarray(g_bias, np.float32), np.asarray(g_aligned, np.float32)
        assert np.isfinite(g_aligned).all()
        assert np.abs(g_aligned - g_bias).max() <= 3e-2 * max(1.0, np.abs(g_bias).max())


@_GPU_ONLY
@pytest.mark.parametrize("window", [0, 4])
def test_fused_attention_matches_einsum_on_gpu(window):
    """Outputs and the gradients of q, k and v within bfloat16 rounding of the einsum form."""
    q, k, v, pos, seg = _batch(b=4, t=64, h=8, kv=2, d=64, dtype=jnp.bfloat16)
    real = np.asarray(seg) > 0  # padding rows' outputs are never used
    cot = jnp.asarray(np.random.default_rng(1).standard_normal(q.shape), jnp.float32)

    def loss(fused, q, k, v):
        out, _ = dense_attend(pos, seg, window, fused=fused)(q, k, v, 0, None)
        return jnp.sum(jnp.where(real[..., None, None], out.astype(jnp.float32) * cot, 0.0))

    outs = {}
    for fused in (False, True):
        out, _ = jax.jit(dense_attend(pos, seg, window, fused=fused))(q, k, v, 0, None)
        grads = jax.jit(jax.grad(lambda *a, f=fused: loss(f, *a), argnums=(0, 1, 2)))(q, k, v)
        outs[fused] = (out, grads)
    out_e, grads_e = outs[False]
    out_f, grads_f = outs[True]
    # bf16 outputs: a few units of the last place of values of size ~1
    err = np.abs(np.asarray(out_f, np.float32) - np.asarray(out_e, np.float32))[real]
    assert err.max() < 3e-2, err.max()
    for ge, gf in zip(grads_e, grads_f, strict=True):
        ge, gf = np.asarray(ge, np.float32), np.asarray(gf, np.float32)
        assert np.abs(gf - ge).max() <= 3e-2 * max(1.0, np.abs(ge).max()), np.abs(gf - ge).max()


@_GPU_ONLY
def test_model_logits_with_cudnn_attention_on_gpu():
    """A bf16 model's logits on a left-padded batch: cuDNN attention vs the einsum form."""
    cfg = tiny_config(dtype="bfloat16", num_layers=2, hidden_size=128, num_heads=4)
    params = ModelDef(cfg.replace(attention="einsum")).init(jax.random.key(0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 32)))
    _, _, _, pos, seg = _batch(b=2, t=32)
    logits = {
        impl: np.asarray(ModelDef(cfg.replace(attention=impl)).apply(params, tokens, pos, seg))
        for impl in ("einsum", "cudnn")
    }
    real = np.asarray(seg) > 0
    diff = np.abs(logits["cudnn"] - logits["einsum"])[real]
    assert diff.max() < 0.05 * np.abs(logits["einsum"][real]).max(), diff.max()


@_GPU_ONLY
def test_one_segment_rows_with_cudnn_attention_on_gpu():
    """Rows laid out by ``pack`` through cuDNN's causal call (``one_segment``): the real tokens'
    logits within bf16 rounding of the einsum form's, every logit and gradient finite."""
    cfg = tiny_config(dtype="bfloat16", num_layers=2, hidden_size=128, num_heads=4)
    params = ModelDef(cfg.replace(attention="einsum")).init(jax.random.key(0))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in (3, 16, 9, 1)]
    responses = [rng.integers(3, cfg.vocab_size, n).tolist() for n in (16, 4, 0, 11)]
    batch = {k: jnp.asarray(v) for k, v in pack(prompts, responses, 16, 16).items()}
    args = (batch["tokens"], batch["positions"], batch["segment_ids"], True)
    fused = ModelDef(cfg.replace(attention="cudnn"))
    logits = {
        "einsum": np.asarray(ModelDef(cfg.replace(attention="einsum")).apply(params, *args)),
        "cudnn": np.asarray(fused.apply(params, *args)),
    }
    real = np.asarray(batch["segment_ids"]) > 0
    diff = np.abs(logits["cudnn"] - logits["einsum"])[real]
    assert diff.max() < 0.05 * np.abs(logits["einsum"][real]).max(), diff.max()
    assert np.isfinite(logits["cudnn"]).all()
    grads = jax.grad(lambda p: jnp.sum(fused.apply(p, *args).astype(jnp.float32) ** 2))(params)
    assert all(np.isfinite(np.asarray(g, np.float32)).all() for g in jax.tree.leaves(grads))
