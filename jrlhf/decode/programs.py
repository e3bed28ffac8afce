"""The decode engine's device programs: pure functions of a static spec, the state and the weights.

``EngineSpec`` is what every program is a function of besides its arguments: the model, mesh,
rules and ``EngineConfig``, and what ``engine_spec`` derives from them once (the attention
kernel, the data shards, how query heads meet KV heads, the weight layout). The programs take
it first, then the weights and a ``DecodeState`` (jrlhf.decode.state), and return the new state:

* ``insert``: batched prefill of a few new prompts (rows and prompt length bucketed to powers of
  two by the scheduler, so compiles are bounded), writing their K/V into their pages and sampling
  their first token. Samples of one prompt admitted together (a GRPO group) share one prefill
  row and the prompt's full pages; each gets its own copy of the page holding the prompt's end
  (which its decode steps write into) and its own first token, drawn from the shared logits
  with its own key.
* ``decode_chunk``: a ``lax.while_loop`` of up to ``chunk_steps`` decode steps (``decode_step``)
  over all slots; it stops early once no slot is active. On a mesh with a stage axis it is
  jrlhf.decode.pipelined's ``staged_chunk`` instead: the layers run as a pipeline over the
  stages, with groups of slots in flight (the same tokens and log-probs).
* ``extend`` starts a multi-turn slot's next turn: one chunked prefill of the observation's
  tokens into the slot's pages, then the turn's first sampled token.
* ``extract`` and ``adopt`` move sequences out of one engine's state and into another's
  (migration).

The model is the trainer's own (``Transformer.embed/run_layers/logits``) with a paged ``attend``
hook, and the raw log-probs are ``token_logprobs`` of its float32 logits, so rollout and trainer
log-probs agree to float rounding. On a mesh, slots and pages are split over the data axes and kv
heads over the tensor axis; decode attention runs under ``shard_map`` so each device reads only
its own pages.

``jit_programs`` wraps them once per spec (``Programs``): donated state, explicit output
shardings. Which requests go where, and when, is the host scheduler's business
(jrlhf.decode.scheduler); nothing here keeps state between calls.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jrlhf import kernels
from jrlhf.decode.kernels import select_kernel
from jrlhf.decode.sampling import sample_tokens
from jrlhf.decode.state import (
    MOVED_ROWS,
    MOVED_ROWS2,
    STATE_AXES,
    DecodeState,
    EngineConfig,
    data_shards,
    init_state,
    layer_stages,
    moved_shardings,
    state_shardings,
)
from jrlhf.kernels import panels
from jrlhf.meshes.context import activation_sharding
from jrlhf.meshes.rules import Rules, axis_size, logical_to_spec
from jrlhf.models import moe
from jrlhf.models.attention import (
    aligned_causal_attention,
    attention_mask,
    full_attention,
    fused_attention_fits,
    layer_choice,
    layer_masks,
    masked_attention,
    select_choice,
)
from jrlhf.models.config import ModelConfig
from jrlhf.models.model_def import ModelDef
from jrlhf.models.transformer import panels_fit


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """The static side of one engine (``engine_spec`` builds it): the programs close over it,
    so a spec change means new programs, and nothing in it changes between calls."""

    model_def: ModelDef
    mesh: Mesh
    rules: Rules
    config: EngineConfig
    kernel_name: str  # the paged-attention kernel (jrlhf.decode.kernels), resolved
    kernel: Callable  # its function, the model's soft cap bound in
    num_shards: int  # data shards: slots and pages are split this many ways
    q_axes: Any  # the mesh axes the query heads are split over
    kv_select: bool  # query heads split finer than KV heads: each shard picks its own KV heads
    kernel_pick: bool  # the token choice runs as one kernel call (jrlhf.kernels' token_pick)
    weight_layout: str  # how unrolled layer copies store their kernels (see choose_layout)
    stages: int  # pipeline stages the layers (and their KV pages) are split over; 1: none
    groups: int  # groups of slots in flight through the stages (EngineConfig.pipeline_batches)

    @property
    def cfg(self) -> ModelConfig:
        return self.model_def.config

    @property
    def pages_per_shard(self) -> int:
        return self.config.total_pages // self.num_shards

    @property
    def slots_per_shard(self) -> int:
        return self.config.num_slots // self.num_shards


def engine_spec(model_def: ModelDef, mesh: Mesh, rules: Rules, config: EngineConfig) -> EngineSpec:
    """The spec of an engine for ``model_def`` on ``mesh``; a model, mesh or config it cannot
    run is refused in one line, before anything compiles."""
    cfg, ec = model_def.config, config
    if model_def.head != "lm":
        raise ValueError("DecodeEngine needs a language-model head (head='lm')")
    if ec.record_routes and not cfg.is_moe:
        raise ValueError("EngineConfig.record_routes needs a mixture-of-experts model")
    # A model with soft-capped attention scores (Gemma 2) gets a kernel that computes them
    # (select_kernel: "auto" takes the blocked one where it would take the Pallas one).
    kernel_name, kernel = select_kernel(
        ec.kernel, ec.page_size, cfg.head_dim, cfg.attn_logit_softcap
    )
    num_shards = data_shards(mesh, rules)
    tensor = axis_size(mesh, logical_to_spec(("act_kv_heads",), mesh, rules)[0])
    if ec.num_slots % num_shards:
        raise ValueError(
            f"num_slots {ec.num_slots} is not divisible by the {num_shards} data shards "
            f"of mesh {dict(mesh.shape)}"
        )
    if ec.total_pages % num_shards:
        raise ValueError(
            f"num_pages {ec.total_pages} is not divisible by the {num_shards} data shards"
        )
    if cfg.num_kv_heads % tensor:
        raise ValueError(f"{cfg.num_kv_heads} kv heads cannot be split over tensor size {tensor}")
    stages = layer_stages(mesh, rules)
    groups = (ec.pipeline_batches or stages) if stages > 1 else 1
    if stages > 1:
        check_stages(cfg, ec, stages, groups, num_shards)
    # Query heads split over more tensor shards than the KV heads are (rules that replicate
    # the KV heads, e.g. dp_tp_kv_replicated): each shard's query heads must read whole KV
    # heads, i.e. its heads and a KV head's group nest one in the other.
    q_axes = logical_to_spec(("act_heads",), mesh, rules)[0]
    q_tensor = axis_size(mesh, q_axes)
    kv_select = q_tensor > tensor
    if kv_select:
        local_heads = cfg.num_heads // q_tensor
        group = cfg.num_heads // cfg.num_kv_heads
        if cfg.num_heads % q_tensor or (local_heads % group and group % local_heads):
            raise ValueError(
                f"{cfg.num_heads} query heads over tensor size {q_tensor} do not nest "
                f"with KV groups of {group} heads"
            )
    return EngineSpec(
        model_def=model_def,
        mesh=mesh,
        rules=rules,
        config=ec,
        kernel_name=kernel_name,
        kernel=kernel,
        num_shards=num_shards,
        q_axes=q_axes,
        kv_select=kv_select,
        # The token choice in one kernel call where the backend registers one (jrlhf.kernels;
        # on CPU the native token pick): a custom call, which XLA does not partition, so one
        # device only
        kernel_pick=mesh.devices.size == 1 and kernels.usable("token_pick") is not None,
        weight_layout=choose_layout(cfg, mesh, ec.weight_layout),
        stages=stages,
        groups=groups,
    )


def check_stages(cfg: ModelConfig, ec: EngineConfig, stages: int, groups: int, shards: int):
    """One line of error for what pipelined decode over ``stages`` stages cannot run."""
    if cfg.num_layers % stages:
        raise ValueError(
            f"{cfg.num_layers} layers do not split over {stages} pipeline stages of the "
            "generation mesh"
        )
    if stages % groups:
        # more batches than stages would only wait; a divisor keeps round_slots' multiple whole
        raise ValueError(
            f"EngineConfig.pipeline_batches {ec.pipeline_batches} must be 0 or a divisor of the "
            f"generation mesh's {stages} pipeline stages"
        )
    if ec.num_slots % (shards * groups):
        raise ValueError(
            f"num_slots {ec.num_slots} is not divisible by {shards} data shards x {groups} "
            "pipelined batches (round_slots rounds to a multiple)"
        )


def choose_layout(cfg: ModelConfig, mesh: Mesh, wanted: str | None) -> str:
    """``EngineConfig.weight_layout`` (``wanted``), resolved (see there); a "panels" that cannot
    apply here is refused in one line naming why, before anything compiles."""
    cpu = jax.default_backend() == "cpu"
    why = None
    if not cpu:
        why = f"runs on CPU, not {jax.default_backend()}"
    elif jnp.dtype(cfg.jnp_dtype) != jnp.float32:
        why = f"multiplies float32, not the model's {cfg.dtype}"
    elif not panels_fit(cfg):
        why = f"needs every projection's outputs a multiple of {panels.LANES}"
    elif mesh.devices.size != 1:
        why = f"runs on a one-device mesh, not {dict(mesh.shape)}"
    elif kernels.usable("few_row_matmul") is None:
        why = kernels.why_unusable("few_row_matmul")
    if wanted == "panels" and why is not None:
        raise ValueError(f"EngineConfig.weight_layout 'panels': the few-row matmul {why}")
    if wanted is not None:
        return wanted
    if why is None and kernels.lookup("few_row_matmul").queries["fast_here"]():
        return "panels"
    return "out_major" if cpu else "in_major"


def own_kv_heads(q_local, k_pool, v_pool, cfg, q_axis):
    """Inside a tensor shard whose pools hold every KV head (replicated over ``tensor``) but
    whose query heads are a slice: the pools' KV heads that slice reads (contiguous, since a
    shard's heads and a KV head's group nest), selected by the shard's index on ``q_axis``, the
    mesh axis the query heads are split over."""
    local_heads = q_local.shape[2]
    group = cfg.num_heads // cfg.num_kv_heads
    count = max(1, local_heads // group)
    first = jax.lax.axis_index(q_axis) * local_heads // group
    take = lambda pool: jax.lax.dynamic_slice_in_dim(pool, first, count, axis=3)  # noqa: E731
    return take(k_pool), take(v_pool)


def sample(spec: EngineSpec, logits, step_keys, temperature, top_k, top_p, greedy, filtered):
    """``sample_tokens`` of one step, with the token-pick kernel where it applies."""
    return sample_tokens(
        logits,
        step_keys,
        temperature,
        top_k,
        top_p,
        greedy=greedy,
        filtered=filtered,
        kernel_pick=spec.kernel_pick,
    )


def is_stop(tok, stop_ids):
    """Whether each of ``tok`` is one of ``stop_ids`` (padded with -1, which no token is)."""
    return jnp.any(tok[:, None] == stop_ids[None, :], axis=-1)


def insert(
    spec: EngineSpec,
    params,
    state,
    tokens_nt,
    lens_n,
    page_rows_np,
    slots_m,
    src_m,
    copy_page_m,
    seeds_m,
    prompt_idx_m,
    sample_idx_m,
    max_new_m,
    stop_ids,
    turn_stop_ids,
    turn_tokens,
    temperature,
    top_k,
    top_p,
    *,
    greedy,
    filtered,
):
    """Prefill ``n`` prompts (rows with length 0 are padding) into the pages of
    ``page_rows_np`` and start ``m`` samples: sample ``j`` continues prompt row ``src_m[j]``
    in slot ``slots_m[j]`` (out of range: padding). ``copy_page_m[j]`` (out of range: none)
    receives a copy of the prompt's last, partial page for a sample that shares the row's
    full pages but must write its own tokens after the prompt."""
    n, t = tokens_nt.shape
    lens_m = lens_n[src_m]
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (n, t))
    attend = prefill_attend(spec, positions, lens_n, page_rows_np, src_m, copy_page_m)
    with activation_sharding(spec.mesh, spec.rules):
        model = spec.model_def.bind(params)
        hidden, (kp, vp), layer_stats = model.run_layers(
            model.embed(tokens_nt),
            positions,
            attend,
            (state.k_pages, state.v_pages),
            with_stats=True,
        )
        last_col = jnp.maximum(lens_n - 1, 0)
        last = jnp.take_along_axis(hidden, last_col[:, None, None], axis=1)
        logits = model.logits(last[:, 0])[src_m]
    routes = state.routes
    if spec.config.record_routes:  # the prompt's last token's experts (L, n, t, k) -> (m, L, k)
        chosen = layer_stats[moe.EXPERTS][:, jnp.arange(n), last_col]
        chosen = jnp.transpose(chosen, (1, 0, 2))[src_m]
        routes = routes.at[slots_m, 0].set(chosen, mode="drop")

    keys = sequence_keys(seeds_m, prompt_idx_m, sample_idx_m)
    step_keys = jax.vmap(jax.random.fold_in)(keys, jnp.zeros_like(sample_idx_m))
    tok, slp, rlp = sample(spec, logits, step_keys, temperature, top_k, top_p, greedy, filtered)
    turn_left = turn_tokens - 1
    done = is_stop(tok, stop_ids) | (max_new_m <= 1)
    done |= is_stop(tok, turn_stop_ids) | (turn_left <= 0)
    put = _slot_setter(slots_m)
    return state.replace(
        k_pages=kp,
        v_pages=vp,
        lengths=put(state.lengths, lens_m),
        last_token=put(state.last_token, tok),
        num_generated=put(state.num_generated, jnp.ones_like(lens_m)),
        max_new=put(state.max_new, max_new_m),
        active=put(state.active, ~done),
        keys=put(state.keys, keys),
        tokens=state.tokens.at[slots_m, 0].set(tok, mode="drop"),
        sampling_lp=state.sampling_lp.at[slots_m, 0].set(slp, mode="drop"),
        raw_lp=state.raw_lp.at[slots_m, 0].set(rlp, mode="drop"),
        policy=state.policy.at[slots_m, 0].set(True, mode="drop"),
        turn_left=put(state.turn_left, jnp.broadcast_to(turn_left, lens_m.shape)),
        routes=routes,
    )


def sequence_keys(seeds_m, prompt_idx_m, sample_idx_m):
    """Each sequence's PRNG key: its seed, folded with its prompt's index where that is >= 0
    (one seed for the whole call; -1: a seed of its own) and with its sample's index. Step
    ``j``'s key folds in ``j``, so a sequence draws the same tokens in any slot or batch."""
    keys = jax.vmap(jax.random.PRNGKey)(seeds_m)
    keys = jnp.where(
        (prompt_idx_m >= 0)[:, None],
        jax.vmap(jax.random.fold_in)(keys, jnp.maximum(prompt_idx_m, 0)),
        keys,
    )
    return jax.vmap(jax.random.fold_in)(keys, sample_idx_m)


