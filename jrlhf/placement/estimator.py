"""Cost estimator for execution plans: per-call seconds, reshard seconds, and memory per device.

Every call is priced from FLOPs and bytes against a ``DeviceProfile``:

* compute: FLOPs / (achieved matmul FLOP/s x a fitted per-kind efficiency);
* activations: the elementwise work between the matmuls streams each layer's live activations,
  priced at a fitted fraction of the memory bandwidth (``forward_activation_efficiency``,
  ``train_activation_efficiency``; 0 folds it into the efficiencies, as on accelerators, where
  it fuses into the matmul kernels). On XLA's CPU backend it grows with tokens x width, not
  with FLOPs, and decides much of a small model's time;
* decode: each step runs one token per sequence through the matmuls, at
  ``max(compute, weight shard bytes / bandwidth) / decode_efficiency`` (on a shared host with
  ``decode_weight_efficiency``: the FLOPs at ``decode_efficiency`` plus every device program's
  weight shard at that fraction of the bandwidth), and its attention reads
  the KV pages the kernel visits (``attended_context``) at ``decode_kv_efficiency`` x the
  bandwidth;
* collectives: FSDP all-gathers of weights (and reduce-scatter of gradients), the all-reduce of
  the gradients of weights replicated over the batch (data parallelism), tensor-parallel
  all-reduces of activations (two per layer forward, four forward + backward), priced by bytes per
  device over the intra- or inter-node bandwidth (whichever the call's device span needs);
* fixed costs: per jitted call, per layer (kernel launches / small ops), per decode step, per
  generate call (``decode_call_overhead_s``: the engine's host work, dispatch and syncs; and on
  a shared host the unrolled decode's per-layer weight copies, ``decode_copy_efficiency``).

The call structure follows the trainer: generation keeps ``Workload.decode_slots`` sequences in
flight (the KV pool holds that many at full length; with uniform lengths the rows decode in
ceil(rows / slots) waves of gen_len - 1 steps, each step reading the weights once); scoring runs
one call per ``infer_batch_size`` rows (each paying dispatch and FSDP gathers; memory for one
chunk); training accumulates gradients over the role's micro-batches (activations of one
micro-batch, FSDP gathers and gradient reduce-scatter per micro-batch; with unrolled layers,
``layers_unrolled``, the gathers once per step) with one optimizer update per minibatch. Calls
of one phase on pairwise disjoint devices (scoring calls, actor and critic training) run at the
same time (``concurrent_seconds``; on a shared host only as far as
one call leaves the cores idle, ``call_core_share``); on shared devices they run in turn.

Reshard bytes come from the shardings themselves, computed arithmetically from the ``MeshSpec``
and rule set (the same partitioning ``NamedSharding`` uses), so plans over devices that do not
exist here (128 H100s) are priced too; ``tests/placement/test_plan_estimator.py`` checks the
arithmetic against ``jrlhf.reshard.layout.bytes_moved`` on real (fake CPU) devices. A move between
disjoint device sets is priced as the resharder runs it: a shard-for-shard copy of the source layout
onto the target devices (so only the source's bytes cross the links between the two sets), then the
same-devices reshard there. Between the same layouts the resharder aliases the source: no time,
and no generation copy in memory.

Memory per device is what lives there during the call's phase (train states with fp32 AdamW
moments, the actor's generation copy, frozen models, the KV pool; the memory knobs take some of
them off the devices outside their phases, as ``jrlhf.ppo.residency`` does) plus what the
running call needs transiently (gradients, activations under the remat policy, FSDP-gathered
weights of one scanned layer at a time, or of every layer where they run unrolled, plus the
embedding and head, logits);
``tests/placement/test_plan_estimator.py`` compares the transient bytes with XLA's memory analysis
of the trainer's compiled steps. A plan fits when every call's peak is within the profile's
``usable_bytes`` (its memory less the reserve).

Memory knobs (``tune_batches`` chooses them per plan with the batch knobs): the remat policy of
each training call (in the role's ModelConfig), a dropped generation copy (no time: the reshard
after the update rebuilds it anyway) and state offloaded to host memory (``Memory.offload``:
each item crosses the host link once each way per iteration, at ``host_bandwidth``, in the
phases where the trainer moves it).
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
import math
import types
from collections.abc import Mapping, Sequence

import jax
import numpy as np

from jrlhf.config import DROPPED_COPY_PHASES, OFFLOAD_PHASES
from jrlhf.decode.kernels.blocked import pages_per_block
from jrlhf.meshes.mesh import MeshSpec, pick_replicas, replica_groups
from jrlhf.meshes.rules import axis_size, get_rules, logical_to_spec, path_str
from jrlhf.models import fused_schedule
from jrlhf.models import lora as lora_lib
from jrlhf.models.config import PIPELINE_SCHEDULES, ModelConfig
from jrlhf.models.lora import LoraConfig
from jrlhf.models.model_def import ModelDef
from jrlhf.models.pipeline import bubble_fraction
from jrlhf.placement.plan import CALLS, INFERENCE_CALLS, CallPlacement, ExecutionPlan, ReshardEdge
from jrlhf.placement.profile import DeviceProfile
from jrlhf.placement.workload import (
    Workload,
    activation_bytes_per_token,
    attention_is_fused,
    decode_step_flops,
    forward_flops,
    head_params,
    itemsize,
    kv_bytes_per_token,
    mlp_width,
    num_params,
)
from jrlhf.reshard.layout import moved_elements
from jrlhf.reshard.resharder import path_between

replace = dataclasses.replace

PHASES = ("generate", "score", "train", "reshard")
# The trainer phase each kind of call runs in (residents are per phase).
CALL_PHASE = {"generate": "generate", "infer": "score", "train": "train"}
MOMENT_BYTES = 8  # AdamW mu + nu, float32 each
GIB = 2**30


@dataclasses.dataclass
class PlanEstimate:
    plan: ExecutionPlan
    call_seconds: dict[str, float]  # every call in CALLS (0 for calls the workload lacks)
    reshard_seconds: dict[str, float]  # per ReshardEdge, keyed by role
    phase_seconds: dict[str, float]  # the trainer's phases: generate, score, train, reshard
    iteration_seconds: float
    memory_bytes: dict[str, int]  # peak bytes per device for each call
    fits: bool
    reasons: list[str]
    # the workload priced: with ``estimate_tuned``, the config's with the batch knobs chosen
    # for this plan (scoring chunk, micro-batches)
    workload: Workload | None = None
    # seconds of host-memory copies per offloaded item (included in phase_seconds)
    offload_seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    # for each call: what its most loaded device holds at its peak ({what: bytes}, "working"
    # being the call's transient bytes)
    memory_breakdown: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    # seconds of the sample channel's transfer on the training group's side of an asynchronous
    # iteration (``group_traffic``; 0 where no samples cross between processes)
    data_plane_seconds: float = 0.0

    def summary(self) -> str:
        phases = ", ".join(f"{k} {v:.3g}s" for k, v in self.phase_seconds.items())
        mem = max(self.memory_bytes.values(), default=0) / GIB
        verdict = "fits" if self.fits else "DOES NOT FIT: " + "; ".join(self.reasons)
        head = f"{self.plan.name}: {self.iteration_seconds:.3g}s/iter ({phases})"
        return f"{head}; peak {mem:.2f} GiB; {verdict}"


# ------------------------------------------------------------------------ sharding arithmetic
def _param_table(
    cfg: ModelConfig, head: str, lora: LoraConfig | None = None
) -> tuple[tuple[str, tuple, tuple[int, ...], int], ...]:
    """(path, logical axes, shape, itemsize) per parameter, from the model's abstract state
    (with ``lora``: the LoRA model's, adapters included)."""
    # The knobs the tuner varies per plan do not change the parameter tree: one table serves
    # every remat policy and pipeline schedule (each table traces the model's abstract state).
    if (cfg.remat_policy, cfg.pipeline_microbatches, cfg.pipeline_schedule) != ("none", 0, "gpipe"):
        cfg = replace(cfg, remat_policy="none", pipeline_microbatches=0, pipeline_schedule="gpipe")
    return _param_table_of(cfg, head, lora)


@functools.lru_cache(maxsize=64)
def _param_table_of(
    cfg: ModelConfig, head: str, lora: LoraConfig | None
) -> tuple[tuple[str, tuple, tuple[int, ...], int], ...]:
    model = ModelDef(cfg, head, lora)
    is_axes = lambda x: isinstance(x, tuple) and all(isinstance(a, str | None) for a in x)  # noqa: E731
    axes, treedef = jax.tree_util.tree_flatten_with_path(model.logical_axes, is_leaf=is_axes)
    shapes = treedef.flatten_up_to(model.abstract_params)
    return tuple(
        (path_str(path), ax, tuple(s.shape), np.dtype(s.dtype).itemsize)
        for (path, ax), s in zip(axes, shapes)
    )


@functools.lru_cache(maxsize=16384)
def _dim_axes(logical: tuple, spec: MeshSpec, rules: str) -> tuple[tuple[str, ...], ...]:
    """Mesh axes each dimension is split over: the rule set's PartitionSpec on this mesh shape.

    ``logical_to_spec`` only reads ``mesh.shape``, so a stand-in with the MeshSpec's axis sizes
    gives exactly the spec a real ``Mesh`` would.
    """
    fake = types.SimpleNamespace(shape=spec.shape)
    out = []
    for part in logical_to_spec(logical, fake, get_rules(rules)):
        out.append(() if part is None else (part,) if isinstance(part, str) else tuple(part))
    return tuple(out)


def _device_bounds(shape, dim_axes, spec: MeshSpec) -> dict[int, tuple[tuple[int, int], ...]]:
    """device id -> (start, stop) per dim, as NamedSharding lays out the array on the mesh."""
    sizes = [s for _, s in spec.axes]
    names = spec.names
    out = {}
    for pos, device in enumerate(spec.device_ids()):
        coord = dict(zip(names, np.unravel_index(pos, sizes)))
        bounds = []
        for dim, axes in zip(shape, dim_axes):
            k = axis_size(spec, axes)
            index = 0
            for a in axes:  # the first listed axis is the major one
                index = index * spec.shape[a] + int(coord[a])
            chunk = -(-dim // k)
            bounds.append((min(dim, index * chunk), min(dim, (index + 1) * chunk)))
        out[device] = tuple(bounds)
    return out


# The search evaluates thousands of plans built from a few hundred distinct placements: the
# per-placement arithmetic below is cached (configs and placements are frozen, hashable).
@functools.lru_cache(maxsize=4096)
def shard_bytes(
    cfg: ModelConfig, head: str, placement: CallPlacement, only: tuple[str, ...] = ()
) -> int:
    """Parameter bytes one device holds under ``placement`` (the largest shard, ceil-divided);
    with ``only``, of the parameters under those top-level names alone (``("layers",)``: the
    stacked decoder-layer weights)."""
    total = 0
    for path, logical, shape, size in _param_table(cfg, head):
        if only and path.split("/")[0] not in only:
            continue
        axes = _dim_axes(logical, placement.mesh, placement.rules)
        total += (
            math.prod(-(-d // axis_size(placement.mesh, a)) for d, a in zip(shape, axes)) * size
        )
    return total


@functools.lru_cache(maxsize=4096)
def lora_shard_bytes(
    cfg: ModelConfig, head: str, placement: CallPlacement, lora: LoraConfig, part: str
) -> int:
    """Bytes one device holds of a LoRA model's ``part``: ``"adapters"`` (the A and B
    matrices, laid out by their own logical axes) or ``"trainable"`` (adapters and a value
    head: what has gradients and optimizer moments, jrlhf.models.lora.trainable)."""
    keep = (lambda k: "_lora_" in k[-1]) if part == "adapters" else lora_lib.is_trainable
    total = 0
    for path, logical, shape, size in _param_table(cfg, head, lora):
        if not keep(tuple(path.split("/"))):
            continue
        axes = _dim_axes(logical, placement.mesh, placement.rules)
        total += (
            math.prod(-(-d // axis_size(placement.mesh, a)) for d, a in zip(shape, axes)) * size
        )
    return total


def trained_bytes(
    cfg: ModelConfig, head: str, placement: CallPlacement, lora: LoraConfig | None
) -> int:
    """Bytes one device holds of the parameters a train step differentiates and its optimizer
    updates: all of them, or a LoRA model's adapters (and value head)."""
    if lora is None:
        return shard_bytes(cfg, head, placement)
    return lora_shard_bytes(cfg, head, placement, lora, "trainable")


def held_bytes(
    cfg: ModelConfig, head: str, placement: CallPlacement, lora: LoraConfig | None
) -> int:
    """Parameter bytes one device holds of a trained role: the model, plus its adapters."""
    extra = 0 if lora is None else lora_shard_bytes(cfg, head, placement, lora, "adapters")
    return shard_bytes(cfg, head, placement) + extra


@functools.lru_cache(maxsize=4096)
def layout_problems(cfg: ModelConfig, head: str, placement: CallPlacement) -> tuple[str, ...]:
    """Parameters whose dims do not divide their mesh axes (the trainer would refuse them)."""
    out = []
    for path, logical, shape, _ in _param_table(cfg, head):
        for dim, (size, axes) in enumerate(
            zip(shape, _dim_axes(logical, placement.mesh, placement.rules))
        ):
            k = axis_size(placement.mesh, axes)
            if k > 1 and size % k:
                out.append(
                    f"parameter {path} dim {dim} (size {size}) not divisible by {axes} ({k})"
                )
    return tuple(out)


@functools.lru_cache(maxsize=4096)
def reshard_bytes_per_device(
    cfg: ModelConfig, head: str, src: CallPlacement, dst: CallPlacement
) -> Mapping[int, int]:
    """Bytes each target device must receive to go from ``src``'s layout to ``dst``'s.

    The same count as ``jrlhf.reshard.layout.moved_bytes_per_device`` (both use
    ``layout.moved_elements``), from the MeshSpecs and rules without building devices. The
    returned mapping is shared by the cache: read-only.
    """
    out: dict[int, int] = {d: 0 for d in dst.mesh.device_ids()}
    for _path, logical, shape, size in _param_table(cfg, head):
        have = _device_bounds(shape, _dim_axes(logical, src.mesh, src.rules), src.mesh)
        want = _device_bounds(shape, _dim_axes(logical, dst.mesh, dst.rules), dst.mesh)
        for device, n in moved_elements(have, want).items():
            out[device] += n * size
    return types.MappingProxyType(out)


@functools.lru_cache(maxsize=4096)
def reshard_moving_leaves(
    cfg: ModelConfig, head: str, src: CallPlacement, dst: CallPlacement
) -> int:
    """Parameters (leaves) of which some device must receive a part: one collective each."""
    count = 0
    for _path, logical, shape, _size in _param_table(cfg, head):
        have = _device_bounds(shape, _dim_axes(logical, src.mesh, src.rules), src.mesh)
        want = _device_bounds(shape, _dim_axes(logical, dst.mesh, dst.rules), dst.mesh)
        count += any(moved_elements(have, want).values())
    return count


@functools.lru_cache(maxsize=4096)
def reshard_gathered_bytes(
    cfg: ModelConfig, head: str, src: CallPlacement, dst: CallPlacement
) -> int:
    """Bytes the moving parameters' collectives write: for every parameter and every target
    device that receives any part of it from another device, that device's whole target shard
    (an all-gather writes its full result, the part the device already held included)."""
    total = 0
    for _path, logical, shape, size in _param_table(cfg, head):
        have = _device_bounds(shape, _dim_axes(logical, src.mesh, src.rules), src.mesh)
        want = _device_bounds(shape, _dim_axes(logical, dst.mesh, dst.rules), dst.mesh)
        for device, n in moved_elements(have, want).items():
            if n:
                total += math.prod(hi - lo for lo, hi in want[device]) * size
    return total


@functools.lru_cache(maxsize=4096)
def same_layout(cfg: ModelConfig, head: str, src: CallPlacement, dst: CallPlacement) -> bool:
    """Whether every parameter has the same slice on every device under both placements (a
    one-device plan, or data parallelism in both calls): the resharder then aliases the source
    (its ``alias`` path), which takes no time and no memory of its own."""
    if src.devices != dst.devices:
        return False
    for _path, logical, shape, _size in _param_table(cfg, head):
        have = _device_bounds(shape, _dim_axes(logical, src.mesh, src.rules), src.mesh)
        want = _device_bounds(shape, _dim_axes(logical, dst.mesh, dst.rules), dst.mesh)
        if have != want:
            return False
    return True


def reshard_bytes(cfg: ModelConfig, head: str, src: CallPlacement, dst: CallPlacement) -> int:
    """Total bytes crossing devices (equals ``layout.bytes_moved`` of the two shardings)."""
    return sum(reshard_bytes_per_device(cfg, head, src, dst).values())


# ------------------------------------------------------------------------------ call geometry
@dataclasses.dataclass(frozen=True)
class _Geometry:
    n: int  # devices
    batch: int  # ways the batch (rows / slots) is split
    tensor: int  # ways heads / mlp are split
    kv_tensor: int  # ways kv heads are split (activations / KV cache)
    devices: frozenset[int]
    nodes: int
    stages: int = 1  # pipeline stages the layers are split over (jrlhf.models.pipeline)
    experts: int = 1  # ways a mixture of experts' experts are split (the expert axis)


@functools.lru_cache(maxsize=4096)
def _geometry(p: CallPlacement, profile: DeviceProfile) -> _Geometry:
    spec = p.mesh

    def ways(name: str) -> int:
        return axis_size(spec, _dim_axes((name,), spec, p.rules)[0])

    devices = p.devices
    nodes = len({d // profile.devices_per_node for d in devices})
    return _Geometry(
        spec.size,
        ways("batch"),
        ways("heads"),
        ways("act_kv_heads"),
        devices,
        nodes,
        ways("layers"),
        ways("experts"),
    )


@dataclasses.dataclass(frozen=True)
class _Pipeline:
    """A full-sequence pass's pipeline schedule on a call's devices (jrlhf.models.pipeline):
    each pass's rows in ``micro`` micro-batches through ``stages`` stages; GPipe runs
    ``micro + stages - 1`` iterations, 1F1B (train steps only) ``micro + 2 stages - 1`` ticks of
    a forward and a backward each, each device running its ``num_layers / stages`` layers once
    per iteration; ``fused`` (a PPO train step in the fused actor-critic program,
    jrlhf.runtime.fused_step) the ``ticks`` of its table, its layer work ``work`` times both
    models' useful work (``_fused_work``): on a mesh of stages only each stage runs the one op
    its table slot names, or nothing, so each model's micro-batches run its layers once forward
    and once backward on every stage; with other axes (``lockstep``) every stage runs a forward
    and a backward of both models at every tick. Without stages: one micro-batch through one
    stage (every factor 1)."""

    stages: int
    micro: int
    schedule: str = "gpipe"
    ticks: int = 0  # fused: the table's length (fused_schedule.step_schedule)
    work: float = 0.0  # fused: _fused_work of the table
    lockstep: bool = False  # fused: the lockstep program (stages' work split over other axes)

    @property
    def iterations(self) -> int:
        if self.schedule == "fused":
            return self.ticks
        extra = 2 * self.stages - 1 if self.schedule == "1f1b" else self.stages - 1
        return self.micro + extra

    @property
    def busy_iterations(self) -> int:
        """The iterations that run the model's layers: every one, but in the per-stage fused
        program only its micro-batches' (each a forward and a backward on every stage; idle
        slots and the other model's run none of its layers)."""
        return self.micro if self.schedule == "fused" and not self.lockstep else self.iterations

    @property
    def bubble(self) -> float:
        """The share of this model's stage-iterations spent on filler: GPipe's and 1F1B's
        ``pipeline.bubble_fraction``; fused, the share of the critical path that is not useful
        work (recompute and waits), ``1 - 1 / work``."""
        if self.schedule == "fused":
            return 1.0 - 1.0 / self.work
        return bubble_fraction(self.stages, self.micro, self.schedule) if self.stages > 1 else 0.0

    @property
    def layer_work(self) -> float:
        """A device's layer work (FLOPs, activation passes, tensor-parallel traffic) per pass
        over the unpipelined model's on the same devices' share: the bubble's filler on top,
        ``(M + S - 1) / M``; fused, ``work``; FLOPs per device already divide by every device,
        stages too."""
        return self.work if self.schedule == "fused" else self.iterations / self.micro

    @property
    def layer_runs(self) -> float:
        """Layer invocations a device runs per pass, over the model's layer count: (M + S - 1)
        iterations of ``L / S`` layers each (per-layer launches, scanned FSDP gathers)."""
        return self.busy_iterations / self.stages


def _pipeline(
    cfg: ModelConfig, g: _Geometry, train: bool = False, ticks: int = 0, work: float = 0.0
) -> _Pipeline:
    """The schedule of a call's passes: a train step's is the model's ``pipeline_schedule``,
    or the fused program's of ``ticks`` and ``work`` (``_fused_table``, ``_fused_work``); a
    scoring call's the GPipe forward."""
    if g.stages <= 1:
        return _Pipeline(1, 1)
    micro = cfg.pipeline_microbatches or g.stages
    if train and ticks:
        return _Pipeline(g.stages, micro, "fused", ticks, work, lockstep=g.n > g.stages)
    schedule = cfg.pipeline_schedule if train else "gpipe"
    return _Pipeline(g.stages, micro, schedule)


def _fused_table(w: Workload, g: _Geometry) -> fused_schedule.Schedule | None:
    """The table the fused actor-critic step runs for ``w`` on a training call of geometry
    ``g`` (the PPO update's, ``fused_schedule.step_schedule``), or None where ``w`` trains the
    two models apart: no fused critic, no stages, or minibatch rows that do not split into a
    model's pipeline micro-batches (``fused_problem`` says so)."""
    if not w.fused_actor_critic or w.critic is None or g.stages < 2:
        return None
    rows = min(w.minibatch_size, w.rows)
    micro = tuple(c.pipeline_microbatches or g.stages for c in (w.actor, w.critic))
    if any(rows % m for m in micro):
        return None
    hidden = (w.actor.hidden_size, w.critic.hidden_size)
    return fused_schedule.step_schedule(g.stages, micro, rows, hidden).schedule


def _fused_work(w: Workload, g: _Geometry, table: fused_schedule.Schedule) -> float:
    """The fused program's layer work over the useful work of both models (3 forward passes of
    each micro-batch): its table's critical path (``Schedule.critical_path``), an op costing
    a forward of its model's micro-batch through a stage, a backward three (the forward
    recomputed under ``jax.vjp``, then two matmuls a weight), idle slots nothing: 4/3 (the
    recompute) where no stage ever waits. Where the mesh splits the stages' work over other
    axes (jrlhf.runtime.fused_step.run_fused runs them in lockstep there) every tick costs a
    forward and a backward of both models. The same factor prices both models' shares, which
    add up to the program's."""
    rows = min(w.minibatch_size, w.rows)
    costs, useful = [], 0.0
    for role in ("actor", "critic"):
        cfg, head = w.models()[role]
        micro = cfg.pipeline_microbatches or g.stages
        forward = forward_flops(cfg, rows // micro, w.seq_len, head, 0)
        costs.append((forward, 3 * forward))
        useful += 3 * micro * forward
    if g.n > g.stages:
        return table.ticks * sum(back for _, back in costs) / useful
    return table.critical_path(costs) / useful


def fused_problem(w: Workload, plan: ExecutionPlan, profile: DeviceProfile) -> str | None:
    """Why the fused actor-critic step (``w.fused_actor_critic``) cannot run on ``plan``, as
    the PPO update refuses it (jrlhf.ppo.update.fused_step), or None."""
    if not w.fused_actor_critic or w.critic is None:
        return None
    actor, critic = plan["actor_train"], plan["critic_train"]
    if actor != critic:
        return (
            "critic/RoleConfig.pipeline_schedule='fused' needs the actor and the critic on one "
            f"training mesh and rule set; actor {actor}, critic {critic}"
        )
    g = _geometry(actor, profile)
    if g.stages < 2:
        return (
            "critic/RoleConfig.pipeline_schedule='fused' needs a stage axis of 2 or more, got "
            f"{actor}"
        )
    if _fused_table(w, g) is None:
        return (
            f"critic/RoleConfig.pipeline_schedule='fused': {min(w.minibatch_size, w.rows)} "
            "minibatch rows do not split into the actor's and critic's pipeline micro-batches"
        )
    return None


def train_schedule_prices(
    w: Workload, p: CallPlacement, profile: DeviceProfile
) -> dict[str, dict[str, float]]:
    """The actor's and the critic's PPO train steps of ``w`` on one staged placement ``p``,
    priced on each schedule: ``gpipe`` and ``1f1b`` (two steps, one after the other) and, with
    a critic, ``fused`` (one program on the table ``fused_schedule.step_schedule`` picks). Per
    schedule: ``seconds`` (both steps), ``ticks`` (iterations of each model's schedule, summed:
    the fused program's once), ``bubble`` (the share of the priced layer work that is not a
    forward and a backward of a real micro-batch: filler, and 1F1B's recompute), and for
    ``fused`` ``table_bubble``, the table's own idle share (``Schedule.bubble``): its idle
    slots cost nothing, its ``bubble`` is what its critical path adds to the useful work
    (recompute, and stages waiting on their neighbours' slower ops)."""
    g = _geometry(p, profile)
    roles = ["actor"] + (["critic"] if w.critic is not None else [])
    out: dict[str, dict[str, float]] = {}
    for schedule in ("gpipe", "1f1b", "fused"):
        if schedule == "fused" and len(roles) < 2:
            continue
        changes = {r: replace(getattr(w, r), pipeline_schedule="gpipe") for r in roles}
        if schedule != "fused":
            changes = {r: replace(c, pipeline_schedule=schedule) for r, c in changes.items()}
        wk = replace(w, fused_actor_critic=schedule == "fused", **changes)
        table = _fused_table(wk, g) if schedule == "fused" else None
        if schedule == "fused" and table is None:
            continue
        ticks = table.ticks if table is not None else 0
        work = _fused_work(wk, g, table) if table is not None else 0.0
        useful = priced = 0.0
        iterations = []
        for r in roles:
            cfg, head = wk.models()[r]
            pipe = _pipeline(cfg, g, train=True, ticks=ticks, work=work)
            per_pass = forward_flops(cfg, 1, wk.seq_len, head, 0)  # any rows: a ratio
            useful += 3 * pipe.micro * per_pass
            passes = 4 if pipe.schedule == "1f1b" else 3
            priced += passes * pipe.micro * pipe.layer_work * per_pass
            iterations.append(pipe.iterations)
        row = {
            "seconds": sum(train_seconds(wk, r, p, profile) for r in roles),
            "ticks": ticks or sum(iterations),
            "bubble": 1.0 - useful / priced,
        }
        if table is not None:
            row["table_bubble"] = table.bubble()
        out[schedule] = row
    return out


def pipeline_send_seconds(
    cfg: ModelConfig,
    rows: int,
    seq: int,
    g: _Geometry,
    passes: int,
    profile: DeviceProfile,
    ticks: int = 0,
) -> float:
    """The activations crossing stages in one pipelined pass over ``rows`` rows per device:
    at every iteration each stage's micro-batch output moves one stage on (a collective
    permute) and the last stage's goes to every stage (the schedule's output), in the forward
    and, for ``passes`` 2, again as gradients in the backward. 0 without stages. ``ticks``:
    the fused program's (``_pipeline``), whose stages send their activations and input
    gradients to their neighbours every tick and nothing to every stage."""
    pipe = _pipeline(cfg, g, train=passes > 1, ticks=ticks)
    if pipe.stages <= 1:
        return 0.0
    micro_bytes = -(-rows // pipe.micro) * seq * cfg.hidden_size * itemsize(cfg.dtype)
    sends = (1 if pipe.schedule == "fused" else 2) * passes * pipe.iterations
    return _comm_s(sends * micro_bytes, sends, g, profile)


def _work_s(per_device: float, g: _Geometry, rate: float, profile: DeviceProfile) -> float:
    """Seconds for ``per_device`` units of work on each of the call's devices at ``rate``.

    On a shared host the devices are threads on the same cores: the machine does n times the
    per-device work at its aggregate rate.
    """
    return per_device * (g.n if profile.shared_host else 1) / rate


def _activation_s(
    cfg: ModelConfig, tokens: float, seq: int, g: _Geometry, efficiency: float, profile
) -> float:
    """Seconds of a forward's elementwise work over ``tokens`` tokens per device (its live
    activations, ``activation_bytes_per_token``, streamed once per layer) at ``efficiency`` x
    the memory bandwidth; 0 when the profile does not price it apart (efficiency 0)."""
    if efficiency <= 0:
        return 0.0
    fused = attention_is_fused(cfg, profile.fused_attention)
    per_token = activation_bytes_per_token(cfg, seq, g.tensor, saved=False, fused_attention=fused)
    return _work_s(
        tokens * cfg.num_layers * per_token, g, profile.memory_bandwidth * efficiency, profile
    )


def _fixed_s(seconds: float, g: _Geometry, profile: DeviceProfile) -> float:
    """A fixed per-device cost (dispatch, per-op launch): on a shared host every device's
    program runs its ops on the same cores, so the cost is paid n times over, or less where the
    runtime overlaps them: n ** ``fixed_device_exponent`` times (fitted; 0.7 on the 2-core CPU,
    where 2 devices already cost more than 1: a lone program's ops get both cores)."""
    return _fixed_n_s(seconds, g.n, profile)


def _fixed_n_s(seconds: float, n: int, profile: DeviceProfile) -> float:
    """``_fixed_s`` for a call on ``n`` devices."""
    if not profile.shared_host:
        return seconds
    return seconds * n**profile.fixed_device_exponent


def _link_bandwidth(nodes: int, profile: DeviceProfile) -> float:
    return profile.intra_node_bandwidth if nodes <= 1 else profile.inter_node_bandwidth


def _comm_s(bytes_per_device: float, count: int, g: _Geometry, profile: DeviceProfile) -> float:
    """``count`` collectives moving ``bytes_per_device`` in total into each device."""
    if bytes_per_device <= 0 or g.n <= 1:
        return 0.0
    bw = _link_bandwidth(g.nodes, profile)
    # each collective's rendezvous: on a shared host every device's thread takes part in it on
    # the same cores (calibrate.collective_fit measures it that way)
    latency = _fixed_s(count * profile.collective_latency_s, g, profile)
    return _work_s(bytes_per_device, g, bw, profile) + latency


def _ring(bytes_total: float, k: int) -> float:
    """Bytes into each device for an all-gather / reduce-scatter of ``bytes_total`` over k."""
    return bytes_total * (k - 1) / k if k > 1 else 0.0


def moe_dispatch_bytes(cfg: ModelConfig, act_bytes: float, experts: int) -> float:
    """Bytes into each device for one pass of a mixture of experts' token dispatch and combine
    over ``experts`` expert shards, per layer: the expert group's tokens gathered (each device
    holds ``act_bytes`` of them) and the outputs reduce-scattered back, a ring each
    (jrlhf.models.moe: the expert-parallel form; GSPMD's dense form moves the same). 0 for a
    dense model or unsplit experts."""
    if not cfg.is_moe or experts <= 1:
        return 0.0
    return 2 * _ring(act_bytes * experts, experts)


def _bucket(n: int, lo: int) -> int:
    return max(lo, 1 << max(0, n - 1).bit_length())


# ------------------------------------------------------------------------------- call costs
def _gathered_weight_bytes(cfg, head, p: CallPlacement, g: _Geometry) -> float:
    """FSDP: bytes of weights a device must fetch over one forward (its tensor shard of every
    layer, minus what it holds): the all-gather traffic, not the memory it occupies at once
    (``_gather_buffer_bytes``)."""
    if g.stages > 1 or g.experts > 1:
        # a device gathers its own stage's layers only, and its own expert group's experts
        return max(0.0, _used_weight_bytes(cfg, head, p) - shard_bytes(cfg, head, p))
    full = sum(math.prod(s) * size for _, _, s, size in _param_table(cfg, head))
    return max(0.0, full / g.tensor - shard_bytes(cfg, head, p))


@functools.lru_cache(maxsize=4096)
def _replicated_grad_bytes(cfg: ModelConfig, head: str, placement: CallPlacement) -> float:
    """Bytes into each device for one step's gradient all-reduce: every parameter a device
    holds whole along mesh axes that split the batch (data parallelism, and the small weights
    FSDP does not shard) has partial gradients on its ``r`` replicas, which a ring all-reduce
    sums (2 (r - 1) / r times its shard). FSDP-sharded weights reduce-scatter instead, priced
    with their gathers."""
    spec = placement.mesh
    batch_axes = _dim_axes(("batch",), spec, placement.rules)[0]
    total = 0.0
    for _path, logical, shape, size in _param_table(cfg, head):
        axes = _dim_axes(logical, spec, placement.rules)
        split = {a for dim in axes for a in dim}
        r = math.prod(spec.shape[a] for a in batch_axes if a not in split)
        if r > 1:
            shard = math.prod(-(-d // axis_size(spec, a)) for d, a in zip(shape, axes)) * size
            total += 2 * shard * (r - 1) / r
    return total


def _weight_pass_s(
    cfg, head: str, p: CallPlacement, g: _Geometry, efficiency: float, profile: DeviceProfile
) -> float:
    """Seconds for every device program to go once through its weights as its matmuls use them
    (``_used_weight_bytes``: FSDP-gathered or held) at ``efficiency`` x the link bandwidth; 0
    when the profile does not price it apart (efficiency 0)."""
    if efficiency <= 0:
        return 0.0
    used = _used_weight_bytes(cfg, head, p)
    return _work_s(used, g, _link_bandwidth(g.nodes, profile) * efficiency, profile)


@functools.lru_cache(maxsize=4096)
def _used_weight_bytes(cfg: ModelConfig, head: str, placement: CallPlacement) -> int:
    """Bytes per device of every weight as a forward's matmuls use it: split over every mesh
    axis but ``fsdp`` (FSDP gathers the rest; data parallelism holds it whole)."""
    spec = placement.mesh
    total = 0
    for _path, logical, shape, size in _param_table(cfg, head):
        axes = _dim_axes(logical, spec, placement.rules)
        kept = [tuple(x for x in a if x != "fsdp") for a in axes]
        total += math.prod(-(-d // axis_size(spec, a)) for d, a in zip(shape, kept)) * size
    return total


@functools.lru_cache(maxsize=4096)
def _gathered_parts(cfg: ModelConfig, head: str, placement: CallPlacement) -> tuple[int, int]:
    """(one scanned layer, the unscanned rest): bytes per device of the FSDP-sharded weights
    once gathered, i.e. split over every mesh axis but ``fsdp``. Weights not split over fsdp
    are used in place and count zero."""
    spec = placement.mesh
    layer = rest = 0
    for _path, logical, shape, size in _param_table(cfg, head):
        axes = _dim_axes(logical, spec, placement.rules)
        if not any("fsdp" in a for a in axes) or spec.shape.get("fsdp", 1) <= 1:
            continue
        kept = [tuple(x for x in a if x != "fsdp") for a in axes]
        dims = list(shape)
        if logical and logical[0] == "layers":
            dims[0] = 1
        n = math.prod(-(-d // axis_size(spec, a)) for d, a in zip(dims, kept)) * size
        if logical and logical[0] == "layers":
            layer += n
        else:
            rest += n
    return layer, rest


def layers_unrolled(cfg: ModelConfig, profile: DeviceProfile) -> bool:
    """Whether ``cfg``'s training and scoring passes run their layers unrolled on the profile's
    devices (ModelConfig.unrolls_layers_on; a shared host is fake CPU devices)."""
    return cfg.unrolls_layers_on(profile.shared_host)


def _gather_buffer_bytes(
    cfg, head: str, p: CallPlacement, profile: DeviceProfile, train: bool
) -> float:
    """Memory the FSDP all-gathers occupy at a call's peak (per device).

    Under ``lax.scan`` XLA gathers each layer's weights inside the loop, one layer at a time
    (benchmarks/fsdp_memory.py: XLA's temp memory of the scoring forward does not grow with
    depth; the train step's grows only by gradients and saved activations), so this is one
    layer's gathered weights, not the model's. Training also holds the layer's full-size
    gradient before its reduce-scatter (x2). On accelerators the latency-hiding scheduler
    prefetches the next layer's gather while this one computes (one more layer); the CPU backend
    runs collectives in order. The embedding and output head (outside the scan) are gathered
    whole, and in training their full-size gradients too.

    Unrolled layers (``layers_unrolled``) are gathered whole, every layer, and in training kept
    for the backward pass, plus one layer's full-size gradient: XLA's temp memory of those
    programs grows by about a gathered layer per layer (scoring), and by that plus the layer's
    saved activations (training).
    """
    layer, rest = _gathered_parts(cfg, head, p)
    copies = 2 if train else 1
    if layers_unrolled(cfg, profile):  # with stages, a device's own stage's layers
        stages = _geometry(p, profile).stages
        return layer * (cfg.num_layers // stages + copies - 1) + rest * copies
    prefetch = 0 if profile.shared_host else 1
    return layer * (copies + prefetch) + rest * copies


def _head_tokens(w: Workload, head: str, role: str, rows: int) -> int:
    # lm heads and the critic run at every response column, the reward model at one per row
    return rows * (1 if role == "reward" else w.gen_len)


def _engine_slots(w: Workload, g: _Geometry) -> int:
    """Decode slots as the trainer sizes the engine (jrlhf.decode.state.round_slots): rounded
    up to a multiple of the data shards times the pipeline stages."""
    unit = g.batch * g.stages
    return -(-w.slots // unit) * unit


def _waves(w: Workload, g: _Geometry) -> list[int]:
    """Sequences in flight in each decode wave (uniform lengths: full waves, then the rest)."""
    slots = _engine_slots(w, g)
    full, rest = divmod(w.rows, slots)
    return [slots] * full + ([rest] if rest else [])


def prefill_len(w: Workload) -> int:
    """The prefill's padded prompt length, as the engine buckets it: a power of two of at least
    min(16, prompt_len), capped at prompt_len (``EngineConfig.min_prefill_len`` and
    ``max_prompt_len`` as ``jrlhf.ppo.rollout.engine_config`` sets them)."""
    return min(w.prompt_len, _bucket(w.prompt_len, min(16, w.prompt_len)))


@functools.lru_cache(maxsize=1024)
def attended_context(prompt_len: int, gen_len: int, page_size: int) -> float:
    """KV positions one decode step reads per sequence, averaged over the steps.

    The decode kernels read the cache in whole pages or less: the pure-JAX one
    (``paged_attention_blocked``, TPUs) in blocks of ``pages_per_block`` pages, as many blocks as
    the longest sequence needs; the GPU one each sequence's own pages and the CPU's native one
    its own positions, at most a block less. Every profile is priced with the blocked kernel's
    CPU blocks (the profiles' KV read rates were fitted so). With uniform lengths the sequences
    at step s hold prompt_len + s positions.
    """
    pages = -(-(prompt_len + gen_len - 1) // page_size)
    block = pages_per_block(page_size, pages, backend="cpu") * page_size
    steps = range(1, max(1, gen_len - 1) + 1)
    return sum(-(-(prompt_len + s) // block) * block for s in steps) / len(steps)


def generate_seconds(w: Workload, p: CallPlacement, profile: DeviceProfile) -> float:
    """A call's fixed cost (``decode_call_overhead_s``) and its per-layer weight copies
    (``decode_copy_efficiency``), prefill in batches of <= min(slots, 64) prompts, then, per
    wave of up to ``slots``
    sequences, gen_len - 1 decode steps. Each step runs the matmuls of one token per sequence
    (compute- or weight-read-bound, at ``decode_efficiency``), and its attention reads the KV
    pages of the sequences in flight (``attended_context``) at ``decode_kv_efficiency`` of the
    memory bandwidth: on CPU that gather-and-reduce is far slower than the matmuls and grows
    with the context, not with the weights."""
    cfg = w.actor
    g = _geometry(p, profile)
    rows = w.rows
    slots = _engine_slots(w, g)
    # prefill: prompts padded as the engine buckets them, <= 64 rows per call
    plen = prefill_len(w)
    prefill_calls = -(-rows // min(slots, 64))
    flops = forward_flops(cfg, rows, plen, "lm", rows)
    prefill = prefill_calls * (
        profile.call_overhead_s
        + cfg.num_layers
        * (profile.forward_layer_overhead_s + profile.forward_layer_overhead_once_s)
    )
    prefill += _work_s(flops / g.n, g, profile.matmul_flops * profile.forward_efficiency, profile)
    prefill_tokens = -(-rows // g.batch) * plen
    prefill += _activation_s(
        cfg, prefill_tokens, plen, g, profile.forward_activation_efficiency, profile
    )
    steps = max(0, w.gen_len - 1)
    context = attended_context(w.prompt_len, w.gen_len, w.decode_page_size)
    weight_bytes = shard_bytes(cfg, "lm", p)
    chunks = -(-steps // max(1, w.decode_chunk_steps))
    total = prefill + _fixed_s(profile.decode_call_overhead_s, g, profile)
    if profile.decode_copy_efficiency > 0:  # the unrolled decode's layer copies, once a call
        total += _work_s(
            weight_bytes, g, profile.memory_bandwidth * profile.decode_copy_efficiency, profile
        )
    groups = min(w.decode_pipeline_batches or g.stages, g.stages)
    for in_flight in _waves(w, g):
        step = _decode_step_s(cfg, p, g, profile, in_flight, context, w.decode_pipeline_batches)
        total += steps * step + chunks * _fixed_s(profile.call_overhead_s, g, profile)
        # a staged chunk fills and drains its pipeline: G - 1 ticks (of S a step) more
        total += chunks * (groups - 1) * step / g.stages
    return total


def _decode_step_s(
    cfg: ModelConfig,
    p: CallPlacement,
    g: _Geometry,
    profile: DeviceProfile,
    in_flight: int,
    context: float,
    groups: int = 0,
) -> float:
    """One decode step of ``in_flight`` sequences (over the call's data shards) that attend
    to ``context`` KV positions each on average (``generate_seconds``).

    With pipeline stages (jrlhf.decode.pipelined) a step, every sequence one token on, takes
    ``S`` ticks: each group of ``in_flight / G`` sequences (``groups`` G, 0 = S) passes the
    ``S`` stages one tick each, and a tick costs the busy stage's ``L / S`` layers on one group
    (its weights and its layers' KV read, its matmuls, its tensor all-reduces) plus the send
    of the group's hidden states to the next stage; the embedding and head run once a tick."""
    a = itemsize(cfg.dtype)
    stages = g.stages
    groups = min(groups or stages, stages)
    rows = -(-in_flight // groups) if stages > 1 else in_flight  # a tick's sequences
    layers = cfg.num_layers // stages  # a tick's layers
    weight_bytes = shard_bytes(cfg, "lm", p)  # a device's: its stage's layers
    per_shard = -(-rows // g.batch)
    flops = decode_step_flops(cfg, rows, 0) / stages  # a stage's share, on its devices
    compute = _work_s(flops / (g.n // stages), g, profile.matmul_flops, profile)
    memory = _work_s(weight_bytes, g, profile.memory_bandwidth, profile)
    kv_bytes = per_shard * context * kv_bytes_per_token(cfg) / stages / g.kv_tensor
    kv = _work_s(kv_bytes, g, profile.memory_bandwidth * profile.decode_kv_efficiency, profile)
    # a stage's tensor group stays inside its own nodes (stages are whole nodes)
    stage_g = dataclasses.replace(g, nodes=-(-g.nodes // stages)) if stages > 1 else g
    tp = _comm_s(
        2 * layers * 2 * _ring(per_shard * cfg.hidden_size * a, g.tensor),
        2 * layers,
        stage_g,
        profile,
    )
    if profile.decode_weight_efficiency > 0:  # shared host: the two add up
        tick = compute / profile.decode_efficiency + kv
        tick += _work_s(
            weight_bytes, g, profile.memory_bandwidth * profile.decode_weight_efficiency, profile
        )
    else:
        tick = max(compute, memory) / profile.decode_efficiency + kv
    tick += _fixed_s(layers * profile.decode_layer_overhead_s, g, profile) + tp
    if stages > 1:  # the group's hidden states on to the next stage
        tick += _comm_s(per_shard * cfg.hidden_size * a, 1, g, profile)
    return stages * tick + cfg.num_layers * profile.decode_layer_overhead_once_s


# ------------------------------------------------------------- long-tailed and partial rollouts
@functools.lru_cache(maxsize=256)
def _continuous_batching(
    contexts: tuple[int, ...], tokens: tuple[int, ...], slots: int
) -> tuple[int, tuple[tuple[int, int, float], ...]]:
    """The decode steps of an engine call with ``slots`` sequence slots over rows that start
    from ``contexts[i]`` KV positions and generate ``tokens[i]`` tokens (the first from the
    prefill, then one per decode step), admitted in order, each into the first slot that frees
    (continuous batching). Returns (steps until the last row ends, ((in flight, steps,
    attended positions summed over those steps and rows), ...) by number in flight): at its
    s-th decode step a row attends to context + s positions, as ``attended_context`` counts
    them (without rounding to the kernel's blocks)."""
    free = [0] * max(1, min(slots, len(contexts)))
    starts = np.zeros(len(contexts), np.int64)
    for i, n in enumerate(tokens):  # each row into the slot that frees first
        t = heapq.heappop(free)
        starts[i] = t
        heapq.heappush(free, t + max(0, n - 1))
    duration = np.maximum(0, np.asarray(tokens, np.int64) - 1)
    ends = starts + duration
    steps = int(ends.max(initial=0))
    live = duration > 0
    # Per step t: rows in flight, and the sum over them of (context - start + 1); a row's
    # attended positions at step t are context + (t - start) + 1.
    active = np.zeros(steps + 1, np.int64)
    offset = np.zeros(steps + 1, np.float64)
    np.add.at(active, starts[live], 1)
    np.add.at(active, ends[live], -1)
    base = np.asarray(contexts, np.float64) - starts + 1
    np.add.at(offset, starts[live], base[live])
    np.add.at(offset, ends[live], -base[live])
    active, offset = np.cumsum(active)[:steps], np.cumsum(offset)[:steps]
    attended = offset + np.arange(steps) * active
    counts = np.bincount(active)
    sums = np.bincount(active, weights=attended)
    by = tuple((int(a), int(counts[a]), float(sums[a])) for a in np.nonzero(counts)[0] if a)
    return steps, by


def engine_call_seconds(
    w: Workload,
    p: CallPlacement,
    profile: DeviceProfile,
    rows: Sequence[tuple[int, int, int, int]],
) -> float:
    """One generate call over rows given as (prefilled tokens, KV positions they leave, tokens
    generated, rows like it), admitted in a fixed shuffled order (a batch's lengths come in no
    particular order): the engine's fixed costs, the prefill of
    every row (in calls of <= min(slots, 64) rows, as ``generate_seconds``), then the decode
    steps of continuous batching over the engine's slots (``_continuous_batching``), each
    priced as ``generate_seconds`` prices a step of that many sequences in flight at their
    mean attended context. With every row at prompt_len and gen_len this is
    ``generate_seconds`` up to the kernel's block rounding of the attended context."""
    cfg = w.actor
    g = _geometry(p, profile)
    slots = _engine_slots(w, g)
    order = np.random.default_rng(0).permutation(sum(n for *_, n in rows))
    flat = [(pre, ctx, k) for pre, ctx, k, n in rows for _ in range(n)]
    flat = [flat[i] for i in order]
    total_rows = len(flat)
    if not total_rows:
        return 0.0
    prefill_calls = -(-total_rows // min(slots, 64))
    total = prefill_calls * (
        profile.call_overhead_s
        + cfg.num_layers
        * (profile.forward_layer_overhead_s + profile.forward_layer_overhead_once_s)
    )
    by_len: dict[int, int] = {}
    for pre, _, _, n in rows:
        by_len[pre] = by_len.get(pre, 0) + n
    for length, n in by_len.items():
        flops = forward_flops(cfg, n, length, "lm", n)
        total += _work_s(flops / g.n, g, profile.matmul_flops * profile.forward_efficiency, profile)
        tokens = -(-n // g.batch) * length
        efficiency = profile.forward_activation_efficiency
        total += _activation_s(cfg, tokens, length, g, efficiency, profile)
    total += _fixed_s(profile.decode_call_overhead_s, g, profile)
    if profile.decode_copy_efficiency > 0:
        total += _work_s(
            shard_bytes(cfg, "lm", p),
            g,
            profile.memory_bandwidth * profile.decode_copy_efficiency,
            profile,
        )
    steps, by = _continuous_batching(
        tuple(c for _, c, _ in flat), tuple(k for _, _, k in flat), slots
    )
    for in_flight, count, attended in by:
        context = attended / (count * in_flight)
        total += count * _decode_step_s(
            cfg, p, g, profile, in_flight, context, w.decode_pipeline_batches
        )
    chunks = -(-steps // max(1, w.decode_chunk_steps))
    return total + chunks * _fixed_s(profile.call_overhead_s, g, profile)


@functools.lru_cache(maxsize=1024)
def sampling_rounds(prompts: int, no_signal: float, max_rounds: int) -> float:
    """Expected generation rounds per batch under dynamic sampling: rounds of ``prompts``
    prompts are drawn until they hold ``prompts`` groups with signal (each with probability
    1 - ``no_signal``, independently), at most ``max_rounds``. E[R] = sum over r < max_rounds
    of P(R > r) = 1 + sum over 1 <= r < max_rounds of P(Binomial(r prompts, 1 - no_signal)
    < prompts). 1 without dynamic sampling (``no_signal`` 0)."""
    if no_signal <= 0:
        return 1.0
    if no_signal >= 1:
        return float(max_rounds)
    p, total = 1.0 - no_signal, 1.0
    for r in range(1, max_rounds):
        n = r * prompts
        log_pmf = [
            math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)
            + k * math.log(p) + (n - k) * math.log1p(-p)
            for k in range(min(prompts, n + 1))
        ]  # fmt: skip
        total += math.fsum(math.exp(x) for x in log_pmf)
    return total


def workload_rounds(w: Workload) -> float:
    """``sampling_rounds`` of the workload's batch."""
    return sampling_rounds(w.prompts, w.no_signal_fraction, w.max_sampling_rounds)


def _scaled(count: int, rounds: float) -> int:
    return max(1, round(count * rounds)) if count else 0


def partial_pass_rows(w: Workload) -> list[tuple[int, int, int, int]]:
    """The rows of one partial-rollout pass in the steady state (``engine_call_seconds``'s
    row groups, oldest batch first): the pass gives every unfinished sample of the batches in
    flight up to T = ``partial_rollout_tokens`` more tokens. A batch has had ``age`` passes
    before (0 .. k - 1; T x k >= its longest response, so none is left at its k-th); its rows
    longer than age x T continue: re-prefilled over their prompt and age x T tokens so far (the
    KV cache is recomputed under the current weights), then min(T, length - age x T) tokens.
    New rows prefill their prompt (padded as the engine buckets it). Dynamic sampling's extra
    rounds add rows in proportion (``workload_rounds``)."""
    t = w.partial_rollout_tokens
    rounds = workload_rounds(w)
    longest = max(k for k, _ in w.lengths)
    out = []
    age = -(-longest // t) - 1
    while age >= 0:
        done = age * t
        for k, n in w.lengths:
            if k > done:
                pre = prefill_len(w) if age == 0 else w.prompt_len + done
                out.append((pre, w.prompt_len + done, min(t, k - done), _scaled(n, rounds)))
        age -= 1
    return out


def rollout_seconds(w: Workload, p: CallPlacement, profile: DeviceProfile) -> float:
    """Generation seconds per iteration (the generate phase). Uniform lengths without partial
    rollouts: ``generate_seconds``, once per dynamic-sampling round (``workload_rounds``; each
    round is its own generate call). Long-tailed lengths (``Workload.response_lengths``): the
    same rounds, each one ``engine_call_seconds`` over the batch's rows, so the call lasts at
    least as long as its longest row. Partial rollouts (``partial_rollout_tokens`` with
    ``max_staleness`` >= 1), in the steady state: one pass (``partial_pass_rows``), whose
    decode lasts at most about T steps more than continuous batching needs for its rows: the
    longest sample no longer sets the iteration's generation time, at the price of
    re-prefilling the continued rows."""
    rounds = workload_rounds(w)
    if w.partial_rollout_tokens and w.max_staleness >= 1:
        return engine_call_seconds(w, p, profile, partial_pass_rows(w))
    if not w.response_lengths:
        return rounds * generate_seconds(w, p, profile)
    rows = [(prefill_len(w), w.prompt_len, k, n) for k, n in w.lengths]
    return rounds * engine_call_seconds(w, p, profile, rows)


# ----------------------------------------------------------------- what crosses between groups
# The sample channel's layout (jrlhf.ppo.samples.pack_batch): per response token an int32 id,
# a float32 behaviour log-prob and an int64 policy version, the rows one after the other
# without padding; prompts as int32, likewise.
SAMPLE_TOKEN_BYTES = 4 + 4 + 8
PROMPT_TOKEN_BYTES = 4
# Per row: its length and its prompt's index (int32 each); with partial rollouts also whether
# it finished (uint8) and its passes (int32). Per prompt: its length (int32).
ROW_BYTES, PARTIAL_ROW_BYTES, PROMPT_BYTES = 8, 5, 4
# The control plane per iteration and training process: a batch header (its index and byte
# layout) and the update's result (metrics, the KL coefficient), JSON in the key-value store.
CONTROL_BYTES_PER_PROCESS = 2048


@dataclasses.dataclass(frozen=True)
class GroupTraffic:
    """What crosses between the generating and the training group in one iteration."""

    receivers: int  # processes of the training group: each receives its own copy
    batch_bytes: float  # one iteration's samples as packed (every dynamic-sampling round)
    data_bytes: float  # batch_bytes x receivers: out of the sending device
    control_bytes: int  # key-value store messages
    weight_bytes: int  # one copy of the actor's weights (the weight channel moves it)
    data_seconds: float  # the data plane through the sending device's link


def sample_bytes(w: Workload) -> float:
    """Bytes of one iteration's samples as the sample channel packs them, once (per receiving
    process): every row's own tokens (no padding), prompts of prompt_len (the task's
    per-prompt meta, a JSON string, not counted), times the expected dynamic-sampling
    rounds."""
    tokens = sum(k * n for k, n in w.lengths)
    per_row = ROW_BYTES + (PARTIAL_ROW_BYTES if w.partial_rollout_tokens and w.max_staleness else 0)
    per_prompt = w.prompt_len * PROMPT_TOKEN_BYTES + PROMPT_BYTES
    rows = tokens * SAMPLE_TOKEN_BYTES + w.rows * per_row
    return workload_rounds(w) * (rows + w.prompts * per_prompt)


def group_traffic(
    w: Workload, plan: ExecutionPlan, profile: DeviceProfile, processes_per_node: int = 1
) -> GroupTraffic:
    """The data and control planes of an iteration with generation on processes of its own
    (jrlhf.ppo.samples.SampleChannel): the first generation device sends every batch to one
    device of each training process (``processes_per_node`` processes per node share the
    node's devices evenly), so its link carries ``sample_bytes`` once per receiver, at the
    inter-node bandwidth when a receiver is on another node. The training group is every
    device of the workload's other calls that generation does not use."""
    gen = plan["actor_generate"].devices
    train: set[int] = set()
    for call in _active_calls(w):
        if call != "actor_generate":
            train |= plan[call].devices - gen
    per_process = max(1, profile.devices_per_node // max(1, processes_per_node))
    receivers = len({d // per_process for d in train})
    batch = sample_bytes(w)
    data = batch * receivers
    source_node = min(gen) // profile.devices_per_node
    nodes = {source_node} | {d // profile.devices_per_node for d in train}
    seconds = data / _link_bandwidth(len(nodes), profile) if receivers else 0.0
    return GroupTraffic(
        receivers=receivers,
        batch_bytes=batch,
        data_bytes=data,
        control_bytes=CONTROL_BYTES_PER_PROCESS * receivers,
        weight_bytes=num_params(w.actor, "lm") * itemsize(w.actor.param_dtype),
        data_seconds=seconds,
    )


def _chunks(w: Workload) -> list[int]:
    """Rows of each scoring call: infer_batch_size at a time, the last chunk padded to full
    size as the trainer does (one compiled shape), or all rows in one call."""
    size = w.infer_chunk
    calls = -(-w.rows // size)
    return [w.rows] if calls == 1 else [size] * calls


def infer_seconds(w: Workload, role: str, p: CallPlacement, profile: DeviceProfile) -> float:
    """Forwards over the packed batch (rows x (prompt + gen) tokens) in chunks of
    ``infer_batch_size`` rows, one call after another: each call pays its dispatch and per-layer
    overheads and (FSDP) gathers the weights again."""
    cfg, head = w.models()[role]
    g = _geometry(p, profile)
    seq = w.seq_len
    gathered = _gathered_weight_bytes(cfg, head, p, g)
    # With pipeline stages (_Pipeline): the bubble's filler on the layer work, every iteration
    # launching (and, scanned, gathering) its stage's layers again, and the stage sends.
    pipe = _pipeline(cfg, g)
    runs = cfg.num_layers * pipe.layer_runs
    gathers = 1 if pipe.stages <= 1 or layers_unrolled(cfg, profile) else pipe.iterations
    t = 0.0
    for rows in _chunks(w):
        flops = forward_flops(cfg, rows, seq, head, _head_tokens(w, head, role, rows))
        t += _fixed_s(
            profile.call_overhead_s + runs * profile.forward_layer_overhead_s,
            g,
            profile,
        )
        t += runs * profile.forward_layer_overhead_once_s
        t += pipe.layer_work * _work_s(
            flops / g.n, g, profile.matmul_flops * profile.forward_efficiency, profile
        )
        tokens = -(-rows // g.batch) * seq
        t += (pipe.layer_work / pipe.stages) * _activation_s(
            cfg, tokens, seq, g, profile.forward_activation_efficiency, profile
        )
        t += _comm_s(gathers * gathered, cfg.num_layers * gathers // pipe.stages, g, profile)
        t += _weight_pass_s(cfg, head, p, g, profile.forward_gather_efficiency, profile)
        act = -(-rows // g.batch) * seq * cfg.hidden_size * itemsize(cfg.dtype)
        tp_bytes = 2 * cfg.num_layers * 2 * _ring(act, g.tensor) * pipe.layer_work / pipe.stages
        t += _comm_s(tp_bytes, round(2 * runs), g, profile)
        t += pipeline_send_seconds(cfg, -(-rows // g.batch), seq, g, 1, profile)
        dispatch = moe_dispatch_bytes(cfg, act, g.experts)  # expert parallelism, per layer
        t += _comm_s(cfg.num_layers * dispatch, 2 * cfg.num_layers, g, profile)
    return t


def train_seconds(w: Workload, role: str, p: CallPlacement, profile: DeviceProfile) -> float:
    """epochs x minibatches steps; each step accumulates gradients over ``microbatches``
    micro-batches (fwd + bwd (+ recompute), FSDP gathers and gradient reduce-scatter and
    per-layer overheads, and the all-reduce of the gradients of weights replicated over the
    batch (``_replicated_grad_bytes``), per micro-batch; unrolled layers gather once per step)
    and ends with one optimizer update. A remat policy adds the profile's
    ``remat_forward_cost`` forward passes."""
    cfg, head = w.models()[role]
    g = _geometry(p, profile)
    mb, seq = min(w.minibatch_size, w.rows), w.seq_len
    m = w.microbatches(role, g.batch)
    micro = w.microbatch_rows(role, g.batch)
    # forward, and a backward of two matmuls per weight (input and weight gradients); a LoRA
    # model's frozen weights take no weight gradient (its adapters' are a rank/hidden sliver)
    passes = (2.0 if w.lora(role) else 3.0) + (
        profile.remat_forward_cost if cfg.remat_policy != "none" else 0.0
    )
    flops = passes * forward_flops(cfg, mb, seq, head, _head_tokens(w, head, role, mb))
    # With pipeline stages (_Pipeline): the bubble's filler on the layer work, each iteration
    # launching (and, scanned, gathering) its stage's layers again, and the stage sends; 1F1B
    # recomputes each stage's forward in its backward. In the fused actor-critic program each
    # stage runs only the ops its table slots name: the layer work is the table's critical
    # path (_fused_work, the backward's recompute in it: no extra pass), and the two models'
    # shares add up to it (the caller sums the two calls, which share their devices).
    table = _fused_table(w, g) if role in ("actor", "critic") else None
    ticks = table.ticks if table is not None else 0
    work = _fused_work(w, g, table) if table is not None else 0.0
    pipe = _pipeline(cfg, g, train=True, ticks=ticks, work=work)
    if pipe.schedule == "1f1b":
        flops += forward_flops(cfg, mb, seq, head, 0)
    runs = cfg.num_layers * pipe.layer_runs
    # one program for both models in the fused step: the actor's share pays its dispatch
    dispatch = 0.0 if ticks and role == "critic" else profile.call_overhead_s
    step = _fixed_s(
        dispatch + profile.train_step_overhead_s + m * runs * profile.train_layer_overhead_s,
        g,
        profile,
    )
    if ticks and role == "critic":
        # the critic's stage weights flipped onto the reversed stages, their gradients back
        # (jrlhf.runtime.fused_step._flip_stages: collective permutes)
        step += _comm_s(2 * shard_bytes(cfg, head, p, ("layers",)), 2, g, profile)
    step += m * runs * profile.train_layer_overhead_once_s
    step += pipe.layer_work * _work_s(
        flops / g.n, g, profile.matmul_flops * profile.train_efficiency, profile
    )
    step += (m * pipe.layer_work / pipe.stages) * _activation_s(
        cfg, -(-micro // g.batch) * seq, seq, g, profile.train_activation_efficiency, profile
    )
    step += m * pipeline_send_seconds(cfg, -(-micro // g.batch), seq, g, 2, profile, ticks)
    gathered = _gathered_weight_bytes(cfg, head, p, g)
    if pipe.stages > 1 and not layers_unrolled(cfg, profile):
        # scanned layers inside the schedule's loop: every iteration gathers its stage's
        # layers again (forward, backward) and reduce-scatters their gradients
        # (benchmarks/pipeline_memory.py's programs: the gathers sit in the inner loop body;
        # the fused program's, in the branches that run them)
        its = pipe.busy_iterations
        step += m * _comm_s(3 * its * gathered, 3 * round(runs), g, profile)
    elif layers_unrolled(cfg, profile):
        # unrolled layers: XLA gathers each weight once per step, and the forward's gathered
        # copy serves the backward; the gathers do not depend on the micro-batch, so they are
        # hoisted out of the accumulation loop (loop-invariant code motion: the compiled step's
        # loop body holds none, tests/placement/test_plan_estimator.py). Each micro-batch
        # reduce-scatters its gradients.
        step += _comm_s(gathered, cfg.num_layers, g, profile)
        step += m * _comm_s(gathered, cfg.num_layers, g, profile)
    else:
        # per micro-batch: two all-gathers of the weights (forward, backward) and a
        # reduce-scatter of the gradients
        step += m * _comm_s(3 * gathered, 3 * cfg.num_layers, g, profile)
    act = -(-micro // g.batch) * seq * cfg.hidden_size * itemsize(cfg.dtype)
    tp_bytes = 4 * cfg.num_layers * 2 * _ring(act, g.tensor) * pipe.layer_work / pipe.stages
    tp = _comm_s(tp_bytes, round(4 * runs), g, profile)
    step += m * tp
    # expert parallelism: dispatch and combine in the forward, their transposes in the backward
    dispatch = moe_dispatch_bytes(cfg, act, g.experts)
    step += m * _comm_s(2 * cfg.num_layers * dispatch, 4 * cfg.num_layers, g, profile)
    # the gradients of weights replicated over the batch's axes: XLA combines them into one
    # all-reduce per micro-batch (inside the accumulation loop, in the compiled step's HLO)
    step += m * _comm_s(_replicated_grad_bytes(cfg, head, p), 1, g, profile)
    elems = trained_bytes(cfg, head, p, w.lora(role)) / itemsize(cfg.param_dtype)
    step += _work_s(elems * profile.optimizer_bytes_per_param, g, profile.memory_bandwidth, profile)
    return w.train_steps * step


def reshard_seconds(
    w: Workload, edge: ReshardEdge, plan: ExecutionPlan, profile: DeviceProfile
) -> float:
    """The resharder's compiled transition: it writes a new array on every target device, even
    where nothing crosses devices, and the parameters of which a device needs parts held
    elsewhere arrive through collectives. Between disjoint device sets of one size (the
    resharder's ``device_put+jit`` path), a twin copy of the source layout onto the target
    devices comes first (``_twin_copy_seconds``), then all of this on the target. Between
    nodes whose device counts do not divide one another, every target device receives the
    resharder's relay layout: a gcd-th of the weights.

    Off a shared host: the bytes each target device receives over the links the move spans,
    the target copy read and written at memory bandwidth, one collective's latency per
    parameter that moves. On a shared host (every device a thread of one process, one memory):
    every device's target copy at one fitted rate, and the collectives' outputs
    (``reshard_gathered_bytes``: the whole target shard of every device that receives a part)
    at another: on one host a gathered shard costs about the same whatever part of it came
    from other threads. Refitted to three plan-bench runs' calibrations, this put their
    reshards within 22% in sample (the two-device run aside, -13% to -24%) where the bytes
    from other devices plus a per-parameter latency missed by -37% to +45%. Where the two
    layouts are the same (``same_layout``) the resharder aliases the source: no time."""
    cfg, head = w.models()[edge.role]
    # the layouts do not depend on the remat policy: one cache entry for every policy
    cfg = replace(cfg, remat_policy="none") if cfg.remat_policy != "none" else cfg
    src, dst = plan[edge.src], plan[edge.dst]
    if same_layout(cfg, head, src, dst):  # the resharder aliases the training copy
        return 0.0
    # processes are nodes here: the resharder's own choice of path between the device sets
    crosses = {d // profile.devices_per_node for d in src.devices} != {
        d // profile.devices_per_node for d in dst.devices
    }
    path = path_between(frozenset(src.devices), frozenset(dst.devices), crosses)
    twin_s = 0.0
    if path == "device_put+jit":
        # the resharder's device_put+jit path: the source layout copied shard for shard onto
        # the target devices (its "twin"), then the same-devices reshard there
        twin_s = _twin_copy_seconds(cfg, head, src, dst, profile)
        src = twin_placement(src, dst)
    devices = src.devices | dst.devices
    nodes = len({d // profile.devices_per_node for d in devices})
    bw = _link_bandwidth(nodes, profile) * profile.reshard_efficiency
    target = shard_bytes(cfg, head, dst)
    if profile.shared_host:
        copy_bw = _link_bandwidth(nodes, profile) * (
            profile.reshard_copy_efficiency or profile.reshard_efficiency
        )
        moved = reshard_gathered_bytes(cfg, head, src, dst) / bw
        copy = target * dst.mesh.size / copy_bw
        latency = 0.0
    else:
        per_device = reshard_bytes_per_device(cfg, head, src, dst)
        received = max(per_device.values(), default=0)
        if path == "relay":  # every target device receives 1 / gcd of the weights
            total = num_params(cfg, head) * itemsize(cfg.param_dtype)
            received = max(received, total / math.gcd(src.mesh.size, dst.mesh.size))
        moved = received / bw
        copy = 2 * target / profile.memory_bandwidth
        # one collective per parameter that moves, each paying the measured collective latency
        latency = profile.collective_latency_s * reshard_moving_leaves(cfg, head, src, dst)
    # dispatch and per-leaf copies: every device of the move runs them (on a shared host, on
    # the same cores)
    overhead = _fixed_n_s(profile.reshard_overhead_s, len(devices), profile)
    return overhead + moved + latency + copy + twin_s


def twin_placement(src: CallPlacement, dst: CallPlacement) -> CallPlacement:
    """``src``'s mesh axes and rules on ``dst``'s devices, in ``dst``'s order: where the
    resharder copies a source layout before resharding between disjoint device sets
    (``jrlhf.reshard.processes.twin``)."""
    return CallPlacement(MeshSpec(src.mesh.axes, dst.mesh.device_ids()), src.rules)


def _twin_copy_seconds(
    cfg: ModelConfig, head: str, src: CallPlacement, dst: CallPlacement, profile: DeviceProfile
) -> float:
    """Copying every source shard to its twin device: its bytes (on a shared host all copies
    go through one memory at the target copy's rate; otherwise every device sends its shard
    over its own link at once) plus ``reshard_twin_shard_s`` per shard copied (every device's
    shard of every parameter; on a shared host one after another)."""
    shard = shard_bytes(cfg, head, src)
    nodes = len({d // profile.devices_per_node for d in src.devices | dst.devices})
    bw = _link_bandwidth(nodes, profile)
    copies = len(_param_table(cfg, head))
    if profile.shared_host:
        eff = profile.reshard_copy_efficiency or profile.reshard_efficiency
        return (shard / (bw * eff) + copies * profile.reshard_twin_shard_s) * src.mesh.size
    return shard / (bw * profile.reshard_efficiency) + copies * profile.reshard_twin_shard_s


# ------------------------------------------------------------------------------- memory model
def _state_bytes(cfg: ModelConfig, head: str, p: CallPlacement, train: bool) -> int:
    """Parameters (and, for a trained model, fp32 AdamW moments) on one device."""
    b = shard_bytes(cfg, head, p)
    if train:
        b += _moment_bytes(cfg, head, p)
    return b


def _moment_bytes(
    cfg: ModelConfig, head: str, p: CallPlacement, lora: LoraConfig | None = None
) -> int:
    """fp32 AdamW moments of the trained parameters one device holds (with ``lora``, of the
    adapters and a value head only)."""
    return trained_bytes(cfg, head, p, lora) // itemsize(cfg.param_dtype) * MOMENT_BYTES


def _kv_pool_bytes(w: Workload, g: _Geometry) -> int:
    """The engine's page pool: its slots (not the rows) at full length, split over the data
    shards, the kv-head axis and the pipeline stages (each holds its layers' pages)."""
    per_shard = _engine_slots(w, g) // g.batch * w.seq_len * kv_bytes_per_token(w.actor)
    return int(per_shard / g.kv_tensor / g.stages)


def _resident_parts(
    w: Workload, plan: ExecutionPlan, profile: DeviceProfile
) -> list[tuple[str, str | None, frozenset[int], int]]:
    """Everything that can live on the devices across an iteration, as (what, knob, devices,
    bytes per device); ``knob`` names the memory knob that can take it off the devices
    (a Memory.offload item or "generation_copy"), None for what always stays."""
    out = []
    models = w.models()
    for role, (cfg, head) in models.items():
        if role in ("actor", "critic"):
            train, lora = plan.for_role(role, "train"), w.lora(role)
            out.append((f"{role} params", None, train.devices, held_bytes(cfg, head, train, lora)))
            out.append(
                (
                    f"{role} adam",
                    f"{role}_optimizer",
                    train.devices,
                    _moment_bytes(cfg, head, train, lora),
                )
            )
        else:  # reference, reward
            p = plan[f"{role}_infer"]
            out.append((f"{role} params", role, p.devices, shard_bytes(cfg, head, p)))
    gen = plan["actor_generate"]
    # the generation copy is the resharder's output: the "shadow" copy when generation has its
    # own devices, none when it aliases the training copy (the same layout)
    same = same_layout(w.actor, "lm", plan.for_role("actor", "train"), gen)
    # A LoRA actor's copy is its merged weights, never its training tree: always a copy.
    copy = 0 if same and w.actor_lora is None else shard_bytes(w.actor, "lm", gen)
    out.append(("actor generation copy", "generation_copy", gen.devices, copy))
    out.append(("kv pool", None, gen.devices, _kv_pool_bytes(w, _geometry(gen, profile))))
    if "critic" in models and not same_layout(
        w.critic, "value", plan["critic_train"], plan["critic_infer"]
    ):
        p = plan["critic_infer"]
        out.append(("critic inference copy", None, p.devices, shard_bytes(w.critic, "value", p)))
    return out


def _on_device(w: Workload, knob: str | None, phase: str) -> bool:
    """Whether state under ``knob`` is on the devices during ``phase`` with ``w``'s settings:
    offloaded items only in their phases (``OFFLOAD_PHASES``), a dropped generation copy only
    from the reshard to the end of generation."""
    if knob is None:
        return True
    if knob == "generation_copy":
        return w.generation_copy != "dropped" or phase in DROPPED_COPY_PHASES
    return knob not in w.offload or phase in OFFLOAD_PHASES[knob]


def _resident(
    w: Workload, plan: ExecutionPlan, profile: DeviceProfile, phase: str
) -> dict[int, dict[str, int]]:
    """device -> {what: bytes} for everything that lives on the device during ``phase`` (one of
    PHASES): all of it without memory knobs."""
    out: dict[int, dict[str, int]] = {}
    for what, knob, devices, nbytes in _resident_parts(w, plan, profile):
        if not _on_device(w, knob, phase):
            continue
        for d in devices:
            out.setdefault(d, {})
            out[d][what] = out[d].get(what, 0) + int(nbytes)
    return out


def _offload_items(w: Workload, plan: ExecutionPlan) -> dict[str, tuple[frozenset[int], int]]:
    """item -> (devices, bytes per device) of each offloaded item this workload has."""
    models = w.models()
    out = {}
    for item in w.offload:
        role = item.removesuffix("_optimizer")
        if role not in models:
            continue
        cfg, head = models[role]
        if item.endswith("_optimizer"):
            p = plan.for_role(role, "train")
            out[item] = (p.devices, _moment_bytes(cfg, head, p, w.lora(role)))
        else:
            p = plan[f"{role}_infer"]
            out[item] = (p.devices, _state_bytes(cfg, head, p, False))
    return out


def offload_seconds(
    w: Workload, plan: ExecutionPlan, profile: DeviceProfile
) -> dict[str, dict[str, float]]:
    """item -> {phase: seconds} of the host-memory copies an offloaded item costs per iteration:
    back to the device when its phase begins, out again when the next phase begins (where
    ``jrlhf.ppo.residency`` makes them; the trainer waits for each). Every device copies its own
    shard over its own link (all at once); on a shared host they share the machine's memory
    bandwidth. An unknown ``host_bandwidth`` prices them at infinity."""
    out: dict[str, dict[str, float]] = {}
    for item, (devices, nbytes) in _offload_items(w, plan).items():
        total = nbytes * (len(devices) if profile.shared_host else 1)
        one = total / profile.host_bandwidth if profile.host_bandwidth > 0 else math.inf
        back = OFFLOAD_PHASES[item][0]
        out_phase = PHASES[(PHASES.index(OFFLOAD_PHASES[item][-1]) + 1) % len(PHASES)]
        out[item] = {back: one}
        out[item][out_phase] = out[item].get(out_phase, 0.0) + one
    return out


def _logits_bytes(cfg, head: str, head_tokens_per_device: float, tensor: int, copies: int) -> float:
    if head != "lm":
        return head_tokens_per_device * 4 * copies
    return head_tokens_per_device * cfg.vocab_size / tensor * 4 * copies  # float32 logits


def _unrolled_layer_bytes(
    w: Workload, cfg: ModelConfig, p: CallPlacement, profile: DeviceProfile
) -> int:
    """Per-device bytes of the per-layer weight copies a generate call holds when its decode steps
    run the layers unrolled (DecodeConfig.layer_loop 'unroll', or 'auto' on CPU, where the
    engine unrolls by default): every layer weight's shard once more, and on CPU, where the
    copies are output-major or packed panels (``EngineConfig.weight_layout``), an untied LM
    head's shard too, and on one device (where the engine packs panels) a tied embedding's
    packed copy as well. 'auto' on accelerators unrolls only into memory the plan leaves free
    (``layer_copies_fit``): nothing here."""
    loop = w.decode_layer_loop
    if not (loop == "unroll" or (loop == "auto" and profile.shared_host)):
        return 0
    copied = ("layers",)
    if profile.shared_host:
        copied += ("lm_head",)
        if len(p.devices) == 1 and cfg.tie_word_embeddings:
            copied += ("embedding",)
    return shard_bytes(cfg, "lm", p, only=copied)


def _working_bytes(w: Workload, call: str, p: CallPlacement, profile: DeviceProfile) -> float:
    """Transient bytes a call needs on top of the residents (per device)."""
    role, phase = CALLS[call]
    cfg, head = w.models()[role]
    g = _geometry(p, profile)
    a = itemsize(cfg.dtype)
    fused = attention_is_fused(cfg, profile.fused_attention)
    if phase == "generate":
        plen = prefill_len(w)
        slots = _engine_slots(w, g)
        prefill_rows = -(-min(w.rows, slots, 64) // g.batch)
        act = (
            prefill_rows
            * plen
            * (
                activation_bytes_per_token(cfg, plen, g.tensor, saved=False, fused_attention=fused)
                + 2 * cfg.hidden_size * a
            )
        )
        in_flight = -(-min(w.rows, slots) // g.batch)
        logits = _logits_bytes(cfg, "lm", max(in_flight, prefill_rows), g.tensor, 4)
        return act + logits + _unrolled_layer_bytes(w, cfg, p, profile)
    pipe = _pipeline(cfg, g)
    if phase == "infer":
        rows = -(-w.infer_chunk // g.batch)
        tokens = rows * w.seq_len
        # with stages: one pipeline micro-batch live in a layer, and the schedule's inputs and
        # outputs of every micro-batch (bubble iterations' included)
        live = activation_bytes_per_token(
            cfg, w.seq_len, g.tensor, saved=False, fused_attention=fused
        )
        act = tokens * (live / pipe.micro + 2 * cfg.hidden_size * a * pipe.layer_work)
        logits = _logits_bytes(cfg, head, _head_tokens(w, head, role, rows), g.tensor, 3)
        return act + logits + _gather_buffer_bytes(cfg, head, p, profile, train=False)
    # train: gradients (and their accumulator with micro-batches), saved activations of one
    # micro-batch per the remat policy, logits and their gradient
    rows = -(-w.microbatch_rows(role, g.batch) // g.batch)
    tokens = rows * w.seq_len
    grads = trained_bytes(cfg, head, p, w.lora(role))
    grads *= 2 if w.microbatches(role, g.batch) > 1 else 1
    saved_layer = activation_bytes_per_token(
        cfg, w.seq_len, g.tensor, saved=True, fused_attention=fused
    )
    # With stages a device keeps its L / S layers' residuals of every iteration until the
    # backward (autodiff through the GPipe schedule), the bubble's filler included; a layer's
    # recompute under remat is one pipeline micro-batch's. 1F1B keeps a ring of 2S micro-batch
    # inputs a stage and one micro-batch's residuals of its stage (the backward's recompute),
    # and runs the head on one micro-batch at a time.
    pipe = _pipeline(cfg, g, train=True)
    layers = cfg.num_layers * pipe.layer_work / pipe.stages
    recompute = tokens / pipe.micro * saved_layer
    if pipe.schedule == "1f1b":
        micro_tokens = tokens / pipe.micro
        held = cfg.num_layers / pipe.stages * micro_tokens * saved_layer
        ring = 2 * pipe.stages * micro_tokens * cfg.hidden_size * a
        logits = _logits_bytes(cfg, head, _head_tokens(w, head, role, rows), g.tensor, 4)
        logits /= pipe.micro
        gathered = _gather_buffer_bytes(cfg, head, p, profile, train=True)
        return grads * 2 + held + ring + logits + gathered
    if cfg.remat_policy == "none":
        act = layers * tokens * saved_layer
    elif cfg.remat_policy == "full":
        act = layers * tokens * cfg.hidden_size * a + recompute
    else:  # dots policies keep the matmul outputs, not the attention probabilities
        dots = cfg.head_dim * (cfg.num_heads * 2 + 2 * cfg.num_kv_heads) + 3 * mlp_width(cfg)
        act = layers * tokens * (cfg.hidden_size + dots / g.tensor) * a + recompute
    logits = _logits_bytes(cfg, head, _head_tokens(w, head, role, rows), g.tensor, 4)
    return grads + act + logits + _gather_buffer_bytes(cfg, head, p, profile, train=True)


def batch_problem(w: Workload, call: str, p: CallPlacement) -> str | None:
    """A training micro-batch or a scoring chunk whose rows do not split over the call's batch
    shards (the trainer would refuse it; decode slots are rounded up instead)."""
    role, phase = CALLS[call]
    shards = axis_size(p.mesh, _dim_axes(("batch",), p.mesh, p.rules)[0])
    if phase == "train":
        rows, what = w.microbatch_rows(role, shards), "micro-batch"
    elif phase == "infer":
        rows, what = w.infer_chunk, "scoring chunk"
    else:
        return None
    if shards > 1 and rows % shards:
        return f"{what} of {rows} rows does not split over {shards} batch shards"
    return None


def _fmt(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB / 10 else f"{n / 2**20:.1f} MiB"


# ------------------------------------------------------------------------------------ estimate
def _active_calls(w: Workload) -> list[str]:
    models = w.models()
    return [c for c, (role, _) in CALLS.items() if role in models]


def iteration_seconds(
    phases: dict[str, float],
    max_staleness: int = 0,
    separated: bool = False,
    data_plane_s: float = 0.0,
) -> float:
    """An iteration's time from its phases. Synchronous (``max_staleness`` 0), or generation and
    the rest sharing devices: the sum. Asynchronous on a plan whose generation devices no other
    call uses (``separated``, and hosts that run them at the same time): generating the next
    batch overlaps scoring, training and resharding this one, so the slower of the two; the
    training group receives each batch (``data_plane_s``, ``group_traffic``) before it scores
    it, so the transfer adds to the rest."""
    if max_staleness >= 1 and separated:
        rest = sum(v for k, v in phases.items() if k != "generate") + data_plane_s
        return max(phases.get("generate", 0.0), rest)
    return sum(phases.values())


def concurrent_seconds(seconds: Sequence[float], profile: DeviceProfile) -> float:
    """Time of calls dispatched together on pairwise disjoint devices: the longest one where
    devices have their own compute; on a shared host, where they take turns on the same cores,
    the longest one or ``call_core_share`` of their sum, whichever is more."""
    if not seconds:
        return 0.0
    if not profile.shared_host:
        return max(seconds)
    return max(max(seconds), profile.call_core_share * sum(seconds))


def _calls_seconds(seconds: Sequence[float], disjoint: bool, profile: DeviceProfile) -> float:
    """Calls of one phase: at the same time where their devices are ``disjoint``, else in turn."""
    return concurrent_seconds(seconds, profile) if disjoint else sum(seconds)


def generation_separated(plan: ExecutionPlan, calls: list[str]) -> bool:
    """Whether no call of ``calls`` but actor_generate uses a device of actor_generate."""
    gen = plan["actor_generate"].devices
    return all(not (plan[c].devices & gen) for c in calls if c != "actor_generate")


def estimate(plan: ExecutionPlan, workload: Workload, profile: DeviceProfile) -> PlanEstimate:
    """Seconds per call, phase and iteration, peak memory per call, and whether the plan fits."""
    w = workload
    active = _active_calls(w)
    reasons: list[str] = []
    for call in active:
        role, _ = CALLS[call]
        cfg, head = w.models()[role]
        for problem in layout_problems(cfg, head, plan[call])[:1]:
            reasons.append(f"{call}: {plan[call]}: {problem}")
        problem = batch_problem(w, call, plan[call])
        if problem:
            reasons.append(f"{call}: {plan[call]}: {problem}")
    problem = fused_problem(w, plan, profile)
    if problem:
        reasons.append(f"critic_train: {problem}")

    call_seconds = {c: 0.0 for c in CALLS}
    for call in active:
        role, phase = CALLS[call]
        p = plan[call]
        if phase == "generate":
            call_seconds[call] = rollout_seconds(w, p, profile)
        elif phase == "infer":
            call_seconds[call] = infer_seconds(w, role, p, profile)
        else:
            call_seconds[call] = train_seconds(w, role, p, profile)

    reshard = {}
    for edge in plan.reshard_edges():
        if edge.role in w.models():
            reshard[edge.role] = reshard_seconds(w, edge, plan, profile)

    # Only the calls this workload makes can overlap (no critic in GRPO, no reward model with a
    # verifiable reward): an absent call's placeholder slot must not break the overlap.
    scoring = [c for c in INFERENCE_CALLS if c in active]
    infer = [call_seconds[c] for c in scoring]
    # host work of the score phase besides the model calls: packing, the advantage function and
    # fetching its results (a few synchronizing calls)
    # dynamic sampling scores every round it generates
    score = workload_rounds(w) * _calls_seconds(infer, plan.overlapping_inference(scoring), profile)
    score += 2 * profile.call_overhead_s
    disjoint_train = not (plan["actor_train"].devices & plan["critic_train"].devices)
    trains = [call_seconds["actor_train"], call_seconds["critic_train"]]
    train = _calls_seconds(trains, disjoint_train, profile)
    phases = {
        "generate": call_seconds["actor_generate"],
        "score": score,
        "train": train,
        "reshard": sum(reshard.values()),
    }
    offload = {}
    for item, by_phase in offload_seconds(w, plan, profile).items():
        offload[item] = sum(by_phase.values())
        for phase, secs in by_phase.items():
            phases[phase] += secs
        if not math.isfinite(offload[item]):
            reasons.append(f"offload {item}: profile {profile.name} has no host_bandwidth")

    memory = {c: 0 for c in CALLS}
    breakdown: dict[str, dict[str, int]] = {}
    capacity = profile.usable_bytes
    residents = {ph: _resident(w, plan, profile, ph) for ph in ("generate", "score", "train")}
    for call in active:
        p = plan[call]
        resident = residents[CALL_PHASE[CALLS[call][1]]]
        working = _working_bytes(w, call, p, profile)
        worst_device, worst = None, -1.0
        for d in p.devices:
            total = sum(resident.get(d, {}).values()) + working
            if total > worst:
                worst_device, worst = d, total
        memory[call] = int(worst)
        breakdown[call] = {**resident.get(worst_device, {}), "working": int(working)}
        if worst > capacity:
            parts = ", ".join(
                f"{k} {_fmt(v)}" for k, v in sorted(resident.get(worst_device, {}).items())
            )
            reserve = (
                f" less a {_fmt(profile.memory_reserve_bytes)} reserve"
                if profile.memory_reserve_bytes
                else ""
            )
            reasons.append(
                f"{call}: needs {_fmt(worst)} per device on device {worst_device} "
                f"({parts}, working {_fmt(working)}) but {profile.name} has "
                f"{_fmt(profile.memory_bytes)}{reserve}"
            )
    separated = generation_separated(plan, active) and not profile.shared_host
    # samples cross between groups where generation has processes of its own
    data_plane = group_traffic(w, plan, profile).data_seconds if separated else 0.0
    data_plane = data_plane if w.max_staleness >= 1 else 0.0
    return PlanEstimate(
        plan=plan,
        call_seconds=call_seconds,
        reshard_seconds=reshard,
        phase_seconds=phases,
        iteration_seconds=iteration_seconds(phases, w.max_staleness, separated, data_plane),
        data_plane_seconds=data_plane,
        memory_bytes=memory,
        fits=not reasons,
        reasons=reasons,
        workload=w,
        offload_seconds=offload,
        memory_breakdown=breakdown,
    )


# ------------------------------------------------------------------------------ fusion
def tail_replicas(gen: CallPlacement) -> np.ndarray:
    """The generation call's data-parallel replicas: one row of device ids each."""
    spec = gen.mesh
    data = _dim_axes(("slots",), spec, gen.rules)[0]
    ids = np.array(spec.device_ids()).reshape([size for _, size in spec.axes])
    return replica_groups(ids, spec.names, data)


def tail_placement(gen: CallPlacement, replicas: int, avoid: frozenset[int]) -> CallPlacement:
    """Where a migrated tail decodes (jrlhf.ppo.fusion.tail_migration): ``replicas`` of the
    generation call's data-parallel replicas (``tail_replicas``), those holding the fewest
    ``avoid`` devices (the scoring calls'), chosen by the rule the trainer uses; same axes, the
    data axes shrunk."""
    spec = gen.mesh
    data = _dim_axes(("slots",), spec, gen.rules)[0]
    groups = tail_replicas(gen)
    replicas = min(replicas, len(groups))
    picked = groups[pick_replicas(groups, replicas, avoid)]
    first = next((a for a in spec.names if a in data), None)
    axes = tuple(
        (a, (replicas if a == first else 1) if a in data else size) for a, size in spec.axes
    )
    return CallPlacement(MeshSpec(axes, tuple(int(d) for d in picked.flat)), gen.rules)


def tail_devices(gen: CallPlacement, replicas: int, avoid: frozenset[int]) -> frozenset[int]:
    """The devices of ``tail_placement``."""
    return tail_placement(gen, replicas, avoid).devices


def fused_rollout_seconds(
    plan: ExecutionPlan,
    workload: Workload,
    profile: DeviceProfile,
    lengths: Sequence[int],
    score_rows: int,
    migrate_rows: int = 0,
    migrate_replicas: int = 1,
) -> dict[str, float]:
    """Time to a scored batch without and with inter-stage fusion (jrlhf.ppo.fusion), for rows
    whose responses have ``lengths`` tokens (``workload.gen_len``: the packed response length
    scoring sees, TaskConfig.max_response_len).

    Generation runs until the longest row ends; every decode step costs the same (the engine
    steps all its slots), and a row is handed over at the end of the decode chunk it finished
    in. Unfused, scoring (all rows) follows generation. Fused, a call of ``score_rows``
    rows is dispatched whenever that many rows have finished and the rest after generation;
    those calls overlap the decode only when the scoring calls run on devices generation does
    not use and devices run concurrently (not ``shared_host``); otherwise they queue behind the
    decode, each delaying it by its own time.

    With ``migrate_rows`` (Fusion.migrate_rows), at the end of the chunk after which at most
    that many rows still decode, their KV moves to ``migrate_replicas`` generation replicas
    (``tail_placement``; priced at the link bandwidth, plus a call overhead), decode there at
    the tail placement's step time for that many rows, and from then on the scoring calls
    overlap the tail when their devices are disjoint from the tail's.
    Returns unfused and fused seconds, the generation and scoring parts, and the overlap flags.
    """
    w, rows = workload, len(lengths)
    gen_p = plan["actor_generate"]
    longest = max(int(n) for n in lengths)
    prefill = generate_seconds(dataclasses.replace(w, gen_len=1), gen_p, profile)
    generate = generate_seconds(dataclasses.replace(w, gen_len=longest), gen_p, profile)
    step = (generate - prefill) / max(1, longest - 1)
    chunk = max(1, w.decode_chunk_steps)
    # the decode step after which each row is handed over (its chunk's end), in finishing order
    handed = sorted(min(-(-max(0, int(n) - 1) // chunk) * chunk, longest - 1) for n in lengths)
    ready = [prefill + step * s for s in handed]

    scoring = [c for c in INFERENCE_CALLS if c in _active_calls(w)]
    overlap_calls = plan.overlapping_inference(scoring)

    def score(n: int) -> float:
        wk = dataclasses.replace(w, prompts=n, samples_per_prompt=1)
        t = [infer_seconds(wk, CALLS[c][0], plan[c], profile) for c in scoring]
        return _calls_seconds(t, overlap_calls, profile) + profile.call_overhead_s

    unfused = generate + score(rows)
    per_call = score(score_rows)
    full, rest = divmod(rows, score_rows)
    early = [ready[(j + 1) * score_rows - 1] for j in range(full)]
    scoring_devices = set().union(*(plan[c].devices for c in scoring)) if scoring else set()
    concurrent = not profile.shared_host
    overlap = not (scoring_devices & gen_p.devices) and concurrent

    # Migration: when, at what price, on which devices, and how fast the tail then steps.
    migrate_at, migrate_s, overlap_tail, generate_end = math.inf, 0.0, False, generate
    if migrate_rows and migrate_rows < rows:
        migrate_step = handed[rows - migrate_rows - 1]
        if migrate_step < longest - 1:  # some rows still decode after that chunk
            migrate_at = prefill + step * migrate_step
            g = _geometry(gen_p, profile)
            kv = migrate_rows * (w.prompt_len + migrate_step) * kv_bytes_per_token(w.actor)
            bw = _link_bandwidth(g.nodes, profile) * profile.reshard_efficiency
            migrate_s = profile.call_overhead_s + kv / max(1, g.kv_tensor) / bw
            tail_p = tail_placement(gen_p, migrate_replicas, frozenset(scoring_devices))
            overlap_tail = not (scoring_devices & tail_p.devices) and concurrent
            # The tail's decode step: its rows on its devices (the same weight reads per step
            # on accelerators; fewer devices' fixed costs on a shared host).
            wt = dataclasses.replace(w, prompts=migrate_rows, samples_per_prompt=1)
            t1 = generate_seconds(dataclasses.replace(wt, gen_len=1), tail_p, profile)
            tn = generate_seconds(dataclasses.replace(wt, gen_len=longest), tail_p, profile)
            tail_step = (tn - t1) / max(1, longest - 1)
            moved_at = migrate_at + migrate_s
            ready = [t if s <= migrate_step else moved_at + tail_step * (s - migrate_step)
                     for t, s in zip(ready, handed)]  # fmt: skip
            early = [ready[(j + 1) * score_rows - 1] for j in range(full)]
            generate_end = moved_at + tail_step * (longest - 1 - migrate_step)

    if overlap:
        busy = 0.0  # when the scoring devices are free again
        for t in early:
            busy = max(busy, t) + per_call
        fused = max(busy, generate_end) + (per_call if rest else 0.0)
    elif overlap_tail:
        # Calls of rows finished before the migrating chunk queue behind the decode (delaying
        # it); the rest are dispatched after the tail has moved (the engine hands a chunk's
        # rows over after it dispatches the next chunk) and run beside it.
        before = sum(t < migrate_at for t in early)
        delay = before * per_call
        busy = migrate_at + delay
        for t in early[before:]:
            busy = max(busy, t + delay) + per_call
        fused = max(busy, generate_end + delay) + (per_call if rest else 0.0)
    else:
        fused = generate_end + (full + (1 if rest else 0)) * per_call
    return {
        "unfused_s": unfused,
        "fused_s": fused,
        "generate_s": generate,
        "generate_migrated_s": generate_end,
        "score_all_s": score(rows),
        "score_call_s": per_call,
        "score_calls": full + (1 if rest else 0),
        "overlap": overlap,
        "migrate_s": migrate_s,
        "migrated": math.isfinite(migrate_at),
        "overlap_tail": overlap_tail,
    }


# ------------------------------------------------------------------------------ batch knobs
def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _pick(options: list[tuple[float, float, object]], capacity: float) -> int:
    """The index of the fastest option whose peak fits ``capacity`` (ties: the earlier
    option); when none fits, the one least over memory. Options: (seconds, peak, value)."""
    fitting = [i for i, o in enumerate(options) if o[1] <= capacity]
    if fitting:
        return min(fitting, key=lambda i: options[i][0])
    return min(range(len(options)), key=lambda i: (options[i][1], options[i][0]))


def _remat_options(cfg: ModelConfig) -> list[str]:
    """Remat policies to try for a training call: the config's first (it wins ties), then
    none, dots, full (dots_no_batch is priced as dots). Layers unrolled by the config's own
    choice (``layer_loop='unroll'``) run without remat (ModelConfig refuses both): none only."""
    if cfg.layer_loop == "unroll":
        return [cfg.remat_policy]
    out = [cfg.remat_policy]
    for policy in ("none", "dots", "full"):
        if policy not in out:
            out.append(policy)
    return out


def pipeline_micro_options(stages: int, rows_per_shard: int) -> list[int]:
    """Pipeline micro-batch counts to try for a pass over ``stages`` stages whose rows give each
    batch shard ``rows_per_shard``: the divisors of those rows from ``stages`` (fewer leave
    stages idle; more than rows pads) up to eight times it (each micro-batch pays a stage's
    launches and sends), so every micro-batch splits evenly over the shards, as the 1F1B
    schedule needs. With fewer rows than stages, all the rows one each."""
    if stages <= 1:
        return []
    out = [d for d in range(stages, 8 * stages + 1) if rows_per_shard % d == 0]
    return out or [rows_per_shard]


def _staged_scoring_roles(w: Workload, plan: ExecutionPlan, profile: DeviceProfile):
    """(role, stages, batch shards) of the frozen scoring roles whose call has stages (their
    pipeline micro-batches go with the scoring chunk; the critic's go with its training)."""
    out = []
    for call in INFERENCE_CALLS:
        role = CALLS[call][0]
        if role not in w.models() or role == "critic":
            continue
        g = _geometry(plan[call], profile)
        if g.stages > 1:
            out.append((role, g.stages, g.batch))
    return out


def _residency_options(w: Workload, profile: DeviceProfile) -> list[tuple[str, tuple[str, ...]]]:
    """(generation_copy, offload) settings to try, fewest knobs first (they win ties). Offload
    only where the profile knows the host link's bandwidth."""
    models = w.models()
    items = [
        item
        for item in ("reference", "reward", "actor_optimizer", "critic_optimizer")
        if item.removesuffix("_optimizer") in models
    ]
    if profile.host_bandwidth <= 0:
        items = []
    subsets = [
        tuple(item for i, item in enumerate(items) if mask >> i & 1)
        for mask in range(1 << len(items))
    ]
    subsets.sort(key=len)
    return [(copy, sub) for sub in subsets for copy in ("kept", "dropped")]


@functools.lru_cache(maxsize=65536)
def _call_cost(
    w: Workload, call: str, p: CallPlacement, profile: DeviceProfile
) -> tuple[float, float]:
    """(seconds, working bytes) of a scoring or training call: the search meets the same call
    placement in many plans, and the tuner prices every knob value of it."""
    role, phase = CALLS[call]
    if phase == "infer":
        seconds = infer_seconds(w, role, p, profile)
    else:
        seconds = train_seconds(w, role, p, profile)
    return seconds, _working_bytes(w, call, p, profile)


def tune_batches(
    plan: ExecutionPlan, workload: Workload, profile: DeviceProfile, memory_knobs: bool = True
) -> Workload:
    """``workload`` with its knobs chosen for ``plan``: the scoring chunk (``infer_batch_size``),
    the actor's and critic's micro-batches and, with ``memory_knobs``, each training call's
    remat policy, the generation copy's lifetime and what is offloaded to host memory. The
    fastest setting that fits in ``usable_bytes``, else the one least over.

    Each knob changes only some calls: the chunk the scoring calls' time and working memory, a
    role's micro-batches and remat policy only its training call's, and the residency knobs the
    residents of each phase (hence every call's headroom) and the host copies' time. So the
    per-call options are priced once, and for each residency setting the fastest fitting
    option of each call is taken; the setting with the smallest total (its host copies plus
    the chosen calls' seconds) among those where every call fits wins. Candidates divide the
    batch they split (the rollout rows, the minibatch) and split over every affected call's
    batch shards.
    """
    w = workload
    active = _active_calls(w)
    capacity = profile.usable_bytes

    def priced(calls: list[str], variants: list[tuple[object, Workload]]):
        """(seconds over ``calls``, {call: working bytes}, value) per admissible variant."""
        out = []
        for value, wk in variants:
            if any(batch_problem(wk, c, plan[c]) for c in calls):
                continue
            seconds, working = 0.0, {}
            for c in calls:
                secs, working[c] = _call_cost(wk, c, plan[c], profile)
                seconds += secs
            out.append((seconds, working, value))
        return out

    # the knob groups: the scoring chunk over every scoring call, then each trained role
    groups: list[tuple[list[str], list]] = []
    infer_calls = [c for c in INFERENCE_CALLS if c in active]
    # largest chunk first, so a tie in time keeps the fewer calls
    chunks = sorted(_divisors(w.rows), reverse=True)
    staged = _staged_scoring_roles(w, plan, profile) if memory_knobs else []
    chunk_variants = []
    for c in chunks:
        change: dict = {"infer_batch_size": 0 if c == w.rows else c}
        # staged frozen scorers: pipeline micro-batches a common multiple of their stages
        options = [
            {
                role: replace(getattr(w, role), pipeline_microbatches=k * stages)
                for role, stages, _ in staged
            }
            for k in (1, 2, 4, 8)
            if all(
                c % shards == 0 and (c // shards) % (k * stages) == 0
                for _, stages, shards in staged
            )
        ] or [{}]
        for models in options:
            both = {**change, **models}
            chunk_variants.append((both, replace(w, infer_batch_size=c, **models)))
    groups.append((infer_calls, priced(infer_calls, chunk_variants)))
    for role in ("actor", "critic"):
        call = f"{role}_train"
        if call not in active:
            continue
        cfg = getattr(w, role)
        policies = _remat_options(cfg) if memory_knobs else [cfg.remat_policy]
        g = _geometry(plan[call], profile)
        variants = []
        for policy in policies:
            rcfg = replace(cfg, remat_policy=policy) if policy != cfg.remat_policy else cfg
            # A token budget fixes the split (RoleConfig.microbatch_tokens): not a knob here.
            budget = w.microbatch_tokens(role)
            for m in [None] if budget else _divisors(min(w.minibatch_size, w.rows)):
                change = {role: rcfg} if m is None else {f"{role}_microbatches": m, role: rcfg}
                # with stages: the pipeline micro-batches and the schedule of each step
                rows = -(-min(w.minibatch_size, w.rows) // (m or w.microbatches(role, g.batch)))
                pipes = pipeline_micro_options(g.stages, rows // g.batch) if memory_knobs else []
                # the fused step runs its own schedule: a critic binding 'gpipe' or '1f1b'
                # would turn it off (batch_bindings), so only the micro-batches are a knob
                schedules = [cfg.pipeline_schedule] if w.fused_actor_critic else PIPELINE_SCHEDULES
                for micro, schedule in itertools.product(pipes, schedules):
                    if schedule == "1f1b" and rows % micro:
                        continue
                    piped = replace(rcfg, pipeline_microbatches=micro, pipeline_schedule=schedule)
                    staged_change = {**change, role: piped}
                    variants.append((staged_change, replace(w, **staged_change)))
                if not pipes:
                    variants.append((change, replace(w, **change)))
        groups.append(([call], priced([call], variants)))

    settings = _residency_options(w, profile) if memory_knobs else []
    settings = settings or [(w.generation_copy, w.offload)]
    # Devices holding the same parts hold the same bytes in every setting: price one of each.
    parts = _resident_parts(w, plan, profile)
    holds: dict[int, list[int]] = {}
    for i, (_, _, devices, _) in enumerate(parts):
        for d in devices:
            holds.setdefault(d, []).append(i)
    kinds = {c: {tuple(holds.get(d, ())) for d in plan[c].devices} for c in active}
    # Host copies only add time: a setting whose copies alone, with every call at its fastest,
    # take longer than the best fitting total so far cannot win (settings in order of copies).
    fastest = sum(min(o[0] for o in options) for _, options in groups if options)

    def copies(setting) -> float:
        wr = replace(w, generation_copy=setting[0], offload=setting[1])
        return sum(sum(v.values()) for v in offload_seconds(wr, plan, profile).values())

    costed = sorted(((copies(st), i, st) for i, st in enumerate(settings)), key=lambda x: x[:2])
    best = None
    for host_s, _, (copy, offload) in costed:
        if best is not None and not best[0][0] and host_s + fastest >= best[0][1]:
            break
        wr = replace(w, generation_copy=copy, offload=offload)

        def top(call: str, wr: Workload = wr) -> float:
            phase = CALL_PHASE[CALLS[call][1]]
            return max(
                sum(parts[i][3] for i in kind if _on_device(wr, parts[i][1], phase))
                for kind in kinds[call]
            )

        seconds = host_s
        over = 0.0  # the largest peak / capacity over the calls
        if "actor_generate" in active:
            gen_peak = top("actor_generate") + _working_bytes(
                wr, "actor_generate", plan["actor_generate"], profile
            )
            over = gen_peak / capacity
        changes: dict = {"generation_copy": copy, "offload": offload}
        for calls, options in groups:
            if not options:
                continue
            tops = {c: top(c) for c in calls}
            peaks = [(o[0], max(tops[c] + o[1][c] for c in calls), o[2]) for o in options]
            i = _pick(peaks, capacity)
            seconds += peaks[i][0]
            over = max(over, peaks[i][1] / capacity)
            changes.update(peaks[i][2])
        key = (over > 1, seconds if over <= 1 else over)
        if best is None or key < best[0]:
            best = (key, changes)
    return replace(w, **best[1])


def estimate_tuned(plan: ExecutionPlan, workload: Workload, profile: DeviceProfile) -> PlanEstimate:
    """``estimate`` with the batch and memory knobs ``tune_batches`` chooses for this plan (the
    estimate's ``workload`` carries them)."""
    return estimate(plan, tune_batches(plan, workload, profile), profile)


def batch_bindings(workload: Workload) -> list[str]:
    """Gin bindings that make the trainer use ``workload``'s batch and memory knobs."""
    lines = [f"Memory.infer_batch_size = {workload.infer_batch_size}"]
    for role in ("actor", "critic") if workload.critic is not None else ("actor",):
        budget = workload.microbatch_tokens(role)
        if budget:  # the split follows the budget, as in the config the plan was made for
            lines.append(f"{role}/RoleConfig.microbatch_tokens = {budget}")
        else:
            m = getattr(workload, f"{role}_microbatches")
            lines.append(f"{role}/RoleConfig.microbatches = {m}")
        lines.append(f"{role}/RoleConfig.remat_policy = {getattr(workload, role).remat_policy!r}")
    # pipeline micro-batches and schedule of the roles the plan stages (tune_batches)
    for role, (cfg, _) in workload.models().items():
        if cfg.pipeline_microbatches:
            lines.append(f"{role}/RoleConfig.pipeline_microbatches = {cfg.pipeline_microbatches}")
        if cfg.pipeline_schedule != "gpipe":
            lines.append(f"{role}/RoleConfig.pipeline_schedule = {cfg.pipeline_schedule!r}")
    lines.append(f"Memory.generation_copy = {workload.generation_copy!r}")
    lines.append(f"Memory.offload = {tuple(workload.offload)!r}")
    return lines


def compiled_memory_bytes(compiled) -> int | None:
    """Peak bytes per device XLA reports for a compiled program (None if it cannot say).

    For checking the memory model against XLA after a plan's programs are compiled.
    """
    try:
        m = compiled.memory_analysis()
    except Exception:  # backends without memory analysis
        return None
    if m is None:
        return None
    return int(
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        + m.temp_size_in_bytes
        - m.alias_size_in_bytes
    )


__all__ = [
    "PHASES",
    "GroupTraffic",
    "PlanEstimate",
    "batch_bindings",
    "batch_problem",
    "compiled_memory_bytes",
    "engine_call_seconds",
    "estimate",
    "estimate_tuned",
    "group_traffic",
    "head_params",
    "layers_unrolled",
    "layout_problems",
    "reshard_bytes",
    "reshard_bytes_per_device",
    "reshard_gathered_bytes",
    "reshard_moving_leaves",
    "rollout_seconds",
    "sample_bytes",
    "sampling_rounds",
    "shard_bytes",
    "tune_batches",
    "twin_placement",
]
