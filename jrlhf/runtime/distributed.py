"""Joining a multi-process (multi-controller) JAX job: ``--distributed`` on every entry point.

Every process of the job runs the same command. :func:`initialize` connects it to the others
through JAX's coordination service before JAX starts its backends; afterwards ``jax.devices()``
lists every process's devices and meshes span them all.

Where the job's shape comes from:

- explicitly, from ``JAX_COORDINATOR_ADDRESS`` (``host:port`` of process 0), ``JAX_NUM_PROCESSES``
  and ``JAX_PROCESS_ID`` (all three, or none), optionally ``JAX_LOCAL_DEVICE_IDS`` (comma-separated
  accelerator ids this process uses). ``jax.distributed.initialize()`` alone does not read the
  process count and id, so they are read, checked and passed here;
- otherwise by JAX's own detection of the cluster: TPU pod slices, SLURM, Open MPI.

Every wait is bounded (seconds, from the environment; see :class:`Timeouts`):

- ``JRLHF_INIT_TIMEOUT`` (default 120): joining the job. A coordinator that cannot be reached, or
  processes that never all arrive (a wrong ``JAX_NUM_PROCESSES``, a process that did not start),
  end the process after this long with one line naming the coordinator and the process.
- ``JRLHF_HEARTBEAT_TIMEOUT`` (default 30): a process that stops sending heartbeats (killed,
  hung machine) is declared dead after this long and JAX's coordination service then aborts every
  other process (measured with jax 0.10.2: about the timeout itself; a dead process 0, which hosts
  the service, is noticed by the others within a second).
- ``JRLHF_SHUTDOWN_TIMEOUT`` (default 60): at a normal exit every process waits for the others to
  finish too (JAX's shutdown barrier), at most this long.

Not bounded by JAX: a process that hangs while alive (its heartbeats go on) keeps the others waiting
in their next collective (gloo did not give up within 180 s in a test); a launcher's or
scheduler's time limit bounds that.

Moving arrays between the devices of different processes (a placement that separates processes,
jrlhf.reshard) uses JAX's cross-host transfers, which on backends without their own (CPU, GPU)
go over a socket per process: :func:`initialize` gives every process of a job of more than one
an address, ``JRLHF_TRANSFER_ADDRESS`` (``host`` or ``host:port``; default: 127.0.0.1 when the
coordinator is on this machine's loopback, else this host's name as resolved here) with a free
port unless one is named. On several machines it must be the address the others reach this
process at.

A process of a multi-process job that fails must not wait at that shutdown barrier for processes
that are still working (it would wait the whole shutdown timeout, then JAX aborts it and its exit
status is lost): the entry points pass their exit status through :func:`end_process`, and an
uncaught exception ends the process at once after its traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import os
import random
import signal
import socket
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

import jax

# JAX's process-wide distributed state (not public API): what it was given or detected, read
# without starting the backends, and its coordination-service client (key-value store).
from jax._src import distributed as _jax_distributed

from jrlhf.devices import ensure_host_devices, keep_host_memory
from jrlhf.runtime.job_env import (
    COORDINATOR,
    INIT_TIMEOUT,
    LAUNCHER_PID,
    NUM_PROCESSES,
    PROCESS_ID,
    DistributedError,
    JobSpec,
    Timeouts,
    env_value,
    job_spec_from_env,
)

# Exit status of a process that could not join the job in time.
EXIT_JOIN_TIMEOUT = 1

FLAG_HELP = (
    "join a multi-process JAX job: coordinator, process count and id from "
    f"{COORDINATOR}, {NUM_PROCESSES} and {PROCESS_ID}, or detected (SLURM, TPU pod, Open MPI); "
    "see docs/multihost.md"
)

# JAX's own connection deadline is set this much later than ours, so that the watchdog below
# reports a late join as one line; JAX's deadline (a fatal error with a stack trace, about 5 s
# after it expires) stays behind it as a backstop.
_JAX_DEADLINE_MARGIN_S = 10
_NUM_PROCESSES_KEY = "jrlhf/distributed/num_processes"


@dataclass(frozen=True)
class ProcessInfo:
    """This process's place in the job, once joined."""

    process_id: int
    num_processes: int
    coordinator: str


