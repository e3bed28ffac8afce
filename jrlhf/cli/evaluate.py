"""``python -m jrlhf.evaluate --checkpoint DIR [--mesh SPEC]``: score a trained policy.

Restores the actor of a trainer checkpoint (a run directory, its ``checkpoints/`` or one step)
onto ``--mesh``, which need not be the mesh it was trained on, samples completions for held-out
prompts and reports, as JSON, the reward-model score, the ground-truth score (for tasks that know
it, such as the built-in synthetic task) and the KL to the reference policy: those the run had. A
run without an RL stage (SFT or DPO) is evaluated at its final policy; a reward or reference it
never had is not scored against a random model but left out, with one line on stderr saying why.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from jrlhf.config import ConfigError
from jrlhf.meshes import MeshLayoutError, MeshSpec, blame_setting, make_mesh
from jrlhf.meshes.processes import is_primary
from jrlhf.runtime import distributed
from jrlhf.storage import describe_os_error, settle_abandoned_tasks, write_atomic
from jrlhf.tasks.rewards import RewardError


def _int_at_least(low: int):
    """An argparse type: an int >= ``low`` (a count of 0 samples, or -1 prompts, would be read
    as "the default" or "all but the last" rather than refused)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expects an int, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jrlhf.evaluate", description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True, help="run dir, checkpoints dir or step dir")
    p.add_argument("--mesh", default="data=4,tensor=2", help="evaluation mesh, e.g. data=8")
    p.add_argument("--rules", default="dp_tp", help="rule set for the evaluation mesh")
    p.add_argument(
        "--num-prompts", type=_int_at_least(0), default=0, help="held-out prompts (0: all)"
    )
    p.add_argument("--samples", type=_int_at_least(1), default=4, help="samples per prompt")
    p.add_argument("--greedy", action="store_true")
    p.add_argument("--output", help="also write the JSON report here")
    distributed.add_flag(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    settle_abandoned_tasks()  # a damaged checkpoint's abandoned reads end before the one line
    # Every error about the mesh (a typo, too few devices, a model it does not divide) names
    # --mesh; a typo is found before JAX starts.
    setting = f"--mesh {args.mesh}"
    try:
        with blame_setting(setting):
            spec = MeshSpec.parse(args.mesh)
        distributed.setup_devices(args.distributed)
        with blame_setting(setting):
            make_mesh(spec)
    except ValueError as e:  # DistributedError is one
        print(f"error: {e}", file=sys.stderr)
        return distributed.end_process(2)
    # After the device flag: XLA reads it when JAX's backends start.
    from jrlhf.pipeline.evaluate import evaluate_checkpoint  # noqa: PLC0415

    try:
        report = evaluate_checkpoint(
            Path(args.checkpoint), args.mesh, args.rules, args.num_prompts, args.samples,
            args.greedy,
        )  # fmt: skip
    except (ConfigError, FileNotFoundError, ValueError, RewardError) as e:
        if isinstance(e, MeshLayoutError):  # the run's models do not divide the mesh
            e = f"{setting} (--rules {args.rules}): {e}"
        print(f"error: {e}", file=sys.stderr)
        return distributed.end_process(1 if isinstance(e, RewardError) else 2)
    if is_primary():  # every process computed the same report; process 0 reports it
        missing = report.get("not_reported", {})
        if missing:
            why = "; ".join(f"{key}, as {reason}" for key, reason in missing.items())
            print(f"note: not reported: {why}", file=sys.stderr)
        text = json.dumps(report, indent=2)
        print(text)
        if args.output:
            try:
                write_atomic(args.output, text)  # whole or not at all
            except OSError as e:  # a full disk, a read-only or missing directory
                print(f"error: cannot write --output {describe_os_error(e)}", file=sys.stderr)
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
