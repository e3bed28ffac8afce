"""Mixture-of-experts models in the paged decode engine: greedy generation equal to transformers'
after resharding the experts from the training layout, the rollout's recorded routes against
the training pass's, and the resharder's round trip of expert weights."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from moe_fixtures import VOCAB, moe_checkpoint

from jrlhf.decode import DecodeEngine, EngineConfig, SamplingParams
from jrlhf.meshes import MeshSpec, make_mesh
from jrlhf.models import ModelDef, hf
from jrlhf.models.logprobs import token_logprobs
from jrlhf.models.moe import EXPERTS, rollout_routing_metrics, routing_mismatch
from jrlhf.ppo.batch import pack, response_routes
from jrlhf.ppo.rollout import padded_routes
from jrlhf.reshard import Resharder
from jrlhf.reshard import layout as reshard_layout

ENGINE = EngineConfig(num_slots=4, page_size=4, max_prompt_len=16, max_new_tokens=6, chunk_steps=3)
RECORDING = EngineConfig(**{**ENGINE.__dict__, "record_routes": True})
PROMPT_LENS = (3, 11, 5, 8, 13)  # 5 prompts > 4 slots: a slot is refilled


def _prompts(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, VOCAB, size=n).tolist() for n in PROMPT_LENS]


def _hf_greedy(kind, prompts, max_new):
    import torch
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(moe_checkpoint(kind), dtype=torch.float32)
    out = []
    with torch.no_grad():
        for p in prompts:
            g = model.eval().generate(
                torch.tensor([p]), do_sample=False, max_new_tokens=max_new, pad_token_id=0
            )
            out.append(g[0, len(p) :].tolist())
    return out


def test_greedy_equals_transformers_after_resharding_experts():
    """Mixtral trained with the experts split 4 ways under FSDP, generated with them replicated
    and each expert's width split over tensor; moved both ways by the resharder, bytes
    counted."""
    kind = "mixtral"
    train_mesh = make_mesh(MeshSpec.parse("fsdp=2,expert=4"))
    gen_mesh = make_mesh(MeshSpec.parse("data=4,tensor=2"))
    model, params = hf.load_hf(moe_checkpoint(kind), train_mesh, "fsdp_tp")
    train_sh = model.shardings(train_mesh, "fsdp_tp")
    gen_sh = model.shardings(gen_mesh, "dp_tp_experts_replicated")
    assert train_sh["layers"]["mlp"]["gate_experts"].spec[1] == "expert"
    assert gen_sh["layers"]["mlp"]["gate_experts"].spec[:3] == (None, None, None)
    reference = jax.device_get(params)
    resharder = Resharder()
    gen_params = resharder(params, gen_sh)
    moved = resharder.transitions[0].bytes_moved
    assert moved == reshard_layout.bytes_moved(
        jax.tree.leaves(train_sh), jax.tree.leaves(gen_sh), jax.tree.leaves(model.abstract_params)
    )
    # each device held an eighth of every expert weight (experts / 4 x embed / 2) and needs
    # half of it (width / 2), of which it held a sixteenth: 8 x 7/16 of the weight moves
    names = ("gate_experts", "up_experts", "down_experts")
    mlp_train, mlp_gen, mlp = (
        train_sh["layers"]["mlp"],
        gen_sh["layers"]["mlp"],
        params["layers"]["mlp"],
    )
    experts = sum(reshard_layout.bytes_moved(mlp_train[w], mlp_gen[w], mlp[w]) for w in names)
    assert experts == sum(mlp[w].nbytes for w in names) * 8 * 7 // 16 and experts < moved
    engine = DecodeEngine(model, gen_mesh, "dp_tp_experts_replicated", ENGINE)
    prompts = _prompts()
    got = engine.generate(gen_params, prompts, SamplingParams(greedy=True, stop_ids=(2,)))
    assert got.completion_ids == _hf_greedy(kind, prompts, ENGINE.max_new_tokens)
    back = resharder(gen_params, train_sh)
    for a, b in zip(jax.tree.leaves(reference), jax.tree.leaves(jax.device_get(back))):
        np.testing.assert_array_equal(a, b)


def _train_pass(model, params, prompts, completions):
    """The trainer's view of the rollout: one right-padded pass over prompt + completion; per
    completion its tokens' log-probs and the experts chosen at the columns that predict them."""
    total = max(len(p) + len(c) for p, c in zip(prompts, completions))
    n = len(completions)
    tokens = np.zeros((n, total), np.int32)
    segments = np.zeros((n, total), np.int32)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        tokens[i, : len(p) + len(c)] = p + c
        segments[i, : len(p) + len(c)] = 1
    positions = np.broadcast_to(np.arange(total, dtype=np.int32), (n, total))

    def run(params):
        module = model.bind(params)
        hidden, stats = module.hidden(tokens, positions, segments, with_stats=True)
        return token_logprobs(module.logits(hidden)[:, :-1], tokens[:, 1:]), stats[EXPERTS]

    lp, experts = jax.device_get(jax.jit(run)(params))
    cols = [slice(len(p) - 1, len(p) - 1 + len(c)) for p, c in zip(prompts, completions)]
    return (
        [lp[i, col] for i, col in enumerate(cols)],
        [np.transpose(experts[:, i, col], (1, 0, 2)) for i, col in enumerate(cols)],
    )


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2_moe"])
def test_greedy_equals_transformers_with_routes_recorded(kind):
    """Qwen3-MoE and Qwen2-MoE (its shared expert) on one device, recording routes:
    transformers' greedy tokens, and the rollout's routes and log-probs are the training
    pass's (float32)."""
    mesh = make_mesh(MeshSpec.parse("fsdp=1"))
    model, params = hf.load_hf(moe_checkpoint(kind), mesh, "dp_tp")
    prompts = _prompts()
    engine = DecodeEngine(model, mesh, "dp_tp", RECORDING)
    got = engine.generate(params, prompts, SamplingParams(greedy=True, stop_ids=(2,)))
    assert got.completion_ids == _hf_greedy(kind, prompts, ENGINE.max_new_tokens)
    cfg = model.config
    assert [r.shape for r in got.routes] == [
        (len(c), cfg.num_layers, cfg.num_experts_per_tok) for c in got.completion_ids
    ]
    lps, train_routes = _train_pass(model, params, prompts, got.completion_ids)
    mismatch = routing_mismatch(np.concatenate(got.routes), np.concatenate(train_routes))
    assert mismatch == {"layer_mismatch": 0.0, "token_mismatch": 0.0}
    assert np.abs(np.concatenate(got.raw_logprobs) - np.concatenate(lps)).max() < 1e-4
    # the trainer's probe (DecodeConfig.record_routes) on the padded batch layout agrees
    R = ENGINE.max_new_tokens
    batch = pack(prompts, got.completion_ids, ENGINE.max_prompt_len, R)
    probe = jax.jit(lambda p, b: response_routes(model.bind(p), b, ENGINE.max_prompt_len))
    out = np.asarray(
        probe(
            params, {k: batch[k] for k in ("tokens", "positions", "segment_ids", "response_tokens")}
        )
    )
    routes = padded_routes(got.routes, R)
    assert out.shape == (len(prompts), R, 1 + cfg.num_layers * cfg.num_experts_per_tok)
    train = out[..., 1:].astype(np.int32).reshape(routes.shape)
    rollout_lp = np.zeros((len(prompts), R), np.float32)
    for i, lp in enumerate(got.raw_logprobs):
        rollout_lp[i, : len(lp)] = lp
    metrics = rollout_routing_metrics(routes, train, rollout_lp, out[..., 0], batch["mask"])
    assert metrics["moe/layer_mismatch"] == metrics["moe/token_mismatch"] == 0.0
    assert metrics["moe/logprob_gap"] < 1e-5 and "moe/logprob_gap_rerouted" not in metrics
    with pytest.raises(ValueError, match="mixture-of-experts"):
        dense = cfg.replace(
            num_experts=0, num_experts_per_tok=0, shared_expert_size=0, architecture="qwen3"
        )
        DecodeEngine(ModelDef(dense, "lm"), mesh, "dp_tp", RECORDING)


