"""The sharded SFT step equals the single-device step; RL losses accumulate over micro-batches
to the minibatch's loss."""

import chex
import jax
import numpy as np
import optax
import pytest

from jrlhf.config import DPOConfig, RLConfig
from jrlhf.meshes import make_mesh
from jrlhf.meshes.batch import shard_batch
from jrlhf.models import ModelDef, tiny_config
from jrlhf.models.config import AUTO_UNROLL_LAYERS
from jrlhf.ppo.core_algos import sft_loss
from jrlhf.ppo.losses import actor_loss, critic_loss
from jrlhf.runtime.steps import OptimizerConfig, init_train_state, make_optimizer, make_train_step

# One optimizer object for the module: programs are shared by optimizer identity
# (jrlhf.shared_programs), so steps and states of equal models and meshes are
# traced and compiled once.
SGD = optax.sgd(0.5)


def sft_loss_fn(module, batch):
    logits = module(batch["tokens"], batch["positions"], batch["segment_ids"])
    loss, metrics = sft_loss(logits, batch["targets"], batch["loss_mask"])
    return loss, dict(metrics, weight=batch["loss_mask"].sum())


def make_batch(seed=0, b=8, t=16, vocab=256):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (b, t)).astype(np.int32)
    mask = (rng.random((b, t)) < 0.7).astype(np.float32)
    mask[0] = 0.0  # an all-masked row
    return {
        "tokens": tokens,
        "positions": np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy(),
        "segment_ids": np.ones((b, t), np.int32),
        "targets": np.roll(tokens, -1, axis=1),
        "loss_mask": mask,
    }


def run_steps(mesh_spec, rules, steps=2, microbatches=1, remat="none", optimizer=None):
    model = ModelDef(tiny_config(num_kv_heads=4, remat_policy=remat))
    # Plain SGD by default: its update is linear in the gradient, so parameters can be compared
    # at 1e-5. (Adam's first update is ~lr*sign(g): a gradient at the noise floor may flip.)
    optimizer = optimizer or SGD
    mesh = make_mesh(mesh_spec)
    state = init_train_state(model, optimizer, mesh, rules, seed=0)
    step = make_train_step(model, optimizer, sft_loss_fn, mesh, rules, microbatches=microbatches)
    losses = []
    for i in range(steps):
        state, metrics = step(state, make_batch(i))
        losses.append((float(metrics["loss"]), float(metrics["grad_norm"])))
    return state, np.array(losses)


@pytest.fixture(scope="module")
def single():
    return run_steps("fsdp=1", "fsdp_tp")


@pytest.mark.parametrize(
    "mesh_spec,kwargs",
    [
        ("fsdp=2,tensor=4", {}),
        # (fsdp=4,tensor=2 is the trainer's default training mesh: tests/e2e/test_trainer.py)
        ("data=2,fsdp=2,tensor=2", {"microbatches": 2, "remat": "full"}),
    ],
)
def test_sharded_step_equals_single_device(single, mesh_spec, kwargs):
    ref_state, ref_losses = single
    state, losses = run_steps(mesh_spec, "fsdp_tp", **kwargs)
    np.testing.assert_allclose(losses, ref_losses, atol=1e-5, rtol=0)
    chex.assert_trees_all_close(state.params, ref_state.params, atol=1e-5, rtol=0)
    assert int(state.step) == 2
    assert ref_losses[1, 0] != ref_losses[0, 0]  # the step really changed the parameters


def test_adamw_step_on_mesh_matches_and_shards_moments():
    adam = make_optimizer(OptimizerConfig(learning_rate=1e-3, grad_clip=1.0))
    _ref_state, ref_losses = run_steps("fsdp=1", "fsdp_tp", steps=3, optimizer=adam)
    state, losses = run_steps("fsdp=2,tensor=4", "fsdp_tp", steps=3, optimizer=adam)
    np.testing.assert_allclose(losses, ref_losses, atol=1e-5, rtol=0)
    # Optimizer moments are laid out like their parameters.
    mu = state.opt_state[1][0].mu["layers"]["mlp"]["gate_kernel"]
    assert mu.sharding == state.params["layers"]["mlp"]["gate_kernel"].sharding


def test_state_is_donated_and_step_compiles_once():
    model = ModelDef(tiny_config(num_kv_heads=4))
    optimizer = make_optimizer(OptimizerConfig(learning_rate=1e-3))
    mesh = make_mesh("fsdp=2,tensor=4")
    state = init_train_state(model, optimizer, mesh, "fsdp_tp")
    step = make_train_step(model, optimizer, sft_loss_fn, mesh, "fsdp_tp")
    old = state.params["embedding"]
    state, _ = step(state, make_batch(0))
    assert old.is_deleted()
    for i in range(3):
        state, _ = step(state, make_batch(i + 1))
    assert step.jitted._cache_size() == 1


