"""The placement study of docs/plans.md: estimated PPO iteration time on 8 to 128 H100s.

    python -m benchmarks.plan_study                         # print the tables (markdown)
    python -m benchmarks.plan_study --update docs/plans.md  # rewrite the generated part of the doc
    python -m benchmarks.plan_study --reasoning --update docs/plans.md  # long-reasoning GRPO

For a 7B and a 70B actor + critic PPO setup (reference and reward the same size as the actor), on
8, 16, 32, 64 and 128 devices of a profile (H100 by default), it reports the best variant of each
named strategy (flatten, interleave, separate, each tuned over tensor sizes) and the searched
plan; the same for GRPO, for a Qwen3-30B-A3B-shaped mixture-of-experts GRPO on 8 to 64 devices
(``--moe``) and a 405B GRPO on 1,024 (``--large``), and what the expert and stage axes did.
With ``--reasoning``: long-reasoning GRPO (responses up to 16k tokens, long-tailed) on 64,
128 and 1,024 devices under the synchronous, bounded-staleness and partial-rollout schedules, and
the bytes that cross between the generating and the training group. Every number is the cost
estimator's (jrlhf.placement.estimator) from the profile's datasheet rates: an estimate, not a
measurement. The search is seeded, so the tables are reproducible.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from pathlib import Path

from jrlhf.models.presets import get_preset
from jrlhf.placement.plan import CALLS
from jrlhf.placement.search import SearchResult, peak_memory_bytes, search

BEGIN, END = "<!-- study:begin -->", "<!-- study:end -->"
DEVICES = (8, 16, 32, 64, 128)
MODELS = {
    "7B": "llama2_7b",
    "70B": "llama2_70b",
    "405B": "llama3_405b",
    "30B-A3B": "qwen3_30b_a3b",
}
ALGORITHMS = ("ppo", "grpo")
# GRPO as its seeds run it: groups of samples per prompt, a verifiable (Python) reward, no
# critic; the same 512 rows per iteration as the PPO workload.
GRPO = dict(prompts=64, samples_per_prompt=8)
# The 405B-class case: a GRPO actor (and its reference) on 1,024 devices, searched with a
# shorter anneal (each estimate walks 1,024 devices).
LARGE = ("grpo", "405B", 1024)
LARGE_SEARCH = dict(steps=6000, restarts=2)
# A mixture of experts: a Qwen3-30B-A3B-shaped GRPO actor and reference (128 experts, 8 chosen
# per token: 3.3B of its 30.5B parameters active) on 8 to 64 devices, where the search may split
# the experts over an expert axis.
MOE = tuple(("grpo", "30B-A3B", n) for n in (8, 16, 32, 64))
# A typical PPO iteration (the scale of ReaL's and HybridFlow's experiments).
WORKLOAD = dict(
    prompts=512,
    samples_per_prompt=1,
    prompt_len=1024,
    gen_len=1024,
    epochs=1,
    minibatch_size=128,
)
REMAT = "dots_no_batch"  # as configs/llama3_8b_ppo.gin: 2k-token training needs remat
# How the trainer runs it (see docs/plans.md): the decode engine keeps DECODE_SLOTS sequences in
# flight in total over its data shards (DecodeConfig.num_slots; the rest wait for a free slot),
# reference / reward / critic score INFER_BATCH_SIZE rows per call (Memory.infer_batch_size),
# and each minibatch is trained in micro-batches of microbatch_rows() rows (gradient accumulation,
# RoleConfig.microbatches = minibatch_size / rows), one optimizer update per minibatch.
# A micro-batch's rows must split over the training call's batch (fsdp) shards, so 8-row
# micro-batches would cap training at 8 shards; they are used where memory needs them (8-16
# devices) and 16-row micro-batches from 32 devices on.
DECODE_SLOTS = 256
INFER_BATCH_SIZE = 64
MICROBATCH_ROWS = {8: 8, 16: 8}  # devices -> rows per micro-batch
DEFAULT_MICROBATCH_ROWS = 16


def microbatch_rows(devices: int) -> int:
    return MICROBATCH_ROWS.get(devices, DEFAULT_MICROBATCH_ROWS)


SEARCH = dict(steps=300, restarts=2, seed=0, top=5)
STRATEGY_NAMES = ("flatten", "interleave", "separate")


def workload_for(size: str, devices: int = 8, algorithm: str = "ppo"):
    """The study's workload: PPO with four models of ``size``, or GRPO (actor and reference,
    a verifiable reward). The batch and memory knobs given here are the search's starting
    point; it chooses them per plan (``tune_batches``)."""
    from jrlhf.placement.workload import Workload

    model = get_preset(MODELS[size], remat_policy=REMAT)
    microbatches = WORKLOAD["minibatch_size"] // microbatch_rows(devices)
    ppo = algorithm == "ppo"
    return Workload(
        actor=model,
        critic=model if ppo else None,
        reference=model,
        reward=model if ppo else None,
        **{**WORKLOAD, **({} if ppo else GRPO)},
        decode_slots=DECODE_SLOTS,
        infer_batch_size=INFER_BATCH_SIZE,
        actor_microbatches=microbatches,
        critic_microbatches=microbatches,
    )


@dataclasses.dataclass
class Case:
    algorithm: str
    size: str
    devices: int
    result: SearchResult | None  # None: no candidate space (cannot even be laid out)
    seconds: float  # wall time of the search


def run_case(algorithm: str, size: str, devices: int, profile, **search_kwargs) -> Case:
    t0 = time.perf_counter()
    kwargs = {**SEARCH, **search_kwargs}
    if (algorithm, size, devices) == LARGE:
        kwargs.update(LARGE_SEARCH)
    result = search(
        workload_for(size, devices, algorithm),
        devices,
        profile,
        devices_per_node=min(profile.devices_per_node, devices),
        tune_batches=True,
        **kwargs,
    )
    return Case(algorithm, size, devices, result, time.perf_counter() - t0)


def _secs(r) -> str:
    if r is None:
        return "n/a"
    if not r.estimate.fits:
        return f"OOM ({peak_memory_bytes(r.estimate) / 2**30:.0f} GiB)"
    return f"{r.cost:.1f}"


def _ratio(a, b) -> str:
    if a is None or b is None or not (math.isfinite(a.cost) and math.isfinite(b.cost)):
        return "-"
    return f"{a.cost / b.cost:.2f}x"


def compact(plan, roles=None) -> str:
    """``gen 64(t8)@0 | ref,rew,crit-inf 64(t8)@64 | ...``: calls grouped by identical slot
    (``s2``: 2 pipeline stages, ``e4``: experts split 4 ways); with ``roles``, only the calls
    of those roles (GRPO has no critic or reward model)."""
    short = {
        "actor_generate": "gen",
        "reference_infer": "ref",
        "reward_infer": "rew",
        "critic_infer": "cinf",
        "actor_train": "atrain",
        "critic_train": "ctrain",
    }
    groups: dict[str, list[str]] = {}
    for call, p in plan.placements:
        if roles is not None and call.split("_")[0] not in roles:
            continue
        ids = sorted(p.mesh.device_ids())
        shape = p.mesh.shape
        extra = "".join(
            f",{short_axis}{shape[axis]}"
            for axis, short_axis in (("stage", "s"), ("expert", "e"))
            if shape.get(axis, 1) > 1
        )
        key = f"{len(ids)}(t{shape.get('tensor', 1)}{extra})@{ids[0]}"
        groups.setdefault(key, []).append(short[call])
    return " / ".join(f"{','.join(calls)} {key}" for key, calls in groups.items())


def knobs_row(best) -> str:
    """The knob and memory-breakdown cells of a searched plan's row."""
    e = best.estimate
    w = e.workload
    crit = w.critic is not None
    mb = f"{w.actor_microbatches}" + (f" / {w.critic_microbatches}" if crit else "")
    remat = w.actor.remat_policy + (f" / {w.critic.remat_policy}" if crit else "")
    host = sum(e.offload_seconds.values())
    offload = ", ".join(w.offload) + f" ({host:.1f} s)" if w.offload else "-"
    call = max(e.memory_bytes, key=e.memory_bytes.get)
    parts = ", ".join(
        f"{k} {v / 2**30:.1f}" for k, v in e.memory_breakdown.get(call, {}).items() if v >= 2**27
    )
    return (
        f"{w.infer_batch_size or 'all'} | {mb} | {remat} | {pipeline_cell(best)} | "
        f"{w.generation_copy} | {offload} | {call} | {e.memory_bytes[call] / 2**30:.1f}: {parts} |"
    )


