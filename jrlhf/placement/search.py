"""Search for the fastest execution plan under a cost estimate (ReaL's plan search, in small).

The space gives each model call a slot (``candidates.Slot``: an aligned power-of-two device slice,
a tensor size and, for training and scoring, an expert-parallel size for a mixture of experts
and a pipeline stage count for a model whose state does not fit one node, ``staged_calls``).
When the product of the per-call candidate counts is small the search is exhaustive; otherwise
it runs simulated-annealing MCMC as ReaL does: propose a change of one call's
placement, accept it with probability ``min(1, exp(-(c' - c) / T))`` while ``T`` cools, from
several starting plans, with a fixed seed so a run is reproducible. The three named strategies of
the literature (flatten, interleave, separate), each over a few tensor sizes, are always
evaluated: they are the baselines the result is compared against and the MCMC's starting points,
with the best variant of each also with every training and scoring call staged or its experts
split (``axis_seeds``: the strategies never use those axes).

The search never looks inside the cost: it calls ``cost_fn(plan) -> PlanEstimate``, by default
``jrlhf.placement.estimator.estimate`` with the workload and device profile, so tests can inject a
cost function with a known optimum. A plan that does not fit in memory costs infinity in the
ranking but keeps its estimate (and so its reasons); such plans rank after every plan that fits,
least over memory first (``SearchResult.ranking_rule`` says which order a result is in). Inside
the MCMC a plan that does not fit gets a large finite energy that grows with its memory overflow,
so a chain that starts outside the feasible region walks towards it instead of drifting.

Strategy variants are put in the space's canonical form (calls of absent models on the actor's
training devices), so a plan is counted, evaluated and listed once; the variants that are not in
the candidate space (separate on three quarters of the devices, say) are counted in
``SearchResult.total``, so ``evaluated`` never exceeds it.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import jax

from jrlhf.meshes.rules import PHASE_RULES
from jrlhf.models.config import ModelConfig
from jrlhf.placement import plan as plans
from jrlhf.placement.candidates import (
    DEVICES_PER_NODE,
    Slot,
    build_plan,
    call_batches,
    call_candidates,
    call_models,
    placement_slot,
    slot_problem,
    slots_of,
)
from jrlhf.placement.estimator import MOMENT_BYTES, estimate, estimate_tuned
from jrlhf.placement.plan import CALLS, CallPlacement, ExecutionPlan
from jrlhf.placement.profile import DeviceProfile
from jrlhf.placement.workload import Workload, num_params, param_bytes

CostFn = Callable[[ExecutionPlan], Any]  # returns a PlanEstimate (duck-typed: see _energy)

EXHAUSTIVE_LIMIT = 20_000
# Energy offset of a plan that does not fit: above any real iteration time (see _energy).
INFEASIBLE = 1e9


@dataclasses.dataclass
class Ranked:
    """One evaluated plan and its estimate; ``cost`` is infinite when it does not fit."""

    plan: ExecutionPlan
    estimate: Any

    @property
    def cost(self) -> float:
        return self.estimate.iteration_seconds if self.estimate.fits else math.inf

    @property
    def name(self) -> str:
        return self.plan.name


@dataclasses.dataclass
class SearchResult:
    """Distinct plans, fitting ones first and fastest first, plus the best variant of each named
    strategy (``baselines``; absent when no variant of it is valid on this many devices)."""

    ranked: list[Ranked]
    baselines: dict[str, Ranked]
    method: str  # 'exhaustive' or 'mcmc'
    space_size: int  # number of plans in the candidate space
    evaluated: int  # distinct plans whose cost was computed (at most ``total``)
    outside: int = 0  # strategy variants outside the candidate space (also evaluated)
    capacity: int | None = None  # the profile's memory per device, for the ranking statement

    @property
    def total(self) -> int:
        """Distinct plans the search could evaluate: the space and the strategy variants
        outside it."""
        return self.space_size + self.outside

    def ranking_rule(self) -> str:
        """How ``ranked`` is ordered, in one sentence (the CLI prints it above the table)."""
        cap = f" ({self.capacity / 2**30:.2f} GiB per device)" if self.capacity else ""
        if self.best.estimate.fits:
            rule = "ranked by estimated iteration time, fastest first"
            if not all(r.estimate.fits for r in self.ranked):
                rule += f"; plans that do not fit in memory{cap} follow, least over memory first"
            return rule
        return (
            f"no plan fits in memory{cap}: ranked by how far over it each plan's peak memory "
            "per device is, least first, not by time (iteration time only breaks ties)"
        )

    @property
    def best(self) -> Ranked:
        return self.ranked[0]

    def speedup(self, strategy: str) -> float:
        """Estimated iteration time of the best variant of ``strategy`` over the best plan's."""
        base = self.baselines.get(strategy)
        if base is None or not math.isfinite(base.cost) or not math.isfinite(self.best.cost):
            return math.nan
        return base.cost / self.best.cost


