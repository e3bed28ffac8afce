"""``python -m jrlhf.bench async``: synchronous vs asynchronous RL (``Asynchrony.max_staleness``)
with generation and training on separate process groups, side by side in one run.

Each variant is a real ``python -m jrlhf.launch ... -- train`` job whose plan gives generation
processes of its own (jrlhf.ppo.groups), in one of three layouts:

* ``1+1`` (``--processes 2``): 2 processes x 4 devices, ``separate``: generation on process 0,
  scoring and training on process 1;
* ``2+2`` (``--processes 4``): 4 processes x 2 devices, ``separate``: generation on processes
  0-1, scoring and training on 2-3;
* ``1+1+2`` (``--processes 4``): 4 processes x 2 devices, custom meshes: generation on process
  0, scoring on 1, training on 2-3.

Synchronous (``max_staleness=0``): the groups take turns (generate, then score and train, then
move the weights). Asynchronous (``max_staleness=1``): the generating group generates batch i+1
while the training group trains on batch i (jrlhf.ppo.schedules.bounded); they meet once per
iteration. The variants alternate (``--repeats``), so load on the machine hits both.

Each group is pinned to host cores of its own by default (``--pin``; jrlhf.launch ``--cores``):
generation on core 0, everything else on core 1 (modulo the cores there are), so generation and
training own separate hardware, as in a separated placement on accelerators. Unpinned, each
process's XLA threads spread over every core, so on an idle 2-core machine the groups only take
cores from each other (measured with 1+1: asynchronous 0.76x of synchronous).

The iteration time is the median gap between consecutive iterations' metric records (written by
process 0 as each iteration ends), after ``--warmup`` iterations (compilation). Each run also
reports its ``planes``: the sample channel's control-plane and data-plane bytes per iteration
and the most keys the coordination service held (a long ``--iterations`` run shows them flat).
Beside it:

* ``estimator``: the cost estimator's phases for the plan and workload (jrlhf.placement, this
  machine's calibrated ``cpu`` profile) and its iteration time, synchronous (the sum) and
  asynchronous (``iteration_seconds`` with the processes as separate hosts: the slower of
  generation and the rest);
* ``from_measured_phases``: the same two formulas applied to the synchronous run's own measured
  phase times.

PPO on the synthetic task from random Llama roles (size options below), one JSON object.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.report import add_out_argument, check_out, emit

ROOT = Path(__file__).resolve().parent.parent
PHASES = ("generate", "score", "train", "reshard")


# layout -> (processes, devices per process, placement bindings, the group of each process:
# 0 generates, 1 does the rest)
LAYOUTS = {
    "1+1": (2, 4, ["RunConfig.placement='separate'"], (0, 1)),
    "2+2": (4, 2, ["RunConfig.placement='separate'"], (0, 0, 1, 1)),
    "1+1+2": (
        4,
        2,
        [
            "RunConfig.placement='custom'",
            "actor/RoleConfig.generate_mesh='data=2@0:2'",
            *[f"{r}/RoleConfig.infer_mesh='fsdp=2@2:4'" for r in ("reference", "reward", "critic")],
            "reward/RoleConfig.train_mesh='fsdp=2@2:4'",
            *[f"{r}/RoleConfig.train_mesh='fsdp=2,tensor=2@4:8'" for r in ("actor", "critic")],
        ],
        (0, 1, 1, 1),
    ),
}
LAYOUTS_OF = {2: ("1+1",), 4: ("2+2", "1+1+2")}


def _bindings(args) -> list[str]:
    overrides = (
        f"(('hidden_size', {args.hidden}), ('intermediate_size', {args.mlp}), "
        f"('num_layers', {args.layers}), ('num_heads', {args.heads}), "
        f"('num_kv_heads', {args.heads}))"
    )
    rows = args.prompts * args.samples
    out = [
        "RunConfig.stages=('ppo',)",
        "RunConfig.tensorboard=False",
        "RunConfig.progress_bar=False",
        f"RoleConfig.model_overrides={overrides}",
        f"TaskConfig.max_response_len={args.new_tokens}",
        "TaskConfig.num_heldout=8",
        f"RLConfig.prompts_per_iteration={args.prompts}",
        f"RLConfig.samples_per_prompt={args.samples}",
        f"RLConfig.minibatch_size={rows // args.minibatches}",
        f"RLConfig.epochs={args.epochs}",
        f"RLConfig.iterations={args.iterations}",
        "RLConfig.checkpoint_every=0",
        "OffPolicy.correction='tis'",
    ]
    out += [f"{role}/RoleConfig.init='tiny'" for role in ("actor", "critic", "reference", "reward")]
    return out


def _run(
    layout: str, bindings: list[str], staleness: int, run_dir: Path, timeout: int, pin: bool
) -> list[dict]:
    processes, devices, placement, groups = LAYOUTS[layout]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    total = os.cpu_count() or 1
    cores = ["--cores", ";".join(str(g % total) for g in groups)] if pin else []
    cmd = [
        sys.executable, "-m", "jrlhf.launch", "--processes", str(processes),
        "--devices-per-process", str(devices), *cores, "--", "train", "--run-dir", str(run_dir),
        "--quiet", *bindings, *placement, f"Asynchrony.max_staleness={staleness}",
    ]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"{layout} max_staleness={staleness} run failed:\n{out.stderr[-3000:]}")
    lines = (run_dir / "logs" / "ppo" / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "reward" in r]


def _summary(rows: list[dict], warmup: int) -> dict:
    times = [b["time"] - a["time"] for a, b in itertools.pairwise(rows)][warmup - 1 :]
    phases = {}
    for k in sorted({k for r in rows for k in r if k.startswith("time/")}):
        phases[k[5:]] = statistics.median(r[k] for r in rows[warmup:] if r.get(k) is not None)
    return {
        "iteration_s": statistics.median(times),
        "iteration_s_all": times,
        "phases_s": phases,
        "staleness_max": max(r.get("staleness/max", 0.0) for r in rows),
        "planes": _planes(rows),
    }


def _planes(rows: list[dict]) -> dict:
    """What the sample channel moved per iteration, as process 0 counted it (its own sends and
    receipts), and the most keys the coordination service held at any iteration's end: the
    control plane must stay small and flat however many iterations run and whatever the batch,
    the data plane carries the batch."""
    counted = [r for r in rows if "samples/control_bytes" in r]
    if not counted:  # a layout whose groups share process 0's schedule without a channel
        return {}
    per = lambda k: [int(r[k]) for r in counted]  # noqa: E731
    control, data = per("samples/control_bytes"), per("samples/data_bytes")
    return {
        "iterations": len(counted),
        "control_bytes_per_iteration": {"min": min(control), "max": max(control)},
        "data_bytes_per_iteration": {"min": min(data), "max": max(data)},
        "stored_keys_max": max(per("samples/stored_keys")),
    }


def _estimate(bindings: list[str]) -> dict:
    """The estimator's phases for the plan of ``bindings`` on 8 devices, and its iteration
    times: synchronous (the sum) and asynchronous (the groups as separate hosts)."""
    from jrlhf.config import DEFAULT_CONFIG, ROLES, load_config
    from jrlhf.pipeline.task_data import task_model_overrides
    from jrlhf.placement import effective_plan
    from jrlhf.placement import estimator as est
    from jrlhf.placement.profile import DeviceProfile
    from jrlhf.placement.workload import Workload
    from jrlhf.runtime.model_source import resolve_model

    cfg = load_config([str(DEFAULT_CONFIG)], bindings)
    overrides = task_model_overrides(cfg)
    models = {role: resolve_model(cfg, role, overrides, init="tiny").model.config for role in ROLES}
    w = Workload.from_config(cfg, models)
    plan = effective_plan(cfg, 8, None)
    e = est.estimate(plan, w, DeviceProfile.load("cpu"))
    phases = dict(e.phase_seconds)
    return {
        "profile": "cpu",
        "phases_s": phases,
        "sync_iteration_s": est.iteration_seconds(phases, 0),
        # two processes: generation and the rest run at the same time on their own cores
        "async_iteration_s": est.iteration_seconds(phases, 1, separated=True),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jrlhf.bench async", description=__doc__)
    p.add_argument("--iterations", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2, help="first iterations not timed (>= 1)")
    p.add_argument("--repeats", type=int, default=1, help="runs of each variant, alternating")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--minibatches", type=int, default=1)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--mlp", type=int, default=352)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--timeout", type=int, default=1200, help="seconds per run")
    p.add_argument(
        "--processes",
        type=int,
        choices=sorted(LAYOUTS_OF),
        default=2,
        help="2: the 1+1 layout; 4: the 2+2 and 1+1+2 layouts (see above)",
    )
    p.add_argument(
        "--pin",
        type=int,
        choices=(0, 1),
        default=1 if (os.cpu_count() or 1) >= 2 else 0,
        help="1: the generating group on core 0, the others on core 1 (default where there are "
        "2 cores or more); 0: unpinned, every process shares every core",
    )
    add_out_argument(p)
    args = p.parse_args(argv)
    check_out(p, args.out)
    if args.warmup < 1 or args.iterations < args.warmup + 2:
        p.error("need --warmup >= 1 and --iterations >= warmup + 2")
    bindings = _bindings(args)
    layouts = {}
    with tempfile.TemporaryDirectory(prefix="jrlhf-bench-async-") as tmp:
        for layout in LAYOUTS_OF[args.processes]:
            results: dict[str, list[dict]] = {"sync": [], "async": []}
            for r in range(args.repeats):
                order = [("sync", 0), ("async", 1)] if r % 2 == 0 else [("async", 1), ("sync", 0)]
                for name, k in order:
                    run_dir = Path(tmp) / f"{layout}-{name}{r}"
                    rows = _run(layout, bindings, k, run_dir, args.timeout, bool(args.pin))
                    results[name].append(_summary(rows, args.warmup))
            layouts[layout] = _layout_report(results, [*bindings, *LAYOUTS[layout][2]])
    report = {
        "benchmark": "async",
        "setting": {k: v for k, v in vars(args).items() if k != "out"},
        "layouts": layouts,
        "cpu_count": os.cpu_count(),
    }
    emit(report, args.out)
    return 0


def _layout_report(results: dict[str, list[dict]], bindings: list[str]) -> dict:
    """One layout's runs, their median iteration times and speedup, beside the same formulas
    applied to the synchronous run's measured phases and the estimator's."""
    sync_s = statistics.median(x["iteration_s"] for x in results["sync"])
    async_s = statistics.median(x["iteration_s"] for x in results["async"])
    measured = results["sync"][0]["phases_s"]
    phases = {k: measured.get(k, 0.0) for k in PHASES}
    rest = sum(v for k, v in phases.items() if k != "generate")
    estimate = _estimate(bindings)
    return {
        "sync": results["sync"],
        "async": results["async"],
        "sync_iteration_s": sync_s,
        "async_iteration_s": async_s,
        "speedup": sync_s / async_s,
        "from_measured_phases": {
            "phases_s": phases,
            "sync_iteration_s": sum(phases.values()),
            "async_iteration_s": max(phases["generate"], rest),
            "speedup": sum(phases.values()) / max(phases["generate"], rest),
        },
        "estimator": {
            **estimate,
            "speedup": estimate["sync_iteration_s"] / estimate["async_iteration_s"],
        },
    }


if __name__ == "__main__":
    sys.exit(main())