def test_rollout_routing_metrics_against_numpy():
    rng = np.random.default_rng(0)
    rollout = rng.integers(0, 4, (3, 5, 2, 2))
    train = rollout.copy()
    train[0, 1, 1] = [7, 8]  # row 0 token 1: layer 1 differs
    train[2, 4, 0] = [7, 8]  # past row 2's end: not counted
    mask = np.ones((3, 5))
    mask[2, 3:] = 0
    lp_a, lp_b = rng.normal(size=(3, 5)), rng.normal(size=(3, 5))
    got = rollout_routing_metrics(rollout, train, lp_a, lp_b, mask)
    gap = np.abs(lp_a - lp_b)
    real = mask > 0
    assert got["moe/token_mismatch"] == pytest.approx(1 / real.sum())
    assert got["moe/layer_mismatch"] == pytest.approx(1 / (2 * real.sum()))
    assert got["moe/logprob_gap"] == pytest.approx(gap[real].mean())
    assert got["moe/logprob_gap_rerouted"] == pytest.approx(gap[0, 1])
    same = real.copy()
    same[0, 1] = False
    assert got["moe/logprob_gap_same_routes"] == pytest.approx(gap[same].mean())
    routes = padded_routes([np.ones((2, 2, 2)), np.ones((0, 2, 2))], 3)
    assert routes.shape == (2, 3, 2, 2) and (routes[0, 2] == -1).all() and (routes[1] == -1).all()


def test_routing_mismatch_counts_sets_not_order():
    a = np.array([[[0, 1], [2, 3]], [[1, 2], [0, 3]]])
    b = np.array([[[1, 0], [2, 3]], [[1, 3], [0, 3]]])  # token 0 reordered; token 1 layer 0 differs
    assert routing_mismatch(a, b) == {"layer_mismatch": 0.25, "token_mismatch": 0.5}
    with pytest.raises(ValueError, match="do not pair up"):
        routing_mismatch(a, b[:1])