def peak_memory_bytes(estimate: Any) -> int:
    """The largest per-device figure in an estimate's ``memory_bytes`` (0 when none)."""
    values = list(getattr(estimate, "memory_bytes", {}).values())
    return max(values) if values else 0


def effective_batches(workload: Any) -> dict[str, int]:
    """Rows each call's batch axis carries in one program: a training micro-batch
    (minibatch / microbatches), a scoring chunk (infer_batch_size rows), or, for generation,
    the rollout batch (``call_batches``). Workloads without these fields use the defaults."""
    out = dict(call_batches(workload))
    rows = workload.prompts * workload.samples_per_prompt
    chunk = getattr(workload, "infer_batch_size", 0) or 0
    for call, (role, phase) in CALLS.items():
        if phase == "train":
            m = max(1, getattr(workload, f"{role}_microbatches", 1) or 1)
            out[call] = -(-out[call] // m)
        elif phase == "infer" and chunk > 0:
            out[call] = min(chunk, rows)
    return out


def _whole_batches(workload: Any) -> Any:
    """``workload`` with one micro-batch per training call and scoring in one call: the batch
    sizes that admit the most slices (each axis split must divide the rows it carries)."""
    if not dataclasses.is_dataclass(workload):
        return workload
    fields = {f.name for f in dataclasses.fields(workload)}
    knobs = {"actor_microbatches": 1, "critic_microbatches": 1, "infer_batch_size": 0}
    return dataclasses.replace(workload, **{k: v for k, v in knobs.items() if k in fields})


class SearchSpace:
    """Per-call candidate slots for a workload on ``num_devices`` devices.

    Calls whose model is absent (no critic in GRPO, a Python reward function) are *tied*: they
    follow the actor's training slot, so they neither enlarge the space nor write odd meshes.
    ``stage_calls``: the calls offered pipeline stages (None: every training and scoring call;
    ``search`` offers them where a model's state does not fit one node, ``staged_calls``).
    """

    def __init__(
        self,
        workload: Any,
        num_devices: int,
        *,
        devices_per_node: int = DEVICES_PER_NODE,
        max_tensor: int | None = None,
        candidates: Mapping[str, Sequence[Slot]] | None = None,
        stage_calls: Collection[str] | None = None,
    ):
        if num_devices < 1:
            raise ValueError(f"need at least one device, got {num_devices}")
        self.num_devices = num_devices
        self.devices_per_node = devices_per_node
        self.models = call_models(workload)
        self.batches = effective_batches(workload)
        self.tied = tuple(c for c in CALLS if self.models[c] is None and c != "actor_train")
        self.free = tuple(c for c in CALLS if c not in self.tied)
        if candidates is None:
            candidates = {
                c: call_candidates(
                    c,
                    self.models[c],
                    num_devices,
                    batch=self.batches[c],
                    devices_per_node=devices_per_node,
                    max_tensor=max_tensor,
                    stages=stage_calls is None or c in stage_calls,
                )
                for c in self.free
            }
        self.candidates = {c: list(candidates[c]) for c in self.free}
        for call, cands in self.candidates.items():
            if not cands:
                whole = Slot(0, num_devices, 1)
                why = self.problem(call, whole) or "no aligned power-of-two slice is valid"
                raise ValueError(f"no valid placement of {call} on {num_devices} devices ({why})")
        self._members = {c: set(v) for c, v in self.candidates.items()}
        self._neighbours: dict[tuple[str, Slot], list[Slot]] = {}

    @property
    def size(self) -> int:
        return math.prod(len(v) for v in self.candidates.values())

    def problem(self, call: str, slot: Slot) -> str | None:
        return slot_problem(
            call,
            self.models[call],
            slot,
            self.num_devices,
            batch=self.batches[call],
            devices_per_node=self.devices_per_node,
        )

    def key(self, slots: Mapping[str, Slot]) -> tuple[Slot, ...]:
        return tuple(slots[c] for c in self.free)

    def complete(self, free: Mapping[str, Slot]) -> dict[str, Slot]:
        out = dict(free)
        for call in self.tied:
            out[call] = free["actor_train"]
        return out

    def plan(self, slots: Mapping[str, Slot], name: str = "searched") -> ExecutionPlan:
        return build_plan(name, self.complete(slots))

    def canonical(self, plan: ExecutionPlan) -> ExecutionPlan:
        """``plan`` with every tied call on the actor's training devices, as the space builds
        it: plans that differ only where an absent model would run are the same plan."""
        if not self.tied:
            return plan
        train = plan["actor_train"].mesh
        placements = dict(plan.placements)
        for call in self.tied:
            placements[call] = CallPlacement(train, PHASE_RULES[CALLS[call][1]])
        return dataclasses.replace(plan, placements=tuple((c, placements[c]) for c in CALLS))

    def contains(self, plan: ExecutionPlan) -> bool:
        """Whether ``plan`` (canonical) is one of the space's plans."""
        slots = slots_of(plan)
        if slots is None or any(slots[c] not in self._members[c] for c in self.free):
            return False
        return self.plan(slots).placements == plan.placements

    def has(self, call: str, slot: Slot) -> bool:
        """Whether ``slot`` is one of ``call``'s candidates."""
        return slot in self._members[call]

    def valid(self, slots: Mapping[str, Slot]) -> bool:
        return all(self.problem(c, slots[c]) is None for c in self.free)

    def enumerate(self):
        for combo in itertools.product(*(self.candidates[c] for c in self.free)):
            yield dict(zip(self.free, combo))

    def random(self, rng: random.Random) -> dict[str, Slot]:
        return {c: rng.choice(self.candidates[c]) for c in self.free}

    def neighbours(self, call: str, slot: Slot) -> list[Slot]:
        """Slots one step away: shift by one slice, halve or double the slice, halve or double
        the tensor size, the stage count or the expert size. Local moves let the annealing
        refine a plan it has found."""
        key = (call, slot)
        if key not in self._neighbours:
            s, n, t = slot.start, slot.size, slot.tensor
            st, ex = slot.stages, slot.experts
            near = [
                Slot(s - n, n, t, None, st, ex),
                Slot(s + n, n, t, None, st, ex),
                Slot(s, n // 2, t, None, st, ex),
                Slot(s + n // 2, n // 2, t, None, st, ex),
                Slot(s - s % (2 * n), 2 * n, t, None, st, ex),
                Slot(s, n, t * 2, None, st, ex),
                Slot(s, n, t // 2, None, st, ex),
                Slot(s, n // 2, max(1, t // 2), None, st, ex),
                Slot(s - s % (2 * n), 2 * n, t * 2, None, st, ex),
                Slot(s, n, t, None, st * 2, ex),
                Slot(s, n, t, None, st // 2, ex),
                Slot(s, n, t, None, st, ex * 2),
                Slot(s, n, t, None, st, ex // 2),
                Slot(s - s % (2 * n), 2 * n, t, None, st * 2, ex),
            ]
            # a member is found by its shape: its rule set follows from it (generation_rules)
            members = {m.shape_key: m for m in self._members.get(call, set())}
            found = {members[x.shape_key] for x in near if x.shape_key in members}
            self._neighbours[key] = sorted(found - {slot}, key=lambda x: x.shape_key)
        return self._neighbours[key]

    def propose(self, slots: Mapping[str, Slot], rng: random.Random) -> dict[str, Slot]:
        """Change one call's placement: a uniform candidate, a local step, or another call's
        slice (co-location is what flatten and separate are made of, and a uniform draw would
        rarely hit another call's slice exactly)."""
        out = dict(slots)
        call = rng.choice(self.free)
        current = slots[call]
        u = rng.random()
        choice = None
        if u < 0.3:
            near = self.neighbours(call, current)
            choice = rng.choice(near) if near else None
        elif u < 0.55 and len(self.free) > 1:
            other = slots[rng.choice([c for c in self.free if c != call])]
            same_slice = [
                x
                for x in self.candidates[call]
                if (x.start, x.size) == (other.start, other.size) and x != current
            ]
            if same_slice:
                choice = min(same_slice, key=lambda x: (abs(x.tensor - current.tensor), x.tensor))
        if choice is None:
            choice = rng.choice(self.candidates[call])
        out[call] = choice
        return out


def staged_calls(workload: Any, profile: Any, devices_per_node: int) -> set[str]:
    """The calls whose model's state does not fit one node's memory: the trained roles'
    weights and AdamW moments, the frozen roles' and generation's weights. Stages are
    candidates for these only: a model that fits a node trains (and decodes) there with FSDP
    and tensor parallelism, whose traffic inside it is cheaper than a pipeline's bubble
    (docs/pipelines.md); past a node, stages cross the slow links with activations where FSDP
    would gather weights and tensor parallelism all-reduce every layer."""
    node = getattr(profile, "usable_bytes", 0) * devices_per_node
    out = set()
    for call, model in call_models(workload).items():
        if model is None:
            continue
        role = CALLS[call][0]
        head = "value" if role in ("critic", "reward") else "lm"
        state = param_bytes(model, head)
        if role in ("actor", "critic") and CALLS[call][1] != "generate":
            state += num_params(model, head) * MOMENT_BYTES
        if state > node:
            out.add(call)
    return out


def generation_splits(num_devices: int) -> list[int]:
    """Devices ``separate`` gives generation: every eighth of them (1/8 .. 7/8) where the count
    divides by 8, else every quarter; any split, not only halves, since with bounded staleness
    the best split balances generation against the rest. Splits whose rest the batch does not
    divide over are dropped later (``_plan_valid``)."""
    parts = 8 if num_devices % 8 == 0 else 4
    return sorted({num_devices * j // parts for j in range(1, parts)} - {0, num_devices})


def strategy_variants(space: SearchSpace) -> dict[str, list[ExecutionPlan]]:
    """Flatten, interleave and separate over every valid (tensor, generation tensor) pair, and
    for separate over every generation split of ``generation_splits``: the baselines are each
    strategy tuned, not a strawman."""
    n = space.num_devices
    tensors = []
    t = 1
    while t <= min(n, space.devices_per_node):
        tensors.append(t)
        t *= 2
    out: dict[str, list[ExecutionPlan]] = {name: [] for name in plans.STRATEGIES}
    seen: set = set()

    def add(strategy: str, label: str, **kwargs: int) -> None:
        try:
            plan = plans.strategy(strategy, n, **kwargs)
        except ValueError:
            return
        plan = space.canonical(plan)
        if not _plan_valid(space, plan) or plan.placements in seen:
            return
        seen.add(plan.placements)
        out[strategy].append(dataclasses.replace(plan, name=f"{strategy}({label})"))

    for t, gt in itertools.product(tensors, tensors):
        label = f"t={t},gen_t={gt}"
        add("flatten", label, tensor=t, gen_tensor=gt)
        add("interleave", label, tensor=t, gen_tensor=gt)
        for gen in generation_splits(n):
            add("separate", f"gen={gen},{label}", gen_devices=gen, tensor=t, gen_tensor=gt)
    return out


def _plan_valid(space: SearchSpace, plan: ExecutionPlan) -> bool:
    """Whether every call of a strategy's plan passes the same checks as the candidates."""
    try:
        plan.validate(space.num_devices)
    except ValueError:
        return False
    for call in CALLS:
        slot = placement_slot(plan[call])
        model = space.models[call]
        # Strategy slices need not be power-of-two aligned (separate on 3/4 of the devices), so
        # check the dimensions, not membership in the candidate list.
        problem = slot_problem(
            call,
            model,
            slot,
            max(plan[call].mesh.device_ids()) + 1,
            batch=space.batches[call],
            devices_per_node=space.devices_per_node,
        )
        if problem is not None:
            return False
    return True


def _energy(estimate: Any, capacity: int | None) -> float:
    """Iteration seconds for a plan that fits. One that does not sits above every plan that
    does (``INFEASIBLE``) and pays for its overflow (10% over capacity doubles its time): the
    differences between two such plans stay on the scale of the annealing temperature, so a
    chain outside the feasible region can still climb out of a local minimum of overflow."""
    seconds = float(estimate.iteration_seconds)
    if estimate.fits:
        return seconds
    overflow = max(0.0, peak_memory_bytes(estimate) / capacity - 1.0) if capacity else 1.0
    return INFEASIBLE + seconds * (1.0 + 10.0 * overflow)


def default_cost_fn(workload: Any, profile: Any, tune_batches: bool = False) -> CostFn:
    """``estimator.estimate`` bound to a workload and profile (tests replace this hook); with
    ``tune_batches``, ``estimator.estimate_tuned`` (each plan priced with its own scoring chunk
    and micro-batches)."""
    if tune_batches:
        return lambda plan: estimate_tuned(plan, workload, profile)
    return lambda plan: estimate(plan, workload, profile)


def search(
    workload: Any,
    num_devices: int,
    profile: Any = None,
    *,
    cost_fn: CostFn | None = None,
    devices_per_node: int = DEVICES_PER_NODE,
    max_tensor: int | None = None,
    exhaustive_limit: int = EXHAUSTIVE_LIMIT,
    steps: int = 2000,
    restarts: int = 4,
    seed: int = 0,
    top: int = 10,
    space: SearchSpace | None = None,
    tune_batches: bool = False,
) -> SearchResult:
    """Find the plan with the smallest estimated iteration time for ``workload``.

    ``cost_fn(plan)`` returns a PlanEstimate; by default ``estimator.estimate(plan, workload,
    profile)``. With more than ``exhaustive_limit`` plans in the space the search runs
    ``restarts`` annealing chains of ``steps`` proposals each (seeded by ``seed``).

    ``tune_batches``: also choose, per plan, the scoring chunk, the actor's and critic's
    micro-batches and remat policies, and the memory knobs (generation copy, offload;
    ``estimator.tune_batches``; each estimate's ``workload`` says which). The
    candidate slots are then those some micro-batch count and scoring chunk admit (whole
    minibatches and batches: a slice whose data axes the config's micro-batches do not split
    may still train with fewer, larger micro-batches, and the tuner prices only settings that
    split); without tuning, those the config's batch sizes admit.
    """
    if cost_fn is None:
        if profile is None:
            raise ValueError("search needs a device profile or a cost_fn")
        cost_fn = default_cost_fn(workload, profile, tune_batches)
    capacity = getattr(profile, "usable_bytes", getattr(profile, "memory_bytes", None))
    if space is None:
        admitted = _whole_batches(workload) if tune_batches else workload
        stage_calls = None
        if capacity and dataclasses.is_dataclass(workload):
            stage_calls = staged_calls(workload, profile, devices_per_node)
        space = SearchSpace(
            admitted,
            num_devices,
            devices_per_node=devices_per_node,
            max_tensor=max_tensor,
            stage_calls=stage_calls,
        )
    # Keyed by placements (not names): the same plan reached twice is evaluated once.
    evaluated: dict[tuple, tuple[float, ExecutionPlan, Any]] = {}

    def evaluate(plan: ExecutionPlan) -> float:
        hit = evaluated.get(plan.placements)
        if hit is None:
            est = cost_fn(plan)
            hit = evaluated[plan.placements] = (_energy(est, capacity), plan, est)
        return hit[0]

    baselines: dict[str, Ranked] = {}
    seeds: list[dict[str, Slot]] = []
    best_seeds: list[dict[str, Slot]] = []  # each strategy's best variant
    variants_of = strategy_variants(space)
    outside = sum(not space.contains(p) for v in variants_of.values() for p in v)
    for strategy, variants in variants_of.items():
        scored = sorted(((evaluate(p), i, p) for i, p in enumerate(variants)), key=lambda x: x[:2])
        if scored:
            best = scored[0][2]
            baselines[strategy] = Ranked(best, evaluated[best.placements][2])
        for i, (_, _, p) in enumerate(scored[:2]):
            slots = slots_of(p)
            if slots is not None:
                seeds.append({c: slots[c] for c in space.free})
                if i == 0:
                    best_seeds.append(seeds[-1])

    # The strategies never split stages or experts: their best variants with every training
    # and scoring call staged or expert-split where it can be start the chains too.
    seeds += axis_seeds(space, best_seeds)

    if space.size <= exhaustive_limit:
        method = "exhaustive"
        for slots in space.enumerate():
            evaluate(space.plan(slots))
    else:
        method = "mcmc"
        _anneal(space, evaluate, seeds, random.Random(seed), steps, restarts)

    ranked = _rank(evaluated.values(), baselines, top)
    return SearchResult(ranked, baselines, method, space.size, len(evaluated), outside, capacity)


def axis_seeds(space: SearchSpace, seeds: Sequence[Mapping[str, Slot]]) -> list[dict[str, Slot]]:
    """``seeds`` with every call but generation given one stage count and expert size, for each
    pair some call admits on its slice (a call that does not admit it keeps its slot)."""
    calls = [c for c in space.free if c != "actor_generate"]
    pairs = sorted({(x.stages, x.experts) for c in calls for x in space.candidates[c]} - {(1, 1)})
    out = []
    for seed in seeds:
        for stages, experts in pairs:
            moved = dict(seed)
            for c in calls:
                slot = dataclasses.replace(seed[c], stages=stages, experts=experts)
                if space.has(c, slot):
                    moved[c] = slot
            if moved != seed:
                out.append(moved)
    return out


def _anneal(
    space: SearchSpace,
    evaluate: Callable[[ExecutionPlan], float],
    seeds: list[dict[str, Slot]],
    rng: random.Random,
    steps: int,
    restarts: int,
) -> None:
    """Simulated annealing: ``restarts`` chains, each from a strategy seed, the best plan found
    so far, or a random plan; geometric cooling from 5% to 0.05% of the best feasible cost."""

    def energy(slots: Mapping[str, Slot]) -> float:
        return evaluate(space.plan(slots))

    starts = [s for s in seeds if space.valid(s)]
    best_slots, best_e = None, math.inf
    for s in starts:
        e = energy(s)
        if e < best_e:
            best_slots, best_e = s, e
    for r in range(restarts):
        if r < len(starts) and r < restarts - 1:
            current = starts[r]
        elif best_slots is not None and r == restarts - 1:
            current = best_slots  # the last chain refines the best plan found
        else:
            current = space.random(rng)
        e = energy(current)
        # Temperatures are relative to the iteration time of the best plan so far (without the
        # infeasible offset), so one schedule serves 7B on 8 devices and 70B on 128.
        scale = (best_e if best_e < math.inf else e) % INFEASIBLE or 1.0
        t0, t1 = 0.05 * scale, 0.0005 * scale
        for i in range(steps):
            temperature = t0 * (t1 / t0) ** (i / max(1, steps - 1))
            proposal = space.propose(current, rng)
            e_new = energy(proposal)
            if e_new <= e or rng.random() < math.exp(-(e_new - e) / temperature):
                current, e = proposal, e_new
                if e < best_e:
                    best_slots, best_e = current, e


def _shape(plan: ExecutionPlan, est: Any) -> tuple:
    """A plan up to a shift of all its device ids, with its estimate's time and memory: equal
    for copies of one plan on other devices that the estimate cannot tell apart."""
    base = min(min(p.mesh.device_ids()) for _, p in plan.placements)
    layout = tuple(
        (call, p.mesh.axes, p.rules, tuple(d - base for d in p.mesh.device_ids()))
        for call, p in plan.placements
    )
    return (layout, float(est.iteration_seconds), peak_memory_bytes(est), bool(est.fits))


def _rank(entries: Any, baselines: Mapping[str, Ranked], top: int) -> list[Ranked]:
    """Fitting plans first, fastest first; then the others, least over memory first (a plan
    that does not fit has no iteration time to compare: its peak memory decides, then its time).
    Names say which strategy a plan is, if any."""
    names = {b.plan.placements: b.plan.name for b in baselines.values()}
    # Among equally fast plans prefer the simpler one (fewer distinct placements: fewer meshes
    # to compile and fewer reshards), and a named strategy's over an anonymous one.
    order = sorted(
        entries,
        key=lambda x: (
            not x[2].fits,
            0 if x[2].fits else peak_memory_bytes(x[2]),
            float(x[2].iteration_seconds),
            len({p for _, p in x[1].placements}),
            x[1].placements not in names,
            # then the plan on the lowest device ids (equal-cost plans are mostly shifted copies)
            tuple(min(p.mesh.device_ids()) for _, p in x[1].placements),
            x[1].name,
        ),
    )
    # A plan moved to other devices with the same estimate is the same row to the reader
    # (searched-1..10 on devices 0, 1, 2, ...): list it once, on its lowest devices.
    kept, shapes = [], set()
    for entry in order:
        shape = _shape(entry[1], entry[2])
        if shape not in shapes:
            shapes.add(shape)
            kept.append(entry)
            if len(kept) >= max(top, 1):
                break
    out = []
    for i, (_, plan, est) in enumerate(kept):
        name = names.get(plan.placements, plan.name if plan.name != "searched" else "")
        name = name or f"searched-{i + 1}"
        out.append(Ranked(dataclasses.replace(plan, name=name), est))
    return out


# ------------------------------------------------------------------------- from a run's config
def local_device_kind() -> str:
    """The built-in profile name of this machine's devices ('cpu', 'h100', 'h200')."""
    device = jax.devices()[0]
    if device.platform == "cpu":
        return "cpu"
    kind = device.device_kind.lower()
    for name in ("h200", "h100"):
        if name in kind:
            return name
    raise ValueError(
        f"no built-in device profile for {device.device_kind!r}: pass a profile JSON "
        "(python -m jrlhf.plan --device-kind PATH.json)"
    )


# The largest job the search plans for. Its memory and time grow about linearly with the device
# count (plans list their device ids): measured for configs/ppo_tiny.gin, 65,536 devices took
# 80 s and 0.5 GB, 1,048,576 devices over 4 GB and more than 5 minutes.
MAX_PLAN_DEVICES = 65536


def check_device_count(num_devices: int, profile: Any) -> None:
    """One-line error for a device count the profile's hardware cannot have, or one too large
    to plan for (:data:`MAX_PLAN_DEVICES`)."""
    per_node = getattr(profile, "devices_per_node", 1)
    if num_devices < 1:
        raise ValueError(f"--devices must be >= 1, got {num_devices}")
    if num_devices > MAX_PLAN_DEVICES:
        raise ValueError(
            f"--devices {num_devices}: the planner plans for at most {MAX_PLAN_DEVICES} devices "
            "(its memory grows with the device count)"
        )
    shared = getattr(profile, "shared_host", False)
    if not shared and num_devices > per_node and num_devices % per_node:
        raise ValueError(
            f"{num_devices} {profile.name} devices is not a whole number of {per_node}-device nodes"
        )


def check_fits_somewhere(workload: Any, num_devices: int, profile: Any) -> None:
    """One-line error when no plan can fit, whatever its memory knobs: while scoring, every
    model's parameters are on the devices; while training, the trained models' parameters and
    AdamW moments (frozen models, the generation copy and optimizer state can leave the devices
    only outside those phases). Even spread evenly over all ``num_devices`` devices, the larger
    of the two needs at least this much per device (working memory, the KV pool and uneven
    shards only add to it)."""
    params = moments = 0
    for role, (cfg, head) in workload.models().items():
        params += param_bytes(cfg, head)
        if role in ("actor", "critic"):
            moments += num_params(cfg, head) * MOMENT_BYTES
    trained = sum(
        param_bytes(cfg, head)
        for role, (cfg, head) in workload.models().items()
        if role in ("actor", "critic")
    )
    total = max(params, trained + moments)
    floor, capacity = total / num_devices, profile.usable_bytes
    if floor > capacity:
        raise ValueError(
            f"no plan can fit: the models' weights (while scoring) or the trained models' "
            f"weights and AdamW moments (while training) alone need {floor / 2**30:.1f} GiB per "
            f"device on {num_devices} devices ({profile.name} has {capacity / 2**30:.1f} GiB "
            f"usable); plan for at least {math.ceil(total / capacity)} devices (more for "
            "working memory) or smaller models"
        )


def search_for_config(
    cfg: Any,
    num_devices: int,
    models: Mapping[str, ModelConfig],
    device_kind: str | None = None,
    **kwargs: Any,
) -> ExecutionPlan:
    """The best plan for ``cfg`` running ``models`` (role -> ModelConfig) on ``num_devices``
    local devices (``placement='search'``)."""
    profile = DeviceProfile.load(device_kind or local_device_kind())
    check_device_count(num_devices, profile)
    workload = Workload.from_config(cfg, models)
    # A shorter anneal than the CLI's: this runs at every trainer start-up.
    kwargs.setdefault("steps", 600)
    kwargs.setdefault("restarts", 3)
    result = search(
        workload,
        num_devices,
        profile,
        devices_per_node=min(profile.devices_per_node, num_devices),
        **kwargs,
    )
    return result.best.plan
