"""The fused actor-critic train step (RLHFuse): one jitted, donated program that trains the
actor and the critic of a PPO minibatch in one bidirectional pipeline over the same stages.

The actor's micro-batches flow through the stages first-to-last, the critic's last-to-first:
the critic's layer stack is laid on the ``stage`` axis in reverse (its block ``p`` on stage
``S - 1 - p``), so the two pipelines' warm-ups and drains fill each other's bubbles. Which
micro-batch of which model each stage works on at each tick is data, a table
(jrlhf.runtime.fused_schedule.Schedule: the search picks it under a memory limit); the program
executes any valid table. Per model and tick each stage reads its micro-batch's saved input,
runs its layers' forward under ``jax.vjp`` and pulls the gradient of its output back through
it when the table says backward (so a backward recomputes the forward from the saved input, as
the 1F1B step does); activations then move one stage along the model's direction and input
gradients one stage back (collective permutes), into the buffer slots the table assigned. The
loss of a micro-batch runs at its last block's stage the tick its forward ends (the LM head or
value head, under ``lax.cond`` so that ticks without one skip it), the embedding's gradient the
tick its first block's backward ends. Losses, metrics and gradients add up over the
micro-batches as the 1F1B step adds them (jrlhf.runtime.pipeline_step), and each model then
takes its own optimizer step (jrlhf.runtime.steps.apply_update): the update equals the two
separate ones.

What it costs, as built: all stages run in lockstep in one SPMD program, so at every tick each
stage computes a forward and a backward of both models and keeps the ones the table names
(``vmap`` turns a per-stage branch into a select); the table's idle slots are therefore not
the only waste. The critic's stage weights move to the reversed stages at every step (a
collective permute of its layer weights, and of their gradients back).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jrlhf.meshes.batch import check_batch_divides, shard_batch
from jrlhf.meshes.context import activation_sharding, constrain, layer_stages
from jrlhf.meshes.rules import Rules, get_rules
from jrlhf.models import pipeline
from jrlhf.models.model_def import ModelDef
from jrlhf.runtime import fused_schedule as fs
from jrlhf.runtime.pipeline_step import PipelineParts, finish, pipeline_parts
from jrlhf.runtime.steps import LossFn, TrainState, apply_update, state_shardings

_IN_FLIGHT = ("act_stage", "batch", "length", "act_embed")
_BUFFER = ("act_stage", None, "batch", "length", "act_embed")


def _flip_stages(tree: Any) -> Any:
    """Stage blocks in reverse order along the (stage-sharded) leading axis; XLA keeps the
    layout of the input for the reverse: a collective permute of the blocks between stages."""
    return jax.tree.map(lambda x: jnp.flip(x, axis=0), tree)


def run_fused(parts: tuple[PipelineParts, PipelineParts], sched: fs.Schedule) -> tuple:
    """Forward and backward of the actor's and the critic's micro-batches (``parts``, in the
    order of fused_schedule.MODELS) through the stages on the table ``sched``, gradients by
    hand: per model, (stage gradients (S, K, ...) in the model's own block order, the sum of
    its head's and embedding's gradients, the sum of its head's statistics)."""
    stages = sched.stages
    prog = fs.program(sched)
    for m, p in enumerate(parts):
        if p.micro != sched.micro[m]:
            raise ValueError(
                f"fused schedule: the table has {sched.micro[m]} {fs.MODELS[m]} micro-batches, "
                f"the {fs.MODELS[m]}'s pipeline_microbatches make {p.micro}"
            )
    stage_ids = jnp.arange(stages, dtype=jnp.int32)
    run_axis = pipeline._stage_axis()
    first = (0, stages - 1)  # the stage of each model's first block
    last = (stages - 1, 0)
    shift = (1, -1)  # where each model's activations go next

    params, totals, buffers, xs = [], [], [], {}
    for m, p in enumerate(parts):
        sp = p.stage_params if m == fs.ACTOR else _flip_stages(p.stage_params)
        params.append(sp)
        x0 = p.embed(jnp.int32(0))
        _, head_grads, stats = jax.eval_shape(p.head, jnp.int32(0), x0)
        zero = lambda t: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), t)  # noqa: E731
        totals.append((jax.tree.map(jnp.zeros_like, sp), zero(head_grads), zero(stats)))
        buf = constrain(jnp.zeros((stages, prog.slots[m], *x0.shape), x0.dtype), _BUFFER)
        buffers.append((buf, buf))  # saved inputs, gradients of the outputs
        xs[m] = x0

    def per_stage(stage_fn, block_of):
        def run(p, saved, grads, aux, stage, slot, op):
            block = block_of(stage)
            x = saved[slot]
            y, vjp = jax.vjp(lambda p, x: stage_fn(p, x, aux, block), p, x)
            back = op == 2
            cot = jnp.where(back, grads[slot], jnp.zeros_like(grads[slot]))
            d_params, dx = vjp(cot)
            keep = lambda g: jnp.where(back, g, jnp.zeros_like(g))  # noqa: E731
            return y, keep(dx), jax.tree.map(keep, d_params)

        return jax.vmap(run, spmd_axis_name=run_axis)

    runners = [
        per_stage(parts[0].stage_fn, lambda s: s),
        per_stage(parts[1].stage_fn, lambda s: stages - 1 - s),
    ]

    def write(buf, slot, value, ok):
        return buf.at[slot].set(jnp.where(ok, value, buf[slot]))

    write_stages = jax.vmap(write, spmd_axis_name=run_axis)

    def model_tick(m, carry, t):
        p = parts[m]
        (saved, grads), (g_stages, g_outer, sums) = carry
        op, micro, slot = prog.op[m][t], prog.micro[m][t], prog.slot[m][t]
        # the first block's input: this tick's embedding, into its slot
        e, e_slot = prog.embed[m][t], prog.embed_slot[m][t]
        x_in = p.embed(jnp.maximum(e, 0))
        row = saved[first[m], e_slot]
        saved = saved.at[first[m], e_slot].set(jnp.where(e >= 0, x_in, row))
        saved = constrain(saved, _BUFFER)
        aux = jax.tree.map(lambda a: a[micro], p.aux)
        y, dx, d_params = runners[m](params[m], saved, grads, aux, stage_ids, slot, op)
        y, dx = constrain(y, _IN_FLIGHT), constrain(dx, _IN_FLIGHT)
        g_stages = jax.tree.map(jnp.add, g_stages, d_params)
        # the loss of the micro-batch whose last block ran forward this tick, and the
        # gradient its backward starts from (skipped on ticks without one)
        h, h_slot = prog.head[m][t], prog.head_slot[m][t]
        shapes = jax.eval_shape(p.head, jnp.int32(0), y[last[m]])
        zeros = lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)  # noqa: E731
        dy, head_g, stats = jax.lax.cond(
            h >= 0, lambda: p.head(jnp.maximum(h, 0), y[last[m]]), zeros
        )
        g_outer = jax.tree.map(jnp.add, g_outer, head_g)
        sums = jax.tree.map(jnp.add, sums, stats)
        row = grads[last[m], h_slot]
        grads = grads.at[last[m], h_slot].set(jnp.where(h >= 0, dy, row))
        # the embedding's gradient of the micro-batch whose first block ran backward
        g_e = prog.embed_grad[m][t]
        e_shapes = jax.eval_shape(p.embed_grads, jnp.int32(0), dx[first[m]])
        e_zeros = lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), e_shapes)  # noqa: E731
        d_embed = jax.lax.cond(
            g_e >= 0, lambda: p.embed_grads(jnp.maximum(g_e, 0), dx[first[m]]), e_zeros
        )
        g_outer = jax.tree.map(jnp.add, g_outer, d_embed)
        # activations on to the next block's stage, input gradients back to the previous one
        sent = constrain(jnp.roll(y, shift[m], axis=0), _IN_FLIGHT)
        r = prog.recv_fwd[m][t]
        saved = constrain(write_stages(saved, jnp.maximum(r, 0), sent, r >= 0), _BUFFER)
        back = constrain(jnp.roll(dx, -shift[m], axis=0), _IN_FLIGHT)
        r = prog.recv_bwd[m][t]
        grads = constrain(write_stages(grads, jnp.maximum(r, 0), back, r >= 0), _BUFFER)
        return (saved, grads), (g_stages, g_outer, sums)

    def tick(carry, t):
        return tuple(model_tick(m, carry[m], t) for m in (fs.ACTOR, fs.CRITIC)), None

    # the table's arrays ride along as constants of the program, indexed by the traced tick
    as_jnp = lambda tup: tuple(jnp.asarray(a) for a in tup)  # noqa: E731
    prog = fs.Program(
        **{
            k: (as_jnp(v) if k != "slots" else v)
            for k, v in ((k, getattr(prog, k)) for k in fs.Program.__dataclass_fields__)
        }
    )
    carry = tuple((buffers[m], totals[m]) for m in (fs.ACTOR, fs.CRITIC))
    ticks = jnp.arange(sched.ticks, dtype=jnp.int32)
    carry, _ = jax.lax.scan(tick, carry, ticks)
    out = []
    for m in (fs.ACTOR, fs.CRITIC):
        g_stages, g_outer, sums = carry[m][1]
        if m == fs.CRITIC:
            g_stages = _flip_stages(g_stages)
        out.append((g_stages, g_outer, sums))
    return tuple(out)


