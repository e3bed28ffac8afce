"""Storage faults (no space, read-only file system, permission) reported in one line.

A write can fail in Python (an ``OSError`` with its errno) or inside Orbax's TensorStore, whose
errors are ``ValueError``s whose text ends in ``[os_error_code='28']`` and quotes the file; an
asynchronous save's failure reaches the main thread wrapped, with the original as its cause or
context. :func:`storage_fault` finds the fault in any of these and says it in one line naming the
path and the errno. Orbax logs each failed background write with a traceback of its own before the
main thread hears of it; :func:`quiet_storage_noise` drops those records (the one line says it).

A failed read (a damaged checkpoint) leaves work behind too: Orbax runs a restore's reads as the
tasks of an event loop of its own and closes the loop as soon as one read fails, while the
others are still in TensorStore's hands. Each of those then finds the loop closed when it
completes ("Event loop is closed", printed from TensorStore's thread) and, once collected, its
coroutine turns the close into an error of its own ("Exception ignored in: <coroutine ...>").
:func:`settle_abandoned_tasks` makes a loop let its pending tasks finish before it closes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures.thread
import contextlib
import errno
import logging
import os
import re
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

# The errnos that mean "this storage cannot take the write": nothing the run can fix by retrying.
STORAGE_ERRNOS = frozenset(
    {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG}
)
# TensorStore's errno ("[os_error_code='28']") and Rust's std::io::Error's, as safetensors
# reports it ("(os error 28)").
_TS_ERRNO = re.compile(r"\[os_error_code='?(\d+)'?\]|\(os error (\d+)\)")
_TS_PATH = re.compile(r'"(/[^"]+)"')
_NOISY_LOGGERS = ("absl", "orbax", "asyncio")


def _chain(exc: BaseException):
    """``exc`` and every exception it was raised from or during, and an exception group's
    members, each once."""
    seen, stack = set(), [exc]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        stack += [e.__cause__, e.__context__, *getattr(e, "exceptions", ())]


def _describe(path: object, code: int) -> str:
    where = f"{os.fsdecode(path)}: " if path else ""
    return f"{where}{os.strerror(code)} ({errno.errorcode.get(code, code)})"


def describe_os_error(e: OSError) -> str:
    """``"PATH: STRERROR (ERRNO)"`` for any OSError (its path and errno, when it has them)."""
    if e.errno is None:
        return f"{os.fsdecode(e.filename)}: {e}" if e.filename else str(e)
    return _describe(e.filename, e.errno)


def _errno_in(text: str) -> int | None:
    match = _TS_ERRNO.search(text)
    return int(match.group(1) or match.group(2)) if match else None


def storage_fault(exc: BaseException, where: object = None) -> str | None:
    """``"PATH: STRERROR (ERRNO)"`` when ``exc`` is, or was caused by, a write the storage
    refused (:data:`STORAGE_ERRNOS`); None for anything else. ``where`` stands for the path
    when the error names none (safetensors' do not)."""
    found = []  # (path or None, errno), outermost first
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno in STORAGE_ERRNOS:
            found.append((e.filename, e.errno))
        elif not isinstance(e, OSError):  # TensorStore's and safetensors' errors name the errno
            text = str(e)
            code = _errno_in(text)
            if code in STORAGE_ERRNOS:
                # The innermost quoted path is the file the write failed on (the spec that
                # follows "[tensorstore_spec=" quotes its paths with escaped quotes).
                paths = _TS_PATH.findall(text.split("[tensorstore_spec=")[0])
                found.append((paths[-1] if paths else None, code))
    if not found:
        return None
    # A fault that names its file, when one does (a later close of another file on the same
    # full disk may not).
    path, code = next(((p, c) for p, c in found if p), found[0])
    return _describe(path or where, code)


class StorageFault(ValueError):
    """A write the storage refused, as one line (a ValueError: the entry points report those in
    one line)."""


@contextlib.contextmanager
def reporting_storage_faults(where: object = None) -> Iterator[None]:
    """Turn a storage fault raised in the body (:func:`storage_fault`) into a StorageFault
    whose message is ``"cannot write PATH: STRERROR (ERRNO)"``; ``where`` names the path when
    the error does not."""
    try:
        yield
    except Exception as e:
        fault = storage_fault(e, where)
        if fault is None:
            raise
        raise StorageFault(f"cannot write {fault}") from e


class _DropStorageFaults(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None:
            return storage_fault(record.exc_info[1]) is None
        return _errno_in(record.getMessage()) not in STORAGE_ERRNOS


_FILTER = _DropStorageFaults()


def _closed_loop(exc: BaseException | None) -> bool:
    # TensorStore completes the writes still in flight after a failed one aborted Orbax's save
    # and closed its event loop; each completion's callback then finds the loop closed.
    return isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed"


def _quiet_unraisable(previous):
    def hook(unraisable) -> None:
        exc = unraisable.exc_value
        if _closed_loop(exc) or (exc is not None and storage_fault(exc) is not None):
            return
        previous(unraisable)

    hook.quiets_storage = True
    return hook


def quiet_storage_noise() -> None:
    """Drop what Orbax and TensorStore print on their own threads about a failed write: absl
    log records of a storage fault, asyncio's "Future exception was never retrieved" for one,
    and the unraisable "Event loop is closed" of each write still in flight when a save failed.
    The failure itself reaches the caller, which reports it in one line. Idempotent."""
    for name in _NOISY_LOGGERS:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
    if not getattr(sys.unraisablehook, "quiets_storage", False):
        sys.unraisablehook = _quiet_unraisable(sys.unraisablehook)


# How long a closing event loop waits for the tasks it still has (reads of a local file end in
# milliseconds; a hung network file system must not hang the process's exit for longer).
SETTLE_TIMEOUT_S = 60.0


class _SettlingLoop(asyncio.SelectorEventLoop):
    """An event loop that, closed with tasks still pending, first runs until they end (at most
    :data:`SETTLE_TIMEOUT_S`) and retrieves their errors: what ``asyncio.run`` does for its
    loop, and Orbax's loops do not."""

    def close(self) -> None:
        if not self.is_running() and not self.is_closed():
            pending = [t for t in asyncio.all_tasks(self) if not t.done()]
            if pending:
                self.run_until_complete(asyncio.wait(pending, timeout=SETTLE_TIMEOUT_S))
                for task in pending:
                    if task.done() and not task.cancelled():
                        task.exception()  # reported by the caller that awaited their sibling
        super().close()


class _SettlingPolicy(asyncio.DefaultEventLoopPolicy):
    def new_event_loop(self) -> asyncio.AbstractEventLoop:
        return _SettlingLoop()


def settle_abandoned_tasks() -> None:
    """Every event loop made from now on (``asyncio.new_event_loop``, as Orbax makes one per
    restore) lets the tasks still pending when it is closed end first: the reads a failed
    restore abandoned then complete on an open loop, and no traceback of theirs follows the
    one line that reports the damage. Idempotent."""
    if not isinstance(asyncio.get_event_loop_policy(), _SettlingPolicy):
        asyncio.set_event_loop_policy(_SettlingPolicy())


def write_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all: a write cut short (a full disk) leaves
    the previous file, or none, never a truncated one that a resume would read."""
    with atomic_file(path) as tmp:
        tmp.write_text(text)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary file next to ``path`` for the body to write, renamed to ``path`` when the
    body ends and removed when it fails: ``path`` is written whole or not at all. An OSError
    names ``path`` (not the temporary file), for the one line that reports it."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with naming(path):
            try:
                yield tmp
                os.replace(tmp, path)
            except OSError as e:
                if e.filename == os.fspath(tmp):
                    e.filename = os.fspath(path)
                raise
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


@contextlib.contextmanager
def naming(path: str | os.PathLike) -> Iterator[None]:
    """An OSError raised in the body without a file name (a write or flush of an open file
    raises those) gets ``path`` as its file name, for the one line that reports it."""
    try:
        yield
    except OSError as e:
        if e.filename is None:
            e.filename = os.fspath(path)
        raise


def settle_writers(before: set[threading.Thread], timeout_s: float = 60.0) -> None:
    """Wait, at most ``timeout_s``, for the threads started since ``before`` (a snapshot of
    ``threading.enumerate()``) that the interpreter would wait for at exit: the writes a failed
    Orbax save left running. At exit they would fail to schedule their next step ("cannot
    schedule new futures after interpreter shutdown") and log a traceback each; waited for
    here, they end as their storage lets them (a fault is dropped by quiet_storage_noise).
    The coroutines of the writes the failed save abandoned are not warned about at exit."""
    warnings.filterwarnings("ignore", r"coroutine '.*' was never awaited", RuntimeWarning)
    # A thread pool's workers wait for work until their pool shuts down (at exit): not writers.
    pool_workers = set(getattr(concurrent.futures.thread, "_threads_queues", {}))
    deadline = time.monotonic() + timeout_s
    for thread in threading.enumerate():
        if thread in before or thread in pool_workers or thread.daemon:
            continue
        if thread is threading.current_thread():
            continue
        # The base class's join: Orbax's threads re-raise their failure from theirs.
        threading.Thread.join(thread, max(0.0, deadline - time.monotonic()))
