"""``python -m jrlhf.bench plan``: the cost estimator's error against measured trainer phase times.

For each plan (``--plans``, default all of ``PLANS``: the named strategies, variants with other
mesh shapes and batch knobs, and ``searched``, the planner's best plan for the profile) this runs
the real PPO trainer (built as ``python -m jrlhf.train`` builds it) on the available devices (8
fake CPU devices without an accelerator), all plans' trainers in this process taking turns one
iteration at a time (so a change of the machine's load between rounds reaches every plan alike),
reads the phase times the trainer reports (``time/generate|score|train|reshard``; each plan's
first iteration is dropped, it compiles), and compares their robust median (high outliers
dropped first, as the calibration treats its own samples: ``calibrate.robust_seconds``) with
``estimate()`` of the same plan and batch knobs under a calibrated device profile.

Prints one JSON object. ``summary`` comes first and says it all: the median and max absolute
relative error over every (plan, phase) pair and over the plans' iteration times, and the
searched plan's measured and estimated speed-up over flatten (flatten's iteration time over the
searched plan's, both measured in this run). ``table`` gives one row per plan: measured and
estimated seconds and the relative error per phase and for the iteration. ``results`` has the
details (each iteration's phase times, the placements, the estimate's per-call seconds).

Held-out check: by default the profile is calibrated in this process (microbenchmarks plus two
small models, ``jrlhf.calibration.measure.CALIBRATION_MODELS``); the model evaluated here has a
different size (``--hidden``/``--layers``), so the error is not fitted to the test. The
calibration models are timed first (the search uses that profile), then once more before each
round of trainer iterations; the errors come from the profile fitted to those later rounds, which
saw the machine as the trainers did (``summary.calibrated_before_measuring`` scores the first).
``summary.builtin_profile`` scores the device kind's built-in profile (the one
``placement='search'`` and ``python -m jrlhf.plan`` use), calibrated apart from the run: a check
held out from the run's own calibration.

The report keeps its profiles with their inputs (``profiles``: the fitted one and the one
calibrated before measuring, each with the microbenchmarks and every calibration round, or the
``--profile`` given), so ``--rescore REPORT`` can price an earlier run's measurements again after
the estimator or its fit changes, in seconds and without measuring: a calibrated profile is
refitted by this code from the report's rounds (a given one is used as stored), and the plans
and workloads are rebuilt from the recorded placements, knobs, model and workload.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.report import add_out_argument, check_out, emit
from jrlhf.config import DEFAULT_CONFIG, load_config
from jrlhf.meshes.mesh import MeshSpec
from jrlhf.pipeline.plan_bench import trainer_bindings, trainer_workload
from jrlhf.pipeline.task_data import task_model_overrides
from jrlhf.placement.plan import CALLS, CallPlacement, ExecutionPlan, flatten, strategy
from jrlhf.placement.workload import Workload
from jrlhf.runtime.model_source import resolve_model

PHASE_KEYS = ("generate", "score", "train", "reshard")


def _everywhere(name: str, mesh: MeshSpec, rules: str) -> ExecutionPlan:
    return ExecutionPlan.of(name, **{call: CallPlacement(mesh, rules) for call in CALLS})


def _data_parallel(n: int) -> ExecutionPlan:
    """Every call on all devices with replicated weights (``dp_tp``, data x tensor 2): no FSDP
    gathers, and the generation layout is the training layout (the resharder aliases it)."""
    tensor = 2 if n % 2 == 0 else 1
    mesh = MeshSpec((("data", n // tensor), ("tensor", tensor)), tuple(range(n)))
    return _everywhere("flatten-dp", mesh, "dp_tp")


# plan name -> (plan builder over n devices, workload knobs: Memory.infer_batch_size and the
# actor's and critic's micro-batches). ``searched`` is added at run time.
PLANS: dict[str, tuple[Callable[[int], ExecutionPlan], dict[str, int]]] = {
    "flatten": (lambda n: strategy("flatten", n), {}),
    "flatten-fsdp8": (
        lambda n: dataclasses.replace(flatten(n, tensor=1), name="flatten-fsdp8"),
        {},
    ),
    "flatten-dp": (_data_parallel, {}),
    "flatten-mb2": (
        lambda n: dataclasses.replace(strategy("flatten", n), name="flatten-mb2"),
        {"infer_batch_size": 16, "actor_microbatches": 2, "critic_microbatches": 2},
    ),
    "interleave": (lambda n: strategy("interleave", n), {}),
    "separate": (lambda n: strategy("separate", n), {}),
    "separate-t1": (
        lambda n: dataclasses.replace(
            strategy("separate", n, tensor=1, gen_tensor=1), name="separate-t1"
        ),
        {},
    ),
}
DEFAULT_PLANS = (*PLANS, "searched")


def _model(args) -> dict:
    """The bench model's shape and dtypes, as its report records them."""
    return {
        "hidden": args.hidden,
        "intermediate": args.intermediate,
        "layers": args.layers,
        "heads": args.heads,
        "dtype": args.dtype or "float32",
        "param_dtype": args.param_dtype or "float32",
    }


