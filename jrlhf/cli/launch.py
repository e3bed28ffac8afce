"""``python -m jrlhf.launch --processes N --devices-per-process K -- ENTRY ARGS...``: a local job.

Starts N processes of ``python -m jrlhf.ENTRY ARGS... --distributed`` on this machine, as one
multi-process JAX job: process 0 hosts the coordinator on 127.0.0.1 (a free port unless
``--port``), each gets JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID and K virtual
CPU devices. ENTRY is a jrlhf entry point (train, evaluate, generate, convert, bench,
plan.calibrate) or any module path that accepts ``--distributed`` (e.g. a test helper).

Every output line is prefixed ``[p<i>] `` (stdout to stdout, stderr to stderr). When a process
exits with a non-zero status or is killed, the launcher ends the others (SIGTERM, then SIGKILL
after ``--grace`` seconds), prints one line naming the process and its status, and exits with
that status (128 + signal number for a signal); 0 when every process exits 0. A refusal (status
2, a one-line error every process makes) is awaited first: each process leaves by itself, process 0
last, and only one still running after ``REFUSAL_GRACE_S`` is ended. What the other
processes write to stderr once one has failed (their tracebacks from a collective with a dead
peer, their notice of the SIGTERM) is not shown but counted in that line.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from jrlhf.devices import MAX_HOST_DEVICES, with_host_device_count
from jrlhf.runtime import job_env
from jrlhf.runtime.distributed import REFUSAL_LINGER_S, REFUSED, free_port

# The entry points that take --distributed, by the name used after ``python -m jrlhf.``.
ENTRY_POINTS = ("train", "evaluate", "generate", "convert", "bench", "plan.calibrate")
_POLL_S = 0.2
# A refusal (exit status REFUSED) is every process's, as they run the same checks, and each
# leaves by itself (jrlhf.runtime.distributed.end_process: process 0 up to REFUSAL_LINGER_S
# after the others); ending one on its way out would only add JAX's notice of the signal.
REFUSAL_GRACE_S = REFUSAL_LINGER_S + 5.0
_PREFIX = "[launch] "


@dataclass
class _Child:
    index: int
    proc: subprocess.Popen
    readers: list[threading.Thread]


def build_parser() -> argparse.ArgumentParser:
    """The launcher's options (the command after ``--`` is split off before parsing)."""
    p = argparse.ArgumentParser(
        prog="python -m jrlhf.launch",
        usage="python -m jrlhf.launch --processes N --devices-per-process K [options] "
        "-- ENTRY [ARGS...]",
        description=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--processes", type=int, required=True, help="number of processes (N)")
    p.add_argument(
        "--devices-per-process",
        type=int,
        required=True,
        help="virtual CPU devices per process (K): the job sees N x K devices",
    )
    p.add_argument("--port", type=int, default=0, help="coordinator port (default: a free one)")
    p.add_argument(
        "--timeout",
        type=int,
        default=60,
        help="seconds the processes may take to join the job before each gives up with one "
        f"line (sets {job_env.INIT_TIMEOUT}; default 60)",
    )
    p.add_argument(
        "--grace",
        type=float,
        default=5.0,
        help="seconds between SIGTERM and SIGKILL when ending the processes (default 5; JAX's "
        "preemption notifier catches SIGTERM in a joined process, so SIGKILL usually ends it)",
    )
    p.add_argument(
        "--cores-per-process",
        type=int,
        default=0,
        help="pin process i to host cores i*C .. i*C+C-1 (modulo the cores there are), as if "
        "each process owned its own hardware (default 0: no pinning)",
    )
    p.add_argument(
        "--cores",
        default="",
        help="the host cores of each process, one entry per process separated by ';', each a "
        "comma list of cores or ranges, e.g. '0;0;1;1' (processes 0-1 share core 0, 2-3 core "
        "1: two groups on hardware of their own); instead of --cores-per-process",
    )
    p.add_argument(
        "--max-time",
        type=float,
        default=0.0,
        help="end the whole job after this many seconds, exit 124 (default 0: no limit)",
    )
    return p


def core_sets(spec: str, processes: int, available: int) -> list[set[int]]:
    """``--cores``: one set of host cores per process; ValueError naming what is wrong."""
    entries = spec.split(";")
    if len(entries) != processes:
        raise ValueError(f"--cores {spec!r}: {len(entries)} entries for {processes} processes")
    out = []
    for entry in entries:
        cores: set[int] = set()
        for part in entry.split(","):
            lo, _, hi = part.strip().partition("-")
            try:
                first, last = int(lo), int(hi or lo)
            except ValueError:
                raise ValueError(f"--cores {spec!r}: {part!r} is not a core or a range") from None
            if not 0 <= first <= last < available:
                raise ValueError(
                    f"--cores {spec!r}: {part!r} is not within this host's cores 0-{available - 1}"
                )
            cores.update(range(first, last + 1))
        out.append(cores)
    return out


def split_command(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """(launcher options, command): the command is everything after the first ``--``."""
    argv = list(argv)
    if "--" not in argv:
        return argv, []
    i = argv.index("--")
    return argv[:i], argv[i + 1 :]


def entry_module(entry: str) -> str:
    """The module ``python -m`` runs for ENTRY: a jrlhf entry point by its short name, else the
    module path as given."""
    return f"jrlhf.{entry}" if entry in ENTRY_POINTS else entry


def child_command(entry: str, args: Sequence[str]) -> list[str]:
    """``python -m MODULE ARGS... --distributed`` (the flag before a ``--`` in ARGS, so that the
    entry point still reads it as an option)."""
    args = list(args)
    if "--distributed" not in args:
        at = args.index("--") if "--" in args else len(args)
        args.insert(at, "--distributed")
    return [sys.executable, "-m", entry_module(entry), *args]


def child_env(
    base: dict[str, str], index: int, processes: int, coordinator: str, devices: int, timeout: int
) -> dict[str, str]:
    """Process ``index``'s environment: the job's shape, its virtual devices, unbuffered output."""
    env = dict(base)
    env[job_env.COORDINATOR] = coordinator
    env[job_env.NUM_PROCESSES] = str(processes)
    env[job_env.PROCESS_ID] = str(index)
    env[job_env.INIT_TIMEOUT] = str(timeout)
    env[job_env.LAUNCHER_PID] = str(os.getpid())
    # Replaces any count in the caller's XLA_FLAGS: each process gets exactly K devices.
    env["XLA_FLAGS"] = with_host_device_count(base.get("XLA_FLAGS", ""), devices)
    # Lines reach the launcher (and the terminal) as they are written, not when a buffer fills.
    env["PYTHONUNBUFFERED"] = "1"
    return env


def describe_status(index: int, code: int) -> str:
    """'process I exited with C' or 'process I was killed by SIGNAME'."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"process {index} was killed by {name}"
    return f"process {index} exited with {code}"


def exit_status(code: int) -> int:
    """The launcher's exit status for a failed process's ``code`` (128 + n for signal n)."""
    return 128 - code if code < 0 else code


class _Fold:
    """Once a process has failed, what the others write to stderr is its consequence (a
    collective with a dead peer, the SIGTERM the launcher sends), not its cause: those lines are
    counted into the launcher's one line instead of shown. A Python traceback is held until it
    ends and then up to ``HOLD_S`` longer, so that one already on its way when the launcher
    learns of the failure is folded too."""

    HOLD_S = 1.0
    _TRACEBACK = b"Traceback (most recent call last):"

    def __init__(self):
        self.failed: int | None = None  # the first process that failed
        self.lines = 0
        self._lock = threading.Lock()

    def fail(self, index: int) -> None:
        with self._lock:
            if self.failed is None:
                self.failed = index

    def hides(self, index: int) -> bool:
        """Whether process ``index``'s stderr is now folded."""
        return self.failed is not None and self.failed != index

    def fold(self, lines: int) -> None:
        with self._lock:
            self.lines += lines

    def settle(self, index: int) -> bool:
        """After a traceback of process ``index``: wait up to HOLD_S for the launcher to learn
        of a failure; whether the traceback is to be folded."""
        deadline = time.monotonic() + self.HOLD_S
        while self.failed is None and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.hides(index)

    def note(self) -> str:
        """The launcher's line's account of what it folded."""
        if not self.lines:
            return ""
        s = "s" if self.lines != 1 else ""
        return f" ({self.lines} line{s} the other processes wrote to stderr after it not shown)"


class _Output:
    """Copies a child's stream to ours, one prefixed line at a time (lines are not interleaved)."""

    lock = threading.Lock()

    @staticmethod
    def pump(stream, out, prefix: bytes, fold: _Fold | None = None, index: int = -1) -> None:
        """Copy ``stream`` to ``out`` until it closes; with ``fold``, the lines process
        ``index`` writes once another has failed are counted there instead (see _Fold)."""
        writable = True
        held: list[bytes] = []  # a traceback in progress

        def write(lines: list[bytes]) -> None:
            nonlocal writable
            if not writable:
                return  # keep draining: a child blocked on a full pipe would never exit
            with _Output.lock:
                try:
                    for line in lines:
                        out.write(prefix + (line if line.endswith(b"\n") else line + b"\n"))
                    out.flush()
                except OSError:  # our reader went away (e.g. "| head"): drop the rest
                    writable = False

        for line in iter(stream.readline, b""):
            if fold is None:
                write([line])
            elif fold.hides(index):
                fold.fold(len(held) + 1)
                held = []
            elif held or line.startswith(_Fold._TRACEBACK):
                held.append(line)
                # A traceback ends at its first unindented line after the header.
                if len(held) > 1 and not line[:1].isspace():
                    if fold.settle(index):
                        fold.fold(len(held))
                    else:
                        write(held)
                    held = []
            else:
                write([line])
        if held:
            if fold is not None and fold.hides(index):
                fold.fold(len(held))
            else:
                write(held)
        stream.close()


def _say(message: str) -> None:
    with _Output.lock:
        sys.stderr.write(f"{_PREFIX}{message}\n")
        sys.stderr.flush()


def _watch(index: int, proc: subprocess.Popen, exits: queue.Queue) -> None:
    # Popen.wait returns as soon as the process exits, so the queue holds exits in order.
    exits.put((index, proc.wait()))


def _start(
    index: int,
    cmd: list[str],
    env: dict[str, str],
    exits: queue.Queue,
    cores: set[int] | None = None,
    fold: _Fold | None = None,
) -> _Child:
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if cores:  # before the child's interpreter starts any thread, so every thread inherits it
        os.sched_setaffinity(proc.pid, cores)
    threading.Thread(
        target=_watch, args=(index, proc, exits), daemon=True, name=f"p{index}-wait"
    ).start()
    prefix = f"[p{index}] ".encode()
    readers = [
        threading.Thread(
            target=_Output.pump,
            args=(stream, out, prefix, folds, index),
            daemon=True,
            name=f"p{index}-{name}",
        )
        for stream, out, name, folds in (
            (proc.stdout, sys.stdout.buffer, "out", None),
            (proc.stderr, sys.stderr.buffer, "err", fold),
        )
    ]
    for r in readers:
        r.start()
    return _Child(index, proc, readers)


def end_children(children: Sequence[_Child], grace: float) -> int:
    """End the children still running, by process id: SIGTERM, then SIGKILL after ``grace``.
    Returns how many were running."""
    running = [c for c in children if c.proc.poll() is None]
    for c in running:
        # Popen.send_signal skips a process already reaped and one that just exited.
        c.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for c in running:
        try:
            c.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            c.proc.kill()
    for c in running:
        try:
            # SIGKILL cannot be refused; the wait is bounded anyway.
            c.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            _say(f"process {c.index} (pid {c.proc.pid}) did not end after SIGKILL")
    return len(running)


def _await_exits(children: Sequence[_Child], timeout: float) -> None:
    """Wait, at most ``timeout`` seconds in all, for every child to exit by itself."""
    deadline = time.monotonic() + timeout
    for c in children:
        try:
            c.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return


def _join_readers(children: Sequence[_Child], timeout: float = 5.0) -> None:
    # A grandchild that inherited a pipe could keep it open: wait for the output a bounded time.
    deadline = time.monotonic() + timeout
    for c in children:
        for r in c.readers:
            r.join(timeout=max(0.0, deadline - time.monotonic()))


def supervise(
    children: Sequence[_Child],
    exits: queue.Queue,
    grace: float,
    max_time: float,
    fold: _Fold | None = None,
) -> int:
    """Wait for the children; on the first failure end the rest. Returns the exit status (an
    interrupt is the caller's to handle). ``exits`` receives ``(index, status)`` as each child
    exits, in that order: the process reported is the one that failed first, not one that
    failed because of it (e.g. in a collective with a killed process); what the others write to
    stderr after it goes into ``fold`` (counted in the launcher's line)."""
    fold = fold or _Fold()
    deadline = time.monotonic() + max_time if max_time else None
    running = {c.index for c in children}
    while running:
        try:
            # A bounded get: the loop also checks --max-time, and signals are handled between.
            index, code = exits.get(timeout=_POLL_S)
        except queue.Empty:
            if deadline is not None and time.monotonic() > deadline:
                end_children(children, grace)
                _join_readers(children)
                _say(f"job still running after --max-time {max_time:g} s: ended every process")
                return 124
            continue
        running.discard(index)
        if code != 0:
            fold.fail(index)
            if code == REFUSED:
                _await_exits(children, REFUSAL_GRACE_S)
            ended = end_children(children, grace)
            _join_readers(children)
            tail = f"; ended {ended} other process{'es' if ended != 1 else ''}" if ended else ""
            _say(f"{describe_status(index, code)}{tail}{fold.note()}")
            return exit_status(code)
    _join_readers(children)
    return 0


class _Terminated(KeyboardInterrupt):
    """The launcher received SIGTERM."""


def _terminate_on_sigterm(signum, frame) -> None:
    # A scheduler ending the launcher ends the job: turn SIGTERM into the interrupt path.
    raise _Terminated


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status (see the module docstring)."""
    own, command = split_command(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(own)
    if not command:
        parser.error("no command: put the entry point and its arguments after --")
    counts = {
        "--processes": args.processes,
        "--devices-per-process": args.devices_per_process,
        "--timeout": args.timeout,
    }
    for name, value in counts.items():
        if value < 1:
            parser.error(f"{name} must be at least 1, got {value}")
    if args.devices_per_process > MAX_HOST_DEVICES:  # why: see MAX_HOST_DEVICES
        parser.error(
            f"--devices-per-process must be at most {MAX_HOST_DEVICES}, got "
            f"{args.devices_per_process}"
        )
    if not 0 <= args.port < 65536:
        parser.error(f"--port {args.port}: not a TCP port")
    if args.cores_per_process < 0:
        parser.error(f"--cores-per-process must be >= 0, got {args.cores_per_process}")
    total = os.cpu_count() or 1
    pins = [{(i * args.cores_per_process + c) % total for c in range(args.cores_per_process)}
            for i in range(args.processes)]  # fmt: skip
    if args.cores:
        if args.cores_per_process:
            parser.error("give --cores or --cores-per-process, not both")
        try:
            pins = core_sets(args.cores, args.processes, total)
        except ValueError as e:
            parser.error(str(e))
    for flag, value in (("--grace", args.grace), ("--max-time", args.max_time)):
        if not math.isfinite(value) or value < 0:  # nan would never end a job, nor compare
            parser.error(f"{flag} must be a finite number of seconds >= 0, got {value}")
    port = args.port or free_port()
    coordinator = f"127.0.0.1:{port}"
    module = entry_module(command[0])
    try:  # in this process's environment, which the children inherit
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that is missing, or an empty name
        found = False
    if not found:
        parser.error(
            f"{command[0]}: no module {module} to run (entry points: {', '.join(ENTRY_POINTS)}, "
            "or a module path)"
        )
    cmd = child_command(command[0], command[1:])
    base = dict(os.environ)
    try:
        # The processes read the other timeouts from this environment: a bad one fails here, once.
        job_env.Timeouts.from_env(base)
    except job_env.DistributedError as e:
        parser.error(str(e))
    children: list[_Child] = []
    exits: queue.Queue = queue.Queue()
    fold = _Fold()
    previous = signal.signal(signal.SIGTERM, _terminate_on_sigterm)
    try:
        for i in range(args.processes):
            env = child_env(
                base, i, args.processes, coordinator, args.devices_per_process, args.timeout
            )
            children.append(_start(i, cmd, env, exits, pins[i], fold))
        return supervise(children, exits, args.grace, args.max_time, fold)
    except KeyboardInterrupt as e:
        end_children(children, args.grace)
        _join_readers(children)
        terminated = isinstance(e, _Terminated)
        _say(f"{'terminated' if terminated else 'interrupted'}: ended every process")
        return 143 if terminated else 130
    except BaseException:
        # Whatever went wrong here, no process started here is left behind.
        end_children(children, args.grace)
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