def _replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def make_fused_train_step(
    actor: tuple[ModelDef, optax.GradientTransformation, LossFn],
    critic: tuple[ModelDef, optax.GradientTransformation, LossFn],
    mesh: Mesh,
    rules: Rules | str,
    sched: fs.Schedule,
    *,
    donate: bool = True,
) -> Callable:
    """Jitted ``step(actor_state, critic_state, actor_batch, critic_batch) -> (actor_state,
    critic_state, actor_metrics, critic_metrics)``, both states donated: the actor's and the
    critic's updates of one minibatch in one fused pipeline on ``mesh`` (which must have a
    stage axis of ``sched.stages``) on the table ``sched``. Each of ``actor`` / ``critic`` is
    (model, optimizer, loss_fn); the metrics are those of each model's own train step
    (jrlhf.runtime.steps.make_train_step), as are the updates."""
    rules = get_rules(rules)
    sched.validate()
    models = (actor, critic)
    shardings = tuple(state_shardings(m, o, mesh, rules) for m, o, _ in models)

    def step(actor_state: TrainState, critic_state: TrainState, actor_batch, critic_batch):
        states, batches = (actor_state, critic_state), (actor_batch, critic_batch)
        with activation_sharding(mesh, rules):
            stages = layer_stages()
            if stages != sched.stages:
                raise ValueError(
                    f"fused schedule: the table has {sched.stages} stages, the mesh "
                    f"{dict(mesh.shape)} {stages}"
                )
            parts = tuple(
                pipeline_parts(m, loss, st.params, b, stages, "fused")
                for (m, _, loss), st, b in zip(models, states, batches, strict=True)
            )
            sums = run_fused(parts, sched)
            out_states, out_metrics = [], []
            for (model, opt, _), st, (g_stages, g_rest, stats) in zip(
                models, states, sums, strict=True
            ):
                value, metrics, grads = finish(model, g_stages, g_rest, stats)
                new_state, metrics = apply_update(model, opt, st, value, metrics, grads)
                out_states.append(new_state)
                out_metrics.append(metrics)
        return (*out_states, *out_metrics)

    jitted = jax.jit(
        step,
        in_shardings=(*shardings, None, None),
        out_shardings=(*shardings, _replicated(mesh), _replicated(mesh)),
        donate_argnums=(0, 1) if donate else (),
    )

    def run(actor_state, critic_state, actor_batch, critic_batch):
        for b in (actor_batch, critic_batch):
            check_batch_divides(b, mesh, rules, 1)
        ab, cb = (shard_batch(b, mesh, rules) for b in (actor_batch, critic_batch))
        return jitted(actor_state, critic_state, ab, cb)

    run.jitted = jitted
    return run
