"""Role groups: the processes that own each side of an asynchronous iteration.

A plan puts every call (the actor's generation, the scoring calls, the updates) on devices; the
processes owning the actor's generation devices form the *generating group*, every other process
the *training group* (scoring and the updates, however the plan splits them between its
processes). When the two groups share no process and ``Asynchrony.max_staleness >= 1``, each runs
its own calls at its own pace: host reads and agreements stay inside the group
(``jrlhf.meshes.batch.process_group``), batches cross through the sample channel and weights
through the weight channel, and the groups meet once per iteration. Any number of processes per
group: e.g. 4 processes with generation on 0-1 and the rest on 2-3, or generation on 0, scoring
on 1 and training on 2-3.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping

import jax

from jrlhf.ppo.samples import SampleChannel
from jrlhf.runtime.roles import RoleSetup

log = logging.getLogger("jrlhf")


@dataclasses.dataclass(frozen=True)
class RoleGroups:
    """The generating and the training group (process indices)."""

    generate: frozenset[int]
    train: frozenset[int]

    @property
    def side(self) -> str:
        """This process's side: ``"generate"`` or ``"train"``."""
        return "generate" if jax.process_index() in self.generate else "train"

    def describe(self) -> str:
        return f"generation on processes {sorted(self.generate)}, the rest on {sorted(self.train)}"


def _owners(mesh) -> set[int]:
    return {d.process_index for d in mesh.devices.flat}


def role_groups(rl, roles: Mapping[str, RoleSetup]) -> RoleGroups | None:
    """The groups of an asynchronous run whose generation has processes of its own, else None
    (every process runs every call, in lockstep: one process, ``max_staleness = 0``, or a plan
    whose generation shares a process with another call, which is said in the log)."""
    if not rl.asynchrony.max_staleness or jax.process_count() == 1:
        return None
    gen = _owners(roles["actor"].meshes["generate"])
    rest = set().union(*(
        _owners(mesh)
        for role, setup in roles.items()
        for phase, mesh in setup.meshes.items()
        if (role, phase) != ("actor", "generate")
    ))  # fmt: skip
    if gen & rest:
        log.warning(
            "Asynchrony.max_staleness=%d: generation (processes %s) shares processes %s with the "
            "other calls, so every process runs every call in lockstep, without overlap; give "
            "the actor's generate mesh processes of its own to overlap generation and training",
            rl.asynchrony.max_staleness, sorted(gen), sorted(gen & rest),
        )  # fmt: skip
        return None
    if 0 not in gen:
        # Process 0 writes the logs and the checkpoint's meta, whose batches in flight are the
        # generating group's.
        raise ValueError(
            f"Asynchrony.max_staleness={rl.asynchrony.max_staleness} with generation on processes "
            f"{sorted(gen)}: the generating group must include process 0 (it writes the logs "
            "and the checkpoint of the batches in flight); put the actor's generate mesh on "
            "the first processes' devices"
        )
    if rl.memory.generation_copy != "kept":
        raise ValueError(
            "Memory.generation_copy='dropped' with generation on processes of its own: the "
            "copy lives on devices no other call uses, so dropping it frees nothing; keep it"
        )
    if rl.fusion.migrate_rows:
        raise ValueError(
            "Fusion.migrate_rows with generation on processes of its own: no scoring call runs "
            "on the generation devices, so moving the long tail off them frees nothing; set 0"
        )
    groups = RoleGroups(frozenset(gen), frozenset(range(jax.process_count())) - frozenset(gen))
    log.info("asynchronous groups: %s", groups.describe())
    return groups


def sample_channel(roles: Mapping[str, RoleSetup], groups: RoleGroups) -> SampleChannel:
    """The channel from the generating group (its first generation device stages batches) to
    every process of the training group (the first device it uses receives them)."""
    gen = list(roles["actor"].meshes["generate"].devices.flat)
    sinks: dict[int, jax.Device] = {}
    for setup in roles.values():
        for mesh in setup.meshes.values():
            for d in mesh.devices.flat:
                if d.process_index in groups.train:
                    sinks.setdefault(d.process_index, d)
    first = {}
    for d in jax.devices():  # a training process that runs no call still joins the group
        first.setdefault(d.process_index, d)
    train = [sinks.get(p, first[p]) for p in sorted(groups.train)]
    return SampleChannel(gen[0], train, readers=sorted(groups.generate))
