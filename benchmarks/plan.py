"""``python -m jrlhf.bench plan``: the cost estimator's error against measured trainer phase times.

For each strategy (flatten, interleave, separate) this runs the real PPO trainer for a few
iterations on the available devices (8 fake CPU devices without an accelerator), reads the phase
times the trainer logs (``time/generate|score|train|reshard`` in logs/ppo/metrics.jsonl; the first
iteration is dropped, it compiles), and compares their median with ``estimate()`` of the same plan
under a calibrated device profile. Prints one JSON object: per plan and phase the measured and
estimated seconds and the relative error, and the median / max absolute relative error.

Held-out check: by default the profile is calibrated first in this process (microbenchmarks plus
two small models, ``jrlhf.pipeline.calibrate.CALIBRATION_MODELS``); the model evaluated here has a
different size (``--hidden``/``--layers``), so the error is not fitted to the test.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from jrlhf.config import DEFAULT_CONFIG, ROLES, load_config
from jrlhf.pipeline.task_data import task_model_overrides
from jrlhf.placement.workload import Workload
from jrlhf.runtime.model_source import resolve_model

PHASE_KEYS = ("generate", "score", "train", "reshard")


def _bindings(args, plan) -> list[str]:
    overrides = (
        f"(('hidden_size', {args.hidden}), ('intermediate_size', {args.intermediate}), "
        f"('num_layers', {args.layers}), ('num_heads', {args.heads}), ('num_kv_heads', 2))"
    )
    out = [
        "RunConfig.stages=('ppo',)",
        "RunConfig.tensorboard=False",
        "RunConfig.progress_bar=False",
        f"RunConfig.host_devices={args.devices}",
        f"RoleConfig.model_overrides={overrides}",
        f"RLConfig.iterations={args.iterations}",
        "RLConfig.checkpoint_every=0",
        "RLConfig.async_checkpoint=False",
        f"RLConfig.prompts_per_iteration={args.prompts}",
        f"RLConfig.minibatch_size={args.minibatch}",
        "RLConfig.epochs=2",
        "TaskConfig.num_heldout=8",
        f"TaskConfig.max_response_len={args.gen_len}",
    ]
    for role in ("actor", "critic", "reference", "reward"):
        out.append(f"{role}/RoleConfig.init='tiny'")
    # the plan as RoleConfig meshes ('custom' placement), the form every trainer version accepts
    for line in plan.to_gin().splitlines():
        if line and not line.startswith("#"):
            out.append(line.replace(" = ", "="))
    return out


def _workload(bindings: list[str]):
    cfg = load_config([str(DEFAULT_CONFIG)], bindings)
    overrides = task_model_overrides(cfg)
    models = {role: resolve_model(cfg, role, overrides, init="tiny").model.config for role in ROLES}
    return Workload.from_config(cfg, models)


def _measure(bindings: list[str], run_dir: Path) -> dict[str, list[float]]:
    from jrlhf.cli import train

    # The trainer prints its result line on stdout; keep stdout for this benchmark's JSON.
    with contextlib.redirect_stdout(sys.stderr):
        rc = train.main(["--run-dir", str(run_dir), "--quiet", *bindings])
    if rc != 0:
        raise RuntimeError(f"trainer exited with {rc}")
    rows = [
        json.loads(line) for line in (run_dir / "logs/ppo/metrics.jsonl").read_text().splitlines()
    ]
    rows = [r for r in rows if "time/train" in r]
    out = {k: [r[f"time/{k}"] for r in rows[1:]] for k in PHASE_KEYS}  # drop the compile iteration
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m jrlhf.bench plan", description=__doc__.split("\n")[0]
    )
    p.add_argument("--profile", help="device profile name or JSON (default: calibrate now)")
    p.add_argument("--plans", default="flatten,interleave,separate")
    p.add_argument("--devices", type=int, default=8, help="fake CPU devices (no accelerator)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=704)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--minibatch", type=int, default=16)
    p.add_argument("--gen-len", type=int, default=12)
    p.add_argument("--iterations", type=int, default=4)
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args(argv)

    from jrlhf.runtime.devices import ensure_host_devices

    ensure_host_devices(args.devices)
    import jax

    from jrlhf.placement.estimator import estimate
    from jrlhf.placement.plan import strategy
    from jrlhf.placement.profile import DeviceProfile

    t_start = time.perf_counter()
    if args.profile:
        profile = DeviceProfile.load(args.profile)
        calibrated_here = False
    else:
        from jrlhf.pipeline.calibrate import calibrate

        profile = calibrate("cpu" if jax.devices()[0].platform == "cpu" else None, quick=True)
        calibrated_here = True
    n = jax.device_count()
    results, errors = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.plans.split(","):
            plan = strategy(name, n)
            bindings = _bindings(args, plan)
            workload = _workload(bindings)
            measured = _measure(bindings, Path(tmp) / name)
            est = estimate(plan, workload, profile)
            phases = {}
            for k in PHASE_KEYS:
                m = statistics.median(measured[k])
                e = est.phase_seconds[k]
                rel = (e - m) / m if m > 0 else float("nan")
                phases[k] = {
                    "measured_s": m,
                    "estimated_s": e,
                    "rel_error": rel,
                    "runs": measured[k],
                }
                errors.append(abs(rel))
            m_iter = sum(statistics.median(measured[k]) for k in PHASE_KEYS)
            results.append(
                {
                    "plan": name,
                    "placements": {c: str(pl) for c, pl in plan.placements},
                    "phases": phases,
                    "iteration": {
                        "measured_s": m_iter,
                        "estimated_s": est.iteration_seconds,
                        "rel_error": (est.iteration_seconds - m_iter) / m_iter,
                    },
                    "estimated_call_seconds": est.call_seconds,
                    "estimated_memory_bytes": est.memory_bytes,
                    "fits": est.fits,
                }
            )
    iteration_errors = [abs(r["iteration"]["rel_error"]) for r in results]
    out = {
        "benchmark": "plan_estimator",
        "device": f"{n} x {jax.devices()[0].platform}",
        "profile": profile.name,
        "calibrated_in_this_run": calibrated_here,
        "profile_fits": profile.measured.get("fits"),
        "model": {
            "hidden": args.hidden,
            "intermediate": args.intermediate,
            "layers": args.layers,
            "heads": args.heads,
        },
        "workload": {
            "prompts": args.prompts,
            "minibatch": args.minibatch,
            "gen_len": args.gen_len,
            "iterations": args.iterations,
        },
        "results": results,
        "phase_error": {
            "median_abs_rel": statistics.median(errors),
            "max_abs_rel": max(errors),
            "count": len(errors),
        },
        "iteration_error": {
            "median_abs_rel": statistics.median(iteration_errors),
            "max_abs_rel": max(iteration_errors),
        },
        "seconds": time.perf_counter() - t_start,
    }
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
