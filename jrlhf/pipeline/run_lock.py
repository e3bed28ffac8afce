"""One writer per run directory: an exclusive OS file lock on ``run_dir/run.lock``.

The lock is ``flock(2)`` on the lock file, so the kernel releases it when its holder ends in any
way (a normal exit, an exception, ``kill -9``): a killed run never leaves a stale lock, and the
file that stays behind only records who held it last. The holder writes its pid and host into
the file once it holds the lock, so a refused start names who has the directory.
:func:`run_dir_holder` asks whether another process holds it without holding it (``--check``).
Only standard library imports: tests hold the lock from a bare subprocess.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import time
from pathlib import Path

LOCK_FILE = "run.lock"
# How long a refused process waits for the holder to write its pid and host (it takes the lock
# first, then writes them).
_HOLDER_WAIT_S = 1.0
# How long a start retries a taken lock before it refuses: run_dir_holder (``--check``) takes a
# shared lock for an instant to look, which must not turn a start away.
_TAKEN_RETRY_S = 0.25


class RunDirInUse(Exception):
    """Another process holds the run directory's lock; one line naming its pid and host."""

    def __init__(self, run_dir: Path, holder: str):
        super().__init__(
            f"run directory {run_dir} is in use by another run ({holder}; {run_dir / LOCK_FILE}): "
            "wait for it to end, or choose another --run-dir"
        )


def _holder(fd: int) -> str:
    """Who the lock file says holds it ("pid 123 on host h"), once the holder has written it."""
    deadline = time.monotonic() + _HOLDER_WAIT_S
    while True:
        text = os.pread(fd, 4096, 0).decode(errors="replace").strip()
        if text or time.monotonic() > deadline:
            return text or "a process that has not yet recorded its pid and host"
        time.sleep(0.05)


class RunLock:
    """The held lock of one run directory; :meth:`release` (or the process's end) frees it."""

    def __init__(self, run_dir: Path, fd: int):
        self.run_dir, self._fd = run_dir, fd

    def release(self) -> None:
        """Free the lock (idempotent). The file stays: removing it could let two processes
        each lock a different file under the same name."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def lock_run_dir(run_dir: Path) -> RunLock:
    """Take the exclusive lock of the existing directory ``run_dir`` without waiting for a
    holder; a RunDirInUse naming the holder when another process (or another open of it in this
    process) has it. OSErrors of the file system (read-only, no space, permission) pass
    through."""
    run_dir = Path(run_dir)
    fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        deadline = time.monotonic() + _TAKEN_RETRY_S
        while not _try_lock(fd, fcntl.LOCK_EX):
            if time.monotonic() > deadline:
                raise RunDirInUse(run_dir, _holder(fd))
            time.sleep(0.01)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()}\n".encode(), 0)
    except BaseException:
        os.close(fd)  # frees the lock too
        raise
    return RunLock(run_dir, fd)


def _try_lock(fd: int, kind: int) -> bool:
    """Take the lock ``kind`` (LOCK_EX or LOCK_SH) of ``fd`` without waiting; False when
    another open of the file holds a lock that excludes it."""
    try:
        fcntl.flock(fd, kind | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def run_dir_holder(run_dir: Path) -> str | None:
    """Who holds the lock of ``run_dir`` ("pid 123 on host h") when another process has it (a
    start or resume would be refused with RunDirInUse); None when it is free or has no lock
    file to read (none yet, or a path a start could not use either: it says so itself).
    Creates and writes nothing: it takes a shared lock for an instant, which a start retries
    past (lock_run_dir)."""
    try:
        fd = os.open(Path(run_dir) / LOCK_FILE, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if _try_lock(fd, fcntl.LOCK_SH):
            return None  # closing the file frees the shared lock
        return _holder(fd)
    finally:
        os.close(fd)
