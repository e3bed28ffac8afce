"""Pipeline parallelism (jrlhf.models.pipeline): a ``stage`` mesh axis splits the stacked layers,
and full-sequence passes run their micro-batches through the stages on the GPipe schedule. The
pipelined logits, values, log-probs, loss, gradient norm and parameters after an SGD step equal
the unpipelined run's on 8 fake CPU devices (float32: 1e-5 absolute). A PPO job with staged
actor and critic equals one without stages in tests/e2e/test_multiprocess.py, its stages on a
process each."""

import chex
import jax
import numpy as np
import optax
import pytest

from benchmarks import fsdp_memory as fm
from benchmarks import pipeline_memory
from benchmarks.fused_pipeline import P, rl_batch
from jrlhf.cli import train
from jrlhf.config import ConfigError, RLConfig, RoleConfig
from jrlhf.meshes import activation_sharding, make_mesh
from jrlhf.meshes.rules import MeshLayoutError
from jrlhf.models import ModelDef, tiny_config
from jrlhf.models.lora import LoraConfig
from jrlhf.models.pipeline import bubble_fraction
from jrlhf.placement import estimator as est
from jrlhf.placement.plan import CallPlacement
from jrlhf.placement.profile import DeviceProfile
from jrlhf.placement.workload import Workload
from jrlhf.ppo.batch import response_logprobs
from jrlhf.ppo.losses import actor_loss, critic_loss
from jrlhf.runtime.steps import init_train_state, make_train_step
from tests.placement.test_estimator_fused import COMPUTE_ONLY

TOL = 1e-5
REFERENCE_MESH = "fsdp=2,tensor=2"
SGD = optax.sgd(0.5)


def tiny(**overrides):
    base = dict(hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4, num_kv_heads=2)
    return tiny_config(vocab_size=64, **{**base, **overrides})


def forward(model, params, mesh_spec, batch):
    """(logits or values, response log-probs for an LM) of ``batch`` on ``mesh_spec``."""
    mesh = make_mesh(mesh_spec)
    params = jax.device_put(params, model.shardings(mesh, "fsdp_tp"))

    def run(params, batch):
        with activation_sharding(mesh, "fsdp_tp"):
            module = model.bind(params)
            out = module(batch["tokens"], batch["positions"], batch["segment_ids"])
            logp = response_logprobs(module, batch, P) if model.head == "lm" else out
            return out, logp

    return jax.tree.map(np.asarray, jax.jit(run)(params, batch))


def train_step(model, mesh_spec, loss_fn, microbatches=1):
    mesh = make_mesh(mesh_spec)
    state = init_train_state(model, SGD, mesh, "fsdp_tp", seed=0)
    step = make_train_step(model, SGD, loss_fn, mesh, "fsdp_tp", microbatches=microbatches)
    state, metrics = step(state, rl_batch())
    return (float(metrics["loss"]), float(metrics["grad_norm"])), state.params


@pytest.fixture(scope="module")
def reference():
    """The unpipelined forward passes and train steps every pipelined case is compared with."""
    rl = RLConfig(entropy_coef=0.01, kl_in_loss=True)
    out = {}
    for head in ("lm", "value"):
        model = ModelDef(tiny(), head=head)
        params = model.init_sharded(make_mesh(REFERENCE_MESH), "fsdp_tp")
        loss = actor_loss(P, rl, kl_in_loss=True) if head == "lm" else critic_loss(P, rl)
        out[head] = dict(
            params=params,
            forward=forward(model, params, REFERENCE_MESH, rl_batch()),
            loss_fn=loss,
            step=train_step(model, REFERENCE_MESH, loss),
        )
    return out


def assert_step_close(got, want):
    np.testing.assert_allclose(got[0], want[0], atol=TOL, rtol=0)
    chex.assert_trees_all_close(got[1], want[1], atol=TOL, rtol=0)


@pytest.mark.parametrize(
    "mesh_spec,overrides",
    [
        ("stage=2,fsdp=2,tensor=2", {}),  # 2 micro-batches (one per stage), 4 layers a stage
        ("stage=4,fsdp=2", dict(pipeline_microbatches=3)),  # 8 rows padded to 9: 3 of 3
        ("stage=2,fsdp=2,tensor=2", dict(pipeline_microbatches=8, remat_policy="full")),
    ],
)
def test_pipelined_actor_equals_unpipelined(reference, mesh_spec, overrides):
    """Logits, response log-probs, and the loss, gradient norm and parameters after one PPO
    actor step (GRPO's KL-in-loss form)."""
    ref = reference["lm"]
    model = ModelDef(tiny(**overrides))
    logits, logp = forward(model, ref["params"], mesh_spec, rl_batch())
    np.testing.assert_allclose(logits, ref["forward"][0], atol=TOL, rtol=0)
    np.testing.assert_allclose(logp, ref["forward"][1], atol=TOL, rtol=0)
    assert_step_close(train_step(model, mesh_spec, ref["loss_fn"]), ref["step"])


