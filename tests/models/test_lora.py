"""LoRA (jrlhf.models.lora): fresh adapters compute the base model exactly; a step trains only
the adapters (and a value head); optimizer state shrinks by the factor the shapes say; adapters
checkpoint on their own, resume, and merge on export to HF; the planner counts their memory;
a LoRA GRPO run raises held-out exact match."""

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hf_fixtures import VOCAB, hf_checkpoint, torch_logits

from jrlhf import checkpoint
from jrlhf.config import ConfigError, load_config
from jrlhf.meshes import make_mesh
from jrlhf.models import ModelDef, tiny_config
from jrlhf.models import lora as lora_lib
from jrlhf.models.hf import load_hf, save_hf
from jrlhf.models.lora import LoraConfig
from jrlhf.ppo.core_algos import sft_loss
from jrlhf.runtime.steps import OptimizerConfig, init_train_state, make_optimizer, make_train_step

ADAM = make_optimizer(OptimizerConfig(learning_rate=1e-2, grad_clip=0.0))


def lm_loss(module, batch):
    logits = module(batch["tokens"], batch["positions"], batch["segment_ids"])
    loss, metrics = sft_loss(logits, batch["targets"], batch["loss_mask"])
    return loss, dict(metrics, weight=batch["loss_mask"].sum())


def value_loss(module, batch):
    values = module(batch["tokens"], batch["positions"], batch["segment_ids"])
    loss = jnp.mean((values - 1.0) ** 2 * batch["loss_mask"])
    return loss, {"weight": batch["loss_mask"].sum()}


def make_batch(seed=0, b=8, t=12, vocab=256):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (b, t)).astype(np.int32)
    return {
        "tokens": tokens,
        "positions": np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy(),
        "segment_ids": np.ones((b, t), np.int32),
        "targets": np.roll(tokens, -1, axis=1),
        "loss_mask": np.ones((b, t), np.float32),
    }


def flat(tree):
    return {
        "/".join(str(getattr(k, "key", k)) for k in path): np.asarray(v)
        for path, v in jax.tree_util.tree_leaves_with_path(tree)
    }


LORA = LoraConfig(rank=4, alpha=8.0)


@pytest.mark.parametrize("mesh_spec", ["fsdp=1", "fsdp=2,tensor=2"])
def test_fresh_adapters_give_the_base_models_logits_exactly(mesh_spec):
    cfg = tiny_config()
    base, lora = ModelDef(cfg), ModelDef(cfg, lora=LORA)
    mesh = make_mesh(mesh_spec)
    params = base.init_sharded(mesh, "fsdp_tp", seed=3)
    full = checkpoint.load_source_weights(lora, None, mesh, "fsdp_tp", 3)
    # a random LoRA model's base is the plain model of its seed; A random, B zero
    for k, v in flat(lora_lib.frozen(full)).items():
        np.testing.assert_array_equal(v, flat(params)[k], err_msg=k)
    a = full["layers"]["attn"]["q_lora_a"]
    assert float(jnp.abs(a).max()) > 0 and not np.any(
        np.asarray(full["layers"]["mlp"]["up_lora_b"])
    )
    assert a.shape == (cfg.num_layers, cfg.hidden_size, LORA.rank)
    tokens = make_batch()["tokens"]
    want = jax.jit(base.apply)(params, tokens)
    got = jax.jit(lora.apply)(full, tokens)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # the adapters' logical axes: A (kernel input..., lora_rank), B (lora_rank, kernel output...)
    axes = lora.logical_axes["layers"]
    assert axes["attn"]["q_lora_a"] == ("layers", "embed", "lora_rank")
    assert axes["attn"]["q_lora_b"] == ("layers", "lora_rank", "heads", "head_dim")
    assert axes["attn"]["o_lora_a"] == ("layers", "heads", "head_dim", "lora_rank")
    assert axes["mlp"]["down_lora_b"] == ("layers", "lora_rank", "embed")
    spec = lora.shardings(mesh, "fsdp_tp")["layers"]["attn"]["q_lora_b"].spec
    assert tuple(spec)[:3] == (None, None, "tensor" if "tensor" in mesh_spec else None)


