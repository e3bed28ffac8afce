"""Paged-KV generation with continuous batching on a generation mesh.

Device side, everything is one pure pytree (``DecodeState``): the K/V page pools, the page table,
per-slot lengths, last tokens, activity flags, PRNG keys and output buffers. Two jitted programs
act on it, both donating it so the pools are updated in place:

* ``insert``: batched prefill of a few new prompts (rows and prompt length bucketed to powers of
  two, so compiles are bounded), writing their K/V into their pages and sampling their first token.
  Samples of one prompt admitted together (a GRPO group) share one prefill row and the prompt's
  full pages; each gets its own copy of the page holding the prompt's end (which its decode steps
  write into) and its own first token, drawn from the shared logits with its own key.
* ``decode_chunk``: a ``lax.while_loop`` of up to ``chunk_steps`` decode steps over all slots; it
  stops early once no slot is active.

Host side, between chunks, a small loop harvests finished slots, frees their pages, admits waiting
prompts into free slots (back-pressure when the pool is short) and grows the page tables of running
sequences for the next chunk. It waits on the device once per chunk (for the slots' activity and
counts), plus once more to fetch outputs when a slot has finished. Compiles depend only on the
engine's shapes, never on the number of prompts.

The model is the trainer's own (``Transformer.embed/run_layers/logits``) with a paged ``attend``
hook, and the raw log-probs are ``token_logprobs`` of its float32 logits, so rollout and trainer
log-probs agree to float rounding. On a mesh, slots and pages are split over the data axes and kv
heads over the tensor axis; decode attention runs under ``shard_map`` so each device reads only its
own pages.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jrlhf import kernels
from jrlhf.decode.kernels import select_kernel
from jrlhf.decode.page_table import PageAllocator, pages_for
from jrlhf.decode.sampling import SamplingParams, sample_tokens
from jrlhf.decode.state import (
    MAX_STOP_IDS,
    MOVED_ROWS,
    MOVED_ROWS2,
    DecodeState,
    EngineConfig,
    FinishedCallback,
    FinishedRow,
    GenerationResult,
    Migration,
    data_shards,
    init_state,
    moved_shardings,
    round_slots,
    state_shardings,
)
from jrlhf.decode.turns import CONTINUING, TurnEnd, Turns, end_reason
from jrlhf.kernels import panels
from jrlhf.meshes.batch import to_host
from jrlhf.meshes.context import activation_sharding
from jrlhf.meshes.rules import Rules, axis_size, get_rules, logical_to_spec
from jrlhf.models import moe
from jrlhf.models.attention import (
    aligned_causal_attention,
    full_attention,
    fused_attention_fits,
    layer_choice,
    layer_masks,
)
from jrlhf.models.model_def import ModelDef, Params
from jrlhf.models.transformer import LayerWeights, decode_weights, panels_fit


@dataclasses.dataclass
class _Request:
    index: int
    prompt: list[int]
    prompt_index: int
    sample_index: int
    seed: int
    derived_seed: bool
    max_new: int

    @property
    def max_cached(self) -> int:
        # The last sampled token is never fed back, so it never needs a cache entry.
        return len(self.prompt) + self.max_new - 1


def _bucket(n: int, lo: int, hi: int) -> int:
    return min(hi, max(lo, 1 << max(0, n - 1).bit_length()))


def layer_copies_fit(layers: Any, share: float = 0.5, stats_of: Callable | None = None) -> bool:
    """Whether one more copy of every device's shards of ``layers`` fits in ``share`` of that
    device's free memory (the allocator's ``bytes_limit - bytes_in_use``); False where a device
    reports no memory statistics. ``stats_of(device)`` defaults to ``device.memory_stats()``."""
    stats_of = stats_of or (lambda d: d.memory_stats())
    need: collections.Counter = collections.Counter()
    for leaf in jax.tree.leaves(layers):
        if not isinstance(leaf, jax.Array):  # host arrays: placed by the call; no statistics
            return False
        shard = int(np.prod(leaf.sharding.shard_shape(leaf.shape))) * leaf.dtype.itemsize
        for device in leaf.sharding.addressable_devices:
            need[device] += shard
    for device, nbytes in need.items():
        stats = stats_of(device) or {}
        if "bytes_limit" not in stats or "bytes_in_use" not in stats:
            return False
        if nbytes > share * (stats["bytes_limit"] - stats["bytes_in_use"]):
            return False
    return True


def _own_kv_heads(q_local, k_pool, v_pool, cfg, q_axis):
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


# Engines built so far, by (model, mesh, rules, config): see DecodeEngine.__init__. Bounded, so a
# long-lived process that builds many differently shaped engines does not keep every program.
_TEMPLATES: collections.OrderedDict[tuple, DecodeEngine] = collections.OrderedDict()
_MAX_TEMPLATES = 16


class DecodeEngine:
    """Continuous-batching generator for one model on one generation mesh.

    Construct once and call ``generate`` every RL iteration: the device state (including the page
    pools) persists and is reused, programs compile on first use only, and parameters are used
    in place (pass them already sharded on ``mesh``).
    """

    def __init__(
        self,
        model_def: ModelDef,
        mesh: Mesh | None = None,
        rules: Rules | str = "dp_tp",
        config: EngineConfig | None = None,
    ):
        if mesh is None:
            mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "tensor"))
        key = (model_def, mesh, get_rules(rules), config or EngineConfig())
        template = _TEMPLATES.get(key)
        if template is None:
            template = object.__new__(DecodeEngine)
            template._build(*key)
            _TEMPLATES[key] = template
            while len(_TEMPLATES) > _MAX_TEMPLATES:
                _TEMPLATES.popitem(last=False)
        else:
            _TEMPLATES.move_to_end(key)
        # The jitted programs are the template's bound methods: jax.jit caches traces and
        # executables per function object, so an engine built again with the same model, mesh,
        # rules and config (the trainer rebuilt in one process, evaluation after training) reuses
        # them instead of tracing, lowering and compiling again. The template never holds a
        # decode state; the programs read only what _build derives from the key.
        self.__dict__.update(template.__dict__)
        self.state: DecodeState | None = None

    def _build(self, model_def: ModelDef, mesh: Mesh, rules: Rules, config: EngineConfig):
        if model_def.head != "lm":
            raise ValueError("DecodeEngine needs a language-model head (head='lm')")
        if config.record_routes and not model_def.config.is_moe:
            raise ValueError("EngineConfig.record_routes needs a mixture-of-experts model")
        self.model_def = model_def
        self.cfg = model_def.config
        self.config = config
        self.mesh = mesh
        self.rules = rules
        # A model with soft-capped attention scores (Gemma 2) gets a kernel that computes them
        # (select_kernel: "auto" takes the blocked one where it would take the Pallas one).
        self.kernel_name, self._kernel = select_kernel(
            self.config.kernel,
            self.config.page_size,
            self.cfg.head_dim,
            self.cfg.attn_logit_softcap,
        )
        ec = self.config

        self.num_shards = data_shards(mesh, self.rules)
        tensor = axis_size(mesh, logical_to_spec(("act_kv_heads",), mesh, self.rules)[0])
        if ec.num_slots % self.num_shards:
            raise ValueError(
                f"num_slots {ec.num_slots} is not divisible by the {self.num_shards} data shards "
                f"of mesh {dict(mesh.shape)}"
            )
        if ec.total_pages % self.num_shards:
            raise ValueError(
                f"num_pages {ec.total_pages} is not divisible by the {self.num_shards} data shards"
            )
        if self.cfg.num_kv_heads % tensor:
            raise ValueError(
                f"{self.cfg.num_kv_heads} kv heads cannot be split over tensor size {tensor}"
            )
        # Query heads split over more tensor shards than the KV heads are (rules that replicate
        # the KV heads, e.g. dp_tp_kv_replicated): each shard's query heads must read whole KV
        # heads, i.e. its heads and a KV head's group nest one in the other.
        self._q_axes = logical_to_spec(("act_heads",), mesh, self.rules)[0]
        q_tensor = axis_size(mesh, self._q_axes)
        self._kv_select = q_tensor > tensor
        if self._kv_select:
            local_heads = self.cfg.num_heads // q_tensor
            group = self.cfg.num_heads // self.cfg.num_kv_heads
            if self.cfg.num_heads % q_tensor or (local_heads % group and group % local_heads):
                raise ValueError(
                    f"{self.cfg.num_heads} query heads over tensor size {q_tensor} do not nest "
                    f"with KV groups of {group} heads"
                )
        self._weight_layout = self._choose_layout()
        # The token choice in one kernel call where the backend registers one (jrlhf.kernels;
        # on CPU the native token pick): a custom call, which XLA does not partition, so one
        # device only
        self._kernel_pick = mesh.devices.size == 1 and kernels.usable("token_pick") is not None
        self.pages_per_shard = ec.total_pages // self.num_shards
        self.slots_per_shard = ec.num_slots // self.num_shards
        self.state_shardings = state_shardings(mesh, self.rules)
        self._specs = jax.tree.map(
            lambda s: s.spec, self.state_shardings, is_leaf=lambda x: isinstance(x, NamedSharding)
        )
        init = functools.partial(init_state, ec, self.cfg, self.num_shards)
        self._init = jax.jit(init, out_shardings=self.state_shardings)
        self._insert = jax.jit(
            self._insert_fn,
            donate_argnums=(1,),
            out_shardings=self.state_shardings,
            static_argnames=("greedy", "filtered"),
        )
        self._decode_chunk = jax.jit(
            self._decode_chunk_fn,
            donate_argnums=(2,),
            out_shardings=self.state_shardings,
            static_argnames=("greedy", "filtered"),
        )
        # Migration (see Migration): sequences leave through _extract, arrive through _adopt.
        self.moved_shardings = moved_shardings(mesh, self.rules)
        self._extract = jax.jit(
            self._extract_fn,
            donate_argnums=(0,),
            out_shardings=(self.state_shardings, self.moved_shardings),
        )
        self._adopt = jax.jit(
            self._adopt_fn, donate_argnums=(0,), out_shardings=self.state_shardings
        )
        self._resume = jax.jit(
            self._resume_fn, donate_argnums=(0,), out_shardings=self.state_shardings
        )

    # ------------------------------------------------------------------------------ device code
    def _sample(self, logits, step_keys, temperature, top_k, top_p, greedy, filtered):
        """``sample_tokens`` of one step, with the token-pick kernel where it applies."""
        return sample_tokens(
            logits,
            step_keys,
            temperature,
            top_k,
            top_p,
            greedy=greedy,
            filtered=filtered,
            kernel_pick=self._kernel_pick,
        )

    def _is_stop(self, tok, stop_ids):
        return jnp.any(tok[:, None] == stop_ids[None, :], axis=-1)

    def _insert_fn(
        self,
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
        ps = self.config.page_size
        n, t = tokens_nt.shape
        total_pages = state.k_pages.shape[1]
        lens_m = lens_n[src_m]
        # The partial page's positions in the prompt row, and where each copy writes them.
        part_pos_mp = (lens_m // ps * ps)[:, None] + jnp.arange(ps, dtype=jnp.int32)
        part_page_mp = jnp.where(part_pos_mp < lens_m[:, None], copy_page_m[:, None], total_pages)
        part_pos_mp = jnp.minimum(part_pos_mp, t - 1)
        part_off_mp = jnp.broadcast_to(jnp.arange(ps, dtype=jnp.int32), part_pos_mp.shape)
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (n, t))
        valid = positions < lens_n[:, None]
        segments = valid.astype(jnp.int32)
        mask = layer_masks(positions, segments, self.cfg.layer_windows)
        page_idx = jnp.take_along_axis(page_rows_np, positions // ps, axis=1)
        page_idx = jnp.where(valid, page_idx, total_pages)  # padding writes are dropped
        offsets = positions % ps
        aligned = (
            self.cfg.fused_attention
            and not self.cfg.sliding_window
            and fused_attention_fits(t, t, self.cfg.head_dim)
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
            out = full_attention(
                q, k, v, mask(layer), self.cfg.fused_attention, self.cfg.attn_logit_softcap
            )
            return out, (kp, vp)

        record = self.config.record_routes
        with activation_sharding(self.mesh, self.rules):
            model = self.model_def.bind(params)
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
        if record:  # the prompt's last token's experts (L, n, t, k) -> (m, L, k)
            chosen = layer_stats[moe.EXPERTS][:, jnp.arange(n), last_col]
            chosen = jnp.transpose(chosen, (1, 0, 2))[src_m]
            routes = routes.at[slots_m, 0].set(chosen, mode="drop")

        keys = jax.vmap(jax.random.PRNGKey)(seeds_m)
        keys = jnp.where(
            (prompt_idx_m >= 0)[:, None],
            jax.vmap(jax.random.fold_in)(keys, jnp.maximum(prompt_idx_m, 0)),
            keys,
        )
        keys = jax.vmap(jax.random.fold_in)(keys, sample_idx_m)
        step_keys = jax.vmap(jax.random.fold_in)(keys, jnp.zeros_like(sample_idx_m))
        tok, slp, rlp = self._sample(logits, step_keys, temperature, top_k, top_p, greedy, filtered)
        turn_left = turn_tokens - 1
        done = self._is_stop(tok, stop_ids) | (max_new_m <= 1)
        done |= self._is_stop(tok, turn_stop_ids) | (turn_left <= 0)
        put = lambda a, x: a.at[slots_m].set(x, mode="drop")  # noqa: E731
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
            forced_n=put(state.forced_n, jnp.zeros_like(lens_m)),
            forced_i=put(state.forced_i, jnp.zeros_like(lens_m)),
            routes=routes,
        )

    def _paged_attend(self, state: DecodeState):
        """The decode ``attend`` hook: write this step's K/V into its page, attend over pages."""
        mesh, rules = self.mesh, self.rules
        ps, windows, kernel = self.config.page_size, self.cfg.layer_windows, self._kernel
        select, q_axis = self._kv_select, self._q_axes
        spec = lambda *axes: logical_to_spec(axes, mesh, rules)  # noqa: E731
        q_spec = spec("slots", None, "act_heads", "head_dim")
        kv_spec = spec("slots", None, "act_kv_heads", "head_dim")
        pool_spec = self._specs.k_pages
        slot_spec = spec("slots")
        table_spec = spec("slots", None)
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
                kp_q, vp_q = _own_kv_heads(q, kp, vp, self.cfg, q_axis)
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

        def attend(q, k, v, layer, cache):
            kp, vp = cache
            _, which = layer_choice(windows, layer)
            static = isinstance(which, int)
            args = (q, k, v, jnp.asarray(layer, jnp.int32), kp, vp)
            args += (state.page_table, state.lengths, state.active)
            out, kp, vp = mapped(which if static else None)(*args, *(() if static else (which,)))
            return out, (kp, vp)

        return attend

    def _decode_step(
        self,
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
        with activation_sharding(self.mesh, self.rules):
            model = self.model_def.bind(params)
            x = model.embed(state.last_token[:, None])
            hidden, (kp, vp), layer_stats = model.run_layers(
                x,
                state.lengths[:, None],
                self._paged_attend(state),
                (state.k_pages, state.v_pages),
                layer_params,
                with_stats=True,
            )
            logits = model.logits(hidden[:, 0], layer_params)
        step_keys = jax.vmap(jax.random.fold_in)(state.keys, state.num_generated)
        tok, slp, rlp = self._sample(logits, step_keys, temperature, top_k, top_p, greedy, filtered)
        active = state.active
        slots = jnp.arange(active.shape[0])
        # A slot feeding an observation takes its next token instead of the sample (the logits
        # of this step, after the turn's last token, are not the policy's choice of anything).
        forcing = state.forced_i < state.forced_n
        at = jnp.minimum(state.forced_i, state.forced.shape[1] - 1)
        forced_tok = jnp.take_along_axis(state.forced, at[:, None], axis=1)[:, 0]
        tok = jnp.where(forcing, forced_tok, tok)
        slp, rlp = jnp.where(forcing, 0.0, slp), jnp.where(forcing, 0.0, rlp)
        sampled = active & ~forcing
        turn_left = state.turn_left - sampled
        col = jnp.where(active, state.num_generated, state.tokens.shape[1])  # idle: dropped
        num_generated = state.num_generated + active
        done = num_generated >= state.max_new
        done |= ~forcing & (self._is_stop(tok, stop_ids) | self._is_stop(tok, turn_stop_ids))
        done |= sampled & (turn_left <= 0)
        routes = state.routes
        if self.config.record_routes:  # this step's experts (L, slots, 1, k) -> (slots, L, k)
            chosen = jnp.transpose(layer_stats[moe.EXPERTS][:, :, 0], (1, 0, 2))
            routes = routes.at[slots, col].set(chosen, mode="drop")
        return state.replace(
            routes=routes,
            k_pages=kp,
            v_pages=vp,
            lengths=state.lengths + active,
            last_token=jnp.where(active, tok, state.last_token),
            num_generated=num_generated,
            active=active & ~done,
            tokens=state.tokens.at[slots, col].set(tok, mode="drop"),
            sampling_lp=state.sampling_lp.at[slots, col].set(slp, mode="drop"),
            raw_lp=state.raw_lp.at[slots, col].set(rlp, mode="drop"),
            policy=state.policy.at[slots, col].set(~forcing, mode="drop"),
            turn_left=turn_left,
            forced_i=state.forced_i + (active & forcing),
        )

    def _decode_chunk_fn(self, params, layer_params, state, *scalars, greedy, filtered):
        """Up to ``chunk_steps`` decode steps; stops as soon as no slot is active."""
        steps = self.config.chunk_steps

        def cond(carry):
            i, s = carry
            return (i < steps) & jnp.any(s.active)

        def body(carry):
            i, s = carry
            s = self._decode_step(
                params, layer_params, s, *scalars, greedy=greedy, filtered=filtered
            )
            return i + 1, s

        _, state = jax.lax.while_loop(cond, body, (jnp.int32(0), state))
        return state

    def _resume_fn(self, state: DecodeState, slots_m, forced_mf, forced_n_m, turn_tokens):
        """Slots ``slots_m`` (out of range: padding) go on with a new turn: first the
        ``forced_n_m`` observation tokens of ``forced_mf``, then ``turn_tokens`` sampled ones."""
        put = lambda a, x: a.at[slots_m].set(x, mode="drop")  # noqa: E731
        return state.replace(
            active=put(state.active, True),
            forced=put(state.forced, forced_mf),
            forced_n=put(state.forced_n, forced_n_m),
            forced_i=put(state.forced_i, jnp.zeros_like(forced_n_m)),
            turn_left=put(state.turn_left, jnp.broadcast_to(turn_tokens, forced_n_m.shape)),
        )

    def _extract_fn(self, state: DecodeState, slots_m, pages_mp):
        """The decode state of slots ``slots_m`` (out of range: padding rows, inactive) with the
        KV of pages ``pages_mp`` (global ids, out of range: none), and ``state`` with those slots
        idle (their pages are released on the host)."""
        take = lambda a: jnp.take(a, slots_m, axis=0, mode="fill", fill_value=0)  # noqa: E731
        pages = lambda pool: jnp.take(pool, pages_mp, axis=1, mode="fill", fill_value=0)  # noqa: E731
        moved = {"k": pages(state.k_pages), "v": pages(state.v_pages)}
        moved.update({k: take(getattr(state, k)) for k in MOVED_ROWS + MOVED_ROWS2})
        return state.replace(active=state.active.at[slots_m].set(False, mode="drop")), moved

    def _adopt_fn(self, state: DecodeState, moved, slots_m, pages_mp):
        """``state`` with the moved rows in slots ``slots_m`` (out of range: dropped) and their
        KV written into pages ``pages_mp`` (global ids of this engine's pool)."""
        pages = lambda pool, x: pool.at[:, pages_mp].set(x.astype(pool.dtype), mode="drop")  # noqa: E731
        put = lambda a, x: a.at[slots_m].set(x, mode="drop")  # noqa: E731
        return state.replace(
            k_pages=pages(state.k_pages, moved["k"]),
            v_pages=pages(state.v_pages, moved["v"]),
            **{k: put(getattr(state, k), moved[k]) for k in MOVED_ROWS + MOVED_ROWS2},
        )

    def tail(self, mesh: Mesh, rows: int) -> DecodeEngine:
        """A tail engine for migration (see Migration): this engine's model, rules and shapes
        on ``mesh`` (fewer devices), with slots for ``rows`` sequences (rounded up to the mesh's
        data shards) and a pool that holds each of them at full length."""
        slots = round_slots(rows, mesh, self.rules)
        config = dataclasses.replace(
            self.config, num_slots=slots, num_pages=0, max_prefill_rows=min(slots, 64)
        )
        return DecodeEngine(self.model_def, mesh, self.rules, config)

    # -------------------------------------------------------------------------------- host code
    def unrolls(self, layers: Any) -> bool:
        """Whether this ``generate`` runs the layers unrolled (``EngineConfig.unroll_layers``)."""
        if self.config.unroll_layers is not None:
            return self.config.unroll_layers
        if jax.default_backend() == "cpu":
            return True
        return jax.process_count() == 1 and layer_copies_fit(layers)

    def weight_layout(self) -> str:
        """How the unrolled layer copies store their kernels (``EngineConfig.weight_layout``)."""
        return self._weight_layout

    def _choose_layout(self) -> str:
        """``EngineConfig.weight_layout``, resolved (see there); a "panels" that cannot apply
        here is refused in one line naming why, before anything compiles."""
        cpu = jax.default_backend() == "cpu"
        why = None
        if not cpu:
            why = f"runs on CPU, not {jax.default_backend()}"
        elif jnp.dtype(self.cfg.jnp_dtype) != jnp.float32:
            why = f"multiplies float32, not the model's {self.cfg.dtype}"
        elif not panels_fit(self.cfg):
            why = f"needs every projection's outputs a multiple of {panels.LANES}"
        elif self.mesh.devices.size != 1:
            why = f"runs on a one-device mesh, not {dict(self.mesh.shape)}"
        elif kernels.usable("few_row_matmul") is None:
            why = kernels.why_unusable("few_row_matmul")
        wanted = self.config.weight_layout
        if wanted == "panels" and why is not None:
            raise ValueError(f"EngineConfig.weight_layout 'panels': the few-row matmul {why}")
        if wanted is not None:
            return wanted
        if why is None and kernels.lookup("few_row_matmul").queries["fast_here"]():
            return "panels"
        return "out_major" if cpu else "in_major"

    def _layer_copies(self, params: Params) -> LayerWeights:
        """The per-layer weight copies unrolled decode steps run on (``unroll_layers``)."""
        return decode_weights(params, self._weight_layout)

    def compile_counts(self) -> dict[str, int]:
        """How many programs each jitted entry point has compiled (for tests and logs)."""
        return {
            "insert": self._insert._cache_size(),
            "decode_chunk": self._decode_chunk._cache_size(),
        }

    def _requests(self, prompts, sp: SamplingParams, max_new: int) -> list[_Request]:
        ec = self.config
        if sp.seeds is not None and len(sp.seeds) != len(prompts):
            raise ValueError(f"{len(sp.seeds)} seeds given for {len(prompts)} prompts")
        capacity = min(ec.max_pages_per_seq, self.pages_per_shard) * ec.page_size
        reqs = []
        for p, prompt in enumerate(prompts):
            prompt = [int(t) for t in prompt]
            if not prompt:
                raise ValueError(f"prompt {p} is empty")
            if len(prompt) > ec.max_prompt_len:
                raise ValueError(
                    f"prompt {p} has {len(prompt)} tokens, more than max_prompt_len "
                    f"{ec.max_prompt_len}"
                )
            bad = [t for t in prompt if not 0 <= t < self.cfg.vocab_size]
            if bad:
                raise ValueError(
                    f"prompt {p}: token id {bad[0]} outside vocab {self.cfg.vocab_size}"
                )
            if len(prompt) + max_new - 1 > capacity:
                raise ValueError(
                    f"prompt {p}: {len(prompt)} + {max_new} new tokens needs "
                    f"{pages_for(len(prompt) + max_new - 1, ec.page_size)} pages, but one data "
                    f"shard's pool holds {self.pages_per_shard} (and a sequence at most "
                    f"{ec.max_pages_per_seq})"
                )
            for s in range(sp.num_samples):
                seed = sp.seeds[p] if sp.seeds is not None else sp.seed
                reqs.append(
                    _Request(
                        len(reqs), prompt, p, s, int(seed) & 0xFFFFFFFF, sp.seeds is None, max_new
                    )
                )
        return reqs

    def generate(
        self,
        params: Params,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingParams | None = None,
        on_finished: FinishedCallback | None = None,
        migration: Migration | None = None,
        turns: Turns | None = None,
    ) -> GenerationResult:
        """Generate ``sampling.num_samples`` completions for every prompt (token-id lists).

        ``on_finished``, when given, receives the rows that finished in each decode chunk, once
        the next chunk has been dispatched (so the host work it does overlaps that chunk's
        decode), and the last ones after the loop; it must not touch the engine. ``migration``
        moves the last few sequences onto a tail engine on fewer devices (see Migration). The
        samples are the same with or without either. ``turns`` makes every sequence an episode
        of several turns (jrlhf.decode.turns).
        """
        sp = sampling or SamplingParams()
        ec = self.config
        max_new = sp.max_new_tokens or ec.max_new_tokens
        if max_new > ec.max_new_tokens:
            raise ValueError(
                f"max_new_tokens {max_new} exceeds the engine's max_new_tokens {ec.max_new_tokens}"
            )
        stops = self.cfg.eos_ids if sp.stop_ids is None else tuple(sp.stop_ids)
        if len(stops) > MAX_STOP_IDS:
            raise ValueError(f"at most {MAX_STOP_IDS} stop ids are supported (got {len(stops)})")
        if migration is not None:
            if ec.record_routes:
                raise ValueError("EngineConfig.record_routes does not follow migrated sequences")
            self._check_tail(migration.engine)
        self._check_turns(turns)
        requests = self._requests(prompts, sp, max_new)
        stop_ids = np.full((MAX_STOP_IDS,), -1, np.int32)
        stop_ids[: len(stops)] = stops
        turn_stop_ids = np.full((MAX_STOP_IDS,), -1, np.int32)
        turn_tokens = np.int32(2**30)  # no turn limit but the episode's
        if turns is not None:
            turn_stop_ids[: len(turns.stop_ids)] = turns.stop_ids
            turn_tokens = np.int32(turns.max_tokens or 2**30)
        scalars = (
            stop_ids,
            turn_stop_ids,
            turn_tokens,
            np.float32(sp.temperature),
            np.int32(sp.top_k),
            np.float32(sp.top_p),
        )
        flags = dict(greedy=sp.greedy, filtered=sp.filtered)
        if self.state is None:
            self.state = self._init()
        unrolled = self.unrolls(params["layers"])
        layer_params = self._layer_copies(params) if unrolled else None
        state = self.state
        self.state = None  # donated below; restored at the end
        alloc = self._allocator()
        queue = collections.deque(requests)
        slot_req: list[_Request | None] = [None] * ec.num_slots
        outputs: list[tuple | None] = [None] * len(requests)
        routes_out: list[np.ndarray | None] = [None] * len(requests)
        stats = collections.Counter()
        done_rows: list[FinishedRow] = []  # finished, not yet handed to on_finished
        active_host = np.zeros((ec.num_slots,), bool)  # as of the last sync
        num_gen = np.zeros((ec.num_slots,), np.int32)
        eng = self  # the engine decoding now: self, or the migration's tail engine
        own_state = own_alloc = None  # self's state and pages while the tail engine decodes
        t0 = time.perf_counter()
        try:
            while queue or any(r is not None for r in slot_req):
                admitted = self._admit(queue, slot_req, alloc, stats) if eng is self else []
                if admitted:
                    state = self._insert_batch(
                        params, state, admitted, alloc, scalars, flags, stats
                    )
                    stats["prefill_calls"] += 1
                    # Not synced: a slot whose first token already ended it just makes the chunk's
                    # while loop stop at once, and its pages are released below as usual.
                    for slot, _, _ in admitted:
                        active_host[slot], num_gen[slot] = True, 1
                elif all(r is None for r in slot_req):
                    raise RuntimeError("no sequence could be admitted into an empty page pool")
                for slot, req in enumerate(slot_req):
                    if req is not None and active_host[slot]:
                        cached = len(req.prompt) + int(num_gen[slot]) - 1
                        alloc.grow(slot, min(cached + ec.chunk_steps, req.max_cached))
                if alloc.dirty:
                    table = jax.device_put(alloc.table, eng.state_shardings.page_table)
                    state = state.replace(page_table=table)
                    alloc.dirty = False
                state = eng._decode_chunk(params, layer_params, state, *scalars, **flags)
                stats["decode_chunks"] += 1
                stats["tail_decode_chunks"] += eng is not self
                if on_finished is not None and done_rows:
                    on_finished(done_rows)
                    done_rows = []
                # The one sync per chunk (plus the outputs of finished slots, when there are any).
                active_host, num_gen = map(np.array, to_host((state.active, state.num_generated)))
                finished = [
                    s for s, r in enumerate(slot_req) if r is not None and not active_host[s]
                ]
                if finished:
                    fetch = (state.tokens, state.sampling_lp, state.raw_lp)
                    toks, slp, rlp, *policy = to_host(fetch + ((state.policy,) * bool(turns)))
                    if ec.record_routes:
                        routes_host = to_host(state.routes)
                    if turns is not None:
                        turn_ended = finished
                        state, finished = eng._next_turns(
                            state, turns, finished, slot_req, num_gen, toks, policy[0], stops
                        )
                        for slot in set(turn_ended) - set(finished):  # going on: a new turn
                            active_host[slot] = True
                            stats["turns"] += 1
                    for slot in finished:
                        n = int(num_gen[slot])
                        req = slot_req[slot]
                        outputs[req.index] = (
                            toks[slot, :n].tolist(),
                            slp[slot, :n].copy(),
                            rlp[slot, :n].copy(),
                            policy[0][slot, :n].copy() if policy else None,
                        )
                        if ec.record_routes:
                            routes_out[req.index] = routes_host[slot, :n].copy()
                        alloc.release(slot)
                        slot_req[slot] = None
                        if on_finished is not None:
                            row = FinishedRow(req.index, req.prompt_index, *outputs[req.index])
                            done_rows.append(row)
                running = sum(r is not None for r in slot_req)
                if migration and eng is self and not queue and 0 < running <= migration.max_rows:
                    t_mig = time.perf_counter()
                    own_state, moved = self._hand_over(
                        state, alloc, slot_req, num_gen, migration.engine
                    )
                    eng = migration.engine
                    state = eng._take_over(moved, migration.transfer)
                    params = migration.transfer(params, eng._param_shardings(params))
                    unrolled = eng.unrolls(params["layers"])
                    layer_params = eng._layer_copies(params) if unrolled else None
                    own_alloc, alloc, slot_req = alloc, moved["alloc"], moved["slot_req"]
                    active_host, num_gen = moved["active"], moved["num_generated"]
                    stats["migrated_rows"] = running
                    stats["migrated_pages"] = moved["pages"]
                    stats["migrate_seconds"] = time.perf_counter() - t_mig
            if on_finished is not None and done_rows:
                on_finished(done_rows)
        except BaseException:
            # A failed call leaves slots active on the device that no request owns: the next
            # call starts from a fresh state rather than decode them into pages reused by others.
            state = own_state = None
            raise
        finally:
            if eng is self:
                self.state = state
            else:
                self.state, eng.state = own_state, state
        stats["seconds"] = time.perf_counter() - t0
        stats["unrolled_layers"] = int(unrolled)
        if eng is not self:
            stats["tail_peak_pages_used"] = alloc.peak_used
            alloc = own_alloc
        stats["peak_pages_used"] = alloc.peak_used
        stats["pages_taken"] = alloc.taken
        stats["pool_pages"] = ec.total_pages
        stats["generated_tokens"] = sum(len(o[0]) for o in outputs)
        return GenerationResult(
            completion_ids=[o[0] for o in outputs],
            sampling_logprobs=[o[1] for o in outputs],
            raw_logprobs=[o[2] for o in outputs],
            prompt_index=np.array([r.prompt_index for r in requests], np.int32),
            stats=dict(stats),
            policy_masks=[o[3] for o in outputs] if turns is not None else None,
            routes=routes_out if ec.record_routes else None,
        )

    def _check_turns(self, turns: Turns | None) -> None:
        """One line of error for multi-turn settings this engine cannot run."""
        if turns is None:
            return
        if not self.config.max_observation_tokens:
            raise ValueError(
                "multi-turn generation needs EngineConfig.max_observation_tokens > 0 (the "
                "longest observation appended between turns)"
            )
        if len(turns.stop_ids) > MAX_STOP_IDS:
            raise ValueError(
                f"at most {MAX_STOP_IDS} turn stop ids are supported (got {len(turns.stop_ids)})"
            )

    def _next_turns(self, state, turns: Turns, finished, slot_req, num_gen, toks, policy, stops):
        """The slots in ``finished`` whose turn ended ask ``turns.handler`` for their next
        observation; those that get one go on (a ``_resume`` call feeds it), the others' episodes
        end. Returns the state and the slots whose episodes ended."""
        ends = []
        for slot in finished:
            req, n = slot_req[slot], int(num_gen[slot])
            reason = end_reason(int(toks[slot, n - 1]), n, req.max_new, stops, turns)
            ends.append(
                TurnEnd(
                    req.index, req.prompt_index, req.sample_index, req.prompt,
                    toks[slot, :n].tolist(), policy[slot, :n].copy(), reason, req.max_new - n,
                )
            )  # fmt: skip
        answers = list(turns.handler(ends))
        if len(answers) != len(ends):
            raise ValueError(f"turn handler answered {len(answers)} of {len(ends)} turn ends")
        width = self.config.max_observation_tokens
        slots = np.full((self.config.num_slots,), self.config.num_slots, np.int32)
        forced = np.zeros((self.config.num_slots, max(1, width)), np.int32)
        forced_n = np.zeros((self.config.num_slots,), np.int32)
        ended, k = [], 0
        for slot, end, answer in zip(finished, ends, answers):
            if end.reason not in CONTINUING or answer is None or not len(answer):
                ended.append(slot)
                continue
            obs = [int(t) for t in answer][: end.room]
            if len(obs) > width:
                raise ValueError(
                    f"request {end.index}: an observation of {len(obs)} tokens is longer than "
                    f"EngineConfig.max_observation_tokens {width}"
                )
            bad = [t for t in obs if not 0 <= t < self.cfg.vocab_size]
            if bad:
                raise ValueError(
                    f"request {end.index}: observation token id {bad[0]} outside vocab "
                    f"{self.cfg.vocab_size}"
                )
            slots[k], forced[k, : len(obs)], forced_n[k] = slot, obs, len(obs)
            k += 1
        if k:
            turn_tokens = np.int32(turns.max_tokens or 2**30)
            state = self._resume(state, slots, forced, forced_n, turn_tokens)
        return state, ended

    def _allocator(self) -> PageAllocator:
        ec = self.config
        return PageAllocator(
            self.num_shards, self.pages_per_shard, self.slots_per_shard, ec.page_size,
            ec.max_pages_per_seq,
        )  # fmt: skip

    def _check_tail(self, tail: DecodeEngine) -> None:
        """A migration's tail engine must run this engine's model with the same per-sequence
        shapes (its slots and pool may be smaller)."""
        a, b = self.config, tail.config
        same = ("page_size", "max_prompt_len", "max_new_tokens", "chunk_steps")
        diff = [f for f in same if getattr(a, f) != getattr(b, f)]
        if diff or tail.model_def.config != self.model_def.config:
            what = ", ".join(diff) or "model config"
            raise ValueError(f"migration tail engine differs from the engine in {what}")

    def _hand_over(self, state, alloc: PageAllocator, slot_req, num_gen, tail: DecodeEngine):
        """Take every running sequence out of ``state`` (their slots go idle and their pages
        return to ``alloc``): returns this engine's state and the moved rows, with the tail's
        allocator and slot table already holding them (tail slot ``i`` of shard ``i %
        shards``, so the rows spread over the tail's data shards)."""
        ec, tc = self.config, tail.config
        width = ec.max_pages_per_seq
        t_alloc = tail._allocator()
        m = tc.num_slots
        src_slots = np.full((m,), ec.num_slots, np.int32)
        src_pages = np.full((m, width), ec.total_pages, np.int32)
        dst_slots = np.full((m,), m, np.int32)
        dst_pages = np.full((m, width), tc.total_pages, np.int32)
        t_req: list[_Request | None] = [None] * m
        running = [s for s, r in enumerate(slot_req) if r is not None]
        pages = 0
        for i, slot in enumerate(running):
            req = slot_req[slot]
            t = (i % tail.num_shards) * tail.slots_per_shard + i // tail.num_shards
            owned = int(np.sum(alloc.table[slot] < alloc.pages_per_shard))
            t_alloc.admit(t, req.max_cached)
            t_alloc.grow(t, owned * ec.page_size)
            src_slots[i], dst_slots[i] = slot, t
            src_pages[i, :owned] = alloc.global_rows(slot)[:owned]
            dst_pages[i, :owned] = t_alloc.global_rows(t)[:owned]
            pages += owned
            t_req[t] = req
        state, moved = self._extract(state, src_slots, src_pages)
        for slot in running:
            alloc.release(slot)
            slot_req[slot] = None
        # Host view of the tail slots as of the last sync (every moved row is running).
        active = np.zeros((m,), bool)
        num_gen_t = np.zeros((m,), np.int32)
        for i, slot in enumerate(running):
            active[dst_slots[i]], num_gen_t[dst_slots[i]] = True, num_gen[slot]
        moved_host = {
            "tree": moved,
            "slots": dst_slots,
            "pages_table": dst_pages,
            "alloc": t_alloc,
            "slot_req": t_req,
            "active": active,
            "num_generated": num_gen_t,
            "pages": pages,
        }
        return state, moved_host

    def _take_over(self, moved, transfer) -> DecodeState:
        """Write the moved rows (from ``_hand_over``) into this (tail) engine's state."""
        tree = transfer(moved["tree"], self.moved_shardings)
        state = self.state if self.state is not None else self._init()
        self.state = None
        return self._adopt(state, tree, moved["slots"], moved["pages_table"])

    def _param_shardings(self, params: Params):
        """``params``' partitioning on this engine's mesh (the axis names are the same)."""

        def one(x):
            spec = x.sharding.spec if isinstance(x.sharding, NamedSharding) else PartitionSpec()
            return NamedSharding(self.mesh, spec)

        return jax.tree.map(one, params)

    def _admit(self, queue, slot_req, alloc: PageAllocator, stats) -> list[tuple[int, Any, int]]:
        """Move queued requests into free slots (taking their prompt pages): a list of (slot,
        request, prefill row). A request joins the row of an earlier sample of its prompt admitted
        in this call on the same data shard, sharing its full pages; otherwise it opens a row (at
        most ``max_prefill_rows``)."""
        ec = self.config
        admitted: list[tuple[int, _Request, int]] = []
        owners: dict[tuple[int, int], tuple[int, int]] = {}  # (prompt, shard) -> (slot, row)
        rows = 0
        for slot in range(ec.num_slots):
            if not queue:
                break
            if slot_req[slot] is not None:
                continue
            req = queue[0]
            group = (req.prompt_index, alloc.shard_of(slot))
            owner = owners.get(group) if ec.share_prefixes else None
            shared = len(req.prompt) // ec.page_size if owner is not None else 0
            if owner is None and rows == ec.max_prefill_rows:
                break
            if not alloc.can_admit(slot, req.max_cached, shared):
                continue
            queue.popleft()
            if owner is None:
                alloc.admit(slot, req.max_cached)
                owners[group] = owner = (slot, rows)
                rows += 1
            else:
                alloc.admit(slot, req.max_cached, share_from=owner[0], shared=shared)
                stats["shared_pages"] += shared
            alloc.grow(slot, len(req.prompt))
            slot_req[slot] = req
            admitted.append((slot, req, owner[1]))
        return admitted

    def _insert_batch(self, params, state, admitted, alloc: PageAllocator, scalars, flags, stats):
        ec = self.config
        heads = {row: (slot, req) for slot, req, row in reversed(admitted)}  # first of each row
        n = len(heads)
        rows = _bucket(n, 1, ec.max_prefill_rows)
        samples = _bucket(len(admitted), 1, max(ec.num_slots, ec.max_prefill_rows))
        longest = max(len(r.prompt) for _, r in heads.values())
        t = _bucket(longest, ec.min_prefill_len, max(ec.max_prompt_len, ec.min_prefill_len))
        tokens = np.zeros((rows, t), np.int32)
        lens = np.zeros((rows,), np.int32)
        page_rows = np.full((rows, ec.max_pages_per_seq), ec.total_pages, np.int32)
        for row, (slot, req) in heads.items():
            tokens[row, : len(req.prompt)] = req.prompt
            lens[row] = len(req.prompt)
            page_rows[row] = alloc.global_rows(slot)
        stats["prefill_rows"] += n
        stats["prefill_tokens"] += int(lens.sum())
        slots = np.full((samples,), ec.num_slots, np.int32)
        src = np.zeros((samples,), np.int32)
        copy_page = np.full((samples,), ec.total_pages, np.int32)
        seeds = np.zeros((samples,), np.uint32)
        prompt_idx = np.full((samples,), -1, np.int32)
        sample_idx = np.zeros((samples,), np.int32)
        max_new = np.zeros((samples,), np.int32)
        for i, (slot, req, row) in enumerate(admitted):
            slots[i] = slot
            src[i] = row
            last = len(req.prompt) // ec.page_size
            if heads[row][0] != slot and len(req.prompt) % ec.page_size:
                copy_page[i] = alloc.global_rows(slot)[last]
            seeds[i] = req.seed
            prompt_idx[i] = req.prompt_index if req.derived_seed else -1
            sample_idx[i] = req.sample_index
            max_new[i] = req.max_new
        return self._insert(
            params,
            state,
            tokens,
            lens,
            page_rows,
            slots,
            src,
            copy_page,
            seeds,
            prompt_idx,
            sample_idx,
            max_new,
            *scalars,
            **flags,
        )
