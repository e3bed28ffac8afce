"""Programs built again from equal arguments in one process are the ones built before
(jrlhf.shared_programs, the decode engine's templates): no tracing or compiling again,
the same results, and nothing shared between requests that differ."""

from __future__ import annotations

import dataclasses

import jax

from jrlhf.config import Asynchrony, RLConfig
from jrlhf.decode import DecodeEngine, EngineConfig, SamplingParams
from jrlhf.meshes import make_mesh
from jrlhf.models.config import tiny_config
from jrlhf.models.model_def import ModelDef
from jrlhf.ppo import batch as rl_batch
from jrlhf.ppo.losses import actor_loss, critic_loss
from jrlhf.reshard.resharder import backend_compile_count
from jrlhf.runtime.steps import OptimizerConfig, make_optimizer, make_train_step
from jrlhf.shared_programs import shared_program


def test_equal_arguments_share_and_unhashable_ones_build_afresh():
    built = []

    @shared_program(maxsize=2)
    def factory(*args):
        built.append(args)
        return object()

    assert factory(1, ("a",)) is factory(1, ("a",))
    assert factory(1, ("a",)) is not factory(2, ("a",))
    assert factory([1]) is not factory([1])  # a list: called straight through, no error
    assert len(built) == 4
    assert rl_batch.logprobs_fn(7) is rl_batch.logprobs_fn(7)
    assert rl_batch.logprobs_fn(7) is not rl_batch.logprobs_fn(8)


def test_a_second_engine_and_train_step_of_equal_arguments_compile_nothing():
    cfg = tiny_config(vocab_size=96, eos_token_id=None, num_layers=1)
    params = ModelDef(cfg).init(jax.random.key(3))
    engine_cfg = EngineConfig(num_slots=2, page_size=4, max_prompt_len=8, max_new_tokens=3)
    prompts = [[5, 6, 7], [8, 9]]
    greedy = SamplingParams(greedy=True, stop_ids=())
    first = DecodeEngine(ModelDef(cfg), None, "dp_tp", engine_cfg).generate(params, prompts, greedy)
    before = backend_compile_count()
    again = DecodeEngine(ModelDef(cfg), None, "dp_tp", engine_cfg).generate(params, prompts, greedy)
    assert backend_compile_count() == before
    assert again.completion_ids == first.completion_ids
    # A different config is a different engine: its programs compile.
    other = EngineConfig(num_slots=2, page_size=4, max_prompt_len=8, max_new_tokens=4)
    DecodeEngine(ModelDef(cfg), None, "dp_tp", other).generate(params, prompts, greedy)
    assert backend_compile_count() > before

    mesh = make_mesh("fsdp=2")
    opt = make_optimizer(OptimizerConfig(learning_rate=1e-3))
    assert make_optimizer(OptimizerConfig(learning_rate=1e-3)) is opt
    loss, other_loss = (lambda module, batch: (0.0, {})), (lambda module, batch: (0.0, {}))
    step = make_train_step(ModelDef(cfg), opt, loss, mesh, "fsdp_tp")
    assert make_train_step(ModelDef(cfg), opt, loss, mesh, "fsdp_tp") is step
    assert make_train_step(ModelDef(cfg), opt, other_loss, mesh, "fsdp_tp") is not step
    assert make_train_step(ModelDef(cfg), opt, loss, mesh, "fsdp_tp", microbatches=2) is not step


def test_training_losses_are_shared_by_configs_that_differ_only_outside_the_loss():
    """Runs whose RLConfigs differ in what the loss never reads (iterations, checkpointing,
    staleness) get the same loss functions, hence the same train steps; a loss setting, or the
    KL estimator of a KL loss term, gives another."""
    base = RLConfig(clip_eps=0.2, loss_agg="token-mean")
    elsewhere = dataclasses.replace(
        base, iterations=3, async_checkpoint=False, asynchrony=Asynchrony(max_staleness=1)
    )
    assert actor_loss(8, base, True) is actor_loss(8, elsewhere, True)
    assert critic_loss(8, base) is critic_loss(8, elsewhere)
    assert actor_loss(8, base, True) is not actor_loss(
        8, dataclasses.replace(base, clip_eps=0.3), True
    )
    assert critic_loss(8, base) is not critic_loss(8, dataclasses.replace(base, value_clip_eps=0.5))
    assert actor_loss(8, base, True) is not actor_loss(8, base, False)
    assert actor_loss(8, base, True, "k1") is not actor_loss(8, base, True, "k3")
    # without a KL term the estimator does not reach the loss
    assert actor_loss(8, base, False, "k1") is actor_loss(8, base, False, "k3")
