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
import shlex
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
COMPILE_TIMEOUT_S = 300


class BuildError(RuntimeError):
    """The native kernel could not be compiled or loaded here (the message says why)."""


def cache_dir() -> Path:
    """Where compiled kernels are kept (see the module docstring)."""
    if os.environ.get("JRLHF_CACHE_DIR"):
        return Path(os.environ["JRLHF_CACHE_DIR"]) / "kernels"
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "jrlhf" / "kernels"
    try:
        return Path.home() / ".cache" / "jrlhf" / "kernels"
    except RuntimeError:  # no home directory (a container's uid without a passwd entry)
        return Path(tempfile.gettempdir()) / f"jrlhf-{os.getuid()}" / "kernels"


def _compiler() -> list[str]:
    """The compiler's command: ``$CXX`` (which may carry arguments, e.g. ``ccache g++``), else
    the first of ``c++``, ``g++``, ``clang++`` on the PATH."""
    for command in (os.environ.get("CXX", ""), "c++", "g++", "clang++"):
        words = shlex.split(command)
        if words and shutil.which(words[0]):
            return [shutil.which(words[0]), *words[1:]]
    raise BuildError("no C++ compiler found ($CXX, c++, g++ or clang++)")


def _cpu_features() -> str:
    """The CPU's feature flags (what -march=native compiles for), as /proc/cpuinfo lists them."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}"


def _run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(
            command, capture_output=True, check=False, timeout=COMPILE_TIMEOUT_S, **kwargs
        )
    except subprocess.TimeoutExpired:
        raise BuildError(f"{Path(command[0]).name} ran past {COMPILE_TIMEOUT_S} s") from None
    except OSError as err:
        raise BuildError(f"{Path(command[0]).name} could not run ({err})") from None


def _arch_flags(compiler: list[str]) -> tuple[str, ...]:
    probe = _run([*compiler, "-march=native", "-x", "c++", "-E", "-", "-o", os.devnull], input=b"")
    return ("-march=native",) if probe.returncode == 0 else ()


def _failure(compiler: list[str], result: subprocess.CompletedProcess) -> BuildError:
    """One line: the compiler, its exit status and its first error line (else its first line)."""
    lines = [ln.strip() for ln in result.stderr.decode(errors="replace").splitlines()]
    lines = [ln for ln in lines if ln]
    cause = next((ln for ln in lines if "error" in ln.lower()), lines[0] if lines else "no output")
    name = Path(compiler[0]).name
    return BuildError(f"{name} failed on {SOURCE.name} (exit {result.returncode}): {cause[:300]}")


def build(rebuild: bool = False) -> Path:
    """The compiled kernel's path, compiling it into the cache first if needed (or if
    ``rebuild``); raises ``BuildError`` in one line when it cannot be built."""
    compiler = _compiler()
    version = _run([*compiler, "--version"]).stdout
    flags = (*_FLAGS, *_arch_flags(compiler))
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), version, " ".join(compiler[1:] + list(flags))):
        key.update(part if isinstance(part, bytes) else part.encode())
    key.update(f"{jaxlib.__version__} {_cpu_features()}".encode())
    directory = cache_dir()
    path = directory / f"paged_attention_cpu-{key.hexdigest()[:20]}.so"
    if path.exists() and not rebuild:
        return path
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, scratch = tempfile.mkstemp(suffix=".so", dir=directory)
        os.close(fd)
    except OSError as err:
        raise BuildError(f"kernel cache {directory} cannot be written ({err})") from None
    try:
        command = [*compiler, *flags, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", scratch]
        result = _run(command)
        if result.returncode != 0:
            raise _failure(compiler, result)
        # mkstemp's file is private to its owner: a cache shared by several users needs the
        # library readable by all of them, as the umask allows
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(scratch, 0o755 & ~umask)
        os.replace(scratch, path)  # atomic: a concurrent build of the same key writes the same
    finally:
        if os.path.exists(scratch):
            os.unlink(scratch)
    return path


@functools.cache
def _registered() -> str | None:
    """Builds, loads and registers the kernel once per process: None when that worked, else why
    not (also said once in a warning). A cached library that does not load (truncated by a full
    disk, say) is compiled again once."""
    try:
        try:
            library = ctypes.cdll.LoadLibrary(str(build()))
        except OSError:
            library = ctypes.cdll.LoadLibrary(str(build(rebuild=True)))
        handler = jax.ffi.pycapsule(getattr(library, SYMBOL))
        jax.ffi.register_ffi_target(TARGET, handler, platform="cpu")
    except (BuildError, OSError, AttributeError) as err:
        reason = " ".join(str(err).split())
        warnings.warn(
            f"native CPU paged attention unavailable, using the blocked kernel: {reason}",
            stacklevel=3,
        )
        return reason
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
    out = jax.ShapeDtypeStruct(q_bhd.shape, q_bhd.dtype)
    call = jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")
    return call(
        q_bhd,
        k_pool,
        v_pool,
        jnp.asarray(layer, jnp.int32).reshape(()),
        page_table_bp.astype(jnp.int32),
        lengths_b.astype(jnp.int32),
        sliding_window=np.int64(sliding_window),
    )
