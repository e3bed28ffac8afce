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


def select_kernel(name: str = "auto") -> tuple[str, Callable]:
    """(resolved name, fn) with fn(q_bhd, k_pool, v_pool, layer, page_table, lengths, window)."""
    if name not in KERNELS:
        raise ValueError(f"unknown paged-attention kernel {name!r} (use one of {KERNELS})")
    if name == "auto":
        name = "pallas" if jax.default_backend() == "gpu" else "blocked"
    if name == "reference":
        return name, paged_attention_reference
    if name == "blocked":
        return name, paged_attention_blocked
    # Pallas and its Triton lowering load only when a Pallas kernel is chosen.
    from jrlhf.decode.kernels.pallas_gpu import paged_attention_pallas  # noqa: PLC0415

    return name, functools.partial(paged_attention_pallas, interpret=name == "pallas_interpret")


__all__ = ["KERNELS", "paged_attention_blocked", "paged_attention_reference", "select_kernel"]