def _workload_fields(args) -> dict:
    return {
        "prompts": args.prompts,
        "minibatch": args.minibatch,
        "gen_len": args.gen_len,
        "iterations": args.iterations,
        "bindings": list(args.bind),
    }


def _bindings(args, plan: ExecutionPlan, knobs: dict[str, int]) -> list[str]:
    """The trainer's bindings (``jrlhf.pipeline.plan_bench``, which the GPU fit shares)."""
    return trainer_bindings(_model(args), _workload_fields(args), args.devices, plan, knobs)


def _workload(bindings: list[str]) -> Workload:
    return trainer_workload(bindings)


def _knobs(w: Workload) -> dict[str, int]:
    return {
        "infer_batch_size": w.infer_batch_size,
        "actor_microbatches": w.actor_microbatches,
        "critic_microbatches": w.critic_microbatches,
    }


class _PlanRun:
    """One plan's PPO trainer, built as ``python -m jrlhf.train`` builds it (the task data, the
    effective plan, the roles the loss needs, ``RLTrainer``, the prompt loader) and stepped one
    iteration at a time, so the plans' iterations can take turns (``_measure_interleaved``)."""

    def __init__(self, bindings: list[str], run_dir: Path):
        import jax

        from jrlhf.data.loader import PromptLoader
        from jrlhf.pipeline.task_data import build_task_data
        from jrlhf.placement import effective_plan
        from jrlhf.ppo.trainer import RLTrainer
        from jrlhf.runtime.roles import setup_role

        cfg = load_config([str(DEFAULT_CONFIG)], bindings)
        data = build_task_data(cfg)
        plan = effective_plan(cfg, jax.device_count(), None)
        overrides = task_model_overrides(cfg)
        roles = {
            role: setup_role(cfg, role, plan, resolve_model(cfg, role, overrides, run_dir))
            for role in ("actor", "reference", "critic", "reward")
        }
        self.trainer = RLTrainer(cfg, "ppo", roles, plan, data, run_dir / "ppo")
        self.response_lens: list[float] = []
        self.loader = PromptLoader(
            data.train_records(), cfg.rl.prompts_per_iteration, seed=cfg.run.seed
        )

    def step(self) -> dict[str, float]:
        """One iteration; its phase times (the trainer's ``time/*`` metrics)."""
        batch = self.loader.next_batch()
        metrics = self.trainer.run_iteration([r.prompt_ids for r in batch], [r.meta for r in batch])
        # the estimate prices every response at the full length: shorter responses (the
        # longest decides a synchronous rollout's steps) explain a faster generate
        self.response_lens.append(
            (round(float(metrics["response_len"]), 2), float(metrics["response_len_max"]))
        )
        return {k: metrics[f"time/{k}"] for k in PHASE_KEYS}


def _measure_interleaved(
    runs: dict[str, _PlanRun],
    rounds: int,
    probe: Callable[[], float] | None = None,
    between: Callable[[], None] | None = None,
) -> tuple[dict[str, dict[str, list[float]]], list[float]]:
    """Every plan's phase times over ``rounds`` iterations, the plans taking turns (one
    iteration each per round, the order rotating), so a change of the machine's load between
    rounds reaches every plan alike instead of whichever ran then. Each plan's first iteration
    (it compiles) is run first and dropped. ``between`` (the calibration's next round) runs at
    each round's start, so the profile fitted from its rounds saw the machine as the trainers'
    iterations did. Returns plan -> phase -> seconds per round, and the probe's time at each
    round's start."""
    from jrlhf.runtime.gc_freeze import warm_freeze

    for run in runs.values():
        run.step()
    names = list(runs)
    out = {n: {k: [] for k in PHASE_KEYS} for n in names}
    probes = []
    # as a trainer does after its first iteration (RunConfig.gc_freeze): the collector stops
    # re-scanning the compiled trainers, whose full collections took up to 0.67 s here
    with warm_freeze(True, "bench plan") as freezer:
        freezer.step_done()
        for r in range(rounds):
            if probe is not None:
                probes.append(probe())
            if between is not None:
                between()
            for name in names[r % len(names) :] + names[: r % len(names)]:
                for k, v in runs[name].step().items():
                    out[name][k].append(v)
    return out, probes


