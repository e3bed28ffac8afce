"""Parking a parameter tree in host memory during generation, and measuring live device bytes.

Parking uses JAX memory kinds (``pinned_host`` or ``unpinned_host``) when the backend has one
distinct from device memory: the arrays keep their shardings, only their memory kind changes, and
the device buffers are donated. Without such a memory kind the tree is copied to NumPy (a real host
copy) and the device arrays are deleted; ``ParkedTree.path`` says which path was taken.
"""

from __future__ import annotations

import dataclasses
import gc
from typing import Any

import jax

from jrlhf.reshard.layout import bytes_per_device

HOST_KINDS = ("pinned_host", "unpinned_host")


def host_memory_kind(device: jax.Device | None = None) -> str | None:
    """The host memory kind ``device`` supports apart from its default memory, or None."""
    device = jax.devices()[0] if device is None else device
    try:
        default = device.default_memory().kind
        kinds = [m.kind for m in device.addressable_memories()]
    except Exception:  # backends without the memories API: no memory kinds
        return None
    for kind in HOST_KINDS:
        if kind in kinds and kind != default:
            return kind
    return None


def default_memory_kind(device: jax.Device | None = None) -> str | None:
    """The kind of ``device``'s default memory (``'device'`` on CPU/GPU/TPU), or None."""
    device = jax.devices()[0] if device is None else device
    try:
        return device.default_memory().kind
    except Exception:  # backends without the memories API
        return None


@dataclasses.dataclass
class ParkedTree:
    """A tree moved off the accelerator, with what is needed to put it back exactly."""

    tree: Any  # host-memory jax.Arrays (memory-kind path) or NumPy arrays (numpy path)
    shardings: Any  # the original device shardings
    path: str  # "memory_kind:<kind>" or "numpy"
    nbytes: int  # device bytes the tree occupied, replicas counted on every device


def _device_nbytes(leaves: list, shardings: list) -> int:
    return sum(bytes_per_device(shardings, leaves).values())


def park_to_host(
    tree: Any, *, memory_kind: str | None = None, allow_numpy_fallback: bool = True
) -> ParkedTree:
    """Move ``tree`` to host memory and free its device buffers (the input is consumed).

    ``memory_kind`` defaults to the backend's host memory kind. If the backend has none, the tree
    is copied to NumPy when ``allow_numpy_fallback`` is set, and otherwise this raises naming the
    memories the device offers.
    """
    leaves, treedef = jax.tree.flatten(tree)
    if not leaves:
        return ParkedTree(tree, tree, "empty", 0)
    shardings = [x.sharding for x in leaves]
    device = next(iter(shardings[0].device_set))
    kind = memory_kind or host_memory_kind(device)
    nbytes = _device_nbytes(leaves, shardings)
    if kind is not None:
        host = [s.with_memory_kind(kind) for s in shardings]
        # PJRT does not implement donation across memory kinds, so copy, wait, then free.
        parked = jax.device_put(leaves, host)
        jax.block_until_ready(parked)
        for x in leaves:
            x.delete()
        return ParkedTree(
            treedef.unflatten(parked), treedef.unflatten(shardings), f"memory_kind:{kind}", nbytes
        )
    if not allow_numpy_fallback:
        memories = [m.kind for m in device.addressable_memories()]
        raise RuntimeError(
            f"{device.platform} device {device.id} has no host memory kind (memories: {memories}); "
            "pass allow_numpy_fallback=True to park through NumPy"
        )
    host_np = jax.device_get(leaves)
    for x in leaves:
        x.delete()
    return ParkedTree(treedef.unflatten(host_np), treedef.unflatten(shardings), "numpy", nbytes)


def restore_from_host(parked: ParkedTree) -> Any:
    """Bring a parked tree back to its original device shardings (the host copy is consumed)."""
    leaves, treedef = jax.tree.flatten(parked.tree)
    shardings = treedef.flatten_up_to(parked.shardings)
    out = jax.device_put(leaves, shardings)
    if parked.path.startswith("memory_kind:"):
        # No cross-memory-kind donation in PJRT: wait for the copy, then free the host buffers.
        jax.block_until_ready(out)
        for x in leaves:
            x.delete()
    parked.tree = None  # the host copy is no longer the live one
    return treedef.unflatten(out)


def live_bytes(memory_kind: str | None = None) -> int:
    """Bytes of live jax.Array buffers in ``memory_kind`` (default: device memory), deduplicated.

    Shard views and relabelled arrays share buffers with their parent, so buffers are counted once
    per (device, address).
    """
    # Arrays dropped in reference cycles stay in live_arrays() until collected.
    gc.collect()
    kind = default_memory_kind() if memory_kind is None else memory_kind
    seen: set[tuple[int, int]] = set()
    total = 0
    for arr in jax.live_arrays():
        if arr.is_deleted() or (arr.sharding.memory_kind or kind) != kind:
            continue
        for shard in arr.addressable_shards:
            data = shard.data
            key = (shard.device.id, data.unsafe_buffer_pointer())
            if key not in seen:
                seen.add(key)
                total += data.nbytes
    return total
