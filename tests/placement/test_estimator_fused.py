"""The estimator's price of the fused actor-critic pipeline (critic/RoleConfig.pipeline_schedule
='fused', jrlhf.runtime.fused_step) against the two separate staged steps."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from benchmarks import fsdp_memory as fm
from jrlhf.models import fused_schedule as fs
from jrlhf.placement import estimator as est
from jrlhf.placement.plan import CallPlacement, ExecutionPlan, strategy
from jrlhf.placement.profile import DeviceProfile
from jrlhf.placement.workload import Workload

H100 = DeviceProfile.load("h100")
# layer FLOPs only: no launch, dispatch, collective or memory-traffic terms
COMPUTE_ONLY = H100.replace(
    call_overhead_s=0.0,
    train_step_overhead_s=0.0,
    train_layer_overhead_s=0.0,
    train_layer_overhead_once_s=0.0,
    collective_latency_s=0.0,
    intra_node_bandwidth=1e30,
    inter_node_bandwidth=1e30,
    memory_bandwidth=1e30,
)


def workload(micro: int, rows: int = 16, fused: bool = True) -> Workload:
    cfg = fm.model_config(4, pipeline_microbatches=micro)
    return Workload(
        actor=cfg,
        critic=cfg,
        reference=cfg,
        reward=None,
        prompts=rows,
        samples_per_prompt=1,
        prompt_len=fm.P,
        gen_len=fm.R,
        epochs=1,
        minibatch_size=rows,
        fused_actor_critic=fused,
    )


def on_train(actor: CallPlacement, critic: CallPlacement) -> ExecutionPlan:
    """The flatten plan on 8 devices with the actor's and critic's training calls moved."""
    base = strategy("flatten", 8)
    calls = dict(base.placements, actor_train=actor, critic_train=critic)
    return ExecutionPlan("fused", tuple(calls.items()))


# an op's cost in forwards of its micro-batch through a stage: a backward recomputes the forward
# under jax.vjp, then runs two matmuls a weight
COSTS = ((1.0, 3.0), (1.0, 3.0))


@pytest.mark.parametrize(
    ("mesh", "stages", "micro"),
    [("stage=2", 2, 4), ("stage=4", 4, 2), ("stage=2,fsdp=4", 2, 4)],
)
def test_the_fused_step_is_priced_on_the_table_the_runtime_runs(mesh, stages, micro):
    """The priced ticks and idle share are those of the table the PPO update builds
    (fused_schedule.step_schedule, the one home of its search settings), and its layer work is
    what the program runs: on a mesh of stages only the table's critical path, idle slots
    free; with an fsdp axis too (the lockstep program) a forward and a backward of both models
    at every tick. On a compute-only profile the fused step costs path / (6 (M + S - 1)) of
    the two GPipe steps (each 3 forwards a micro-batch and iteration), its priced bubble the
    share of the path that is not the two models' 6M useful forwards."""
    w, p = workload(micro), CallPlacement(mesh, "fsdp_tp")
    table = fs.step_schedule(stages, (micro, micro), 16, (256, 256)).schedule
    path = table.critical_path(COSTS) if "fsdp" not in mesh else 2 * 3 * table.ticks
    prices = est.train_schedule_prices(w, p, COMPUTE_ONLY)
    fused = prices["fused"]
    assert fused["ticks"] == table.ticks
    assert fused["table_bubble"] == table.bubble()
    assert fused["bubble"] == pytest.approx(1 - 6 * micro / path)
    ratio = fused["seconds"] / prices["gpipe"]["seconds"]
    assert ratio == pytest.approx(path / (6 * (micro + stages - 1)))
    assert prices["gpipe"]["bubble"] == pytest.approx((stages - 1) / (micro + stages - 1))
    # the estimate of a plan prices the train phase as the fused program
    plan = on_train(p, p)
    e = est.estimate(plan, w, COMPUTE_ONLY)
    assert e.call_seconds["actor_train"] + e.call_seconds["critic_train"] == pytest.approx(
        fused["seconds"]
    )


def test_fused_is_priced_by_its_critical_path_and_beats_the_1f1b_steps():
    """The fused step's idle slots cost nothing, so it is priced by its table's critical path
    (each stage's op once it and its neighbours ended the tick before): below the two 1F1B
    steps' (forward + recompute + backward) x (M + 2S - 1) each in every case checked (S = 2,
    4; M = 1, 2, 4), and at S = 2 from 2 micro-batches a model exactly the stages' own work,
    2M (forward + recompute + backward): no stage ever waits. A table without idle slots is
    not free of waits, and a path is never shorter than the busiest stage's work."""
    for mesh, stages in (("stage=2", 2), ("stage=4", 4)):
        p = CallPlacement(mesh, "fsdp_tp")
        for micro in (1, 2, 4):
            prices = est.train_schedule_prices(workload(micro), p, COMPUTE_ONLY)
            table = fs.step_schedule(stages, (micro, micro), 16, (256, 256)).schedule
            path = table.critical_path(COSTS)
            assert path >= 2 * micro * 4
            if stages == 2 and micro >= 2:
                assert path == 2 * micro * 4
            assert path < 2 * 4 * (micro + 2 * stages - 1)
            assert prices["fused"]["seconds"] < prices["1f1b"]["seconds"]
            assert prices["fused"]["bubble"] < prices["1f1b"]["bubble"]
    # one actor micro-batch: each op waits for its chain's previous one on the other stage
    waits = fs.Schedule(
        2,
        (1, 0),
        model=np.array([[0, -1], [-1, 0], [-1, 0], [0, -1]]),
        micro_index=np.zeros((4, 2), np.int32),
        backward=np.array([[0, 0], [0, 0], [0, 1], [1, 0]], bool),
    )
    waits.validate()
    assert waits.critical_path(COSTS) == 1 + 1 + 3 + 3  # each stage's work is 4


def test_a_fused_plan_the_runtime_refuses_does_not_fit():
    """Actor and critic on different training meshes, no stage axis, or rows that do not
    split: the PPO update refuses the fused step, so the estimate does not fit."""
    w = workload(4)
    staged = CallPlacement("stage=2,fsdp=4", "fsdp_tp")
    base = strategy("flatten", 8)
    cases = [
        (on_train(staged, base["critic_train"]), "one training mesh"),
        (base, "a stage axis of 2 or more"),
    ]
    for plan, why in cases:
        e = est.estimate(plan, w, H100)
        assert not e.fits and any(why in r for r in e.reasons), e.reasons
    uneven = dataclasses.replace(w, critic=fm.model_config(4, pipeline_microbatches=3))
    plan = on_train(staged, staged)
    e = est.estimate(plan, uneven, H100)
    assert any("do not split" in r for r in e.reasons), e.reasons
    assert not any("fused" in r for r in est.estimate(plan, w, H100).reasons)