def _check_coordinator_port_free(spec: JobSpec, environ: Mapping[str, str]) -> None:
    """Process 0 hosts the coordination service; a port already taken makes JAX crash (SIGSEGV,
    jax 0.10.2) instead of raising, so look first."""
    port = int(spec.coordinator.rpartition(":")[2])
    # JAX binds every interface ([::]) unless told otherwise; the check binds the same way, with
    # SO_REUSEADDR as gRPC does, so that only a listening socket counts as taken.
    bind = env_value(environ, "JAX_COORDINATOR_BIND_ADDRESS")
    candidates = []
    if bind is not None:
        host = bind.rpartition(":")[0].strip("[]")
        candidates.append((socket.AF_INET6 if ":" in host else socket.AF_INET, host))
    else:
        candidates += [(socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")]
    for family, host in candidates:
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue  # no IPv6 on this machine: try the next family
        with sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
                sock.listen(1)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise DistributedError(
                        f"process 0: cannot serve as coordinator {spec.coordinator}: port {port} "
                        f"is already in use on this host (choose another {COORDINATOR} port)"
                    ) from None
                if e.errno == errno.EADDRNOTAVAIL:
                    continue
                raise DistributedError(
                    f"process 0: cannot serve as coordinator on port {port}: {e.strerror}"
                ) from None
            return


def _reachable(address: str, timeout: float = 1.0) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


def _join_failure_message(spec: JobSpec, timeouts: Timeouts) -> str:
    """One line saying which process could not join which coordinator, and the likely cause."""
    state = _jax_distributed.global_state
    # JAX records what it detected (or was given) before it connects.
    coordinator = getattr(state, "coordinator_address", None) or spec.coordinator or "(undetected)"
    pid = spec.process_id if spec.process_id is not None else getattr(state, "process_id", "?")
    num = spec.num_processes if spec.num_processes is not None else state.num_processes
    where = f"process {pid} of {num}"
    if pid != 0 and coordinator != "(undetected)" and not _reachable(coordinator):
        return (
            f"{where}: coordinator {coordinator} not reachable within {timeouts.init} s "
            f"(is process 0 running? {INIT_TIMEOUT} sets this limit)"
        )
    return (
        f"{where}: not all {num} processes joined coordinator {coordinator} within "
        f"{timeouts.init} s (were all started, with the same {NUM_PROCESSES} and {COORDINATOR}? "
        f"{INIT_TIMEOUT} sets this limit)"
    )


def _start_join_watchdog(spec: JobSpec, timeouts: Timeouts) -> threading.Timer:
    # JAX's connect blocks in C++ (without the GIL) and, when its deadline passes, kills the
    # process with a fatal log and stack trace; a timer thread reports first, as one line.
    def fire() -> None:
        print(f"error: {_join_failure_message(spec, timeouts)}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(EXIT_JOIN_TIMEOUT)

    timer = threading.Timer(timeouts.init, fire)
    timer.daemon = True
    timer.start()
    return timer


def _coordination_client():
    """JAX's coordination-service client (not public API: None if this JAX has none)."""
    return getattr(_jax_distributed.global_state, "client", None)


def _check_process_count(info: ProcessInfo, timeouts: Timeouts) -> None:
    """Every process must agree on the process count: one that was told more processes than
    process 0's service expects would otherwise wait minutes in JAX's device-topology exchange."""
    client = _coordination_client()
    if client is None or info.num_processes == 1:
        return
    if info.process_id == 0:
        client.key_value_set(_NUM_PROCESSES_KEY, str(info.num_processes))
        return
    try:
        theirs = int(client.blocking_key_value_get(_NUM_PROCESSES_KEY, timeouts.init * 1000))
    except Exception as e:  # JAX raises its runtime error type for a deadline
        raise DistributedError(
            f"process {info.process_id}: no process count from process 0 via {info.coordinator} "
            f"within {timeouts.init} s: {str(e).splitlines()[0]}"
        ) from None
    if theirs != info.num_processes:
        raise DistributedError(
            f"process {info.process_id}: {NUM_PROCESSES}={info.num_processes} here but "
            f"{theirs} on process 0 (coordinator {info.coordinator}): every process needs the same"
        )


def _fail_fast_excepthook(previous):
    def hook(exc_type, exc, tb) -> None:
        previous(exc_type, exc, tb)
        sys.stdout.flush()
        sys.stderr.flush()
        # Skip JAX's shutdown barrier: the other processes are not coming to it.
        os._exit(130 if issubclass(exc_type, KeyboardInterrupt) else 1)

    return hook


def _use_cpu_collectives() -> None:
    """Cross-process computations on CPU need a collectives implementation: gloo over TCP.

    The setting only concerns JAX's CPU backend (accelerators bring their own), so it is made
    whatever the platform; a choice in the environment (e.g. mpi) is kept.
    """
    if not os.environ.get("JAX_CPU_COLLECTIVES_IMPLEMENTATION"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")


TRANSFER_ADDRESS = "JRLHF_TRANSFER_ADDRESS"
_LOOPBACK = ("127.0.0.1", "localhost", "::1")
_PR_SET_PDEATHSIG = 1  # prctl option (linux/prctl.h)


# Where Linux says its ephemeral ports (those it gives outgoing connections) start and end.
_EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
_LOWEST_PORT = 10000


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now, for a listener that binds it later (the coordination
    service, JAX's cross-host transfer socket at the job's first transfer).

    Drawn at random below the OS's ephemeral range where it can: meanwhile, a port of that range
    may go to any outgoing connection (gloo's between the processes, a checkpoint's), and the
    listener then fails with "bind: Address already in use" (seen in CI); a random draw keeps
    processes that choose at the same time apart. Falls back to the OS's choice."""
    low = _LOWEST_PORT
    with contextlib.suppress(OSError, ValueError), open(_EPHEMERAL_RANGE) as f:
        low = int(f.read().split()[0])
    draw = random.SystemRandom()
    for _ in range(64):
        port = draw.randrange(_LOWEST_PORT, low) if low > _LOWEST_PORT else 0
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return s.getsockname()[1]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _use_cross_host_transfers(info: ProcessInfo, environ: Mapping[str, str]) -> None:
    """Give this process the socket address JAX's cross-host transfers listen on (see the module
    docstring); set before the backends start, after joining (the process count is known)."""
    value = environ.get(TRANSFER_ADDRESS, "").strip()
    host, sep, port = value.rpartition(":") if ":" in value else (value, "", "")
    if not host:
        coordinator_host = info.coordinator.rpartition(":")[0]
        host = (
            "127.0.0.1"
            if coordinator_host in _LOOPBACK
            else socket.gethostbyname(socket.gethostname())
        )
    if sep and not port.isdigit():
        raise DistributedError(f"{TRANSFER_ADDRESS}={value!r}: the port must be an integer")
    try:
        number = int(port) if port and int(port) else free_port(host)
    except OSError as e:
        raise DistributedError(f"{TRANSFER_ADDRESS}: cannot listen on {host} ({e})") from None
    jax.config.update("jax_cross_host_transfer_socket_address", f"{host}:{number}")


def _whole_lines() -> None:
    """Write stdout and stderr a line at a time (one write per line, flushed at the newline).

    JAX's C++ threads (gloo, the coordination service) write to the same file descriptors; with
    unbuffered streams ``print`` writes its text and its newline separately and their output can
    land in between, splitting the line that a launcher or log collector prefixes.
    """
    for stream in (sys.stdout, sys.stderr):
        # A stream that is not a text file (e.g. replaced by a test harness) is left alone.
        with contextlib.suppress(AttributeError, ValueError):
            stream.reconfigure(line_buffering=True, write_through=False)


def _end_with_launcher(environ: Mapping[str, str]) -> None:
    """A child of ``python -m jrlhf.launch`` ends when the launcher does, however it ends
    (killed with SIGKILL by a scheduler or a test's timeout included), instead of living on
    with its ports and cores waiting for peers that are gone (Linux's parent-death signal)."""
    launcher = environ.get(LAUNCHER_PID, "")
    if not launcher.isdigit() or not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != int(launcher):  # it died before the signal was armed
        os._exit(1)


def initialize(
    host_devices: int | None = 8,
    *,
    environ: Mapping[str, str] | None = None,
    timeouts: Timeouts | None = None,
) -> ProcessInfo:
    """Join the multi-process JAX job described by the environment; call before any JAX work.

    ``host_devices`` virtual CPU devices are requested for this process (as without
    ``--distributed``, see :func:`jrlhf.devices.ensure_host_devices`; an XLA_FLAGS device
    count already set, e.g. by ``python -m jrlhf.launch``, wins; None leaves the count to the
    caller, who must set it before JAX's backends start). ``environ`` (default
    ``os.environ``) supplies the job's shape (:func:`job_spec_from_env`) and, unless ``timeouts``
    is given, the timeouts (:meth:`Timeouts.from_env`). Configuration problems raise a
    DistributedError before anything is started; a job that cannot be joined within the
    initialization timeout ends the process with one line on stderr and exit status 1. Calling it
    again in a joined process returns the same ProcessInfo.
    """
    env = os.environ if environ is None else environ
    spec = job_spec_from_env(env)
    timeouts = Timeouts.from_env(env) if timeouts is None else timeouts
    if jax.distributed.is_initialized():
        return _process_info(spec)
    keep_host_memory()
    _end_with_launcher(env)
    if host_devices is not None:
        ensure_host_devices(host_devices)
    _use_cpu_collectives()
    _whole_lines()
    if spec.explicit and spec.process_id == 0:
        _check_coordinator_port_free(spec, env)

    watchdog = _start_join_watchdog(spec, timeouts)
    try:
        jax.distributed.initialize(
            coordinator_address=spec.coordinator,
            num_processes=spec.num_processes,
            process_id=spec.process_id,
            local_device_ids=list(spec.local_device_ids) if spec.local_device_ids else None,
            # With the job's shape given, JAX must not also detect a cluster: under SLURM it would
            # limit each process to one accelerator.
            cluster_detection_method="deactivate" if spec.explicit else None,
            initialization_timeout=timeouts.init + _JAX_DEADLINE_MARGIN_S,
            heartbeat_timeout_seconds=timeouts.heartbeat,
            shutdown_timeout_seconds=timeouts.shutdown,
        )
    except (ValueError, TypeError, RuntimeError) as e:
        watchdog.cancel()
        if not spec.explicit and "coordinator_address" in str(e):
            raise DistributedError(
                f"--distributed: none of {COORDINATOR}, {NUM_PROCESSES}, {PROCESS_ID} is set and "
                "JAX detected no cluster (SLURM, TPU pod, Open MPI): set all three"
            ) from None
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DistributedError(f"--distributed: {first}") from None
    sys.excepthook = _fail_fast_excepthook(sys.excepthook)
    info = _process_info(spec)
    if info.num_processes > 1:
        _use_cross_host_transfers(info, env)
    try:
        _check_process_count(info, timeouts)
    finally:
        watchdog.cancel()
    return info


def _process_info(spec: JobSpec) -> ProcessInfo:
    # Read from JAX's state rather than jax.process_index(), which would start the backends.
    state = _jax_distributed.global_state
    return ProcessInfo(
        process_id=int(state.process_id),
        num_processes=int(state.num_processes),
        coordinator=str(state.coordinator_address or spec.coordinator),
    )


def is_multiprocess() -> bool:
    """Whether this process has joined a job of more than one process."""
    return jax.distributed.is_initialized() and _jax_distributed.global_state.num_processes > 1


# The exit status of a refusal (a one-line error, as argparse's), how long a refusing process
# waits for the others to refuse too, and how long process 0 then stays for them to leave (see
# end_process; jrlhf.launch awaits them).
REFUSED = 2
REFUSAL_WAIT_S = 30.0
REFUSAL_LINGER_S = 5.0


def end_process(code: int) -> int:
    """The exit status ``code`` for an entry point's ``main`` to return.

    In a multi-process job a failed process (``code != 0``) exits here at once, skipping JAX's
    shutdown barrier (which would hold it until the other processes finish or the shutdown
    timeout ends it with SIGABRT, losing ``code``); the others notice through their next
    collective or the heartbeat. Otherwise ``code`` is returned unchanged.

    A refusal (``code == REFUSED``, 2: a one-line error) is normally every process's, as they
    all run the same checks: the process first waits, at most ``REFUSAL_WAIT_S``, for the others
    to refuse too; then every process disconnects from the coordination service (its client's
    shutdown, together), and process 0, which serves it, leaves last (up to ``REFUSAL_LINGER_S``
    later; jrlhf.launch waits for that). A process that left without disconnecting, or the
    service going first, would make the service end the others with a page of gRPC errors after
    the line that matters. A peer that does not refuse in time: the process leaves at once.
    """
    if code != 0 and is_multiprocess():
        sys.stdout.flush()
        sys.stderr.flush()
        if code == REFUSED:
            try:
                client = _jax_distributed.global_state.client
                client.wait_at_barrier("jrlhf:refused", int(REFUSAL_WAIT_S * 1000))
                client.shutdown()
            except Exception:  # a peer that never refuses: leave at once
                pass
            else:
                if jax.process_index() == 0:
                    time.sleep(REFUSAL_LINGER_S)
        os._exit(code)
    return code


def add_flag(parser: argparse.ArgumentParser) -> None:
    """Add ``--distributed`` to an entry point's parser."""
    parser.add_argument("--distributed", action="store_true", help=FLAG_HELP)


def setup_devices(distributed: bool, host_devices: int = 8) -> None:
    """An entry point's device set-up: join the job with ``--distributed`` (see
    :func:`initialize`), otherwise ask for ``host_devices`` virtual CPU devices as before."""
    if distributed:
        initialize(host_devices)
    else:
        ensure_host_devices(host_devices)
