"""The search space of execution plans: per-call candidate placements, checked arithmetically.

A call's placement is abstracted as a ``Slot``: a contiguous, aligned, power-of-two slice of the
devices ``[start, start + size)``, a tensor-parallel size and, for training and inference, a
pipeline stage count and an expert-parallel size. Training and inference calls lay their model
out as ``stage x fsdp x expert x tensor`` with the ``fsdp_tp`` rules (the stage and expert axes
only where they are above 1); generation as ``stage x data x tensor`` with ``dp_tp`` (no FSDP:
each decode step must read its weights locally; stages run pipelined decode with a group of
slots in flight a stage, jrlhf.decode.pipelined; no expert axis).
Power-of-two aligned slices are the sub-meshes that nest cleanly (ReaL's device-mesh candidates
are the same shape); they keep the space small without excluding the placements the literature
uses.

Pipeline stages (jrlhf.models.pipeline) split the layers: the stage count must divide the
layer count, and each stage is a whole number of nodes (a slice spanning several nodes), since
inside a node tensor parallelism and FSDP move less than a pipeline's bubble costs
(docs/pipelines.md). An expert axis (jrlhf.models.moe) splits a mixture of experts' experts: its
size divides ``num_experts``, and it carries batch rows outside the routed MLP as ``fsdp`` does.

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
    """A call's devices ``[start, start + size)``, tensor size, pipeline stages and expert ways
    (the rest is fsdp or data); ``rules``: a rule set other than the phase's (generation with
    replicated KV heads)."""

    start: int
    size: int
    tensor: int = 1
    rules: str | None = None
    stages: int = 1
    experts: int = 1

    @property
    def fsdp(self) -> int:
        """The fsdp (or, for generation, data) size: what the other axes leave of the slice."""
        return self.size // (self.tensor * self.stages * self.experts)

    @property
    def devices(self) -> range:
        return range(self.start, self.start + self.size)

    def __str__(self) -> str:
        kv = "kvrep" if self.rules == KV_REPLICATED_RULES else ""
        extra = (f",s{self.stages}" if self.stages > 1 else "") + (
            f",e{self.experts}" if self.experts > 1 else ""
        )
        return f"{self.size}x(t{self.tensor}{kv}{extra})@{self.start}"

    @property
    def shape_key(self) -> tuple[int, int, int, int, int]:
        return (self.start, self.size, self.tensor, self.stages, self.experts)


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
    iteration's samples for inference and generation); it must split over the batch shards
    (``fsdp x expert``).
    """
    start, size, tensor = slot.start, slot.size, slot.tensor
    stages, experts = slot.stages, slot.experts
    if size < 1 or start < 0 or start + size > num_devices:
        return f"slice {start}..{start + size - 1} is outside the {num_devices} devices"
    for name, value in (("tensor", tensor), ("stages", stages), ("experts", experts)):
        if not is_pow2(value):
            return f"{name}={value} is not a power of two"
    generating = call == GENERATE_CALL
    if tensor > devices_per_node * (GENERATION_NODES if generating else 1):
        span = f"{GENERATION_NODES} nodes" if generating else "a node"
        return f"tensor={tensor} exceeds the devices of {span} ({devices_per_node} per node)"
    if size % (tensor * stages * experts):
        return (
            f"tensor={tensor} x stages={stages} x experts={experts} does not divide the slice "
            f"of {size} devices"
        )
    if slot.rules not in (None, KV_REPLICATED_RULES) or (slot.rules and not generating):
        return f"rule set {slot.rules!r} is not a candidate for {call}"
    if generating and experts > 1:
        return "generation meshes take no expert axis here (experts replicate for decode)"
    if stages > 1 and size // stages < devices_per_node:
        return f"stages={stages}: each stage must hold whole nodes ({devices_per_node} devices)"
    if model is not None:
        problem = tensor_problem(model, tensor, kv_replicated=slot.rules == KV_REPLICATED_RULES)
        if problem:
            return problem
        if model.num_layers % stages:
            return f"stages={stages} does not divide num_layers={model.num_layers}"
        if experts > 1 and (not model.is_moe or model.num_experts % experts):
            return f"experts={experts} does not divide num_experts={model.num_experts}"
        if call != GENERATE_CALL and model.hidden_size % slot.fsdp:
            return f"fsdp={slot.fsdp} does not divide hidden_size={model.hidden_size}"
    # Generation is exempt: the trainer rounds decode slots up to the data shards.
    if batch is not None and call != GENERATE_CALL and batch % (slot.fsdp * experts):
        axes = f"fsdp={slot.fsdp}" + (f" x expert={experts}" if experts > 1 else "")
        return f"batch of {batch} rows does not split over {axes}"
    return None