def test_pipelined_critic_values_equal_unpipelined(reference):
    """Critic values at stage=2 (its GPipe train step runs in the PPO run below, its 1F1B step
    in test_1f1b_train_step_equals_unpipelined)."""
    ref = reference["value"]
    model = ModelDef(tiny(pipeline_microbatches=2), head="value")
    values, _ = forward(model, ref["params"], "stage=2,fsdp=2,tensor=2", rl_batch())
    np.testing.assert_allclose(values, ref["forward"][0], atol=TOL, rtol=0)


def test_the_schedule_shifts_stages_by_collective_permutes(reference):
    """Each device holds its stage's layers only, and the in-flight micro-batches move between
    stages by collective permutes."""
    model = ModelDef(tiny())
    mesh = make_mesh("stage=4,fsdp=2")
    params = jax.device_put(reference["lm"]["params"], model.shardings(mesh, "fsdp_tp"))
    kernel = params["layers"]["mlp"]["up_kernel"]
    assert kernel.addressable_shards[0].data.shape[0] == 1  # 4 layers over 4 stages
    batch = rl_batch()

    def run(params, tokens):
        with activation_sharding(mesh, "fsdp_tp"):
            return model.apply(params, tokens)

    hlo = jax.jit(run).lower(params, batch["tokens"]).compile().as_text()
    assert "collective-permute" in hlo
    assert bubble_fraction(4, 4) == pytest.approx(3 / 7)


def test_stage_settings_fail_in_one_line():
    model = ModelDef(tiny(num_layers=3))
    with pytest.raises(MeshLayoutError, match="3 layers do not split over 'stage' of size 2"):
        model.shardings(make_mesh("stage=2,fsdp=4"), "fsdp_tp")
    with pytest.raises(ConfigError, match="actor/RoleConfig.pipeline_microbatches: must be >= 0"):
        RoleConfig(pipeline_microbatches=-1).validate("actor")
    RoleConfig(generate_mesh="stage=2,tensor=4").validate("actor")  # pipelined decode
    with pytest.raises(ValueError, match="pipeline_microbatches must be an integer >= 0"):
        tiny(pipeline_microbatches=-2)


def test_the_estimator_prices_the_bubble_the_sends_and_the_memory_of_stages():
    """jrlhf.placement.estimator on a stage mesh: on a compute-only profile a pipelined train
    step costs (M + S - 1) / M of the unpipelined one on the same 8 devices (the bubble), the
    stage sends add time on finite links, and the working memory of a compiled pipelined train
    step and scoring call is XLA's within the estimator tests' bound (XLA_WORKING_BOUND)."""

    def workload(cfg, rows=16):
        return Workload(
            actor=cfg,
            critic=None,
            reference=cfg,
            reward=None,
            prompts=rows,
            samples_per_prompt=1,
            prompt_len=fm.P,
            gen_len=fm.R,
            epochs=1,
            minibatch_size=rows,
        )

    h100 = DeviceProfile.load("h100")
    flat, staged = CallPlacement("fsdp=8", "fsdp_tp"), CallPlacement("stage=2,fsdp=4", "fsdp_tp")
    plain = workload(fm.model_config(4))
    for micro in (2, 8):
        piped = workload(fm.model_config(4, pipeline_microbatches=micro))
        ratio = est.train_seconds(piped, "actor", staged, COMPUTE_ONLY) / est.train_seconds(
            plain, "actor", flat, COMPUTE_ONLY
        )
        assert ratio == pytest.approx((micro + 1) / micro)
        # 1F1B: a longer lockstep bubble and a recompute of every stage's forward
        one_f = workload(fm.model_config(4, pipeline_microbatches=micro, pipeline_schedule="1f1b"))
        t_1f1b = est.train_seconds(one_f, "actor", staged, COMPUTE_ONLY)
        assert t_1f1b > est.train_seconds(piped, "actor", staged, COMPUTE_ONLY)
        assert est.pipeline_send_seconds(piped.actor, 8, fm.P + fm.R, est._geometry(
            staged, h100), 2, h100) > 0  # fmt: skip
    cpu = DeviceProfile.load("cpu")
    cases = [  # (mesh, micro-batches, schedule, call, compiled program)
        ("stage=2,fsdp=2,tensor=2", 4, "gpipe", "actor_train", fm.train_analysis),
        ("stage=2,fsdp=2,tensor=2", 4, "1f1b", "actor_train", fm.train_analysis),
        ("stage=2,fsdp=4", 2, "gpipe", "reference_infer", fm.infer_analysis),
    ]
    for mesh, micro, schedule, call, analysis in cases:
        cfg = fm.model_config(4, pipeline_microbatches=micro, pipeline_schedule=schedule)
        xla = analysis(cfg, mesh, 16).temp_size_in_bytes
        want = est._working_bytes(workload(cfg), call, CallPlacement(mesh, "fsdp_tp"), cpu)
        assert abs(want / xla - 1) < 0.35, (mesh, want, xla)


