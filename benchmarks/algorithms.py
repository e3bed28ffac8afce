"""Which RL algorithm learns the arithmetic task best? ``python -m jrlhf.bench algorithms``.

For each seed, one SFT run of ``configs/arithmetic_grpo.gin`` (its ``sft`` stage), then from that
same SFT policy one GRPO-stage run per algorithm, each adding its ``configs/algorithms/NAME.gin``
on top of the arithmetic config: the same prompts, samples, iterations and learning rate for all
(the same budget). Every run is the real CLI in a subprocess (``python -m jrlhf.train``); the
held-out exact match before and after RL is the run's own ``summary.json`` (4 samples per
held-out prompt at the training temperature). One JSON object on stdout: per algorithm and seed
the scores and wall time, and the mean over seeds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.report import add_out_argument, check_out, emit

CHECKOUT = Path(__file__).resolve().parents[1]
CONFIG = CHECKOUT / "configs" / "arithmetic_grpo.gin"
ALGORITHM_DIR = CHECKOUT / "configs" / "algorithms"


def algorithms() -> list[str]:
    """Every algorithm that has a config fragment in configs/algorithms/."""
    return sorted(p.stem for p in ALGORITHM_DIR.glob("*.gin"))


def run_train(run_dir: Path, configs: list[Path], bindings: list[str], log: Path) -> float:
    """One ``python -m jrlhf.train`` run; returns its wall time. A failed run raises with the
    tail of its log."""
    args = [sys.executable, "-m", "jrlhf.train", "--run-dir", str(run_dir), "--quiet"]
    for c in configs:
        args += ["--config", str(c)]
    t0 = time.perf_counter()
    with log.open("w") as out:
        rc = subprocess.run(args + bindings, cwd=CHECKOUT, stdout=out, stderr=subprocess.STDOUT)
    if rc.returncode != 0:
        tail = log.read_text().strip().splitlines()[-3:]
        raise RuntimeError(f"{run_dir}: exit {rc.returncode}: {' | '.join(tail)}")
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jrlhf.bench algorithms", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument(
        "--algorithms", nargs="+", default=None, help=f"default: all of {algorithms()}"
    )
    parser.add_argument("--runs", type=Path, required=True, help="directory for the runs")
    add_out_argument(parser)
    parser.add_argument("--host-devices", type=int, default=1, help="virtual CPU devices per run")
    parser.add_argument("--sft-steps", type=int, default=0, help="0: the config's")
    parser.add_argument("--iterations", type=int, default=0, help="0: the config's")
    args = parser.parse_args(argv)
    names = args.algorithms or algorithms()
    unknown = [n for n in names if not (ALGORITHM_DIR / f"{n}.gin").is_file()]
    if unknown:
        parser.error(f"unknown algorithm(s) {unknown} (known: {algorithms()})")
    if args.runs.exists() and any(args.runs.iterdir()):
        parser.error(f"--runs {args.runs} is not empty")
    check_out(parser, args.out)
    args.runs.mkdir(parents=True, exist_ok=True)

    common = [f"RunConfig.host_devices={args.host_devices}"]
    if args.sft_steps:
        common.append(f"SFTConfig.steps={args.sft_steps}")
    if args.iterations:
        common.append(f"RLConfig.iterations={args.iterations}")
    runs: dict[str, dict[str, dict]] = {n: {} for n in names}
    sft_seconds = {}
    for seed in args.seeds:
        base = args.runs / f"seed{seed}"
        base.mkdir()
        seeded = [*common, f"RunConfig.seed={seed}"]
        sft_run = base / "sft"
        sft_seconds[seed] = run_train(
            sft_run, [CONFIG], [*seeded, "RunConfig.stages=('sft',)"], base / "sft.log"
        )
        start = f"'ckpt:{sft_run / 'sft'}'"
        for name in names:
            run_dir = base / name
            seconds = run_train(
                run_dir,
                [CONFIG, ALGORITHM_DIR / f"{name}.gin"],
                [
                    *seeded,
                    "RunConfig.stages=('grpo',)",
                    f"actor/RoleConfig.init={start}",
                    f"reference/RoleConfig.init={start}",
                ],
                base / f"{name}.log",
            )
            summary = json.loads((run_dir / "summary.json").read_text())
            runs[name][str(seed)] = {
                "before": summary["before"]["gt_score"],
                "after": summary["after"]["gt_score"],
                "seconds": round(seconds, 1),
            }
            if "kl_to_ref" in summary["after"]:  # only a run with a KL term has a reference
                runs[name][str(seed)]["kl_to_ref"] = summary["after"]["kl_to_ref"]
            print(f"seed {seed} {name}: {runs[name][str(seed)]}", file=sys.stderr)

    def mean(name: str, key: str) -> float:
        return round(statistics.fmean(r[key] for r in runs[name].values()), 4)

    report = {
        "benchmark": "algorithms",
        "task": "arithmetic (configs/arithmetic_grpo.gin)",
        "metric": "held-out exact match, 4 samples per prompt at temperature 1",
        "seeds": args.seeds,
        "overrides": common,
        "sft_seconds": {str(s): round(t, 1) for s, t in sft_seconds.items()},
        "runs": runs,
        "mean": {n: {"before": mean(n, "before"), "after": mean(n, "after")} for n in names},
    }
    emit(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
