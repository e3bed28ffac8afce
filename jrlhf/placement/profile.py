"""Device profiles: the handful of rates and overheads the cost estimator prices work with.

A profile is a JSON file per device kind. ``jrlhf/placement/profiles/cpu.json`` was measured on the
development machine by ``python -m jrlhf.plan.calibrate``. ``h100.json`` and ``h200.json`` have
their single-device rates and efficiencies fitted to ``python -m jrlhf.bench gpu`` reports from one
GPU of each kind (``python -m jrlhf.plan.calibrate --from-bench-gpu``, the reports in docs/gpu/);
their links, memory and fixed overheads are datasheet numbers (``measured.template_notes``), which
one GPU cannot measure: a multi-GPU plan's communication times are still unmeasured estimates.

Two regimes:

* ``shared_host=False`` (accelerators): every device has its own compute, memory bandwidth and
  links; rates are per device, calls on disjoint devices run concurrently.
* ``shared_host=True`` (XLA's fake CPU devices): all "devices" are threads on the same cores and
  memory, so rates are for the whole machine, work on n devices costs n times the per-device
  work at that aggregate rate, fixed per-device costs are paid n times over on ``host_cores``
  cores, and calls on disjoint devices run at the same time only as far as one call leaves
  the cores idle (``call_core_share``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

PROFILE_DIR = Path(__file__).resolve().parent / "profiles"


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    """Rates (per device, or per machine when ``shared_host``), efficiencies and overheads."""

    name: str
    memory_bytes: int  # usable device memory (per device; the host's RAM when shared_host)
    # compute: achieved dense-matmul FLOP/s in the compute dtype (microbenchmark), and the
    # fraction of it a real model call reaches (fitted to short model profiles)
    matmul_flops: float
    peak_flops: float = 0.0  # datasheet peak, for reference (0: unknown)
    forward_efficiency: float = 1.0
    train_efficiency: float = 1.0
    decode_efficiency: float = 1.0
    # The fraction of memory_bandwidth at which a forward (and a training step's forward and
    # backward) streams its activations through the elementwise work between the matmuls (norms,
    # rotary, softmax, residuals, activations): work that grows with tokens x width, not with
    # the FLOPs. 0: not priced apart (folded into the efficiencies, as on accelerators, where
    # it fuses into the matmul kernels).
    forward_activation_efficiency: float = 0.0
    train_activation_efficiency: float = 0.0
    # The fraction of the link bandwidth at which a forward's device programs go through their
    # weights: each device its whole copy of every weight as its matmuls use it (FSDP-gathered
    # or held), besides the gathers' own collective time. 0: not priced apart. On fake CPU
    # devices every device program's small matmuls touch (and pack) all of its weights, so
    # scoring on n devices costs about n times one copy's pass whether the weights were
    # gathered or replicated (data parallelism); a training step's showed no such cost in the
    # calibration's fits, so it has none.
    forward_gather_efficiency: float = 0.0
    # the fraction of memory_bandwidth at which a decode step's attention reads the KV cache
    # (near a stream on GPUs and for the CPU's native kernel, which reads pages in place; far
    # below it for the pure-JAX kernels, which gather copies of the pages)
    decode_kv_efficiency: float = 1.0
    # shared_host: the fraction of memory_bandwidth at which each device program's decode step
    # reads its weight shard, priced besides the step's matmul FLOPs (their sum, not the
    # larger: on fake CPU devices n programs each run small matmuls over their own copy of the
    # weights, whose per-weight cost does not overlap the FLOPs). 0: the roofline
    # max(FLOPs, weight bytes) / decode_efficiency, as on accelerators.
    decode_weight_efficiency: float = 0.0
    # shared_host: the fraction of memory_bandwidth at which a generate call makes the unrolled
    # decode's per-layer weight copies (``transformer.decode_weights``, every call, every
    # device its shard). 0: not priced apart.
    decode_copy_efficiency: float = 0.0
    # memory and links: achieved bytes/s
    memory_bandwidth: float = 1e11
    intra_node_bandwidth: float = 1e11  # per device, one direction, inside a node
    inter_node_bandwidth: float = 1e10  # per device, one direction, across nodes
    devices_per_node: int = 8
    # device <-> host memory, per device, one direction (PCIe on GPUs): what parking state in
    # host memory costs (Memory.offload). 0: unknown, and the planner does not offload.
    host_bandwidth: float = 0.0
    # held back from memory_bytes in the fit check (allocator fragmentation, runtime buffers);
    # ``python -m jrlhf.plan --memory-reserve`` sets it
    memory_reserve_bytes: int = 0
    # fixed costs
    call_overhead_s: float = 0.0  # one jitted call: dispatch + host sync
    forward_layer_overhead_s: float = 0.0  # per layer of a forward (kernel launches, small ops)
    train_layer_overhead_s: float = 0.0  # per layer of a training step (fwd + bwd)
    # per training step besides its call and its layers: the trainer's per-minibatch host work
    # and the update's dispatch (fitted to the whole trainer on GPUs, docs/gpu.md run 23)
    train_step_overhead_s: float = 0.0
    decode_layer_overhead_s: float = 0.0  # per layer of one decode step
    # per generate call besides its steps and layers: the engine's host work, its prefill's and
    # chunks' dispatch and syncs (paid by every device program on a shared host)
    decode_call_overhead_s: float = 0.0
    # The same per-layer costs' part a call pays once whatever its device count. On a shared host
    # the ``*_layer_overhead_s`` above are paid by every device program (n / min(n, host_cores)
    # times over); these are not: the calibration fits both from runs on 1, half and all the
    # devices (XLA's CPU runtime overlaps much of the per-device op launching). 0 on accelerators,
    # where every device pays its own launches at the same time.
    forward_layer_overhead_once_s: float = 0.0
    train_layer_overhead_once_s: float = 0.0
    decode_layer_overhead_once_s: float = 0.0
    collective_latency_s: float = 0.0  # per collective (all-gather, all-reduce, ...)
    reshard_overhead_s: float = 0.0  # one cached resharder transition: tree walk, dispatch, sync
    # fraction of the link bandwidth a transition achieves; on a shared host, the rate at which
    # its collectives write the gathered shards (``estimator.reshard_gathered_bytes``)
    reshard_efficiency: float = 1.0
    # shared_host: the fraction of the link bandwidth at which a transition writes its target
    # copy on every target device (gathered shards pay this and ``reshard_efficiency`` both);
    # 0 = reshard_efficiency (one rate for both)
    reshard_copy_efficiency: float = 0.0
    # a move between disjoint device sets (the resharder's device_put+jit path) first copies the
    # source layout shard for shard onto the target devices: this fixed cost per shard copied
    # (one per parameter per source device), besides its bytes
    reshard_twin_shard_s: float = 0.0
    shared_host: bool = False
    # Whether full-sequence passes with a 16-bit compute dtype run fused attention here
    # (ModelConfig.attention "auto": cuDNN flash attention on GPUs), which keeps no score or
    # probability matrix in memory (workload.activation_bytes_per_token).
    fused_attention: bool = False
    # shared_host: the cores the device programs share (recorded by the calibration; the
    # fixed costs below grow with the device count from one device on, not from host_cores:
    # on the 2-core CPU a generation on 2 fake devices took 1.32x one on 1).
    host_cores: int = 1
    # shared_host: how a fixed per-device cost (dispatch, op launches, a collective's
    # rendezvous), paid by each of the n device programs, grows with n: by
    # n ** fixed_device_exponent. 1 = in proportion (every program's ops queue for the cores);
    # below 1 as far as the runtime overlaps them (fitted by the calibration).
    fixed_device_exponent: float = 1.0
    # shared_host: the share of the host's cores one call keeps busy. Calls dispatched together
    # on disjoint devices (actor and critic training steps, scoring calls) take the longest
    # one's time or this share of their summed times, whichever is more: 1 = they only queue
    # for the cores, as if run one after another. A one-device call's dispatch and small ops
    # leave a core idle, so two of them at once took 0.75-0.93 x their sum on the 2-core CPU
    # (fitted by the calibration from one-device training steps run in pairs).
    call_core_share: float = 1.0
    optimizer_bytes_per_param: float = 28.0  # AdamW: read p,g,m,v + write p,m,v at 4 bytes
    # What a training step's remat recomputation costs, in forward passes at the step's rate: a
    # step is priced as 3 passes (forward, backward) plus this many under any remat policy
    # but "none". 1.0 (a whole forward) unless measured: on an H200, full remat added 3% to a
    # 1B step and dots_no_batch none (docs/gpu.md, run 13), where XLA hides the recomputation.
    remat_forward_cost: float = 1.0
    notes: str = ""
    measured: dict[str, Any] = dataclasses.field(default_factory=dict, hash=False, compare=False)

    def __post_init__(self):
        for field in ("memory_bytes", "matmul_flops", "memory_bandwidth", "intra_node_bandwidth"):
            if getattr(self, field) <= 0:
                raise ValueError(f"profile {self.name!r}: {field} must be > 0")
        for field in (
            "forward_efficiency",
            "train_efficiency",
            "decode_efficiency",
            "decode_kv_efficiency",
        ):
            if not 0 < getattr(self, field) <= 10:
                raise ValueError(f"profile {self.name!r}: {field} must be in (0, 10]")
        for field in (
            "forward_activation_efficiency",
            "train_activation_efficiency",
            "decode_weight_efficiency",
            "decode_copy_efficiency",
        ):
            if not 0 <= getattr(self, field) <= 10:
                raise ValueError(f"profile {self.name!r}: {field} must be in [0, 10]")
        if not 0 <= self.remat_forward_cost <= 2:
            raise ValueError(f"profile {self.name!r}: remat_forward_cost must be in [0, 2]")
        if self.host_bandwidth < 0:
            raise ValueError(f"profile {self.name!r}: host_bandwidth must be >= 0")
        if not 0 <= self.memory_reserve_bytes < self.memory_bytes:
            raise ValueError(
                f"profile {self.name!r}: memory_reserve_bytes must be in [0, memory_bytes)"
            )
        if not 0 <= self.fixed_device_exponent <= 1:
            raise ValueError(f"profile {self.name!r}: fixed_device_exponent must be in [0, 1]")
        if not 0 < self.call_core_share <= 1:
            raise ValueError(f"profile {self.name!r}: call_core_share must be in (0, 1]")
        if self.host_cores < 1:
            raise ValueError(f"profile {self.name!r}: host_cores must be >= 1")
        if self.devices_per_node < 1:
            raise ValueError(f"profile {self.name!r}: devices_per_node must be >= 1")

    @property
    def usable_bytes(self) -> int:
        """Device memory a plan may fill: ``memory_bytes`` less the reserve."""
        return self.memory_bytes - self.memory_reserve_bytes

    def replace(self, **changes: Any) -> DeviceProfile:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def save(self, path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=False) + "\n")

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "profile") -> DeviceProfile:
        if not isinstance(data, dict):
            raise ValueError(f"{where}: a profile is a JSON object, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{where}: unknown profile field(s) {unknown}")
        return cls(**data)

    @classmethod
    def load(cls, name_or_path: str) -> DeviceProfile:
        """A built-in profile by name (``cpu``, ``h100``, ``h200``) or a JSON file path."""
        path = Path(name_or_path)
        if not (path.suffix == ".json" or path.exists()):
            path = PROFILE_DIR / f"{name_or_path}.json"
            if not path.exists():
                known = sorted(p.stem for p in PROFILE_DIR.glob("*.json"))
                raise ValueError(f"unknown device profile {name_or_path!r} (built-in: {known})")
        if not path.exists():
            raise ValueError(f"device profile file {path} does not exist")
        return cls.from_dict(json.loads(path.read_text()), where=str(path))

    @staticmethod
    def builtin() -> list[str]:
        return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))
