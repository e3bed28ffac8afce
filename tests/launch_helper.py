"""A tiny multi-process program for tests/runtime/test_distributed.py, started by jrlhf.launch.

    python -m jrlhf.launch --processes 2 --devices-per-process 2 -- tests.launch_helper MODE

MODE ``sum``: print the global device count and the sum, over every process's devices, of a
sharded array (a cross-process collective), and ``to_host`` of a value each process computed on
its own; every process must print the same, then the host cores it may run on. MODE ``exit3``:
process 1 exits with status 3 once the job is joined, the others wait for the launcher to end them.
MODE ``survivor``: process 1 is killed (SIGKILL, like kill -9) once the job is joined; process 0
fails for want of it, as a survivor does, with a long traceback.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jrlhf.meshes.batch import to_host
from jrlhf.meshes.processes import fetch, post
from jrlhf.runtime import distributed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _fail(depth: int) -> None:
    if depth:
        _fail(depth - 1)
    raise RuntimeError("process 1 is gone")


def main(argv: list[str] | None = None) -> int:
    """Run MODE; returns the exit status."""
    p = argparse.ArgumentParser(prog="python -m tests.launch_helper")
    p.add_argument("mode", choices=("sum", "exit3", "survivor"))
    distributed.add_flag(p)
    args = p.parse_args(argv)
    try:
        distributed.setup_devices(args.distributed, host_devices=1)
    except distributed.DistributedError as e:
        print(f"error: {e}", file=sys.stderr)
        # A check that failed after joining (e.g. process counts that disagree) must not wait
        # at JAX's shutdown barrier either.
        return distributed.end_process(2)
    if args.mode == "exit3":
        print(f"pid {os.getpid()}", flush=True)
        if jax.process_index() == 1:
            print("process 1 failing with 3", flush=True)
            return distributed.end_process(3)
        time.sleep(120)  # ended by the launcher long before
        return 0
    if args.mode == "survivor":
        if jax.process_index() == 1:
            post("survivor:pid", str(os.getpid()).encode())
            os.kill(os.getpid(), signal.SIGKILL)
        peer = int(fetch("survivor:pid"))
        while _alive(peer):  # until the launcher has reaped it: it knows of the death first
            time.sleep(0.02)
        _fail(depth=20)
    n = jax.device_count()
    mesh = Mesh(np.array(jax.devices()), ("d",))
    # Device d holds the value d: the sum needs every process's shards.
    values = np.arange(n, dtype=np.float32)
    x = jax.make_array_from_callback((n,), NamedSharding(mesh, P("d")), lambda idx: values[idx])
    total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(x)
    ids = multihost_utils.process_allgather(jnp.array([jax.process_index()]))
    # A value every process computes from host values on its own default device (as the
    # off-policy metrics are): to_host reads each process's own copy, never their sum.
    mine = to_host({"half": jnp.asarray(np.float32(0.5)) * 3})["half"]
    print(
        f"process {jax.process_index()} of {jax.process_count()}: devices {n} "
        f"local {jax.local_device_count()} sum {float(total.addressable_data(0))} "
        f"processes {sorted(int(i) for i in np.ravel(ids))} own {float(mine)}"
    )
    print(f"process {jax.process_index()} cores {sorted(os.sched_getaffinity(0))}")
    return distributed.end_process(0)


if __name__ == "__main__":
    sys.exit(main())