def _trained(model, loss, seed=0, steps=2):
    mesh = make_mesh("fsdp=2,tensor=2")
    state = init_train_state(model, ADAM, mesh, "fsdp_tp", seed=seed)
    before = flat(state.params)
    step = make_train_step(model, ADAM, loss, mesh, "fsdp_tp")
    for i in range(steps):
        state, metrics = step(state, make_batch(i))
    assert float(metrics["skipped"]) == 0.0
    return before, flat(state.params), state


@pytest.mark.parametrize("head,loop", [("value", "auto"), ("lm", "scan")])
def test_a_step_changes_only_the_adapters_and_value_head(head, loop):
    # "scan": the layers under lax.scan with full remat, adapter dropout drawing per layer
    if loop == "scan":
        cfg = tiny_config(layer_loop="scan", remat_policy="full")
        model = ModelDef(cfg, head=head, lora=dataclasses.replace(LORA, dropout=0.1))
    else:
        model = ModelDef(tiny_config(), head=head, lora=LORA)
    before, after, _ = _trained(model, lm_loss if head == "lm" else value_loss)
    changed = {k for k in before if not np.array_equal(before[k], after[k])}
    trainable = {k for k in before if lora_lib.is_trainable(tuple(k.split("/")))}
    # A changes once B is nonzero (after the first step); every B and the value head change
    assert {k for k in trainable if k.endswith("_lora_b") or k == "value_head"} <= changed
    assert changed <= trainable
    for k in set(before) - trainable:  # the frozen base: bit for bit
        np.testing.assert_array_equal(after[k], before[k], err_msg=k)
    assert ("value_head" in trainable) == (head == "value")


def test_optimizer_state_shrinks_by_the_factor_of_the_shapes():
    cfg = tiny_config()
    full, lora = ModelDef(cfg), ModelDef(cfg, lora=LORA)

    def moment_bytes(model):
        state = jax.eval_shape(optax.adamw(1e-3).init, model.trainable(model.abstract_params))
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state) if x.ndim >= 1)

    # the arithmetic: each adapted (in, out) kernel of each layer has r * (in + out) adapter
    # entries; AdamW keeps two moments per trained entry
    e, f, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    h, k = cfg.num_heads * d, cfg.num_kv_heads * d
    shapes = [(e, h), (e, k), (e, k), (h, e), (e, f), (e, f), (f, e)]
    adapter = cfg.num_layers * LORA.rank * sum(i + o for i, o in shapes)
    assert adapter == lora_lib.num_adapter_params(cfg, LORA)
    factor = full.num_params() / adapter
    assert moment_bytes(full) == 2 * 4 * full.num_params()
    assert moment_bytes(lora) * factor == pytest.approx(moment_bytes(full), rel=1e-12)
    # and the real train state agrees with the abstract one
    state = init_train_state(lora, ADAM, make_mesh("fsdp=2"), "fsdp_tp")
    real = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state.opt_state) if x.ndim)
    assert real == moment_bytes(lora)


