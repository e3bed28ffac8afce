"""Compiling, caching and registering the native CPU kernels (see ``jrlhf.native``).

A kernel is one C++ source file in this directory, written against the FFI headers jaxlib ships
and the headers beside it. ``build(source)``
compiles it with the system's C++ compiler (``$CXX``, else ``c++``, ``g++`` or ``clang++``) for
the host's own instruction set (``-march=native``) and caches the library by a key of everything
the binary depends on (the source and the headers beside it, the compiler's version and flags,
jaxlib's version, the CPU's feature flags), so each machine compiles each kernel once (a few
seconds). The cache is
``$JRLHF_CACHE_DIR/kernels``, else ``$XDG_CACHE_HOME/jrlhf/kernels``, else
``~/.cache/jrlhf/kernels``; concurrent processes each write a private file and rename it into
place, so none ever loads a partial one. ``register(source, symbol, target)`` builds, loads and
registers a handler once per process and says in one line why not when it cannot.
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
from pathlib import Path

import jax
import jaxlib

_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-w")
NATIVE_DIR = Path(__file__).parent  # the kernels' sources and the headers they share
COMPILE_TIMEOUT_S = 300


class BuildError(RuntimeError):
    """A native kernel could not be compiled or loaded here (the message says why)."""


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


def compiler() -> list[str]:
    """The compiler's command: ``$CXX`` (which may carry arguments, e.g. ``ccache g++``), else
    the first of ``c++``, ``g++``, ``clang++`` on the PATH."""
    for command in (os.environ.get("CXX", ""), "c++", "g++", "clang++"):
        words = shlex.split(command)
        if words and shutil.which(words[0]):
            return [shutil.which(words[0]), *words[1:]]
    raise BuildError("no C++ compiler found ($CXX, c++, g++ or clang++)")


def cpu_features() -> str:
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


def _arch_flags(command: list[str]) -> tuple[str, ...]:
    """-march=native where the compiler takes it; on AVX-512 hosts also full-width vectors for
    the loops the compiler vectorizes by itself (GCC prefers 256-bit ones on many Intel CPUs)."""
    flags = ["-march=native"]
    if "avx512f" in cpu_features().split():
        flags.append("-mprefer-vector-width=512")
    while flags:
        probe = _run([*command, *flags, "-x", "c++", "-E", "-", "-o", os.devnull], input=b"")
        if probe.returncode == 0:
            return tuple(flags)
        flags.pop()
    return ()


def _failure(command: list[str], source: Path, result: subprocess.CompletedProcess) -> BuildError:
    """One line: the compiler, its exit status and its first error line (else its first line)."""
    lines = [ln.strip() for ln in result.stderr.decode(errors="replace").splitlines()]
    lines = [ln for ln in lines if ln]
    cause = next((ln for ln in lines if "error" in ln.lower()), lines[0] if lines else "no output")
    name = Path(command[0]).name
    return BuildError(f"{name} failed on {source.name} (exit {result.returncode}): {cause[:300]}")


def build(source: Path, rebuild: bool = False) -> Path:
    """The compiled library of ``source``, compiling it into the cache first if needed (or if
    ``rebuild``); raises ``BuildError`` in one line when it cannot be built."""
    command = compiler()
    version = _run([*command, "--version"]).stdout
    flags = (*_FLAGS, *_arch_flags(command))
    key = hashlib.sha256()
    headers = [h.read_bytes() for h in sorted(source.parent.glob("*.h"))]
    for part in (source.read_bytes(), *headers, version, " ".join(command[1:] + list(flags))):
        key.update(part if isinstance(part, bytes) else part.encode())
    key.update(f"{jaxlib.__version__} {cpu_features()}".encode())
    directory = cache_dir()
    path = directory / f"{source.stem}-{key.hexdigest()[:20]}.so"
    if path.exists() and not rebuild:
        return path
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, scratch = tempfile.mkstemp(suffix=".so", dir=directory)
        os.close(fd)
    except OSError as err:
        raise BuildError(f"kernel cache {directory} cannot be written ({err})") from None
    try:
        includes = (f"-I{jax.ffi.include_dir()}", f"-I{source.parent}")
        result = _run([*command, *flags, *includes, str(source), "-o", scratch])
        if result.returncode != 0:
            raise _failure(command, source, result)
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
def register(source: Path, symbol: str, target: str) -> str | None:
    """Builds and loads ``source`` and registers its FFI handler ``symbol`` as the CPU custom-call
    ``target``, once per process: None when that worked, else one line saying why not. A cached
    library that does not load (truncated by a full disk, say) is compiled again once."""
    try:
        try:
            library = ctypes.cdll.LoadLibrary(str(build(source)))
        except OSError:
            library = ctypes.cdll.LoadLibrary(str(build(source, rebuild=True)))
        handler = jax.ffi.pycapsule(getattr(library, symbol))
        jax.ffi.register_ffi_target(target, handler, platform="cpu")
    except (BuildError, OSError, AttributeError) as err:
        return " ".join(str(err).split())
    return None
