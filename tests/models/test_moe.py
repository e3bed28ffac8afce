"""Mixture-of-experts models (Qwen3-MoE, Mixtral) against transformers' own code, on one device
and on meshes with the experts split; the router losses against NumPy; the presets' counts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from moe_fixtures import VOCAB, moe_checkpoint

from jrlhf.meshes import MeshSpec, make_mesh
from jrlhf.meshes.context import activation_sharding
from jrlhf.models import ModelDef, hf, moe
from jrlhf.models.config import ModelConfig, tiny_config
from jrlhf.models.lora import LoraConfig
from jrlhf.models.moe import EXPERTS, ROUTER_LOGITS, route, router_losses
from jrlhf.models.presets import get_preset
from jrlhf.models.safetensors_io import CheckpointError
from tests.hf_fixtures import torch_logits

KINDS = ("qwen3_moe", "mixtral", "qwen2_moe")
# (mesh, layer loop, expert computation): the experts whole on one device, split 4 ways with
# the tensor axis splitting each expert's width (expert-parallel ragged under shard_map), and
# split 4 ways under FSDP (auto: the dense form)
MESHES = (
    ("fsdp=1", "unroll", "ragged"),
    ("expert=4,tensor=2", "scan", "ragged"),
    ("fsdp=2,expert=4", "unroll", "auto"),
)


@pytest.fixture(scope="module")
def refs():
    """Per family: the checkpoint, test tokens and transformers' fp32 logits."""
    out = {}
    for kind in KINDS:
        path = moe_checkpoint(kind)
        # 8 rows: the expert-parallel form needs rows that the row axes divide
        tokens = np.random.default_rng(0).integers(3, VOCAB, (8, 16))
        out[kind] = (path, tokens, torch_logits(path, tokens))
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_transformers_with_experts_sharded(kind, refs):
    path, tokens, ref = refs[kind]
    assert np.abs(ref).max() > 1.0
    first = None
    for spec, loop, impl in MESHES:
        mesh = make_mesh(MeshSpec.parse(spec))
        model, params = hf.load_hf(path, mesh, "fsdp_tp")
        if "expert" in spec:  # the experts really are split over the expert axis
            gate = params["layers"]["mlp"]["gate_experts"]
            assert gate.sharding.spec[1] == "expert", gate.sharding.spec
        model = ModelDef(model.config.replace(layer_loop=loop, moe_impl=impl), model.head)

        def loss(p, t, model=model, mesh=mesh, spec=spec):
            with activation_sharding(mesh, "fsdp_tp"):
                # rows divide the row axes wherever the experts are split ("ragged" takes it)
                assert (moe.expert_parallel_plan(t.shape[0]) is not None) == ("expert" in spec)
                logits = model.apply(p, t)
                return jnp.mean(logits**2), logits

        (_, out), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params, tokens)
        err = np.abs(np.asarray(out) - ref).max()
        # the backward pass (shard_map's collectives transposed) agrees with one device's
        mlp = jax.device_get(grads["layers"]["mlp"])
        if first is None:
            first = mlp
        for name, g in mlp.items():
            np.testing.assert_allclose(g, first[name], atol=1e-6, rtol=1e-4, err_msg=name)
        assert err < 1e-4, (kind, spec, err)


@pytest.mark.parametrize("kind", KINDS)
def test_export_reloads_in_transformers(kind, refs, tmp_path):
    path, tokens, ref = refs[kind]
    mesh = make_mesh(MeshSpec.parse("fsdp=1"))
    model, params = hf.load_hf(path, mesh, "fsdp_tp")
    out_dir = hf.save_hf(model, params, tmp_path / "export")
    assert np.abs(torch_logits(out_dir, tokens) - ref).max() < 1e-5
    reloaded, params2 = hf.load_hf(out_dir, mesh, "fsdp_tp")
    assert reloaded == model
    np.testing.assert_array_equal(
        np.asarray(params2["layers"]["mlp"]["down_experts"]),
        np.asarray(params["layers"]["mlp"]["down_experts"]),
    )