def test_a_non_finite_update_is_skipped_and_a_finite_one_is_applied_in_place():
    """The guard keeps the state exactly on a non-finite loss (and gradient), and decides before
    the update, so the update needs no second copy of the state: the compiled step's scratch
    memory stays under the state's size (params and both AdamW moments), where keeping the old
    state beside the new one for a select took more."""
    model = ModelDef(tiny_config(num_kv_heads=4))
    optimizer = make_optimizer(OptimizerConfig(learning_rate=1e-3))
    mesh = make_mesh("fsdp=1")

    def scaled_loss(module, batch):
        loss, metrics = sft_loss_fn(module, batch)
        return loss * batch["scale"][0], metrics

    def batch(scale):
        b = make_batch(0, b=2, t=4)  # its first row is all masked out, the second is not
        return dict(b, scale=np.full((2,), scale, np.float32))

    state = init_train_state(model, optimizer, mesh, "fsdp_tp")
    step = make_train_step(model, optimizer, scaled_loss, mesh, "fsdp_tp")
    before = jax.tree.map(np.asarray, state)
    state, metrics = step(state, batch(np.nan))
    assert float(metrics["skipped"]) == 1.0
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, state), before)
    state, metrics = step(state, batch(1.0))
    assert float(metrics["skipped"]) == 0.0 and int(state.step) == 1
    moved = jax.tree.map(lambda a, b: bool((np.asarray(a) != b).any()), state.params, before.params)
    assert all(jax.tree.leaves(moved["layers"]))
    compiled = step.jitted.lower(state, shard_batch(batch(1.0), mesh, "fsdp_tp")).compile()
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(state.params))
    assert compiled.memory_analysis().temp_size_in_bytes < 3 * param_bytes


def test_an_overflowing_update_is_reported_skipped_and_so_is_every_one_after_it():
    """Finite loss and gradients, an update that makes the parameters non-finite (an infinite
    learning rate): the guard decided before the update, so it is applied, but reported
    skipped, and so is the next update (its parameters stay non-finite), so UpdateGuard stops
    the run."""
    model = ModelDef(tiny_config(num_kv_heads=4))
    optimizer = optax.sgd(float("inf"))
    mesh = make_mesh("fsdp=1")
    state = init_train_state(model, optimizer, mesh, "fsdp_tp")
    step = make_train_step(model, optimizer, sft_loss_fn, mesh, "fsdp_tp")
    state, metrics = step(state, make_batch(0))
    assert np.isfinite(float(metrics["loss"])) and np.isfinite(float(metrics["grad_norm"]))
    assert float(metrics["skipped"]) == 1.0
    assert not all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state.params))
    state, metrics = step(state, make_batch(1))
    assert float(metrics["skipped"]) == 1.0


def test_indivisible_batch_is_one_line():
    model = ModelDef(tiny_config())
    optimizer = make_optimizer(OptimizerConfig())
    mesh = make_mesh("data=4,tensor=2")
    state = init_train_state(model, optimizer, mesh, "fsdp_tp")
    step = make_train_step(model, optimizer, sft_loss_fn, mesh, "fsdp_tp")
    with pytest.raises(ValueError, match="'tokens' has 6 rows, not divisible"):
        step(state, make_batch(0, b=6))


# ----------------------------------------------------------------------------- RL losses

RL_P, RL_R = 4, 6


def rl_batch(b=8, seed=0, vocab=256):
    """A PPO minibatch in the trainer's layout; rows 0-1 empty (so one micro-batch of 4 has no
    valid token), rows 2-3 one token long, the rest ragged."""
    rng = np.random.default_rng(seed)
    t = RL_P + RL_R
    tokens = rng.integers(0, vocab, (b, t)).astype(np.int32)
    lengths = np.array([0, 0, 1, 1, 6, 3, 5, 2])[:b]
    mask = (np.arange(RL_R)[None, :] < lengths[:, None]).astype(np.float32)
    normal = lambda *s: rng.normal(size=s).astype(np.float32)  # noqa: E731
    old_lp = np.log(rng.uniform(0.001, 0.02, (b, RL_R))).astype(np.float32)
    return {
        "tokens": tokens,
        "positions": np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy(),
        "segment_ids": np.ones((b, t), np.int32),
        "response_tokens": tokens[:, RL_P:],
        "mask": mask,
        "old_logprobs": old_lp,
        "advantages": normal(b, RL_R),
        "ref_logprobs": (old_lp + 0.3 * normal(b, RL_R)).astype(np.float32),
        "kl_coef": np.full((b,), 0.1, np.float32),
        "old_values": normal(b, RL_R),
        "returns": normal(b, RL_R),
    }