def test_adapters_checkpoint_alone_and_restore(tmp_path):
    model = ModelDef(tiny_config(), lora=LORA)
    _, after, state = _trained(model, lm_loss, seed=5)
    mesh, rules = make_mesh("fsdp=2,tensor=2"), "fsdp_tp"
    manager = checkpoint.trainer_checkpoint_manager(tmp_path, max_to_keep=1, async_save=False)
    bases = {"actor": {"weights": None, "seed": 5}}
    checkpoint.save_trainer_state(
        manager, 2, {"iteration": 2}, {"actor": state}, {"actor": model}, bases
    )
    manager.wait_until_finished()
    # The params item holds the adapters only: about their bytes, far from the model's.
    item = next(tmp_path.glob("checkpoints/2/actor_params"))
    stored = sum(p.stat().st_size for p in item.rglob("*") if p.is_file())
    adapter_bytes = lora_lib.count(model.trainable(model.abstract_params))[1]
    assert stored < 0.5 * model.num_params() * 4 and stored > 0.5 * adapter_bytes
    # Restore into a fresh state built from the same source (its base), as a resume does.
    fresh = init_train_state(model, ADAM, mesh, rules, seed=5)
    from jrlhf.runtime.steps import state_shardings

    target = checkpoint.restore_target(fresh, state_shardings(model, ADAM, mesh, rules))
    target = target.replace(params=model.trainable(target.params))
    meta, states = checkpoint.restore_trainer_state(manager, {"actor": target})
    assert meta["models"]["actor"]["lora"]["rank"] == LORA.rank
    restored = model.with_trainable(fresh.params, states["actor"].params)
    for k, v in flat(restored).items():
        np.testing.assert_array_equal(v, after[k], err_msg=k)
    assert int(states["actor"].step) == 2
    # load_model (evaluate, generate, convert) gives the plain model with the adapters merged
    loaded_model, merged = checkpoint.load_model(tmp_path, make_mesh("fsdp=1"), rules)
    assert loaded_model == model.base
    tokens = make_batch()["tokens"]
    np.testing.assert_allclose(
        np.asarray(jax.jit(model.base.apply)(merged, tokens)),
        np.asarray(jax.jit(model.apply)(restored, tokens)),
        atol=1e-5,
    )


@pytest.mark.parametrize("kind", ["llama3", "qwen3", "gemma3"])
def test_export_to_hf_merges_and_transformers_agrees(kind, tmp_path):
    src = hf_checkpoint(kind)
    mesh = make_mesh("fsdp=2")
    base_model, _ = load_hf(src, mesh, "fsdp_tp")
    model = ModelDef(base_model.config, lora=LORA)
    params = checkpoint.load_source_weights(model, f"hf:{src}", mesh, "fsdp_tp", 0)
    # adapters as training leaves them: B nonzero
    noisy = jax.tree.map(
        lambda x: x + 0.05 * jax.random.normal(jax.random.key(1), x.shape, x.dtype),
        lora_lib.adapters_only(params),
    )
    params = lora_lib.combine(params, noisy)
    out = save_hf(model, params, tmp_path / "hf")
    tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 16))
    ours = np.asarray(jax.jit(model.apply)(params, tokens))
    base = np.asarray(jax.jit(base_model.apply)(lora_lib.frozen(params), tokens))
    assert np.abs(ours - base).max() > 1e-3  # the adapters do change the logits
    np.testing.assert_allclose(torch_logits(out, tokens), ours, atol=1e-4)
    assert json.loads((out / "config.json").read_text())["architectures"]


def test_lora_settings_are_validated_in_one_line():
    base = ["RunConfig.stages=('ppo',)"]
    cfg = load_config(
        [], [*base, "actor/RoleConfig.lora_rank=8", "actor/RoleConfig.lora_targets=('q', 'v')"]
    )
    lora = cfg.roles["actor"].lora()
    assert lora == LoraConfig(8, 16.0, ("q", "v"), 0.0) and cfg.roles["critic"].lora() is None
    bad = {
        "actor/RoleConfig.lora_rank=-1": "actor/RoleConfig.lora_rank: must be >= 0",
        "actor/RoleConfig.lora_alpha=0.0": "actor/RoleConfig.lora_alpha:",
        "actor/RoleConfig.lora_targets=('q', 'qq')": "actor/RoleConfig.lora_targets:",
        "actor/RoleConfig.lora_dropout=1.0": "actor/RoleConfig.lora_dropout:",
        "reference/RoleConfig.lora_rank=4": "only the trained roles",
    }
    for binding, message in bad.items():
        extra = [] if "lora_rank" in binding else ["actor/RoleConfig.lora_rank=4"]
        with pytest.raises(ConfigError, match=message) as e:
            load_config([], [*base, *extra, binding])
        assert "\n" not in str(e.value)


