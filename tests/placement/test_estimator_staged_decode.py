"""The estimator's price of pipelined decode (jrlhf.decode.pipelined) and the plan search's staged
generation slots: a step is S ticks of one stage's layers on one group of slots, the delayed
inter-batch pipeline (G = S groups) beats naive pipelined decode (G = 1), and generation is
offered stages only where its weights do not fit one node."""

import dataclasses

import pytest

from jrlhf.models.presets import get_preset
from jrlhf.placement import estimator as est
from jrlhf.placement.candidates import call_candidates, placement, slot_of
from jrlhf.placement.plan import CallPlacement
from jrlhf.placement.profile import DeviceProfile
from jrlhf.placement.search import staged_calls
from jrlhf.placement.workload import Workload

H100 = DeviceProfile.load("h100")


def grpo(model, **kw) -> Workload:
    """docs/plans.md's GRPO workload: 64 prompts x 8 samples, 1024 + 1024 tokens."""
    kw = {"decode_slots": 256, **kw}
    return Workload(
        actor=model, critic=None, reference=model, reward=None, prompts=64,
        samples_per_prompt=8, prompt_len=1024, gen_len=1024, epochs=1, minibatch_size=128, **kw,
    )  # fmt: skip


def step(w: Workload, mesh: str, in_flight: int, groups: int = 0, cfg=None) -> float:
    p = CallPlacement(mesh, "dp_tp")
    g = est._geometry(p, H100)
    return est._decode_step_s(cfg or w.actor, p, g, H100, in_flight, 1500.0, groups)


def test_a_staged_step_is_s_ticks_of_one_stage_on_one_group():
    """70B on 2 stages of 8 devices: a step of 256 sequences in flight costs 2 ticks, each the
    step of a half-depth model (one stage's 40 layers) on its 8 devices over one group (128
    sequences with G = 2, all 256 with G = 1), plus the hand-off of the group's hidden states
    and the model's per-layer fixed cost counted once; the delayed pipeline is the cheaper."""
    model = get_preset("llama3_70b")
    w = grpo(model)
    half = dataclasses.replace(model, num_layers=model.num_layers // 2)
    once = model.num_layers * H100.decode_layer_overhead_once_s
    half_once = half.num_layers * H100.decode_layer_overhead_once_s
    for groups, rows in ((2, 128), (1, 256)):
        staged = step(w, "stage=2,data=1,tensor=8", 256, groups)
        tick = step(w, "data=1,tensor=8", rows, cfg=half) - half_once
        # the half-depth model's flops hold the whole head, a stage's the head's half
        assert staged - once == pytest.approx(2 * tick, rel=0.03), groups
    delayed = step(w, "stage=2,data=1,tensor=8", 256, 2)
    naive = step(w, "stage=2,data=1,tensor=8", 256, 1)
    assert delayed < naive
    # one stage and no stage axis: the unstaged price, whatever the groups
    assert step(w, "data=2,tensor=8", 256, 1) == step(w, "data=2,tensor=8", 256, 0)


def test_generate_prices_the_staged_engine_as_it_runs():
    """The engine's slots round to data shards x stages; each chunk fills and drains the
    pipeline (G - 1 more ticks); the delayed pipeline beats naive decode, and on 16 H100s two
    stages of a node each beat tensor parallelism over both nodes (every layer's all-reduces
    crossing them)."""
    model = get_preset("llama3_70b")
    w = grpo(model, decode_slots=250)
    staged = CallPlacement("stage=2,data=2,tensor=4", "dp_tp")
    # a multiple of 2 data shards x 2 stages
    assert est._engine_slots(w, est._geometry(staged, H100)) == 252
    delayed = est.generate_seconds(w, staged, H100)
    naive = est.generate_seconds(dataclasses.replace(w, decode_pipeline_batches=1), staged, H100)
    across = est.generate_seconds(w, CallPlacement("data=1,tensor=16", "dp_tp"), H100)
    assert delayed < naive and delayed < across


def test_generation_is_offered_stages_where_its_weights_do_not_fit_a_node():
    """405B's bf16 weights (810 GB) exceed a node of 8 H100s: the search offers generation
    stages of whole nodes, laid out stage x data x tensor; 70B's fit: none."""
    big = grpo(get_preset("llama3_405b"))
    assert "actor_generate" in staged_calls(big, H100, 8)
    assert "actor_generate" not in staged_calls(grpo(get_preset("llama3_70b")), H100, 8)
    slots = call_candidates("actor_generate", big.actor, 32, batch=512)
    staged = [s for s in slots if s.stages > 1]
    assert staged and all(s.size // s.stages >= 8 for s in staged)
    slot = next(s for s in staged if s.stages == 2 and s.size == 32 and s.tensor == 8)
    p = placement("actor_generate", slot)
    assert dict(p.mesh.axes) == {"stage": 2, "data": 2, "tensor": 8}
    assert slot_of(p) == slot
