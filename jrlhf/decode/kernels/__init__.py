"""Paged decode attention kernels: a pure-JAX reference, a pure-JAX blocked kernel that reads only
the pages in use, the ``paged_attention`` kernel jrlhf.kernels registers for the backend
(``native_cpu``: jrlhf.native's C++ kernel for XLA:CPU, compiled on first use) and a Pallas GPU
kernel.

``select_kernel("auto")`` picks the Pallas kernel when JAX's default backend is a GPU, the native
kernel on a CPU where it builds, and the blocked kernel otherwise (TPU; a CPU without a compiler).
Soft-capped attention scores (Gemma 2) all but the Pallas kernel compute (``SOFTCAP_KERNELS``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax

from jrlhf import kernels
from jrlhf.decode.kernels.blocked import paged_attention_blocked
from jrlhf.decode.kernels.reference import paged_attention_reference

KERNELS = ("auto", "reference", "blocked", "native_cpu", "pallas", "pallas_interpret")
# The kernels that soft-cap attention scores (their ``softcap`` argument); the Pallas kernel has
# no such step.
SOFTCAP_KERNELS = ("reference", "blocked", "native_cpu")


def select_kernel(
    name: str = "auto",
    page_size: int | None = None,
    head_dim: int | None = None,
    softcap: float = 0.0,
) -> tuple[str, Callable]:
    """(resolved name, fn) with fn(q_bhd, k_pool, v_pool, layer, page_table, lengths, window),
    the model's attention ``softcap`` (0: none) bound into fn.

    Given the engine's ``page_size`` and the model's ``head_dim``, ``"auto"`` takes the blocked
    kernel on a GPU too where the Pallas one cannot tile them (not powers of two), and
    ``"pallas"`` refuses them here, before any compilation. With a ``softcap`` ``"auto"`` takes
    the blocked kernel where it would take the Pallas one (only ``SOFTCAP_KERNELS`` compute it),
    and naming the Pallas one is refused in one line."""
    if name not in KERNELS:
        raise ValueError(f"unknown paged-attention kernel {name!r} (use one of {KERNELS})")
    if softcap and name not in ("auto", *SOFTCAP_KERNELS):
        raise ValueError(
            f"paged-attention kernel {name!r} cannot soft-cap attention scores (the model's "
            f"attn_logit_softcap {softcap}): use 'auto' or one of {SOFTCAP_KERNELS}"
        )
    backend = jax.default_backend()
    if name == "auto":
        name = {"gpu": "pallas", "cpu": "native_cpu"}.get(backend, "blocked")
        if name == "pallas" and softcap:
            # The Pallas kernel has no soft-capping step (Gemma 2): the blocked kernel, the next
            # fastest on a GPU (it reads only the pages in use), computes the model's attention.
            name = "blocked"
        if name == "pallas" and not all(tileable(n) for n in (page_size, head_dim) if n):
            name = "blocked"
        if name == "native_cpu" and kernels.usable("paged_attention") is None:
            name = "blocked"

    def bind(fn: Callable) -> Callable:
        return functools.partial(fn, softcap=softcap) if softcap else fn

    if name == "reference":
        return name, bind(paged_attention_reference)
    if name == "blocked":
        return name, bind(paged_attention_blocked)
    if name == "native_cpu":
        if backend != "cpu":
            raise ValueError(f"paged-attention kernel 'native_cpu' runs on CPU, not {backend}")
        kernel = kernels.usable("paged_attention")
        if kernel is None:
            why = kernels.why_unusable("paged_attention")
            raise ValueError(f"paged-attention kernel 'native_cpu': {why}")
        return name, bind(kernel.fn)
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
    "SOFTCAP_KERNELS",
    "paged_attention_blocked",
    "paged_attention_reference",
    "select_kernel",
    "tileable",
]
