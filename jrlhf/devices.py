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
from collections.abc import Mapping

HOST_DEVICE_FLAG = "--xla_force_host_platform_device_count"
# The most virtual CPU devices an entry point asks XLA for. Each one costs the process memory and
# threads before any work (measured with jax 0.10.2 on the 2-core CPU machine: 1,024 devices
# started in 1.5 s and 0.34 GB, 4,096 in 3.1 s and 0.65 GB; 100,000 grew past 6 GB in 98 s and
# died of SIGSEGV under a memory limit, silently). Fake devices test sharding logic, and 4,096
# covers the meshes of any real job this code plans for on one host's cores without that cost.
MAX_HOST_DEVICES = 4096
# The flag with its value, as XLA accepts it (``--flag=N``; a space before the value is not read).
_FLAG_RE = re.compile(r"\s*--xla_force_host_platform_device_count(=\S*)?")


def with_host_device_count(flags: str, count: int) -> str:
    """``flags`` (an XLA_FLAGS value) with the virtual CPU device count set to ``count``.

    Replaces a count already in ``flags``: the launcher uses this to give each process exactly the
    count it was asked for, whatever the caller's environment held.
    """
    if not 1 <= count <= MAX_HOST_DEVICES:
        raise ValueError(f"host device count must be in 1..{MAX_HOST_DEVICES}, got {count}")
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
# The same settings as glibc tunables (read by glibc at a process's start), for child processes.
# mallopt's -1 trim threshold is SIZE_MAX as a tunable.
_TUNABLES_ENV = "GLIBC_TUNABLES"
KEPT_TUNABLES = (
    ("glibc.malloc.arena_max", "1"),
    ("glibc.malloc.mmap_max", "0"),
    ("glibc.malloc.trim_threshold", str(2**64 - 1)),
)
_inherited_tunables = ""  # the user's GLIBC_TUNABLES, before keep_host_memory exported its own


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
    ``JRLHF_KEEP_HOST_MEMORY=0`` opts out. Calling it again does nothing.

    Call it before any other thread starts: a thread that has allocated before keeps an arena
    of its own, and XLA's threads created later share the arenas round-robin, so some of them
    would still get fresh pages (importing JAX starts a thread; so does a test runner's worker).
    ``jrlhf.cli`` calls it on import, before any entry point imports JAX. The same settings are
    exported as ``GLIBC_TUNABLES`` for the processes this one starts (test workers, trainer
    subprocesses, the launcher's processes), which glibc then applies before their first
    thread; :func:`allocator_defaults` gives an environment without them (the benchmarks' peers
    keep glibc's defaults).
    """
    global _kept, _inherited_tunables
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
        if _kept:
            found = os.environ.get(_TUNABLES_ENV, "")
            # what a parent that kept its memory exported is not the user's own setting
            ours = {f"{name}={v}" for name, v in KEPT_TUNABLES}
            _inherited_tunables = ":".join(i for i in found.split(":") if i and i not in ours)
            os.environ[_TUNABLES_ENV] = _with_tunables(found)
    return _kept


def _with_tunables(value: str) -> str:
    """A GLIBC_TUNABLES value with :data:`KEPT_TUNABLES` set (replacing the same names)."""
    ours = dict(KEPT_TUNABLES)
    rest = [item for item in value.split(":") if item and item.split("=")[0] not in ours]
    return ":".join(rest + [f"{name}={v}" for name, v in KEPT_TUNABLES])


def allocator_defaults(environ: Mapping[str, str]) -> dict[str, str]:
    """A copy of ``environ`` for a child process that keeps glibc's allocator as it is: with
    ``GLIBC_TUNABLES`` as it was before :func:`keep_host_memory` exported its settings."""
    env = dict(environ)
    if _kept:
        env.pop(_TUNABLES_ENV, None)
        if _inherited_tunables:
            env[_TUNABLES_ENV] = _inherited_tunables
    return env


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
