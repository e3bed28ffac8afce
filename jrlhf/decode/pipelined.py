"""Pipelined decode: the engine's decode chunk with the layers split over pipeline stages.

On a generation mesh with a ``stage`` axis the rule sets shard the stacked layers, and the KV
pools' layer dimension with them, over ``stage`` (jrlhf.meshes.rules): stage ``s`` of ``S``
holds layers ``[s*L/S, (s+1)*L/S)`` and those layers' KV pages. A decode step of a batch then
has to pass through the stages one after the other. Decoding one batch that way (naive
pipelined decode) leaves ``S - 1`` stages idle at every moment; Pipe-RLHF's delayed inter-batch
pipeline splits the slots into ``G = S`` groups and keeps one group at every stage.

``staged_chunk`` is the ``decode_chunk`` program of such an engine. Each tick of its loop runs
every stage at once (a ``vmap`` over the stage dimension, ``spmd_axis_name`` the stage axis, as
jrlhf.models.pipeline does for full-sequence passes):

* stage 0 embeds the last tokens of the group entering the pipeline this tick;
* stage ``s`` runs its ``L/S`` layers on the group it holds (the hidden states the previous
  stage handed on), writing that group's K/V into its own layers' pages and attending over them
  (``programs.paged_call`` under the stage ``vmap``: each device reads only its own stage's,
  data shard's and KV heads' pages);
* the last stage's output goes through the final norm and the head, and its group samples
  (``programs.advance``: stop tokens, budgets, multi-turn observation tokens as unpipelined);
* the hidden states roll one stage on (a collective permute).

Group ``g`` (of ``G <= S``) enters at ticks ``g, g + S, g + 2S, ...``: its next token enters the
tick after its last stage sampled the previous one, so a group advances one token every ``S``
ticks, and with ``G = S`` every stage holds a group at every tick. A chunk gives every group up
to ``chunk_steps`` tokens, as the unpipelined chunk gives every slot, in ``chunk_steps * S + G -
1`` ticks (the pipeline fills at the chunk's start and drains at its end, so that the host sees
a chunk's state whole: the bubble is ``(S - 1) / (chunk_steps * S + S - 1)`` of the stage-ticks
with ``G = S``, ``1 - 1/S`` with ``G = 1``). A group's rows are every ``G``-th slot of each data
shard, so slots admitted in order spread over the groups.

Every per-sequence input of a step is the unpipelined step's (the PRNG key folds in the
sequence's step index, never its slot or group), so tokens and log-probs are the unpipelined
engine's, to float rounding. ``DecodeState.pipe_counts`` counts the ticks and each stage's busy
ticks (holding a group with an active slot), for the bubble the scheduler reports.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jrlhf.decode.programs import EngineSpec, advance, paged_call
from jrlhf.decode.state import STATE_AXES, DecodeState
from jrlhf.meshes.context import activation_sharding, constrain
from jrlhf.meshes.rules import logical_to_spec
from jrlhf.models import moe, pipeline
from jrlhf.models.attention import layer_choice
from jrlhf.models.transformer import unstack_layers

# The fields of a DecodeState indexed by slot: a group's rows are taken and put back together.
SLOT_FIELDS = tuple(
    f.name
    for f in dataclasses.fields(DecodeState)
    if f.name not in ("k_pages", "v_pages", "pipe_counts")
)
IN_FLIGHT = ("act_stage", "batch", "length", "act_embed")


def group_rows(x: jax.Array, g, groups: int, shards: int) -> jax.Array:
    """The rows of group ``g`` of a slot-indexed array (slots, ...): every ``groups``-th slot of
    each data shard's, from its ``g``-th on; the shards stay in order (and on their devices)."""
    rest = x.shape[1:]
    per = x.shape[0] // (shards * groups)
    return x.reshape(shards, per, groups, *rest)[:, :, g].reshape(shards * per, *rest)


def set_group_rows(x: jax.Array, g, rows: jax.Array, groups: int, shards: int) -> jax.Array:
    """``x`` with the rows of group ``g`` (see ``group_rows``) set to ``rows``."""
    rest = x.shape[1:]
    per = x.shape[0] // (shards * groups)
    y = x.reshape(shards, per, groups, *rest)
    return y.at[:, :, g].set(rows.reshape(shards, per, *rest)).reshape(x.shape)


def chunk_ticks(spec: EngineSpec) -> int:
    """Ticks of a full chunk: the last group's ``chunk_steps``-th token leaves the last stage."""
    return spec.config.chunk_steps * spec.stages + spec.groups - 1


