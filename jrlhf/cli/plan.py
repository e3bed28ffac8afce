"""Plan an RLHF run: rank execution plans by estimated iteration time and write the best as gin.

    python -m jrlhf.plan --config configs/llama3_8b_ppo.gin --devices 64 --device-kind h100
    python -m jrlhf.plan --config configs/ppo_tiny.gin --actor llama2_70b --critic llama2_7b \\
        --devices 128 --device-kind h100 --output plan.gin

The workload (batch, lengths, epochs) comes from the gin config; each role's model from a preset
(``--actor llama2_7b``...) or the config's RoleConfig init. The device profile (``h100``, ``h200``,
``cpu`` or a JSON file) need not describe this machine: plans for 128 H100s can be searched on a
laptop. The written gin file sets every role's meshes (``RunConfig.placement = 'custom'``) and is
meant to be included after the base config; it only runs on hardware with that many devices.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import jax

from jrlhf.config import ROLES, load_config
from jrlhf.models.presets import get_preset
from jrlhf.pipeline.task_data import task_model_overrides
from jrlhf.placement.estimator import batch_bindings
from jrlhf.placement.plan import CALLS, STAGE_CALLS
from jrlhf.placement.profile import DeviceProfile
from jrlhf.placement.search import (
    check_device_count,
    check_fits_somewhere,
    local_device_kind,
    peak_memory_bytes,
    search,
)
from jrlhf.placement.workload import Workload
from jrlhf.runtime.model_source import role_models

PHASES = ("generate", "score", "train", "reshard")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jrlhf.plan",
        description="Rank execution plans by estimated iteration time; write the best as gin.",
    )
    p.add_argument("--config", action="append", default=[], help="gin file (repeatable)")
    p.add_argument("bindings", nargs="*", help="gin bindings, e.g. RLConfig.minibatch_size=64")
    p.add_argument("--devices", type=int, help="devices to plan for (default: this machine's)")
    p.add_argument(
        "--device-kind",
        help="device profile: h100, h200, cpu or a profile JSON (default: this machine's)",
    )
    for role in ROLES:
        p.add_argument(f"--{role}", metavar="PRESET", help=f"model preset for the {role}")
    p.add_argument("--top", type=int, default=10, help="plans to list (default 10)")
    p.add_argument("--output", default="plan.gin", help="gin file for the best plan")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--steps", type=int, default=2000, help="MCMC proposals per chain")
    p.add_argument("--restarts", type=int, default=4, help="MCMC chains")
    p.add_argument("--seed", type=int, default=0, help="MCMC seed")
    p.add_argument(
        "--fixed-batches",
        action="store_true",
        help="keep the config's batch and memory knobs (Memory.infer_batch_size, "
        "generation_copy, offload; RoleConfig.microbatches, remat_policy) instead of choosing "
        "them per plan (and writing them to the gin file)",
    )
    p.add_argument(
        "--memory-reserve",
        type=float,
        metavar="GIB",
        help="GiB per device held back in the fit check for allocator fragmentation and runtime "
        "buffers (default: the profile's memory_reserve_bytes, 0 for the built-in ones)",
    )
    p.add_argument(
        "--exhaustive-limit",
        type=int,
        default=20_000,
        help="enumerate every plan when the space has at most this many (default 20000)",
    )
    return p


def _fmt_s(x: float) -> str:
    return "inf" if not math.isfinite(x) else f"{x:.3g}" if x < 0.01 else f"{x:.2f}"


def _row(rank: str, r) -> dict:

    est = r.estimate
    return {
        "rank": rank,
        "plan": r.plan.name,
        **{phase: float(est.phase_seconds.get(phase, 0.0)) for phase in PHASES},
        "iteration": float(est.iteration_seconds),
        "peak_gb": peak_memory_bytes(est) / 2**30,
        "fits": bool(est.fits),
    }


def format_table(result) -> str:
    """Ranked plans, then any named strategy that did not make the list (rank '-')."""
    rows = [_row(str(i + 1), r) for i, r in enumerate(result.ranked)]
    listed = {r.plan.placements for r in result.ranked}
    for r in result.baselines.values():
        if r.plan.placements not in listed:
            rows.append(_row("-", r))
    head = ["rank", "plan", *PHASES, "iteration_s", "peak_GB", "fits"]
    body = [
        [
            row["rank"],
            row["plan"],
            *(_fmt_s(row[p]) for p in PHASES),
            _fmt_s(row["iteration"]),
            f"{row['peak_gb']:.1f}",
            "yes" if row["fits"] else "no",
        ]
        for row in rows
    ]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(line, widths)) for line in [head, *body]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def describe_best(result, absent: dict[str, str] | None = None) -> str:
    """The chosen plan's placements and estimated per-call and per-phase timeline. ``absent``
    maps the calls this workload does not make to the missing role: they are marked, not timed
    (their meshes are written only so the gin file is complete)."""
    absent = absent or {}
    best = result.best
    est = best.estimate
    lines = [f"chosen plan {best.plan.name!r}:"]
    for call, mesh, rules in best.plan.rows():
        secs = est.call_seconds.get(call)
        if call in absent:
            lines.append(f"  {call:16s} not run (no {absent[call]} model)")
            continue
        when = f"  {_fmt_s(secs)} s" if secs is not None else ""
        lines.append(f"  {call:16s} {mesh} [{rules}]{when}")
    for edge, secs in est.reshard_seconds.items():
        lines.append(f"  reshard {edge}: {_fmt_s(secs)} s")
    w = getattr(est, "workload", None)
    if w is not None:
        chunk = w.infer_batch_size or "all"
        mbs = f"actor {w.actor_microbatches}" + (
            f", critic {w.critic_microbatches}" if w.critic is not None else ""
        )
        lines.append(f"  batches: scoring chunk {chunk} rows; micro-batches {mbs}")
        remat = f"actor {w.actor.remat_policy}" + (
            f", critic {w.critic.remat_policy}" if w.critic is not None else ""
        )
        offload = ", ".join(w.offload) or "nothing"
        host = sum(getattr(est, "offload_seconds", {}).values())
        lines.append(
            f"  memory: remat {remat}; generation copy {w.generation_copy}; offloaded to host "
            f"{offload}" + (f" ({_fmt_s(host)} s of host copies)" if w.offload else "")
        )
    breakdown = getattr(est, "memory_breakdown", {})
    for call, parts in breakdown.items():
        total = sum(parts.values())
        items = ", ".join(f"{k} {v / 2**30:.1f}" for k, v in parts.items() if v >= 2**26)
        lines.append(f"  peak {call:16s} {total / 2**30:.1f} GiB ({items})")
    phases = ", ".join(f"{p} {_fmt_s(est.phase_seconds.get(p, 0.0))} s" for p in PHASES)
    lines.append(f"  timeline: {phases}; iteration {_fmt_s(est.iteration_seconds)} s")
    for name in ("flatten", "interleave", "separate"):
        speedup = result.speedup(name)
        if math.isfinite(speedup):
            lines.append(f"  {speedup:.2f}x faster than the best {name} plan")
    for reason in est.reasons:
        lines.append(f"  note: {reason}")
    return "\n".join(lines)


def gin_header(argv: list[str], result, profile, num_devices: int) -> str:
    best = result.best
    cmd = " ".join(["python -m jrlhf.plan", *argv])
    return "\n".join(
        [
            f"Written by `{cmd}`.",
            f"Best of {result.evaluated} plans evaluated of {result.total} ({result.method} "
            f"search) for {num_devices} x {profile.name} devices; {result.ranking_rule()}:",
            f"estimated iteration {_fmt_s(best.estimate.iteration_seconds)} s (an estimate from "
            f"the {profile.name} profile, not a measurement)"
            + ("." if best.estimate.fits else "; it does not fit in memory."),
            memory_line(profile) + ".",
            f"Runs only where jax sees {num_devices} devices of that kind: include it after the "
            "base config,",
            "  python -m jrlhf.train --config BASE.gin --config THIS.gin",
        ]
    )


def _batches(w) -> dict | None:
    """The batch and memory knobs a plan was priced with (None when the estimate does not
    say)."""
    if w is None:
        return None
    return {
        "infer_batch_size": w.infer_batch_size,
        "actor_microbatches": w.actor_microbatches,
        "critic_microbatches": w.critic_microbatches,
        "actor_remat_policy": w.actor.remat_policy,
        "critic_remat_policy": w.critic.remat_policy if w.critic is not None else None,
        "generation_copy": w.generation_copy,
        "offload": list(w.offload),
    }


def result_json(result) -> dict:
    def entry(r):
        est = r.estimate
        return {
            "name": r.plan.name,
            "placements": {call: [mesh, rules] for call, mesh, rules in r.plan.rows()},
            "call_seconds": dict(est.call_seconds),
            "reshard_seconds": dict(est.reshard_seconds),
            "phase_seconds": dict(est.phase_seconds),
            "iteration_seconds": est.iteration_seconds,
            "memory_bytes": dict(est.memory_bytes),
            "fits": est.fits,
            "reasons": list(est.reasons),
            "batches": _batches(getattr(est, "workload", None)),
            "memory_breakdown": dict(getattr(est, "memory_breakdown", {})),
            "offload_seconds": dict(getattr(est, "offload_seconds", {})),
        }

    return {
        "method": result.method,
        "space_size": result.space_size,
        "outside_space": result.outside,
        "total": result.total,
        "evaluated": result.evaluated,
        "ranking": result.ranking_rule(),
        "ranked": [entry(r) for r in result.ranked],
        "baselines": {k: entry(v) for k, v in result.baselines.items()},
        "speedup": {k: result.speedup(k) for k in result.baselines},
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)

    def fail(message: str) -> int:
        print(f"error: {message}", file=sys.stderr)
        return 2

    # Everything that can be checked without work is checked first, in one line each.
    presets = {role: getattr(args, role) for role in ROLES if getattr(args, role)}
    try:
        for name in presets.values():
            get_preset(name)
    except ValueError as e:
        return fail(str(e))
    if not args.config:
        return fail("--config is required (a gin file such as configs/llama3_8b_ppo.gin)")
    if args.devices is not None and args.devices < 1:
        return fail(f"--devices must be >= 1, got {args.devices}")
    if args.memory_reserve is not None and not (
        math.isfinite(args.memory_reserve) and args.memory_reserve >= 0
    ):
        return fail(f"--memory-reserve must be a number of GiB >= 0, got {args.memory_reserve}")
    if args.top < 1:
        return fail(f"--top must be >= 1, got {args.top}")
    for flag in ("steps", "restarts", "exhaustive_limit"):
        if getattr(args, flag) < 0:
            name = "--" + flag.replace("_", "-")
            return fail(f"{name} must be >= 0, got {getattr(args, flag)}")

    try:
        kind = args.device_kind or local_device_kind()
        profile = DeviceProfile.load(kind)
        if args.memory_reserve is not None:
            profile = profile.replace(memory_reserve_bytes=int(args.memory_reserve * 2**30))
    except (ValueError, OSError) as e:
        return fail(str(e).splitlines()[0])
    num_devices = args.devices
    try:
        cfg = load_config(args.config, args.bindings)
        if num_devices is None:
            num_devices = _local_devices(cfg, kind)
        check_device_count(num_devices, profile)
    except ValueError as e:
        return fail(str(e).splitlines()[0])

    try:
        models = role_models(cfg, lambda: task_model_overrides(cfg), presets)
        workload = Workload.from_config(cfg, models)
        check_fits_somewhere(workload, num_devices, profile)
        result = search(
            workload,
            num_devices,
            profile,
            devices_per_node=min(profile.devices_per_node, num_devices),
            exhaustive_limit=args.exhaustive_limit,
            steps=args.steps,
            restarts=args.restarts,
            seed=args.seed,
            top=args.top,
            tune_batches=not args.fixed_batches,
        )
    except (ValueError, OSError) as e:
        return fail(str(e).splitlines()[0])

    best = result.best
    text = best.plan.to_gin(gin_header(argv, result, profile, num_devices))
    if not args.fixed_batches and getattr(best.estimate, "workload", None) is not None:
        text += (
            "# batch and memory knobs chosen with the plan (--fixed-batches keeps the config's)\n"
        )
        text += "\n".join(batch_bindings(best.estimate.workload)) + "\n"
    if profile.shared_host:
        # Fake CPU devices are made by the trainer from this setting; a plan for N needs N.
        text += f"RunConfig.host_devices = {num_devices}\n"
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)

    if args.json:
        print(json.dumps({**result_json(result), "output": str(out)}, indent=2))
    else:
        roles = ", ".join(
            f"{role} {_count(m.num_params())}"
            for role, m in (
                ("actor", workload.actor),
                ("critic", workload.critic),
                ("reference", workload.reference),
                ("reward", workload.reward),
            )
            if m is not None
        )
        print(
            f"workload: {roles}; {workload.prompts} prompts x {workload.samples_per_prompt} "
            f"samples, prompt {workload.prompt_len} + gen {workload.gen_len} tokens, "
            f"{workload.epochs} epoch(s), minibatch {workload.minibatch_size}"
        )
        print(f"{num_devices} x {profile.name}: {result.method} search, {count_line(result)}")
        print(f"{result.ranking_rule()}:")
        print(format_table(result))
        print(describe_best(result, absent_calls(workload)))
        print(memory_line(profile))
        if not best.estimate.fits:
            print(
                f"warning: no plan fits in memory; the written plan is the one least over it "
                f"(peak {peak_memory_bytes(best.estimate) / 2**30:.1f} GiB per device, "
                f"{profile.name} has {profile.usable_bytes / 2**30:.1f} GiB usable)"
            )
            print(f"wrote {out}")
            return 1
        print(f"wrote {out}")
    return 0


def memory_line(profile) -> str:
    """The fit check's capacity, stated: device memory less the reserve."""
    reserve = profile.memory_reserve_bytes / 2**30
    return (
        f"fit check: {profile.usable_bytes / 2**30:.1f} GiB usable per device "
        f"({profile.memory_bytes / 2**30:.1f} GiB in the {profile.name} profile, "
        f"{reserve:.1f} GiB reserve; --memory-reserve sets it)"
    )


def count_line(result) -> str:
    """'N plans evaluated of M', M being the candidate space plus the strategy variants outside
    it (so N <= M, with N == M when the search was exhaustive)."""
    line = f"{result.evaluated} plans evaluated of {result.total}"
    if result.outside:
        line += (
            f" ({result.space_size} in the candidate space + {result.outside} strategy "
            "variant(s) outside it)"
        )
    return line


def absent_calls(workload) -> dict[str, str]:
    """Calls whose role has no model in this workload (GRPO's critic, a function reward)."""
    return {
        call: role
        for call, (role, _) in (*CALLS.items(), *STAGE_CALLS.items())
        if getattr(workload, role, None) is None
    }


def _count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)


def _local_devices(cfg, kind: str) -> int:
    """This machine's device count: the fake CPU devices the trainer would make, else jax's."""
    if kind == "cpu":
        return cfg.run.host_devices
    return jax.device_count()


if __name__ == "__main__":
    sys.exit(main())
