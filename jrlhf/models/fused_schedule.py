"""The fused actor-critic pipeline schedule (RLHFuse): which micro-batch of which model each
stage works on at each tick, and the search that picks it under a per-device memory limit.

The actor's layers sit on the stages first-to-last and the critic's last-to-first (its layer
block ``p`` on stage ``S - 1 - p``), so the two pipelines run in opposite directions over the
same devices and each fills the other's warm-up and drain bubbles. Every micro-batch of a
model is one chain of ops over its pipeline positions ``p = 0..S-1``: the forwards up, then
the backwards down (``fwd 0 -> ... -> fwd S-1 -> bwd S-1 -> ... -> bwd 0``); a stage runs one
op at a time. A schedule fixes each stage's order of ops; its table (``Schedule``) gives each
op a tick, the first one its order and chain allow with every op one tick long, which is how
the fused train step (jrlhf.runtime.fused_step) executes it: each stage runs its tick's op (or
nothing), and the sends at the end of each tick keep the stages' ticks in step.

Memory: a stage keeps a micro-batch's activations from the start of its forward on that stage
to the end of its backward there (``memory[model]`` per micro-batch); a schedule fits when no
stage's sum ever exceeds ``limit``. The search (``search``) minimises the makespan, with
per-op costs, by simulated annealing over the ops' priorities (each stage runs its ops in
priority order, waiting where a dependency is not done), starting from the better of a greedy
list schedule and the two models' separate 1F1B schedules one after the other.

Pure Python and NumPy (no JAX), so that a planner can price schedules without tracing. It
lives in jrlhf.runtime beside the 1F1B step (pipeline_step), as the table it makes is what the
runtime's fused train step executes.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import numpy as np

MODELS = ("actor", "critic")
ACTOR, CRITIC = 0, 1
IDLE = -1


def stage_of(model: int, position: int, stages: int) -> int:
    """The stage that holds ``model``'s layer block ``position``: the actor's in order, the
    critic's reversed."""
    return position if model == ACTOR else stages - 1 - position


@dataclasses.dataclass(frozen=True)
class Op:
    """One stage's work on one micro-batch: the forward or backward of ``model``'s layer
    block ``position`` on micro-batch ``micro``."""

    model: int
    micro: int
    position: int
    backward: bool

    def stage(self, stages: int) -> int:
        return stage_of(self.model, self.position, stages)

    def before(self, stages: int) -> Op | None:
        """The op of the same chain that must finish first (None for the first forward)."""
        if not self.backward:
            return (
                None
                if self.position == 0
                else dataclasses.replace(self, position=self.position - 1)
            )
        if self.position == stages - 1:
            return dataclasses.replace(self, backward=False)
        return dataclasses.replace(self, position=self.position + 1)


def all_ops(stages: int, micro: Sequence[int]) -> list[Op]:
    """Every op of ``micro[model]`` micro-batches per model over ``stages`` stages."""
    return [
        Op(m, i, p, b)
        for m in (ACTOR, CRITIC)
        for i in range(micro[m])
        for b in (False, True)
        for p in range(stages)
    ]


