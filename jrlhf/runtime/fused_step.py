"""The fused actor-critic train step (RLHFuse): one jitted, donated program that trains the
actor and the critic of a PPO minibatch in one bidirectional pipeline over the same stages.

The actor's micro-batches flow through the stages first-to-last, the critic's last-to-first:
the critic's layer stack is laid on the ``stage`` axis in reverse (its block ``p`` on stage
``S - 1 - p``), so the two pipelines' warm-ups and drains fill each other's bubbles. Which
micro-batch of which model each stage works on at each tick is data, a table
(jrlhf.models.fused_schedule.Schedule: the search picks it under a memory limit); the program
executes any valid table. Per model and tick each stage reads its micro-batch's saved input,
runs its layers' forward under ``jax.vjp`` and pulls the gradient of its output back through
it when the table says backward (so a backward recomputes the forward from the saved input, as
the 1F1B step does); activations then move one stage along the model's direction and input
gradients one stage back (collective permutes), into the buffer slots the table assigned. The
loss of a micro-batch runs at its last block's stage the tick its forward ends (the LM head or
value head, under ``lax.cond`` so that ticks without one skip it), the embedding's gradient from
the input gradient of its first block's backward. Losses, metrics and gradients add up over the
micro-batches as the 1F1B step adds them (jrlhf.runtime.pipeline_step), and each model then
takes its own optimizer step (jrlhf.runtime.steps.apply_update): the update equals the two
separate ones.

How it runs (``run_fused``): where the mesh has no axis but the stage axes (a device, or a
process, a stage), each stage runs its own program (``_run_per_stage``: ``shard_map`` manual
over the stage axis, a ``lax.switch`` per tick on the stage's own table slot), so an idle slot
costs nothing and a tick costs its slowest stage's op, which the sends ending the tick wait for
(``Schedule.critical_path``). Where the mesh also splits a stage's work (fsdp, tensor, data
axes), that work holds the compiler's collectives, and stages in different branches would wait
on each other's: there all stages run in lockstep (``_run_lockstep``), each computing a forward
and a backward of both models at every tick and keeping the ones the table names, so idle slots
cost as much as busy ones. The critic's stage weights move to the reversed stages at every step
(a collective permute of its layer weights, and of their gradients back).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jrlhf.meshes.batch import check_batch_divides, shard_batch
from jrlhf.meshes.context import activation_sharding, constrain, current_rules, layer_stages
from jrlhf.meshes.rules import Rules, get_rules
from jrlhf.models import fused_schedule as fs
from jrlhf.models import pipeline
from jrlhf.models.model_def import ModelDef
from jrlhf.runtime.pipeline_step import PipelineParts, finish, pipeline_parts
from jrlhf.runtime.steps import LossFn, TrainState, apply_update, state_shardings

_IN_FLIGHT = ("act_stage", "batch", "length", "act_embed")
_BUFFER = ("act_stage", None, "batch", "length", "act_embed")


def _flip_stages(tree: Any) -> Any:
    """Stage blocks in reverse order along the (stage-sharded) leading axis; XLA keeps the
    layout of the input for the reverse: a collective permute of the blocks between stages."""
    return jax.tree.map(lambda x: jnp.flip(x, axis=0), tree)


def _tables(sched: fs.Schedule) -> dict[str, Any]:
    """Per (tick, stage), what the stage's program does: ``branch`` 0 idle, ``1 + 2 model +
    backward`` the op; ``micro`` and ``slot`` its micro-batch and buffer slot; per model,
    ``recv_fwd`` / ``recv_bwd`` the slot the activation / input gradient arriving at the end of
    the tick goes to (-1: none). A stage's loss, embedding and embedding gradient follow from
    its op (its model's last or first block), so they need no table of their own. ``slots``:
    the buffer slots a stage needs, per model (``fused_schedule.program``)."""
    prog = fs.program(sched)
    branch = np.zeros((sched.ticks, sched.stages), np.int32)
    micro = np.zeros_like(branch)
    slot = np.zeros_like(branch)
    for m in (fs.ACTOR, fs.CRITIC):
        on = prog.op[m] > 0
        branch[on] = 1 + 2 * m + (prog.op[m][on] - 1)
        micro[on], slot[on] = prog.micro[m][on], prog.slot[m][on]
    return {
        "branch": branch,
        "micro": micro,
        "slot": slot,
        "recv_fwd": np.stack(prog.recv_fwd, axis=-1),
        "recv_bwd": np.stack(prog.recv_bwd, axis=-1),
        "slots": prog.slots,
    }


def run_fused(parts: tuple[PipelineParts, PipelineParts], sched: fs.Schedule, mesh: Mesh) -> tuple:
    """Forward and backward of the actor's and the critic's micro-batches (``parts``, in the
    order of fused_schedule.MODELS) through the stages on the table ``sched``, gradients by
    hand: per model, (stage gradients (S, K, ...) in the model's own block order, the sum of
    its head's and embedding's gradients, the sum of its head's statistics). Per stage
    (``_run_per_stage``) where every mesh axis but the stage axes has size 1, in lockstep
    (``_run_lockstep``) otherwise."""
    for m, p in enumerate(parts):
        if p.micro != sched.micro[m]:
            raise ValueError(
                f"fused schedule: the table has {sched.micro[m]} {fs.MODELS[m]} micro-batches, "
                f"the {fs.MODELS[m]}'s pipeline_microbatches make {p.micro}"
            )
    stage_axes = _names(pipeline._stage_axis())
    if all(size == 1 for name, size in mesh.shape.items() if name not in stage_axes):
        return _run_per_stage(parts, sched, mesh)
    return _run_lockstep(parts, sched)


def _run_lockstep(parts: tuple[PipelineParts, PipelineParts], sched: fs.Schedule) -> tuple:
    """``run_fused`` in one SPMD program with all stages in lockstep: at every tick each stage
    computes a forward and a backward of both models and keeps the ones the table names
    (``vmap`` turns a per-stage branch into a select), so the table's idle slots cost a
    forward and a backward too. For meshes that split a stage's work over other axes: there
    the compiler's collectives of those axes sit inside the stage's work, and in per-stage
    branches (``_run_per_stage``) the stages, taking different branches, would wait on each
    other's collectives (one SPMD collective spans every device of the program)."""
    stages = sched.stages
    prog = fs.program(sched)
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


def _run_per_stage(
    parts: tuple[PipelineParts, PipelineParts], sched: fs.Schedule, mesh: Mesh
) -> tuple:
    """``run_fused`` as one program per stage: ``shard_map`` manual over the stage axis, each
    stage reading its own table row at each tick and taking one branch of a ``lax.switch``:
    idle, or the forward or backward of the model and micro-batch the table names, so an idle
    slot runs nothing. The sends are four ``ppermute`` every tick on every stage (each model's
    activations one stage along its direction, input gradients one back), outside the
    branches, which hold no collective (the caller's mesh has no other axis to split a stage's
    work over): a collective inside a branch would wait for the stages that took another."""
    stages = sched.stages
    tab = _tables(sched)
    axis = pipeline._stage_axis()
    first = (0, stages - 1)  # the stage of each model's first block
    last = (stages - 1, 0)
    # each model's activations go one stage on (the critic's towards stage 0), gradients back
    on = [[(s, (s + d) % stages) for s in range(stages)] for d in (1, -1)]
    back = [on[1], on[0]]

    xs, zeros_outer = [], []
    for p in parts:
        x0 = jax.eval_shape(p.embed, jnp.int32(0))
        _, head_grads, stats = jax.eval_shape(p.head, jnp.int32(0), x0)
        xs.append(x0)
        zeros_outer.append((head_grads, stats))
    zero = lambda t: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), t)  # noqa: E731

    rules = current_rules()

    def per_stage(*args):
        # the models' sharding constraints, on the other axes, must name the mesh as the body
        # sees it: its stage axis manual
        with activation_sharding(jax.sharding.get_abstract_mesh(), rules):
            return stage_program(*args)

    def stage_program(actor_params, critic_params, inputs):
        s = jax.lax.axis_index(axis)
        params = [jax.tree.map(lambda a: a[0], sp) for sp in (actor_params, critic_params)]
        blocks = (s, stages - 1 - s)  # the model's layer block this stage holds
        table = {k: jnp.asarray(v) for k, v in tab.items() if k != "slots"}

        def forward(m, state, i, k):
            """Model ``m``'s forward of micro-batch ``i`` from slot ``k`` (on its first
            block's stage from its embedding; its loss after, on its last block's, whose
            gradient the backward starts from)."""
            p, (saved, grads, d_in, g_stages, g_outer, sums) = parts[m], state[m]
            aux = jax.tree.map(lambda a: a[i], p.aux)
            x = _act(jnp.where(s == first[m], inputs[m][i], saved[k]))
            saved = _buf(saved.at[k].set(x))
            y = _act(p.stage_fn(params[m], x, aux, blocks[m]))

            def with_head():
                dy, head_g, stats = p.head(i, y)
                add = lambda a, b: jax.tree.map(jnp.add, a, b)  # noqa: E731
                return _buf(grads.at[k].set(dy)), add(g_outer, head_g), add(sums, stats)

            grads, g_outer, sums = jax.lax.cond(
                s == last[m], with_head, lambda: (_buf(grads), g_outer, sums)
            )
            return (saved, grads, d_in, g_stages, g_outer, sums), y, _act(jnp.zeros_like(y))

        def backward(m, state, i, k):
            """Model ``m``'s backward of micro-batch ``i`` in slot ``k``: the forward
            recomputed from the saved input under ``jax.vjp`` (as the 1F1B step does); on
            its first block's stage the input gradient is the embedding's, kept for after."""
            p, (saved, grads, d_in, g_stages, g_outer, sums) = parts[m], state[m]
            aux = jax.tree.map(lambda a: a[i], p.aux)
            y, vjp = jax.vjp(lambda q, x: p.stage_fn(q, x, aux, blocks[m]), params[m], saved[k])
            d_params, dx = vjp(grads[k])
            dx = _act(dx)
            g_stages = jax.tree.map(jnp.add, g_stages, d_params)
            d_in = _micro(d_in.at[i].set(jnp.where(s == first[m], dx, d_in[i])))
            return (saved, grads, d_in, g_stages, g_outer, sums), _act(jnp.zeros_like(y)), dx

        def branch(run, m):
            def go(state, i, k):
                new, y, dx = run(m, state, i, k)
                sends = [(_act(jnp.zeros(x.shape, x.dtype)),) * 2 for x in xs]
                sends[m] = (y, dx)
                return tuple(new if n == m else state[n] for n in (0, 1)), tuple(sends)

            return go

        def idle(state, i, k):
            return state, tuple((_act(jnp.zeros(x.shape, x.dtype)),) * 2 for x in xs)

        branches = [idle] + [branch(run, m) for m in (0, 1) for run in (forward, backward)]

        def tick(state, t):
            at = lambda name: table[name][t, s]  # noqa: E731
            state, sends = jax.lax.switch(at("branch"), branches, state, at("micro"), at("slot"))
            out = []
            for m in (fs.ACTOR, fs.CRITIC):
                saved, grads, *acc = state[m]
                y, dx = sends[m]
                y, dx = jax.lax.ppermute(y, axis, on[m]), jax.lax.ppermute(dx, axis, back[m])
                r_f, r_b = table["recv_fwd"][t, s, m], table["recv_bwd"][t, s, m]
                saved = _buf(_write(saved, r_f, y))
                grads = _buf(_write(grads, r_b, dx))
                out.append((saved, grads, *acc))
            return tuple(out), None

        state = []
        for m in (fs.ACTOR, fs.CRITIC):
            buf = _buf(jnp.zeros((tab["slots"][m], *xs[m].shape), xs[m].dtype))
            d_in = _micro(jnp.zeros_like(inputs[m]))
            g_stages = jax.tree.map(jnp.zeros_like, params[m])
            state.append((buf, buf, d_in, g_stages, *(zero(z) for z in zeros_outer[m])))
        state, _ = jax.lax.scan(tick, tuple(state), jnp.arange(sched.ticks, dtype=jnp.int32))
        out = []
        for m in (fs.ACTOR, fs.CRITIC):
            _, _, d_in, g_stages, g_outer, sums = state[m]
            g_stages = jax.tree.map(lambda g: g[None], g_stages)
            # the losses ran on one stage, the embeddings' input gradients on one: their
            # sums everywhere
            out.append((g_stages, *jax.lax.psum((d_in, g_outer, sums), axis)))
        return tuple(out)

    # The embeddings (a gather from the table) and their gradients (a scatter-add into it)
    # run before and after the per-stage programs, for every micro-batch at once: one of each
    # a model and step, not one a micro-batch in the first stage's branches (the stages keep
    # the minibatch's embeddings and their gradients, the size of its activations).
    inputs = tuple(_micro(jax.vmap(p.embed)(jnp.arange(p.micro))) for p in parts)
    params = (parts[0].stage_params, _flip_stages(parts[1].stage_params))
    stage_spec, whole = PartitionSpec(axis), PartitionSpec()
    out = jax.shard_map(
        per_stage,
        mesh=mesh,
        in_specs=(stage_spec, stage_spec, whole),
        out_specs=tuple((stage_spec, whole, whole, whole) for _ in parts),
        axis_names=set(_names(axis)),
        check_vma=False,
    )(*params, inputs)
    result = []
    for m, (p, (g_stages, d_in, g_outer, sums)) in enumerate(zip(parts, out, strict=True)):

        def add_embed(total, step, p=p):
            m_index, dx = step
            return jax.tree.map(jnp.add, total, p.embed_grads(m_index, dx)), None

        micro = jnp.arange(p.micro)
        g_outer, _ = jax.lax.scan(add_embed, g_outer, (micro, d_in))
        g_stages = _flip_stages(g_stages) if m == fs.CRITIC else g_stages
        result.append((g_stages, g_outer, sums))
    return tuple(result)


def _act(x: jax.Array) -> jax.Array:
    """A micro-batch's activations (or their gradient) in one layout: every branch of a
    conditional must give its outputs the same one."""
    return constrain(x, ("batch", "length", "act_embed"))


def _buf(x: jax.Array) -> jax.Array:
    """A stage's buffer of micro-batch slots, laid out as ``_act`` lays out each slot."""
    return constrain(x, (None, "batch", "length", "act_embed"))


def _micro(x: jax.Array) -> jax.Array:
    """All micro-batches' activations (or gradients), laid out as ``_act`` lays out each."""
    return constrain(x, (None, "batch", "length", "act_embed"))


def _names(axis) -> tuple[str, ...]:
    return (axis,) if isinstance(axis, str) else tuple(axis)


def _write(buf: jax.Array, slot: jax.Array, value: jax.Array) -> jax.Array:
    """``buf`` with ``value`` in ``slot``, unchanged where ``slot`` is -1 (nothing arrived)."""
    k = jnp.maximum(slot, 0)
    return buf.at[k].set(jnp.where(slot >= 0, value, buf[k]))


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
            sums = run_fused(parts, sched, mesh)
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
