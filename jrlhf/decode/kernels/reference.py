"""Pure-JAX paged attention for one decode step: gather the sequence's pages, masked attention.

This is the reference every other kernel is checked against, and the implementation used on CPU.
The pool layout is ``(layers, pages, page_size, kv_heads, head_dim)`` so that gathering a
sequence's pages yields ``(batch, pages, page_size, kv_heads, head_dim)``, which reshapes for free
into the ``(batch, keys, kv_heads, head_dim)`` layout of ``masked_attention``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jrlhf.models.attention import MASK_VALUE, softcap_scores


def paged_attention_reference(
    q_bhd: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    layer: jax.Array,
    page_table_bp: jax.Array,
    lengths_b: jax.Array,
    sliding_window: int = 0,
    softcap: float = 0.0,
) -> jax.Array:
    """Attention of one query token per sequence over its cached keys.

    Args:
      q_bhd: queries (batch, heads, head_dim) for the token at position ``lengths_b - 1``.
      k_pool, v_pool: (layers, pages, page_size, kv_heads, head_dim) page pools.
      layer: int32 scalar, the layer whose pages are read.
      page_table_bp: int32 (batch, max_pages) page ids of each sequence, in order.
      lengths_b: int32 (batch,) number of valid cached tokens, including the current one.
      sliding_window: attend only to the last ``sliding_window`` positions (0 = all).
      softcap: ``softcap * tanh(score / softcap)`` of the scaled scores (0 = none; Gemma 2).
        The native CPU and Pallas kernels have none (``select_kernel``).

    Returns:
      (batch, heads, head_dim) in the dtype of ``q_bhd``.
    """
    b, h, d = q_bhd.shape
    _, num_pages, _, kv_heads, _ = k_pool.shape
    # One gather with (layer, page) indices rather than slicing the layer first: slicing a layer
    # out of the pool would materialise a copy of every page of that layer.
    pages = jnp.clip(page_table_bp, 0, num_pages - 1)
    k_bskd = k_pool[layer, pages].reshape(b, -1, kv_heads, d)
    v_bskd = v_pool[layer, pages].reshape(b, -1, kv_heads, d)
    s = k_bskd.shape[1]
    kv_pos = jnp.arange(s, dtype=jnp.int32)
    q_pos = lengths_b[:, None] - 1
    valid_bs = kv_pos[None, :] <= q_pos
    if sliding_window:
        valid_bs &= q_pos - kv_pos[None, :] < sliding_window
    groups = h // kv_heads
    # Broadcast-multiply-and-reduce instead of einsum: with a single query token per sequence the
    # einsum becomes many tiny batched matmuls whose operand transposes copy every gathered page;
    # on CPU this form fuses with the gather and measured about 2x faster (fp32 accumulation).
    q_b1kgd = q_bhd.reshape(b, 1, kv_heads, groups, d).astype(jnp.float32) * (d**-0.5)
    scores_bskg = jnp.sum(q_b1kgd * k_bskd[:, :, :, None, :].astype(jnp.float32), axis=-1)
    scores_bskg = softcap_scores(scores_bskg, softcap)
    scores_bskg = jnp.where(valid_bs[:, :, None, None], scores_bskg, MASK_VALUE)
    probs_bskg = jax.nn.softmax(scores_bskg, axis=1)
    out = jnp.sum(probs_bskg[..., None] * v_bskd[:, :, :, None, :].astype(jnp.float32), axis=1)
    return out.reshape(b, h, d).astype(q_bhd.dtype)
