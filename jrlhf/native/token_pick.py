"""A decode step's token choice and log-probs on XLA:CPU in one native call (``token_pick.cc``).

``pick_tokens(logits, noise, temperature)`` returns what ``jrlhf.decode.sampling.sample_tokens``
computes without top-k/top-p filtering: for each row the first maximum of the logits (greedy,
``noise`` None) or of ``logits / temperature + noise`` (Gumbel-max sampling), the token's
log-prob under ``logits / temperature`` (0 for greedy) and under the raw logits. XLA runs that
as several reductions over the (rows, vocab) logits, each its own pass and program step; the
kernel reads a row once for its maximum and again from cache for each exp-sum (16 rows of 8192:
see docs/performance.md).

It is one custom call, which XLA does not partition: the decode engine takes it on CPU on a
one-device mesh where ``available()``. Without a compiler ``available()`` is False (said once in
a warning) and the engine keeps the XLA form.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp

from jrlhf.native import build as native_build
from jrlhf.native.build import NATIVE_DIR

SOURCE = NATIVE_DIR / "token_pick.cc"
TARGET = "jrlhf_token_pick_cpu"
SYMBOL = "JrlhfTokenPick"


@functools.cache
def _registered() -> str | None:
    reason = native_build.register(SOURCE, SYMBOL, TARGET)
    if reason is not None:
        warnings.warn(f"native CPU token pick unavailable: {reason}", stacklevel=3)
    return reason


def available() -> bool:
    """Whether the kernel is built and registered in this process (built if need be)."""
    return _registered() is None


def unavailable_reason() -> str | None:
    """Why ``available()`` is False, or None."""
    return _registered()


def pick_tokens(
    logits_bv: jax.Array, noise_bv: jax.Array | None, temperature: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(tokens int32, sampling log-probs, raw log-probs), each (rows,), from float32 logits
    (rows, vocab): greedy where ``noise_bv`` is None, else the first maximum of
    ``logits / temperature + noise_bv`` (see the module docstring)."""
    if not available():
        raise RuntimeError(f"native CPU token pick unavailable: {unavailable_reason()}")
    logits_bv = jnp.asarray(logits_bv, jnp.float32)
    rows, vocab = logits_bv.shape
    if noise_bv is None:
        noise_bv = jnp.zeros((0, vocab), jnp.float32)  # no noise: greedy
    elif noise_bv.shape != logits_bv.shape:
        raise ValueError(f"noise of shape {noise_bv.shape} for logits of {logits_bv.shape}")
    out = (
        jax.ShapeDtypeStruct((rows,), jnp.int32),
        jax.ShapeDtypeStruct((rows,), jnp.float32),
        jax.ShapeDtypeStruct((rows,), jnp.float32),
    )
    call = jax.ffi.ffi_call(TARGET, out)
    t = jnp.asarray(temperature, jnp.float32).reshape(())
    return call(logits_bv, noise_bv.astype(jnp.float32), t)
