"""Several JAX processes (multi-controller) over one global mesh: who writes, when to wait, and
which processes own a sharding's devices.

Every process runs the same program. Files outside Orbax checkpoints (configs, logs, summaries,
model descriptions) are written by process 0 alone; a decision that depends on files on disk is
taken by every process before a ``barrier`` and the files are written after it, so no process
sees another's half-done writes and all take the same branch (a diverging branch would leave
the others waiting in a collective). With one process both are no-ops.
"""

from __future__ import annotations

import itertools

import jax
import numpy as np
from jax._src import distributed as _jax_distributed
from jax.experimental import multihost_utils
from jax.sharding import Sharding


def is_primary() -> bool:
    """Whether this process writes the run's files (process 0)."""
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Wait until every process reaches the barrier called ``name``."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def all_processes(ok: bool) -> bool:
    """Whether ``ok`` holds on every process (a collective: every process calls it), so that a
    failure seen by one process (e.g. its shard of a checkpoint is unreadable) sends every
    process down the same branch."""
    if jax.process_count() == 1:
        return ok
    return bool(np.all(multihost_utils.process_allgather(np.int32(ok))))


# Bound on a host barrier: generous, since one side may be copying weights meanwhile; a process
# that died is noticed sooner by the coordination service's heartbeat, which aborts the job.
HOST_BARRIER_TIMEOUT_S = 600
_host_barriers = itertools.count()


def host_barrier(name: str) -> None:
    """Wait until every process reaches this point, through JAX's coordination service alone.

    Unlike :func:`barrier` (a collective on every device) it runs no device work, so it may
    follow a cross-host transfer: a process whose devices sit in a collective cannot serve the
    transfers other processes are waiting for. Every process must call it in the same order.
    """
    if jax.process_count() == 1:
        return
    client = _jax_distributed.global_state.client
    client.wait_at_barrier(f"jrlhf:{name}:{next(_host_barriers)}", HOST_BARRIER_TIMEOUT_S * 1000)


# The directory of jrlhf's keys in the coordination service's key-value store.
_KEYS = "jrlhf"


def post(key: str, value: bytes) -> None:
    """Publish ``value`` under ``key`` in JAX's coordination service (its key-value store), for
    another process to :func:`take`; each key once per job. Small control messages only (ids,
    shapes, versions, metrics): the store lives in process 0's memory and serves every process
    through one server."""
    _jax_distributed.global_state.client.key_value_set_bytes(f"{_KEYS}/{key}", value)


def take(key: str, timeout_s: float = HOST_BARRIER_TIMEOUT_S) -> bytes:
    """:func:`fetch` ``key``, then delete it: a message read by its one reader, so the store
    holds only messages in flight."""
    value = fetch(key, timeout_s)
    _jax_distributed.global_state.client.key_value_delete(f"{_KEYS}/{key}")
    return value


def stored_keys() -> int:
    """How many of jrlhf's keys the coordination service holds now (every process sees the
    same store)."""
    if jax.process_count() == 1:
        return 0
    return len(_jax_distributed.global_state.client.key_value_dir_get_bytes(_KEYS))


def fetch(key: str, timeout_s: float = HOST_BARRIER_TIMEOUT_S) -> bytes:
    """The value another process posted under ``key``, waiting for it at most ``timeout_s``
    (then a TimeoutError naming the key)."""
    client = _jax_distributed.global_state.client
    try:
        return client.blocking_key_value_get_bytes(f"{_KEYS}/{key}", int(timeout_s * 1000))
    except Exception as e:  # JAX raises its runtime error type for a deadline
        if "DEADLINE" not in str(e).upper():
            raise
        raise TimeoutError(
            f"process {jax.process_index()}: nothing posted under {key!r} within {timeout_s} s"
        ) from None


def job_mesh(single: str, axis: str) -> str:
    """A command-line tool's default mesh: ``single`` for one process; with several, ``axis``
    over every device of the job (the tools are tested on meshes over every process only; the
    RL pipeline also runs plans that separate processes, see jrlhf.reshard.processes)."""
    return single if jax.process_count() == 1 else f"{axis}={jax.device_count()}"


def owners(sharding: Sharding) -> frozenset[int]:
    """The processes that own devices of ``sharding``."""
    return frozenset(d.process_index for d in sharding.device_set)


def spans_all_processes(sharding: Sharding) -> bool:
    """Whether every process of the job owns a device of ``sharding``."""
    return len(owners(sharding)) == jax.process_count()
