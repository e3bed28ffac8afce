"""How a batch of examples is laid over a mesh (rows split over the rule set's ``batch`` axes),
and how results come back to the host.

The one place that moves batches between host and devices, for training steps, inference calls
and the decode engine alike. With several JAX processes (multi-controller), a mesh spans other
processes' devices too: every process passes the same global host batch and keeps only its own
shards, and ``to_host`` gives every process the same global result.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding

from jrlhf.meshes.processes import owners, spans_all_processes
from jrlhf.meshes.rules import Rules, axis_size, get_rules, logical_to_spec


def batch_sharding(mesh: Mesh, rules: Rules | str, ndim: int) -> NamedSharding:
    """Batch arrays are split over the rule set's ``batch`` axes and replicated otherwise."""
    logical = ("batch",) + (None,) * (ndim - 1)
    return NamedSharding(mesh, logical_to_spec(logical, mesh, get_rules(rules)))


def batch_shardings(batch: dict[str, Any], mesh: Mesh, rules: Rules | str) -> dict[str, Any]:
    """The sharding of every field of ``batch``."""
    return {k: batch_sharding(mesh, rules, jnp.ndim(v)) for k, v in batch.items()}


def batch_shards(mesh: Mesh, rules: Rules | str) -> int:
    """How many ways a batch's rows are split on ``mesh``."""
    spec = batch_sharding(mesh, rules, 1).spec
    return axis_size(mesh, spec[0] if spec else None)


def check_batch_divides(
    batch: dict[str, Any], mesh: Mesh, rules: Rules | str, microbatches: int = 1
) -> None:
    """One-line error when a batch cannot be split over the mesh's batch axes."""
    for name, value in batch.items():
        spec = batch_sharding(mesh, rules, jnp.ndim(value)).spec
        axes = spec[0] if spec else None
        n = axis_size(mesh, axes)
        size = jnp.shape(value)[0]
        if size % (n * microbatches):
            raise ValueError(
                f"batch field {name!r} has {size} rows, not divisible by the batch mesh axes "
                f"{axes} (size {n}) x microbatches {microbatches}"
            )


def shard_batch(batch: dict[str, Any], mesh: Mesh, rules: Rules | str) -> dict[str, jax.Array]:
    """Put a host batch on ``mesh``, rows split over the batch axes."""
    return jax.device_put(batch, batch_shardings(batch, mesh, rules))


# Inside process_group(...): host reads involve the processes of that group only (see there).
_group: frozenset[int] | None = None


@contextlib.contextmanager
def process_group(processes: Iterable[int]) -> Iterator[None]:
    """Within the block, :func:`to_host` involves only the processes of ``processes``: for code
    that runs on one group's devices while the other processes do something else (asynchronous
    RL with generation and training on different process groups). Every process of the group
    must make the same reads in the same order (SPMD within the group); an array with shards on
    a process outside the group raises instead of waiting for it."""
    global _group
    before, _group = _group, frozenset(processes)
    try:
        yield
    finally:
        _group = before


def _group_devices(group: frozenset[int]) -> tuple[jax.Device, ...]:
    """One device of each process of ``group`` (its first), in process order."""
    first: dict[int, jax.Device] = {}
    for d in jax.devices():
        first.setdefault(d.process_index, d)
    return tuple(first[p] for p in sorted(group))


_pickers: dict[tuple, Any] = {}


def _group_broadcast(value: np.ndarray | None, shape, dtype, source: int, group) -> np.ndarray:
    """``value`` of process ``source`` on every process of ``group`` (a collective of the
    group's processes only: one row per process, the source's row picked, exactly)."""
    devices = _group_devices(group)
    mesh = Mesh(np.array(devices, dtype=object), ("group",))
    me = jax.process_index()
    raw = np.dtype(dtype) == np.dtype(bool)
    row = np.zeros(shape, np.uint8 if raw else dtype) if value is None else value
    row = row.view(np.uint8) if raw else row
    mine = next(d for d in devices if d.process_index == me)
    rows = jax.make_array_from_single_device_arrays(
        (len(devices), *row.shape),
        NamedSharding(mesh, PartitionSpec("group")),
        [jax.device_put(row[None], mine)],
    )
    index = sorted(group).index(source)
    key = (devices, index)
    pick = _pickers.get(key)
    if pick is None:
        pick = _pickers[key] = jax.jit(
            lambda a: a[index], out_shardings=NamedSharding(mesh, PartitionSpec())
        )
    out = np.asarray(pick(rows).addressable_data(0))
    return out.view(bool) if raw else out


def host_group() -> frozenset[int]:
    """The processes that run the host code here: the current :func:`process_group`, or every
    process of the job."""
    return _group if _group is not None else frozenset(range(jax.process_count()))


