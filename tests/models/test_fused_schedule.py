"""The fused actor-critic schedule's search (jrlhf.models.fused_schedule): on tiny cases its
makespan is the optimum an exhaustive search finds, no schedule it returns holds more than the
memory limit on any stage, an impossible limit and a broken table fail in one line, and the
bubbles it reports are those of the tables."""

import math

import numpy as np
import pytest

from jrlhf.models import fused_schedule as fs


def brute_force(stages, micro, costs, memory, limit):
    """The shortest makespan over every order of every stage's ops (depth first over the
    ops in a dependency-respecting sequence, each appended to its stage's order and started
    as early as that order and its chain allow), pruning branches over the limit or no
    shorter than the best found."""
    chains = [(m, i) for m in (0, 1) for i in range(micro[m])]
    # a chain's ops in order: forwards over positions 0..S-1, then backwards S-1..0
    seq = [(p, False) for p in range(stages)] + [(p, True) for p in reversed(range(stages))]
    best = [math.inf]

    def stage(m, p):
        return p if m == 0 else stages - 1 - p

    def dfs(progress, chain_end, free, held, span):
        if span >= best[0]:
            return
        if all(k == len(seq) for k in progress):
            best[0] = span
            return
        for c, (m, _) in enumerate(chains):
            k = progress[c]
            if k == len(seq):
                continue
            p, back = seq[k]
            s = stage(m, p)
            new_held = held[s] + (-memory[m] if back else memory[m])
            if new_held > limit:
                continue
            end = max(free[s], chain_end[c]) + costs[m][back]
            dfs(
                (*progress[:c], k + 1, *progress[c + 1 :]),
                (*chain_end[:c], end, *chain_end[c + 1 :]),
                (*free[:s], end, *free[s + 1 :]),
                (*held[:s], new_held, *held[s + 1 :]),
                max(span, end),
            )

    n = len(chains)
    dfs((0,) * n, (0.0,) * n, (0.0,) * stages, (0.0,) * stages, 0.0)
    return best[0]


def held_per_stage(sched, memory):
    """Each stage's peak memory counted straight from the table, tick by tick."""
    peaks = []
    for s in range(sched.stages):
        held = peak = 0.0
        for t in range(sched.ticks):
            m = sched.model[t, s]
            if m == fs.IDLE:
                continue
            if sched.backward[t, s]:
                held -= memory[m]
            else:
                held += memory[m]
                peak = max(peak, held)
        peaks.append(peak)
    return np.array(peaks)


CASES = [
    # stages, micro-batches (actor, critic), (forward, backward) costs, memory, limit
    (2, (1, 1), ((1, 2), (1, 2)), (1, 1), math.inf),
    (2, (2, 1), ((1, 2), (2, 3)), (1, 1), math.inf),
    (2, (2, 1), ((1, 2), (1, 2)), (1, 2), 2),
    (3, (1, 1), ((1, 1), (2, 2)), (1, 1), 1),
    (2, (2, 2), ((1, 1), (1, 1)), (1, 1), 1),
    (2, (2, 2), ((1, 2), (2, 1)), (1, 1), 2),
]


@pytest.mark.parametrize("stages,micro,costs,memory,limit", CASES)
def test_the_search_finds_the_optimal_makespan_of_tiny_cases(stages, micro, costs, memory, limit):
    want = brute_force(stages, micro, costs, memory, limit)
    got = fs.search(stages, micro, costs, memory, limit, iterations=2000, seed=0)
    got.schedule.validate()
    assert got.makespan == pytest.approx(want)
    assert got.makespan <= got.start_makespan
    # the reported makespan is the one of the returned orders
    assert fs.makespan(got.schedule.orders(), stages, costs) == pytest.approx(want)
    assert np.all(held_per_stage(got.schedule, memory) <= limit)


@pytest.mark.parametrize("stages,micro", [(2, (4, 4)), (4, (4, 2)), (4, (3, 5))])
def test_no_schedule_holds_more_than_the_memory_limit(stages, micro):
    memory = (2.0, 3.0)
    spans = []
    for limit in (3.0, 5.0, 8.0, math.inf):
        found = fs.search(stages, micro, ((1, 2), (1.5, 3)), memory, limit, iterations=300)
        found.schedule.validate()
        peaks = held_per_stage(found.schedule, memory)
        assert np.all(peaks <= limit), (limit, peaks)
        np.testing.assert_array_equal(found.peak_memory, peaks)
        spans.append(found.makespan)
    # more memory never makes the best schedule found slower than the tightest limit's
    assert spans[-1] <= spans[0]


def test_an_impossible_limit_and_a_broken_table_fail_in_one_line():
    with pytest.raises(ValueError) as err:
        fs.search(2, (2, 2), memory=(1.0, 3.0), limit=2.0)
    assert str(err.value).startswith("fused schedule: a per-device memory limit of 2 is below")
    assert "\n" not in str(err.value)
    sched = fs.search(2, (2, 2), iterations=50).schedule
    swapped = sched.backward.copy()
    t, s = np.argwhere(sched.backward)[0]
    swapped[t, s] = False
    broken = fs.Schedule(sched.stages, sched.micro, sched.model, sched.micro_index, swapped)
    with pytest.raises(ValueError, match=r"^schedule table: .* (never runs|more than once)$"):
        broken.validate()


@pytest.mark.parametrize("stages", [2, 4])
def test_the_fused_schedule_fills_the_separate_schedules_bubbles(stages):
    """Counted from the tables (one op a stage a tick): each model's 1F1B alone idles
    (S-1)/(M+S-1) of its 2(M+S-1) ticks; the fused table at the memory a 1F1B stage holds
    (S micro-batches) idles less and ends sooner than the two one after the other."""
    for micro in (2, 4, 8):
        alone = fs.table(fs.one_f_one_b_orders(stages, micro), stages, (micro, 0))
        assert alone.ticks == 2 * (micro + stages - 1)
        assert alone.bubble() == pytest.approx((stages - 1) / (micro + stages - 1))
        assert alone.peak_memory((1, 1)).max() == min(stages, micro)
        found = fs.search(stages, (micro, micro), ((1, 1), (1, 1)), (1, 1), stages, iterations=400)
        assert found.schedule.ticks < 2 * alone.ticks
        assert found.schedule.bubble() < alone.bubble()
        assert found.peak_memory.max() <= stages
