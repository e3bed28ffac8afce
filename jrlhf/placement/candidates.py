"""The search space of execution plans: per-call candidate placements, checked arithmetically.

A call's placement is abstracted as a ``Slot``: a contiguous, aligned, power-of-two slice of the
devices ``[start, start + size)`` and a tensor-parallel size. Training and inference calls lay
their model out as ``fsdp x tensor`` with the ``fsdp_tp`` rules; generation as ``data x tensor``
with ``dp_tp`` (no FSDP: each decode step must read its weights locally). Power-of-two aligned
slices are the sub-meshes that nest cleanly (ReaL's device-mesh candidates are the same shape);
they keep the space small without excluding the placements the literature uses.

Everything is checked from the model's dimensions alone, with no devices, so a plan for 128 H100s
can be searched on a laptop: a tensor size must divide the attention heads, the KV heads, the MLP
width and the vocabulary (the rules shard all four over ``tensor``), the FSDP size must divide the
hidden size (``embed`` is sharded over ``fsdp``), and the batch must split over the batch axes.

Tensor parallelism stays inside a node, with one exception: generation may span two nodes
(``GENERATION_NODES``), as 405B-class models are served (a 405B model's bf16 weights are 94.5 GiB
per device at tensor 8). A generation tensor size above the KV heads replicates them
(``dp_tp_kv_replicated``: every shard holds all KV heads and attends with its own).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from jrlhf.meshes.mesh import MeshSpec
from jrlhf.meshes.rules import PHASE_RULES
from jrlhf.models.config import ModelConfig
from jrlhf.placement.plan import CALLS, CallPlacement, ExecutionPlan
from jrlhf.reshard.layout import choose_generation_mesh

# Which model each call runs (the role), and the call a model-less call follows (see below).
GENERATE_CALL = "actor_generate"
DEVICES_PER_NODE = 8  # H100/H200 HGX nodes: tensor parallelism stays inside NVLink
GENERATION_NODES = 2  # the nodes a generation tensor group may span
KV_REPLICATED_RULES = "dp_tp_kv_replicated"


@dataclasses.dataclass(frozen=True, order=True)
class Slot:
    """A call's devices ``[start, start + size)`` and tensor size (the rest is fsdp or data);
    ``rules``: a rule set other than the phase's (generation with replicated KV heads)."""

    start: int
    size: int
    tensor: int = 1
    rules: str | None = None

    @property
    def devices(self) -> range:
        return range(self.start, self.start + self.size)

    def __str__(self) -> str:
        kv = "kvrep" if self.rules == KV_REPLICATED_RULES else ""
        return f"{self.size}x(t{self.tensor}{kv})@{self.start}"

    @property
    def shape_key(self) -> tuple[int, int, int]:
        return (self.start, self.size, self.tensor)


def is_pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def slices(num_devices: int) -> list[tuple[int, int]]:
    """All aligned power-of-two slices (start, size) of ``num_devices`` devices, biggest first."""
    out, size = [], 1
    while size <= num_devices:
        out.extend((start, size) for start in range(0, num_devices - size + 1, size))
        size *= 2
    return sorted(out, key=lambda s: (-s[1], s[0]))


def tensor_problem(model: ModelConfig, tensor: int, kv_replicated: bool = False) -> str | None:
    """Why ``tensor`` cannot split ``model`` (None when it can); with ``kv_replicated`` the KV
    heads are not split, but each shard's query heads must nest with a KV head's group."""
    dims = {
        "num_heads": model.num_heads,
        "num_kv_heads": model.num_kv_heads,
        "intermediate_size": model.intermediate_size,
        "vocab_size": model.vocab_size,
    }
    if kv_replicated:
        del dims["num_kv_heads"]
    for name, value in dims.items():
        if value % tensor:
            return f"tensor={tensor} does not divide {name}={value}"
    if kv_replicated:
        local, group = model.num_heads // tensor, model.num_heads // model.num_kv_heads
        if local % group and group % local:
            return f"tensor={tensor}: {local} query heads per shard do not nest with KV groups"
    return None


def generation_rules(model: ModelConfig | None, tensor: int) -> str | None:
    """The rule set of a generation slot: None (the phase's dp_tp) unless ``tensor`` does not
    divide the KV heads, which are then replicated."""
    if model is not None and model.num_kv_heads % tensor:
        return KV_REPLICATED_RULES
    return None


