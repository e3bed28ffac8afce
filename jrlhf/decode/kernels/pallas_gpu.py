"""Paged decode attention as a Pallas kernel for GPUs (Triton backend).

One program per (sequence, kv head): it loads the query heads that share that kv head (padded to
16 rows, the smallest Triton dot), walks the sequence's pages through the page table and keeps an
online softmax, so only the pages a sequence actually uses are read. The whole 5-D pool and the
layer index go in (no per-layer slice, which would copy every page of the layer each step).

Precision: Triton's default for a float32 dot is TF32 (10-bit mantissas), which put the compiled
kernel 3e-4 (relative) off the reference on float32 pools where the pure-JAX kernels are within
1e-7 (measured on an H200). So float32 (and f16 or mixed) operands use IEEE float32 dots, and a
bf16 model's decode (bf16 queries and pools) multiplies in bf16, whose products are exact in the
float32 accumulator, the scale applied to the scores; the softmax weights, float32, are split
into a high and a low bf16 half (two dots instead of one: about 16 mantissa bits instead of 8),
so the result stays within rounding of the reference, which computes in float32 throughout.

The kernel math is checked against the pure-JAX reference on CPU with ``interpret=True``. The
compiled Triton path is selected automatically when ``jax.default_backend() == "gpu"``;
tests/decode/test_decode_kernels.py checks it on a CUDA device
(``JAX_PLATFORMS=cuda python -m pytest -o addopts="" tests/decode/test_decode_kernels.py``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jrlhf.decode.kernels import tileable
from jrlhf.models.attention import MASK_VALUE

_MIN_ROWS = 16  # Triton's tl.dot needs at least 16 rows
# ... and at least 16 along its other dimensions: pages of fewer tokens (the trainer's 8 before
# 2026-11-27), or heads narrower than 16, multiply and sum on the vector units instead. On an
# H200 the bf16 dot on 8-token pages compiled, ran and returned garbage (docs/gpu.md, runs 21-22).
_MIN_DOT_COLS = 16


def check_shapes(page_size: int, head_dim: int | None = None) -> None:
    """The compiled kernel's block shapes are Triton's: powers of two. Raises a one-line error
    naming the setting otherwise (``kernel='auto'`` picks the blocked kernel for such shapes)."""
    if not tileable(page_size):
        raise ValueError(
            f"the Pallas paged-attention kernel needs a power-of-two page size (Triton block "
            f"shapes), got {page_size}: set DecodeConfig.page_size (EngineConfig.page_size) to "
            "16 or 32, or the engine's kernel to 'blocked' or 'auto'"
        )
    if head_dim is not None and not tileable(head_dim):
        raise ValueError(
            f"the Pallas paged-attention kernel needs a power-of-two head_dim (Triton block "
            f"shapes), got {head_dim}: set the engine's kernel to 'blocked' or 'auto'"
        )


def _dot(a, b, trans_b: bool = False):
    """A float32-accumulated dot with exact products: IEEE for float32 operands (not TF32),
    the tensor cores' native multiply for bf16 ones."""
    return plgpu.dot(a, b, trans_b=trans_b, precision=lax.Precision.HIGHEST)


def _split_bf16(x):
    """float32 ``x`` as bf16 ``hi + lo`` to about 16 mantissa bits. ``hi`` is ``x`` with its low
    16 bits cleared (exactly a bf16), taken by bit masking: a round trip through a bf16 convert
    may be folded away by a compiler allowed excess precision (XLA:GPU folded it under
    ``interpret=True``, leaving ``lo`` zero)."""
    hi = lax.bitcast_convert_type(
        lax.bitcast_convert_type(x, jnp.uint32) & jnp.uint32(0xFFFF0000), jnp.float32
    )
    return hi.astype(jnp.bfloat16), (x - hi).astype(jnp.bfloat16)