def test_per_layer_choices_and_lora_adapters_follow_their_layers_through_the_stages():
    """A Gemma-3-like model (sliding and full layers alternating, a local RoPE base, q/k
    norms, post-norms, soft-capped scores: per-layer choices taken from the layer index, traced
    under the vmap over stages) with LoRA adapters on every projection (stacked like the
    layers): stage=2 logits equal the unpipelined ones (scanned layers; the unrolled loop takes
    the same traced index, and the other tests run it)."""
    kinds = ("sliding_attention",) * 2 + ("full_attention",) * 2  # stage 0 | stage 1
    cfg = tiny(
        layer_types=kinds,
        sliding_window=3,
        rope_local_theta=100.0,
        qk_norm=True,
        post_norms=True,
        norm_unit_offset=True,
        attn_logit_softcap=20.0,
        layer_loop="scan",
    )
    model = ModelDef(cfg, lora=LoraConfig(rank=2))
    params = model.init_sharded(make_mesh(REFERENCE_MESH), "fsdp_tp", seed=1)
    # adapters start at zero (B = 0): make them count
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: x + 0.05 if "lora_b" in jax.tree_util.keystr(path) else x, params
    )
    want, _ = forward(model, params, REFERENCE_MESH, rl_batch())
    got, _ = forward(model, params, "stage=2,fsdp=2,tensor=2", rl_batch())
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)


def test_a_stage_count_the_layers_do_not_divide_fails_the_run_in_one_line(tmp_path, capsys):
    rc = train.main([
        "--run-dir", str(tmp_path / "r"), "--quiet", "RunConfig.stages=('grpo',)",
        "actor/RoleConfig.init='tiny'", "reference/RoleConfig.init='tiny'",
        "RLConfig.samples_per_prompt=2", "actor/RoleConfig.train_mesh='stage=4,fsdp=2'",
    ])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert rc != 0
    assert err.startswith("error: actor/RoleConfig.train_mesh stage=4,fsdp=2"), err
    assert "2 layers do not split over 'stage' of size 4" in err


@pytest.mark.parametrize(
    "head,mesh_spec,micro,accumulate",
    [
        ("lm", "stage=2,fsdp=2,tensor=2", 4, 1),
        ("lm", "stage=4,fsdp=2", 8, 1),
        ("value", "stage=2,fsdp=2,tensor=2", 2, 2),
    ],
)
def test_1f1b_train_step_equals_unpipelined(reference, head, mesh_spec, micro, accumulate):
    """The 1F1B schedule (gradients by hand, the loss per micro-batch on the last stage's
    output): loss, gradient norm and parameters after one step equal the unpipelined step's,
    for the actor and (inside 2 gradient-accumulation micro-batches) the critic."""
    ref = reference[head]
    model = ModelDef(tiny(pipeline_schedule="1f1b", pipeline_microbatches=micro), head=head)
    step = train_step(model, mesh_spec, ref["loss_fn"], microbatches=accumulate)
    assert_step_close(step, ref["step"])


def test_1f1b_keeps_less_activation_memory_than_gpipe():
    """XLA's temp memory of the compiled train step (benchmarks/pipeline_memory.py's model, 8
    micro-batches over 2 stages, no remat): 1F1B keeps at most 2S - 1 micro-batches' inputs a
    stage where GPipe keeps every iteration's residuals (20.0 vs 46.5 MiB)."""
    temps = {}
    for schedule in ("gpipe", "1f1b"):
        cfg = pipeline_memory.model_config("none", 8, schedule)
        compiled = fm.train_compiled(cfg, "stage=2,fsdp=2,tensor=2", 32)
        temps[schedule] = compiled.memory_analysis().temp_size_in_bytes
        if schedule == "1f1b":
            assert "collective-permute" in compiled.as_text()
    assert temps["1f1b"] < 0.6 * temps["gpipe"], temps
    assert bubble_fraction(2, 8, "1f1b") == pytest.approx(3 / 11)


def test_1f1b_refuses_rows_that_do_not_split_in_one_line(reference):
    model = ModelDef(tiny(pipeline_schedule="1f1b", pipeline_microbatches=3))
    with pytest.raises(ValueError, match="8 rows does not split into pipeline_microbatches=3"):
        train_step(model, "stage=2,fsdp=2,tensor=2", reference["lm"]["loss_fn"])


def test_check_refuses_1f1b_micro_batches_the_step_rows_do_not_make(tmp_path, capsys):
    rc = train.main([
        "--check", "--run-dir", str(tmp_path / "r"), "RunConfig.stages=('grpo',)",
        "actor/RoleConfig.init='tiny'", "reference/RoleConfig.init='tiny'",
        "RLConfig.samples_per_prompt=2", "actor/RoleConfig.train_mesh='stage=2,fsdp=4'",
        "actor/RoleConfig.pipeline_schedule='1f1b'", "actor/RoleConfig.pipeline_microbatches=3",
    ])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert rc != 0
    assert err.startswith("error: actor/RoleConfig.pipeline_microbatches: the 1f1b schedule"), err
