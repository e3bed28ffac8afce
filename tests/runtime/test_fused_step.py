"""The fused actor-critic train step (jrlhf.runtime.fused_step) on fake CPU devices: one
program trains the actor (stages first-to-last) and the critic (last-to-first) of a PPO
minibatch on a searched table, each stage running only its own table slots, and its losses,
metrics, gradients and parameters after the optimizer step equal each model's own update
without stages: autodiff of its loss on one device and an SGD step (float32, 1e-5
absolute)."""

import chex
import jax
import numpy as np
import optax
import pytest

from benchmarks.fused_pipeline import P, rl_batch
from jrlhf.config import RLConfig
from jrlhf.meshes import make_mesh
from jrlhf.models import ModelDef, tiny_config
from jrlhf.models import fused_schedule as fs
from jrlhf.ppo.losses import actor_loss, critic_loss
from jrlhf.runtime.fused_step import make_fused_train_step
from jrlhf.runtime.steps import TrainState, state_shardings

TOL = 1e-5
SGD = optax.sgd(1.0)  # parameters after the step minus before are minus the gradients
RL = RLConfig(entropy_coef=0.01, kl_in_loss=True)
LOSSES = {"lm": actor_loss(P, RL, kl_in_loss=True), "value": critic_loss(P, RL)}
SEEDS = {"lm": 0, "value": 1}


