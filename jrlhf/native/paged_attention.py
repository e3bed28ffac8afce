"""Paged decode attention compiled for the host CPU, called from XLA:CPU through the XLA FFI.

The kernel (``jrlhf/native/paged_attention_cpu.cc``) has the contract of
``paged_attention_reference``. Each sequence's pages are read in place, in position order, once for
the scores and once for the values, with the sequences shared out over XLA's intra-op threads: no
page is copied, where the pure-JAX kernels gather (and transpose) every page they read. On the
bench model's decode shape (8 layers, 16 sequences, 4 KV heads of 64, context 128) one step's
attention took 1.26 ms against the blocked kernel's 4.8 ms (docs/performance.md).

It is built on first use with the system's C++ compiler and cached per machine by
``jrlhf.native.build`` (about 2 s, once). Without a compiler (or if the build fails)
``available()`` is False, says why once in a warning, and ``select_kernel("auto")`` keeps the
blocked kernel.
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jrlhf.decode.kernels.blocked import paged_attention_blocked
from jrlhf.native import build as native_build
from jrlhf.native.build import NATIVE_DIR

SOURCE = NATIVE_DIR / "paged_attention_cpu.cc"
TARGET = "jrlhf_paged_attention_cpu"
SYMBOL = "JrlhfPagedAttention"
DTYPES = (jnp.float32, jnp.bfloat16)  # of the queries and of the pools; others go blocked


def build(rebuild: bool = False) -> Path:
    """The compiled kernel's path, compiling it into the cache first if needed (or if
    ``rebuild``); raises ``jrlhf.native.build.BuildError`` in one line when it cannot be built."""
    return native_build.build(SOURCE, rebuild)


@functools.cache
def _registered() -> str | None:
    """Builds, loads and registers the kernel once per process: None when that worked, else why
    not (also said once in a warning)."""
    reason = native_build.register(SOURCE, SYMBOL, TARGET)
    if reason is not None:
        warnings.warn(
            f"native CPU paged attention unavailable, using the blocked kernel: {reason}",
            stacklevel=3,
        )
    return reason


def available() -> bool:
    """Whether the native kernel is built and registered in this process (built if need be)."""
    return _registered() is None


def unavailable_reason() -> str | None:
    """Why ``available()`` is False, or None."""
    return _registered()


def supports(dtype) -> bool:
    """Whether the kernel takes queries or pools of ``dtype``."""
    return jnp.dtype(dtype) in tuple(jnp.dtype(t) for t in DTYPES)


def paged_attention_native(
    q_bhd: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    layer: jax.Array,
    page_table_bp: jax.Array,
    lengths_b: jax.Array,
    sliding_window: int = 0,
    softcap: float = 0.0,
) -> jax.Array:
    """Same contract as ``paged_attention_reference``, on the CPU. Where the kernel is not
    ``available()`` (it is built and registered by the first call that asks), and for dtypes
    other than float32 and bfloat16, the blocked kernel runs instead."""
    dtypes_ok = supports(q_bhd.dtype) and supports(k_pool.dtype) and k_pool.dtype == v_pool.dtype
    if not (dtypes_ok and available()):
        return paged_attention_blocked(
            q_bhd, k_pool, v_pool, layer, page_table_bp, lengths_b, sliding_window, softcap=softcap
        )
    out = jax.ShapeDtypeStruct(q_bhd.shape, q_bhd.dtype)
    call = jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")
    return call(
        q_bhd,
        k_pool,
        v_pool,
        jnp.asarray(layer, jnp.int32).reshape(()),
        page_table_bp.astype(jnp.int32),
        lengths_b.astype(jnp.int32),
        sliding_window=np.int64(sliding_window),
        softcap=np.float32(softcap),
    )
