"""Pipelined decode (jrlhf.decode.pipelined): the paged engine on a generation mesh with a stage
axis gives the tokens and log-probs of the same engine on a mesh without one."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrlhf.decode import DecodeEngine, EngineConfig, SamplingParams, round_slots
from jrlhf.decode.pipelined import group_rows, set_group_rows
from jrlhf.decode.turns import Turns
from jrlhf.meshes import make_mesh
from jrlhf.models.config import tiny_config
from jrlhf.models.model_def import ModelDef
from tests.decode.test_decode import _prompts
from tests.decode.test_multiturn import ScriptedEnv

ENGINE = EngineConfig(
    num_slots=8,
    page_size=4,
    max_prompt_len=16,
    max_new_tokens=8,
    chunk_steps=3,
    max_prefill_rows=8,
    max_observation_tokens=4,
)
PROMPT_LENS = (3, 11, 7, 5, 1, 8, 14, 6, 9, 2, 12)  # 11 prompts > 8 slots: slots are refilled
MODEL = ModelDef(tiny_config(vocab_size=64, eos_token_id=None, num_layers=4))


@functools.cache
def _params():
    return jax.jit(MODEL.init)(jax.random.key(0))


@functools.cache
def _engine(mesh_text: str, **config):
    """An engine on ``mesh_text`` and the same parameters placed there (one init program for
    every mesh: compiles are most of this file's time)."""
    mesh = make_mesh(mesh_text)
    engine = DecodeEngine(MODEL, mesh, "dp_tp", dataclasses.replace(ENGINE, **config))
    return engine, jax.device_put(_params(), MODEL.shardings(mesh, "dp_tp"))


def _assert_same(got, want):
    assert got.completion_ids == want.completion_ids
    for a, b in zip(
        got.raw_logprobs + got.sampling_logprobs, want.raw_logprobs + want.sampling_logprobs
    ):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


@pytest.mark.parametrize("mesh_text", ["stage=2,data=2,tensor=2", "stage=4,data=2"])
def test_pipelined_greedy_decoding_gives_the_unpipelined_tokens_and_logprobs(mesh_text):
    """Greedy, with a stop token and more prompts than slots (finished slots are refilled
    between chunks): the unpipelined engine's tokens, log-probs within 1e-5; every stage is
    busy at every tick of a full chunk, and the program compiles once."""
    prompts = _prompts(PROMPT_LENS, vocab=64)
    sp = SamplingParams(greedy=True, stop_ids=(6,))
    base, base_params = _engine("data=2,tensor=2")
    want = base.generate(base_params, prompts, sp)
    assert any(c[-1] == 6 for c in want.completion_ids)  # a stop token ended some
    assert any(len(c) == ENGINE.max_new_tokens for c in want.completion_ids)
    engine, params = _engine(mesh_text)
    stages = engine.spec.stages
    assert (stages, engine.spec.groups) == (int(mesh_text[6]), stages)
    got = engine.generate(params, prompts, sp)
    _assert_same(got, want)
    st = got.stats
    assert st["pipeline_stages"] == st["pipeline_batches"] == stages
    assert len(st["pipeline_stage_busy"]) == stages
    assert 0 < max(st["pipeline_stage_busy"]) <= st["pipeline_ticks"]
    assert st["pipeline_bubble"] == pytest.approx(
        1 - sum(st["pipeline_stage_busy"]) / (stages * st["pipeline_ticks"])
    )
    assert engine.compile_counts()["decode_chunk"] == 1
    # Each device holds its stage's layers' KV pages (of its data shard and KV heads).
    pool = engine.state.k_pages
    assert pool.addressable_shards[0].data.shape[0] == MODEL.config.num_layers // stages
    # One prompt per group, none stopping: the first chunk's ticks are all busy but the fill and
    # drain, (S - 1) / (chunk_steps * S + S - 1) of them idle.
    full = SamplingParams(greedy=True, stop_ids=(), max_new_tokens=ENGINE.chunk_steps + 1)
    one_chunk = engine.generate(params, _prompts((4,) * 8, vocab=64, seed=1), full).stats
    ticks = ENGINE.chunk_steps * stages + stages - 1
    assert one_chunk["pipeline_ticks"] == ticks
    assert one_chunk["pipeline_bubble"] == pytest.approx((stages - 1) / ticks)


def test_multiturn_episodes_under_stages():
    """Multi-turn episodes (observations prefilled between turns, turn budgets) on two
    stages equal the unpipelined ones, greedy on the engines above (compiles are this file's
    time; sampling through the stages: the recorded-routes test below). Naive pipelined decode,
    one batch in flight, runs the same program with G = 1: ``bench pipeline`` checks its tokens."""
    prompts = _prompts(PROMPT_LENS[:6], vocab=64)
    turns = Turns(ScriptedEnv(), stop_ids=(9,), max_tokens=3)
    sp = SamplingParams(greedy=True, num_samples=2, stop_ids=(5,))
    base, base_params = _engine("data=2,tensor=2")
    want = base.generate(base_params, prompts, sp, turns=turns)
    assert not all(m.all() for m in want.policy_masks)  # observations were fed
    engine, params = _engine("stage=2,data=2,tensor=2")
    got = engine.generate(params, prompts, sp, turns=turns)
    _assert_same(got, want)
    for a, b in zip(got.policy_masks, want.policy_masks):
        np.testing.assert_array_equal(a, b)


def test_group_rows_take_every_groups_th_slot_of_each_data_shard():
    x = jnp.arange(16)  # 2 data shards of 8 slots, 4 groups
    rows = group_rows(x, 1, groups=4, shards=2)
    np.testing.assert_array_equal(rows, [1, 5, 9, 13])
    back = set_group_rows(x, 1, -rows, groups=4, shards=2)
    np.testing.assert_array_equal(back, np.where(np.isin(x, rows), -x, x))


def test_pipelined_decode_settings_fail_in_one_line():
    mesh = make_mesh("stage=2,data=2,tensor=2")
    assert round_slots(5, mesh, "dp_tp") == 8  # data shards x stages
    with pytest.raises(ValueError, match="pipeline_batches 3 must be 0 or a divisor of the gen"):
        DecodeEngine(MODEL, mesh, "dp_tp", dataclasses.replace(ENGINE, pipeline_batches=3))
    with pytest.raises(ValueError, match="num_slots 6 is not divisible by 2 data shards x 2"):
        DecodeEngine(MODEL, mesh, "dp_tp", dataclasses.replace(ENGINE, num_slots=6))
    three = ModelDef(tiny_config(vocab_size=64, num_layers=3))
    with pytest.raises(ValueError, match="3 layers do not split over 2 pipeline stages"):
        DecodeEngine(three, mesh, "dp_tp", ENGINE)
    with pytest.raises(ValueError, match="pipeline_batches must be >= 0"):
        EngineConfig(pipeline_batches=-1)


def test_recorded_routes_travel_through_the_stages():
    """A mixture of experts recording its routes (DecodeConfig.record_routes): each stage adds
    its layers' experts to the token's as the token passes, and the result equals the
    unpipelined engine's routes, tokens and log-probs."""
    moe = ModelDef(tiny_config(vocab_size=64, num_layers=4, num_experts=4, num_experts_per_tok=2))
    params = jax.jit(moe.init)(jax.random.key(1))
    config = dataclasses.replace(ENGINE, record_routes=True)
    prompts = _prompts(PROMPT_LENS[:6], vocab=64)
    sp = SamplingParams(seed=3, temperature=0.9)
    got = {}
    for mesh_text in ("data=2", "stage=2,data=2"):
        mesh = make_mesh(mesh_text)
        engine = DecodeEngine(moe, mesh, "dp_tp", config)
        got[mesh_text] = engine.generate(
            jax.device_put(params, moe.shardings(mesh, "dp_tp")), prompts, sp
        )
    want, staged = got["data=2"], got["stage=2,data=2"]
    _assert_same(staged, want)
    assert staged.stats["pipeline_stages"] == 2
    for a, b in zip(staged.routes, want.routes):
        np.testing.assert_array_equal(a, b)
    assert len({int(e) for r in want.routes for e in np.ravel(r)}) > 1  # routes that vary


def test_the_trainer_builds_its_engine_on_a_staged_generation_mesh():
    """RoleConfig.generate_mesh takes a stage axis; DecodeConfig.pipeline_batches reaches the
    rollout's engine, whose slots round to data shards x stages."""
    from jrlhf.config import ConfigError, load_config
    from jrlhf.ppo.rollout import engine_config

    cfg = load_config(
        [],
        [
            "actor/RoleConfig.generate_mesh='stage=2,data=4'",
            "DecodeConfig.pipeline_batches=1",
            "RLConfig.prompts_per_iteration=3",
            "RLConfig.samples_per_prompt=1",
            "RLConfig.minibatch_size=3",
        ],
    )
    mesh = make_mesh(cfg.roles["actor"].generate_mesh)
    config = engine_config(cfg, mesh, "dp_tp")
    assert (config.num_slots, config.pipeline_batches) == (8, 1)
    engine = DecodeEngine(MODEL, mesh, "dp_tp", config)
    assert (engine.spec.stages, engine.spec.groups) == (2, 1)
    with pytest.raises(ConfigError, match="DecodeConfig.pipeline_batches: must be >= 0"):
        load_config([], ["DecodeConfig.pipeline_batches=-1"])