def test_configs_read_and_routing_normalization(refs):
    q, _ = hf.read_hf_config(refs["qwen3_moe"][0])
    m, _ = hf.read_hf_config(refs["mixtral"][0])
    assert (q.num_experts, q.num_experts_per_tok, q.expert_size, q.norm_topk_prob) == (
        4,
        2,
        24,
        False,
    )
    assert q.qk_norm and not m.qk_norm
    assert (m.num_experts, m.expert_size, m.norm_topk_prob) == (4, 24, True)
    w, _ = hf.read_hf_config(refs["qwen2_moe"][0])
    assert (w.shared_expert_size, w.qkv_bias, w.qk_norm) == (40, True, False)
    for cfg in (q, m, w):  # the counting formulas against the parameter tree
        assert ModelDef(cfg, "lm").num_params() == cfg.num_params(), cfg.architecture
    logits = jnp.asarray([[2.0, 1.0, 0.0, -1.0]])
    w, e = route(logits, 2, normalize=False)
    p = np.exp([2.0, 1.0, 0.0, -1.0]) / np.exp([2.0, 1.0, 0.0, -1.0]).sum()
    np.testing.assert_allclose(np.asarray(w[0]), p[:2], rtol=1e-6)
    assert e.tolist() == [[0, 1]]
    w, _ = route(logits, 2, normalize=True)  # = the softmax over the chosen logits (Mixtral)
    np.testing.assert_allclose(np.asarray(w[0]), p[:2] / p[:2].sum(), rtol=1e-6)


def test_router_losses_against_numpy():
    rng = np.random.default_rng(3)
    L, B, T, X, K = 2, 2, 5, 4, 2
    logits = rng.normal(size=(L, B, T, X)).astype(np.float32)
    experts = np.argsort(-logits, axis=-1)[..., :K]
    mask = np.ones((B, T), bool)
    mask[1, :2] = False  # left padding does not count
    got = {k: float(v) for k, v in router_losses(logits, experts, mask).items()}
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    real = mask[None].repeat(L, 0)
    balance, z, load = [], [], []
    for layer in range(L):
        p, e, m = probs[layer][real[layer]], experts[layer][real[layer]], mask.sum()
        frac = np.bincount(e.reshape(-1), minlength=X) / (m * K)
        balance.append(X * np.sum(frac * p.mean(0)))
        lse = np.log(np.exp(logits[layer][real[layer]]).sum(-1))
        z.append(np.mean(lse**2))
        load.append(frac.max() * X)
    assert got["router_aux_loss"] == pytest.approx(np.mean(balance), rel=1e-5)
    assert got["router_z_loss"] == pytest.approx(np.mean(z), rel=1e-5)
    assert got["moe_max_load"] == pytest.approx(np.mean(load), rel=1e-5)
    # perfectly uniform routing scores 1.0
    flat = np.zeros((1, 1, 4, X), np.float32)
    even = np.array([[[[0, 1], [2, 3], [0, 1], [2, 3]]]])
    assert float(router_losses(flat, even, np.ones((1, 4)))["router_aux_loss"]) == pytest.approx(
        1.0
    )


def test_presets_total_and_active_parameters():
    counts = {
        "qwen3_30b_a3b": (30_532_122_624, 3_353_032_704),
        "qwen3_235b_a22b": (235_093_634_560, 22_190_763_520),
        "mixtral_8x7b": (46_702_792_704, 12_879_925_248),
    }
    for name, (total, active) in counts.items():
        cfg = get_preset(name)
        assert (cfg.num_params(), cfg.num_active_params()) == (total, active), name
        # transformers' config reads back the same (dtypes are the loader's choice)
        back = hf.config_from_hf(hf.config_to_hf(cfg))[0]
        assert back.replace(param_dtype=cfg.param_dtype, dtype=cfg.dtype) == cfg, name


