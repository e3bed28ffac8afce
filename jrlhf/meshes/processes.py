"""Several JAX processes (multi-controller) over one global mesh: who writes, and when to wait.

Every process runs the same program. Files outside Orbax checkpoints (configs, logs, summaries,
model descriptions) are written by process 0 alone; a decision that depends on files on disk is
taken by every process before a ``barrier`` and the files are written after it, so no process
sees another's half-done writes and all take the same branch (a diverging branch would leave
the others waiting in a collective). With one process both are no-ops.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.experimental import multihost_utils


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


def job_mesh(single: str, axis: str) -> str:
    """A command-line tool's default mesh: ``single`` for one process; with several, ``axis``
    over every device of the job (a mesh must hold devices of every process: a process that owns
    none of an array's shards cannot restore or compute it)."""
    return single if jax.process_count() == 1 else f"{axis}={jax.device_count()}"
