"""The decode engine's host scheduler: the loop of one ``generate`` call around the device programs.

Between decode chunks a small host loop harvests finished slots, frees their pages, admits
waiting prompts into free slots (back-pressure when the pool is short; samples of one prompt
admitted together share its prefill and full pages), grows the page tables of running sequences
for the next chunk, asks a multi-turn handler for the next observations (jrlhf.decode.turns),
hands finished rows to ``on_finished`` and, with a ``Migration``, moves the last few sequences
onto a tail engine. It waits on the device once per chunk (for the slots' activity and counts),
plus once more to fetch outputs when a slot has finished. The programs it calls are bucketed
so that compiles depend only on the engine's shapes, never on the number of prompts.

Here are only host decisions and numpy bookkeeping: the device programs are
jrlhf.decode.programs, the data they share jrlhf.decode.state, the pages' owner
jrlhf.decode.page_table. An "engine" below is a ``DecodeEngine``: its ``spec``, its jitted
``programs`` and the ``state`` it keeps between calls, which a call takes and gives back.
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
from jrlhf.decode.programs import EngineSpec
from jrlhf.decode.sampling import SamplingParams
from jrlhf.decode.state import (
    MAX_STOP_IDS,
    EngineConfig,
    EngineParts,
    FinishedCallback,
    FinishedRow,
    GenerationResult,
    Migration,
)
from jrlhf.decode.turns import CONTINUING, TurnEnd, Turns, end_reason
from jrlhf.meshes.batch import to_host
from jrlhf.models.model_def import Params
from jrlhf.models.transformer import decode_weights


@dataclasses.dataclass
class Request:
    """One sequence to generate: sample ``sample_index`` of prompt ``prompt_index``, at position
    ``index`` of the result; ``derived_seed``: its key folds in the prompt index (one seed for
    the whole call) rather than using a seed of the prompt's own."""

    index: int
    prompt: list[int]
    prompt_index: int
    sample_index: int
    seed: int
    derived_seed: bool
    max_new: int
    turn_sampled: int = 0  # multi-turn: tokens its current turn sampled before this call

    @property
    def max_cached(self) -> int:
        # The last sampled token is never fed back, so it never needs a cache entry.
        return len(self.prompt) + self.max_new - 1


def bucket(n: int, lo: int, hi: int) -> int:
    """``n`` rounded up to a power of two, clipped to [lo, hi]: the padded sizes of prefill
    calls, so that their compiles are bounded."""
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


def unrolls(config: EngineConfig, layers: Any) -> bool:
    """Whether a ``generate`` on ``layers`` runs them unrolled (``EngineConfig.unroll_layers``)."""
    if config.unroll_layers is not None:
        return config.unroll_layers
    if jax.default_backend() == "cpu":
        return True
    return jax.process_count() == 1 and layer_copies_fit(layers)


def allocator(spec: EngineSpec) -> PageAllocator:
    """An empty page allocator for ``spec``'s pool, slots and data shards."""
    ec = spec.config
    return PageAllocator(
        spec.num_shards, spec.pages_per_shard, spec.slots_per_shard, ec.page_size,
        ec.max_pages_per_seq,
    )  # fmt: skip


def pipeline_stats(spec: EngineSpec, counts: np.ndarray) -> dict[str, Any]:
    """The statistics of a pipelined decode (jrlhf.decode.pipelined) from its counters
    ``DecodeState.pipe_counts`` (ticks, each stage's busy ticks): the bubble is the share of
    stage-ticks in which a stage held no group with an active slot."""
    ticks, busy = int(counts[0]), [int(b) for b in counts[1:]]
    return {
        "pipeline_stages": spec.stages,
        "pipeline_batches": spec.groups,
        "pipeline_ticks": ticks,
        "pipeline_stage_busy": busy,
        "pipeline_bubble": 1.0 - sum(busy) / (spec.stages * ticks) if ticks else 0.0,
    }


def generate(
    engine: EngineParts,
    params: Params,
    prompts: Sequence[Sequence[int]],
    sampling: SamplingParams | None = None,
    on_finished: FinishedCallback | None = None,
    migration: Migration | None = None,
    turns: Turns | None = None,
) -> GenerationResult:
    """``DecodeEngine.generate`` (see there): every request of one call, decoded to its end on
    ``engine`` (and on ``migration``'s tail engine), whose states are taken and given back."""
    call = _Call(
        engine, params, prompts, sampling or SamplingParams(), on_finished, migration, turns
    )
    call.run()
    return call.result()


