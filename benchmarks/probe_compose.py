"""Do the RL loop's mechanisms compose? ``python -m benchmarks.probe_compose --out FILE``.

Runs every combination of bounded staleness ({0, 1, 2}), fusion, partial rollouts, dynamic
sampling, migration of the tail and a memory knob (none, optimizer offload, a dropped generation
copy) as a real ``python -m jrlhf.train`` job (``--layout 1x8``), or the same through ``python
-m jrlhf.launch`` on several processes with generation on a group of its own (``2x4``: 1 + 1
processes; ``4x2``: 2 + 2; ``4x2-3``: generation, scoring and training on 1 + 1 + 2 processes),
for a few iterations of PPO from tiny random roles with a verifiable reward (the synthetic
task's ground truth: many groups without signal, so dynamic sampling takes more rounds). Each
combination gets one verdict:

``ran``       exit 0, the iterations' metrics written;
``refused``   exit not 0 with one line of error naming a setting, before any iteration;
``failed``    anything else (a traceback, a timeout, a refusal in many lines).

Combinations that name a knob without its prerequisite (partial rollouts at staleness 0,
migration without fusion) are left out: their refusals are tested with the config. It is a
probe, not a test: the JSON report lists every combination with its verdict and last error line.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.report import add_out_argument, check_out, emit

ROOT = Path(__file__).resolve().parent.parent
RESPONSE = 12
BASE = [
    "RunConfig.stages=('ppo',)",
    "RunConfig.tensorboard=False",
    "RunConfig.progress_bar=False",
    *[f"{r}/RoleConfig.init='tiny'" for r in ("actor", "critic", "reference", "reward")],
    "TaskConfig.reward_fn='synthetic_ground_truth'",
    f"TaskConfig.max_response_len={RESPONSE}",
    "TaskConfig.num_heldout=8",
    "RLConfig.prompts_per_iteration=8",
    "RLConfig.samples_per_prompt=4",
    "RLConfig.minibatch_size=16",
    "RLConfig.epochs=1",
    "RLConfig.iterations=3",
    "RLConfig.checkpoint_every=0",
    "OffPolicy.correction='tis'",
]
# layout -> (processes, devices per process, placement bindings)
LAYOUTS = {
    "1x8": (1, 8, []),
    "2x4": (2, 4, ["RunConfig.placement='separate'"]),
    "4x2": (4, 2, ["RunConfig.placement='separate'"]),
    "4x2-3": (
        4,
        2,
        [
            "RunConfig.placement='custom'",
            "actor/RoleConfig.generate_mesh='data=2@0:2'",
            *[f"{r}/RoleConfig.infer_mesh='fsdp=2@2:4'" for r in ("reference", "reward", "critic")],
            "reward/RoleConfig.train_mesh='fsdp=2@2:4'",
            *[f"{r}/RoleConfig.train_mesh='fsdp=2,tensor=2@4:8'" for r in ("actor", "critic")],
        ],
    ),
}
MEMORY = {
    "none": [],
    "offload": ["Memory.offload=('actor_optimizer', 'critic_optimizer')"],
    "dropped": ["Memory.generation_copy='dropped'"],
}


def combinations() -> list[dict]:
    """Every meaningful combination of the mechanisms, as a dict of their settings."""
    out = []
    for k, fusion, partial, dynamic, migrate, memory in itertools.product(
        (0, 1, 2), (False, True), (False, True), (False, True), (False, True), MEMORY
    ):
        if (partial and not k) or (migrate and not fusion):
            continue
        out.append(dict(k=k, fusion=fusion, partial=partial, dynamic=dynamic,
                        migrate=migrate, memory=memory))  # fmt: skip
    return out


def bindings(c: dict) -> list[str]:
    out = [f"Asynchrony.max_staleness={c['k']}", f"Fusion.enabled={c['fusion']}"]
    if c["partial"]:
        out.append(f"Asynchrony.partial_rollout_tokens={RESPONSE // c['k']}")
    if c["dynamic"]:
        out += ["SampleFilters.dynamic_sampling=True", "SampleFilters.max_sampling_rounds=2"]
    if c["migrate"]:
        out += ["Fusion.migrate_rows=4", "Fusion.migrate_replicas=1"]
    return out + MEMORY[c["memory"]]


def _error_lines(stderr: str, launcher: bool = True) -> list[str]:
    """The lines of ``stderr`` that are not logging, without their process prefix (without
    the launcher's own lines unless ``launcher``)."""
    keep = []
    for line in stderr.splitlines():
        if not launcher and line.startswith("[launch]"):
            continue
        text = line.split("] ", 1)[1] if line.startswith(("[p", "[launch]")) else line
        if not text.strip() or " INFO " in text or "Gloo" in text or "peer ranks" in text:
            continue
        if text.startswith(("WARNING", "I0000", "W0000")) or " WARNING " in text:
            continue
        keep.append(text)
    return keep


def run_one(layout: str, c: dict, tmp: Path, timeout: int) -> dict:
    processes, devices, placement = LAYOUTS[layout]
    run_dir = tmp / f"run{time.monotonic_ns()}"
    args = ["--run-dir", str(run_dir), "--quiet", *BASE, *placement, *bindings(c)]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    # The jobs of a layout compile mostly the same programs: one XLA cache for the whole probe
    # (each program is compiled once per layout, then loaded; the runs themselves are unchanged).
    env.update(JAX_COMPILATION_CACHE_DIR=str(tmp / "xla-cache"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")  # fmt: skip
    if processes == 1:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
        cmd = [sys.executable, "-m", "jrlhf.train", *args]
    else:
        cmd = [sys.executable, "-m", "jrlhf.launch", "--processes", str(processes),
               "--devices-per-process", str(devices), "--", "train", *args]  # fmt: skip
    start = time.monotonic()
    try:
        out = subprocess.run(
            cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
        )
        rc, stderr = out.returncode, out.stderr
    except subprocess.TimeoutExpired as e:
        rc, stderr = None, (e.stderr or b"").decode(errors="replace") if e.stderr else ""
    errors = _error_lines(stderr)
    # Every process of a job makes the same checks, so a refusal is the same line from each
    # (the launcher's own line after it says which process ended first).
    said = set(_error_lines(stderr, launcher=False))
    metrics = run_dir / "logs" / "ppo" / "metrics.jsonl"
    rows = metrics.read_text().splitlines() if metrics.exists() else []
    if rc == 0 and len([r for r in rows if '"reward"' in r]) == 3:
        verdict = "ran"
    elif rc and not rows and len(said) == 1 and "Traceback" not in stderr:
        verdict = "refused"
    else:
        verdict = "failed"
    return {
        "layout": layout,
        **c,
        "verdict": verdict,
        "rc": rc,
        "seconds": round(time.monotonic() - start, 1),
        # a refusal's own line (every process's), not the launcher's line after it
        "error": next(iter(said)) if verdict == "refused" else (errors[-1] if errors else ""),
        # a failure's lines that are not logging, to see what went wrong without a rerun
        **({"lines": errors[-40:]} if verdict == "failed" else {}),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.probe_compose", description=__doc__)
    p.add_argument("--layout", choices=sorted(LAYOUTS), action="append")
    p.add_argument("--timeout", type=int, default=600, help="seconds per run")
    p.add_argument(
        "--only", default="", help="a JSON dict of settings to keep, e.g. '{\"k\": [1, 2]}'"
    )
    add_out_argument(p)
    args = p.parse_args(argv)
    check_out(p, args.out)
    only = json.loads(args.only) if args.only else {}
    todo = [
        c
        for c in combinations()
        if all(c[k] in (v if isinstance(v, list) else [v]) for k, v in only.items())
    ]
    results = []
    with tempfile.TemporaryDirectory(prefix="jrlhf-probe-compose-") as tmp:
        for layout in args.layout or ["1x8"]:
            for c in todo:
                results.append(run_one(layout, c, Path(tmp), args.timeout))
                r = results[-1]
                print(f"{layout} {bindings(c)} -> {r['verdict']} {r['error'][:160]}",
                      file=sys.stderr, flush=True)  # fmt: skip
    tally: dict[str, int] = {}
    for r in results:
        tally[r["verdict"]] = tally.get(r["verdict"], 0) + 1
    emit({"probe": "compose", "tally": tally, "results": results}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
