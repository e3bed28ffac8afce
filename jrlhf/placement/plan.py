"""Execution plans: where each model call of an RLHF iteration runs and how it is sharded.

An iteration makes six model calls (ReaL's view of the dataflow)::

    actor_generate -> reference_infer, reward_infer, critic_infer -> actor_train, critic_train

A plan gives every call a device slice with mesh axis sizes (a ``MeshSpec``) and a rule-set name.
Between calls, parameters move along *reshard edges*: the actor's weights from ``actor_train`` to
``actor_generate`` after every update, and the critic's from ``critic_train`` to ``critic_infer``
when those differ. The reference and reward models are frozen and live where their call runs.

The named strategies of the literature are plan constructors:

- ``flatten``: every call on all devices with one training layout (generation drops FSDP);
- ``interleave``: like flatten, but the three independent inference calls run at the same time on
  disjoint device slices (JAX dispatches asynchronously, so they overlap);
- ``separate``: generation on its own slice with a shadow copy of the actor, refreshed by
  resharding after each training step; training and inference on the rest.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from jrlhf.meshes.mesh import MeshSpec
from jrlhf.meshes.rules import PHASE_RULES, RULE_SETS
from jrlhf.reshard.layout import choose_generation_mesh

# call name -> (role, phase) in RoleConfig terms
CALLS: dict[str, tuple[str, str]] = {
    "actor_generate": ("actor", "generate"),
    "reference_infer": ("reference", "infer"),
    "reward_infer": ("reward", "infer"),
    "critic_infer": ("critic", "infer"),
    "actor_train": ("actor", "train"),
    "critic_train": ("critic", "train"),
}
INFERENCE_CALLS = ("reference_infer", "reward_infer", "critic_infer")
# A model call outside the RL iteration: the reward model's supervised stage. Unless placed
# explicitly (a RoleConfig mesh) it runs where the reward model scores.
STAGE_CALLS: dict[str, tuple[str, str]] = {"reward_train": ("reward", "train")}
STAGE_DEFAULTS = {"reward_train": "reward_infer"}
STRATEGIES = ("flatten", "interleave", "separate")


@dataclasses.dataclass(frozen=True)
class CallPlacement:
    """A call's devices and mesh axes, and the rule set that lays its model out on them."""

    mesh: MeshSpec
    rules: str

    def __post_init__(self):
        if isinstance(self.mesh, str):
            object.__setattr__(self, "mesh", MeshSpec.parse(self.mesh))
        if self.rules not in RULE_SETS:
            raise ValueError(f"unknown rule set {self.rules!r} (known: {sorted(RULE_SETS)})")

    @property
    def devices(self) -> frozenset[int]:
        return frozenset(self.mesh.device_ids())

    def __str__(self) -> str:
        return f"{self.mesh} [{self.rules}]"


@dataclasses.dataclass(frozen=True)
class ReshardEdge:
    """Parameters of ``role`` move from ``src`` call's layout to ``dst`` call's layout."""

    role: str
    src: str
    dst: str


