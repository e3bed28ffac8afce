"""Host-device setup for command-line entry points.

On a machine without an accelerator, the entry points ask XLA for several virtual CPU devices so
that meshes, shardings and mesh switches are real. This must happen before JAX initializes its
backends, so call ``ensure_host_devices`` before the first JAX computation. This module is the one
place that writes XLA's device-count flag: the entry points (directly or through
``jrlhf.runtime.distributed``) and the multi-process launcher (``jrlhf.cli.launch``) all use it.

It is also where the process's C allocator is set up for XLA:CPU (:func:`keep_host_memory`),
which must likewise happen before the backend starts its threads.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import os
import platform
import re

HOST_DEVICE_FLAG = "--xla_force_host_platform_device_count"
# The flag with its value, as XLA accepts it (``--flag=N``; a space before the value is not read).
_FLAG_RE = re.compile(r"\s*--xla_force_host_platform_device_count(=\S*)?")


def with_host_device_count(flags: str, count: int) -> str:
    """``flags`` (an XLA_FLAGS value) with the virtual CPU device count set to ``count``.

    Replaces a count already in ``flags``: the launcher uses this to give each process exactly the
    count it was asked for, whatever the caller's environment held.
    """
    if count < 1:
        raise ValueError(f"host device count must be >= 1, got {count}")
    rest = _FLAG_RE.sub("", flags).strip()
    return f"{rest} {HOST_DEVICE_FLAG}={count}".strip()


def ensure_host_devices(count: int = 8) -> None:
    """Request ``count`` virtual CPU devices unless the user already chose a device setup (and
    set up the allocator for them: :func:`keep_host_memory`)."""
    keep_host_memory()
    flags = os.environ.get("XLA_FLAGS", "")
    if HOST_DEVICE_FLAG.lstrip("-") in flags:
        return
    os.environ["XLA_FLAGS"] = with_host_device_count(flags, count)


# Opt-out of keep_host_memory: "0" leaves the C allocator as it is, "1" (the default) sets it up.
KEEP_HOST_MEMORY_ENV = "JRLHF_KEEP_HOST_MEMORY"
# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
_kept: bool | None = None


def keep_host_memory() -> bool:
    """On a CPU-only JAX, make glibc keep and reuse the memory XLA frees; True when set up.

    XLA:CPU allocates each execution's temporaries (one buffer per program, all its
    intermediates) with ``posix_memalign`` from its worker threads. glibc serves a thread other
    than the main one from an arena of its own, whose heaps hold at most 64 MB, so a larger
    request gets a fresh ``mmap`` that ``free`` unmaps again: every page of it faults on first
    touch, at every call. The train step of ``python -m jrlhf.bench rl``'s GRPO trainer has a
    298 MB temporary: 78,000 minor page faults an iteration, and about 0.2 s of its 0.55-0.6 s
    train phase on the 2-core CPU machine (first touch of fresh memory ran at ~1 GB/s there,
    reuse at ~19 GB/s). So before the backend starts its threads: one arena for all threads,
    never ``mmap`` (the heap grows instead) and never give freed memory back to the system (a
    process keeps its peak, as torch's caching allocator does). Then the temporaries reuse the
    same pages call after call.

    Only with glibc, and only when no accelerator can be JAX's backend (``JAX_PLATFORMS`` is
    ``cpu``, or no accelerator plugin is installed): there the temporaries live in device
    memory, and one arena would serialize the host threads' allocations for nothing.
    ``JRLHF_KEEP_HOST_MEMORY=0`` opts out. Call it before JAX's backends start (threads that
    already have an arena keep it); calling it again does nothing.
    """
    global _kept
    if _kept is not None:
        return _kept
    choice = os.environ.get(KEEP_HOST_MEMORY_ENV) or "1"
    if choice not in ("0", "1"):
        raise ValueError(f"{KEEP_HOST_MEMORY_ENV}={choice!r}: expected 0 or 1")
    _kept = False
    if choice == "1" and platform.libc_ver()[0] == "glibc" and _cpu_backend_only():
        mallopt = ctypes.CDLL(None).mallopt  # the process's own C library
        # A trim threshold of -1 never trims (mallopt(3)); any finite one (at most 2 GB, an int)
        # is crossed once a process has peaked higher: the free top of the heap is then given
        # back after every call and the next call faults it in again.
        settings = ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, -1))
        _kept = all(mallopt(param, value) == 1 for param, value in settings)
    return _kept


def _cpu_backend_only() -> bool:
    """Whether JAX's backend will be its CPU one, without starting it."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms:
        return {p.strip() for p in platforms.split(",")} == {"cpu"}
    # JAX finds GPU plugins by this entry-point group, and TPUs through libtpu.
    return (
        not importlib.metadata.entry_points(group="jax_plugins")
        and importlib.util.find_spec("jax_plugins") is None
        and importlib.util.find_spec("libtpu") is None
    )