def test_dropout_only_in_train_steps_and_repeatable():
    cfg = tiny_config()
    model = ModelDef(cfg, lora=LoraConfig(rank=4, dropout=0.5))
    mesh = make_mesh("fsdp=1")
    p = init_train_state(model, ADAM, mesh, "fsdp_tp", seed=1).params
    # B nonzero, so dropout on the adapters' input shows in the output
    p = lora_lib.combine(p, jax.tree.map(lambda x: x + 0.1, lora_lib.adapters_only(p)))
    tokens = make_batch()["tokens"]
    plain = np.asarray(jax.jit(model.apply)(p, tokens))

    @jax.jit
    def dropped(params, key):
        with lora_lib.dropout_key(key):
            return model.apply(params, tokens)

    a, b = dropped(p, jax.random.key(0)), dropped(p, jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert np.abs(np.asarray(a) - plain).max() > 1e-4
    assert np.abs(np.asarray(dropped(p, jax.random.key(1))) - np.asarray(a)).max() > 1e-4


def test_planner_counts_lora_memory():
    from jrlhf.meshes.mesh import MeshSpec
    from jrlhf.placement import estimator as est
    from jrlhf.placement.plan import CallPlacement

    cfg = tiny_config(vocab_size=512, hidden_size=128, intermediate_size=256)
    p = CallPlacement(MeshSpec.parse("fsdp=2,tensor=2"), "fsdp_tp")
    full = est.trained_bytes(cfg, "lm", p, None)
    lora = est.trained_bytes(cfg, "lm", p, LORA)
    adapters = est.lora_shard_bytes(cfg, "lm", p, LORA, "adapters")
    assert lora == adapters  # an LM head model trains its adapters only
    total = lora_lib.num_adapter_params(cfg, LORA) * 4
    # spread over the devices, not above one copy of the adapters nor below a quarter
    assert total / 4 <= adapters <= total
    assert est._moment_bytes(cfg, "lm", p, LORA) == 2 * adapters
    assert est._moment_bytes(cfg, "lm", p) == 2 * full
    assert full / lora > 5
    assert math.isclose(
        est.held_bytes(cfg, "lm", p, LORA) - est.shard_bytes(cfg, "lm", p), adapters
    )


# -- end to end: a LoRA GRPO run on the arithmetic task ------------------------------------------
# One device (the subprocesses' XLA_FLAGS): the tiny model's steps are dominated by per-step
# overheads, which eight fake devices on two cores double.
def test_lora_grpo_raises_heldout_exact_match(base_run, tmp_path):
    """GRPO trains rank-8 adapters on the shared SFT policy (right about 15% of the time on the
    synthetic task), its base frozen: held-out exact match (the same prompts before and after)
    must rise by 10 points (measured: 0.15 -> 0.42). An untrained adapter (learning rate 1e-9)
    leaves it where it was (measured: 0.15 -> 0.15), so the margin is GRPO's doing."""
    from run_helpers import SMALL

    from jrlhf.cli import train

    rl = tmp_path / "grpo_run"
    bindings = [
        "RunConfig.stages=('grpo',)", f"actor/RoleConfig.init='ckpt:{base_run}/sft'",
        f"reference/RoleConfig.init='ckpt:{base_run}/sft'", "actor/RoleConfig.lora_rank=8",
        "actor/RoleConfig.lora_alpha=16.0", "actor/RoleConfig.learning_rate=3e-3",
        "TaskConfig.reward_fn='synthetic_ground_truth'", "RLConfig.iterations=12",
        "RLConfig.samples_per_prompt=4", "RLConfig.kl_coef=0.01", "RLConfig.kl_estimator='k3'",
        "RLConfig.checkpoint_every=12", *SMALL,
    ]  # fmt: skip
    assert train.main(["--run-dir", str(rl), "--quiet", *bindings]) == 0
    summary = json.loads((rl / "summary.json").read_text())
    before, after = summary["before"]["gt_score"], summary["after"]["gt_score"]
    assert 0.05 < before < 0.5, summary  # a policy with headroom, and signal for GRPO
    assert after >= before + 0.1, summary
    # The run trained adapters: its checkpoint holds them (and no base kernel).
    meta = checkpoint.read_trainer_meta(rl)
    assert meta["models"]["actor"]["lora"]["rank"] == 8
    assert meta["models"]["actor"]["base"]["weights"] == f"ckpt:{base_run}/sft"


# -- PPO: actor and critic LoRA; placements, the generation copy's offload, kill and resume -----
LORA_PPO = [
    "actor/RoleConfig.lora_rank=4", "actor/RoleConfig.learning_rate=1e-3",
    "critic/RoleConfig.lora_rank=4", "critic/RoleConfig.lora_targets=('q', 'v', 'down')",
    "critic/RoleConfig.learning_rate=1e-3",
]  # fmt: skip


def test_lora_ppo_resumes_exactly_on_a_separated_plan(base_run, tmp_path, monkeypatch):
    """PPO with LoRA actor and critic (the critic's value head trains too), co-located (flatten)
    against separated generation with the generation copy dropped between iterations and the
    run killed in iteration 3 and resumed from its adapters-only checkpoint: the same metrics.
    The weight channel sends merged weights: as many bytes as a full fine-tune's."""
    from run_helpers import Preempted, assert_rows_close, metric_rows, ppo_bindings, preempt_at

    from jrlhf.cli import train

    flat_dir = tmp_path / "flatten"
    bindings = ppo_bindings(base_run, *LORA_PPO)
    assert train.main(["--run-dir", str(flat_dir), "--quiet", *bindings]) == 0
    rows = metric_rows(flat_dir)
    assert len([r for r in rows if "reward" in r]) == 4
    meta = checkpoint.read_trainer_meta(flat_dir)
    assert meta["models"]["critic"]["lora"]["targets"] == ["q", "v", "down"]
    # the critic's trained part (adapters and value head) changed from the reward model's
    mesh = make_mesh("fsdp=1")
    critic_model, critic = checkpoint.load_model(flat_dir, mesh, "fsdp_tp", role="critic")
    _, rm = checkpoint.load_model(base_run / "rm", mesh, "fsdp_tp")
    assert critic_model.lora is None  # loaded merged
    assert not np.allclose(np.asarray(critic["value_head"]), np.asarray(rm["value_head"]))
    assert not np.allclose(
        np.asarray(critic["layers"]["mlp"]["down_kernel"]),
        np.asarray(rm["layers"]["mlp"]["down_kernel"]),
    )
    np.testing.assert_array_equal(  # not adapted: the reward model's
        np.asarray(critic["layers"]["mlp"]["up_kernel"]),
        np.asarray(rm["layers"]["mlp"]["up_kernel"]),
    )

    sep_dir = tmp_path / "separate"
    args = [
        "--run-dir", str(sep_dir), "--quiet", *bindings, "RunConfig.placement='separate'",
        "Memory.generation_copy='dropped'",
    ]  # fmt: skip
    # Killed in its fourth iteration (index 3), in this process: the preemption hook raises
    # instead of exiting, and nothing after it runs (the hard exit: tests/e2e/test_trainer.py).
    preempt_at(monkeypatch, 3)
    with pytest.raises(Preempted):
        train.main([*args, "RLConfig.async_checkpoint=False"])
    monkeypatch.undo()
    assert checkpoint.latest_step_dir(sep_dir).name == "2"
    assert train.main([*args, "--resume"]) == 0
    assert_rows_close(metric_rows(sep_dir), rows)
    # merged weights cross to the generation mesh: the plain model's bytes, every iteration
    synced = [
        json.loads(line)["reshard/bytes"]
        for line in (sep_dir / "logs" / "ppo" / "metrics.jsonl").read_text().splitlines()
        if "reshard/bytes" in line
    ]
    actor = ModelDef(critic_model.config)  # the same tiny shape as the actor, with an LM head
    assert synced and all(s > 0.5 * actor.num_params() * 4 for s in synced)


def test_lora_with_generation_on_processes_of_its_own_forms_groups(monkeypatch):
    """The weight channel merges on the training mesh before sending: with generation on
    processes of its own, the merge runs on the training group's devices (the generating
    processes hold no shard of it) and the merged kernels cross; the groups form as without
    LoRA (the run itself: tests/e2e/test_multiprocess.py, GRPO with a LoRA actor on 2+2
    processes, equal to one process)."""
    import types

    import gin

    from jrlhf.config import Asynchrony, RLConfig
    from jrlhf.ppo.groups import role_groups

    gin.clear_config()  # RLConfig reads gin: no binding left by an earlier test's run applies

    def mesh(*processes):
        return types.SimpleNamespace(
            devices=np.array([types.SimpleNamespace(process_index=p) for p in processes])
        )

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    roles = {
        "actor": types.SimpleNamespace(
            model=ModelDef(tiny_config(), lora=LORA), meshes={"generate": mesh(0), "train": mesh(1)}
        )
    }
    groups = role_groups(RLConfig(asynchrony=Asynchrony(max_staleness=1)), roles)
    assert groups.generate == {0} and groups.train == {1}


def test_the_plan_prices_lora_adapters_moments_and_the_merged_generation_copy():
    """A workload read from a config with LoRA roles: the residents of every device count the
    adapters beside the base, AdamW moments of the adapters (and the critic's value head) only,
    and a generation copy even where the layouts agree (the merged weights are a copy)."""
    from jrlhf.placement import estimator as est
    from jrlhf.placement.plan import flatten
    from jrlhf.placement.profile import DeviceProfile
    from jrlhf.placement.workload import Workload

    model = tiny_config(vocab_size=512, hidden_size=128, intermediate_size=256)
    models = {r: model for r in ("actor", "critic", "reference", "reward")}
    plain = Workload.from_config(load_config([], ["RunConfig.stages=('ppo',)"]), models)
    cfg = load_config([], ["RunConfig.stages=('ppo',)", *LORA_PPO])
    lora = Workload.from_config(cfg, models)
    assert lora.actor_lora == cfg.roles["actor"].lora() and lora.critic_lora.targets == (
        "q",
        "v",
        "down",
    )
    plan, profile = flatten(1), DeviceProfile.load("cpu")
    full_parts = est._resident(plain, plan, profile, "train")[0]
    lora_parts = est._resident(lora, plan, profile, "train")[0]
    adapters = lora_lib.num_adapter_params(model, lora.actor_lora) * 4
    assert lora_parts["actor params"] == full_parts["actor params"] + adapters
    assert lora_parts["actor adam"] == 2 * adapters
    critic_trained = lora_lib.num_adapter_params(model, lora.critic_lora) + model.hidden_size
    assert lora_parts["critic adam"] == 2 * 4 * critic_trained
    assert full_parts["actor adam"] == 2 * full_parts["actor params"]
    # one device: training and generation share a layout, the full actor's copy aliases
    assert full_parts["actor generation copy"] == 0
    assert lora_parts["actor generation copy"] == est.shard_bytes(
        model, "lm", plan["actor_generate"]
    )
    # and the train step's working memory holds the adapters' gradients, not the model's
    w_full = est._working_bytes(plain, "actor_train", plan["actor_train"], profile)
    w_lora = est._working_bytes(lora, "actor_train", plan["actor_train"], profile)
    assert w_full - w_lora == pytest.approx(full_parts["actor params"] - adapters)


def test_lora_sft_killed_mid_stage_resumes_and_writes_a_merged_model(
    base_run, tmp_path, monkeypatch
):
    """An SFT stage with LoRA from base_run's SFT output: killed after step 15 (checkpointed
    at 10, adapters only), resumed, it writes the uninterrupted stage's numbers and a plain
    model checkpoint (the adapters merged), which differs from its start in the adapted kernels
    only."""
    from run_helpers import SMALL, Preempted, assert_rows_close, metric_rows, preempt_at_step

    from jrlhf.cli import train

    start = base_run / "sft"
    common = [
        "--quiet", "RunConfig.stages=('sft',)", "SFTConfig.steps=20",
        "SFTConfig.checkpoint_every=10", f"actor/RoleConfig.init='ckpt:{start}'",
        "actor/RoleConfig.lora_rank=4", "actor/RoleConfig.lora_targets=('q', 'o', 'up')", *SMALL,
    ]  # fmt: skip
    whole = tmp_path / "whole"
    assert train.main(["--run-dir", str(whole), *common]) == 0
    run_dir = tmp_path / "killed"
    args = ["--run-dir", str(run_dir), *common]
    preempt_at_step(monkeypatch, "sft:15")  # in this process (the hook raises)
    with pytest.raises(Preempted):
        train.main(args)
    monkeypatch.undo()
    assert train.main([*args, "--resume"]) == 0
    drop = {"sft/steps_per_s"}
    assert_rows_close(
        [{k: v for k, v in r.items() if k not in drop} for r in metric_rows(run_dir, "sft")],
        [{k: v for k, v in r.items() if k not in drop} for r in metric_rows(whole, "sft")],
    )
    mesh = make_mesh("fsdp=1")
    model, out = checkpoint.load_model(run_dir / "sft", mesh, "fsdp_tp")
    assert model.lora is None
    _, before = checkpoint.load_model(start, mesh, "fsdp_tp")
    _, whole_out = checkpoint.load_model(whole / "sft", mesh, "fsdp_tp")
    changed = {k for k, v in flat(out).items() if not np.array_equal(v, flat(before)[k])}
    assert changed == {"layers/attn/q_kernel", "layers/attn/o_kernel", "layers/mlp/up_kernel"}
    for k, v in flat(out).items():
        np.testing.assert_allclose(v, flat(whole_out)[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_the_train_step_forms_neither_base_gradients_nor_merged_kernels():
    """The LoRA gradient's program multiplies no matrix whose result has a frozen kernel's shape:
    the low-rank path runs as (x @ A) @ B beside x @ W (no W + A @ B), and no frozen weight gets
    a gradient (the LM head's (embed, vocab) included)."""
    cfg = tiny_config()
    model = ModelDef(cfg, lora=LORA)
    params = model.init(jax.random.key(0))
    batch = {k: jnp.asarray(v) for k, v in make_batch().items()}

    def loss(trainable):
        return lm_loss(model.bind(model.with_trainable(params, trainable)), batch)[0]

    def dot_shapes(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                yield tuple(eqn.outvars[0].aval.shape)
            for sub in jax.core.subjaxprs(eqn) if hasattr(jax.core, "subjaxprs") else ():
                yield from dot_shapes(sub)
            for p in eqn.params.values():
                inner = getattr(p, "jaxpr", p)
                if hasattr(inner, "eqns"):
                    yield from dot_shapes(inner)

    shapes = set(dot_shapes(jax.make_jaxpr(jax.grad(loss))(model.trainable(params)).jaxpr))
    assert shapes  # the walk found the products
    frozen_shapes = set()
    for path, leaf in flat(lora_lib.frozen(params)).items():
        if leaf.ndim >= 2:
            name = path.split("/")[-1]
            n_in = {"o_kernel": 2}.get(name, 1)
            per_layer = leaf.shape[1:] if path.startswith("layers/") else leaf.shape
            frozen_shapes.add((math.prod(per_layer[:n_in]), math.prod(per_layer[n_in:])))
    frozen_shapes |= {(o, i) for i, o in frozen_shapes}  # either orientation
    assert not shapes & frozen_shapes, shapes & frozen_shapes
    # the adapters' own gradients are there: (in, rank) and (rank, out) products
    assert (cfg.hidden_size, LORA.rank) in shapes or (LORA.rank, cfg.hidden_size) in shapes