@dataclasses.dataclass(frozen=True)
class ExecutionPlan:
    """A placement for every model call; hashable, printable, and writable as gin bindings."""

    name: str
    placements: tuple[tuple[str, CallPlacement], ...]
    # placements of STAGE_CALLS that differ from their default (reward_train on reward_infer)
    stage_placements: tuple[tuple[str, CallPlacement], ...] = ()

    def __post_init__(self):
        unknown = sorted({c for c, _ in self.stage_placements} - set(STAGE_CALLS))
        if unknown:
            raise ValueError(f"plan {self.name!r}: unknown stage call(s) {unknown}")
        names = [c for c, _ in self.placements]
        unknown = sorted(set(names) - set(CALLS))
        if unknown:
            raise ValueError(
                f"plan {self.name!r}: unknown call(s) {unknown} (known: {list(CALLS)})"
            )
        missing = sorted(set(CALLS) - set(names))
        if missing:
            raise ValueError(f"plan {self.name!r}: no placement for {missing}")

    @classmethod
    def of(cls, name: str, **calls: CallPlacement | tuple[str, str]) -> ExecutionPlan:
        placements = tuple(
            (call, p if isinstance(p, CallPlacement) else CallPlacement(*p))
            for call, p in calls.items()
        )
        return cls(name, placements)

    def __getitem__(self, call: str) -> CallPlacement:
        for name, placement in self.placements + self.stage_placements:
            if name == call:
                return placement
        if call in STAGE_DEFAULTS:
            return self[STAGE_DEFAULTS[call]]
        raise KeyError(f"plan {self.name!r} has no call {call!r}")

    def for_role(self, role: str, phase: str) -> CallPlacement:
        """The placement of ``role`` in ``phase`` (an RL call or a supervised stage's)."""
        for call, rp in (*CALLS.items(), *STAGE_CALLS.items()):
            if rp == (role, phase):
                return self[call]
        raise KeyError(f"no model call runs the {role} in phase {phase!r}")

    def reshard_edges(self) -> list[ReshardEdge]:
        """Where trained parameters move after each update: the actor to its generation layout
        (always; the resharder aliases the training copy when the layouts agree), the critic to
        its inference layout when that differs from its training layout."""
        edges = [ReshardEdge("actor", "actor_train", "actor_generate")]
        if self["critic_infer"] != self["critic_train"]:
            edges.append(ReshardEdge("critic", "critic_train", "critic_infer"))
        return edges

    def num_devices(self) -> int:
        return len(frozenset().union(*(p.devices for _, p in self.placements)))

    def validate(self, num_devices: int) -> None:
        """One-line errors for slices that do not exist on ``num_devices`` devices."""
        for call, placement in self.placements + self.stage_placements:
            ids = placement.mesh.device_ids()
            if max(ids) >= num_devices:
                raise ValueError(
                    f"plan {self.name!r}: {call} mesh {placement.mesh} needs device "
                    f"{max(ids)} but only {num_devices} devices exist"
                )

    def overlapping_inference(self, calls: Iterable[str] = INFERENCE_CALLS) -> bool:
        """Whether the given inference calls (default: all three) sit on pairwise disjoint
        devices, so they can run at the same time."""
        sets = [self[c].devices for c in calls]
        return all(not (a & b) for i, a in enumerate(sets) for b in sets[i + 1 :])

    def to_gin(self, header: str = "") -> str:
        """Gin bindings that make the trainer run this plan."""
        lines = [f"# {line}" for line in header.splitlines()] if header else []
        lines.append(f"# execution plan {self.name!r}")
        lines.append("RunConfig.placement = 'custom'")
        for call, (role, phase) in (*CALLS.items(), *STAGE_CALLS.items()):
            p = self[call]
            lines.append(f"{role}/RoleConfig.{phase}_mesh = '{p.mesh}'")
            lines.append(f"{role}/RoleConfig.{phase}_rules = '{p.rules}'")
        return "\n".join(lines) + "\n"

    def rows(self) -> list[tuple[str, str, str]]:
        """(call, mesh, rules) for every call, the supervised stage's included."""
        calls = (*CALLS, *STAGE_CALLS)
        return [(call, str(self[call].mesh), self[call].rules) for call in calls]

    def describe(self) -> str:
        """One line naming every call's mesh and rules (the run log's)."""
        rows = "; ".join(f"{call} {mesh} [{rules}]" for call, mesh, rules in self.rows())
        return f"execution plan {self.name!r}: {rows}"