@dataclasses.dataclass(frozen=True, eq=False)
class Schedule:
    """A fused schedule's table: at tick ``t`` stage ``s`` runs ``model[t, s]`` (``IDLE``,
    ``ACTOR`` or ``CRITIC``) on micro-batch ``micro_index[t, s]``, its backward if
    ``backward[t, s]``. ``micro``: micro-batches per model."""

    stages: int
    micro: tuple[int, int]
    model: np.ndarray
    micro_index: np.ndarray
    backward: np.ndarray

    @property
    def ticks(self) -> int:
        return self.model.shape[0]

    def ops(self) -> dict[Op, int]:
        """Each scheduled op and its tick."""
        out = {}
        for t, s in zip(*np.nonzero(self.model != IDLE), strict=True):
            m, i = int(self.model[t, s]), int(self.micro_index[t, s])
            position = s if m == ACTOR else self.stages - 1 - s
            out[Op(m, i, int(position), bool(self.backward[t, s]))] = int(t)
        return out

    def orders(self) -> list[list[Op]]:
        """Each stage's ops in the order it runs them."""
        by_tick = sorted(self.ops().items(), key=lambda kv: kv[1])
        orders: list[list[Op]] = [[] for _ in range(self.stages)]
        for op, _ in by_tick:
            orders[op.stage(self.stages)].append(op)
        return orders

    def bubble(self) -> float:
        """The share of (tick, stage) slots the table leaves idle."""
        return float(np.mean(self.model == IDLE))

    def peak_memory(self, memory: Sequence[float]) -> np.ndarray:
        """Each stage's peak activation memory: a micro-batch counts ``memory[model]`` from
        the tick its forward starts on the stage to the tick its backward there ends."""
        return np.array([_order_peak(order, memory) for order in self.orders()])

    def critical_path(self, costs) -> float:
        """How long the fused train step runs this table (jrlhf.runtime.fused_step) with
        ``costs[model] = (forward, backward)`` per op: each stage runs its tick's op (an idle
        slot costs nothing) once it and both its neighbours have ended the tick before, as
        the sends that end every tick (to the next stage and the previous one, around the
        ring) let it; the time the last stage ends."""
        cost = np.zeros(self.model.shape)
        for m in (ACTOR, CRITIC):
            for back in (False, True):
                cost[(self.model == m) & (self.backward == back)] = costs[m][back]
        end = np.zeros(self.stages)
        for row in cost:
            end = np.maximum.reduce([end, np.roll(end, 1), np.roll(end, -1)]) + row
        return float(end.max(initial=0.0))

    def validate(self) -> None:
        """One-line ValueError unless every op runs exactly once, on its stage, after the op
        its chain needs first."""
        S, T = self.stages, self.ticks
        for name in ("model", "micro_index", "backward"):
            if getattr(self, name).shape != (T, S):
                raise ValueError(
                    f"schedule table {name}: shape {getattr(self, name).shape}, not ({T}, {S})"
                )
        for t, s in zip(*np.nonzero(self.model != IDLE), strict=True):
            m, i = int(self.model[t, s]), int(self.micro_index[t, s])
            if m not in (ACTOR, CRITIC) or not 0 <= i < self.micro[m]:
                raise ValueError(
                    f"schedule table: tick {t} stage {s} runs model {m} micro-batch {i}, "
                    "which does not exist"
                )
        ticks = self.ops()
        count = int(np.sum(self.model != IDLE))
        if count != len(ticks):
            raise ValueError("schedule table: an op runs more than once")
        for op in all_ops(S, self.micro):
            if op not in ticks:
                raise ValueError(f"schedule table: {_name(op)} never runs")
            first = op.before(S)
            if first is not None and ticks[first] >= ticks[op]:
                raise ValueError(
                    f"schedule table: {_name(op)} at tick {ticks[op]} runs before "
                    f"{_name(first)} (tick {ticks[first]}) is done"
                )


def _name(op: Op) -> str:
    kind = "backward" if op.backward else "forward"
    return f"the {MODELS[op.model]}'s {kind} of micro-batch {op.micro} at layer block {op.position}"


def _order_peak(order: Sequence[Op], memory: Sequence[float]) -> float:
    held = peak = 0.0
    for op in order:
        if not op.backward:
            held += memory[op.model]
            peak = max(peak, held)
        else:
            held -= memory[op.model]
    return peak


def _timed(
    orders: Sequence[Sequence[Op]], stages: int, cost
) -> dict[Op, tuple[float, float]] | None:
    """(start, end) of every op when each stage runs its ``orders`` in turn, each op as soon as
    its stage is free and its chain's previous op done; None when the orders wait on each
    other (a deadlock). ``cost(op)``: its duration."""
    done: dict[Op, tuple[float, float]] = {}
    nxt = [0] * stages
    free = [0.0] * stages
    moved = True
    while moved:
        moved = False
        for s in range(stages):
            order = orders[s]
            while nxt[s] < len(order):
                op = order[nxt[s]]
                first = op.before(stages)
                if first is not None and first not in done:
                    break
                start = max(free[s], done[first][1] if first is not None else 0.0)
                free[s] = start + cost(op)
                done[op] = (start, free[s])
                nxt[s] += 1
                moved = True
    if any(nxt[s] < len(orders[s]) for s in range(stages)):
        return None
    return done


def makespan(orders: Sequence[Sequence[Op]], stages: int, costs) -> float:
    """The time the last op of ``orders`` ends, with ``costs[model] = (forward, backward)``
    per op; ``inf`` when the orders deadlock."""
    timed = _timed(orders, stages, lambda op: costs[op.model][op.backward])
    return math.inf if timed is None else max((end for _, end in timed.values()), default=0.0)


