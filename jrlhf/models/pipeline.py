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

Schedule: GPipe. ``M`` micro-batches through ``S`` stages take ``M + S - 1`` iterations; in the
first and last ``S - 1`` some stages run on filler (zeros) whose results are dropped: the bubble,
``(S - 1) / (M + S - 1)`` of the stage-iterations (``bubble_fraction``).
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

SCHEDULES = ("gpipe",)

# stage_fn(stage_state, x_bte, aux, stage_index) -> x_bte: one stage's layers on one micro-batch;
# ``aux`` is a tree of the micro-batch's per-row inputs (positions, segment ids).
StageFn = Callable[[Any, jax.Array, Any, jax.Array], jax.Array]


def bubble_fraction(stages: int, microbatches: int) -> float:
    """The share of stage-iterations a GPipe schedule spends on filler: (S-1)/(M+S-1)."""
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
