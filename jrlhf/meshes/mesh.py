"""Named meshes over a chosen slice of the devices.

A ``MeshSpec`` is an ordered list of (axis name, size) plus the device ids it lives on, so that two
roles (say the actor's training mesh and its generation mesh) can occupy disjoint devices. The last
axis varies fastest over the slice, so put the axis that wants the fastest links (tensor) last.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import math
import re
from collections.abc import Iterator, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from jrlhf.meshes.rules import MESH_AXES

_AXIS_RE = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*(\d+)\s*$")


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """Axis sizes and the device ids (indices into ``jax.devices()``) the mesh covers.

    ``devices=None`` means the first ``prod(sizes)`` devices.
    """

    axes: tuple[tuple[str, int], ...]
    devices: tuple[int, ...] | None = None

    def __post_init__(self):
        names = [n for n, _ in self.axes]
        for name in names:
            check_axis_name(name)
        if len(set(names)) != len(names):
            raise ValueError(f"mesh {self}: axis names repeat")
        for name, size in self.axes:
            if size < 1:
                raise ValueError(f"mesh {self}: axis {name!r} has size {size}")
        if self.devices is not None:
            object.__setattr__(self, "devices", tuple(int(d) for d in self.devices))
            if len(set(self.devices)) != len(self.devices):
                raise ValueError(f"mesh {self}: device ids repeat")
            if len(self.devices) != self.size:
                raise ValueError(
                    f"mesh {self}: axis sizes multiply to {self.size} but the slice has "
                    f"{len(self.devices)} devices"
                )

    @classmethod
    def of(cls, devices: Sequence[int] | range | None = None, **axes: int) -> MeshSpec:
        """``MeshSpec.of(fsdp=4, tensor=2, devices=range(4, 12))``."""
        return cls(tuple(axes.items()), None if devices is None else tuple(devices))

    @classmethod
    def parse(cls, text: str) -> MeshSpec:
        """Parse ``"data=2,tensor=4"`` or ``"fsdp=4@4:8"`` (devices 4..7) or ``"tensor=2@0,3"``."""
        body, _, dev = text.partition("@")
        axes = []
        for part in body.split(","):
            m = _AXIS_RE.match(part)
            if not m:
                raise ValueError(f"mesh spec {text!r}: cannot parse axis {part!r} (want name=size)")
            axes.append((m.group(1), int(m.group(2))))
        devices = None
        if dev:
            try:
                if ":" in dev:
                    lo, hi = dev.split(":")
                    devices = tuple(range(int(lo), int(hi)))
                else:
                    devices = tuple(int(d) for d in dev.split(","))
            except ValueError:
                raise ValueError(f"mesh spec {text!r}: cannot parse device slice {dev!r}") from None
        return cls(tuple(axes), devices)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.axes)

    @property
    def shape(self) -> dict[str, int]:
        return dict(self.axes)

    @property
    def size(self) -> int:
        return math.prod(s for _, s in self.axes)

    def device_ids(self) -> tuple[int, ...]:
        return self.devices if self.devices is not None else tuple(range(self.size))

    def __str__(self) -> str:
        body = ",".join(f"{n}={s}" for n, s in self.axes)
        if self.devices is None:
            return body
        return f"{body}@{','.join(map(str, self.devices))}"


def check_axis_name(name: str) -> None:
    """One line for a mesh axis no rule set shards over (:data:`jrlhf.meshes.rules.MESH_AXES`),
    suggesting the nearest known name: such an axis would leave every array replicated on it."""
    if name in MESH_AXES:
        return
    near = difflib.get_close_matches(name, MESH_AXES, n=1, cutoff=0.5)
    hint = f"did you mean `{near[0]}`?" if near else f"the mesh axes are {', '.join(MESH_AXES)}"
    raise ValueError(f"`{name}` is not a mesh axis; {hint}")


def make_mesh(spec: MeshSpec | str, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Build a ``jax.sharding.Mesh`` for ``spec``; fails with one line if it cannot fit."""
    if isinstance(spec, str):
        spec = MeshSpec.parse(spec)
    all_devices = list(jax.devices() if devices is None else devices)
    ids = spec.device_ids()
    bad = [i for i in ids if i >= len(all_devices) or i < 0]
    if bad:
        raise ValueError(
            f"mesh {spec} needs device ids {min(ids)}..{max(ids)} but only "
            f"{len(all_devices)} devices exist"
        )
    array = np.array([all_devices[i] for i in ids], dtype=object).reshape([s for _, s in spec.axes])
    return Mesh(array, spec.names)


