"""The fused actor-critic pipeline (jrlhf.runtime.fused_step, docs/pipelines.md): the bubbles
of the fused and the separate 1F1B schedule tables, the fused step's deviation from each
model's own update, and its time against the separate GPipe and 1F1B steps.

    python -m benchmarks.fused_pipeline bubbles     # the tables only (pure Python, a second)
    python -m benchmarks.fused_pipeline equality    # S=2,4 x micro-batches: max deviations
    python -m benchmarks.fused_pipeline timing      # stage=2, 8 micro-batches each: ms/minibatch

On 8 fake CPU devices (set here), float32, a 4-layer model of hidden size 32 and 8 rows.
"""

from __future__ import annotations

import math
import os
import sys
import time

if "jax" not in sys.modules:
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np
import optax

from jrlhf.config import RLConfig
from jrlhf.meshes import make_mesh
from jrlhf.models import ModelDef, tiny_config
from jrlhf.models import fused_schedule as fs
from jrlhf.ppo.losses import actor_loss, critic_loss
from jrlhf.runtime.fused_step import make_fused_train_step
from jrlhf.runtime.steps import TrainState, init_train_state, make_train_step, state_shardings

P, R = 4, 6
HEADS = ("lm", "value")
SGD = optax.sgd(1.0)
RL = RLConfig(entropy_coef=0.01, kl_in_loss=True)
LOSSES = {"lm": actor_loss(P, RL, kl_in_loss=True), "value": critic_loss(P, RL)}
EQUALITY_CASES = (
    # (mesh, stages, (actor, critic) micro-batches)
    ("stage=2,fsdp=2,tensor=2", 2, (2, 2)),
    ("stage=2,fsdp=2,tensor=2", 2, (4, 8)),
    ("stage=2,fsdp=2,tensor=2", 2, (8, 8)),
    ("stage=4,fsdp=2", 4, (2, 2)),
    ("stage=4,fsdp=2", 4, (4, 4)),
    ("stage=4,fsdp=2", 4, (8, 8)),
    ("stage=4,fsdp=2", 4, (8, 2)),
    # stage axes only: the per-stage program (jrlhf.runtime.fused_step.run_fused)
    ("stage=2", 2, (4, 8)),
    ("stage=4", 4, (8, 2)),
)


def tiny(**overrides):
    base = dict(hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4, num_kv_heads=2)
    return tiny_config(vocab_size=64, **{**base, **overrides})


def rl_batch(b=8, seed=0, vocab=64):
    """A PPO minibatch of ``b`` rows (P prompt + R response columns): left-padded prompts,
    ragged responses (two rows empty), behaviour log-probs, advantages, reference log-probs, a
    KL coefficient, old values and returns; drawn from ``seed``. The pipelined-training tests
    share it (tests/models/test_pipeline_stages.py, tests/runtime/test_fused_step.py)."""
    rng = np.random.default_rng(seed)
    t = P + R
    tokens = rng.integers(0, vocab, (b, t)).astype(np.int32)
    segments = np.ones((b, t), np.int32)
    segments[::3, :2] = 0
    lengths = np.array([0, 0, 1, 1, 6, 3, 5, 2])[:b]
    mask = (np.arange(R)[None, :] < lengths[:, None]).astype(np.float32)
    old_lp = np.log(rng.uniform(0.01, 0.2, (b, R))).astype(np.float32)
    normal = lambda *s: rng.normal(size=s).astype(np.float32)  # noqa: E731
    return {
        "tokens": tokens,
        "positions": np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy(),
        "segment_ids": segments,
        "response_tokens": tokens[:, P:],
        "mask": mask,
        "old_logprobs": old_lp,
        "advantages": normal(b, R),
        "ref_logprobs": (old_lp + 0.3 * normal(b, R)).astype(np.float32),
        "kl_coef": np.full((b,), 0.1, np.float32),
        "old_values": normal(b, R),
        "returns": normal(b, R),
    }


