"""Pure-JAX paged decode attention that reads only the pages in use (CPU, TPU).

The reference gathers every page of every sequence's table row at every step, so a step at
context 70 of a 192-token engine reads (and materialises) as much K/V as one at 190. This kernel
walks the table in blocks of about ``BLOCK_TOKENS`` positions under a ``while`` loop that stops
after the last block any sequence of the batch still needs, combining blocks with an online
softmax (flash-decoding). One compile for every context length; results match the reference to
float rounding (``tests/decode/test_decode_kernels.py``).

Why this shape, measured on the 2-core CPU machine (docs/performance.md, CPU defaults):

* Each block's pages are taken as whole rows of the pool viewed as ``(layers * pages,
  page_size * kv_heads * head_dim)``: one contiguous row per page, a cheaper gather on XLA:CPU
  than indexing the 5-D pool by (layer, page).
* Scores and the weighted sum of values are ``einsum`` contractions (XLA dots) rather than
  broadcast-multiply-and-reduce, which XLA:CPU fuses into slow reductions over a 5-D product.
* Blocks of 32 positions on CPU: with fewer, the loop's fixed cost per step dominates; with
  more, each step's temporaries fall out of cache (64 positions was 8-20% slower, 192 three times
  slower).
* Blocks of 128 positions on accelerators: there each loop step costs kernel launches and the
  temporaries live in HBM, so larger blocks win. On an H200 (docs/gpu.md, run 20) decode of a
  Llama-3.2-1B / Llama-3-8B shape took 3.59 / 11.47 ms a step with 128-position blocks against
  5.87 / 16.41 ms with 32. TPUs take the same blocks, unmeasured there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jrlhf.models.attention import MASK_VALUE, softcap_scores

# Positions of K/V one loop step of the kernel reads per sequence (rounded to whole pages), by
# JAX backend; ACCELERATOR_BLOCK_TOKENS for any backend not listed.
BLOCK_TOKENS = {"cpu": 32}
ACCELERATOR_BLOCK_TOKENS = 128

_HIGHEST = jax.lax.Precision.HIGHEST  # float32 pools stay float32 on TPU too


def block_tokens(backend: str | None = None) -> int:
    """K/V positions per loop step on ``backend`` (default: JAX's default backend)."""
    return BLOCK_TOKENS.get(backend or jax.default_backend(), ACCELERATOR_BLOCK_TOKENS)


def pages_per_block(page_size: int, max_pages: int, backend: str | None = None) -> int:
    """Pages the kernel reads per sequence and loop step on ``backend``: :func:`block_tokens`
    positions' worth (at least one page, at most the table's width). The cost estimator prices
    decode attention with the CPU blocks (jrlhf.placement.estimator.attended_context)."""
    return max(1, min(max_pages, block_tokens(backend) // page_size))


def paged_attention_blocked(
    q_bhd: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    layer: jax.Array,
    page_table_bp: jax.Array,
    lengths_b: jax.Array,
    sliding_window: int = 0,
    block_pages: int | None = None,
    softcap: float = 0.0,
) -> jax.Array:
    """Same contract as ``paged_attention_reference``; ``block_pages`` overrides
    :func:`pages_per_block`."""
    b, h, d = q_bhd.shape
    _, num_pages, page_size, kv_heads, _ = k_pool.shape
    max_pages = page_table_bp.shape[1]
    blk = min(block_pages or pages_per_block(page_size, max_pages), max_pages)
    blocks = -(-max_pages // blk)
    table = jnp.pad(page_table_bp, ((0, 0), (0, blocks * blk - max_pages)))
    table = jnp.clip(table, 0, num_pages - 1)  # ids past a row's length are masked below
    tokens = blk * page_size
    groups = h // kv_heads
    q_bkgd = q_bhd.reshape(b, kv_heads, groups, d).astype(jnp.float32) * (d**-0.5)
    q_pos = lengths_b[:, None] - 1
    needed = (jnp.max(lengths_b) + tokens - 1) // tokens
    # One row per (layer, page): a block's pages are whole contiguous rows.
    k_rows = k_pool.reshape(-1, page_size * kv_heads * d)
    v_rows = v_pool.reshape(-1, page_size * kv_heads * d)
    first_row = layer * num_pages

    def body(carry):
        j, m_bkg, l_bkg, acc_bkgd = carry
        pages = jax.lax.dynamic_slice_in_dim(table, j * blk, blk, axis=1)
        rows = (pages + first_row).reshape(-1)
        k_bskd = jnp.take(k_rows, rows, axis=0, mode="clip").reshape(b, tokens, kv_heads, d)
        v_bskd = jnp.take(v_rows, rows, axis=0, mode="clip").reshape(b, tokens, kv_heads, d)
        kv_pos = j * tokens + jnp.arange(tokens, dtype=jnp.int32)
        valid_bs = kv_pos[None, :] <= q_pos
        if sliding_window:
            valid_bs &= q_pos - kv_pos[None, :] < sliding_window
        scores_bskg = jnp.einsum(
            "bskd,bkgd->bskg", k_bskd.astype(jnp.float32), q_bkgd, precision=_HIGHEST
        )
        scores_bskg = softcap_scores(scores_bskg, softcap)
        scores_bskg = jnp.where(valid_bs[:, :, None, None], scores_bskg, MASK_VALUE)
        m_new = jnp.maximum(m_bkg, jnp.max(scores_bskg, axis=1))
        p_bskg = jnp.exp(scores_bskg - m_new[:, None])
        scale = jnp.exp(m_bkg - m_new)
        l_bkg = l_bkg * scale + jnp.sum(p_bskg, axis=1)
        pv_bkgd = jnp.einsum(
            "bskg,bskd->bkgd", p_bskg, v_bskd.astype(jnp.float32), precision=_HIGHEST
        )
        return j + 1, m_new, l_bkg, acc_bkgd * scale[..., None] + pv_bkgd

    init = (
        jnp.int32(0),
        jnp.full((b, kv_heads, groups), MASK_VALUE, jnp.float32),
        jnp.zeros((b, kv_heads, groups), jnp.float32),
        jnp.zeros((b, kv_heads, groups, d), jnp.float32),
    )
    _, _, l_bkg, acc_bkgd = jax.lax.while_loop(lambda c: c[0] < needed, body, init)
    # No block at all (every length 0): zeros, where the reference averages clipped pages.
    out = jnp.where(l_bkg[..., None] > 0, acc_bkgd / jnp.maximum(l_bkg, 1e-30)[..., None], 0.0)
    return out.reshape(b, h, d).astype(q_bhd.dtype)