def slot_problem(
    call: str,
    model: ModelConfig | None,
    slot: Slot,
    num_devices: int,
    *,
    batch: int | None = None,
    devices_per_node: int = DEVICES_PER_NODE,
) -> str | None:
    """Why ``slot`` is not a valid placement of ``call`` (None when it is).

    ``batch`` is the number of rows the call's batch axis carries (the train minibatch, or the
    iteration's samples for inference and generation); it must split over ``size / tensor``.
    """
    start, size, tensor = slot.start, slot.size, slot.tensor
    if size < 1 or start < 0 or start + size > num_devices:
        return f"slice {start}..{start + size - 1} is outside the {num_devices} devices"
    if not is_pow2(tensor):
        return f"tensor={tensor} is not a power of two"
    generating = call == GENERATE_CALL
    if tensor > devices_per_node * (GENERATION_NODES if generating else 1):
        span = f"{GENERATION_NODES} nodes" if generating else "a node"
        return f"tensor={tensor} exceeds the devices of {span} ({devices_per_node} per node)"
    if size % tensor:
        return f"tensor={tensor} does not divide the slice of {size} devices"
    if slot.rules not in (None, KV_REPLICATED_RULES) or (slot.rules and not generating):
        return f"rule set {slot.rules!r} is not a candidate for {call}"
    if model is not None:
        problem = tensor_problem(model, tensor, kv_replicated=slot.rules == KV_REPLICATED_RULES)
        if problem:
            return problem
        shards = size // tensor
        if call != GENERATE_CALL and model.hidden_size % shards:
            return f"fsdp={shards} does not divide hidden_size={model.hidden_size}"
    # Generation is exempt: the trainer rounds decode slots up to the data shards.
    if batch is not None and call != GENERATE_CALL and batch % (size // tensor):
        return f"batch of {batch} rows does not split over fsdp={size // tensor}"
    return None


def call_candidates(
    call: str,
    model: ModelConfig | None,
    num_devices: int,
    *,
    batch: int | None = None,
    devices_per_node: int = DEVICES_PER_NODE,
    max_tensor: int | None = None,
) -> list[Slot]:
    """Every valid slot of ``call`` on ``num_devices`` devices (aligned power-of-two slices)."""
    node_span = devices_per_node * (GENERATION_NODES if call == GENERATE_CALL else 1)
    limit = min(node_span, max_tensor or node_span)
    out = []
    for start, size in slices(num_devices):
        tensor = 1
        while tensor <= min(size, limit):
            rules = generation_rules(model, tensor) if call == GENERATE_CALL else None
            slot = Slot(start, size, tensor, rules)
            problem = slot_problem(
                call, model, slot, num_devices, batch=batch, devices_per_node=devices_per_node
            )
            if problem is None:
                out.append(slot)
            tensor *= 2
    return out


def placement(call: str, slot: Slot, actor_train: CallPlacement | None = None) -> CallPlacement:
    """The CallPlacement of ``slot``; a generation slot on exactly the actor's training devices
    is ordered for zero-redundancy resharding (jrlhf.reshard.choose_generation_mesh), as
    ``plan.flatten`` does."""
    if call == GENERATE_CALL:
        rules = slot.rules or PHASE_RULES["generate"]
        if actor_train is not None and set(actor_train.mesh.device_ids()) == set(slot.devices):
            mesh = choose_generation_mesh(actor_train.mesh, slot.tensor)
            return CallPlacement(mesh, rules)
        axes = (("data", slot.size // slot.tensor), ("tensor", slot.tensor))
        return CallPlacement(MeshSpec(axes, tuple(slot.devices)), rules)
    axes = (("fsdp", slot.size // slot.tensor), ("tensor", slot.tensor))
    return CallPlacement(MeshSpec(axes, tuple(slot.devices)), PHASE_RULES[CALLS[call][1]])


def build_plan(name: str, slots: Mapping[str, Slot]) -> ExecutionPlan:
    """An ExecutionPlan from one slot per call (actor_train first: generation may follow it)."""
    train = placement("actor_train", slots["actor_train"])
    placements = {call: placement(call, slots[call], train) for call in CALLS}
    return ExecutionPlan(name, tuple(placements.items()))


def slot_of(placement_: CallPlacement) -> Slot | None:
    """The slot a placement occupies, or None when it is not a contiguous (X, tensor) slice."""
    mesh = placement_.mesh
    ids = sorted(mesh.device_ids())
    if ids != list(range(ids[0], ids[0] + len(ids))):
        return None
    names = mesh.names
    if len(names) > 2 or (len(names) == 2 and names[1] != "tensor"):
        return None
    rules = placement_.rules if placement_.rules == KV_REPLICATED_RULES else None
    return Slot(ids[0], len(ids), mesh.shape.get("tensor", 1), rules)


def slots_of(plan: ExecutionPlan) -> dict[str, Slot] | None:
    """Slots of every call of ``plan``, or None when some placement is not a slot."""
    out = {}
    for call in CALLS:
        slot = slot_of(plan[call])
        if slot is None:
            return None
        out[call] = slot
    return out


def call_models(workload) -> dict[str, ModelConfig | None]:
    """The model each call runs, from a Workload (None where the role is absent)."""
    return {call: getattr(workload, role) for call, (role, _) in CALLS.items()}


def call_batches(workload) -> dict[str, int]:
    """Rows on each call's batch axis: the train minibatch, else all samples of the iteration."""
    rows = workload.prompts * workload.samples_per_prompt
    return {
        call: workload.minibatch_size if phase == "train" else rows
        for call, (_, phase) in CALLS.items()
    }
