"""Attention over explicit positions and segment ids.

Masks are derived from (position, segment) pairs rather than from array offsets, so left-padded
batches (padding has segment 0), packed batches (several segments per row) and decode steps against
a cache all use the same rule: a query attends to keys of its own segment at positions <= its own.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jrlhf import kernels
from jrlhf.meshes.context import current_mesh

# A large finite negative instead of -inf, so a row with nothing to attend to yields a uniform
# softmax rather than NaN (such rows are padding and their outputs are never used).
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)

# jax.nn.dot_product_attention's implementation behind the fused forms: cuDNN (GPU). The tests
# set "xla" to run the same calls, masks and row shifts on CPU.
FUSED_IMPLEMENTATION = "cudnn"

# attend(q_bthd, k_bskd, v_bskd, layer_idx, cache) -> (out_bthd, cache)
AttendFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, Any], tuple[jax.Array, Any]]


def attention_mask(
    q_positions_bt: jax.Array,
    kv_positions_bs: jax.Array,
    q_segments_bt: jax.Array,
    kv_segments_bs: jax.Array,
    sliding_window: int = 0,
) -> jax.Array:
    """Boolean (B, T, S): same segment, causal by position, optional sliding window."""
    same = q_segments_bt[:, :, None] == kv_segments_bs[:, None, :]
    causal = kv_positions_bs[:, None, :] <= q_positions_bt[:, :, None]
    mask = same & causal
    if sliding_window:
        mask &= q_positions_bt[:, :, None] - kv_positions_bs[:, None, :] < sliding_window
    return mask


def layer_choice(values: Sequence[Any], layer_idx: Any) -> tuple[tuple[Any, ...], Any]:
    """Per-layer ``values`` (one per layer) at ``layer_idx``, as (the distinct values in order,
    which of them): ``which`` a Python int where every layer has the same value or the index is a
    Python int (the unrolled loop), else a traced int32 looked up from the index (the scanned
    loop, whose one body serves every layer)."""
    options = tuple(sorted(set(values)))
    if len(options) == 1:
        return options, 0
    if isinstance(layer_idx, int):
        return options, options.index(values[layer_idx])
    which = jnp.asarray([options.index(v) for v in values], jnp.int32)
    return options, which[layer_idx]


def select_choice(cases: Sequence[Any], which: Any) -> Any:
    """``cases[which]`` for a ``layer_choice`` index: the case itself where ``which`` is a Python
    int, else an elementwise select of the (same-shaped) pytrees."""
    if isinstance(which, int):
        return cases[which]
    return jax.tree.map(lambda *xs: jax.lax.select_n(which, *xs), *cases)


def softcap_scores(scores: jax.Array, softcap: float) -> jax.Array:
    """``softcap * tanh(scores / softcap)`` (Gemma 2's attention logits); ``scores`` if 0."""
    if not softcap:
        return scores
    return softcap * jnp.tanh(scores / softcap)


def masked_attention(
    q_bthd: jax.Array,
    k_bskd: jax.Array,
    v_bskd: jax.Array,
    mask_bts: jax.Array,
    softcap: float = 0.0,
) -> jax.Array:
    """Grouped-query attention with a boolean mask; softmax in float32.

    Computed head-major: each KV head's queries are one (groups * T, D) matrix, so scores, their
    softmax and both products are 4-D, batched over (batch, kv head), with the (B, T, S) mask
    tiled over the groups. On XLA:CPU the forward and backward of the ``bench rl`` model's
    attention ran about 30% faster than in the 5-D (batch, kv head, group, T, S) form, whose
    softmax reductions and operand transposes are slower, and its GRPO train phase 4% faster
    (docs/performance.md).

    Where the backend registers a ``masked_attention`` kernel (jrlhf.kernels; on CPU the native
    one, forward and backward, 1.3x the train step's speed there) and it fits
    (``kernel_fits``: float32 on one device), that kernel computes the same. It has no
    soft-capping: ``softcap`` (``softcap_scores`` of the scaled scores, before the
    mask) takes the XLA form.
    """
    if not softcap and kernel_fits(q_bthd, k_bskd, v_bskd):
        kernel = kernels.usable("masked_attention")
        return kernel.fn(q_bthd, k_bskd, v_bskd, mask_bts, MASK_VALUE)
    b, t, h, d = q_bthd.shape
    kv_heads = k_bskd.shape[2]
    groups = h // kv_heads
    q_bkrd = q_bthd.reshape(b, t, kv_heads, groups, d).transpose(0, 2, 3, 1, 4)
    q_bkrd = q_bkrd.reshape(b, kv_heads, groups * t, d)  # rows r = (group, query) pairs
    k_bkds = k_bskd.transpose(0, 2, 3, 1)
    v_bksd = v_bskd.transpose(0, 2, 1, 3)
    scores = jnp.matmul(q_bkrd, k_bkds, preferred_element_type=jnp.float32) * (d**-0.5)
    scores = softcap_scores(scores, softcap)
    mask_brs = jnp.tile(mask_bts, (1, groups, 1))
    scores = jnp.where(mask_brs[:, None], scores, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_bskd.dtype)
    out = jnp.matmul(probs, v_bksd).reshape(b, kv_heads, groups, t, d)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, d)


