"""Pipeline parallelism of a full-sequence pass: the layers split over a ``stage`` mesh axis,
micro-batches flowing through the stages.

The stacked layer axis (logical ``layers``) is sharded over ``stage`` by the rule sets
(jrlhf.meshes.rules), so stage ``s`` of ``S`` holds the ``K = L / S`` consecutive layers
``[s*K, (s+1)*K)``. The pass reshapes the stack to (S, K, ...) and, at each of the schedule's
iterations, runs every stage at once as one ``vmap`` over the stage dimension, each stage on the
micro-batch it holds; then the stage outputs shift one stage on (a roll of the stage-sharded
axis, which XLA lowers to a collective permute) and stage 0 takes the next micro-batch. The
whole schedule is one traced computation inside the caller's jit, so a train step stays one
donated program and its gradients are autodiff through the schedule (the backward runs the
iterations in reverse, the permutes reversed). Everything on the other mesh axes (fsdp, tensor,
data) composes unchanged: inside the vmap the layers see an ordinary (micro-)batch.

Schedules: ``gpipe``: ``M`` micro-batches through ``S`` stages take ``M + S - 1`` iterations; in
the first and last ``S - 1`` some stages run on filler (zeros) whose results are dropped: the
bubble, ``(S - 1) / (M + S - 1)`` of the stage-iterations (``bubble_fraction``). ``one_f_one_b``
(train steps, jrlhf.runtime.pipeline_step): each micro-batch's backward right after its
forward, gradients by hand, at most ``2S - 1`` micro-batches in flight a stage.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jrlhf.meshes.context import constrain, current_mesh, current_rules
from jrlhf.meshes.rules import logical_to_spec

# stage_fn(stage_state, x_bte, aux, stage_index) -> x_bte: one stage's layers on one micro-batch;
# ``aux`` is a tree of the micro-batch's per-row inputs (positions, segment ids).
StageFn = Callable[[Any, jax.Array, Any, jax.Array], jax.Array]


def bubble_fraction(stages: int, microbatches: int, schedule: str = "gpipe") -> float:
    """The share of stage-iterations a schedule spends on filler: GPipe (S-1)/(M+S-1); 1F1B as
    built here, (2S-1)/(M+2S-1): every stage runs a forward and a backward at each of its
    M+2S-1 ticks in lockstep (one SPMD program), so the warm-up's backward slots and the
    drain's forward slots idle too."""
    if schedule == "1f1b":
        return (2 * stages - 1) / (microbatches + 2 * stages - 1) if stages > 1 else 0.0
    return (stages - 1) / (microbatches + stages - 1)


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def split_stages(state: Any, stages: int) -> Any:
    """The stacked layer state (leading ``layers`` axis of L) as (S, L/S, ...), each leaf
    constrained to keep its layout: the stage dimension on the mesh axes ``layers`` maps to, the
    layer dimension within a stage whole, the rest as the parameter's own logical axes say."""
    mesh, rules = current_mesh(), current_rules()

    def split(variable):
        value = variable[...]
        layers = value.shape[0]
        if layers % stages:
            raise ValueError(f"{layers} layers do not split over {stages} pipeline stages")
        value = value.reshape(stages, layers // stages, *value.shape[1:])
        axes = variable.get_metadata().get("axes")
        if mesh is not None and axes is not None:
            spec = logical_to_spec(tuple(axes), mesh, rules)
            spec = PartitionSpec(spec[0], None, *spec[1:])
            value = jax.lax.with_sharding_constraint(value, NamedSharding(mesh, spec))
        return variable.replace(value)

    return jax.tree.map(split, state, is_leaf=_is_variable)


def gpipe(stage_fn: StageFn, stage_state: Any, xs_mbte: jax.Array, aux_m: Any) -> jax.Array:
    """Run ``M`` micro-batches ``xs_mbte`` (M, b, T, E) through the stages of ``stage_state``
    (leaves (S, K, ...), see ``split_stages``) on the GPipe schedule; the last stage's output per
    micro-batch, (M, b, T, E). ``aux_m``: per-micro-batch inputs (leaves (M, b, ...)) that each
    stage reads for the micro-batch it holds."""
    stages = jax.tree.leaves(stage_state)[0].shape[0]
    micro = xs_mbte.shape[0]
    stage_ids = jnp.arange(stages, dtype=jnp.int32)
    in_flight_axes = ("act_stage", "batch", "length", "act_embed")
    state = constrain(jnp.zeros((stages, *xs_mbte.shape[1:]), xs_mbte.dtype), in_flight_axes)
    run_stages = jax.vmap(stage_fn, spmd_axis_name=_stage_axis())

    def iteration(state, i):
        # Stage 0 takes micro-batch i (past the last one, during the drain, a repeat whose
        # result nobody reads); stage s holds micro-batch i - s.
        first = stage_ids[:, None, None, None] == 0
        state = jnp.where(first, xs_mbte[jnp.minimum(i, micro - 1)][None], state)
        held = jnp.clip(i - stage_ids, 0, micro - 1)
        aux = jax.tree.map(lambda a: a[held], aux_m)
        out = constrain(run_stages(stage_state, state, aux, stage_ids), in_flight_axes)
        # Each stage's output moves on to the next stage (the last one's wraps to stage 0,
        # which the next iteration overwrites): a collective permute over the stage axis.
        return constrain(jnp.roll(out, 1, axis=0), in_flight_axes), out[stages - 1]

    _, last = jax.lax.scan(iteration, state, jnp.arange(micro + stages - 1, dtype=jnp.int32))
    # the last stage finishes micro-batch m at iteration m + S - 1
    return last[stages - 1 :]


def _stage_axis() -> str | tuple[str, ...] | None:
    """The mesh axes the stage dimension lives on, for the vmap's sharding constraints."""
    mesh, rules = current_mesh(), current_rules()
    if mesh is None:
        return None
    part = logical_to_spec(("act_stage",), mesh, rules)[0]
    return part


def to_microbatches(x: jax.Array, micro: int) -> jax.Array:
    """(B, ...) -> (M, B/M, ...); B must be a multiple of ``micro``."""
    return x.reshape(micro, x.shape[0] // micro, *x.shape[1:])


def pad_rows(x: jax.Array, rows: int) -> jax.Array:
    """``x`` with zero rows appended up to ``rows`` (padding rows: segment 0, attend nowhere)."""
    extra = rows - x.shape[0]
    if not extra:
        return x
    return jnp.concatenate([x, jnp.zeros((extra, *x.shape[1:]), x.dtype)])


def one_f_one_b(
    stage_fn: StageFn,
    stage_params: Any,
    aux_m: Any,
    micro: int,
    embed: Callable[[jax.Array], jax.Array],
    embed_grads: Callable[[jax.Array, jax.Array], Any],
    head: Callable[[jax.Array, jax.Array], tuple[jax.Array, Any, Any]],
) -> tuple[Any, Any, Any]:
    """Forward and backward of ``micro`` micro-batches through the stages of ``stage_params``
    (a pure tree, leaves (S, K, ...)) on the 1F1B schedule, gradients by hand (no autodiff
    through the schedule): (the stage parameters' gradients (S, K, ...), the sum of ``head``'s
    and ``embed_grads``' gradients, the sum of ``head``'s statistics).

    At tick ``t`` stage ``s`` runs the forward of micro-batch ``t - s`` and the backward of
    micro-batch ``t - (2S - 1 - s)``, so the last stage starts a micro-batch's backward the tick
    after its forward and a stage holds at most ``2S - 1`` micro-batches in flight, against
    GPipe's all ``M``: the stage keeps only each in-flight micro-batch's input (a ring of 2S)
    and recomputes its layers' forward inside the backward (``jax.vjp`` at the saved input).
    ``M + 2S - 1`` ticks; activations move one stage on and gradients one stage back per tick
    (collective permutes).

    ``embed(m)``: stage 0's input for micro-batch ``m`` (a traced index); ``embed_grads(m, dx)``:
    the gradients that input's cotangent ``dx`` gives (embedding); ``head(m, y)``: for the last
    stage's output ``y`` of micro-batch ``m``, (dy, the gradients of the parameters outside the
    stages, statistics) of the micro-batch's weighted loss.
    """
    stages = jax.tree.leaves(stage_params)[0].shape[0]
    ring = 2 * stages
    ticks = micro + 2 * stages - 1
    stage_ids = jnp.arange(stages, dtype=jnp.int32)
    in_flight = ("act_stage", "batch", "length", "act_embed")
    x0 = embed(jnp.int32(0))
    zeros = constrain(jnp.zeros((stages, *x0.shape), x0.dtype), in_flight)
    saved = jnp.zeros((stages, ring, *x0.shape), x0.dtype)
    saved = constrain(saved, ("act_stage", None, "batch", "length", "act_embed"))
    _, head_grads, stats = jax.eval_shape(head, jnp.int32(0), x0)
    zero = lambda tree: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), tree)  # noqa: E731
    totals = (jax.tree.map(jnp.zeros_like, stage_params), zero(head_grads), zero(stats))

    def per_stage(params, x, buf, cot, aux_f, aux_b, stage, f_slot, b_slot, f_ok, b_ok):
        y = stage_fn(params, x, aux_f, stage)
        buf = buf.at[f_slot].set(jnp.where(f_ok, x, buf[f_slot]))
        _, vjp = jax.vjp(lambda p, xb: stage_fn(p, xb, aux_b, stage), params, buf[b_slot])
        d_params, dx = vjp(cot)
        keep = lambda g: jnp.where(b_ok, g, jnp.zeros_like(g))  # noqa: E731
        return y, buf, keep(dx), jax.tree.map(keep, d_params)

    run_stages = jax.vmap(per_stage, spmd_axis_name=_stage_axis())

    def valid(i):
        return (i >= 0) & (i < micro), jnp.clip(i, 0, micro - 1)

    def tick(carry, t):
        fwd, bwd, saved, (g_stages, g_outer, sums) = carry
        f_ok, f = valid(t - stage_ids)
        b_ok, b = valid(t - (2 * stages - 1 - stage_ids))
        first = stage_ids[:, None, None, None] == 0
        fwd = jnp.where(first, embed(jnp.clip(t, 0, micro - 1))[None], fwd)
        aux_f, aux_b = (jax.tree.map(lambda a, i=i: a[i], aux_m) for i in (f, b))
        y, saved, dx, d_params = run_stages(
            stage_params, fwd, saved, bwd, aux_f, aux_b, stage_ids, f % ring, b % ring, f_ok, b_ok
        )
        y, dx = constrain(y, in_flight), constrain(dx, in_flight)
        g_stages = jax.tree.map(jnp.add, g_stages, d_params)
        # the last stage has just finished micro-batch t - (S - 1): its loss and the gradient
        # its backward starts from at the next tick
        m_ok, m = valid(t - (stages - 1))
        dy, head_g, stats = head(m, y[stages - 1])
        take = lambda g, ok: jnp.where(ok, g, jnp.zeros_like(g))  # noqa: E731
        g_outer = jax.tree.map(lambda a, g: a + take(g, m_ok), g_outer, head_g)
        sums = jax.tree.map(lambda a, g: a + take(g, m_ok), sums, stats)
        # stage 0 has just finished the backward of micro-batch t - (2S - 1): its embedding
        e_ok, e = valid(t - (2 * stages - 1))
        g_outer = jax.tree.map(lambda a, g: a + take(g, e_ok), g_outer, embed_grads(e, dx[0]))
        last = stage_ids[:, None, None, None] == stages - 1
        fwd = constrain(jnp.roll(y, 1, axis=0), in_flight)
        bwd = jnp.where(last, take(dy, m_ok)[None], jnp.roll(dx, -1, axis=0))
        return (fwd, constrain(bwd, in_flight), saved, (g_stages, g_outer, sums)), None

    carry = (zeros, zeros, saved, totals)
    (_, _, _, totals), _ = jax.lax.scan(tick, carry, jnp.arange(ticks, dtype=jnp.int32))
    return totals
