"""Compiled, cached transitions of a parameter tree between shardings.

One path moves the actor between its training and generation layouts. A ``Transition`` is built
once per (tree structure, shapes, dtypes, source shardings, target shardings, donate) and then
only runs; ``Resharder`` keeps them in a dict under exactly that key.

How a transition runs depends on the device sets:

* ``alias``: every leaf's target sharding puts the same slice on the same device as its source
  (``Sharding.is_equivalent_to``: a one-device plan, or data parallelism in both phases, whatever
  the mesh's axis names). Nothing is copied: the output is the source's own device buffers
  under the target shardings. It lives as long as the source does, so a training step that
  donates the source also deletes it, and the trainer rebuilds it after every update (its
  reshard phase), as it rebuilds any generation copy. ``Resharder.switch(keep="host")``, which
  frees the source, copies instead.
* ``jit``: same devices (any mesh shape or device order). One jitted identity with
  ``out_shardings``, compiled ahead of time, so XLA emits the collectives. jit wants one device
  order for all operands, so a source whose mesh lists the devices in another order is first
  relabelled (zero copy) onto the target's order, as ``jax.device_put`` itself does.
* ``device_put+jit``: a disjoint (or different) device set of the same size (separated placement).
  The source layout is copied shard-for-shard onto the target devices (``jax.device_put`` to a
  "twin" sharding with the same partitioning: a plain device-to-device copy, no compile, each
  byte crosses once), then a cached jit reshards there.
  The same path moves weights between processes (a placement that separates processes):
  ``jax.device_put`` between disjoint device sets of different processes is a cross-host transfer
  (each process made the call; jrlhf.runtime.distributed configures its socket), which JAX
  supports exactly for same-shape twin shardings; the jit then runs on the target processes only.
* ``stack``, ``stack+device_put``, ``device_put+stack``: onto some of the source's own devices,
  or between disjoint device sets whose counts divide one another: the larger side lays the
  layout out several times over its devices (a leading ``copies`` axis), so that every transfer
  is shard for shard (see ``Transition._build_stacked``).
* ``relay``: disjoint device sets of different processes whose counts do not divide one another
  (generation on 3 hosts, training on 2): through a layout on gcd(n, m) of the source devices,
  the two legs above (``stack`` there, then ``device_put+stack`` to the target).
* ``device_put``: anything else (non-named shardings; in one process, device counts that do not
  divide): JAX's own ``jax.device_put`` to the target, which may stage through the host. Between
  meshes of different processes JAX cannot do this, and the transition is refused in one line.

Before the first run, ``memory_report()`` gives the peak bytes per device (XLA's compiled memory
analysis where it answers, else the shardings), and a configured budget refuses the transition.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding

from jrlhf.meshes.processes import host_barrier
from jrlhf.reshard import layout
from jrlhf.reshard.memory import ParkedTree, park_to_host
from jrlhf.reshard.processes import stacked, twin

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_compile_events = 0


def _count_compiles(event: str, duration_secs: float, **_: Any) -> None:
    global _compile_events
    if event == _COMPILE_EVENT:
        _compile_events += 1


jax.monitoring.register_event_duration_secs_listener(_count_compiles)


def backend_compile_count() -> int:
    """XLA backend compilations in this process so far (from jax.monitoring events)."""
    return _compile_events


class MemoryBudgetError(RuntimeError):
    """A transition would need more device memory than the configured budget."""


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _identity(tree):
    return tree


def _order(s: NamedSharding) -> tuple:
    return tuple(s.mesh.devices.flat)


def _relabel(s: NamedSharding, order: tuple) -> NamedSharding:
    """The same device -> slice map as ``s``, expressed over the device order ``order``.

    jit requires every operand to list the same devices in the same order. JAX's own device_put
    does this relabelling with logical device ids; we build the equivalent sharding and check the
    index maps agree, so a change in that private detail fails loudly at plan time.
    """
    position = {d: i for i, d in enumerate(order)}
    ids = tuple(position[d] for d in s.mesh.devices.flat)
    mesh = Mesh(
        np.array(order, dtype=object).reshape(s.mesh.devices.shape),
        s.mesh.axis_names,
        axis_types=s.mesh.axis_types,
    )
    return NamedSharding(mesh, s.spec, memory_kind=s.memory_kind, _logical_device_ids=ids)


def _compile(fn, abstract_args):
    # Donated sources rarely alias their targets (shard shapes differ); XLA frees them anyway,
    # so JAX's "donated buffers were not usable" warning is expected here and only noise.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        return fn.lower(abstract_args).compile()


RELAY_AXIS = "relay"


def _relay_spec(shape: tuple[int, ...], g: int) -> PartitionSpec:
    """The relay layout of a leaf over g devices: its first dimension g divides, split over
    them (the rest, and a leaf with no such dimension, replicated)."""
    for i, n in enumerate(shape):
        if g > 1 and n % g == 0:
            return PartitionSpec(*([None] * i), RELAY_AXIS)
    return PartitionSpec()


def _describe(s: Sharding) -> str:
    if isinstance(s, NamedSharding):
        axes = ",".join(f"{n}={k}" for n, k in s.mesh.shape.items())
        ids = ",".join(str(d.id) for d in s.mesh.devices.flat)
        return f"{axes}@{ids}"
    return type(s).__name__


@dataclasses.dataclass(frozen=True)
class LeafKey:
    shape: tuple[int, ...]
    dtype: str
    src: Sharding
    dst: Sharding


@dataclasses.dataclass(frozen=True)
class TransitionKey:
    """What a compiled transition depends on; equal keys share one compiled program."""

    treedef: Any
    leaves: tuple[LeafKey, ...]
    donate: bool
    alias: bool = True  # whether an equivalent layout may share the source's buffers


def path_between(src: frozenset, dst: tuple | frozenset, crosses_processes: bool) -> str:
    """The path a tree laid out over the whole device set ``src`` takes onto the devices
    ``dst`` (named shardings on both sides; see the module's docstring). ``device_put`` when
    ``crosses_processes`` means the move is impossible: JAX moves arrays between processes
    shard for shard only."""
    dst = frozenset(dst)
    if src == dst:
        return "jit"
    if len(src) == len(dst):
        return "device_put+jit"
    if dst < src and len(src) % len(dst) == 0:
        # Onto some of the source's own devices (a migration's tail mesh): through the
        # stacked layout, its first copy on the target's devices (see _build_stacked).
        return "stack"
    if src.isdisjoint(dst):
        # Disjoint device sets of different sizes: through a stacked layout on whichever
        # side is larger (see _build_stacked), when one size divides the other.
        if len(src) % len(dst) == 0:
            return "stack+device_put"
        if len(dst) % len(src) == 0:
            return "device_put+stack"
        if crosses_processes:
            # Counts that do not divide one another, between processes: through a layout
            # on gcd of them (see _build_relay). In one process device_put moves less.
            return "relay"
    return "device_put"


def same_layout(src: Sharding, dst: Sharding, ndim: int) -> bool:
    """Whether ``dst`` holds the same slice of an ``ndim``-dimensional array on the same device
    (and memory kind) as ``src``: moving between them needs no copy."""
    return src == dst or src.is_equivalent_to(dst, ndim)


def transition_key(
    tree: Any, dst_shardings: Any, donate: bool, alias: bool = True
) -> TransitionKey:
    """Key for moving ``tree`` (arrays or ShapeDtypeStructs with ``.sharding``) to ``dst``."""
    leaves, treedef = jax.tree.flatten(tree)
    dst = treedef.flatten_up_to(dst_shardings)
    keys = []
    for x, d in zip(leaves, dst):
        src = getattr(x, "sharding", None)
        if src is None:
            raise ValueError(f"leaf of shape {tuple(x.shape)} has no sharding; cannot plan a move")
        # the dtype's name: bfloat16's array-protocol string is a void type ('<V2')
        keys.append(LeafKey(tuple(x.shape), np.dtype(x.dtype).name, src, d))
    return TransitionKey(treedef, tuple(keys), bool(donate), bool(alias))


class Transition:
    """One compiled move of a tree from its source shardings to target shardings.

    Build it once (``Resharder`` caches it); ``run(tree)`` then compiles nothing. ``compiles``
    counts XLA compilations observed while building and running it.
    """

    def __init__(self, key: TransitionKey, *, budget_bytes: int | None = None):
        self.key = key
        self.treedef = key.treedef
        self.src = [leaf.src for leaf in key.leaves]
        self.dst = [leaf.dst for leaf in key.leaves]
        self.avals = [
            jax.ShapeDtypeStruct(leaf.shape, jax.numpy.dtype(leaf.dtype)) for leaf in key.leaves
        ]
        self.donate = key.donate
        self.budget_bytes = budget_bytes
        self.runs = 0
        self.compiles = 0
        self._compiled = None
        self._relabel: list[NamedSharding | None] = [None] * len(self.src)
        self._twins: list[NamedSharding] | None = None
        before = backend_compile_count()
        self.crosses_processes = self._crosses_processes()
        self.path = self._choose_path()
        if self.path == "device_put" and self.crosses_processes:
            raise ValueError(
                f"reshard {self.describe()}: the target's devices belong to other processes, "
                "and JAX moves arrays between processes only shard for shard (give the two "
                "meshes the same devices, or disjoint ones)"
            )
        if self.path == "jit":
            self._build_jit()
        elif self.path == "device_put+jit":
            self._build_twin()
        elif self.path in ("stack", "stack+device_put", "device_put+stack"):
            self._build_stacked()
        elif self.path == "relay":
            self._build_relay()
        self.compiles += backend_compile_count() - before
        self._memory = self._memory_plan()
        if budget_bytes is not None and self._memory["peak_bytes"] > budget_bytes:
            raise MemoryBudgetError(
                f"reshard {self.describe()} needs {_mib(self._memory['peak_bytes'])} per device "
                f"at peak ({self._memory['method']}), over the budget of {_mib(budget_bytes)}"
            )

    # -- planning ---------------------------------------------------------------------------------
    def _choose_path(self) -> str:
        if not self.src:
            return "empty"
        if self.key.alias and all(
            same_layout(s, d, len(a.shape)) for s, d, a in zip(self.src, self.dst, self.avals)
        ):
            return "alias"
        named = all(isinstance(s, NamedSharding) for s in self.src + self.dst)
        if not named:
            return "device_put"
        src_sets = {frozenset(s.device_set) for s in self.src}
        dst_orders = {_order(d) for d in self.dst}
        if len(src_sets) != 1 or len(dst_orders) != 1:
            return "device_put"
        (src_set,), (order,) = src_sets, dst_orders
        return path_between(src_set, order, self.crosses_processes)

    def _crosses_processes(self) -> bool:
        src = {d.process_index for s in self.src for d in s.device_set}
        dst = {d.process_index for s in self.dst for d in s.device_set}
        return src != dst

    def _abstract(self, shardings) -> list[jax.ShapeDtypeStruct]:
        return [
            jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
            for a, s in zip(self.avals, shardings)
        ]

    def _build_jit(self) -> None:
        order = _order(self.dst[0])
        in_shardings = []
        for i, (s, aval) in enumerate(zip(self.src, self.avals)):
            if _order(s) == order and s._logical_device_ids is None:
                in_shardings.append(s)
                continue
            r = _relabel(s, order)
            if r.devices_indices_map(aval.shape) != s.devices_indices_map(aval.shape):
                raise RuntimeError(f"relabelling {_describe(s)} onto another device order failed")
            self._relabel[i] = r
            in_shardings.append(r)
        self._in_shardings = in_shardings
        fn = jax.jit(
            _identity,
            in_shardings=(in_shardings,),
            out_shardings=self.dst,
            donate_argnums=(0,) if self.donate else (),
        )
        self._compiled = _compile(fn, self._abstract(in_shardings))

    def _build_twin(self) -> None:
        order = _order(self.dst[0])
        self._twins = [twin(s, order, d.memory_kind) for s, d in zip(self.src, self.dst)]
        # The twin is our own temporary: always donate it to the jit that finishes the move.
        fn = jax.jit(
            _identity, in_shardings=(self._twins,), out_shardings=self.dst, donate_argnums=0
        )
        self._in_shardings = self._twins
        self._compiled = _compile(fn, self._abstract(self._twins))

    def _build_stacked(self) -> None:
        """Between device sets of different sizes, one dividing the other, with every transfer
        shard for shard (what JAX can do between processes):

        * ``stack`` (the target's devices some of the source's, c times fewer): one jit on the
          source devices lays the target's layout out c times over them, the first copy on the
          target's devices, which then hold the target's shards: nothing else moves (a jit or
          ``device_put`` from a mesh to a part of it cannot run over several processes);
        * ``stack+device_put`` (more source devices, c times the target's): one jit on the
          source devices lays the target's layout out c times over them (a ``copies`` axis
          in front of the target's mesh); the first copy then moves to the target devices,
          shard for shard, so each target device receives its own slice once;
        * ``device_put+stack`` (c times more target devices): the source layout moves shard for
          shard onto c groups of target devices, which together hold it c times (the stacked
          view); one jit on the target devices lays out the target from there.
        """
        src_order = _order(self.src[0])
        dst_order = _order(self.dst[0])
        if self.path == "stack":
            src_order = (*dst_order, *(d for d in src_order if d not in set(dst_order)))
        if self.path in ("stack", "stack+device_put"):
            self._stacks = [stacked(d, src_order) for d in self.dst]
            ins = []
            for i, (s, aval) in enumerate(zip(self.src, self.avals)):
                r = s if _order(s) == src_order else _relabel(s, src_order)
                if r is not s:
                    if r.devices_indices_map(aval.shape) != s.devices_indices_map(aval.shape):
                        raise RuntimeError(f"relabelling {_describe(s)} failed")
                    self._relabel[i] = r
                ins.append(r)
            self._in_shardings = ins
            if self.path == "stack":
                self._firsts = list(self.dst)
            else:
                self._firsts = [twin(d, src_order[: len(dst_order)]) for d in self.dst]
            fn = jax.jit(_identity, in_shardings=(ins,), out_shardings=self._stacks)
            self._compiled = _compile(fn, self._abstract(ins))
        else:
            n = len(src_order)
            groups = [dst_order[g : g + n] for g in range(0, len(dst_order), n)]
            self._group_twins = [
                [twin(s, group, d.memory_kind) for s, d in zip(self.src, self.dst)]
                for group in groups
            ]
            self._stacks = [
                stacked(s, dst_order, d.memory_kind) for s, d in zip(self.src, self.dst)
            ]
            fn = jax.jit(
                _identity, in_shardings=(self._stacks,), out_shardings=self.dst, donate_argnums=0
            )
            self._in_shardings = self._stacks
            self._compiled = _compile(fn, self._abstract(self._stacks))

    def _build_relay(self) -> None:
        """Between disjoint device sets of n and m devices where neither count divides the
        other: JAX copies between processes shard for shard only, so the tree goes through a
        relay layout on g = gcd(n, m) source devices, taken from the source processes in turn.
        The first leg lays it out there (the ``stack`` path: nothing crosses devices the
        source does not own), the second sends it to each of the m / g groups of g target
        devices and lays the target out from those copies (``device_put+stack``)."""
        src_order = _order(self.src[0])
        g = math.gcd(len(src_order), len(_order(self.dst[0])))
        by_process: dict[int, list[jax.Device]] = {}
        for d in src_order:
            by_process.setdefault(d.process_index, []).append(d)
        rounds = max(len(ds) for ds in by_process.values())
        spread = [ds[i] for i in range(rounds) for ds in by_process.values() if i < len(ds)]
        relay = Mesh(np.array(spread[:g], dtype=object), (RELAY_AXIS,))
        mids = [NamedSharding(relay, _relay_spec(a.shape, g)) for a in self.avals]
        src, mid = (
            self.treedef.unflatten(
                [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s) for a, s in zip(self.avals, ss)]
            )
            for ss in (self.src, mids)
        )
        self._legs = (
            Transition(
                transition_key(src, self.treedef.unflatten(mids), self.donate, alias=False),
                budget_bytes=self.budget_bytes,
            ),
            # the relay layout is this transition's own temporary: always donated
            Transition(
                transition_key(mid, self.treedef.unflatten(self.dst), True, alias=False),
                budget_bytes=self.budget_bytes,
            ),
        )
        paths = tuple(leg.path for leg in self._legs)
        if paths != ("stack", "device_put+stack"):
            raise RuntimeError(f"reshard {self.describe()}: relay legs took {paths}")

    def _relabelled(self, leaves: list[jax.Array]) -> list[jax.Array]:
        """The leaves under the shardings the compiled jit takes (zero-copy relabelling)."""
        return [
            x
            if r is None
            else jax.make_array_from_single_device_arrays(
                x.shape, r, [shard.data for shard in x.addressable_shards]
            )
            for x, r in zip(leaves, self._relabel)
        ]

    def _run_stacked(self, leaves: list[jax.Array]) -> list[jax.Array]:
        if self.path in ("stack", "stack+device_put"):
            stacks = self._compiled(self._relabelled(leaves))
            firsts = []
            for x, first in zip(stacks, self._firsts):
                keep = first.device_set
                shards = [sh.data for sh in x.addressable_shards if sh.device in keep]
                firsts.append(
                    jax.make_array_from_single_device_arrays(x.shape, first, shards, dtype=x.dtype)
                )
            if self.path == "stack":
                return firsts
            out = self._cross(firsts, self.dst)
            del stacks, firsts
            return out
        parts = [self._cross(leaves, twins) for twins in self._group_twins]
        views = []
        for i, (x, view) in enumerate(zip(leaves, self._stacks)):
            shards = [sh.data for part in parts for sh in part[i].addressable_shards]
            views.append(
                jax.make_array_from_single_device_arrays(x.shape, view, shards, dtype=x.dtype)
            )
        del parts
        return self._compiled(views)

    def _cross(self, leaves: list[jax.Array], shardings: list[NamedSharding]) -> list[jax.Array]:
        """``jax.device_put`` shard for shard, between processes when they differ: both sides
        arrive before either starts, and leave once the receivers hold their copies (see the
        device_put+jit path in :meth:`run`)."""
        if self.crosses_processes:
            host_barrier("reshard:start")
        out = jax.device_put(leaves, shardings)
        jax.block_until_ready(out)
        if self.crosses_processes:
            host_barrier("reshard")
        return out

    def _memory_plan(self) -> dict[str, Any]:
        if self.path == "relay":  # each leg checked the budget; the relay layout is freed
            legs = [leg.memory_report() for leg in self._legs]  # into the second leg's jit
            return {
                "path": self.path,
                "donate": self.donate,
                "method": "legs",
                "peak_bytes": max(leg["peak_bytes"] for leg in legs),
                "legs": legs,
            }
        src_b = layout.bytes_per_device(self.src, self.avals)
        dst_b = layout.bytes_per_device(self.dst, self.avals)
        twin_b = layout.bytes_per_device(self._twins, self.avals) if self._twins else {}
        new_b = {} if self.path == "alias" else dst_b  # an alias's target is the source
        devices = set(src_b) | set(dst_b)
        per_device = {d: src_b.get(d, 0) + new_b.get(d, 0) + twin_b.get(d, 0) for d in devices}
        report: dict[str, Any] = {
            "path": self.path,
            "donate": self.donate,
            "source_bytes_per_device": max(src_b.values(), default=0),
            "target_bytes_per_device": max(dst_b.values(), default=0),
            "shardings_peak_bytes": max(per_device.values(), default=0),
        }
        analysis = None
        if self._compiled is not None:
            try:
                analysis = self._compiled.memory_analysis()
            except Exception:  # backends without memory analysis
                analysis = None
        if analysis is not None and analysis.argument_size_in_bytes + analysis.output_size_in_bytes:
            # XLA's numbers are per device of the SPMD program: everything it holds at once.
            xla_peak = (
                analysis.argument_size_in_bytes
                + analysis.output_size_in_bytes
                + analysis.temp_size_in_bytes
                - analysis.alias_size_in_bytes
            )
            # A device that only gives (source side of a separated move) holds just its source.
            only_source = [src_b[d] for d in src_b if d not in dst_b]
            report.update(
                method="xla_memory_analysis",
                peak_bytes=max([xla_peak, *only_source]),
                xla_argument_bytes=analysis.argument_size_in_bytes,
                xla_output_bytes=analysis.output_size_in_bytes,
                xla_temp_bytes=analysis.temp_size_in_bytes,
                xla_alias_bytes=analysis.alias_size_in_bytes,
            )
            if self._twins:
                # The source is still alive while the twin is filled.
                for d in src_b:
                    if d in dst_b:
                        report["peak_bytes"] = max(report["peak_bytes"], xla_peak + src_b[d])
        else:
            report.update(method="shardings", peak_bytes=report["shardings_peak_bytes"])
        return report

    # -- public -----------------------------------------------------------------------------------
    def describe(self) -> str:
        """'fsdp=4,tensor=2@0,..,7 -> data=4,tensor=2@0,2,..' for messages and reports."""
        if not self.src:
            return "(empty tree)"
        return f"{_describe(self.src[0])} -> {_describe(self.dst[0])}"

    def memory_report(self) -> dict[str, Any]:
        """Peak device bytes the transition needs and how they were obtained (computed at build)."""
        return dict(self._memory)

    @property
    def bytes_moved(self) -> int:
        """Bytes that cross devices, from the source and target shardings (through a stacked
        layout: what the shard-for-shard transfer sends, every target slice once, or the
        source layout once per group of target devices)."""
        if not hasattr(self, "_bytes_moved"):
            if self.path == "stack":
                self._bytes_moved = layout.bytes_moved(self.src, self.dst, self.avals)
            elif self.path == "stack+device_put":
                per_device = layout.bytes_per_device(self.dst, self.avals)
                self._bytes_moved = sum(per_device.values())
            elif self.path == "device_put+stack":
                per_device = layout.bytes_per_device(self.src, self.avals)
                copies = len(self._group_twins)
                self._bytes_moved = copies * sum(per_device.values())
            elif self.path == "relay":
                self._bytes_moved = sum(leg.bytes_moved for leg in self._legs)
            else:
                self._bytes_moved = layout.bytes_moved(self.src, self.dst, self.avals)
        return self._bytes_moved

    @property
    def target_shardings(self) -> Any:
        return self.treedef.unflatten(self.dst)

    def run(self, tree: Any) -> Any:
        """Move ``tree`` (which must have the source shardings) to the target shardings."""
        leaves = self.treedef.flatten_up_to(tree)
        for x, s, aval in zip(leaves, self.src, self.avals):
            if x.sharding != s or x.shape != aval.shape:
                raise ValueError(
                    f"input leaf {x.shape} {_describe(x.sharding)} does not match the planned "
                    f"source {aval.shape} {_describe(s)}"
                )
        before = backend_compile_count()
        if self.path == "empty":
            out = leaves
        elif self.path == "alias":
            out = [
                x
                if x.sharding == d
                else jax.make_array_from_single_device_arrays(
                    x.shape, d, [shard.data for shard in x.addressable_shards]
                )
                for x, d in zip(leaves, self.dst)
            ]
        elif self.path == "jit":
            out = self._compiled(self._relabelled(leaves))
        elif self.path in ("stack", "stack+device_put", "device_put+stack"):
            out = self._run_stacked(leaves)
        elif self.path == "relay":
            first, second = self._legs
            out = jax.tree.leaves(second.run(first.run(self.treedef.unflatten(leaves))))
        elif self.path == "device_put+jit":
            # No donate= here: donating into a cross-device device_put crashes the CPU client
            # (jax 0.10.2, segfault). The source is freed below, once the copy has landed.
            if self.crosses_processes:
                # Both sides arrive before either starts: JAX waits only a minute (not
                # configurable) for the other process's transfer server on the first transfer of
                # a job, and processes that run their own calls (asynchronous RL) or start
                # unevenly under load may be further apart than that; this wait is bounded by
                # HOST_BARRIER_TIMEOUT_S.
                host_barrier("reshard:start")
            twins = jax.device_put(leaves, self._twins)
            if self.donate or self.crosses_processes:
                jax.block_until_ready(twins)
            if self.crosses_processes:
                # The receivers have their copies once every process passes this barrier. It
                # uses no device: a sender whose devices sat in a collective (the next
                # all-gather) could not serve the transfer, and a sender may reuse (donate)
                # its buffers only afterwards.
                host_barrier("reshard")
            out = self._compiled(twins)
        else:
            out = jax.device_put(leaves, self.dst, donate=self.donate)
        if self.donate and self.path != "alias":
            # Relabelled views share buffers with the inputs; make the consumed inputs unusable.
            for x in leaves:
                if not x.is_deleted():
                    x.delete()
        self.runs += 1
        self.compiles += backend_compile_count() - before
        return self.treedef.unflatten(list(out))


class Resharder:
    """Moves parameter trees between shardings, one cached ``Transition`` per key.

    ``resharder(params, target_shardings, donate=...)`` plans on first use (compiling, checking the
    memory budget) and afterwards only runs. ``budget_bytes`` caps the per-device peak.
    """

    def __init__(self, budget_bytes: int | None = None):
        self.budget_bytes = budget_bytes
        self._cache: dict[TransitionKey, Transition] = {}

    def plan(
        self, tree: Any, dst_shardings: Any, *, donate: bool = False, alias: bool = True
    ) -> Transition:
        """The (cached) transition for ``tree`` -> ``dst_shardings``; ``tree`` may be abstract
        (ShapeDtypeStructs with ``sharding``). Raises MemoryBudgetError before anything runs.
        ``alias=False``: a copy even where the layouts are the same (an output that must
        outlive the source)."""
        key = transition_key(tree, dst_shardings, donate, alias)
        t = self._cache.get(key)
        if t is None:
            t = Transition(key, budget_bytes=self.budget_bytes)
            self._cache[key] = t
        return t

    def __call__(self, tree: Any, dst_shardings: Any, *, donate: bool = False) -> Any:
        """Reshard ``tree`` to ``dst_shardings``; with ``donate`` the input is consumed."""
        return self.plan(tree, dst_shardings, donate=donate).run(tree)

    def switch(self, tree: Any, dst_shardings: Any, *, keep: str = "device"):
        """Reshard and decide what happens to the source: returns ``(out, kept)``.

        ``keep="none"`` donates the source (kept is None); ``"device"`` keeps it on device (kept is
        the source tree); ``"host"`` parks it in host memory (kept is a ``ParkedTree``; bring it
        back with ``restore_from_host``).
        """
        if keep == "none":
            return self(tree, dst_shardings, donate=True), None
        if keep == "device":
            return self(tree, dst_shardings, donate=False), tree
        if keep == "host":  # parking frees the source: the output must not share its buffers
            out = self.plan(tree, dst_shardings, alias=False).run(tree)
            parked: ParkedTree = park_to_host(tree)
            return out, parked
        raise ValueError(f"keep={keep!r} unknown (use 'none', 'device' or 'host')")

    @property
    def compile_count(self) -> int:
        """XLA compilations made by all cached transitions (builds and runs)."""
        return sum(t.compiles for t in self._cache.values())

    @property
    def transitions(self) -> list[Transition]:
        return list(self._cache.values())

    def clear(self) -> None:
        self._cache.clear()
