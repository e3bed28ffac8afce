"""Paged decode attention compiled for the host CPU, called from XLA:CPU through the XLA FFI.

The kernel (``paged_attention_cpu.cc`` beside this file) has the contract of
``paged_attention_reference``. Each sequence's pages are read in place, in position order, once for
the scores and once for the values, with the sequences shared out over XLA's intra-op threads: no
page is copied, where the pure-JAX kernels gather (and transpose) every page they read. On the
bench model's decode shape (8 layers, 16 sequences, 4 KV heads of 64, context 128) one step's
attention took 1.26 ms against the blocked kernel's 4.8 ms (BUILD.md, "Benchmarks").

It is built on first use with the system's C++ compiler (``$CXX``, else ``c++``, ``g++`` or
``clang++``) against the FFI headers jaxlib ships, for the host's own instruction set
(``-march=native``), and cached by a key of everything the binary depends on (the source, the
compiler's version, jaxlib's version, the CPU's feature flags), so each machine compiles it once
(about 2 s). The cache is ``$JRLHF_CACHE_DIR/kernels``, else ``$XDG_CACHE_HOME/jrlhf/kernels``,
else ``~/.cache/jrlhf/kernels``; concurrent processes each write a private file and rename it into
place, so none ever loads a partial one. Without a compiler (or if the build fails) ``available()``
is False, says why once in a warning, and ``select_kernel("auto")`` keeps the blocked kernel.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from jrlhf.decode.kernels.blocked import paged_attention_blocked

SOURCE = Path(__file__).with_name("paged_attention_cpu.cc")
TARGET = "jrlhf_paged_attention_cpu"
SYMBOL = "JrlhfPagedAttention"
DTYPES = (jnp.float32, jnp.bfloat16)  # of the queries and of the pools; others go blocked
_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-w")


class BuildError(RuntimeError):
    """The native kernel could not be compiled or loaded here (the message says why)."""


def cache_dir() -> Path:
    """Where compiled kernels are kept (see the module docstring)."""
    if os.environ.get("JRLHF_CACHE_DIR"):
        return Path(os.environ["JRLHF_CACHE_DIR"]) / "kernels"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "jrlhf" / "kernels"


def _compiler() -> str:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    raise BuildError("no C++ compiler found ($CXX, c++, g++ or clang++)")


def _cpu_features() -> str:
    """The CPU's feature flags (what -march=native compiles for), as /proc/cpuinfo lists them."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _arch_flags(compiler: str) -> tuple[str, ...]:
    probe = subprocess.run(
        [compiler, "-march=native", "-x", "c++", "-E", "-", "-o", os.devnull],
        input=b"",
        capture_output=True,
        check=False,
    )
    return ("-march=native",) if probe.returncode == 0 else ()


def build() -> Path:
    """The compiled kernel's path, compiling it into the cache first if needed; raises
    ``BuildError`` in one line when it cannot be built."""
    compiler = _compiler()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False)
    flags = (*_FLAGS, *_arch_flags(compiler))
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), version.stdout, " ".join(flags), jaxlib.__version__):
        key.update(part if isinstance(part, bytes) else part.encode())
    key.update(_cpu_features().encode())
    directory = cache_dir()
    path = directory / f"paged_attention_cpu-{key.hexdigest()[:20]}.so"
    if path.exists():
        return path
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, scratch = tempfile.mkstemp(suffix=".so", dir=directory)
        os.close(fd)
    except OSError as err:
        raise BuildError(f"kernel cache {directory} is not writable ({err})") from None
    command = [compiler, *flags, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", scratch]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        os.unlink(scratch)
        first = next((ln for ln in result.stderr.splitlines() if "error" in ln), result.stderr)
        raise BuildError(f"{Path(compiler).name} failed on {SOURCE.name}: {first.strip()[:300]}")
    os.replace(scratch, path)  # atomic: a concurrent build of the same key writes the same bytes
    return path


@functools.cache
def _registered() -> str | None:
    """Builds, loads and registers the kernel once per process: None when that worked, else why
    not (also said once in a warning)."""
    try:
        library = ctypes.cdll.LoadLibrary(str(build()))
        handler = jax.ffi.pycapsule(getattr(library, SYMBOL))
        jax.ffi.register_ffi_target(TARGET, handler, platform="cpu")
    except (BuildError, OSError, AttributeError) as err:
        warnings.warn(
            f"native CPU paged attention unavailable, using the blocked kernel: {err}", stacklevel=3
        )
        return str(err)
    return None


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
) -> jax.Array:
    """Same contract as ``paged_attention_reference``, on the CPU. Where the kernel is not
    ``available()`` (it is built and registered by the first call that asks), and for dtypes
    other than float32 and bfloat16, the blocked kernel runs instead."""
    dtypes_ok = supports(q_bhd.dtype) and supports(k_pool.dtype) and k_pool.dtype == v_pool.dtype
    if not (dtypes_ok and available()):
        return paged_attention_blocked(
            q_bhd, k_pool, v_pool, layer, page_table_bp, lengths_b, sliding_window
        )
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q_bhd.shape, q_bhd.dtype))
    return call(
        q_bhd,
        k_pool,
        v_pool,
        jnp.asarray(layer, jnp.int32).reshape(()),
        page_table_bp.astype(jnp.int32),
        lengths_b.astype(jnp.int32),
        sliding_window=np.int64(sliding_window),
    )
