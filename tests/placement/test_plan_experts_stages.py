"""The plan search's expert and stage axes (jrlhf.placement.search): proposed where they pay,
absent where they do not, priced with a mixture of experts' active parameters for FLOPs and all
of them for memory, and written as configs the trainer's start-up check accepts."""

import dataclasses

import jax
import numpy as np
import pytest

from jrlhf import config
from jrlhf.models.config import tiny_config
from jrlhf.models.model_def import ModelDef
from jrlhf.models.presets import get_preset
from jrlhf.pipeline.start_check import check_run
from jrlhf.pipeline.task_data import build_task_data
from jrlhf.placement import estimator as est
from jrlhf.placement.candidates import call_candidates, slots_of
from jrlhf.placement.plan import CallPlacement, ExecutionPlan, flatten
from jrlhf.placement.profile import DeviceProfile
from jrlhf.placement.search import SearchSpace, search, staged_calls
from jrlhf.placement.workload import Workload, num_params
from jrlhf.runtime.model_source import role_models

H100 = DeviceProfile.load("h100")
# docs/plans.md's GRPO workload: 64 prompts x 8 samples, 1024 + 1024 tokens, minibatch 128
GRPO = dict(prompts=64, samples_per_prompt=8, prompt_len=1024, gen_len=1024, epochs=1)


def grpo(model, **kw) -> Workload:
    return Workload(
        actor=model,
        critic=None,
        reference=model,
        reward=None,
        **GRPO,
        minibatch_size=128,
        decode_slots=256,
        **kw,
    )


def axes(plan: ExecutionPlan, call: str) -> dict[str, int]:
    return plan[call].mesh.shape


def test_moe_search_proposes_an_expert_axis_that_beats_every_strategy():
    """A 30B-A3B-shaped GRPO on 8 H100s: the search's best plan splits the experts of the
    actor's training over an expert axis, and is faster than every tuned strategy (which
    never split them)."""
    model = get_preset("qwen3_30b_a3b", remat_policy="dots_no_batch")
    result = search(grpo(model), 8, H100, tune_batches=True, steps=0, restarts=1)
    best = result.best
    assert best.estimate.fits
    assert axes(best.plan, "actor_train").get("expert", 1) > 1
    assert "stage" not in axes(best.plan, "actor_train")  # 30B's state fits a node
    for base in result.baselines.values():
        assert all("expert" not in axes(base.plan, c) for c, _ in base.plan.placements)
        assert best.cost < base.cost
    # experts divide the 128 experts, and generation never takes the axis
    assert all(
        128 % s.experts == 0 and s.experts <= 8 for s in call_candidates("actor_train", model, 8)
    )
    assert {s.experts for s in call_candidates("actor_generate", model, 8)} == {1}


def tiny_staged_config(extra=()):
    """configs/grpo_tiny.gin with a 4-layer model whose 2-row minibatch caps FSDP at 2."""
    bindings = [
        "RunConfig.stages=('grpo',)",
        "RLConfig.minibatch_size=2",
        "RLConfig.epochs=1",
        "actor/RoleConfig.model_overrides=(('num_layers', 4),)",
        "reference/RoleConfig.model_overrides=(('num_layers', 4),)",
        *extra,
    ]
    return bindings, config.load_config(["configs/grpo_tiny.gin"], bindings)


def workload_of(cfg) -> Workload:
    return Workload.from_config(cfg, role_models(cfg, build_task_data(cfg).model_overrides))


# nodes of 2 devices and 0.85 MB each: the tiny actor's float32 weights and AdamW moments (1.8
# MB) do not fit one node, and its 2-row minibatch and 2 KV heads leave an unstaged training
# call at most fsdp=2 x tensor=2 (4 devices), where it needs 1.0 MB per device
SMALL_NODES = H100.replace(devices_per_node=2, memory_bytes=850_000)