def broadcast_from_first(value: np.ndarray) -> np.ndarray:
    """``value`` of the first process of :func:`host_group` on every process of it (the others
    pass an array of the same shape and dtype, whose contents are ignored): a collective of the
    group's processes only; the value itself without one."""
    group = host_group()
    if len(group) == 1:
        return value
    source = min(group)
    mine = value if jax.process_index() == source else None
    return _group_broadcast(mine, value.shape, value.dtype, source, group)


def _process_local(x: Any) -> bool:
    """Whether ``x`` was computed from host values on this process's default device (not
    placed on any mesh): every process running the same host code holds its own copy of the
    same value, each on a different device, so it is read here and never gathered or broadcast
    (a broadcast from every process at once adds the copies up)."""
    if not isinstance(x, jax.Array):
        return False
    return x.is_fully_addressable and not getattr(x, "_committed", True)


def _leaf_to_host_in_group(x: Any, group: frozenset[int]) -> Any:
    if not isinstance(x, jax.Array):
        return x
    if _process_local(x):
        return np.asarray(jax.device_get(x))
    held = owners(x.sharding)
    me = jax.process_index()
    if not held <= group:
        raise RuntimeError(
            f"process {me}: an array of shape {x.shape} has shards on processes "
            f"{sorted(held - group)}, outside this group {sorted(group)}"
        )
    value = None
    if me in held and x.is_fully_addressable:
        value = np.asarray(jax.device_get(x))
    elif me in held:  # the owners replicate it (a collective of theirs only) and read it
        value = np.asarray(_replicate(x).addressable_data(0))
    if held == group:
        return value
    return _group_broadcast(value, x.shape, x.dtype, min(held), group)


def _leaf_to_host(x: Any) -> Any:
    if not isinstance(x, jax.Array):
        return x
    if x.is_fully_addressable or x.is_fully_replicated:
        return np.asarray(jax.device_get(x))
    # Shards on other processes' devices: a collective, so every process must ask in turn.
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def to_host(tree: Any) -> Any:
    """The global value of every array in ``tree`` as NumPy, on every process.

    Arrays on this process's devices are fetched directly; an array with shards on other
    processes' devices is all-gathered (or, on a mesh that lacks some process, broadcast by its
    first owner: :func:`to_host_many`), which every process must do at the same point of the
    program (SPMD)."""
    if _group is not None:
        return jax.tree.map(lambda x: _leaf_to_host_in_group(x, _group), tree)
    leaves, treedef = jax.tree.flatten(tree)
    # The same choice on every process (a mesh's owners see its arrays fully addressable).
    apart = [
        i
        for i, x in enumerate(leaves)
        if isinstance(x, jax.Array)
        and not _process_local(x)
        and not spans_all_processes(x.sharding)
    ]
    out = [None if i in apart else _leaf_to_host(x) for i, x in enumerate(leaves)]
    if apart:
        for i, v in zip(apart, to_host_many([leaves[i] for i in apart])):
            out[i] = v
    return treedef.unflatten(out)


def to_host_many(arrays: list[jax.Array]) -> list[np.ndarray]:
    """The global values of ``arrays``, each on a mesh that lacks some process, on every process.

    The first owner of each array broadcasts it (the owners first replicate it on its own mesh);
    every process must make the same call at the same point of the program (SPMD).
    """
    me = jax.process_index()
    values: list[Any] = [None] * len(arrays)
    by_source: dict[int, list[int]] = {}
    for i, x in enumerate(arrays):
        s = x.sharding
        source = min(owners(s))
        by_source.setdefault(source, []).append(i)
        if me in owners(s):
            whole = _replicate(x)
            values[i] = np.asarray(whole.addressable_data(0))
        else:
            values[i] = np.zeros(x.shape, x.dtype)
    out: list[Any] = [None] * len(arrays)
    for source, idx in sorted(by_source.items()):
        # psum does not take booleans; a sum with zeros is exact for every other dtype.
        sent = [values[i].view(np.uint8) if values[i].dtype == bool else values[i] for i in idx]
        got = multihost_utils.broadcast_one_to_all(sent, is_source=me == source)
        for i, v in zip(idx, got):
            v = np.asarray(v)
            out[i] = v.view(bool) if arrays[i].dtype == bool else v.astype(arrays[i].dtype)
    return out


_replicators: dict[Sharding, Any] = {}


def _replicate(x: jax.Array) -> jax.Array:
    """``x`` replicated over its own mesh (every owner then holds the whole value)."""
    if x.is_fully_replicated:
        return x
    s = x.sharding
    mesh = s.mesh if isinstance(s, NamedSharding) else Mesh(np.array(s._device_assignment), ("d",))
    rep = NamedSharding(mesh, PartitionSpec())
    fn = _replicators.get(rep)
    if fn is None:
        fn = _replicators[rep] = jax.jit(lambda a: a, out_shardings=rep)
    return fn(x)
