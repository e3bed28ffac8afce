"""The packed-panel weight layout and its few-row products.

A decode step multiplies a few token rows by every weight of the model, so on a CPU its time is
the weights' read. ``to_panels`` packs a (K, N) weight as N / 16 panels of shape (K, 16), each
one contiguous run, which the ``few_row_matmul`` kernel (jrlhf.native.matmul on CPU) streams
once, front to back; ``panel_matmuls`` multiplies several weights that read the same rows in one
call. Where no such kernel is usable the same products run in XLA.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jrlhf import kernels

LANES = 16  # output columns per panel


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
    one kernel call where the backend has one: the projections that read the same rows (a
    layer's query, key and value) share one hand-off to the threads and one stream of panels."""
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
    kernel = kernels.usable("few_row_matmul")
    if kernel is not None:
        outs = kernel.fn(rows, weights, widths)
    else:
        outs = [
            jnp.einsum("mk,pkj->mpj", rows, panels).reshape(rows.shape[0], n)
            for panels, n in zip(weights, widths)
        ]
    return tuple(out.reshape(*lead, n) for out, n in zip(outs, widths))
