"""Full-sequence masked attention on XLA:CPU, forward and backward (``masked_attention.cc``).

``masked_attention(q, k, v, mask, mask_value)`` has the contract of
``jrlhf.models.attention.masked_attention`` for float32 arrays, and a custom VJP whose backward
is the kernel's too: the forward saves each query row's score maximum and reciprocal sum (two
floats a row, not the (B, H, T, S) probabilities), and the backward recomputes the same
probabilities from them. In the ``bench rl`` GRPO model's train step the reference's attention
forward and backward took about a quarter of the step (docs/performance.md).

It is one custom call, which XLA does not partition: ``jrlhf.models.attention`` calls it on CPU
for float32 on a one-device mesh (or none), where ``available()``; elsewhere the reference runs.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from jrlhf.native import build as native_build
from jrlhf.native.build import NATIVE_DIR

SOURCE = NATIVE_DIR / "masked_attention.cc"
TARGETS = {
    "JrlhfMaskedAttentionForward": "jrlhf_masked_attention_forward_cpu",
    "JrlhfMaskedAttentionBackward": "jrlhf_masked_attention_backward_cpu",
}
_FORWARD, _BACKWARD = TARGETS.values()


@functools.cache
def _registered() -> str | None:
    for symbol, target in TARGETS.items():
        reason = native_build.register(SOURCE, symbol, target)
        if reason is not None:
            warnings.warn(f"native CPU masked attention unavailable: {reason}", stacklevel=3)
            return reason
    return None


def available() -> bool:
    """Whether the kernel is built and registered in this process (built if need be)."""
    return _registered() is None


def unavailable_reason() -> str | None:
    """Why ``available()`` is False, or None."""
    return _registered()


def _stats_shape(q: jax.Array) -> jax.ShapeDtypeStruct:
    b, t, h, _ = q.shape
    return jax.ShapeDtypeStruct((b, h, t), jnp.float32)


def _check_available():
    if not available():
        raise RuntimeError(f"native CPU masked attention unavailable: {unavailable_reason()}")


def _forward(q, k, v, mask, mask_value):
    _check_available()
    out = (jax.ShapeDtypeStruct(q.shape, jnp.float32), _stats_shape(q), _stats_shape(q))
    call = jax.ffi.ffi_call(_FORWARD, out)
    return call(q, k, v, mask.astype(bool), mask_value=np.float32(mask_value))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def masked_attention(
    q_bthd: jax.Array, k_bskd: jax.Array, v_bskd: jax.Array, mask_bts: jax.Array, mask_value: float
) -> jax.Array:
    """Attention of float32 ``q`` (B, T, H, D) over ``k``, ``v`` (B, S, KV, D) under a boolean
    ``mask`` (B, T, S), masked scores set to ``mask_value`` (see the module docstring)."""
    return _forward(q_bthd, k_bskd, v_bskd, mask_bts, mask_value)[0]


def _fwd(q, k, v, mask, mask_value):
    out, row_max, row_inv_sum = _forward(q, k, v, mask, mask_value)
    return out, (q, k, v, mask, row_max, row_inv_sum)


def _bwd(mask_value, residuals, d_out):
    q, k, v, mask, row_max, row_inv_sum = residuals
    _check_available()
    shapes = tuple(jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in (q, k, v))
    call = jax.ffi.ffi_call(_BACKWARD, shapes)
    d_q, d_k, d_v = call(
        q,
        k,
        v,
        mask.astype(bool),
        row_max,
        row_inv_sum,
        d_out.astype(jnp.float32),
        mask_value=np.float32(mask_value),
    )
    return d_q, d_k, d_v, None


masked_attention.defvjp(_fwd, _bwd)
