"""Pure-JAX paged decode attention that reads only the pages in use (CPU, TPU).

The reference gathers every page of every sequence's table row at every step, so a step at
context 70 of a 192-token engine reads (and materialises) as much K/V as one at 190. This kernel
walks the table in blocks of ``pages_per_block`` pages under a ``while`` loop that stops after
the last block any sequence of the batch still needs, combining blocks with an online softmax
(flash-decoding). One compile for every context length; results match the reference to float
rounding (``tests/test_decode_kernels.py``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jrlhf.models.attention import MASK_VALUE


def paged_attention_blocked(
    q_bhd: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    layer: jax.Array,
    page_table_bp: jax.Array,
    lengths_b: jax.Array,
    sliding_window: int = 0,
    pages_per_block: int = 4,
) -> jax.Array:
    """Same contract as ``paged_attention_reference``."""
    b, h, d = q_bhd.shape
    _, num_pages, page_size, kv_heads, _ = k_pool.shape
    max_pages = page_table_bp.shape[1]
    blk = min(pages_per_block, max_pages)
    blocks = -(-max_pages // blk)
    table = jnp.pad(page_table_bp, ((0, 0), (0, blocks * blk - max_pages)))
    table = jnp.clip(table, 0, num_pages - 1)  # ids past a row's length are masked below
    tokens = blk * page_size
    groups = h // kv_heads
    q_bkgd = q_bhd.reshape(b, kv_heads, groups, d).astype(jnp.float32) * (d**-0.5)
    q_pos = lengths_b[:, None] - 1
    needed = (jnp.max(lengths_b) + tokens - 1) // tokens

    def body(carry):
        j, m_bkg, l_bkg, acc_bkgd = carry
        pages = jax.lax.dynamic_slice_in_dim(table, j * blk, blk, axis=1)
        k_bskd = k_pool[layer, pages].reshape(b, tokens, kv_heads, d).astype(jnp.float32)
        v_bskd = v_pool[layer, pages].reshape(b, tokens, kv_heads, d).astype(jnp.float32)
        kv_pos = j * tokens + jnp.arange(tokens, dtype=jnp.int32)
        valid_bs = kv_pos[None, :] <= q_pos
        if sliding_window:
            valid_bs &= q_pos - kv_pos[None, :] < sliding_window
        # Broadcast-multiply-and-reduce, as in the reference (fuses with the gather on CPU).
        scores_bskg = jnp.sum(q_bkgd[:, None] * k_bskd[:, :, :, None, :], axis=-1)
        scores_bskg = jnp.where(valid_bs[:, :, None, None], scores_bskg, MASK_VALUE)
        m_new = jnp.maximum(m_bkg, jnp.max(scores_bskg, axis=1))
        p_bskg = jnp.exp(scores_bskg - m_new[:, None])
        scale = jnp.exp(m_bkg - m_new)
        l_bkg = l_bkg * scale + jnp.sum(p_bskg, axis=1)
        pv_bkgd = jnp.sum(p_bskg[..., None] * v_bskd[:, :, :, None, :], axis=1)
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