# The seq-mean modes share one micro-batch weight (rows) and differ only inside each row, which
# tests/ppo/test_ppo_math.py checks for every mode and split: one of them, against the token mean,
# covers the step's accumulation.
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum-norm"])
def test_rl_losses_do_not_depend_on_the_microbatch_split(agg):
    """Each micro-batch weighs in by what its aggregation averages over (tokens or sequences),
    so 1 or 4 micro-batches give the same minibatch loss and update."""
    rl = RLConfig(loss_agg=agg, entropy_coef=0.01, kl_in_loss=True, clip_eps=0.1)
    mesh = make_mesh("fsdp=1")
    cases = [("lm", actor_loss(RL_P, rl, kl_in_loss=True), (1, 4))]
    # Both heads weigh micro-batches by the same aggregation_weight: the value head is checked in
    # the mode furthest from a token mean, the policy head in both.
    if agg == "seq-mean-token-sum-norm":
        cases.append(("value", critic_loss(RL_P, rl), (1, 4)))
    for head, loss_fn, splits in cases:
        model = ModelDef(tiny_config(), head=head)
        results = []
        for mb in splits:
            state = init_train_state(model, SGD, mesh, "fsdp_tp", seed=0)
            step = make_train_step(model, SGD, loss_fn, mesh, "fsdp_tp", microbatches=mb)
            state, metrics = step(state, rl_batch())
            results.append((float(metrics["loss"]), state.params))
        (loss1, params1), *others = results
        for loss, params in others:
            np.testing.assert_allclose(loss, loss1, rtol=1e-5, atol=1e-6, err_msg=head)
            chex.assert_trees_all_close(params, params1, rtol=1e-5, atol=1e-6)


def test_pair_losses_do_not_depend_on_the_microbatch_split():
    """The reward-model and DPO losses read a pair's chosen and rejected rows side by side
    (supervised.pack_pairs), so microbatches of whole pairs give the whole batch's loss and
    update; one empty rejected response leaves its pair out of the DPO loss."""
    from jrlhf.data import PreferenceRecord
    from jrlhf.pipeline.supervised import dpo_loss_fn, pack_pairs, reward_loss_fn

    rng = np.random.default_rng(0)
    ids = lambda n: rng.integers(4, 256, n).tolist()  # noqa: E731
    pairs = [PreferenceRecord(ids(1 + i % RL_P), ids(1 + i % RL_R), ids(i % 3)) for i in range(4)]
    batch = pack_pairs(pairs, RL_P, RL_R, pad_id=0)
    batch["ref_logprobs"] = rng.normal(-8.0, 2.0, 8).astype(np.float32)
    assert batch["mask"][1].sum() == 0  # the first pair's rejected response is empty
    mesh = make_mesh("fsdp=1")
    dpo = DPOConfig(beta=0.5)
    for head, loss_fn in (("value", reward_loss_fn), ("lm", dpo_loss_fn(RL_P, dpo))):
        model = ModelDef(tiny_config(), head=head)
        results = []
        for mb in (1, 2):
            state = init_train_state(model, SGD, mesh, "fsdp_tp", seed=0)
            step = make_train_step(model, SGD, loss_fn, mesh, "fsdp_tp", microbatches=mb)
            state, metrics = step(state, batch)
            results.append((float(metrics["loss"]), float(metrics["accuracy"]), state.params))
        (loss1, acc1, params1), (loss2, acc2, params2) = results
        np.testing.assert_allclose(loss2, loss1, rtol=1e-5, atol=1e-6, err_msg=head)
        assert acc1 == acc2
        chex.assert_trees_all_close(params2, params1, rtol=1e-5, atol=1e-6)


def test_unrolled_layer_loop_equals_scan():
    """ModelConfig.layer_loop="unroll" (static per-layer slices instead of lax.scan) gives the
    scanned model's loss, gradient norm and update; remat needs the scan."""
    results = []
    for loop in ("scan", "unroll"):
        model = ModelDef(tiny_config(num_kv_heads=4, layer_loop=loop))
        # test_sharded_step_equals_single_device's first mesh: the unrolled step's program
        # comes from the compilation cache
        mesh = make_mesh("fsdp=2,tensor=4")
        state = init_train_state(model, SGD, mesh, "fsdp_tp", seed=0)
        step = make_train_step(model, SGD, sft_loss_fn, mesh, "fsdp_tp")
        state, metrics = step(state, make_batch(0))
        results.append((float(metrics["loss"]), float(metrics["grad_norm"]), state.params))
    (l0, g0, p0), (l1, g1, p1) = results
    np.testing.assert_allclose([l1, g1], [l0, g0], rtol=1e-5)
    chex.assert_trees_all_close(p1, p0, rtol=1e-5, atol=1e-6)
    # the default, "auto": unrolled on CPU for a shallow model without remat, else the scan
    assert tiny_config().unroll_layers
    assert not tiny_config(remat_policy="full").unroll_layers
    assert not tiny_config(num_layers=AUTO_UNROLL_LAYERS + 1).unroll_layers
    assert not tiny_config(layer_loop="scan").unroll_layers
    with pytest.raises(ValueError, match="layer_loop"):
        tiny_config(layer_loop="unroll", remat_policy="full")
    with pytest.raises(ValueError, match="layer_loop"):
        tiny_config(layer_loop="while")
