"""The placement study of docs/plans.md: estimated PPO iteration time on 8 to 128 H100s.

    python -m benchmarks.plan_study                         # print the tables (markdown)
    python -m benchmarks.plan_study --update docs/plans.md  # rewrite the generated part of the doc

For a 7B and a 70B actor + critic PPO setup (reference and reward the same size as the actor), on
8, 16, 32, 64 and 128 devices of a profile (H100 by default), it reports the best variant of each
named strategy (flatten, interleave, separate, each tuned over tensor sizes) and the searched
plan. Every number is the cost estimator's (jrlhf.placement.estimator) from the profile's datasheet
rates: an estimate, not a measurement. The search is seeded, so the tables are reproducible.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from pathlib import Path

from jrlhf.models.presets import get_preset
from jrlhf.placement.search import SearchResult, peak_memory_bytes, search

BEGIN, END = "<!-- study:begin -->", "<!-- study:end -->"
DEVICES = (8, 16, 32, 64, 128)
MODELS = {"7B": "llama2_7b", "70B": "llama2_70b", "405B": "llama3_405b"}
ALGORITHMS = ("ppo", "grpo")
# GRPO as its seeds run it: groups of samples per prompt, a verifiable (Python) reward, no
# critic; the same 512 rows per iteration as the PPO workload.
GRPO = dict(prompts=64, samples_per_prompt=8)
# The 405B-class case: a GRPO actor (and its reference) on 1,024 devices, searched with a
# shorter anneal (each estimate walks 1,024 devices).
LARGE = ("grpo", "405B", 1024)
LARGE_SEARCH = dict(steps=6000, restarts=2)
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
# reference / reward / critic score INFER_BATCH_SIZE rows per call (RLConfig.infer_batch_size),
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
    """``gen 64(t8)@0 | ref,rew,crit-inf 64(t8)@64 | ...``: calls grouped by identical slot;
    with ``roles``, only the calls of those roles (GRPO has no critic or reward model)."""
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
        key = f"{len(ids)}(t{p.mesh.shape.get('tensor', 1)})@{ids[0]}"
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
        f"{w.infer_batch_size or 'all'} | {mb} | {remat} | {w.generation_copy} | {offload} "
        f"| {call} | {e.memory_bytes[call] / 2**30:.1f}: {parts} |"
    )


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
        f"actor and reference only (a verifiable reward, no critic). Search: {SEARCH}; the "
        f"{LARGE[1]} {LARGE[0].upper()} case on {LARGE[2]} devices: {LARGE_SEARCH}.",
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
        "remat policy of the actor's / critic's training call, generation copy, state offloaded "
        "to host memory and the seconds its copies add) and the memory of its fullest call "
        "(GiB on its most loaded device):",
        "",
        "| algorithm | model | devices | chunk | micro-batches | remat | generation copy "
        "| offload | fullest call | its memory (GiB) |",
        "|---|---|---|---|---|---|---|---|---|---|",
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
    lines += overlap_tables(cases, profile)
    return "\n".join(lines) + "\n"


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
    variant is priced with RLConfig.max_staleness=1 (the iteration is the slower of generation
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


def update(path: Path, text: str) -> None:
    doc = path.read_text()
    if BEGIN not in doc or END not in doc:
        raise SystemExit(f"{path}: no {BEGIN} ... {END} markers to replace")
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    path.write_text(f"{head}{BEGIN}\n{text}{END}{tail}")


def main(argv: list[str] | None = None) -> int:
    from jrlhf.placement.profile import DeviceProfile

    p = argparse.ArgumentParser(prog="python -m benchmarks.plan_study", description=__doc__)
    p.add_argument("--device-kind", default="h100")
    p.add_argument("--devices", type=int, nargs="*", default=list(DEVICES))
    p.add_argument("--models", nargs="*", default=["7B", "70B"], choices=list(MODELS))
    p.add_argument("--algorithms", nargs="*", default=list(ALGORITHMS), choices=ALGORITHMS)
    p.add_argument(
        "--large", action=argparse.BooleanOptionalAction, default=True, help=f"add {LARGE}"
    )
    p.add_argument("--update", type=Path, help="rewrite the generated part of this markdown file")
    p.add_argument("--jobs", type=int, default=1, help="cases searched in parallel processes")
    args = p.parse_args(argv)
    profile = DeviceProfile.load(args.device_kind)
    todo = [(a, size, n) for a in args.algorithms for size in args.models for n in args.devices]
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