def bubbles() -> None:
    """The markdown table of docs/pipelines.md: separate 1F1B tables vs searched fused ones."""
    print("| S | M (each) | separate: ticks | separate: bubble | fused, limit S: ticks | bubble "
          "| peak | fused, no limit: ticks | bubble | peak |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for stages in (2, 4):
        for micro in range(2, 9):
            alone = fs.table(fs.one_f_one_b_orders(stages, micro), stages, (micro, 0))
            ticks = 2 * alone.ticks  # the actor's table, then the critic's
            row = [stages, micro, ticks, f"{1 - 4 * micro / ticks:.3f}"]
            for limit in (stages, math.inf):
                found = fs.search(stages, (micro, micro), ((1, 1), (1, 1)), (1, 1), limit)
                sched = found.schedule
                row += [sched.ticks, f"{sched.bubble():.3f}", int(found.peak_memory.max())]
            print("| " + " | ".join(map(str, row)) + " |")


def reference() -> dict:
    """Each model's own update on one device: (metrics, state before, parameters after)."""
    out = {}
    for seed, head in enumerate(HEADS):
        model = ModelDef(tiny(), head=head)
        params = model.init(jax.random.key(seed))

        def loss(params, batch, model=model, head=head):
            return LOSSES[head](model.bind(params), batch)

        (value, metrics), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(
            params, rl_batch()
        )
        metrics = dict(metrics, loss=value, grad_norm=optax.tree.norm(grads), skipped=0.0)
        start = TrainState(np.int32(0), params, SGD.init(params))
        after = jax.tree.map(lambda p, g: np.asarray(p - g), params, grads)
        out[head] = (jax.tree.map(float, metrics), jax.tree.map(np.asarray, start), after)
    return out


def equality() -> None:
    """Max |fused - own update| of the metrics, gradients and parameters, per case."""
    ref = reference()
    biggest = lambda tree: max(float(np.abs(x).max()) for x in jax.tree.leaves(tree))  # noqa: E731
    for spec, stages, micro in EQUALITY_CASES:
        mesh = make_mesh(spec)
        models = {h: ModelDef(tiny(pipeline_microbatches=m), head=h) for h, m in zip(HEADS, micro)}
        sched = fs.search(stages, micro, ((1, 1), (1, 1)), (1, 1), stages).schedule
        states = [
            jax.device_put(ref[h][1], state_shardings(models[h], SGD, mesh, "fsdp_tp"))
            for h in HEADS
        ]
        step = make_fused_train_step(
            *((models[h], SGD, LOSSES[h]) for h in HEADS), mesh, "fsdp_tp", sched
        )
        *states, actor_m, critic_m = step(*states, rl_batch(), rl_batch())
        row = {}
        for h, state, metrics in zip(HEADS, states, (actor_m, critic_m)):
            want, start, after = ref[h]
            params = jax.tree.map(np.asarray, state.params)
            d_metrics = max(abs(float(metrics[k]) - v) for k, v in want.items())
            # SGD with learning rate 1: the gradients are the parameters' change
            grads = jax.tree.map(lambda b, a: b - a, start.params, params)
            want_grads = jax.tree.map(lambda b, a: b - a, start.params, after)
            d_grads = biggest(jax.tree.map(np.subtract, grads, want_grads))
            d_params = biggest(jax.tree.map(np.subtract, params, after))
            row[h] = {"metrics": d_metrics, "grads": d_grads, "params": d_params}
        print(spec, micro, "ticks", sched.ticks, row, flush=True)


def timing(stages: int = 2, micro: int = 8, calls: int = 10) -> None:
    """ms per minibatch (actor and critic) of the two GPipe steps, the two 1F1B steps and the
    fused step, the mean of ``calls`` calls after 2."""
    mesh = make_mesh("stage=2,fsdp=2,tensor=2")
    batch = rl_batch()

    def clock(run):
        run(), run()
        start = time.perf_counter()
        for _ in range(calls):
            run()
        return (time.perf_counter() - start) / calls * 1e3

    out = {}
    for schedule in ("gpipe", "1f1b"):
        cfg = dict(pipeline_microbatches=micro, pipeline_schedule=schedule)
        models = {h: ModelDef(tiny(**cfg), head=h) for h in HEADS}
        states = {h: init_train_state(models[h], SGD, mesh, "fsdp_tp") for h in HEADS}
        steps = {h: make_train_step(models[h], SGD, LOSSES[h], mesh, "fsdp_tp") for h in HEADS}

        def run(states=states, steps=steps):
            for h in HEADS:
                states[h], _ = steps[h](states[h], batch)
            jax.block_until_ready(states)

        out[schedule] = clock(run)
    models = {h: ModelDef(tiny(pipeline_microbatches=micro), head=h) for h in HEADS}
    states = [init_train_state(models[h], SGD, mesh, "fsdp_tp") for h in HEADS]
    sched = fs.search(stages, (micro, micro), ((1, 1), (1, 1)), (1, 1), stages).schedule
    step = make_fused_train_step(
        *((models[h], SGD, LOSSES[h]) for h in HEADS), mesh, "fsdp_tp", sched
    )

    def fused():
        states[0], states[1], _, _ = step(*states, batch, batch)
        jax.block_until_ready(states)

    out[f"fused ({sched.ticks} ticks)"] = clock(fused)
    print({k: round(v, 1) for k, v in out.items()}, "ms per minibatch (actor and critic)")


if __name__ == "__main__":
    what = sys.argv[1:] or ["bubbles", "equality", "timing"]
    for name in what:
        {"bubbles": bubbles, "equality": equality, "timing": timing}[name]()
