"""Bytes that cross devices in a resharding, and the zero-redundancy generation-mesh chooser.

Traffic is computed from the shardings themselves (``devices_indices_map``), never estimated by
hand: for every device of the target, the part of its target slice that it does not already hold
under the source must arrive from elsewhere.

The chooser follows HybridFlow's 3D-HybridEngine: training uses (fsdp, tensor=T); generation uses
(data, tensor=t_g). If the generation tensor groups are taken at a stride, each device's generation
shard contains its training shard, so the switch is a gather inside small groups and no byte that
a device already holds is sent to it again.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import Sharding

from jrlhf.meshes.mesh import MeshSpec

Bounds = tuple[tuple[int, int], ...]


def _bounds(index: tuple, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """(start, stop) per dimension for one device's index tuple (slices; None means full)."""
    out = []
    for dim, sl in zip(shape, tuple(index) + (slice(None),) * (len(shape) - len(index))):
        start, stop, step = sl.indices(dim)
        if step != 1:
            raise ValueError(f"strided shard index {sl} is not supported")
        out.append((start, stop))
    return tuple(out)


def _volume(bounds: Iterable[tuple[int, int]]) -> int:
    return math.prod(max(0, hi - lo) for lo, hi in bounds)


def _intersect(a, b) -> tuple[tuple[int, int], ...]:
    return tuple((max(lo1, lo2), min(hi1, hi2)) for (lo1, hi1), (lo2, hi2) in zip(a, b))


def _leaf_shape_dtype(leaf: Any) -> tuple[tuple[int, ...], np.dtype]:
    return tuple(leaf.shape), np.dtype(leaf.dtype)


def _flat_triples(src_shardings: Any, dst_shardings: Any, shapes: Any):
    """Flatten (source sharding, target sharding, shape/dtype leaf) following ``shapes``."""
    leaves, treedef = jax.tree.flatten(shapes)
    src = treedef.flatten_up_to(src_shardings)
    dst = treedef.flatten_up_to(dst_shardings)
    return list(zip(src, dst, leaves))


def moved_elements(have: Mapping[Any, Bounds], want: Mapping[Any, Bounds]) -> dict[Any, int]:
    """Elements each device must receive: its wanted slice minus what it already holds.

    ``have`` and ``want`` map devices to per-dimension (start, stop) bounds; a device absent from
    ``have`` receives its whole slice. Shared by the byte counts here (from real shardings) and
    the plan estimator (from mesh specs, without devices).
    """
    out = {}
    for device, w in want.items():
        h = have.get(device)
        out[device] = _volume(w) - (0 if h is None else _volume(_intersect(w, h)))
    return out


def moved_bytes_per_device(src: Sharding, dst: Sharding, shape, dtype) -> dict[Any, int]:
    """Bytes each target device must receive to go from ``src`` to ``dst`` for one array.

    A device that the source does not use receives its whole target slice.
    """
    shape = tuple(shape)
    itemsize = np.dtype(dtype).itemsize
    have = {d: _bounds(idx, shape) for d, idx in src.devices_indices_map(shape).items()}
    want = {d: _bounds(idx, shape) for d, idx in dst.devices_indices_map(shape).items()}
    return {d: n * itemsize for d, n in moved_elements(have, want).items()}


def bytes_moved(src_shardings: Any, dst_shardings: Any, shapes: Any) -> int:
    """Total bytes that must cross devices to reshard a tree (sum over leaves and devices).

    ``shapes`` is a tree of arrays or ``jax.ShapeDtypeStruct``; the sharding trees match it.
    """
    total = 0
    for s, d, leaf in _flat_triples(src_shardings, dst_shardings, shapes):
        shape, dtype = _leaf_shape_dtype(leaf)
        total += sum(moved_bytes_per_device(s, d, shape, dtype).values())
    return total


def bytes_per_device(shardings: Any, shapes: Any) -> dict[Any, int]:
    """Bytes each device holds for a tree under ``shardings`` (replicas counted on each device)."""
    leaves, treedef = jax.tree.flatten(shapes)
    out: dict[Any, int] = {}
    for s, leaf in zip(treedef.flatten_up_to(shardings), leaves):
        shape, dtype = _leaf_shape_dtype(leaf)
        for device, idx in s.devices_indices_map(shape).items():
            out[device] = out.get(device, 0) + _volume(_bounds(idx, shape)) * dtype.itemsize
    return out


def _tensor_coords(spec: MeshSpec, tensor_axis: str) -> np.ndarray:
    """Tensor-axis coordinate of every device of ``spec``, in the spec's device order."""
    sizes = [s for _, s in spec.axes]
    coords = np.indices(sizes).reshape(len(sizes), -1)
    if tensor_axis not in spec.names:
        return np.zeros(spec.size, dtype=int)
    return coords[spec.names.index(tensor_axis)]


def choose_generation_mesh(
    train: MeshSpec,
    gen_tensor: int,
    *,
    tensor_axis: str = "tensor",
    data_axis: str = "data",
) -> MeshSpec:
    """Generation mesh ``(data, tensor=gen_tensor)`` on the training devices, zero-redundancy order.

    Each device keeps as much of its training tensor slice as possible: a device at training
    tensor index ``i`` (of ``T``) is placed at the generation tensor index ``j`` (of ``t_g``) whose
    slice ``[j/t_g, (j+1)/t_g)`` overlaps ``[i/T, (i+1)/T)`` the most; ties go to the least-filled
    index so that each tensor index gets exactly ``size / t_g`` devices. For ``t_g | T`` this is
    HybridFlow's stride grouping (``j = i // (T / t_g)``), in which every device's generation
    shard contains its training shard. Devices that share ``j`` fill the data axis in training
    order. Only the tensor split depends on the order: ``dp_tp`` replicates everything else.
    """
    n = train.size
    if gen_tensor < 1 or n % gen_tensor:
        raise ValueError(
            f"generation tensor size {gen_tensor} does not divide the {n} devices of {train}"
        )
    ids = train.device_ids()
    t_train = train.shape.get(tensor_axis, 1)
    data = n // gen_tensor
    coords = _tensor_coords(train, tensor_axis)
    groups: list[list[int]] = [[] for _ in range(gen_tensor)]
    for device, i in zip(ids, coords):
        # Integer interval arithmetic on a common grid of t_train * gen_tensor cells.
        lo, hi = int(i) * gen_tensor, (int(i) + 1) * gen_tensor

        def score(j: int, lo=lo, hi=hi) -> tuple[int, int, int]:
            overlap = max(0, min(hi, (j + 1) * t_train) - max(lo, j * t_train))
            return (-overlap, len(groups[j]), j)

        open_js = [j for j in range(gen_tensor) if len(groups[j]) < data]
        groups[min(open_js, key=score)].append(device)
    order = tuple(groups[j][d] for d in range(data) for j in range(gen_tensor))
    return MeshSpec(((data_axis, data), (tensor_axis, gen_tensor)), order)


def naive_generation_mesh(
    train: MeshSpec, gen_tensor: int, *, tensor_axis: str = "tensor", data_axis: str = "data"
) -> MeshSpec:
    """The generation mesh with devices in the training mesh's order (the baseline)."""
    n = train.size
    if gen_tensor < 1 or n % gen_tensor:
        raise ValueError(
            f"generation tensor size {gen_tensor} does not divide the {n} devices of {train}"
        )
    return MeshSpec(((data_axis, n // gen_tensor), (tensor_axis, gen_tensor)), train.device_ids())