def test_bad_moe_configs_fail_in_one_line(tmp_path):
    bad = [
        (dict(num_experts=4, num_experts_per_tok=5), "num_experts_per_tok"),
        (dict(num_experts=4, num_experts_per_tok=2, moe_impl="loop"), "moe_impl"),
        (dict(num_experts=-1), "num_experts"),
        (dict(router_aux_loss_coef=0.01), "num_experts is 0"),
        (dict(num_experts=4, num_experts_per_tok=2, router_z_loss_coef=-1.0), "router_z_loss"),
        (dict(architecture="mixtral"), "num_experts"),
    ]
    for fields, word in bad:
        with pytest.raises(ValueError) as e:
            tiny_config(**fields)
        assert word in str(e.value) and "\n" not in str(e.value), fields
    hf_cfg = hf.config_to_hf(
        tiny_config(architecture="qwen3_moe", num_experts=4, num_experts_per_tok=2)
    )
    moe_cfg = tiny_config(architecture="qwen3_moe", num_experts=4, num_experts_per_tok=2)
    with pytest.raises(ValueError, match="routed experts"):
        _ = ModelDef(moe_cfg, "lm", lora=LoraConfig(rank=2)).abstract_params
    attention_only = LoraConfig(rank=2, targets=("q", "v"))
    assert (
        "q_lora_a" in ModelDef(moe_cfg, "lm", lora=attention_only).abstract_params["layers"]["attn"]
    )
    hf_cfg["mlp_only_layers"] = [1]
    with pytest.raises(CheckpointError, match="mlp_only_layers"):
        hf.config_from_hf(hf_cfg)


def test_routing_stats_and_router_losses_train(refs):
    """The stats a full pass returns are the router's own, and the router losses have
    gradients into the router (the actor adds them to its loss when their coefficients are
    set)."""
    path, tokens, _ = refs["mixtral"]
    mesh = make_mesh(MeshSpec.parse("fsdp=1"))
    model, params = hf.load_hf(path, mesh, "fsdp_tp")
    stats = jax.jit(lambda p: model.bind(p).hidden(jnp.asarray(tokens), with_stats=True)[1])(params)
    cfg: ModelConfig = model.config
    assert stats[ROUTER_LOGITS].shape == (cfg.num_layers, 8, 16, cfg.num_experts)
    assert stats[EXPERTS].shape == (cfg.num_layers, 8, 16, cfg.num_experts_per_tok)
    top = np.argsort(-np.asarray(stats[ROUTER_LOGITS]), axis=-1)[..., :2]
    np.testing.assert_array_equal(np.sort(top, -1), np.sort(np.asarray(stats[EXPERTS]), -1))

    def aux(p):
        _, s = model.bind(p).hidden(jnp.asarray(tokens), with_stats=True)
        return router_losses(s[ROUTER_LOGITS], s[EXPERTS], jnp.ones((8, 16)))["router_aux_loss"]

    g = jax.jit(jax.grad(aux))(params)["layers"]["mlp"]["router_kernel"]
    assert float(jnp.abs(g).max()) > 0


def test_planner_counts_active_flops_and_total_memory():
    """The cost model's FLOPs follow the parameters a token runs through; its weight memory
    all of them."""
    from jrlhf.placement.workload import head_params, layer_matmul_params, num_params

    cfg = get_preset("qwen3_30b_a3b")
    e, d = cfg.hidden_size, cfg.head_dim
    norms = 2 * e + 2 * d
    matmul = cfg.num_layers * layer_matmul_params(cfg) + head_params(cfg, "lm")
    assert matmul == cfg.num_active_params() - cfg.vocab_size * e - cfg.num_layers * norms - e
    assert num_params(cfg, "lm") == cfg.num_params()
    # expert parallelism: each device's tokens gathered over 4 expert shards (3/4 of the group's
    # 4 x 100 bytes arrive) and the outputs reduce-scattered back: 2 x 300 bytes a layer
    from jrlhf.placement.estimator import moe_dispatch_bytes

    assert moe_dispatch_bytes(cfg, 100.0, 4) == 600.0
    assert moe_dispatch_bytes(cfg, 100.0, 1) == 0.0
    assert moe_dispatch_bytes(get_preset("qwen3_8b"), 100.0, 4) == 0.0


def test_record_routes_with_a_dense_actor_is_refused_by_the_check(capsys, monkeypatch):
    from pathlib import Path

    from jrlhf import train

    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    args = ["--check", "--config", "configs/grpo_tiny.gin", "DecodeConfig.record_routes=True"]
    assert train.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "DecodeConfig.record_routes" in err and "\n" not in err
    moe_actor = (
        "actor/RoleConfig.model_overrides=(('architecture','qwen3_moe'),('num_experts',4),"
        "('num_experts_per_tok',2))"
    )
    assert train.main([*args, moe_actor]) == 0
