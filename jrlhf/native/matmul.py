"""Few-row matmuls over packed weight panels on XLA:CPU (``panel_matmul.cc``, through the FFI):
the ``few_row_matmul`` kernel of jrlhf.kernels (the layout: jrlhf.kernels.panels).

``panel_matmul.cc`` streams a product's panels once, front to back, on XLA's intra-op threads,
each thread prefetching the next block of panels while it multiplies one, several weights that
read the same rows in one call. At 16 rows of the bench model's MLP shape (16 x 512 x 1408) it
took 141 us a product against XLA's 316 us, with the weights streamed from memory as in a decode
step (docs/performance.md). The kernel's register blocking is written for AVX-512
(``fast_here``); it builds and is correct elsewhere too.

The kernel is built on first use by ``jrlhf.native.build``. Where it cannot be (no compiler),
``available()`` is False and says why once in a warning; the products then run in XLA, and the
decode engine does not choose the panel layout by itself (``EngineConfig.weight_layout``).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence
from pathlib import Path

import jax

from jrlhf.native import build as native_build

SOURCE = Path(__file__).with_name("panel_matmul.cc")
TARGET = "jrlhf_panel_matmul_cpu"
SYMBOL = "JrlhfPanelMatmul"


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


def few_row_matmuls(
    rows: jax.Array, weights: Sequence[jax.Array], widths: Sequence[int]
) -> list[jax.Array]:
    """``rows`` (M, K) float32 times each packed float32 weight of ``weights`` (widths[i]
    output columns): one custom call."""
    if not available():
        raise RuntimeError(f"native CPU panel matmul unavailable: {unavailable_reason()}")
    shapes = [jax.ShapeDtypeStruct((rows.shape[0], n), rows.dtype) for n in widths]
    return list(jax.ffi.ffi_call(TARGET, shapes)(rows, *weights))