def _device_peak_bytes() -> int | None:
    """The allocator's peak bytes in use over this process's devices, or None where the
    backend reports no memory statistics (CPU)."""
    import jax

    peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in jax.local_devices()]
    return max(peaks) if peaks and None not in peaks else None


def _searched(args, n: int, profile) -> tuple[ExecutionPlan, dict[str, int], dict]:
    """The planner's best plan (and its batch knobs) for the bench's workload under
    ``profile``, searched as ``python -m jrlhf.plan`` does but with shorter annealing chains
    (``--search-steps``, ``--search-restarts``) to keep the bench short."""
    from jrlhf.placement.search import search

    base = _workload(_bindings(args, strategy("flatten", n), {}))
    result = search(
        base,
        n,
        profile,
        tune_batches=True,
        devices_per_node=n,
        steps=args.search_steps,
        restarts=args.search_restarts,
    )
    best = result.best
    plan = dataclasses.replace(best.plan, name="searched")
    info = {
        "method": result.method,
        "evaluated": result.evaluated,
        "estimated_speedup_over_flatten": result.speedup("flatten"),
        "found_as": best.plan.name,
    }
    return plan, _knobs(best.estimate.workload or base), info


def _speed_probe() -> Callable[[], float]:
    """A fixed piece of work (matmuls on all devices) whose robust time, taken before each plan
    and after the calibration, shows whether the machine's speed changed in between (load from
    other processes): it is reported, not used to adjust anything."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from jrlhf.calibration.measure import measure_interleaved

    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("d",))
    x = jax.device_put(jnp.ones((n, 256, 256)), NamedSharding(mesh, PartitionSpec("d")))
    f = jax.jit(lambda v: jnp.einsum("nij,njk->nik", v, v))

    def work():
        for _ in range(8):
            r = f(x)
        r.block_until_ready()

    return lambda: measure_interleaved({"probe": work}, rounds=3, repeat=3)["probe"]["seconds"]


def _rel(e: float, m: float) -> float:
    return (e - m) / m if m > 0 else float("nan")


def _row(phases: dict, iteration: dict) -> dict:
    def cell(d):
        err = d["rel_error"]
        return [round(d["measured_s"], 4), round(d["estimated_s"], 4), err and round(err, 3)]

    return {**{k: cell(v) for k, v in phases.items()}, "iteration": cell(iteration)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m jrlhf.bench plan", description=__doc__.split("\n")[0]
    )
    p.add_argument("--profile", help="device profile name or JSON (default: calibrate now)")
    p.add_argument(
        "--plans",
        default=",".join(DEFAULT_PLANS),
        help=f"comma-separated, from {', '.join(DEFAULT_PLANS)}",
    )
    p.add_argument("--devices", type=int, default=8, help="fake CPU devices (no accelerator)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=704)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default=None,
        help="compute dtype of every role (RoleConfig.dtype; default: the config's, float32)",
    )
    p.add_argument(
        "--bind",
        action="append",
        default=[],
        help="an extra gin binding for every plan's trainer, e.g. DecodeConfig.page_size=16",
    )
    p.add_argument(
        "--param-dtype",
        choices=("float32", "bfloat16"),
        default=None,
        help="parameter dtype of every role (RoleConfig.param_dtype; default: float32)",
    )
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--minibatch", type=int, default=16)
    p.add_argument("--gen-len", type=int, default=12)
    p.add_argument(
        "--iterations",
        type=int,
        default=6,
        help="trainer iterations per plan, taken in turns (first dropped)",
    )
    p.add_argument("--search-steps", type=int, default=300, help="MCMC steps per chain")
    p.add_argument("--search-restarts", type=int, default=2, help="MCMC chains")
    p.add_argument("--save-profile", help="also write the calibrated profile JSON here")
    p.add_argument(
        "--rescore",
        type=Path,
        metavar="REPORT",
        help="measure nothing: score an earlier report's measurements again with this code's "
        "estimator, under --profile or else the report's profile (refitted from its "
        "calibration rounds)",
    )
    add_out_argument(p)
    args = p.parse_args(argv)
    check_out(p, args.out)
    if args.rescore is not None:
        if args.out is not None and args.out.resolve() == args.rescore.resolve():
            p.error(f"--out {args.out} is the report being rescored; write the rescore elsewhere")
        emit(rescore(args.rescore, args.profile), args.out)
        return 0
    names = [x for x in args.plans.split(",") if x]
    unknown = [x for x in names if x not in DEFAULT_PLANS]
    if unknown:
        p.error(f"unknown plan(s) {unknown} (known: {', '.join(DEFAULT_PLANS)})")
    if args.iterations < 2:
        p.error("--iterations must be >= 2 (the first iteration compiles and is dropped)")

    from jrlhf.devices import ensure_host_devices

    ensure_host_devices(args.devices)
    import jax

    from jrlhf.placement.profile import DeviceProfile

    t_start = time.perf_counter()
    timings = None
    if args.profile:
        profile = DeviceProfile.load(args.profile)
    else:
        from jrlhf.calibration import measure as cal

        base = cal.measure_base("cpu" if jax.devices()[0].platform == "cpu" else None, quick=True)
        timings = cal.ModelTimings(cal.model_runs(), cal.compute_dtype())
        for _ in range(3):
            timings.round()
        profile = cal.fit_measured(base, timings.results())
    t_calibrated = time.perf_counter()
    probe = _speed_probe()
    probe_calibrated = probe()
    n = jax.device_count()
    search_info, search_s = None, 0.0
    with tempfile.TemporaryDirectory() as tmp:
        setups = {}
        for name in names:
            if name == "searched":
                t0 = time.perf_counter()
                plan, knobs, search_info = _searched(args, n, profile)
                search_s = time.perf_counter() - t0
            else:
                build, knobs = PLANS[name]
                plan = build(n)
            bindings = _bindings(args, plan, knobs)
            setups[name] = (plan, _workload(bindings), bindings)
        t0 = time.perf_counter()
        runs = {name: _PlanRun(b, Path(tmp) / name) for name, (_, _, b) in setups.items()}
        if timings is not None:
            timings.reset()  # the calibration's rounds from now on share the plans' rounds
        measured_all, probes = _measure_interleaved(
            runs, args.iterations - 1, probe, between=timings.round if timings else None
        )
        run_s = time.perf_counter() - t0
        # (mean, longest) generated length per timed iteration (the compiling one dropped)
        response_lens = {name: run.response_lens[1:] for name, run in runs.items()}
        peak = _device_peak_bytes()
        del runs
    first_profile = profile
    if timings is not None:
        profile = cal.fit_measured(base, timings.results())
        if args.save_profile:
            profile.save(args.save_profile)
    results, summary = _summarize(
        setups,
        measured_all,
        profile,
        first_profile if timings is not None else None,
        search_info,
        _builtin_profile(jax.devices()[0].platform),
    )
    for r in results:
        r["response_len_mean_max"] = response_lens[r["plan"]]
    summary["device_peak_bytes"] = {
        "what": "the allocator's peak bytes in use on the busiest device since the process "
        "started (every plan's trainer, the calibration's too; null where the backend keeps no "
        "statistics, as on CPU), against the largest per-device call memory the estimate gives "
        "any plan",
        "measured": peak,
        "estimated_max": max(max(r["estimated_memory_bytes"].values(), default=0) for r in results),
    }
    summary["probe_slowdown"] = {
        "what": "time of a fixed matmul probe at the start of each measuring round over its "
        "time right after calibration: far from 1 means the machine's load changed between them",
        "rounds": [round(t / probe_calibrated, 2) for t in probes],
    }
    out = {
        "benchmark": "plan_estimator",
        "device": f"{n} x {jax.devices()[0].platform}",
        **_scored(results, summary, profile),
        "calibrated_in_this_run": timings is not None,
        # every input of the fit (microbenchmarks, the calibration models' timings), so that
        # ``--rescore`` can price these measurements again after the estimator changes
        "profiles": (
            {"fitted": profile.to_dict(), "calibrated_before_measuring": first_profile.to_dict()}
            if timings is not None
            else {"given": profile.to_dict()}
        ),
        "model": _model(args),
        "workload": _workload_fields(args),
        "results": results,
        "seconds": {
            "calibration": t_calibrated - t_start,
            "search": search_s,
            "trainers_and_measuring": run_s,
            "total": time.perf_counter() - t_start,
        },
    }
    emit(out, args.out)
    return 0


def _builtin_profile(platform: str):
    """The built-in profile of ``platform``'s devices (what ``placement='search'`` and
    ``python -m jrlhf.plan`` price plans with), or None where there is none."""
    from jrlhf.placement.profile import DeviceProfile

    if platform == "cpu":
        return DeviceProfile.load("cpu")
    from jrlhf.placement.search import local_device_kind

    try:
        return DeviceProfile.load(local_device_kind())
    except ValueError:  # a device kind without a built-in profile
        return None


def _summarize(
    setups: dict,
    measured_all: dict,
    profile,
    first_profile,
    search_info: dict | None,
    builtin=None,
) -> tuple[list[dict], dict]:
    """``_compare`` under ``profile``, plus the summary's score under ``first_profile`` (the
    profile calibrated before the trainers ran; None: there was none) and under ``builtin``
    (the device kind's built-in profile, fitted to none of this run; None: not scored), and the
    searched plan's measured and estimated speed-up over flatten."""
    results, summary = _compare(setups, measured_all, profile)
    if first_profile is not None:
        _, first = _compare(setups, measured_all, first_profile)
        summary["calibrated_before_measuring"] = {
            "what": "the same errors under the profile calibrated before the trainers ran (the "
            "one the search used), whose rounds did not share the machine's state with theirs",
            "phase_error": first["phase_error"],
            "iteration_error": first["iteration_error"],
        }
    if builtin is not None:
        _, held_out = _compare(setups, measured_all, builtin)
        summary["builtin_profile"] = {
            "what": "the same errors under the device kind's built-in profile (what "
            "placement='search' and python -m jrlhf.plan use), calibrated apart from this run",
            "profile": builtin.name,
            "phase_error": held_out["phase_error"],
            "iteration_error": held_out["iteration_error"],
        }
    by_name = {r["plan"]: r for r in results}
    if "searched" in by_name and "flatten" in by_name:
        s, f = by_name["searched"]["iteration"], by_name["flatten"]["iteration"]
        summary["searched_vs_flatten"] = {
            "measured_speedup": f["measured_s"] / s["measured_s"],
            "estimated_speedup": f["estimated_s"] / s["estimated_s"],
            "searched_placements": by_name["searched"]["placements"],
            "searched_knobs": by_name["searched"]["knobs"],
            **(search_info or {}),
        }
    return results, summary


def _refused(msg: str) -> SystemExit:
    return SystemExit(f"python -m jrlhf.bench plan: error: {msg}")


def _scored(results: list[dict], summary: dict, profile) -> dict:
    """The part of a report that says how ``profile`` priced the measurements (a run's and a
    rescore's alike)."""
    return {
        "summary": summary,
        "table_columns": "per phase and iteration: [measured_s, estimated_s, rel_error]; "
        "measured = robust median (high outliers dropped, calibrate.robust_seconds) over "
        "iterations 2..N of the trainer's logged phase time; "
        "rel_error = (estimated - measured) / measured",
        "table": {r["plan"]: _row(r["phases"], r["iteration"]) for r in results},
        "profile": profile.name,
        "profile_rates": {
            k: v for k, v in profile.to_dict().items() if k not in ("measured", "notes")
        },
        "profile_fits": profile.measured.get("fits"),
    }


def _report_profile(profiles: dict, key: str, where: str):
    """The profile a report stored under ``profiles[key]``: refitted with this code's fit from
    its calibration rounds (in the dtype they computed in) where the run calibrated it, as
    stored where it was given. A malformed one is refused in one line."""
    from jrlhf.calibration import measure as cal
    from jrlhf.placement.profile import DeviceProfile

    at = f"{where}: profiles.{key}"
    try:
        stored = DeviceProfile.from_dict(profiles[key], where=at)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise _refused(f"{at} is not a device profile ({e})") from None
    if key == "given":
        return stored
    models = stored.measured.get("models") if isinstance(stored.measured, dict) else None
    if not models:
        raise _refused(f"{at} has no calibration rounds (measured.models) to fit")
    try:
        rounds = [(m["overrides"], m["devices"], m["seconds"], m["spread"]) for m in models]
        dtypes = {m["dtype"] for m in models}
    except (KeyError, TypeError) as e:
        raise _refused(f"{at}.measured.models is malformed ({e!r})") from None
    if len(dtypes) != 1:
        raise _refused(f"{at}: calibration rounds in several dtypes {sorted(dtypes)}")
    try:
        return cal.fit_measured(stored, rounds, dtype=dtypes.pop())
    except (KeyError, TypeError, ValueError) as e:
        raise _refused(f"{at}: its calibration rounds cannot be fitted ({e!r})") from None


def _rescore_profiles(report: dict, profile_name: str | None, where: str):
    """(profile, the profile calibrated before measuring or None, where the profile is from)
    for a rescore: ``profile_name`` if given, else what the report stores."""
    from jrlhf.placement.profile import DeviceProfile

    if profile_name:
        try:
            return DeviceProfile.load(profile_name), None, profile_name
        except (OSError, ValueError) as e:
            raise _refused(f"--profile {profile_name}: {e}") from None
    profiles = report.get("profiles")
    if not isinstance(profiles, dict) or not ({"fitted", "given"} & profiles.keys()):
        raise _refused(
            f"{where}: the report stores no profile (written before reports kept it): "
            "pass --profile"
        )
    if "given" in profiles:
        return _report_profile(profiles, "given", where), None, "the report's given profile"
    first = None
    if "calibrated_before_measuring" in profiles:
        first = _report_profile(profiles, "calibrated_before_measuring", where)
    profile = _report_profile(profiles, "fitted", where)
    return profile, first, "refitted from the report's calibration rounds"


def rescore(path: Path, profile_name: str | None = None) -> dict:
    """A report of ``bench plan`` scored again without measuring anything: every plan's
    workload rebuilt from the report's model, workload, device count and knobs, its plan from
    the recorded placements, and its measured phase times priced by this code's estimator under
    ``profile_name`` or else the report's own profile (refitted from the report's calibration
    rounds when the run calibrated). Bad reports are refused in one line naming the culprit,
    before any plan is priced. The result keeps the report's ``profiles``, so it can be
    rescored in turn."""
    import json

    from jrlhf.config import ConfigError
    from jrlhf.pipeline.plan_bench import plan_from_placements

    where = f"--rescore {path}"
    try:
        report = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise _refused(f"{where}: cannot read a JSON report ({e})") from None
    if not isinstance(report, dict) or report.get("benchmark") != "plan_estimator":
        raise _refused(f"{where}: not a bench plan report (no benchmark 'plan_estimator')")
    missing = [k for k in ("device", "model", "workload", "results") if k not in report]
    if missing:
        raise _refused(f"{where}: the report lacks {', '.join(missing)}")
    count, _, platform = str(report["device"]).partition(" x ")
    if not count.isdigit() or int(count) < 1 or not platform:
        raise _refused(f"{where}: device {report['device']!r} is not 'N x PLATFORM', N >= 1")
    n = int(count)
    if not isinstance(report["results"], list) or not report["results"]:
        raise _refused(f"{where}: results is not a non-empty list of plans")
    profile, first, source = _rescore_profiles(report, profile_name, where)
    setups, measured_all = {}, {}
    for i, r in enumerate(report["results"]):
        try:
            name = r["plan"]
            plan = plan_from_placements(name, r["placements"])
            bindings = trainer_bindings(report["model"], report["workload"], n, plan, r["knobs"])
            measured = {k: [float(x) for x in r["phases"][k]["runs"]] for k in PHASE_KEYS}
            workload = trainer_workload(bindings)
        except (KeyError, TypeError, ValueError, AttributeError, ConfigError) as e:
            raise _refused(f"{where}: results[{i}] is malformed ({e!r})") from None
        bad = [k for k, v in measured.items() if not v or not all(0 <= x < float("inf") for x in v)]
        if bad:
            raise _refused(
                f"{where}: results[{i}] ({name}) phase {bad[0]} has no finite, non-negative "
                "measurements"
            )
        setups[name] = (plan, workload, bindings)
        measured_all[name] = measured
    builtin = _builtin_profile("cpu") if platform == "cpu" else None
    search_info = (report.get("summary") or {}).get("searched_vs_flatten") or {}
    kept = ("method", "evaluated", "estimated_speedup_over_flatten", "found_as")
    results, summary = _summarize(
        setups,
        measured_all,
        profile,
        first,
        {k: search_info[k] for k in kept if k in search_info},
        builtin,
    )
    originals = {r["plan"]: r for r in report["results"]}
    for r in results:
        if "response_len_mean_max" in originals[r["plan"]]:
            r["response_len_mean_max"] = originals[r["plan"]]["response_len_mean_max"]
    return {
        "benchmark": "plan_estimator",
        "rescored": {"report": str(path), "profile": source},
        "device": report["device"],
        **_scored(results, summary, profile),
        "profiles": report.get("profiles") or {},
        "model": report["model"],
        "workload": report["workload"],
        "results": results,
    }


def _error_stats(errors: list[float]) -> dict:
    return {
        "median_abs_rel": statistics.median(errors),
        "max_abs_rel": max(errors),
        "count": len(errors),
    }


def _compare(setups: dict, measured_all: dict, profile) -> tuple[list[dict], dict]:
    """Per plan, the measured phase and iteration times against ``estimate()`` under
    ``profile``: the per-plan results and the summary's error statistics.

    A measured time is ``robust_seconds`` of the plan's iterations: the median after dropping
    samples far above the bulk. The calibration the estimate comes from reduces its own samples
    the same way, so both sides describe the machine without another process's bursts (a burst
    during one of five iterations of a 10 ms reshard can double it). The plain medians' errors
    are kept in the summary (``plain_median``)."""
    from jrlhf.calibration.measure import robust_seconds
    from jrlhf.placement.estimator import estimate

    results, errors, plain_errors, plain_iteration_errors = [], [], [], []
    without_work = []
    for name, (plan, workload, _) in setups.items():
        measured = measured_all[name]
        est = estimate(plan, workload, profile)
        phases = {}
        for k in PHASE_KEYS:
            m = robust_seconds(measured[k])
            e = est.phase_seconds[k]
            phases[k] = {"measured_s": m, "estimated_s": e, "rel_error": None, "runs": measured[k]}
            if e == 0.0:
                # a phase with nothing to run (a reshard between the same layouts aliases the
                # training copy): its measured time is the trainer's bookkeeping, no error
                without_work.append((name, k, round(m, 6)))
                continue
            phases[k]["rel_error"] = _rel(e, m)
            errors.append(abs(phases[k]["rel_error"]))
            plain_errors.append(abs(_rel(e, statistics.median(measured[k]))))
        sums = [sum(t) for t in zip(*measured.values())]
        m_iter = robust_seconds(sums)
        iteration = {
            "measured_s": m_iter,
            "estimated_s": est.iteration_seconds,
            "rel_error": _rel(est.iteration_seconds, m_iter),
        }
        plain_iteration_errors.append(abs(_rel(est.iteration_seconds, statistics.median(sums))))
        results.append(
            {
                "plan": name,
                "placements": {c: str(pl) for c, pl in plan.placements},
                "knobs": _knobs(workload),
                "phases": phases,
                "iteration": iteration,
                "estimated_call_seconds": est.call_seconds,
                "estimated_memory_bytes": est.memory_bytes,
                "fits": est.fits,
            }
        )
    iteration_errors = [abs(r["iteration"]["rel_error"]) for r in results]
    summary = {
        "phase_error": {
            **_error_stats(errors),
            "worst": max(
                (
                    (r["plan"], k, v["rel_error"])
                    for r in results
                    for k, v in r["phases"].items()
                    if v["rel_error"] is not None
                ),
                key=lambda x: abs(x[2]),
            ),
            "phases_without_work": {
                "what": "(plan, phase, measured s) of phases the estimate says run nothing, "
                "left out of the errors",
                "phases": without_work,
            },
        },
        "iteration_error": _error_stats(iteration_errors),
        "plain_median": {
            "what": "the same errors against the plain median of the iterations (no outliers "
            "dropped)",
            "phase_error": _error_stats(plain_errors),
            "iteration_error": _error_stats(plain_iteration_errors),
        },
    }
    return results, summary


if __name__ == "__main__":
    sys.exit(main())
