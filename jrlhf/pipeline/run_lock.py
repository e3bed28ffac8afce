"""One writer per run directory: an exclusive OS file lock on ``run_dir/run.lock``.

The lock is ``flock(2)`` on the lock file, so the kernel releases it when its holder ends in any
way (a normal exit, an exception, ``kill -9``): a killed run never leaves a stale lock, and the
file that stays behind only records who held it last. The holder writes its pid and host into
the file once it holds the lock, so a refused start names who has the directory. Only standard
library imports: tests hold the lock from a bare subprocess.
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


class RunDirInUse(Exception):
    """Another process holds the run directory's lock; one line naming its pid and host."""


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
    """Take the exclusive lock of the existing directory ``run_dir`` without waiting; a
    RunDirInUse naming the holder when another process (or another open of it in this process)
    has it. OSErrors of the file system (read-only, no space, permission) pass through."""
    run_dir = Path(run_dir)
    fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise RunDirInUse(
            f"run directory {run_dir} is in use by another run ({holder}; {run_dir / LOCK_FILE}): "
            "wait for it to end, or choose another --run-dir"
        ) from None
    except BaseException:
        os.close(fd)
        raise
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()}\n".encode(), 0)
    except BaseException:
        os.close(fd)  # frees the lock too
        raise
    return RunLock(run_dir, fd)