@contextlib.contextmanager
def blame_setting(setting: str, errors: type[Exception] | tuple = ValueError) -> Iterator[None]:
    """Prefix ``errors`` raised inside with ``setting``: the flag or binding that chose the
    mesh (``--mesh fsdp=3``, ``actor/RoleConfig.train_mesh``) or another input, so that a
    one-line error says which setting to change. The error keeps its type where that type takes
    a message alone (else it becomes a ValueError)."""
    try:
        yield
    except errors as e:
        try:
            named = type(e)(f"{setting}: {e}")
        except TypeError:  # a type that takes more than a message (UnicodeDecodeError)
            named = ValueError(f"{setting}: {e}")
        raise named from None


def mesh_devices(mesh: Mesh) -> frozenset:
    return frozenset(mesh.devices.flat)


def replica_groups(devices: np.ndarray, names: Sequence[str], data_axes: Sequence[str]):
    """The data-parallel replicas of a mesh's ``devices`` array (axes ``names``): one row per
    index on the ``data_axes`` (row-major over them), holding that replica's devices in the
    order of the other axes."""
    names = list(names)
    data = [a for a in names if a in data_axes]
    rest = [a for a in names if a not in data_axes]
    order = [names.index(a) for a in data + rest]
    total = int(np.prod([devices.shape[names.index(a)] for a in data])) if data else 1
    return devices.transpose(order).reshape(total, -1)


def pick_replicas(groups: np.ndarray, replicas: int, avoid: frozenset = frozenset()) -> list[int]:
    """Which ``replicas`` of ``groups`` (rows of ``replica_groups``) a tail of work takes: those
    holding the fewest ``avoid`` devices, ties to the later replicas; in replica order."""
    busy = [sum(d in avoid for d in g) for g in groups]
    return sorted(sorted(range(len(groups)), key=lambda r: (busy[r], -r))[:replicas])


def replica_submesh(
    mesh: Mesh, data_axes: Sequence[str], replicas: int, avoid: frozenset = frozenset()
) -> Mesh:
    """A mesh of ``replicas`` of ``mesh``'s data-parallel replicas (``replica_groups``), with
    the same axis names: the data axes shrink (the first to ``replicas``, the others to 1) and
    every other axis keeps its size, so a PartitionSpec valid on ``mesh`` stays valid on it when
    the data axes divide. The replicas are chosen by ``pick_replicas`` (fewest ``avoid``
    devices), so a tail of work can go to devices that other calls do not use.
    """
    names = list(mesh.axis_names)
    data = [a for a in names if a in data_axes]
    rest = [a for a in names if a not in data_axes]
    groups = replica_groups(mesh.devices, names, data)
    if not 1 <= replicas <= len(groups):
        raise ValueError(
            f"cannot take {replicas} replicas of mesh {dict(mesh.shape)}: it has {len(groups)} "
            f"over data axes {tuple(data)}"
        )
    sizes = {a: 1 for a in data}
    if data:
        sizes[data[0]] = replicas
    picked = groups[pick_replicas(groups, replicas, avoid)]
    picked = picked.reshape([sizes[a] for a in data] + [mesh.shape[a] for a in rest])
    back = [(data + rest).index(a) for a in names]
    return Mesh(picked.transpose(back), tuple(names))
