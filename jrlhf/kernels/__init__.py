"""Hand-written kernels, chosen by JAX backend: the one place models/ and decode/ ask for them.

An operation of ``OPS`` may have a kernel registered for a backend ("cpu", "gpu", "tpu"). A
package that provides kernels registers them when it is imported, and the registry imports a
backend's providers (``PROVIDERS``) the first time a kernel is looked up on that backend. So the
CPU kernels (jrlhf.native: C++ built on first use for XLA:CPU) are imported and compiled only by
a process whose JAX backend is the CPU; on a GPU or TPU nothing of them loads. Callers keep their
XLA form wherever :func:`usable` gives None (no kernel for the backend, or it could not be built
here: no compiler).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping

import jax

# The operations and the signature of each one's ``fn``.
OPS = {
    "masked_attention": "fn(q_bthd, k_bskd, v_bskd, mask_bts, mask_value), with its backward",
    "few_row_matmul": "fn(rows_mk, panels, widths) -> outputs: a few rows times packed panels",
    "token_pick": "fn(logits_bv, noise_bv | None, temperature) -> (tokens, sampling lp, raw lp)",
    "paged_attention": "fn(q_bhd, k_pool, v_pool, layer, page_table, lengths, window, softcap=)",
}
# The modules that register a backend's kernels, imported on that backend's first lookup.
PROVIDERS = {"cpu": ("jrlhf.native",)}


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One operation's kernel on one backend.

    ``available()``: whether it is built and registered in this process (built if need be);
    ``unavailable_reason()``: why not, or None. ``queries``: the operation's own questions
    (few_row_matmul: ``fast_here()``; paged_attention: ``supports(dtype)``).
    """

    op: str
    fn: Callable
    available: Callable[[], bool]
    unavailable_reason: Callable[[], str | None]
    queries: Mapping[str, Callable] = dataclasses.field(default_factory=dict)


_REGISTRY: dict[tuple[str, str], Kernel] = {}
_LOADED: set[str] = set()


def register(backend: str, kernel: Kernel) -> None:
    """Make ``kernel`` the one for its operation on ``backend`` (a provider's import does this)."""
    if kernel.op not in OPS:
        raise ValueError(f"kernel for unknown operation {kernel.op!r} (one of {tuple(OPS)})")
    _REGISTRY[(kernel.op, backend)] = kernel


def _load(backend: str) -> None:
    if backend in _LOADED:
        return
    _LOADED.add(backend)
    for module in PROVIDERS.get(backend, ()):
        importlib.import_module(module)


def lookup(op: str, backend: str | None = None) -> Kernel | None:
    """The kernel registered for ``op`` on ``backend`` (default: JAX's default backend), or
    None; built or not."""
    if op not in OPS:
        raise ValueError(f"unknown kernel operation {op!r} (one of {tuple(OPS)})")
    backend = backend or jax.default_backend()
    _load(backend)
    return _REGISTRY.get((op, backend))


def usable(op: str, backend: str | None = None) -> Kernel | None:
    """:func:`lookup`'s kernel where it is built and registered in this process, else None."""
    kernel = lookup(op, backend)
    return kernel if kernel is not None and kernel.available() else None


def why_unusable(op: str, backend: str | None = None) -> str | None:
    """Why :func:`usable` gives None for ``op`` (None when it gives a kernel)."""
    backend = backend or jax.default_backend()
    kernel = lookup(op, backend)
    if kernel is None:
        return f"has no kernel on {backend}"
    return kernel.unavailable_reason()
