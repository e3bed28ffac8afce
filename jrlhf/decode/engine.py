"""Paged-KV generation with continuous batching on a generation mesh.

(Being split: the state and shared data are jrlhf.decode.state, the device programs
jrlhf.decode.programs; the host loop below moves to its own module next.)

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
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jrlhf.decode.page_table import PageAllocator, pages_for
from jrlhf.decode.programs import EngineSpec, Programs, engine_spec, jit_programs
from jrlhf.decode.sampling import SamplingParams
from jrlhf.decode.state import (
    MAX_STOP_IDS,
    DecodeState,
    EngineConfig,
    FinishedCallback,
    FinishedRow,
    GenerationResult,
    Migration,
    round_slots,
)
from jrlhf.decode.turns import CONTINUING, TurnEnd, Turns, end_reason
from jrlhf.meshes.batch import to_host
from jrlhf.meshes.rules import Rules, get_rules
from jrlhf.models.config import ModelConfig
from jrlhf.models.model_def import ModelDef, Params
from jrlhf.models.transformer import LayerWeights, decode_weights
from jrlhf.runtime.shared_programs import shared_program


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


# Bounded, so that a long-lived process that builds many differently shaped engines does not keep
# every program.
@shared_program(maxsize=16)
def engine_parts(
    model_def: ModelDef, mesh: Mesh, rules: Rules, config: EngineConfig
) -> tuple[EngineSpec, Programs]:
    """The spec and jitted programs of an engine. jax.jit caches traces and executables per
    function object, so an engine built again with the same model, mesh, rules and config (the
    trainer rebuilt in one process, evaluation after training) gets the same ones and neither
    traces, lowers nor compiles again. ``engine_parts.cache_clear()`` forgets them (an A/B of
    engine variants in one process)."""
    spec = engine_spec(model_def, mesh, rules, config)
    return spec, jit_programs(spec)


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
        parts = engine_parts(model_def, mesh, get_rules(rules), config or EngineConfig())
        self.spec: EngineSpec = parts[0]
        self.programs: Programs = parts[1]
        # None until the first generate, and while one runs (the programs donate it).
        self.state: DecodeState | None = None

    @property
    def model_def(self) -> ModelDef:
        return self.spec.model_def

    @property
    def cfg(self) -> ModelConfig:
        return self.spec.cfg

    @property
    def config(self) -> EngineConfig:
        return self.spec.config

    @property
    def mesh(self) -> Mesh:
        return self.spec.mesh

    @property
    def rules(self) -> Rules:
        return self.spec.rules

    @property
    def kernel_name(self) -> str:
        """The paged-attention kernel decode steps run (jrlhf.decode.kernels)."""
        return self.spec.kernel_name

    @property
    def num_shards(self) -> int:
        """How many ways slots and pages are split (the mesh's data shards)."""
        return self.spec.num_shards

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
        return self.spec.weight_layout

    def _layer_copies(self, params: Params) -> LayerWeights:
        """The per-layer weight copies unrolled decode steps run on (``unroll_layers``)."""
        return decode_weights(params, self.spec.weight_layout)

    def compile_counts(self) -> dict[str, int]:
        """How many programs each jitted entry point has compiled (for tests and logs)."""
        return {
            "insert": self.programs.insert._cache_size(),
            "decode_chunk": self.programs.decode_chunk._cache_size(),
        }

    def _requests(self, prompts, sp: SamplingParams, max_new: int) -> list[_Request]:
        ec = self.config
        if sp.seeds is not None and len(sp.seeds) != len(prompts):
            raise ValueError(f"{len(sp.seeds)} seeds given for {len(prompts)} prompts")
        capacity = min(ec.max_pages_per_seq, self.spec.pages_per_shard) * ec.page_size
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
                    f"shard's pool holds {self.spec.pages_per_shard} (and a sequence at most "
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
            self.state = self.programs.init()
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
                    table = jax.device_put(alloc.table, eng.programs.state_shardings.page_table)
                    state = state.replace(page_table=table)
                    alloc.dirty = False
                state = eng.programs.decode_chunk(params, layer_params, state, *scalars, **flags)
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
            state = self.programs.resume(state, slots, forced, forced_n, turn_tokens)
        return state, ended

    def _allocator(self) -> PageAllocator:
        ec, spec = self.config, self.spec
        return PageAllocator(
            spec.num_shards, spec.pages_per_shard, spec.slots_per_shard, ec.page_size,
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
            t = (i % tail.spec.num_shards) * tail.spec.slots_per_shard + i // tail.spec.num_shards
            owned = int(np.sum(alloc.table[slot] < alloc.pages_per_shard))
            t_alloc.admit(t, req.max_cached)
            t_alloc.grow(t, owned * ec.page_size)
            src_slots[i], dst_slots[i] = slot, t
            src_pages[i, :owned] = alloc.global_rows(slot)[:owned]
            dst_pages[i, :owned] = t_alloc.global_rows(t)[:owned]
            pages += owned
            t_req[t] = req
        state, moved = self.programs.extract(state, src_slots, src_pages)
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
        tree = transfer(moved["tree"], self.programs.moved_shardings)
        state = self.state if self.state is not None else self.programs.init()
        self.state = None
        return self.programs.adopt(state, tree, moved["slots"], moved["pages_table"])

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
        return self.programs.insert(
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