def _requests(
    spec: EngineSpec, prompts, sp: SamplingParams, max_new: int, turns: Turns | None
) -> list[Request]:
    """The call's requests, prompt by prompt and sample by sample (each with its token budget
    and, continuing an episode, what its turn has sampled); a prompt the engine cannot take is
    refused in one line naming it."""
    ec, vocab = spec.config, spec.cfg.vocab_size
    if sp.seeds is not None and len(sp.seeds) != len(prompts):
        raise ValueError(f"{len(sp.seeds)} seeds given for {len(prompts)} prompts")
    sampled = turns.sampled if turns is not None and turns.sampled is not None else None
    if sampled is not None and len(sampled) != len(prompts):
        raise ValueError(f"Turns.sampled has {len(sampled)} counts for {len(prompts)} prompts")
    budgets = sp.max_new_per_prompt
    if budgets is not None and len(budgets) != len(prompts):
        raise ValueError(f"{len(budgets)} max_new_per_prompt given for {len(prompts)} prompts")
    capacity = min(ec.max_pages_per_seq, spec.pages_per_shard) * ec.page_size
    reqs = []
    for p, prompt in enumerate(prompts):
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError(f"prompt {p} is empty")
        new = max_new if budgets is None else min(max_new, int(budgets[p]))
        if len(prompt) > ec.max_prompt_len:
            raise ValueError(
                f"prompt {p} has {len(prompt)} tokens, more than max_prompt_len {ec.max_prompt_len}"
            )
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt {p}: token id {bad[0]} outside vocab {vocab}")
        if len(prompt) + new - 1 > capacity:
            raise ValueError(
                f"prompt {p}: {len(prompt)} + {new} new tokens needs "
                f"{pages_for(len(prompt) + new - 1, ec.page_size)} pages, but one data "
                f"shard's pool holds {spec.pages_per_shard} (and a sequence at most "
                f"{ec.max_pages_per_seq})"
            )
        for s in range(sp.num_samples):
            seed = sp.seeds[p] if sp.seeds is not None else sp.seed
            reqs.append(
                Request(
                    len(reqs), prompt, p, s, int(seed) & 0xFFFFFFFF, sp.seeds is None, new,
                    0 if sampled is None else int(sampled[p]),
                )
            )  # fmt: skip
    return reqs


def _check_turns(config: EngineConfig, turns: Turns | None) -> None:
    """One line of error for multi-turn settings this engine cannot run."""
    if turns is None:
        return
    if not config.max_observation_tokens:
        raise ValueError(
            "multi-turn generation needs EngineConfig.max_observation_tokens > 0 (the "
            "longest observation appended between turns)"
        )
    if len(turns.stop_ids) > MAX_STOP_IDS:
        raise ValueError(
            f"at most {MAX_STOP_IDS} turn stop ids are supported (got {len(turns.stop_ids)})"
        )


def _check_tail(spec: EngineSpec, tail: EngineSpec) -> None:
    """A migration's tail engine must run this engine's model with the same per-sequence
    shapes (its slots and pool may be smaller)."""
    a, b = spec.config, tail.config
    same = ("page_size", "max_prompt_len", "max_new_tokens", "chunk_steps")
    diff = [f for f in same if getattr(a, f) != getattr(b, f)]
    if diff or tail.cfg != spec.cfg:
        what = ", ".join(diff) or "model config"
        raise ValueError(f"migration tail engine differs from the engine in {what}")


def _turn_budget(turns: Turns | None) -> np.int32:
    """The tokens a turn may sample: ``Turns.max_tokens``, or without one (or without turns) a
    number no episode reaches, so only the episode's own budget ends it."""
    return np.int32((turns.max_tokens if turns is not None else 0) or 2**30)


def _scalars(sp: SamplingParams, stops: tuple[int, ...], turns: Turns | None) -> tuple:
    """The per-call inputs of ``insert`` and ``decode_chunk`` after their arrays: padded stop
    ids (so changing them never recompiles), the turn limits and the sampling settings."""
    stop_ids = np.full((MAX_STOP_IDS,), -1, np.int32)
    stop_ids[: len(stops)] = stops
    turn_stop_ids = np.full((MAX_STOP_IDS,), -1, np.int32)
    if turns is not None:
        turn_stop_ids[: len(turns.stop_ids)] = turns.stop_ids
    turn_tokens = _turn_budget(turns)
    return (
        stop_ids,
        turn_stop_ids,
        turn_tokens,
        np.float32(sp.temperature),
        np.int32(sp.top_k),
        np.float32(sp.top_p),
    )