def pipeline_cell(best) -> str:
    """The pipeline micro-batches and schedule of each staged call of a plan ('-': none)."""
    cells = []
    for call, p in best.plan.placements:
        role = call.split("_")[0]
        stages = p.mesh.shape.get("stage", 1)
        if stages <= 1 or role not in best.estimate.workload.models():
            continue
        cfg = getattr(best.estimate.workload, role)
        schedule = cfg.pipeline_schedule if call.endswith("train") else "gpipe"
        micro = cfg.pipeline_microbatches or stages
        cells.append(f"{call} {stages} stages x {micro} ({schedule})")
    return ", ".join(cells) or "-"


def tables(cases: list[Case], profile) -> str:
    lines = [
        f"Profile `{profile.name}` ({profile.memory_bytes / 2**30:.0f} GiB per device, "
        f"{profile.memory_reserve_bytes / 2**30:.0f} GiB reserve). "
        f"PPO workload: {WORKLOAD['prompts']} prompts x {WORKLOAD['samples_per_prompt']} sample, "
        f"prompt {WORKLOAD['prompt_len']} + generation {WORKLOAD['gen_len']} tokens, "
        f"{WORKLOAD['epochs']} PPO epoch, minibatch {WORKLOAD['minibatch_size']} in "
        f"micro-batches of {microbatch_rows(8)} rows on 8-16 devices, "
        f"{DEFAULT_MICROBATCH_ROWS} from 32 on; {DECODE_SLOTS} decode slots in total, scoring "
        f"{INFER_BATCH_SIZE} rows per call; bf16 weights, "
        f"fp32 AdamW moments, remat `{REMAT}` (these batch and memory knobs are the "
        f"starting point: the search chooses them per plan, `tune_batches`). GRPO workload: "
        f"{GRPO['prompts']} prompts x {GRPO['samples_per_prompt']} samples (the same rows), "
        f"actor and reference only (a verifiable reward, no critic). {MOE[0][1]}: a "
        f"`{MODELS[MOE[0][1]]}`-shaped mixture of experts (128 experts, 8 chosen per token) "
        f"in the GRPO workload. Search: {SEARCH}; the "
        f"{LARGE[1]} {LARGE[0].upper()} case on {LARGE[2]} devices: {LARGE_SEARCH}. Plans may "
        "split a mixture of experts' experts over an `expert` axis (e), and the layers of "
        "models whose weights and AdamW moments do not fit one node over pipeline stages "
        "(s, whole nodes each; pipeline micro-batches and GPipe or 1F1B chosen per plan).",
        "",
        "Estimated seconds per iteration (best variant of each strategy; OOM: no variant fits, "
        "with the least peak memory per device among them):",
        "",
        "| algorithm | model | devices | flatten | interleave | separate | searched "
        "| searched vs flatten | vs interleave | vs separate | method (plans evaluated) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cases:
        r = c.result
        b = r.baselines if r else {}
        best = r.best if r else None
        lines.append(
            f"| {c.algorithm} | {c.size} | {c.devices} | "
            + " | ".join(_secs(b.get(s)) for s in STRATEGY_NAMES)
            + f" | {_secs(best)} | "
            + " | ".join(_ratio(b.get(s), best) for s in STRATEGY_NAMES)
            + f" | {r.method if r else '-'} ({r.evaluated if r else 0}) |"
        )
    lines += [
        "",
        "Per-phase estimate of the searched plan (seconds) and its placement "
        "(calls sharing a slot: `devices(tensor)@first device`):",
        "",
        "| algorithm | model | devices | plan | generate | score | train | reshard | peak GiB "
        "| placement |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cases:
        if c.result is None:
            continue
        best = c.result.best
        ph = best.estimate.phase_seconds
        fits = "" if best.estimate.fits else " (OOM)"
        lines.append(
            f"| {c.algorithm} | {c.size} | {c.devices} | {best.plan.name}{fits} | "
            + " | ".join(f"{ph.get(p, 0.0):.1f}" for p in ("generate", "score", "train", "reshard"))
            + f" | {peak_memory_bytes(best.estimate) / 2**30:.0f} "
            + f"| {compact(best.plan, best.estimate.workload.models())} |"
        )
    lines += [
        "",
        "Knobs the search chose with the searched plan (scoring chunk in rows, micro-batches and "
        "remat policy of the actor's / critic's training call, pipeline stages x micro-batches "
        "(schedule) of staged calls, generation copy, state offloaded "
        "to host memory and the seconds its copies add) and the memory of its fullest call "
        "(GiB on its most loaded device):",
        "",
        "| algorithm | model | devices | chunk | micro-batches | remat | pipeline "
        "| generation copy | offload | fullest call | its memory (GiB) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cases:
        if c.result is None:
            continue
        lines.append(f"| {c.algorithm} | {c.size} | {c.devices} | " + knobs_row(c.result.best))
    lines += [
        "",
        "Best variant of each strategy (placement and per-phase seconds):",
        "",
        "| algorithm | model | devices | strategy | generate | score | train | reshard "
        "| peak GiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cases:
        if c.result is None:
            continue
        for s in STRATEGY_NAMES:
            r = c.result.baselines.get(s)
            if r is None:
                continue
            ph = r.estimate.phase_seconds
            fits = "" if r.estimate.fits else " (OOM)"
            lines.append(
                f"| {c.algorithm} | {c.size} | {c.devices} | {r.plan.name}{fits} | "
                + " | ".join(
                    f"{ph.get(p, 0.0):.1f}" for p in ("generate", "score", "train", "reshard")
                )
                + f" | {peak_memory_bytes(r.estimate) / 2**30:.0f} |"
            )
    lines += axes_text(cases, profile)
    lines += overlap_tables(cases, profile)
    return "\n".join(lines) + "\n"


def with_axes(plan, w, calls, per_node: int, stages: int | None = None, experts: int | None = None):
    """``plan`` with ``calls`` given ``stages`` / ``experts`` (None: as they are) on their
    slots, or None when a placement is not a slot or the change is not a valid slot."""
    from jrlhf.placement.candidates import build_plan, call_models, slot_problem, slots_of

    slots, models = slots_of(plan), call_models(w)
    if slots is None:
        return None
    for call in calls:
        change = {k: v for k, v in (("stages", stages), ("experts", experts)) if v is not None}
        slots[call] = dataclasses.replace(slots[call], **change)
        n = plan.num_devices()
        if slot_problem(call, models[call], slots[call], n, devices_per_node=per_node):
            return None
    return build_plan(plan.name, slots)


def axes_text(cases: list[Case], profile) -> list[str]:
    """What the expert and stage axes did, in words, from the cases' searched plans: the
    expert-split plans against the same plans with the experts unsplit, and for the cases
    whose models the search offered stages, the searched plan staged (every training and
    scoring call, each stage count the model and slices admit) against it."""
    from jrlhf.placement.estimator import estimate_tuned
    from jrlhf.placement.search import staged_calls

    lines = ["", "Expert and pipeline-stage axes (the search proposes both, `jrlhf.placement."
             "search`):", ""]  # fmt: skip
    for c in cases:
        if c.result is None:
            continue
        best, w = c.result.best, workload_for(c.size, c.devices, c.algorithm)
        calls = [x for x, _ in best.plan.placements if x != "actor_generate"]
        per_node = min(profile.devices_per_node, c.devices)
        name = f"{c.algorithm.upper()} {c.size} on {c.devices}"
        strategies = min(
            (b.cost for b in c.result.baselines.values() if b.estimate.fits), default=math.inf
        )
        staged = staged_calls(w, profile, per_node)
        if not best.estimate.fits:
            if staged or w.actor.is_moe:
                axes = "stages" if staged else "expert axes"
                lines.append(
                    f"- {name}: {axes} offered, and still no plan found fits (the least over "
                    f"memory: {_secs(best)}, {compact(best.plan, w.models())})."
                )
            continue
        if w.actor.is_moe:
            ways = sorted({best.plan[x].mesh.shape.get("expert", 1) for x in calls} - {1})
            plain = with_axes(best.plan, w, calls, per_node, experts=1)
            e = estimate_tuned(plain, w, profile) if plain is not None else None
            unsplit = _seconds(e) if e is not None else "n/a"
            lines.append(
                f"- {name}: the searched plan ({best.cost:.1f} s) splits the experts "
                + (f"{' / '.join(map(str, ways))} ways" if ways else "nowhere")
                + f"; the same plan with the experts unsplit: {unsplit}; the best strategy "
                f"(never split): {_secs_or_oom(strategies)}."
            )
        if staged:
            moved = [x for x in calls if x in staged]
            has = sorted({best.plan[x].mesh.shape.get("stage", 1) for x in calls} - {1})
            offered = (
                f"stages offered to {', '.join(sorted(staged))} (its state does not fit one node)"
            )
            if has:
                plain = with_axes(best.plan, w, moved, per_node, stages=1)
                e = estimate_tuned(plain, w, profile) if plain is not None else None
                shown = _seconds(e) if e is not None else "n/a"
                lines.append(
                    f"- {name}: {offered}; the searched plan ({best.cost:.1f} s) pipelines over "
                    f"{' / '.join(map(str, has))} stages; the same plan unstaged: {shown}; the "
                    f"best strategy (never staged): {_secs_or_oom(strategies)}."
                )
                continue
            tried = []
            for stages in (2, 4, 8):
                plan = with_axes(best.plan, w, moved, per_node, stages=stages)
                if plan is not None:
                    tried.append(f"{stages} stages {_seconds(estimate_tuned(plan, w, profile))}")
            lines.append(
                f"- {name}: {offered}; the searched plan ({best.cost:.1f} s) has none; the same "
                "plan with those calls staged: "
                + ("; ".join(tried) if tried else "no stage count divides its slices")
                + "."
            )
    return lines


def _secs_or_oom(seconds: float) -> str:
    return f"{seconds:.1f} s" if math.isfinite(seconds) else "none fits"


def _seconds(estimate) -> str:
    """'12.3 s', or 'OOM (N GiB)' for an estimate that does not fit."""
    if not estimate.fits:
        return f"OOM ({peak_memory_bytes(estimate) / 2**30:.0f} GiB)"
    return f"{estimate.iteration_seconds:.1f} s"


# The long-tailed response lengths the fusion estimate uses: jrlhf.tasks.longtail's law (a
# discretized Pareto law, tail index 1) on a grid from 48 tokens up to the workload's 1024.
TAIL = dict(response_len=48, tail_index=1.0)


def tail_lengths(rows: int, max_len: int, seed: int = 0) -> list[int]:
    """``rows`` response lengths drawn from the long-tailed task's length law, capped at
    ``max_len`` (median about twice ``TAIL['response_len']``)."""
    import numpy as np

    from jrlhf.tasks.longtail import LongTailTask

    task = LongTailTask(max_response_len=max_len + 1, **TAIL)
    rng = np.random.default_rng(seed)
    return [int(k) for k in rng.choice(task.lengths, size=rows, p=task.length_probs)]


def overlap_tables(cases: list[Case], profile) -> list[str]:
    """Estimated gains of the two overlap mechanisms (issue: asynchronous RL and inter-stage
    fusion) for PPO on separated plans (generation on devices of its own): every `separate`
    variant is priced with Asynchrony.max_staleness=1 (the iteration is the slower of generation
    and the rest, so the best split is not the synchronous one) and the fastest kept; on it,
    scoring finished samples while long-tailed ones still decode."""
    from jrlhf.placement.estimator import estimate_tuned, fused_rollout_seconds
    from jrlhf.placement.search import SearchSpace, strategy_variants

    lines = [
        "",
        "Overlap mechanisms for PPO, estimated. Asynchronous: every `separate` variant priced "
        "with max_staleness=1 (its iteration is the slower of generation and the rest, each "
        "plan's knobs tuned for it), the fastest against the synchronous best plan. Fusion, on "
        f"that plan: scoring in calls of {INFER_BATCH_SIZE} rows as samples finish, on "
        "long-tailed response lengths (the longtail task's law from "
        f"{TAIL['response_len']} tokens, capped at {WORKLOAD['gen_len']}), time to a scored batch:",
        "",
        "| model | devices | best sync plan (s) | async plan: generation devices, generate / rest "
        "(s) | async (s) | async vs best sync | rollout unfused / fused (s) | fusion gain on "
        "the rollout |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in cases:
        if c.algorithm != "ppo" or c.result is None or not c.result.best.estimate.fits:
            continue
        w = dataclasses.replace(workload_for(c.size, c.devices, "ppo"), max_staleness=1)
        space = SearchSpace(w, c.devices, devices_per_node=min(profile.devices_per_node, c.devices))
        best_async = None
        for plan in strategy_variants(space).get("separate", []):
            e = estimate_tuned(plan, w, profile)
            if e.fits and (
                best_async is None or e.iteration_seconds < best_async[1].iteration_seconds
            ):
                best_async = (plan, e)
        if best_async is None:
            continue
        plan, e = best_async
        ph = e.phase_seconds
        gen = ph.get("generate", 0.0)
        rest = sum(v for k, v in ph.items() if k != "generate")
        tuned = e.workload
        lengths = tail_lengths(tuned.prompts * tuned.samples_per_prompt, tuned.gen_len)
        fused = fused_rollout_seconds(plan, tuned, profile, lengths, INFER_BATCH_SIZE)
        gen_devices = len(plan["actor_generate"].devices)
        lines.append(
            f"| {c.size} | {c.devices} | {c.result.best.cost:.1f} | {gen_devices}, "
            f"{gen:.1f} / {rest:.1f} | {e.iteration_seconds:.1f} | "
            f"{c.result.best.cost / e.iteration_seconds:.2f}x | {fused['unfused_s']:.1f} / "
            f"{fused['fused_s']:.1f} | {fused['unfused_s'] / fused['fused_s']:.2f}x |"
        )
    return lines


# ------------------------------------------------------------------ long-reasoning GRPO
# The workload where the 2026 systems get their gains: GRPO with long, long-tailed responses.
# Llama-3 shapes (grouped-query attention: 8 KV heads, as the long-reasoning models have).
REASONING_MODELS = {"8B": "llama3_8b", "70B": "llama3_70b", "405B": "llama3_405b"}
REASONING = dict(
    prompts=128,
    samples_per_prompt=16,
    prompt_len=1024,
    gen_len=16384,
    epochs=1,
    minibatch_size=512,
)
# jrlhf.tasks.longtail's law from 1,024 tokens: 1024, 1448, ..., 16384 (tail index 1)
REASONING_TAIL = dict(response_len=1024, tail_index=1.0)
REASONING_SLOTS = 512
REASONING_CASES = (("8B", 64), ("8B", 128), ("70B", 64), ("70B", 128), ("405B", 1024))
# The 405B case's search walks 1,024 devices per estimate: about 10 minutes a schedule on 2
# cores with LARGE_SEARCH, so it is left out unless asked for (--reasoning-models ... 405B).
# (label, max_staleness, partial_rollout_tokens): T must divide 16,384 and T x k reach it
SCHEDULES = (
    ("sync", 0, 0),
    ("k=1", 1, 0),
    ("k=2", 2, 0),
    ("k=2, T=8192", 2, 8192),
    ("k=4, T=4096", 4, 4096),
)
REASONING_BEGIN, REASONING_END = "<!-- reasoning:begin -->", "<!-- reasoning:end -->"
TRAFFIC_BEGIN, TRAFFIC_END = "<!-- traffic:begin -->", "<!-- traffic:end -->"


def reasoning_lengths(rows: int) -> tuple[tuple[int, int], ...]:
    """The long-tailed lengths of ``rows`` responses (the law's expected batch)."""
    from jrlhf.placement.workload import law_lengths
    from jrlhf.tasks.longtail import LongTailTask

    task = LongTailTask(max_response_len=REASONING["gen_len"] + 1, **REASONING_TAIL)
    return law_lengths(task.lengths, task.length_probs, rows)


def reasoning_workload(size: str, max_staleness: int = 0, partial: int = 0):
    """Long-reasoning GRPO: actor and reference of ``size``, a verifiable reward."""
    from jrlhf.placement.workload import Workload

    model = get_preset(REASONING_MODELS[size], remat_policy=REMAT, max_position_embeddings=32768)
    rows = REASONING["prompts"] * REASONING["samples_per_prompt"]
    return Workload(
        actor=model,
        critic=None,
        reference=model,
        reward=None,
        **REASONING,
        decode_slots=REASONING_SLOTS,
        response_lengths=reasoning_lengths(rows),
        max_staleness=max_staleness,
        partial_rollout_tokens=partial,
    )


def grpo_workload(size: str):
    """The study's GRPO workload (1,024-token responses) with a Llama-3 shape of ``size``."""
    return dataclasses.replace(
        reasoning_workload(size),
        **{**WORKLOAD, **GRPO},
        response_lengths=(),
        decode_slots=DECODE_SLOTS,
    )


def run_schedule(size: str, devices: int, schedule: tuple, profile) -> tuple:
    label, k, t = schedule
    kwargs = dict(SEARCH)
    if devices >= 1024:
        kwargs.update(LARGE_SEARCH)
    t0 = time.perf_counter()
    result = search(
        reasoning_workload(size, k, t),
        devices,
        profile,
        devices_per_node=min(profile.devices_per_node, devices),
        tune_batches=True,
        **kwargs,
    )
    return (size, devices, label), result, time.perf_counter() - t0


def layout(estimate) -> str:
    """Generation devices / the rest's, or 'shared' where generation shares devices."""
    plan, w = estimate.plan, estimate.workload
    gen = plan["actor_generate"].devices
    rest = set().union(*(plan[c].devices for c, (role, _) in CALLS.items() if role in w.models()
                         and c != "actor_generate"))  # fmt: skip
    if gen & rest:
        return f"shared ({len(gen | rest)})"
    return f"{len(gen)} / {len(rest)}"


def reasoning_tables(results: dict, profile) -> str:
    from jrlhf.placement.estimator import partial_pass_rows

    w = reasoning_workload("8B")
    lengths = w.lengths
    mean = sum(k * n for k, n in lengths) / w.rows
    longest = sum(n for k, n in lengths if k == max(k for k, _ in lengths))
    lines = [
        f"Long-reasoning GRPO, estimated (profile `{profile.name}`): {w.prompts} prompts x "
        f"{w.samples_per_prompt} samples, prompt {w.prompt_len} + responses up to {w.gen_len} "
        f"tokens drawn from the longtail task's law from {REASONING_TAIL['response_len']} "
        f"tokens (tail index {REASONING_TAIL['tail_index']:g}; the law's expected batch, "
        f"`law_lengths`: mean {mean:.0f} tokens, {longest} of {w.rows} rows at {w.gen_len}); "
        f"{REASONING_SLOTS} decode slots (continuous batching), 1 epoch, minibatch "
        f"{w.minibatch_size}; actor and reference of Llama-3 shape (`llama3_8b`, `llama3_70b`, "
        f"`llama3_405b`), a verifiable reward. Scoring and training see full-width rows "
        f"(prompt + {w.gen_len} columns). Each schedule is its own search (batch and memory "
        f"knobs tuned per plan; {SEARCH}, at 1,024 devices {LARGE_SEARCH}): sync is "
        "max_staleness 0; k=1, k=2 bounded staleness; T: partial rollouts of T tokens a pass. "
        "Seconds per iteration; layout: generation devices / the rest's (shared: generation "
        "shares devices with the other calls, so nothing overlaps):",
        "",
        "| model | devices | " + " | ".join(lb for lb, _, _ in SCHEDULES) + " | best vs sync |",
        "|---|---|" + "---|" * len(SCHEDULES) + "---|",
    ]
    for size, devices in dict.fromkeys((s, d) for s, d, _ in results):
        row = [results.get((size, devices, lb)) for lb, _, _ in SCHEDULES]
        cells, costs = [], []
        for r in row:
            if r is None:
                cells.append("-")
                continue
            best = r.best
            cells.append(f"{_secs(best)} ({layout(best.estimate)})")
            costs.append(best.cost)
        sync = row[0].best.cost if row[0] is not None else math.nan
        ratio = sync / min(costs) if costs and math.isfinite(sync) else math.nan
        gain = f"{ratio:.2f}x" if math.isfinite(ratio) else "-"
        lines.append(f"| {size} | {devices} | " + " | ".join(cells) + f" | {gain} |")
    lines += [
        "",
        "Phases of each best plan (seconds: generate / score / train / reshard, and the data "
        "plane's transfer where samples cross between groups):",
        "",
        "| model | devices | schedule | plan | generate | score | train | reshard | data plane "
        "| peak GiB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (size, devices, label), r in results.items():
        e = r.best.estimate
        ph = e.phase_seconds
        fits = "" if e.fits else " (OOM)"
        lines.append(
            f"| {size} | {devices} | {label} | {r.best.plan.name}{fits} | "
            + " | ".join(f"{ph.get(p, 0.0):.1f}" for p in ("generate", "score", "train", "reshard"))
            + f" | {e.data_plane_seconds:.2f} | {peak_memory_bytes(e) / 2**30:.0f} |"
        )
    wp = reasoning_workload("8B", 2, 8192)
    rows = partial_pass_rows(wp)
    continued = sum(n for pre, _, _, n in rows if pre > wp.prompt_len)
    recomputed = sum((pre - wp.prompt_len) * n for pre, _, _, n in rows if pre > wp.prompt_len)
    lines += [
        "",
        f"A pass of T=8192 at k=2 decodes {sum(n for *_, n in rows)} rows: the new batch's "
        f"{wp.rows} and {continued} continued from the batch before, whose {recomputed:,} tokens "
        "so far are prefilled again (`estimator.partial_pass_rows`).",
    ]
    return "\n".join(lines) + "\n"


TRAFFIC_CASES = (("8B", 64), ("70B", 128), ("405B", 1024))


def traffic_table(profile) -> str:
    """Bytes between the groups per iteration, for generation on half the devices."""
    from jrlhf.placement import plan as plans
    from jrlhf.placement.estimator import group_traffic

    lines = [
        "| model | devices (generation / rest) | workload | receiving processes | samples per "
        "process | data plane out of the sender | on its link (s) | control plane | weights "
        "(one copy) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def mb(x: float) -> str:
        return f"{x / 1e9:,.1f} GB" if x >= 1e9 else f"{x / 1e6:,.0f} MB"

    for size, devices in TRAFFIC_CASES:
        plan = plans.separate(devices, devices // 2)
        for name, w in (
            ("GRPO, 1,024-token responses", grpo_workload(size)),
            ("long-reasoning GRPO, k=2, T=8192", reasoning_workload(size, 2, 8192)),
        ):
            t = group_traffic(dataclasses.replace(w, max_staleness=max(1, w.max_staleness)),
                              plan, profile)  # fmt: skip
            lines.append(
                f"| {size} | {devices} ({devices // 2} / {devices - devices // 2}) | {name} "
                f"({w.rows} rows) | {t.receivers} | {mb(t.batch_bytes)} | {mb(t.data_bytes)} | "
                f"{t.data_seconds:.2f} | {t.control_bytes / 1e3:.0f} KB | {mb(t.weight_bytes)} |"
            )
    return "\n".join(lines) + "\n"


def update(path: Path, text: str, begin: str = BEGIN, end: str = END) -> None:
    doc = path.read_text()
    if begin not in doc or end not in doc:
        raise SystemExit(f"{path}: no {begin} ... {end} markers to replace")
    head, rest = doc.split(begin, 1)
    _, tail = rest.split(end, 1)
    path.write_text(f"{head}{begin}\n{text}{end}{tail}")


def reasoning_main(args, profile) -> int:
    traffic = traffic_table(profile)
    todo = [
        (size, n, sc)
        for size, n in REASONING_CASES
        if n in args.devices and size in args.reasoning_models
        for sc in SCHEDULES
    ]
    if args.jobs > 1:
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(args.jobs) as pool:
            futures = [pool.submit(run_schedule, *c, profile) for c in todo]
            done = [f.result() for f in futures]
    else:
        done = [run_schedule(*c, profile) for c in todo]
    results = {}
    for key, result, secs in done:
        print(f"{' '.join(map(str, key))}: {secs:.0f} s search", file=sys.stderr)
        results[key] = result
    text = reasoning_tables(results, profile)
    if args.update:
        update(args.update, traffic, TRAFFIC_BEGIN, TRAFFIC_END)
        update(args.update, text, REASONING_BEGIN, REASONING_END)
    print(traffic)
    print(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    from jrlhf.placement.profile import DeviceProfile

    p = argparse.ArgumentParser(prog="python -m benchmarks.plan_study", description=__doc__)
    p.add_argument("--device-kind", default="h100")
    p.add_argument("--devices", type=int, nargs="*", default=list(DEVICES))
    p.add_argument("--models", nargs="*", default=["7B", "70B"], choices=list(MODELS)[:3])
    p.add_argument("--algorithms", nargs="*", default=list(ALGORITHMS), choices=ALGORITHMS)
    p.add_argument(
        "--large", action=argparse.BooleanOptionalAction, default=True, help=f"add {LARGE}"
    )
    p.add_argument("--moe", action=argparse.BooleanOptionalAction, default=True, help=f"add {MOE}")
    p.add_argument("--update", type=Path, help="rewrite the generated part of this markdown file")
    p.add_argument("--jobs", type=int, default=1, help="cases searched in parallel processes")
    p.add_argument(
        "--reasoning",
        action="store_true",
        help="the long-reasoning GRPO tables and the bytes between groups instead",
    )
    p.add_argument("--reasoning-models", nargs="*", default=["8B", "70B"], choices=REASONING_MODELS)
    args = p.parse_args(argv)
    profile = DeviceProfile.load(args.device_kind)
    if args.reasoning:
        if argv is None and "--devices" not in sys.argv:
            args.devices = sorted({n for _, n in REASONING_CASES})
        return reasoning_main(args, profile)
    todo = [(a, size, n) for a in args.algorithms for size in args.models for n in args.devices]
    if args.moe:
        todo += [c for c in MOE if c[2] in args.devices]
    if args.large:
        todo.append(LARGE)
    extra: dict = {}
    if args.jobs > 1:
        from concurrent.futures import ProcessPoolExecutor

        # largest cases first so the pool stays busy; results are put back in table order
        order = sorted(todo, key=lambda c: (-c[2], c[1]))
        with ProcessPoolExecutor(args.jobs) as pool:
            futures = {c: pool.submit(run_case, *c, profile, **extra) for c in order}
            done = {c: f.result() for c, f in futures.items()}
        cases = [done[c] for c in todo]
    else:
        cases = [run_case(*c, profile, **extra) for c in todo]
    for case in cases:
        print(
            f"{case.algorithm} {case.size} on {case.devices}: {case.seconds:.0f} s search",
            file=sys.stderr,
        )
    text = tables(cases, profile)
    if args.update:
        update(args.update, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
