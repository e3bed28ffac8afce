"""benchmarks/op_profile.py: exclusive times of nested trace events, and a traced call's ops."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from benchmarks.op_profile import exclusive_times, op_profile


def test_exclusive_times_subtract_directly_nested_ops():
    events = [
        (100, 10, "after"),  # starts where "loop" ends: a sibling, not a child
        (0, 100, "loop"),
        (10, 20, "a"),
        (40, 30, "b"),
        (45, 5, "b_inner"),
        (60, 8, "SlinkyThreadPool::Await"),  # b waiting for its helper threads: b's own time
        (0, 120, "ThunkExecutor::Execute"),  # the dispatch around them all: no op
    ]
    got = dict(exclusive_times(events))
    assert got == {"loop": 50, "a": 20, "b": 25, "b_inner": 5, "after": 10}
    assert sum(got.values()) == 110  # every nanosecond of an op counted once


def test_a_traced_call_puts_its_matmul_first():
    """The product (2.1 GFLOP, milliseconds) comes first, ahead of a tanh of 64 values, with most
    of the op time. How long each op took is measured, so on a loaded machine a descheduled tanh
    can outlast the product (on a shared 2-core machine the tanh once took 0.4 ms of a 512 x 512
    product's 1.9 ms call): the ranking is asked of one of up to three profiles, not of every
    one. What does not depend on the timings holds in each: the two ops, once a call; shares
    that add up; op time within the wall time of the threads that ran ops."""
    a, c = jnp.ones((1024, 1024)), jnp.ones((64,))
    f = jax.jit(lambda a, c: (a @ a, jnp.tanh(c)))
    profiles = []
    for _ in range(3):
        prof = op_profile(lambda: jax.block_until_ready(f(a, c)), calls=3)
        profiles.append(prof)
        cats = prof["categories"]
        assert len(cats) == 2, prof  # the product and the tanh, each once a call
        assert all(row["events_per_call"] == 1 for row in cats.values()), prof
        assert sum(row["share"] for row in cats.values()) == pytest.approx(1, abs=2e-3), prof
        # each rounded: the ops to 3 decimals, their total and the wall time to 2
        assert sum(prof["top_ops_ms_per_call"].values()) == pytest.approx(
            prof["op_ms_per_call"], abs=0.02
        )
        threads = prof["threads_with_ops"]
        assert 0 < prof["op_ms_per_call"] <= (prof["wall_ms_per_call"] + 0.005) * threads + 0.005
        first_name, first = next(iter(cats.items()))
        if "tanh" not in first_name and first["share"] > 0.5:
            return
    raise AssertionError(f"the tanh outlasted the product in three profiles: {profiles}")