def _kernel(
    layer_ref,  # (1,) int32
    lengths_ref,  # (1,) int32
    pages_ref,  # (max_pages,) int32
    q_ref,  # (rows, head_dim)
    k_ref,  # (layers, pages, page_size, kv_heads, head_dim)
    v_ref,
    o_ref,  # (rows, head_dim)
    *,
    page_size: int,
    sliding_window: int,
    scale: float,
):
    kv_head = pl.program_id(1)
    layer = layer_ref[0]
    length = lengths_ref[0]
    rows, head_dim = q_ref.shape
    # bf16 when queries and pool are both bf16 (the engine's case for a bf16 model); float32
    # otherwise (float32 models, mixed types, f16).
    cdt = jnp.bfloat16 if q_ref.dtype == k_ref.dtype == jnp.bfloat16 else jnp.float32
    q = q_ref[...].astype(cdt)
    first_page = 0
    if sliding_window:
        first_page = jnp.maximum(length - sliding_window, 0) // page_size

    def body(i, carry):
        o, m, l = carry
        # Same contract as the reference kernel: out-of-range ids (unused table entries) are
        # clamped rather than read past the end of the pool.
        page = jnp.minimum(pages_ref[i], k_ref.shape[1] - 1)
        k = k_ref[layer, page, pl.ds(0, page_size), kv_head, pl.ds(0, head_dim)].astype(cdt)
        v = v_ref[layer, page, pl.ds(0, page_size), kv_head, pl.ds(0, head_dim)].astype(cdt)
        small = min(page_size, head_dim) < _MIN_DOT_COLS
        if small:  # float32 products and sums: exact for bf16 operands too
            qk = q.astype(jnp.float32)[:, None, :] * k.astype(jnp.float32)[None, :, :]
            s = jnp.sum(qk, axis=-1) * scale  # (rows, page_size)
        else:
            s = _dot(q, k, trans_b=True) * scale  # (rows, page_size), float32
        pos = i * page_size + lax.broadcasted_iota(jnp.int32, (rows, page_size), 1)
        valid = pos < length
        if sliding_window:
            valid &= length - 1 - pos < sliding_window
        s = jnp.where(valid, s, MASK_VALUE)
        m_new = jnp.maximum(m, s.max(axis=-1))
        correction = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])
        l_new = l * correction + p.sum(axis=-1)
        if small:
            pv = jnp.sum(p[:, :, None] * v.astype(jnp.float32)[None, :, :], axis=1)
        elif cdt == jnp.float32:
            pv = _dot(p, v)
        else:  # p in two bf16 halves: ~16 mantissa bits, exact products
            hi, lo = _split_bf16(p)
            pv = _dot(hi, v) + _dot(lo, v)
        o_new = o * correction[:, None] + pv
        return o_new, m_new, l_new

    num_pages = (length + page_size - 1) // page_size
    init = (
        jnp.zeros((rows, head_dim), jnp.float32),
        jnp.full((rows,), MASK_VALUE, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )
    o, _, l = lax.fori_loop(first_page, num_pages, body, init)
    o_ref[...] = (o / jnp.maximum(l, 1e-30)[:, None]).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("sliding_window", "interpret"))
def paged_attention_pallas(
    q_bhd: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    layer: jax.Array,
    page_table_bp: jax.Array,
    lengths_b: jax.Array,
    sliding_window: int = 0,
    interpret: bool = False,
) -> jax.Array:
    """Same contract as ``paged_attention_reference``; ``interpret=True`` runs it on CPU."""
    b, h, d = q_bhd.shape
    _, _, page_size, kv_heads, _ = k_pool.shape
    if not interpret:
        check_shapes(page_size, d)
    groups = h // kv_heads
    rows = max(_MIN_ROWS, pl.next_power_of_2(groups))
    q_bkgd = q_bhd.reshape(b, kv_heads, groups, d)
    if rows != groups:
        q_bkgd = jnp.pad(q_bkgd, ((0, 0), (0, 0), (0, rows - groups), (0, 0)))
    max_pages = page_table_bp.shape[1]
    kernel = functools.partial(
        _kernel, page_size=page_size, sliding_window=sliding_window, scale=d**-0.5
    )
    out = pl.pallas_call(
        kernel,
        grid=(b, kv_heads),
        in_specs=[
            pl.BlockSpec((1,), lambda i, j: (0,)),
            pl.BlockSpec((None, 1), lambda i, j: (i, 0)),
            pl.BlockSpec((None, max_pages), lambda i, j: (i, 0)),
            pl.BlockSpec((None, None, rows, d), lambda i, j: (i, j, 0, 0)),
            pl.BlockSpec(k_pool.shape, lambda i, j: (0, 0, 0, 0, 0)),
            pl.BlockSpec(v_pool.shape, lambda i, j: (0, 0, 0, 0, 0)),
        ],
        out_specs=pl.BlockSpec((None, None, rows, d), lambda i, j: (i, j, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((b, kv_heads, rows, d), q_bhd.dtype),
        interpret=interpret,
        name="jrlhf_paged_decode_attention",
    )(
        jnp.reshape(layer, (1,)).astype(jnp.int32),
        lengths_b.astype(jnp.int32)[:, None],
        page_table_bp.astype(jnp.int32),
        q_bkgd,
        k_pool,
        v_pool,
    )
    return out[:, :, :groups, :].reshape(b, h, d)