def test_stages_are_proposed_where_nothing_else_fits_and_the_plan_runs(tmp_path):
    bindings, cfg = tiny_staged_config()
    w = workload_of(cfg)
    assert staged_calls(w, SMALL_NODES, 2) == {"actor_train"}
    kwargs = dict(devices_per_node=2, tune_batches=True, steps=300, restarts=2)
    result = search(w, 8, SMALL_NODES, exhaustive_limit=0, **kwargs)  # 13,755 plans: anneal
    best = result.best
    assert best.estimate.fits, best.estimate.reasons
    mesh = axes(best.plan, "actor_train")
    assert mesh.get("stage", 1) > 1 and 4 % mesh["stage"] == 0
    tuned = best.estimate.workload.actor
    assert tuned.pipeline_microbatches >= 1 and tuned.pipeline_schedule in ("gpipe", "1f1b")
    # with the other calls where they are, no unstaged training slot fits (every one priced),
    # and no strategy fits either
    slots = slots_of(best.plan)
    whole = dataclasses.replace(w, actor_microbatches=1, infer_batch_size=0)
    others = {c: [slots[c]] for c in ("actor_generate", "reference_infer")}
    train = call_candidates("actor_train", w.actor, 8, batch=2, devices_per_node=2, stages=False)
    space = SearchSpace(whole, 8, devices_per_node=2, candidates={**others, "actor_train": train})
    unstaged = search(w, 8, SMALL_NODES, space=space, **kwargs)
    assert unstaged.method == "exhaustive" and unstaged.space_size == len(train) > 4
    assert not any(r.estimate.fits for r in unstaged.ranked)
    assert not any(b.estimate.fits for b in result.baselines.values())
    # the written plan and knobs are a config the start-up check accepts on 8 devices
    run_check(tmp_path, "configs/grpo_tiny.gin", bindings, best)


def run_check(tmp_path, base: str, bindings, best) -> None:
    """``python -m jrlhf.plan``'s output (the plan's gin and its knobs' bindings) over ``base``
    and ``bindings``, through ``python -m jrlhf.train --check``'s checks."""
    gin_file = tmp_path / "plan.gin"
    text = best.plan.to_gin() + "\n".join(est.batch_bindings(best.estimate.workload)) + "\n"
    gin_file.write_text(text)
    cfg = config.load_config([base, str(gin_file)], list(bindings))
    assert jax.device_count() == 8
    plan = check_run(cfg)
    assert plan.rows() == dataclasses.replace(best.plan, name=plan.name).rows()


def test_an_expert_plan_of_the_search_runs(tmp_path):
    """configs/moe_grpo_tiny.gin's workload, the search limited to expert-split training and
    scoring: the plan it writes passes the start-up check (shardings, batch splits)."""
    bindings = ["RunConfig.stages=('grpo',)"]
    cfg = config.load_config(["configs/moe_grpo_tiny.gin"], bindings)
    w = workload_of(cfg)
    whole = dataclasses.replace(w, actor_microbatches=1, infer_batch_size=0)
    full = SearchSpace(whole, 8)
    split = {  # every call of the MoE model but generation on an expert axis
        c: [s for s in cands if s.experts > 1 or not full.models[c].is_moe or c == "actor_generate"]
        for c, cands in full.candidates.items()
    }
    space = SearchSpace(whole, 8, candidates=split)
    kwargs = dict(tune_batches=True, steps=50, restarts=1, top=50, exhaustive_limit=0)
    result = search(w, 8, H100, space=space, **kwargs)
    # the strategies (no expert axis) are ranked too: the best plan of the space is wanted
    best = next(r for r in result.ranked if "expert" in axes(r.plan, "actor_train"))
    assert axes(best.plan, "actor_train")["expert"] in (2, 4)
    assert any("expert=" in line for line in best.plan.to_gin().splitlines())
    run_check(tmp_path, "configs/moe_grpo_tiny.gin", bindings, best)


