"""Arrays on meshes that hold devices of some processes only (placements that separate processes).

With several JAX processes a plan may put a call on the devices of some processes only (e.g.
``separate`` on 2 processes x 4 devices: generation on process 0's, training on process 1's).
Every process still runs the same program: a jitted call on a mesh without any of this process's
devices is a no-op here and returns an array with no local shards. Besides the weight transfer
(the resharder's ``device_put+jit`` path) and reading a value on every process
(``jrlhf.meshes.batch.to_host``: the owners replicate it on their mesh and the first one
broadcasts it from host memory), two things need help and live here:

* Orbax saves only arrays that span every process and restores only onto such shardings: an array
  is saved as a *copies* view (:func:`spanning`) -- its shards plus same-shape copies on the
  devices of the processes it lacks (cross-host ``jax.device_put`` to a twin sharding), one
  global array replicated over a leading ``copies`` axis, so the files are those of the plain
  array; a restore reads into the copies view (:func:`spanning_target`) and keeps the part on
  the array's own devices (:func:`local_part`);
* the check, at set-up, that a mesh admits the copies view (:func:`check_separable`).

With one process every sharding spans all processes and each function is the identity.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jrlhf.meshes.processes import host_barrier, spans_all_processes

COPIES_AXIS = "copies"


def describe_mesh(mesh: Mesh) -> str:
    """'fsdp=2,tensor=2@4,5,6,7' for messages."""
    axes = ",".join(f"{n}={k}" for n, k in mesh.shape.items())
    return f"{axes}@{','.join(str(d.id) for d in mesh.devices.flat)}"


def _copy_groups(mesh: Mesh) -> list[list[jax.Device]]:
    """The mesh's devices, then groups of as many devices of the processes the mesh lacks."""
    own = list(mesh.devices.flat)
    have = {d.process_index for d in own}
    others = [d for d in jax.devices() if d.process_index not in have]
    n = len(own)
    if len(others) % n:
        raise ValueError(
            f"mesh {describe_mesh(mesh)} holds devices of process(es) {sorted(have)} only and "
            f"the other processes' {len(others)} devices do not split into copies of its "
            f"{n} devices (needed to checkpoint it): use a mesh over every process, or one "
            "whose size divides theirs"
        )
    return [own] + [others[i : i + n] for i in range(0, len(others), n)]


def check_separable(mesh: Mesh) -> None:
    """One-line ValueError when arrays on ``mesh`` could not be checkpointed (see module doc)."""
    if len({d.process_index for d in mesh.devices.flat}) < jax.process_count():
        _copy_groups(mesh)


def twin(
    s: NamedSharding, devices: Iterable[jax.Device], memory_kind: str | None = "same"
) -> NamedSharding:
    """``s``'s partitioning on other devices: same mesh shape and axes, devices in order, in
    ``memory_kind`` (``"same"``: ``s``'s; None: the devices' default)."""
    mesh = Mesh(
        np.array(list(devices), dtype=object).reshape(s.mesh.devices.shape),
        s.mesh.axis_names,
        axis_types=s.mesh.axis_types,
    )
    kind = s.memory_kind if memory_kind == "same" else memory_kind
    return NamedSharding(mesh, s.spec, memory_kind=kind)


def stacked(
    s: NamedSharding, devices: Sequence[jax.Device], memory_kind: str | None = "same"
) -> NamedSharding:
    """``s``'s partitioning laid out ``len(devices) // s``'s device count times over
    ``devices`` (in order): a leading ``copies`` axis, replicated."""
    n = math.prod(s.mesh.devices.shape)
    mesh = Mesh(
        np.array(list(devices), dtype=object).reshape((len(devices) // n, *s.mesh.devices.shape)),
        (COPIES_AXIS, *s.mesh.axis_names),
        axis_types=(s.mesh.axis_types[0], *s.mesh.axis_types),
    )
    kind = s.memory_kind if memory_kind == "same" else memory_kind
    return NamedSharding(mesh, s.spec, memory_kind=kind)


def copies_sharding(s: NamedSharding) -> NamedSharding:
    """``s`` replicated over a leading ``copies`` axis whose other entries are twins on the
    devices of the processes ``s`` lacks: a sharding over every process."""
    groups = _copy_groups(s.mesh)
    shape = (len(groups), *s.mesh.devices.shape)
    mesh = Mesh(
        np.array(groups, dtype=object).reshape(shape),
        (COPIES_AXIS, *s.mesh.axis_names),
        axis_types=(s.mesh.axis_types[0], *s.mesh.axis_types),
    )
    return NamedSharding(mesh, s.spec, memory_kind=s.memory_kind)


def _needs_copies(x: Any) -> bool:
    s = getattr(x, "sharding", None)
    return isinstance(s, NamedSharding) and not spans_all_processes(s)


def spanning(tree: Any) -> Any:
    """``tree`` with every array that lacks some process replaced by its copies view (a global
    array Orbax can save); the copies are sent with cross-host ``jax.device_put``. Returns once
    every process holds its copies, so the caller may then overwrite the sources."""
    leaves, treedef = jax.tree.flatten(tree)
    picked = [i for i, x in enumerate(leaves) if _needs_copies(x)]
    if not picked:
        return tree
    out = list(leaves)
    targets = {i: copies_sharding(leaves[i].sharding) for i in picked}
    groups = {i: _copy_groups(leaves[i].sharding.mesh)[1:] for i in picked}
    received: dict[int, list[jax.Array]] = {i: [] for i in picked}
    for g in range(max(len(v) for v in groups.values())):
        idx = [i for i in picked if g < len(groups[i])]
        sent = jax.device_put(
            [leaves[i] for i in idx], [twin(leaves[i].sharding, groups[i][g]) for i in idx]
        )
        for i, y in zip(idx, sent):
            received[i].append(y)
    # Receivers wait for their copies, then everyone meets at a barrier that uses no device, so
    # the senders serve the copies meanwhile and reuse their buffers only afterwards.
    jax.block_until_ready([received[i] for i in picked])
    host_barrier("spanning")
    for i in picked:
        x = leaves[i]
        shards = [s.data for a in (x, *received[i]) for s in a.addressable_shards]
        out[i] = jax.make_array_from_single_device_arrays(x.shape, targets[i], shards)
    return treedef.unflatten(out)


def spanning_target(target: Any) -> Any:
    """A restore target (ShapeDtypeStructs with shardings) with every sharding that lacks some
    process replaced by its copies view."""
    return jax.tree.map(
        lambda a: (
            jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=copies_sharding(a.sharding))
            if _needs_copies(a)
            else a
        ),
        target,
    )


def local_part(restored: Any, target: Any) -> Any:
    """Arrays restored onto :func:`spanning_target` ``(target)`` back on ``target``'s shardings
    (the shards on the target's own devices; the copies are dropped)."""

    def part(x, a):
        if not _needs_copies(a):
            return x
        keep = a.sharding.device_set
        shards = [s.data for s in x.addressable_shards if s.device in keep]
        return jax.make_array_from_single_device_arrays(a.shape, a.sharding, shards, dtype=a.dtype)

    return jax.tree.map(part, restored, target)