def table(orders: Sequence[Sequence[Op]], stages: int, micro: Sequence[int]) -> Schedule:
    """The table of per-stage ``orders`` with every op one tick long (how the fused step
    runs them, tick by tick)."""
    timed = _timed(orders, stages, lambda op: 1.0)
    if timed is None:
        raise ValueError("schedule: the stages' orders wait on each other (deadlock)")
    ticks = int(max((end for _, end in timed.values()), default=0))
    model = np.full((ticks, stages), IDLE, np.int32)
    index = np.zeros((ticks, stages), np.int32)
    backward = np.zeros((ticks, stages), bool)
    for op, (start, _) in timed.items():
        t, s = int(start), op.stage(stages)
        model[t, s], index[t, s], backward[t, s] = op.model, op.micro, op.backward
    return Schedule(stages, (int(micro[0]), int(micro[1])), model, index, backward)


def list_schedule(
    stages: int,
    micro: Sequence[int],
    costs,
    memory: Sequence[float],
    limit: float,
    priority: dict[Op, float],
    models: Sequence[int] = (ACTOR, CRITIC),
) -> list[list[Op]] | None:
    """Greedy list scheduling: whenever a stage is free it starts, of its ready ops (chain
    predecessor done) whose forward fits its memory, the one of lowest ``priority``; the
    stages' orders, or None if it runs into a deadlock (every stage waits on memory held by
    work that cannot proceed). Only ``models``' ops."""
    pending = [op for op in all_ops(stages, micro) if op.model in models]
    done_at: dict[Op, float] = {}
    held = [0.0] * stages
    free = [0.0] * stages
    orders: list[list[Op]] = [[] for _ in range(stages)]
    remaining = set(pending)
    now = 0.0
    while remaining:
        started = False
        for s in sorted(range(stages), key=lambda s: free[s]):
            if free[s] > now:
                continue
            ready = [
                op
                for op in remaining
                if op.stage(stages) == s
                and (op.before(stages) is None or done_at.get(op.before(stages), math.inf) <= now)
                and (op.backward or held[s] + memory[op.model] <= limit)
            ]
            if not ready:
                continue
            op = min(ready, key=lambda op: priority[op])
            remaining.discard(op)
            held[s] += -memory[op.model] if op.backward else memory[op.model]
            free[s] = now + costs[op.model][op.backward]
            done_at[op] = free[s]
            orders[s].append(op)
            started = True
        if not remaining:
            break
        later = [t for t in list(free) + list(done_at.values()) if t > now]
        if not later and not started:
            return None  # nothing runs and nothing will finish: a deadlock
        if later:
            now = min(later)
    return orders


def one_f_one_b_orders(stages: int, micro: int, model: int = ACTOR) -> list[list[Op]]:
    """One model's 1F1B orders: stage ``s`` (position ``p``) runs ``S - p`` forwards, then
    alternates backward and forward, then drains its backwards."""
    orders: list[list[Op]] = [[] for _ in range(stages)]
    for p in range(stages):
        warm = min(stages - p, micro)
        seq = [Op(model, i, p, False) for i in range(warm)]
        f = warm
        for i in range(micro):
            seq.append(Op(model, i, p, True))
            if f < micro:
                seq.append(Op(model, f, p, False))
                f += 1
        orders[stage_of(model, p, stages)] = seq
    return orders


def separate(stages: int, micro: Sequence[int]) -> list[list[Op]]:
    """The unfused baseline: the actor's 1F1B, then the critic's, one after the other."""
    actor = one_f_one_b_orders(stages, micro[ACTOR], ACTOR)
    critic = one_f_one_b_orders(stages, micro[CRITIC], CRITIC)
    return [actor[s] + critic[s] for s in range(stages)]


def _capped_separate(stages, micro, costs, memory, limit) -> list[list[Op]]:
    """Each model's 1F1B as the memory limit allows (list scheduling one model at a time,
    which cannot deadlock: a micro-batch in flight on a stage is in flight on every stage
    before it), the actor's then the critic's."""
    parts = []
    for m in (ACTOR, CRITIC):
        prio = {op: (op.micro, not op.backward) for op in all_ops(stages, micro) if op.model == m}
        prio = {op: rank for rank, op in enumerate(sorted(prio, key=prio.get))}
        parts.append(list_schedule(stages, micro, costs, memory, limit, prio, models=(m,)))
    return [parts[0][s] + parts[1][s] for s in range(stages)]