def fused_attention(
    q_bthd: jax.Array, k_bskd: jax.Array, v_bskd: jax.Array, mask_bts: jax.Array
) -> jax.Array:
    """``masked_attention`` as one cuDNN flash-attention call (GPU; bfloat16 or float16).

    The boolean mask reaches cuDNN as an additive bias of shape (B, 1, T, S), broadcast over
    the heads, so padding, packing and sliding windows keep the one (position, segment) rule.
    The kernel never writes the (B, H, T, S) scores and probabilities that the einsum form
    materializes in float32 for the backward pass: it keeps a log-sum-exp per query and head.
    """
    return jax.nn.dot_product_attention(
        q_bthd, k_bskd, v_bskd, mask=mask_bts[:, None], implementation=FUSED_IMPLEMENTATION
    )


def aligned_causal_attention(q_bthd: jax.Array, k_bskd: jax.Array, v_bskd: jax.Array) -> jax.Array:
    """Fused attention of rows whose real tokens fill columns [0, n) at positions equal to their
    columns (one segment, padding on the right only): cuDNN's own causal mask, with no bias.
    Under it a real query never sees the padding, which only follows it; padding queries see
    real tokens and padding, finite values that nothing reads. Against ``fused_attention``'s
    (B, 1, T, S) bias this skips the blocks above the diagonal and the bias and its gradient,
    which JAX's cuDNN wrapper always computes (one H200, Llama-3-8B heads, 2 x 4096 tokens:
    2.2 vs 6.4 ms a layer, forward + backward).
    """
    return jax.nn.dot_product_attention(
        q_bthd, k_bskd, v_bskd, is_causal=True, implementation=FUSED_IMPLEMENTATION
    )


# Whether masked_attention may take a registered kernel where it fits (tests turn it off to run
# the XLA form).
USE_KERNEL = True


def kernel_fits(q_bthd: jax.Array, k_bskd: jax.Array, v_bskd: jax.Array) -> bool:
    """Whether ``masked_attention`` runs the backend's registered kernel (jrlhf.kernels; on
    XLA:CPU the native one): float32 operands traced on one device (no mesh, or a one-device
    one: XLA does not partition the custom call), where the kernel builds."""
    if not USE_KERNEL:
        return False
    if any(x.dtype != jnp.float32 for x in (q_bthd, k_bskd, v_bskd)):
        return False
    mesh = current_mesh()  # an abstract one inside shard_map (no devices): count its axes
    if mesh is not None and math.prod(mesh.shape.values()) != 1:
        return False
    return kernels.usable("masked_attention") is not None


def fused_attention_fits(t: int, s: int, head_dim: int) -> bool:
    """Whether cuDNN's flash attention takes these shapes with a bias: head_dim a multiple of
    8 and at most 128 (256 from Hopper on; 128 is the bound on every GPU), even lengths."""
    return head_dim % 8 == 0 and head_dim <= 128 and t % 2 == 0 and s % 2 == 0


def full_attention(
    q_bthd: jax.Array,
    k_bskd: jax.Array,
    v_bskd: jax.Array,
    mask_bts: jax.Array,
    fused: bool,
    softcap: float = 0.0,
) -> jax.Array:
    """Attention of whole sequences (training, scoring, prefill): ``fused_attention`` when
    ``fused`` (ModelConfig.fused_attention) and the shapes allow it, ``masked_attention``
    otherwise (always with a ``softcap``, which cuDNN's attention does not have)."""
    fits = fused_attention_fits(q_bthd.shape[1], k_bskd.shape[1], q_bthd.shape[-1])
    if fused and fits and not softcap:
        return fused_attention(q_bthd, k_bskd, v_bskd, mask_bts)
    return masked_attention(q_bthd, k_bskd, v_bskd, mask_bts, softcap)


def aligned_attend(q, k, v, layer_idx, cache):
    """The attend hook of full-sequence passes over left-aligned rows (``aligned_causal_attention``;
    see ``jrlhf.models.transformer.Transformer.hidden``): no cache."""
    del layer_idx
    return aligned_causal_attention(q, k, v), cache


def layer_masks(
    positions_bt: jax.Array, segment_ids_bt: jax.Array, windows: Sequence[int]
) -> Callable[[Any], jax.Array]:
    """``mask(layer_idx)``: the (B, T, T) mask of full sequences for that layer's sliding window
    (``windows``, one per layer). One mask per distinct window, built once; a scanned layer
    selects between them by its index."""
    options, _ = layer_choice(windows, 0)
    masks = [
        attention_mask(positions_bt, positions_bt, segment_ids_bt, segment_ids_bt, w)
        for w in options
    ]

    def mask(layer_idx):
        return select_choice(masks, layer_choice(windows, layer_idx)[1])

    return mask


def dense_attend(
    positions_bt: jax.Array,
    segment_ids_bt: jax.Array,
    sliding_window: int | Sequence[int] = 0,
    fused: bool = False,
    softcap: float = 0.0,
) -> AttendFn:
    """The attend hook for full-sequence forward passes (training, scoring): no cache.

    ``sliding_window``: one for every layer, or one per layer (ModelConfig.layer_windows).
    ``fused``, ``softcap``: see ``full_attention``.
    """
    windows = (sliding_window,) if isinstance(sliding_window, int) else tuple(sliding_window)
    mask = layer_masks(positions_bt, segment_ids_bt, windows)

    def attend(q, k, v, layer_idx, cache):
        return full_attention(q, k, v, mask(layer_idx), fused, softcap), cache

    return attend
