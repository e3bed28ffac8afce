"""The estimator's price of the fused actor-critic pipeline (critic/RoleConfig.pipeline_schedule
='fused', jrlhf.runtime.fused_step) against the two separate staged steps."""

from __future__ import annotations

import dataclasses

import pytest

from benchmarks import fsdp_memory as fm
from jrlhf.placement import estimator as est
from jrlhf.placement.plan import CallPlacement, ExecutionPlan, strategy
from jrlhf.placement.profile import DeviceProfile
from jrlhf.placement.workload import Workload
from jrlhf.runtime import fused_schedule as fs

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


@pytest.mark.parametrize(
    ("mesh", "stages", "micro"), [("stage=2,fsdp=4", 2, 4), ("stage=4,fsdp=2", 4, 2)]
)
def test_the_fused_step_is_priced_on_the_table_the_runtime_runs(mesh, stages, micro):
    """The priced ticks and idle share are those of the table the PPO update builds
    (fused_schedule.step_schedule, the one home of its search settings), and every tick costs
    both models' forward and backward: on a compute-only profile the fused step costs
    ticks / (M + S - 1) of the two GPipe steps, its priced bubble 1 - 2M / (2 ticks)."""
    w, p = workload(micro), CallPlacement(mesh, "fsdp_tp")
    table = fs.step_schedule(stages, (micro, micro), 16, (256, 256)).schedule
    prices = est.train_schedule_prices(w, p, COMPUTE_ONLY)
    fused = prices["fused"]
    assert fused["ticks"] == table.ticks
    assert fused["table_bubble"] == table.bubble()
    assert fused["bubble"] == pytest.approx(1 - 2 * micro / (2 * table.ticks))
    ratio = fused["seconds"] / prices["gpipe"]["seconds"]
    assert ratio == pytest.approx(table.ticks / (micro + stages - 1))
    assert prices["gpipe"]["bubble"] == pytest.approx((stages - 1) / (micro + stages - 1))
    # the estimate of a plan prices the train phase as the fused program
    plan = on_train(p, p)
    e = est.estimate(plan, w, COMPUTE_ONLY)
    assert e.call_seconds["actor_train"] + e.call_seconds["critic_train"] == pytest.approx(
        fused["seconds"]
    )


def test_fused_is_priced_by_the_lockstep_slots_not_the_tables_idle_share():
    """The table's idle share is not what the program saves (it computes every slot): the
    fused step is priced below the two 1F1B steps exactly where its lockstep slots, 2 models
    x (forward + backward) x ticks, are fewer than theirs, (forward + recompute + backward) x
    (M + 2S - 1) each. Under the PPO update's memory limit that is nowhere (2-8 stages, 1-8
    micro-batches, checked here at S = 2, 4 and M = 1, 2, 4; e.g. S = 4, M = 2: 14 ticks,
    84 forward-units against 72), although the fused table idles no more than the separate
    1F1B tables in every case (less from 2 micro-batches a model)."""
    for mesh, stages in (("stage=2,fsdp=4", 2), ("stage=4,fsdp=2", 4)):
        p = CallPlacement(mesh, "fsdp_tp")
        for micro in (1, 2, 4):
            prices = est.train_schedule_prices(workload(micro), p, COMPUTE_ONLY)
            table = fs.step_schedule(stages, (micro, micro), 16, (256, 256)).schedule
            separate = fs.table(fs.separate(stages, (micro, micro)), stages, (micro, micro))
            assert table.bubble() <= separate.bubble()
            cheaper = 6 * table.ticks < 2 * 4 * (micro + 2 * stages - 1)
            assert (prices["fused"]["seconds"] < prices["1f1b"]["seconds"]) is cheaper
            assert (prices["fused"]["bubble"] < prices["1f1b"]["bubble"]) is cheaper


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