def _admit(config: EngineConfig, queue, slot_req, alloc: PageAllocator, stats) -> list[tuple]:
    """Move queued requests into free slots (taking their prompt pages): a list of (slot,
    request, prefill row). A request joins the row of an earlier sample of its prompt admitted
    in this call on the same data shard, sharing its full pages; otherwise it opens a row (at
    most ``max_prefill_rows``)."""
    ec = config
    admitted: list[tuple[int, Request, int]] = []
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


def _prefill_inputs(
    config: EngineConfig, admitted, alloc: PageAllocator, stats, turn_tokens: int
) -> tuple:
    """The arrays ``programs.insert`` takes for the ``admitted`` (slot, request, row) triples,
    rows and lengths padded to buckets: the rows' prompt tokens, lengths and page rows, then per
    sample its slot, row, copy-on-write page, seed, prompt and sample index, token budget; and
    apart, per sample, its first turn's budget (``turn_tokens`` less what it sampled before)."""
    ec = config
    heads = {row: (slot, req) for slot, req, row in reversed(admitted)}  # first of each row
    n = len(heads)
    rows = bucket(n, 1, ec.max_prefill_rows)
    samples = bucket(len(admitted), 1, max(ec.num_slots, ec.max_prefill_rows))
    longest = max(len(r.prompt) for _, r in heads.values())
    t = bucket(longest, ec.min_prefill_len, max(ec.max_prompt_len, ec.min_prefill_len))
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
    # The first turn's budget, per sample: what is left of a turn continued from an earlier
    # call (Turns.sampled).
    turn_left = np.full((samples,), turn_tokens, np.int32)
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
        turn_left[i] -= req.turn_sampled
    return (
        (tokens, lens, page_rows, slots, src, copy_page, seeds, prompt_idx, sample_idx, max_new),
        turn_left,
    )


def _param_shardings(mesh: Mesh, params: Params):
    """``params``' partitioning on ``mesh`` (the axis names are the same)."""

    def one(x):
        spec = x.sharding.spec if isinstance(x.sharding, NamedSharding) else PartitionSpec()
        return NamedSharding(mesh, spec)

    return jax.tree.map(one, params)


def _hand_over(engine: EngineParts, state, alloc: PageAllocator, slot_req, num_gen, tail):
    """Take every running sequence out of ``state`` (their slots go idle and their pages
    return to ``alloc``): returns ``engine``'s state and the moved rows, with the tail's
    allocator and slot table already holding them (tail slot ``i`` of shard ``i % shards``, so
    the rows spread over the tail's data shards)."""
    ec, ts = engine.spec.config, tail.spec
    tc = ts.config
    width = ec.max_pages_per_seq
    t_alloc = allocator(ts)
    m = tc.num_slots
    src_slots = np.full((m,), ec.num_slots, np.int32)
    src_pages = np.full((m, width), ec.total_pages, np.int32)
    dst_slots = np.full((m,), m, np.int32)
    dst_pages = np.full((m, width), tc.total_pages, np.int32)
    t_req: list[Request | None] = [None] * m
    running = [s for s, r in enumerate(slot_req) if r is not None]
    pages = 0
    for i, slot in enumerate(running):
        req = slot_req[slot]
        t = (i % ts.num_shards) * ts.slots_per_shard + i // ts.num_shards
        owned = int(np.sum(alloc.table[slot] < alloc.pages_per_shard))
        t_alloc.admit(t, req.max_cached)
        t_alloc.grow(t, owned * ec.page_size)
        src_slots[i], dst_slots[i] = slot, t
        src_pages[i, :owned] = alloc.global_rows(slot)[:owned]
        dst_pages[i, :owned] = t_alloc.global_rows(t)[:owned]
        pages += owned
        t_req[t] = req
    state, moved = engine.programs.extract(state, src_slots, src_pages)
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


def _take_over(tail: EngineParts, moved, transfer):
    """The moved rows (from ``_hand_over``) written into the tail engine's state, which the
    call now holds."""
    tree = transfer(moved["tree"], tail.programs.moved_shardings)
    state = tail.state if tail.state is not None else tail.programs.init()
    tail.state = None
    return tail.programs.adopt(state, tree, moved["slots"], moved["pages_table"])