def _axes(n: int, tensor: int, first: str) -> dict[str, int]:
    if n % tensor:
        raise ValueError(f"tensor size {tensor} does not divide a slice of {n} devices")
    return {first: n // tensor, "tensor": tensor}


def _spec(first: str, n: int, tensor: int, devices: Iterable[int]) -> MeshSpec:
    return MeshSpec(tuple(_axes(n, tensor, first).items()), tuple(devices))


def default_tensor(n: int, limit: int = 2) -> int:
    """The largest power of two <= limit dividing n (2 on the CPU test setup)."""
    t = 1
    while t * 2 <= limit and n % (t * 2) == 0:
        t *= 2
    return t


def flatten(num_devices: int, tensor: int | None = None, gen_tensor: int | None = None):
    """All calls on all devices: training fsdp x tensor, generation data x tensor (same devices)."""
    tensor = tensor or default_tensor(num_devices)
    gen_tensor = gen_tensor or tensor
    devices = range(num_devices)
    train = _spec("fsdp", num_devices, tensor, devices)
    gen = choose_generation_mesh(train, gen_tensor)
    p = CallPlacement(train, PHASE_RULES["train"])
    return ExecutionPlan.of(
        "flatten",
        actor_generate=CallPlacement(gen, PHASE_RULES["generate"]),
        reference_infer=p,
        reward_infer=p,
        critic_infer=p,
        actor_train=p,
        critic_train=p,
    )


def _slices(num_devices: int, parts: int) -> list[range]:
    """Split devices into ``parts`` contiguous slices of power-of-two sizes (largest first)."""
    if num_devices < parts:
        raise ValueError(f"cannot split {num_devices} devices into {parts} disjoint slices")
    if num_devices % parts == 0:
        size = num_devices // parts
        return [range(i * size, (i + 1) * size) for i in range(parts)]
    # e.g. 8 devices into 3: 4 + 2 + 2
    sizes, left = [], num_devices
    for i in range(parts):
        remaining_parts = parts - i
        size = left // 2 if remaining_parts > 1 and left // 2 >= remaining_parts - 1 else left
        if remaining_parts > 1 and left - size < remaining_parts - 1:
            size = left - (remaining_parts - 1)
        sizes.append(size)
        left -= size
    out, start = [], 0
    for size in sizes:
        out.append(range(start, start + size))
        start += size
    return out


def interleave(num_devices: int, tensor: int | None = None, gen_tensor: int | None = None):
    """Flatten for generation and training; reference, reward and critic inference on three
    disjoint slices so they run concurrently."""
    base = flatten(num_devices, tensor, gen_tensor)
    placements = dict(base.placements)
    for call, devices in zip(INFERENCE_CALLS, _slices(num_devices, 3)):
        t = default_tensor(len(devices), tensor or 2)
        placements[call] = CallPlacement(
            _spec("fsdp", len(devices), t, devices), PHASE_RULES["infer"]
        )
    return ExecutionPlan("interleave", tuple(placements.items()))


def separate(
    num_devices: int,
    gen_devices: int | None = None,
    tensor: int | None = None,
    gen_tensor: int | None = None,
):
    """Generation on the first ``gen_devices`` devices, training and inference on the rest."""
    gen_devices = gen_devices or num_devices // 2
    if not 0 < gen_devices < num_devices:
        raise ValueError(f"separate: gen_devices {gen_devices} must be in 1..{num_devices - 1}")
    rest = num_devices - gen_devices
    tensor = tensor or default_tensor(rest)
    gen_tensor = gen_tensor or default_tensor(gen_devices, tensor)
    gen = _spec("data", gen_devices, gen_tensor, range(gen_devices))
    train_mesh = _spec("fsdp", rest, tensor, range(gen_devices, num_devices))
    train = CallPlacement(train_mesh, PHASE_RULES["train"])
    return ExecutionPlan.of(
        "separate",
        actor_generate=CallPlacement(gen, PHASE_RULES["generate"]),
        reference_infer=train,
        reward_infer=train,
        critic_infer=train,
        actor_train=train,
        critic_train=train,
    )


def strategy(name: str, num_devices: int, **kwargs) -> ExecutionPlan:
    """A named strategy's plan for ``num_devices`` devices."""
    builders = {"flatten": flatten, "interleave": interleave, "separate": separate}
    if name not in builders:
        raise ValueError(f"unknown plan strategy {name!r} (known: {', '.join(builders)})")
    return builders[name](num_devices, **kwargs)