def tiny(**overrides):
    base = dict(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
    return tiny_config(vocab_size=64, **{**base, **overrides})


@pytest.fixture(scope="module")
def separate():
    """Each model's own update, on one device, with autodiff of its whole loss: (the metrics
    its train step reports, the state before, the parameters after one SGD step)."""
    out = {}
    for head in ("lm", "value"):
        model = ModelDef(tiny(), head=head)
        params = model.init(jax.random.key(SEEDS[head]))

        def loss(params, batch, model=model, head=head):
            return LOSSES[head](model.bind(params), batch)

        grad = jax.jit(jax.value_and_grad(loss, has_aux=True))
        (value, metrics), grads = grad(params, rl_batch())
        after = jax.tree.map(lambda p, g: np.asarray(p - g), params, grads)
        metrics = dict(metrics, loss=value, grad_norm=optax.tree.norm(grads), skipped=0.0)
        start = TrainState(np.int32(0), jax.tree.map(np.asarray, params), SGD.init(params))
        out[head] = (jax.tree.map(float, metrics), start, after)
    return out


@pytest.mark.parametrize(
    "mesh_spec,stages,micro",
    [
        # stage axes only: the per-stage program, idle slots skipped
        ("stage=2", 2, (8, 4)),
        # a stage split over fsdp and tensor too: the lockstep program (every stage computes
        # every slot); more cases in python -m benchmarks.fused_pipeline equality
        ("stage=2,fsdp=2,tensor=2", 2, (2, 2)),
    ],
)
def test_the_fused_update_equals_the_separate_updates(separate, mesh_spec, stages, micro):
    mesh = make_mesh(mesh_spec)
    models = {
        head: ModelDef(tiny(pipeline_microbatches=m), head=head)
        for head, m in zip(("lm", "value"), micro, strict=True)
    }
    # a memory limit that makes the search interleave under pressure: S micro-batches a stage
    found = fs.search(stages, micro, ((1, 1), (1, 1)), (1, 1), stages, iterations=300)
    sched = found.schedule
    # fused: at some tick one stage works on the actor while another works on the critic
    assert np.any((sched.model == fs.ACTOR).any(1) & (sched.model == fs.CRITIC).any(1))
    # the separate steps' initial states, laid out on the stage mesh
    states = [
        jax.device_put(separate[h][1], state_shardings(models[h], SGD, mesh, "fsdp_tp"))
        for h in ("lm", "value")
    ]
    step = make_fused_train_step(
        *((models[h], SGD, LOSSES[h]) for h in ("lm", "value")), mesh, "fsdp_tp", sched
    )
    batch = rl_batch()
    *states, actor_metrics, critic_metrics = step(*states, batch, batch)
    for head, state, metrics in zip(
        ("lm", "value"), states, (actor_metrics, critic_metrics), strict=True
    ):
        want_metrics, start, after = separate[head]
        before = start.params
        got = jax.tree.map(float, metrics)
        assert got.keys() == want_metrics.keys()
        for key, want in want_metrics.items():
            assert got[key] == pytest.approx(want, abs=TOL), (head, key)
        params = jax.tree.map(np.asarray, state.params)
        chex.assert_trees_all_close(params, after, atol=TOL, rtol=0)
        # SGD with learning rate 1: the gradients are the parameters' change
        grads = jax.tree.map(lambda b, a: b - a, before, params)
        want_grads = jax.tree.map(lambda b, a: b - a, before, after)
        chex.assert_trees_all_close(grads, want_grads, atol=TOL, rtol=0)
        assert max(float(np.abs(g).max()) for g in jax.tree.leaves(grads)) > 1e-3


def test_a_table_of_other_micro_batches_or_stages_fails_in_one_line(separate):
    mesh = make_mesh("stage=2,fsdp=2,tensor=2")
    models = [ModelDef(tiny(pipeline_microbatches=2), head=h) for h in ("lm", "value")]
    states = [
        jax.device_put(separate[m.head][1], state_shardings(m, SGD, mesh, "fsdp_tp"))
        for m in models
    ]
    parts = [(m, SGD, LOSSES[m.head]) for m in models]
    for stages, micro, message in (
        (2, (2, 4), "the table has 4 critic micro-batches, the critic's"),
        (4, (2, 2), "the table has 4 stages, the mesh"),
    ):
        sched = fs.search(stages, micro, iterations=20).schedule
        step = make_fused_train_step(*parts, mesh, "fsdp_tp", sched, donate=False)
        with pytest.raises(ValueError, match=f"^fused schedule: {message}") as err:
            step(*states, rl_batch(), rl_batch())
        assert "\n" not in str(err.value)


FUSED = "critic/RoleConfig.pipeline_schedule='fused'"


@pytest.mark.parametrize(
    "bindings,message",
    [
        (
            [FUSED, "RunConfig.stages=('grpo',)"],
            "critic/RoleConfig.pipeline_schedule: 'fused' trains the critic together with the "
            "actor, and the grpo stage trains no critic",
        ),
        (
            ["actor/RoleConfig.pipeline_schedule='fused'"],
            "actor/RoleConfig.pipeline_schedule: 'fused' is the critic's setting",
        ),
        (
            [FUSED, "actor/RoleConfig.microbatches=2"],
            f"actor/RoleConfig.microbatches: 2 with {FUSED}: the fused schedule runs",
        ),
        (
            [FUSED, "critic/RoleConfig.microbatch_tokens=64"],
            f"critic/RoleConfig.microbatch_tokens: 64 with {FUSED}",
        ),
        (
            [FUSED, "actor/RoleConfig.lora_rank=4", "actor/RoleConfig.lora_dropout=0.1"],
            f"actor/RoleConfig.lora_dropout: 0.1 with {FUSED}: adapter dropout",
        ),
    ],
)
def test_settings_the_fused_step_cannot_run_fail_at_startup_in_one_line(
    bindings, message, tmp_path, capsys
):
    from jrlhf.cli import train

    rc = train.main(["--run-dir", str(tmp_path / "r"), *bindings])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert err.startswith("error: ") and message in err, err
    assert "\n" not in err


def test_the_ppo_update_refuses_meshes_and_minibatches_the_fused_step_cannot_run():
    """jrlhf.ppo.update.fused_step, which the PPO update builds its fused step with: actor
    and critic on different training meshes, a mesh without stages, and minibatch rows that do
    not split into a model's pipeline micro-batches fail in one line naming the setting."""
    from jrlhf.config import ConfigError, RoleConfig
    from jrlhf.meshes.rules import get_rules
    from jrlhf.ppo.update import fused_step
    from jrlhf.runtime.model_source import ModelSource
    from jrlhf.runtime.roles import RoleSetup

    def roles(actor_mesh, critic_mesh, critic_micro=0):
        def setup(name, mesh, head, micro):
            source = ModelSource(ModelDef(tiny(pipeline_microbatches=micro), head=head), None)
            rules = {"train": get_rules("fsdp_tp")}
            return RoleSetup(name, RoleConfig(), source, {"train": make_mesh(mesh)}, rules)

        return {
            "actor": setup("actor", actor_mesh, "lm", 0),
            "critic": setup("critic", critic_mesh, "value", critic_micro),
        }

    opts, losses = {"actor": SGD, "critic": SGD}, {"actor": LOSSES["lm"], "critic": LOSSES["value"]}
    for setups, rows, message in (
        (
            roles("stage=2,fsdp=4", "stage=2,fsdp=2,tensor=2"),
            8,
            "critic/RoleConfig.pipeline_schedule: 'fused' needs the actor and the critic on one "
            "training mesh",
        ),
        (
            roles("fsdp=4,tensor=2", "fsdp=4,tensor=2"),
            8,
            "critic/RoleConfig.pipeline_schedule: 'fused' needs a stage axis of 2 or more",
        ),
        (
            roles("stage=2,fsdp=4", "stage=2,fsdp=4", critic_micro=3),
            8,
            "critic/RoleConfig.pipeline_microbatches: the fused schedule cuts each minibatch's "
            "8 rows",
        ),
    ):
        with pytest.raises(ConfigError) as err:
            fused_step(setups, opts, losses, rows)
        assert str(err.value).startswith(message) and "\n" not in str(err.value), str(err.value)
