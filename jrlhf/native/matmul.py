"""Few-row matmuls over packed weight panels on XLA:CPU (``panel_matmul.cc``, through the FFI).

A decode step multiplies a few token rows by every weight of the model, so on a CPU its time is
the weights' read. ``to_panels`` packs a (K, N) weight as N / 16 panels of shape (K, 16), each
one contiguous run; ``panel_matmul`` streams them once, front to back, on XLA's intra-op
threads, each thread prefetching the next block of panels while it multiplies one;
``panel_matmuls`` multiplies several weights that read the same rows in one call. At 16 rows of
the bench model's MLP shape (16 x 512 x 1408) it took 141 us a product against XLA's 316 us,
with the weights streamed from memory as in a decode step (docs/performance.md). The
kernel's register blocking is written for AVX-512 (``fast_here``); it builds and is correct
elsewhere too.

The kernel is built on first use by ``jrlhf.native.build``. Where it cannot be (no compiler),
``available()`` is False and says why once in a warning; ``panel_matmul`` then computes the same
product in XLA, and the decode engine does not choose the panel layout by itself
(``EngineConfig.weight_layout``).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp

from jrlhf.native import build as native_build

SOURCE = Path(__file__).with_name("panel_matmul.cc")
TARGET = "jrlhf_panel_matmul_cpu"
SYMBOL = "JrlhfPanelMatmul"
LANES = 16  # output columns per panel


@functools.cache
def _registered() -> str | None:
    reason = native_build.register(SOURCE, SYMBOL, TARGET)
    if reason is not None:
        warnings.warn(f"native CPU panel matmul unavailable: {reason}", stacklevel=3)
    return reason


def available() -> bool:
    """Whether the kernel is built and registered in this process (built if need be)."""
    return _registered() is None


def unavailable_reason() -> str | None:
    """Why ``available()`` is False, or None."""
    return _registered()


@functools.cache
def fast_here() -> bool:
    """Whether this host has the AVX-512 registers the kernel's blocking is written for."""
    return "avx512f" in native_build.cpu_features().split()


def fits(n: int) -> bool:
    """Whether a weight with ``n`` output columns packs into whole panels."""
    return n > 0 and n % LANES == 0


def to_panels(w_kn: jax.Array) -> jax.Array:
    """A (K, N) weight as (N / 16, K, 16) panels: ``panels[p, k, j] = w[k, 16 p + j]``."""
    k, n = w_kn.shape
    if not fits(n):
        raise ValueError(f"a weight of {n} output columns does not pack into panels of {LANES}")
    return jnp.transpose(w_kn.reshape(k, n // LANES, LANES), (1, 0, 2))


def from_panels(panels: jax.Array) -> jax.Array:
    """The (K, N) weight ``to_panels`` packed."""
    p, k, lanes = panels.shape
    return jnp.transpose(panels, (1, 0, 2)).reshape(k, p * lanes)


def panel_matmul(x: jax.Array, panels: jax.Array) -> jax.Array:
    """``x @ w`` for float32 ``x`` (..., K) and ``w`` packed by ``to_panels``: (..., N)."""
    return panel_matmuls(x, (panels,))[0]


def panel_matmuls(x: jax.Array, weights: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
    """``x @ w`` for each ``w`` of ``weights`` (packed by ``to_panels``, all of ``x``'s K), in
    one kernel call: the projections that read the same rows (a layer's query, key and value)
    share one hand-off to the threads and one stream of panels."""
    if not weights:
        raise ValueError("panel matmuls of no weights")
    k = x.shape[-1]
    for panels in weights:
        if panels.ndim != 3 or panels.shape[1] != k or panels.shape[2] != LANES:
            raise ValueError(f"panel matmul of x {x.shape} with panels {panels.shape}")
    lead = x.shape[:-1]
    rows = x.reshape(-1, k).astype(jnp.float32)
    weights = [panels.astype(jnp.float32) for panels in weights]
    widths = [panels.shape[0] * LANES for panels in weights]
    if jax.default_backend() == "cpu" and available():
        shapes = [jax.ShapeDtypeStruct((rows.shape[0], n), rows.dtype) for n in widths]
        outs = jax.ffi.ffi_call(TARGET, shapes)(rows, *weights)
    else:
        outs = [
            jnp.einsum("mk,pkj->mpj", rows, panels).reshape(rows.shape[0], n)
            for panels, n in zip(weights, widths)
        ]
    return tuple(out.reshape(*lead, n) for out, n in zip(outs, widths))