def prefill_attend(spec: EngineSpec, positions, lens_n, page_rows_np, src_m, copy_page_m):
    """The prefill ``attend`` hook (see ``insert``): write each prompt row's K/V into its pages
    and each sharing sample's copy of the row's last, partial page; attend within the row."""
    ps, cfg, total_pages = spec.config.page_size, spec.cfg, spec.config.total_pages
    t = positions.shape[1]
    lens_m = lens_n[src_m]
    # The partial page's positions in the prompt row, and where each copy writes them.
    part_pos_mp = (lens_m // ps * ps)[:, None] + jnp.arange(ps, dtype=jnp.int32)
    part_page_mp = jnp.where(part_pos_mp < lens_m[:, None], copy_page_m[:, None], total_pages)
    part_pos_mp = jnp.minimum(part_pos_mp, t - 1)
    part_off_mp = jnp.broadcast_to(jnp.arange(ps, dtype=jnp.int32), part_pos_mp.shape)
    valid = positions < lens_n[:, None]
    segments = valid.astype(jnp.int32)
    mask = layer_masks(positions, segments, cfg.layer_windows)
    page_idx = jnp.take_along_axis(page_rows_np, positions // ps, axis=1)
    page_idx = jnp.where(valid, page_idx, total_pages)  # padding writes are dropped
    offsets = positions % ps
    aligned = (
        cfg.fused_attention and not cfg.sliding_window and fused_attention_fits(t, t, cfg.head_dim)
    )

    def attend(q, k, v, layer, cache):
        kp, vp = cache
        kp = kp.at[layer, page_idx, offsets].set(k.astype(kp.dtype), mode="drop")
        vp = vp.at[layer, page_idx, offsets].set(v.astype(vp.dtype), mode="drop")
        # Copy-on-write of the shared prompt's last page, written straight from this layer's
        # K/V (the same values the row's own page receives).
        part_k = k[src_m[:, None], part_pos_mp].astype(kp.dtype)
        part_v = v[src_m[:, None], part_pos_mp].astype(vp.dtype)
        kp = kp.at[layer, part_page_mp, part_off_mp].set(part_k, mode="drop")
        vp = vp.at[layer, part_page_mp, part_off_mp].set(part_v, mode="drop")
        if aligned:  # prompts start at column 0: no bias needed
            return aligned_causal_attention(q, k, v), (kp, vp)
        out = full_attention(q, k, v, mask(layer), cfg.fused_attention, cfg.attn_logit_softcap)
        return out, (kp, vp)

    return attend


def paged_call(spec: EngineSpec, staged: bool = False):
    """``run(q, k, v, layer, kp, vp, table, lengths, active, which)`` -> (out, kp, vp): one
    layer's decode attention under ``shard_map``, each device writing this step's K/V into
    its own pages and attending over them. ``layer`` indexes the pools given; ``which`` is
    the layer's sliding-window choice (``layer_choice``), an int or traced. ``staged``: the
    pools are one pipeline stage's (a vmap over the stages adds the stage axis, see
    jrlhf.decode.pipelined), so their layer dimension is whole here."""
    mesh, rules = spec.mesh, spec.rules
    ps, windows, kernel = spec.config.page_size, spec.cfg.layer_windows, spec.kernel
    cfg, select, q_axis = spec.cfg, spec.kv_select, spec.q_axes
    part = lambda *axes: logical_to_spec(axes, mesh, rules)  # noqa: E731
    q_spec = part("slots", None, "act_heads", "head_dim")
    kv_spec = part("slots", None, "act_kv_heads", "head_dim")
    pool_spec = part(*STATE_AXES.k_pages)
    if staged:
        pool_spec = PartitionSpec(None, *pool_spec[1:])
    slot_spec = part("slots")
    table_spec = part("slots", None)
    options, _ = layer_choice(windows, 0)

    def local(static_which, q, k, v, layer, kp, vp, table, lengths, active, which=None):
        local_pages = kp.shape[1]
        page = jnp.take_along_axis(table, (lengths // ps)[:, None], axis=1)[:, 0]
        page = jnp.where(active, page, local_pages)  # idle slots write nowhere
        off = lengths % ps
        kp = kp.at[layer, page, off].set(k[:, 0].astype(kp.dtype), mode="drop")
        vp = vp.at[layer, page, off].set(v[:, 0].astype(vp.dtype), mode="drop")
        # Idle slots attend over nothing: their table rows hold out-of-range page ids and
        # their lengths are stale, which a kernel without bounds checks would read through.
        kv_len = jnp.where(active, lengths + 1, 0)
        if select:  # this shard's query heads read only their own KV heads
            kp_q, vp_q = own_kv_heads(q, kp, vp, cfg, q_axis)
        else:
            kp_q, vp_q = kp, vp
        # The kernels take the sliding window as a constant: the layer's own where it is
        # known here (the layers unrolled, or all alike), else a switch over the model's
        # distinct windows (two for Gemma's sliding and full layers under the scanned loop).
        args = (q[:, 0], kp_q, vp_q, layer, table, kv_len)
        cases = [lambda *a, w=w: kernel(*a, w) for w in options]
        if static_which is not None:
            out = cases[static_which](*args)
        else:
            out = jax.lax.switch(which, cases, *args)
        return out[:, None], kp, vp

    in_specs = (
        q_spec,
        kv_spec,
        kv_spec,
        PartitionSpec(),
        pool_spec,
        pool_spec,
        table_spec,
        slot_spec,
        slot_spec,
    )

    def mapped(static_which):
        traced = static_which is None
        return jax.shard_map(
            functools.partial(local, static_which),
            mesh=mesh,
            in_specs=in_specs + ((PartitionSpec(),) if traced else ()),
            out_specs=(q_spec, pool_spec, pool_spec),
            check_vma=False,
        )

    def run(q, k, v, layer, kp, vp, table, lengths, active, which):
        static = isinstance(which, int)
        args = (q, k, v, jnp.asarray(layer, jnp.int32), kp, vp, table, lengths, active)
        return mapped(which if static else None)(*args, *(() if static else (which,)))

    return run


def paged_attend(spec: EngineSpec, state: DecodeState):
    """The decode ``attend`` hook: write this step's K/V into its page, attend over pages."""
    run, windows = paged_call(spec), spec.cfg.layer_windows

    def attend(q, k, v, layer, cache):
        kp, vp = cache
        _, which = layer_choice(windows, layer)
        args = (state.page_table, state.lengths, state.active, which)
        out, kp, vp = run(q, k, v, layer, kp, vp, *args)
        return out, (kp, vp)

    return attend


def decode_step(
    spec: EngineSpec,
    params,
    layer_params,
    state: DecodeState,
    stop_ids,
    turn_stop_ids,
    turn_tokens,
    temperature,
    top_k,
    top_p,
    *,
    greedy,
    filtered,
) -> DecodeState:
    """One decode step of every slot: an active slot feeds its last token, writes its K/V and
    samples; ``layer_params`` are the unrolled layer copies (None: scan ``params``' stacked
    layers). The other arguments are as for ``insert``."""
    with activation_sharding(spec.mesh, spec.rules):
        model = spec.model_def.bind(params)
        x = model.embed(state.last_token[:, None])
        hidden, (kp, vp), layer_stats = model.run_layers(
            x,
            state.lengths[:, None],
            paged_attend(spec, state),
            (state.k_pages, state.v_pages),
            layer_params,
            with_stats=True,
        )
        logits = model.logits(hidden[:, 0], layer_params)
    chosen = None
    if spec.config.record_routes:  # this step's experts (L, slots, 1, k) -> (slots, L, k)
        chosen = jnp.transpose(layer_stats[moe.EXPERTS][:, :, 0], (1, 0, 2))
    scalars = (stop_ids, turn_stop_ids, turn_tokens, temperature, top_k, top_p)
    state = advance(spec, state, logits, chosen, *scalars, greedy=greedy, filtered=filtered)
    return state.replace(k_pages=kp, v_pages=vp)


def advance(
    spec: EngineSpec,
    state: DecodeState,
    logits,
    chosen,
    stop_ids,
    turn_stop_ids,
    turn_tokens,
    temperature,
    top_k,
    top_p,
    *,
    greedy,
    filtered,
) -> DecodeState:
    """The slots of ``state`` after a step whose float32 ``logits`` (slots, vocab) they
    computed: an active slot samples, records the token and its log-probs, and stops at a stop
    token or its budget. ``chosen``: the step's experts per slot (slots, layers, k) where the
    engine records routes, else None. Every slot-indexed field is read and written, the pools
    are not: a pipelined decode passes the rows of one group of slots."""
    step_keys = jax.vmap(jax.random.fold_in)(state.keys, state.num_generated)
    tok, slp, rlp = sample(spec, logits, step_keys, temperature, top_k, top_p, greedy, filtered)
    active = state.active
    slots = jnp.arange(active.shape[0])
    turn_left = state.turn_left - active
    col = jnp.where(active, state.num_generated, state.tokens.shape[1])  # idle: dropped
    num_generated = state.num_generated + active
    done = num_generated >= state.max_new
    done |= is_stop(tok, stop_ids) | is_stop(tok, turn_stop_ids) | (turn_left <= 0)
    routes = state.routes
    if chosen is not None:
        routes = routes.at[slots, col].set(chosen, mode="drop")
    return state.replace(
        routes=routes,
        lengths=state.lengths + active,
        last_token=jnp.where(active, tok, state.last_token),
        num_generated=num_generated,
        active=active & ~done,
        tokens=state.tokens.at[slots, col].set(tok, mode="drop"),
        sampling_lp=state.sampling_lp.at[slots, col].set(slp, mode="drop"),
        raw_lp=state.raw_lp.at[slots, col].set(rlp, mode="drop"),
        policy=state.policy.at[slots, col].set(True, mode="drop"),
        turn_left=turn_left,
    )


def decode_chunk(spec: EngineSpec, params, layer_params, state, *scalars, greedy, filtered):
    """Up to ``chunk_steps`` decode steps; stops as soon as no slot is active."""
    steps = spec.config.chunk_steps

    def cond(carry):
        i, s = carry
        return (i < steps) & jnp.any(s.active)

    def body(carry):
        i, s = carry
        s = decode_step(spec, params, layer_params, s, *scalars, greedy=greedy, filtered=filtered)
        return i + 1, s

    _, state = jax.lax.while_loop(cond, body, (jnp.int32(0), state))
    return state


def extend_attend(spec: EngineSpec, positions_mt, valid_mt, page_rows_mp):
    """The ``extend`` hook: write the fed tokens' K/V (``valid_mt``) into their slots' pages
    (``page_rows_mp``, global ids), then attend over each slot's pages, everything it cached
    before and the fed tokens up to each query's own position."""
    ps, cfg, total_pages = spec.config.page_size, spec.cfg, spec.config.total_pages
    m, pages = page_rows_mp.shape
    col = jnp.minimum(positions_mt // ps, pages - 1)
    page_idx = jnp.where(valid_mt, jnp.take_along_axis(page_rows_mp, col, axis=1), total_pages)
    offsets = positions_mt % ps
    key_pos = jnp.broadcast_to(jnp.arange(pages * ps, dtype=jnp.int32), (m, pages * ps))
    # Keys past a query's position are masked, so the pages a slot has not taken (out-of-range
    # ids, read clipped) are never attended to.
    windows = cfg.layer_windows
    options, _ = layer_choice(windows, 0)
    q_seg, k_seg = jnp.ones_like(positions_mt), jnp.ones_like(key_pos)
    masks = [attention_mask(positions_mt, key_pos, q_seg, k_seg, w) for w in options]

    def attend(q, k, v, layer, cache):
        kp, vp = cache
        kp = kp.at[layer, page_idx, offsets].set(k.astype(kp.dtype), mode="drop")
        vp = vp.at[layer, page_idx, offsets].set(v.astype(vp.dtype), mode="drop")

        def gather(pool):  # (m, pages * page_size, kv_heads, head_dim), the slots' cache
            rows = jnp.take(pool[layer], page_rows_mp, axis=0, mode="clip")
            return rows.reshape(m, pages * ps, *rows.shape[3:]).astype(q.dtype)

        mask = select_choice(masks, layer_choice(windows, layer)[1])
        out = masked_attention(q, gather(kp), gather(vp), mask, cfg.attn_logit_softcap)
        return out, (kp, vp)

    return attend


def extend(
    spec: EngineSpec,
    params,
    state: DecodeState,
    slots_m,
    obs_mw,
    obs_n_m,
    page_rows_mp,
    stop_ids,
    turn_stop_ids,
    turn_tokens,
    temperature,
    top_k,
    top_p,
    *,
    greedy,
    filtered,
):
    """Slots ``slots_m`` (out of range: padding) go on with a new turn after an observation:
    one pass feeds each slot's last token and the ``obs_n_m`` tokens of ``obs_mw`` at its next
    positions, writing their K/V into its pages (``page_rows_mp``, global ids) and attending
    over everything it cached (a chunked prefill of the new tokens only, not the history); the
    last one's logits give the new turn's first token, unless the observation used up the
    sequence's budget. The observation's tokens are recorded as not the policy's, with
    log-probs 0. Tokens and log-probs equal feeding them one decode step at a time."""
    m, w = obs_mw.shape
    take = lambda a: jnp.take(a, slots_m, axis=0, mode="fill", fill_value=0)  # noqa: E731
    start, n_gen, keys = take(state.lengths), take(state.num_generated), take(state.keys)
    feed = jnp.concatenate([take(state.last_token)[:, None], obs_mw], axis=1)  # (m, w + 1)
    cols = jnp.arange(w + 1, dtype=jnp.int32)[None, :]
    after = n_gen + obs_n_m  # tokens generated once the observation is in
    room = after < take(state.max_new)  # a token left for the new turn
    positions = start[:, None] + cols
    written = (cols < (obs_n_m + room)[:, None]) & (slots_m < state.active.shape[0])[:, None]
    attend = extend_attend(spec, positions, written, page_rows_mp)
    with activation_sharding(spec.mesh, spec.rules):
        model = spec.model_def.bind(params)
        hidden, (kp, vp), layer_stats = model.run_layers(
            model.embed(feed), positions, attend, (state.k_pages, state.v_pages), with_stats=True
        )
        last = jnp.take_along_axis(hidden, obs_n_m[:, None, None], axis=1)[:, 0]
        logits = model.logits(last)
    step_keys = jax.vmap(jax.random.fold_in)(keys, after)
    tok, slp, rlp = sample(spec, logits, step_keys, temperature, top_k, top_p, greedy, filtered)
    turn_left = jnp.broadcast_to(turn_tokens - 1, tok.shape)
    done = ~room | (after + 1 >= take(state.max_new)) | (turn_left <= 0)
    done |= is_stop(tok, stop_ids) | is_stop(tok, turn_stop_ids)
    # Output column n_gen + j: observation token j, then the sampled one (column obs_n).
    sampled = cols == obs_n_m[:, None]
    out_cols = jnp.where(written, n_gen[:, None] + cols, state.tokens.shape[1])  # else dropped
    rows = jnp.broadcast_to(slots_m[:, None], out_cols.shape)
    obs_ext = jnp.concatenate([obs_mw, jnp.zeros((m, 1), obs_mw.dtype)], axis=1)
    put_cols = lambda a, x: a.at[rows, out_cols].set(x, mode="drop")  # noqa: E731
    routes = state.routes
    if spec.config.record_routes:  # each fed token's experts (L, m, t, k) -> (m, t, L, k)
        routes = put_cols(routes, jnp.transpose(layer_stats[moe.EXPERTS], (1, 2, 0, 3)))
    put = _slot_setter(slots_m)
    return state.replace(
        k_pages=kp,
        v_pages=vp,
        lengths=put(state.lengths, start + obs_n_m + room),
        last_token=put(state.last_token, tok),
        num_generated=put(state.num_generated, after + room),
        active=put(state.active, ~done),
        tokens=put_cols(state.tokens, jnp.where(sampled, tok[:, None], obs_ext)),
        sampling_lp=put_cols(state.sampling_lp, jnp.where(sampled, slp[:, None], 0.0)),
        raw_lp=put_cols(state.raw_lp, jnp.where(sampled, rlp[:, None], 0.0)),
        policy=put_cols(state.policy, sampled),
        turn_left=put(state.turn_left, turn_left),
        routes=routes,
    )


def extract(state: DecodeState, slots_m, pages_mp):
    """The decode state of slots ``slots_m`` (out of range: padding rows, inactive) with the
    KV of pages ``pages_mp`` (global ids, out of range: none), and ``state`` with those slots
    idle (their pages are released on the host)."""
    take = lambda a: jnp.take(a, slots_m, axis=0, mode="fill", fill_value=0)  # noqa: E731
    pages = lambda pool: jnp.take(pool, pages_mp, axis=1, mode="fill", fill_value=0)  # noqa: E731
    moved = {"k": pages(state.k_pages), "v": pages(state.v_pages)}
    moved.update({k: take(getattr(state, k)) for k in MOVED_ROWS + MOVED_ROWS2})
    return state.replace(active=state.active.at[slots_m].set(False, mode="drop")), moved


def adopt(state: DecodeState, moved, slots_m, pages_mp):
    """``state`` with the moved rows in slots ``slots_m`` (out of range: dropped) and their
    KV written into pages ``pages_mp`` (global ids of this engine's pool)."""
    pages = lambda pool, x: pool.at[:, pages_mp].set(x.astype(pool.dtype), mode="drop")  # noqa: E731
    put = _slot_setter(slots_m)
    return state.replace(
        k_pages=pages(state.k_pages, moved["k"]),
        v_pages=pages(state.v_pages, moved["v"]),
        **{k: put(getattr(state, k), moved[k]) for k in MOVED_ROWS + MOVED_ROWS2},
    )


def _slot_setter(slots_m):
    """``put(a, x)``: ``a`` with its rows ``slots_m`` set to ``x`` (out of range: dropped)."""
    return lambda a, x: a.at[slots_m].set(x, mode="drop")


@dataclasses.dataclass(frozen=True)
class Programs:
    """The jitted programs of one spec (``jit_programs``): each donates the state it is given
    (its pools are updated in place) and lays its output out as ``state_shardings``."""

    init: Callable  # () -> DecodeState, the empty state
    insert: Callable
    decode_chunk: Callable
    extend: Callable
    extract: Callable  # returns (state, moved rows laid out as moved_shardings)
    adopt: Callable
    state_shardings: DecodeState  # of NamedShardings
    moved_shardings: dict[str, NamedSharding]


def jit_programs(spec: EngineSpec, chunk: Callable = decode_chunk) -> Programs:
    """The programs of ``spec``, jitted (compiled on first use, once per shape); ``chunk`` is
    the decode chunk's function (``decode_chunk``, or on a staged mesh
    jrlhf.decode.pipelined's ``staged_chunk``, which builds on this module)."""
    state_out = state_shardings(spec.mesh, spec.rules)
    moved_out = moved_shardings(spec.mesh, spec.rules)
    flags = ("greedy", "filtered")
    bind = lambda fn: functools.partial(fn, spec)  # noqa: E731
    init = functools.partial(init_state, spec.config, spec.cfg, spec.num_shards, spec.stages)
    return Programs(
        init=jax.jit(init, out_shardings=state_out),
        insert=jax.jit(
            bind(insert), donate_argnums=(1,), out_shardings=state_out, static_argnames=flags
        ),
        decode_chunk=jax.jit(
            bind(chunk), donate_argnums=(2,), out_shardings=state_out, static_argnames=flags
        ),
        extend=jax.jit(
            bind(extend), donate_argnums=(1,), out_shardings=state_out, static_argnames=flags
        ),
        extract=jax.jit(extract, donate_argnums=(0,), out_shardings=(state_out, moved_out)),
        adopt=jax.jit(adopt, donate_argnums=(0,), out_shardings=state_out),
        state_shardings=state_out,
        moved_shardings=moved_out,
    )
