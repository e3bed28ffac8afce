"""A tiny multi-process program for tests/runtime/test_distributed.py, started by jrlhf.launch.

    python -m jrlhf.launch --processes 2 --devices-per-process 2 -- tests.launch_helper MODE

MODE ``sum``: print the global device count and the sum, over every process's devices, of a
sharded array (a cross-process collective), and ``to_host`` of a value each process computed on
its own; every process must print the same, then the host cores it may run on. MODE ``exit3``:
process 1 exits with status 3 once the job is joined, the others wait for the launcher to end them.
MODE ``survivor``: process 1 is killed (SIGKILL, like kill -9) once the job is joined; process 0
fails for want of it, as a survivor does, with a long traceback. MODE ``relay`` (2 processes x 6
devices): the resharder moves trees between meshes of the two processes whose device counts do
not divide one another (6 -> 4 -> 6, 3 -> 2), checks every shard it holds against NumPy and
prints the paths and bytes. MODE ``refuse``: every process refuses in one line, process 1 a
second after process 0, as a start-up check does.
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
from jrlhf.reshard import Resharder
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
    p.add_argument("mode", choices=("sum", "exit3", "survivor", "relay", "refuse"))
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
    if args.mode == "relay":
        return _relay()
    if args.mode == "refuse":
        time.sleep(jax.process_index())
        print("error: Nothing.setting=1 is refused", file=sys.stderr, flush=True)
        return distributed.end_process(2)
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


def _relay() -> int:
    """Weights between the processes' meshes of 6 and 4 devices (and back), and of 3 and 2:
    counts that do not divide one another, so the resharder's relay path."""
    devices = jax.devices()
    six, four = devices[0:6], devices[6:10]
    three, two = devices[0:3], devices[10:12]
    rng = np.random.default_rng(0)  # the same values on every process
    values = {"w": rng.standard_normal((12, 8)).astype(np.float32),
              "b": rng.standard_normal((5,)).astype(np.float32)}  # fmt: skip

    def shardings(ds, spec_w):
        mesh = Mesh(np.array(ds), ("x",))
        return {"w": NamedSharding(mesh, spec_w), "b": NamedSharding(mesh, P())}

    def put(sh):
        return {k: jax.make_array_from_callback(v.shape, sh[k], lambda i, v=v: v[i], dtype=v.dtype)
                for k, v in values.items()}  # fmt: skip

    def check(tree, sh):
        for k, x in tree.items():
            assert x.sharding == sh[k], (k, x.sharding)
            for shard in x.addressable_shards:
                np.testing.assert_array_equal(np.asarray(shard.data), values[k][shard.index])

    resharder = Resharder()
    a, b = shardings(six, P("x")), shardings(four, P(None, "x"))
    tree = put(a)
    for _ in range(2):
        tree = resharder(tree, b, donate=True)
        check(tree, b)
        tree = resharder(tree, a, donate=True)
        check(tree, a)
    c, d = shardings(three, P("x")), shardings(two, P("x"))
    check(resharder(put(c), d), d)
    report = [(t.path, t.runs, t._legs[1].bytes_moved) for t in resharder.transitions]
    print(f"process {jax.process_index()} relay ok {report}", flush=True)
    return distributed.end_process(0)


if __name__ == "__main__":
    sys.exit(main())