class _Call:
    """The host side of one ``generate`` call: its requests and where they are (queued, in a
    slot, finished), the pages they hold, the device state it holds while it runs, and which
    engine decodes now (the call's own or, after a migration, the tail)."""

    def __init__(
        self,
        engine: EngineParts,
        params: Params,
        prompts,
        sp: SamplingParams,
        on_finished: FinishedCallback | None,
        migration: Migration | None,
        turns: Turns | None,
    ):
        spec = engine.spec
        ec = spec.config
        max_new = sp.max_new_tokens or ec.max_new_tokens
        if max_new > ec.max_new_tokens:
            raise ValueError(
                f"max_new_tokens {max_new} exceeds the engine's max_new_tokens {ec.max_new_tokens}"
            )
        self.stops = spec.cfg.eos_ids if sp.stop_ids is None else tuple(sp.stop_ids)
        if len(self.stops) > MAX_STOP_IDS:
            raise ValueError(
                f"at most {MAX_STOP_IDS} stop ids are supported (got {len(self.stops)})"
            )
        if migration is not None:
            if ec.record_routes:
                raise ValueError("EngineConfig.record_routes does not follow migrated sequences")
            _check_tail(spec, migration.engine.spec)
        _check_turns(ec, turns)
        self.requests = _requests(spec, prompts, sp, max_new, turns)
        self.scalars = _scalars(sp, self.stops, turns)
        self.flags = dict(greedy=sp.greedy, filtered=sp.filtered)
        self.on_finished, self.migration, self.turns = on_finished, migration, turns
        if engine.state is None:
            engine.state = engine.programs.init()
        self.engine = self.decoder = engine  # decoder: the engine decoding now
        self._use_params(params)
        self.state = engine.state
        engine.state = None  # the programs donate it; run gives it back
        if spec.stages > 1:  # pipelined decode counts this call's ticks from zero
            zeros = np.zeros((1 + spec.stages,), np.int32)
            counts = jax.device_put(zeros, engine.programs.state_shardings.pipe_counts)
            self.state = self.state.replace(pipe_counts=counts)
        self.own_state = self.own_alloc = None  # engine's while the tail engine decodes
        self.alloc = allocator(spec)
        self.queue = collections.deque(self.requests)
        self.slot_req: list[Request | None] = [None] * ec.num_slots
        self.outputs: list[tuple | None] = [None] * len(self.requests)
        self.routes_out: list[np.ndarray | None] = [None] * len(self.requests)
        self.stats = collections.Counter()
        self.done_rows: list[FinishedRow] = []  # finished, not yet handed to on_finished
        self.active_host = np.zeros((ec.num_slots,), bool)  # as of the last sync
        self.num_gen = np.zeros((ec.num_slots,), np.int32)
        self.t0 = time.perf_counter()

    def _use_params(self, params: Params) -> None:
        """Decode with ``params`` (placed on the decoding engine's mesh) from here on, unrolled
        over per-layer copies where that engine unrolls (``unrolls``)."""
        spec = self.decoder.spec
        self.params = params
        # pipelined decode runs each stage's slice of the stacked layers (jrlhf.decode.pipelined)
        self.unrolled = spec.stages == 1 and unrolls(spec.config, params["layers"])
        self.layer_params = decode_weights(params, spec.weight_layout) if self.unrolled else None

    def run(self) -> None:
        """Decode until every request has finished; the engines get their states back even
        when this fails."""
        try:
            while self.queue or self._running():
                self._step()
            self._hand_finished()
        except BaseException:
            # A failed call leaves slots active on the device that no request owns: the next
            # call starts from a fresh state rather than decode them into pages reused by others.
            self.state = self.own_state = None
            raise
        finally:
            if self.decoder is self.engine:
                self.engine.state = self.state
            else:
                self.engine.state, self.decoder.state = self.own_state, self.state

    def _running(self) -> int:
        return sum(r is not None for r in self.slot_req)

    def _step(self) -> None:
        """One round: admit and prefill what fits, grow the running sequences' pages, dispatch
        one decode chunk, sync once, harvest the slots that finished, perhaps migrate."""
        eng, stats = self.decoder, self.stats
        ec = eng.spec.config
        admitted = []
        if eng is self.engine:
            admitted = _admit(ec, self.queue, self.slot_req, self.alloc, stats)
        if admitted:
            stop_ids, turn_stop_ids, turn_tokens, *sampling = self.scalars
            inputs, turn_left = _prefill_inputs(ec, admitted, self.alloc, stats, turn_tokens)
            self.state = eng.programs.insert(
                self.params, self.state, *inputs, stop_ids, turn_stop_ids, turn_left, *sampling,
                **self.flags,
            )  # fmt: skip
            stats["prefill_calls"] += 1
            # Not synced: a slot whose first token already ended it just makes the chunk's
            # while loop stop at once, and its pages are released below as usual.
            for slot, _, _ in admitted:
                self.active_host[slot], self.num_gen[slot] = True, 1
        elif not self._running():
            raise RuntimeError("no sequence could be admitted into an empty page pool")
        self._grow_pages()
        self.state = eng.programs.decode_chunk(
            self.params, self.layer_params, self.state, *self.scalars, **self.flags
        )
        stats["decode_chunks"] += 1
        stats["tail_decode_chunks"] += eng is not self.engine
        self._hand_finished()  # the last chunk's rows, while this chunk decodes
        # The one sync per chunk (plus the outputs of finished slots, when there are any).
        self.active_host, self.num_gen = map(
            np.array, to_host((self.state.active, self.state.num_generated))
        )
        finished = [
            s for s, r in enumerate(self.slot_req) if r is not None and not self.active_host[s]
        ]
        if finished:
            self._harvest(finished)
        running, migration = self._running(), self.migration
        if (
            migration
            and eng is self.engine
            and not self.queue
            and 0 < running <= migration.max_rows
        ):
            self._migrate(running)

    def _grow_pages(self) -> None:
        """Give every running sequence the pages its next chunk writes into."""
        ec = self.decoder.spec.config
        for slot, req in enumerate(self.slot_req):
            if req is not None and self.active_host[slot]:
                cached = len(req.prompt) + int(self.num_gen[slot]) - 1
                self.alloc.grow(slot, min(cached + ec.chunk_steps, req.max_cached))
        if self.alloc.dirty:
            table = jax.device_put(
                self.alloc.table, self.decoder.programs.state_shardings.page_table
            )
            self.state = self.state.replace(page_table=table)
            self.alloc.dirty = False

    def _hand_finished(self) -> None:
        if self.on_finished is not None and self.done_rows:
            self.on_finished(self.done_rows)
            self.done_rows = []

    def _harvest(self, finished: list[int]) -> None:
        """Fetch the outputs of the ``finished`` slots; multi-turn, those whose episode goes on
        get their next observation, the others' requests are done: their slots and pages are
        freed."""
        state, record = self.state, self.engine.spec.config.record_routes
        fetch = (state.tokens, state.sampling_lp, state.raw_lp)
        toks, slp, rlp, *policy = to_host(fetch + ((state.policy,) * bool(self.turns)))
        if record:
            routes_host = to_host(state.routes)
        if self.turns is not None:
            turn_ended = finished
            finished = self._next_turns(finished, toks, policy[0])
            for slot in set(turn_ended) - set(finished):  # going on: a new turn
                self.active_host[slot] = True
                self.stats["turns"] += 1
        for slot in finished:
            n = int(self.num_gen[slot])
            req = self.slot_req[slot]
            self.outputs[req.index] = (
                toks[slot, :n].tolist(),
                slp[slot, :n].copy(),
                rlp[slot, :n].copy(),
                policy[0][slot, :n].copy() if policy else None,
            )
            if record:
                self.routes_out[req.index] = routes_host[slot, :n].copy()
            self.alloc.release(slot)
            self.slot_req[slot] = None
            if self.on_finished is not None:
                row = FinishedRow(req.index, req.prompt_index, *self.outputs[req.index])
                self.done_rows.append(row)

    def _next_turns(self, finished: list[int], toks, policy) -> list[int]:
        """The slots in ``finished`` whose turn ended ask ``turns.handler`` for their next
        observation; those that get one go on (an ``extend`` call prefills it), the others' episodes
        end. Returns the slots whose episodes ended."""
        turns, spec = self.turns, self.decoder.spec
        ends = []
        for slot in finished:
            req, n = self.slot_req[slot], int(self.num_gen[slot])
            reason = end_reason(int(toks[slot, n - 1]), n, req.max_new, self.stops, turns)
            ends.append(
                TurnEnd(
                    req.index, req.prompt_index, req.sample_index, req.prompt,
                    toks[slot, :n].tolist(), policy[slot, :n].copy(), reason, req.max_new - n,
                )
            )  # fmt: skip
        answers = list(turns.handler(ends))
        if len(answers) != len(ends):
            raise ValueError(f"turn handler answered {len(answers)} of {len(ends)} turn ends")
        width = spec.config.max_observation_tokens
        going, ended = [], []
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
            bad = [t for t in obs if not 0 <= t < spec.cfg.vocab_size]
            if bad:
                raise ValueError(
                    f"request {end.index}: observation token id {bad[0]} outside vocab "
                    f"{spec.cfg.vocab_size}"
                )
            going.append((slot, obs, len(obs) < end.room))
        if going:
            self._extend(going)
        return ended

    def _extend(self, going: list[tuple[int, list[int], bool]]) -> None:
        """Feed each (slot, observation, room) of ``going`` its observation in one chunked
        prefill (``programs.extend``) that also samples its next turn's first token where the
        sequence has ``room`` for one; rows and length padded to powers of two."""
        ec, alloc = self.decoder.spec.config, self.alloc
        m = bucket(len(going), 1, ec.num_slots)
        w = bucket(max(len(obs) for _, obs, _ in going) + 1, 2, ec.max_observation_tokens + 1) - 1
        slots = np.full((m,), ec.num_slots, np.int32)
        obs_mw = np.zeros((m, w), np.int32)
        obs_n = np.zeros((m,), np.int32)
        page_rows = np.full((m, ec.max_pages_per_seq), ec.total_pages, np.int32)
        for k, (slot, obs, room) in enumerate(going):
            req, n = self.slot_req[slot], int(self.num_gen[slot])
            # the cache then holds the turn's last token, the observation and, with room,
            # nothing more (the new token is fed by the next decode step)
            alloc.grow(slot, min(len(req.prompt) + n + len(obs), req.max_cached))
            slots[k], obs_mw[k, : len(obs)], obs_n[k] = slot, obs, len(obs)
            page_rows[k] = alloc.global_rows(slot)
            self.num_gen[slot] = n + len(obs) + room
        stop_ids, turn_stop_ids, turn_tokens, *sampling = self.scalars
        self.state = self.decoder.programs.extend(
            self.params, self.state, slots, obs_mw, obs_n, page_rows, stop_ids, turn_stop_ids,
            turn_tokens, *sampling, **self.flags,
        )  # fmt: skip
        self.stats["extend_calls"] += 1
        self.stats["observation_tokens"] += int(obs_n.sum())

    def _migrate(self, running: int) -> None:
        """Move the ``running`` sequences, their pages' KV and the parameters onto the
        migration's tail engine, which decodes from here on (see Migration)."""
        t_mig, migration = time.perf_counter(), self.migration
        tail = migration.engine
        self.own_state, moved = _hand_over(
            self.engine, self.state, self.alloc, self.slot_req, self.num_gen, tail
        )
        self.decoder = tail
        self.state = _take_over(tail, moved, migration.transfer)
        self._use_params(
            migration.transfer(self.params, _param_shardings(tail.spec.mesh, self.params))
        )
        self.own_alloc, self.alloc, self.slot_req = self.alloc, moved["alloc"], moved["slot_req"]
        self.active_host, self.num_gen = moved["active"], moved["num_generated"]
        self.stats["migrated_rows"] = running
        self.stats["migrated_pages"] = moved["pages"]
        self.stats["migrate_seconds"] = time.perf_counter() - t_mig

    def result(self) -> GenerationResult:
        """The finished call's completions in request order, with its statistics."""
        stats, alloc, outputs = self.stats, self.alloc, self.outputs
        stats["seconds"] = time.perf_counter() - self.t0
        stats["unrolled_layers"] = int(self.unrolled)
        if self.decoder is not self.engine:
            stats["tail_peak_pages_used"] = alloc.peak_used
            alloc = self.own_alloc
        stats["peak_pages_used"] = alloc.peak_used
        stats["pages_taken"] = alloc.taken
        stats["pool_pages"] = self.engine.spec.config.total_pages
        stats["generated_tokens"] = sum(len(o[0]) for o in outputs)
        if self.engine.spec.stages > 1:
            own = self.state if self.decoder is self.engine else self.own_state
            counts = np.asarray(to_host(own.pipe_counts))
            for key, value in pipeline_stats(self.engine.spec, counts).items():
                stats[key] = value  # set, not added: a Counter's update would add
        record = self.engine.spec.config.record_routes
        return GenerationResult(
            completion_ids=[o[0] for o in outputs],
            sampling_logprobs=[o[1] for o in outputs],
            raw_logprobs=[o[2] for o in outputs],
            prompt_index=np.array([r.prompt_index for r in self.requests], np.int32),
            stats=dict(stats),
            policy_masks=[o[3] for o in outputs] if self.turns is not None else None,
            routes=self.routes_out if record else None,
        )