def stage_options(model: ModelConfig | None, size: int, devices_per_node: int) -> list[int]:
    """Stage counts to try on a slice of ``size`` devices: powers of two that divide the layers
    and leave each stage whole nodes (1 always)."""
    out, s = [1], 2
    while model is not None and size // s >= devices_per_node and s <= model.num_layers:
        if model.num_layers % s == 0:
            out.append(s)
        s *= 2
    return out


def expert_options(model: ModelConfig | None, size: int) -> list[int]:
    """Expert-parallel sizes to try: powers of two that divide a mixture of experts' experts
    (1 always; only 1 for a dense model)."""
    out, e = [1], 2
    while model is not None and model.is_moe and e <= min(size, model.num_experts):
        if model.num_experts % e == 0:
            out.append(e)
        e *= 2
    return out


def call_candidates(
    call: str,
    model: ModelConfig | None,
    num_devices: int,
    *,
    batch: int | None = None,
    devices_per_node: int = DEVICES_PER_NODE,
    max_tensor: int | None = None,
    stages: bool = True,
) -> list[Slot]:
    """Every valid slot of ``call`` on ``num_devices`` devices (aligned power-of-two slices;
    for training and inference every expert size and, with ``stages``, every stage count that
    splits the model)."""
    generating = call == GENERATE_CALL
    node_span = devices_per_node * (GENERATION_NODES if generating else 1)
    limit = min(node_span, max_tensor or node_span)
    out = []
    for start, size in slices(num_devices):
        stage_counts = stage_options(model, size, devices_per_node) if stages else [1]
        expert_sizes = [1] if generating else expert_options(model, size)
        tensor = 1
        while tensor <= min(size, limit):
            rules = generation_rules(model, tensor) if generating else None
            for count in stage_counts:
                for experts in expert_sizes:
                    slot = Slot(start, size, tensor, rules, count, experts)
                    problem = slot_problem(
                        call,
                        model,
                        slot,
                        num_devices,
                        batch=batch,
                        devices_per_node=devices_per_node,
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
        same = actor_train is not None and set(actor_train.mesh.device_ids()) == set(slot.devices)
        if same and slot.stages == 1:
            mesh = choose_generation_mesh(actor_train.mesh, slot.tensor)
            return CallPlacement(mesh, rules)
        axes = (("stage", slot.stages),) * (slot.stages > 1) + (
            ("data", slot.fsdp),
            ("tensor", slot.tensor),
        )
        return CallPlacement(MeshSpec(axes, tuple(slot.devices)), rules)
    # stages outermost (each stage whole nodes), the expert axis next to tensor (its dispatch
    # and combine are an all-gather and a reduce-scatter per layer); sizes of 1 are left out
    axes = (
        (("stage", slot.stages),) * (slot.stages > 1)
        + (("fsdp", slot.fsdp),)
        + (("expert", slot.experts),) * (slot.experts > 1)
        + (("tensor", slot.tensor),)
    )
    return CallPlacement(MeshSpec(axes, tuple(slot.devices)), PHASE_RULES[CALLS[call][1]])


def build_plan(name: str, slots: Mapping[str, Slot]) -> ExecutionPlan:
    """An ExecutionPlan from one slot per call (actor_train first: generation may follow it)."""
    train = placement("actor_train", slots["actor_train"])
    placements = {call: placement(call, slots[call], train) for call in CALLS}
    return ExecutionPlan(name, tuple(placements.items()))


def slot_of(placement_: CallPlacement) -> Slot | None:
    """The slot a placement occupies, or None when it is not a contiguous slice with the axes
    ``placement`` lays out ((stage,) X, (expert,) tensor)."""
    mesh = placement_.mesh
    ids = sorted(mesh.device_ids())
    if ids != list(range(ids[0], ids[0] + len(ids))):
        return None
    names = list(mesh.names)
    if names[:1] == ["stage"]:
        names = names[1:]
    if not names:
        return None
    if len(names) > 1 and names[-1] != "tensor":
        return None
    inner = names[1:-1] if len(names) > 1 else []
    if len(names) > 3 or inner not in ([], ["expert"]) or names[0] in ("stage", "expert"):
        return None
    return placement_slot(placement_)


def placement_slot(placement_: CallPlacement) -> Slot:
    """The slot ``placement_``'s mesh spans (its first device, device count, tensor, stage and
    expert ways, and the KV-replicated rules where it uses them), whatever its layout."""
    mesh = placement_.mesh
    rules = placement_.rules if placement_.rules == KV_REPLICATED_RULES else None
    shape = mesh.shape
    return Slot(
        min(mesh.device_ids()),
        len(mesh.device_ids()),
        shape.get("tensor", 1),
        rules,
        shape.get("stage", 1),
        shape.get("expert", 1),
    )


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
