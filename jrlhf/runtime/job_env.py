"""The environment contract of a multi-process job, read without importing JAX.

``jrlhf.runtime.distributed`` reads it to join the job; ``python -m jrlhf.launch`` writes it for
the processes it starts (and stays light: no JAX in the launcher).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

COORDINATOR = "JAX_COORDINATOR_ADDRESS"
NUM_PROCESSES = "JAX_NUM_PROCESSES"
PROCESS_ID = "JAX_PROCESS_ID"
LOCAL_DEVICE_IDS = "JAX_LOCAL_DEVICE_IDS"
INIT_TIMEOUT = "JRLHF_INIT_TIMEOUT"
HEARTBEAT_TIMEOUT = "JRLHF_HEARTBEAT_TIMEOUT"
SHUTDOWN_TIMEOUT = "JRLHF_SHUTDOWN_TIMEOUT"
# Set by ``python -m jrlhf.launch`` for its children: the launcher's pid (a child ends with it).
LAUNCHER_PID = "JRLHF_LAUNCHER_PID"


class DistributedError(ValueError):
    """A problem joining the multi-process job, reported as one line."""


@dataclass(frozen=True)
class JobSpec:
    """The job's shape as the environment gives it; ``None`` fields are left to JAX's detection."""

    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    local_device_ids: tuple[int, ...] | None = None

    @property
    def explicit(self) -> bool:
        """Whether the environment named the coordinator, process count and id."""
        return self.coordinator is not None


@dataclass(frozen=True)
class Timeouts:
    """Bounds, in whole seconds (JAX takes integers), on the coordination service's waits."""

    init: int = 120
    heartbeat: int = 30
    shutdown: int = 60

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Timeouts:
        """The defaults, overridden by JRLHF_INIT_TIMEOUT, JRLHF_HEARTBEAT_TIMEOUT and
        JRLHF_SHUTDOWN_TIMEOUT; a value that is not a positive integer is a DistributedError."""
        env = os.environ if environ is None else environ
        default = cls()
        return cls(
            init=_positive_int(env, INIT_TIMEOUT, default.init),
            heartbeat=_positive_int(env, HEARTBEAT_TIMEOUT, default.heartbeat),
            shutdown=_positive_int(env, SHUTDOWN_TIMEOUT, default.shutdown),
        )


def env_value(env: Mapping[str, str], name: str) -> str | None:
    """``env[name]`` stripped, or None when unset or empty."""
    # An empty value counts as unset: job templates often export a variable they leave empty.
    value = env.get(name, "").strip()
    return value or None


def _positive_int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env_value(env, name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise DistributedError(f"{name}={raw!r}: not an integer number of seconds") from None
    if value < 1:
        raise DistributedError(f"{name}={raw!r}: must be at least 1 (seconds)")
    return value


def job_spec_from_env(environ: Mapping[str, str] | None = None) -> JobSpec:
    """The job's shape from JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID and
    JAX_LOCAL_DEVICE_IDS, checked.

    The first three must be set together or not at all (then JAX detects the cluster); a partial
    set, a value that is not an integer, a process id out of range or an address without a port
    raise a DistributedError whose one-line message names the variable.
    """
    env = os.environ if environ is None else environ
    local_ids = None
    if (raw_ids := env_value(env, LOCAL_DEVICE_IDS)) is not None:
        try:
            local_ids = tuple(int(x) for x in raw_ids.split(","))
        except ValueError:
            raise DistributedError(
                f"{LOCAL_DEVICE_IDS}={raw_ids!r}: expected comma-separated device ids, e.g. 0,1,2,3"
            ) from None
        if any(i < 0 for i in local_ids):
            raise DistributedError(f"{LOCAL_DEVICE_IDS}={raw_ids!r}: device ids are >= 0")

    names = (COORDINATOR, NUM_PROCESSES, PROCESS_ID)
    values = {name: env_value(env, name) for name in names}
    missing = [name for name in names if values[name] is None]
    if len(missing) == len(names):
        return JobSpec(local_device_ids=local_ids)
    if missing:
        given = [name for name in names if values[name] is not None]
        raise DistributedError(
            f"{' and '.join(given)} set but {' and '.join(missing)} not: set all of "
            f"{', '.join(names)}, or none of them to let JAX detect the cluster "
            "(SLURM, TPU pod, Open MPI)"
        )

    address = values[COORDINATOR]
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise DistributedError(f"{COORDINATOR}={address!r}: expected host:port, e.g. 10.0.0.1:1234")
    ints = {}
    for name in (NUM_PROCESSES, PROCESS_ID):
        try:
            ints[name] = int(values[name])
        except ValueError:
            raise DistributedError(f"{name}={values[name]!r}: not an integer") from None
    num, pid = ints[NUM_PROCESSES], ints[PROCESS_ID]
    if num < 1:
        raise DistributedError(f"{NUM_PROCESSES}={num}: must be at least 1")
    if not 0 <= pid < num:
        raise DistributedError(
            f"{PROCESS_ID}={pid}: out of range for {NUM_PROCESSES}={num} (0 to {num - 1})"
        )
    return JobSpec(address, num, pid, local_ids)