def _stage_pools(spec: EngineSpec, pool: jax.Array) -> jax.Array:
    """A KV pool (L, pages, ...) as (S, L/S, pages, ...), the stage dimension where the layers
    were (a split of the stage-sharded dimension: no data moves)."""
    stages = spec.stages
    spec_pool = logical_to_spec(STATE_AXES.k_pages, spec.mesh, spec.rules)
    staged = pool.reshape(stages, pool.shape[0] // stages, *pool.shape[1:])
    layout = PartitionSpec(spec_pool[0], None, *spec_pool[1:])
    return jax.lax.with_sharding_constraint(staged, NamedSharding(spec.mesh, layout))


def _stage_function(spec: EngineSpec, model, graphdef):
    """``stage_fn(stage_state, kp, vp, x, routes, lengths, table, active, stage)`` -> (x, kp,
    vp, routes): one stage's layers on the group it holds, its K/V written into and read from
    its own pools ``kp``, ``vp`` (L/S, pages, ...); ``stage`` is traced under the vmap over
    stages. ``routes`` (rows, L, k), the experts the group's token chose at the stages before,
    gains this stage's layers' (engines that record routes; else passed through)."""
    cfg = spec.cfg
    per_stage = cfg.num_layers // spec.stages
    run, windows = paged_call(spec, staged=True), cfg.layer_windows
    record = spec.config.record_routes

    def stage_fn(stage_state, kp, vp, x, routes, lengths, table, active, stage):
        first = stage * per_stage

        def attend(q, k, v, layer, cache):
            # ``layer`` is the model's index (RoPE kind, window); the pools are the stage's
            _, which = layer_choice(windows, layer)
            out, kp, vp = run(q, k, v, layer - first, *cache, table, lengths, active, which)
            return out, (kp, vp)

        params = unstack_layers(nnx.to_pure_dict(stage_state)) if cfg.unroll_layers else None
        out, (kp, vp), stats = model.layer_loop(
            graphdef, stage_state, x, lengths[:, None], attend, (kp, vp), params, first
        )
        if record:  # this stage's layers' experts (L/S, rows, 1, k) -> their rows of routes
            chosen = jnp.transpose(stats[moe.EXPERTS][:, :, 0], (1, 0, 2))
            routes = jax.lax.dynamic_update_slice_in_dim(routes, chosen, first, axis=1)
        return out, kp, vp, routes

    return stage_fn


def staged_chunk(spec: EngineSpec, params, layer_params, state, *scalars, greedy, filtered):
    """Up to ``chunk_steps`` decode steps of every slot through the pipeline stages (see the
    module's docstring); stops as soon as no slot is active. ``layer_params`` is unused: each
    stage scans (or unrolls) its own slice of the stacked layers."""
    del layer_params
    stages, groups, shards = spec.stages, spec.groups, spec.num_shards
    steps = spec.config.chunk_steps
    ticks = chunk_ticks(spec)
    stage_ids = jnp.arange(stages, dtype=jnp.int32)
    rows_of = functools.partial(group_rows, groups=groups, shards=shards)
    put_rows = functools.partial(set_group_rows, groups=groups, shards=shards)
    num_layers = spec.cfg.num_layers
    with activation_sharding(spec.mesh, spec.rules):
        model = spec.model_def.bind(params)
        graphdef, layers = nnx.split(model.layers)
        stage_state = pipeline.split_stages(layers, stages)
        stage_axis = logical_to_spec(("act_stage",), spec.mesh, spec.rules)[0]
        run_stages = jax.vmap(_stage_function(spec, model, graphdef), spmd_axis_name=stage_axis)
        kp, vp = _stage_pools(spec, state.k_pages), _stage_pools(spec, state.v_pages)
        rows = spec.config.num_slots // groups
        hidden = jnp.zeros((stages, rows, 1, spec.cfg.hidden_size), spec.cfg.jnp_dtype)
        # the experts each in-flight token chose so far travel with its hidden state
        record = spec.config.record_routes
        route_shape = (num_layers, spec.cfg.num_experts_per_tok) if record else (1, 1)
        routes = jnp.zeros((stages, rows, *route_shape), jnp.int32)
        # the pools travel staged in the loop; the state's own would be a second copy
        state = state.replace(k_pages=None, v_pages=None)

        def tick(carry):
            t, state, kp, vp, hidden, routes = carry
            entry = t - stage_ids  # the tick the group each stage holds entered stage 0
            valid = (entry >= 0) & (entry < steps * stages) & (entry % stages < groups)
            held = jnp.minimum(entry % stages, groups - 1)
            per_stage = lambda x: jax.vmap(lambda g: rows_of(x, g))(held)  # noqa: E731
            lengths, table = per_stage(state.lengths), per_stage(state.page_table)
            lengths = constrain(lengths, ("act_stage", "slots"))
            table = constrain(table, ("act_stage", "slots", None))
            active = constrain(per_stage(state.active) & valid[:, None], ("act_stage", "slots"))
            x0 = model.embed(rows_of(state.last_token, held[0])[:, None])
            hidden = jnp.where((stage_ids == 0)[:, None, None, None], x0[None], hidden)
            out, kp, vp, routes = run_stages(
                stage_state, kp, vp, constrain(hidden, IN_FLIGHT), routes, lengths, table,
                active, stage_ids,
            )  # fmt: skip
            out = constrain(out, IN_FLIGHT)
            # The last stage's group samples; its rows change only where it held one.
            last, done = held[stages - 1], valid[stages - 1]
            logits = model.logits(model.final_norm(out[stages - 1])[:, 0])
            old = {f: rows_of(getattr(state, f), last) for f in SLOT_FIELDS}
            chosen = routes[stages - 1] if record else None
            new = advance(
                spec, state.replace(**old), logits, chosen, *scalars, greedy=greedy,
                filtered=filtered,
            )  # fmt: skip
            busy = valid & jnp.any(active, axis=1)
            counts = state.pipe_counts + jnp.concatenate(
                [jnp.ones((1,), jnp.int32), busy.astype(jnp.int32)]
            )
            state = state.replace(
                pipe_counts=counts,
                **{
                    f: put_rows(getattr(state, f), last, jnp.where(done, getattr(new, f), old[f]))
                    for f in SLOT_FIELDS
                },
            )
            # each stage's output moves on to the next stage: a collective permute
            hidden = constrain(jnp.roll(out, 1, axis=0), IN_FLIGHT)
            return t + 1, state, kp, vp, hidden, jnp.roll(routes, 1, axis=0)

        def cond(carry):
            t, state = carry[:2]
            return (t < ticks) & jnp.any(state.active)

        init = (jnp.int32(0), state, kp, vp, hidden, routes)
        _, state, kp, vp, _, _ = jax.lax.while_loop(cond, tick, init)
    unstage = lambda pool: pool.reshape(num_layers, *pool.shape[2:])  # noqa: E731
    return state.replace(k_pages=unstage(kp), v_pages=unstage(vp))
