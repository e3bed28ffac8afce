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
LARGE_SEARCH = dict(steps=400, restarts=2)
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


SEARCH = dict(steps=3000, restarts=4, seed=0, top=5)
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


def compact(plan) -> str:
    """``gen 64(t8)@0 | ref,rew,crit-inf 64(t8)@64 | ...``: calls grouped by identical slot."""
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
        ids = sorted(p.mesh.device_ids())
        key = f"{len(ids)}(t{p.mesh.shape.get('tensor', 1)})@{ids[0]}"
        groups.setdefault(key, []).append(short[call])
    return " / ".join(f"{','.join(calls)} {key}" for key, calls in groups.items())


def tables(cases: list[Case], profile) -> str:
    lines = [
        f"Profile `{profile.name}` ({profile.memory_bytes / 2**30:.0f} GiB per device). "
        f"Workload: {WORKLOAD['prompts']} prompts x {WORKLOAD['samples_per_prompt']} sample, "
        f"prompt {WORKLOAD['prompt_len']} + generation {WORKLOAD['gen_len']} tokens, "
        f"{WORKLOAD['epochs']} PPO epoch, minibatch {WORKLOAD['minibatch_size']} in "
        f"micro-batches of {microbatch_rows(8)} rows on 8-16 devices, "
        f"{DEFAULT_MICROBATCH_ROWS} from 32 on; {DECODE_SLOTS} decode slots in total, scoring "
        f"{INFER_BATCH_SIZE} rows per call; bf16 weights, "
        f"fp32 AdamW moments, remat `{REMAT}`; search: {SEARCH}.",
        "",
        "Estimated seconds per iteration (best variant of each strategy; OOM: no variant fits, "
        "with the least peak memory per device among them):",
        "",
        "| model | devices | flatten | interleave | separate | searched | searched vs flatten "
        "| vs interleave | vs separate | method (plans evaluated) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cases:
        r = c.result
        b = r.baselines if r else {}
        best = r.best if r else None
        lines.append(
            f"| {c.size} | {c.devices} | "
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
        "| model | devices | plan | generate | score | train | reshard | peak GiB | placement |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cases:
        if c.result is None:
            continue
        best = c.result.best
        ph = best.estimate.phase_seconds
        fits = "" if best.estimate.fits else " (OOM)"
        lines.append(
            f"| {c.size} | {c.devices} | {best.plan.name}{fits} | "
            + " | ".join(f"{ph.get(p, 0.0):.1f}" for p in ("generate", "score", "train", "reshard"))
            + f" | {peak_memory_bytes(best.estimate) / 2**30:.0f} | {compact(best.plan)} |"
        )
    lines += [
        "",
        "Best variant of each strategy (placement and per-phase seconds):",
        "",
        "| model | devices | strategy | generate | score | train | reshard | peak GiB |",
        "|---|---|---|---|---|---|---|---|",
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
                f"| {c.size} | {c.devices} | {r.plan.name}{fits} | "
                + " | ".join(
                    f"{ph.get(p, 0.0):.1f}" for p in ("generate", "score", "train", "reshard")
                )
                + f" | {peak_memory_bytes(r.estimate) / 2**30:.0f} |"
            )
    return "\n".join(lines) + "\n"


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
    p.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--update", type=Path, help="rewrite the generated part of this markdown file")
    p.add_argument("--jobs", type=int, default=1, help="cases searched in parallel processes")
    args = p.parse_args(argv)
    profile = DeviceProfile.load(args.device_kind)
    todo = [(size, n) for size in args.models for n in args.devices]
    if args.jobs > 1:
        from concurrent.futures import ProcessPoolExecutor

        # largest cases first so the pool stays busy; results are put back in table order
        order = sorted(todo, key=lambda c: (-c[1], c[0]))
        with ProcessPoolExecutor(args.jobs) as pool:
            futures = {c: pool.submit(run_case, *c, profile) for c in order}
            done = {c: f.result() for c, f in futures.items()}
        cases = [done[c] for c in todo]
    else:
        cases = [run_case(size, n, profile) for size, n in todo]
    for case in cases:
        print(f"{case.size} on {case.devices}: {case.seconds:.0f} s search", file=sys.stderr)
    text = tables(cases, profile)
    if args.update:
        update(args.update, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