def test_a_dense_model_that_fits_a_node_gets_neither_axis():
    """7B GRPO on 16 H100s: its trained state fits one node and it has no experts, so the
    candidates are the ones the search had before the two axes (no stage or expert slot)."""
    model = get_preset("llama2_7b", remat_policy="dots_no_batch")
    w = grpo(model)
    assert staged_calls(w, H100, 8) == set()
    space = SearchSpace(w, 16, stage_calls=staged_calls(w, H100, 8))
    for call, cands in space.candidates.items():
        assert all(s.stages == 1 and s.experts == 1 for s in cands), call
        assert cands == call_candidates(call, model, 16, batch=space.batches[call], stages=False)
    # where its state would not fit a node, stages are offered on multi-node slices only
    staged = call_candidates("actor_train", model, 16, batch=128)
    assert {s.stages for s in staged} == {1, 2}
    assert all(s.size == 16 for s in staged if s.stages > 1)


def moe_param_counts(cfg) -> tuple[int, float]:
    """(all parameters, the matmul parameters one token of a layer runs through), from the
    model's abstract parameter tree: expert weights count top_k / num_experts of their size,
    norms and the embedding gather none."""
    model = ModelDef(cfg, "lm")
    leaves = jax.tree_util.tree_leaves_with_path(model.abstract_params)
    total, active = 0, 0.0
    for path, leaf in leaves:
        name = jax.tree_util.keystr(path)
        size = int(np.prod(leaf.shape))
        total += size
        if "layers" not in name or "norm" in name:
            continue
        share = cfg.num_experts_per_tok / cfg.num_experts if "experts" in name else 1.0
        active += size * share / cfg.num_layers
    return total, active


def test_moe_estimate_prices_flops_by_active_and_memory_by_all_parameters():
    cfg = tiny_config(
        architecture="qwen3_moe",
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        qk_norm=True,
        remat_policy="none",
    )
    w = dataclasses.replace(
        grpo(cfg), prompts=4, samples_per_prompt=2, prompt_len=8, gen_len=8, minibatch_size=8
    )
    total, active = moe_param_counts(cfg)
    assert total == num_params(cfg, "lm") == cfg.num_params()
    assert active < total / cfg.num_layers / 2  # 2 of 8 experts
    # a training step's FLOPs: 3 passes (forward, two backward matmuls) of the active weights,
    # the attention square and the lm head at the response columns
    seq, rows = w.seq_len, w.rows
    forward = (
        2 * cfg.num_layers * active * rows * seq
        + 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * seq * seq * rows
        + 2 * cfg.vocab_size * cfg.hidden_size * rows * w.gen_len
    )
    compute_only = H100.replace(
        call_overhead_s=0.0,
        train_step_overhead_s=0.0,
        train_layer_overhead_s=0.0,
        collective_latency_s=0.0,
        memory_bandwidth=1e30,
        intra_node_bandwidth=1e30,
        inter_node_bandwidth=1e30,
    )
    one = CallPlacement("fsdp=1", "fsdp_tp")
    seconds = est.train_seconds(w, "actor", one, compute_only)
    rate = compute_only.matmul_flops * compute_only.train_efficiency
    assert seconds * rate == pytest.approx(3 * forward, rel=1e-9)
    # memory: every expert's weights and AdamW moments, on one device and split over 8
    plan = flatten(1, tensor=1)
    parts = est.estimate(plan, w, H100).memory_breakdown["actor_train"]
    assert parts["actor params"] == total * 4
    assert parts["actor adam"] == total * est.MOMENT_BYTES
    # on fsdp=2 x expert=4 a device holds 1/4 of the experts and 1/2 of every weight with an
    # embed dimension (norms and the router's expert columns whole)
    model = ModelDef(cfg, "lm")
    is_axes = lambda x: isinstance(x, tuple) and all(isinstance(a, str | None) for a in x)  # noqa: E731
    logical = jax.tree_util.tree_leaves(model.logical_axes, is_leaf=is_axes)
    shapes = jax.tree_util.tree_leaves(model.abstract_params)
    held = sum(
        np.prod(leaf.shape) / (2 if "embed" in ax else 1) / (4 if "experts" in ax else 1)
        for ax, leaf in zip(logical, shapes, strict=True)
    )
    split = CallPlacement("fsdp=2,expert=4@0:8", "fsdp_tp")
    assert est.shard_bytes(cfg, "lm", split) == held * 4
