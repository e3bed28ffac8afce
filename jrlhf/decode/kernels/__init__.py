"""Paged decode attention kernels: a pure-JAX reference, a pure-JAX blocked kernel that reads only
the pages in use, and a Pallas GPU kernel.

``select_kernel("auto")`` picks the Pallas kernel when JAX's default backend is a GPU and the
blocked kernel otherwise (CPU, TPU).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax

from jrlhf.decode.kernels.blocked import paged_attention_blocked
from jrlhf.decode.kernels.reference import paged_attention_reference

KERNELS = ("auto", "reference", "blocked", "pallas", "pallas_interpret")


def select_kernel(
    name: str = "auto", page_size: int | None = None, head_dim: int | None = None
) -> tuple[str, Callable]:
    """(resolved name, fn) with fn(q_bhd, k_pool, v_pool, layer, page_table, lengths, window).

    Given the engine's ``page_size`` and the model's ``head_dim``, ``"auto"`` takes the blocked
    kernel on a GPU too where the Pallas one cannot tile them (not powers of two), and
    ``"pallas"`` refuses them here, before any compilation."""
    if name not in KERNELS:
        raise ValueError(f"unknown paged-attention kernel {name!r} (use one of {KERNELS})")
    if name == "auto":
        name = "pallas" if jax.default_backend() == "gpu" else "blocked"
        if name == "pallas" and not all(tileable(n) for n in (page_size, head_dim) if n):
            name = "blocked"
    if name == "reference":
        return name, paged_attention_reference
    if name == "blocked":
        return name, paged_attention_blocked
    # Pallas and its Triton lowering load only when a Pallas kernel is chosen.
    from jrlhf.decode.kernels.pallas_gpu import (  # noqa: PLC0415
        check_shapes,
        paged_attention_pallas,
    )

    if name == "pallas" and page_size is not None:
        check_shapes(page_size, head_dim)
    return name, functools.partial(paged_attention_pallas, interpret=name == "pallas_interpret")


def tileable(n: int) -> bool:
    """Whether ``n`` can be a Triton block dimension of the Pallas kernel: a power of two."""
    return n >= 1 and not n & (n - 1)


__all__ = [
    "KERNELS",
    "paged_attention_blocked",
    "paged_attention_reference",
    "select_kernel",
    "tileable",
]
