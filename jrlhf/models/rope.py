"""Rotary position embeddings with explicit positions (default, linear and llama3 scaling).

A model has one RoPE table, or two (Gemma 3: the sliding layers' own base frequency,
``ModelConfig.rope_local_theta``); ``rope_tables`` builds them once per pass and ``rope_kinds``
says which one each layer reads.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jrlhf.models.config import ModelConfig, RopeScaling


def inverse_frequencies(cfg: ModelConfig) -> np.ndarray:
    """Per-pair inverse frequencies (head_dim // 2,), float32, with the config's scaling applied."""
    dim = cfg.head_dim
    exponents = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    inv_freq = (1.0 / (np.float32(cfg.rope_theta) ** exponents)).astype(np.float32)
    scaling = cfg.rope_scaling
    if scaling.rope_type == "default":
        return inv_freq
    if scaling.rope_type == "linear":
        return (inv_freq / np.float32(scaling.factor)).astype(np.float32)
    # llama3: leave high frequencies alone, divide low frequencies by `factor`, and blend
    # smoothly in between (wavelength measured against the original context length).
    old_len = float(scaling.original_max_position_embeddings)
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, blended, scaled).astype(np.float32)


def rope_cos_sin(positions_bt: jnp.ndarray, cfg: ModelConfig) -> tuple[jnp.ndarray, jnp.ndarray]:
    """cos/sin tables of shape (B, T, head_dim) for integer positions (B, T)."""
    inv_freq = jnp.asarray(inverse_frequencies(cfg))
    angles_btf = positions_bt.astype(jnp.float32)[..., None] * inv_freq
    # Each angle's cos and sin once, materialized: left alone, XLA fused them into every layer's
    # rotation of the queries and of the keys and evaluated them again for every head (on CPU one
    # libm call per element: 28 us of each layer's 16 x 8 x 64 query rotation in a decode step of
    # `bench decode`'s model). The tables repeat them for the two halves of a head.
    cos, sin = jax.lax.optimization_barrier((jnp.cos(angles_btf), jnp.sin(angles_btf)))
    return jnp.concatenate([cos, cos], axis=-1), jnp.concatenate([sin, sin], axis=-1)


def rope_kinds(cfg: ModelConfig) -> tuple[int, ...]:
    """Which of ``rope_tables`` each layer reads: 0 the model's, 1 the sliding layers' own."""
    if not cfg.rope_local_theta:
        return (0,) * cfg.num_layers
    return tuple(int(w > 0) for w in cfg.layer_windows)


def rope_tables(positions_bt: jnp.ndarray, cfg: ModelConfig) -> list[tuple[jnp.ndarray, ...]]:
    """``rope_cos_sin`` of the model's RoPE and, with ``rope_local_theta``, of the sliding
    layers' (that base, no frequency scaling, as Gemma 3's rope_local_base_freq)."""
    tables = [rope_cos_sin(positions_bt, cfg)]
    if cfg.rope_local_theta:
        local = cfg.replace(rope_theta=cfg.rope_local_theta, rope_scaling=RopeScaling())
        tables.append(rope_cos_sin(positions_bt, local))
    return tables


def apply_rope(
    x_bthd: jnp.ndarray, cos_btd: jnp.ndarray, sin_btd: jnp.ndarray, scale: float = 1.0
) -> jnp.ndarray:
    """Rotate (B, T, H, D) by the half-split convention used by HF Llama/Qwen checkpoints;
    ``scale`` multiplies the result in float32, before the cast back (ModelConfig.query_scale)."""
    dtype = x_bthd.dtype
    x = x_bthd.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    out = x * cos_btd[:, :, None, :] + rotated * sin_btd[:, :, None, :]
    if scale != 1.0:
        out = out * jnp.float32(scale)
    return out.astype(dtype)