@dataclasses.dataclass(frozen=True)
class SearchResult:
    """The schedule found, its makespan under the search's costs, its per-stage peak memory,
    and the start's makespan."""

    schedule: Schedule
    makespan: float
    peak_memory: np.ndarray
    start_makespan: float


def search(
    stages: int,
    micro: Sequence[int],
    costs=((1.0, 2.0), (1.0, 2.0)),
    memory: Sequence[float] = (1.0, 1.0),
    limit: float = math.inf,
    *,
    iterations: int = 4000,
    rounds: int = 4,
    seed: int = 0,
) -> SearchResult:
    """A fused schedule of ``micro = (actor, critic)`` micro-batches over ``stages`` stages
    that minimises the makespan with ``costs[model] = (forward, backward)`` per micro-batch
    and stage, no stage holding more than ``limit`` of activations (``memory[model]`` per
    micro-batch in flight). Simulated annealing over the ops' priorities (each stage runs its
    ops in priority order; a move swaps two ops of one stage), from the better of a greedy
    list schedule and the two models' memory-capped 1F1B schedules in turn. A limit below one
    micro-batch's activations fails in one line."""
    if stages < 1 or min(micro) < 0 or sum(micro) < 1:
        raise ValueError(
            f"fused schedule: stages={stages}, micro-batches {tuple(micro)}: need stages >= 1 "
            "and micro-batches >= 0, not all 0"
        )
    if min(c for pair in costs for c in pair) <= 0:
        raise ValueError(f"fused schedule: costs {tuple(costs)}: every op must cost > 0")
    need = max(memory[m] for m in (ACTOR, CRITIC) if micro[m])
    if limit < need:
        raise ValueError(
            f"fused schedule: a per-device memory limit of {limit:g} is below one micro-batch's "
            f"activations (actor {memory[ACTOR]:g}, critic {memory[CRITIC]:g}): no schedule fits"
        )

    # The state: a priority order over all ops, written as the sequence of their chains
    # (the k-th time chain c appears, its k-th op), so that every state respects each
    # chain's order and each stage runs its ops in the sequence's order without deadlock.
    chains = [(m, i) for m in (ACTOR, CRITIC) for i in range(micro[m])]
    steps = [(p, False) for p in range(stages)] + [(p, True) for p in reversed(range(stages))]
    unit = max(memory[m] for m in (ACTOR, CRITIC) if micro[m])

    def decode(seq) -> tuple[float, float]:
        """(makespan, peak memory over the limit in micro-batches) of a chain sequence."""
        nxt = [0] * len(chains)
        end = [0.0] * len(chains)
        free = [0.0] * stages
        held = [0.0] * stages
        over = 0.0
        for c in seq:
            m = chains[c][0]
            p, back = steps[nxt[c]]
            nxt[c] += 1
            s = p if m == ACTOR else stages - 1 - p
            end[c] = free[s] = max(free[s], end[c]) + costs[m][back]
            held[s] += -memory[m] if back else memory[m]
            over = max(over, held[s] - limit)
        return max(free), over / unit

    def orders_of(seq) -> list[list[Op]]:
        nxt = [0] * len(chains)
        orders: list[list[Op]] = [[] for _ in range(stages)]
        for c in seq:
            (m, i), (p, back) = chains[c], steps[nxt[c]]
            nxt[c] += 1
            orders[stage_of(m, p, stages)].append(Op(m, i, p, back))
        return orders

    def seq_of(orders) -> list[int]:
        timed = _timed(orders, stages, lambda op: costs[op.model][op.backward])
        ranked = sorted(timed, key=lambda op: (timed[op][0], timed[op][1]))
        index = {ch: c for c, ch in enumerate(chains)}
        return [index[(op.model, op.micro)] for op in ranked]

    starts = [seq_of(_capped_separate(stages, micro, costs, memory, limit))]
    # Greedy: backwards first (they free memory), then the earliest micro-batch, the
    # models' micro-batches interleaved, the stages the op still has to pass last.
    greedy = {
        op: (
            not op.backward,
            op.micro / max(micro[op.model], 1),
            -op.position if op.backward else op.position,
        )
        for op in all_ops(stages, micro)
    }
    greedy = {op: rank for rank, op in enumerate(sorted(greedy, key=greedy.get))}
    orders = list_schedule(stages, micro, costs, memory, limit, greedy)
    if orders is not None:
        starts.append(seq_of(orders))
    scored = [(decode(q), q) for q in starts]
    cur, current = min(((sc, q) for sc, q in scored if not sc[1]), key=lambda x: x[0][0])
    best, best_span = list(current), cur[0]
    start_span = best_span
    rng = np.random.default_rng(seed)
    scale = float(np.mean([c for pair in costs for c in pair]))
    t0, t1 = scale, scale * 1e-2
    chain = 2 * stages * scale  # one micro-batch's work over all stages
    n = len(current)

    def descend(seq, length):
        """Local search to a sequence no pair of micro-batches trading places, nor two
        neighbouring ops swapping, makes shorter within the limit."""
        improved = True
        while improved:
            improved = False
            trials = [
                [b if c == a else a if c == b else c for c in seq]
                for a in range(len(chains))
                for b in range(a + 1, len(chains))
            ]
            trials += [
                [*seq[:i], seq[i + 1], seq[i], *seq[i + 2 :]]
                for i in range(n - 1)
                if seq[i] != seq[i + 1]
            ]
            for trial in trials:
                t_len, t_over = decode(trial)
                if not t_over and t_len < length:
                    seq, length, improved = trial, t_len, True
                    break
        return seq, length

    best, best_span = descend(best, best_span)
    current, cur = list(best), (best_span, 0.0)
    # Annealing in rounds, each reheated from the best sequence so far (polished by a local
    # search): a round that wandered off into a worse region does not lose what an earlier
    # one found.
    per_round = max(iterations // rounds, 1)
    for k in range(iterations):
        frac = (k % per_round) / per_round
        if k and k % per_round == 0:
            best, best_span = descend(best, best_span)
            current, cur = list(best), (best_span, 0.0)
        temp = t0 * (t1 / t0) ** frac
        # Sequences over the limit stay reachable as steps between ones that fit (under a
        # tight limit one micro-batch passes another in several moves): they pay a penalty
        # per micro-batch of excess, from half a micro-batch's work over all stages to 4.5
        # times it as the temperature falls; never kept.
        weight = chain * (0.5 + 4.0 * frac)
        trial = list(current)
        move = rng.random()
        if move < 0.1 and len(chains) > 1:  # two micro-batches trade all their places
            a, b = rng.choice(len(chains), 2, replace=False)
            trial = [b if c == a else a if c == b else c for c in trial]
        else:  # one op moves (next to its neighbour, or anywhere)
            i = int(rng.integers(n))
            j = int(rng.integers(n)) if move < 0.4 else min(i + 1, n - 1)
            trial.insert(j, trial.pop(i))
        if trial == current:
            continue
        length, over = decode(trial)
        delta = (length + weight * over) - (cur[0] + weight * cur[1])
        if delta <= 0 or rng.random() < math.exp(-delta / temp):
            current, cur = trial, (length, over)
            if not over and length < best_span:
                best, best_span = list(trial), length
    best, best_span = descend(best, best_span)
    best = orders_of(best)
    sched = table(best, stages, micro)
    return SearchResult(sched, best_span, sched.peak_memory(memory), start_span)


@functools.lru_cache(maxsize=256)
def step_schedule(
    stages: int, micro: tuple[int, int], rows: int, hidden: tuple[int, int]
) -> SearchResult:
    """The schedule the fused train step runs (jrlhf.ppo.update.fused_step) for ``rows``-row
    minibatches cut into ``micro = (actor, critic)`` pipeline micro-batches of models of hidden
    sizes ``hidden``; the estimator prices the same one (jrlhf.placement.estimator), so its
    settings live here only. Unit costs: the program runs the table tick by tick, one op a
    stage a tick, so the table (``table``) gives every op one tick whatever its model or
    direction (what a tick then costs, ``Schedule.critical_path``, is not what the search
    minimises). A micro-batch's memory: its rows times its model's hidden size (a stage
    keeps its input). The limit: what the larger of the two models' 1F1B steps alone keeps on
    a stage, ``min(S, M)`` micro-batches. Cached, as a planner prices the same setting many
    times (callers must not write to its arrays)."""
    memory = tuple(float(rows // m * h) for m, h in zip(micro, hidden, strict=True))
    limit = max(min(stages, m) * mem for m, mem in zip(micro, memory, strict=True))
    return search(stages, micro, ((1.0, 1.0), (1.0, 1.0)), memory, limit)


@dataclasses.dataclass(frozen=True)
class Program:
    """The arrays the fused train step scans over, per model (index 0 actor, 1 critic), each
    (ticks, stages) unless said: ``op`` 0 idle, 1 forward, 2 backward; ``micro`` the
    micro-batch; ``slot`` its buffer slot on that stage; ``recv_fwd`` / ``recv_bwd`` the slot
    the activation / input gradient arriving from the neighbouring stage at the end of the
    tick goes to (-1: none); (ticks,) ``head`` / ``embed`` / ``embed_grad``: the micro-batch
    whose loss, embedding, embedding gradient the tick computes (-1: none) and ``head_slot``,
    ``embed_slot`` their slots; ``slots``: buffer slots a stage needs."""

    op: tuple[np.ndarray, np.ndarray]
    micro: tuple[np.ndarray, np.ndarray]
    slot: tuple[np.ndarray, np.ndarray]
    recv_fwd: tuple[np.ndarray, np.ndarray]
    recv_bwd: tuple[np.ndarray, np.ndarray]
    head: tuple[np.ndarray, np.ndarray]
    head_slot: tuple[np.ndarray, np.ndarray]
    embed: tuple[np.ndarray, np.ndarray]
    embed_slot: tuple[np.ndarray, np.ndarray]
    embed_grad: tuple[np.ndarray, np.ndarray]
    slots: tuple[int, int]


def program(sched: Schedule) -> Program:
    """The fused step's arrays for a (validated) table. Each stage keeps, per model, a
    micro-batch's input from the tick it arrives (its forward's tick on the first position)
    to its backward there, and the gradient of its output in the same slot; slots are reused
    as soon as free (interval colouring), so a stage needs as many as micro-batches overlap."""
    sched.validate()
    S, T = sched.stages, sched.ticks
    ticks = sched.ops()
    fields = {k: [] for k in Program.__dataclass_fields__ if k != "slots"}
    slots = []
    for m in (ACTOR, CRITIC):
        M = sched.micro[m]
        slot = np.zeros((S, max(M, 1)), np.int32)  # by position and micro-batch
        need = 1
        for p in range(S):
            spans = []
            for i in range(M):
                f = ticks[Op(m, i, p, False)]
                start = f if p == 0 else ticks[Op(m, i, p - 1, False)] + 1
                spans.append((start, ticks[Op(m, i, p, True)], i))
            ends: list[int] = []  # the last tick each slot is busy
            for start, end, i in sorted(spans):
                free = [k for k, e in enumerate(ends) if e < start]
                k = free[0] if free else len(ends)
                if k == len(ends):
                    ends.append(end)
                ends[k] = end
                slot[p, i] = k
            need = max(need, len(ends))
        slots.append(need)
        op = np.zeros((T, S), np.int32)
        micro = np.zeros((T, S), np.int32)
        at = np.zeros((T, S), np.int32)
        recv_f = np.full((T, S), -1, np.int32)
        recv_b = np.full((T, S), -1, np.int32)
        head, head_slot = np.full(T, -1, np.int32), np.zeros(T, np.int32)
        embed, embed_slot = np.full(T, -1, np.int32), np.zeros(T, np.int32)
        embed_grad = np.full(T, -1, np.int32)
        step = 1 if m == ACTOR else -1  # the stage of the next position
        for o, t in ticks.items():
            if o.model != m:
                continue
            s, p, i = o.stage(S), o.position, o.micro
            op[t, s], micro[t, s], at[t, s] = 2 if o.backward else 1, i, slot[p, i]
            if not o.backward and p < S - 1:
                recv_f[t, s + step] = slot[p + 1, i]
            if not o.backward and p == S - 1:
                head[t], head_slot[t] = i, slot[p, i]
            if not o.backward and p == 0:
                embed[t], embed_slot[t] = i, slot[p, i]
            if o.backward and p > 0:
                recv_b[t, s - step] = slot[p - 1, i]
            if o.backward and p == 0:
                embed_grad[t] = i
        for k, v in zip(
            fields,
            (op, micro, at, recv_f, recv_b, head, head_slot, embed, embed_slot, embed_grad),
            strict=True,
        ):
            fields[k].append(v)
    return Program(**{k: tuple(v) for k, v in fields.items()}, slots=tuple(slots))
