"""``python -m jrlhf.plan.calibrate --out PATH [--device-kind NAME]``: measure a device profile.

See jrlhf.calibration.measure for what is measured and how it is fitted. On an accelerator, fit
the profile to ``python -m jrlhf.bench gpu`` reports instead (real model shapes; the small
calibration models measure kernel launches there): ``--from-bench-gpu REPORT.json ...
--device-kind h100`` (jrlhf.calibration.from_bench; the built-in profile of that name, or
``--template``, gives what one device cannot measure).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from jrlhf.runtime import distributed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m jrlhf.plan.calibrate", description=__doc__.split("\n")[0]
    )
    p.add_argument("--out", help="profile JSON to write (required unless --score)")
    p.add_argument("--device-kind", help="profile name (default: the platform / device kind)")
    p.add_argument("--quick", action="store_true", help="fewer microbenchmark sizes")
    p.add_argument(
        "--from-bench-gpu",
        nargs="+",
        metavar="REPORT",
        help="fit to these python -m jrlhf.bench gpu JSON reports instead of measuring here",
    )
    p.add_argument(
        "--template",
        help="with --from-bench-gpu: the profile (name or JSON) whose links, memory and "
        "overheads are kept (default: the built-in profile named by --device-kind)",
    )
    p.add_argument(
        "--score",
        metavar="PROFILE",
        help="with --from-bench-gpu: fit nothing; print PROFILE's (name or JSON) estimates of "
        "the reports' runs against their measured times (a held-out check)",
    )
    distributed.add_flag(p)
    args = p.parse_args(argv)
    if args.from_bench_gpu:
        return _from_bench(p, args)
    if args.score:
        p.error("--score needs --from-bench-gpu (the reports to score against)")
    if not args.out:
        p.error("--out is required (the profile JSON to write)")
    try:
        distributed.setup_devices(args.distributed, 8)
    except distributed.DistributedError as e:
        print(f"error: {e}", file=sys.stderr)
        return distributed.end_process(2)
    # After the device flag: XLA reads it when JAX's backends start.
    from jrlhf.calibration.measure import calibrate  # noqa: PLC0415

    profile = calibrate(args.device_kind, quick=args.quick)
    profile.save(args.out)
    print(json.dumps({k: v for k, v in profile.to_dict().items() if k != "measured"}, indent=2))
    return 0


def _from_bench(p: argparse.ArgumentParser, args) -> int:
    """Fit a profile to bench gpu reports (no devices used)."""
    # imported here like the calibration below: the module imports JAX, which this entry point
    # leaves alone until the device flag is applied
    from jrlhf.calibration.from_bench import (  # noqa: PLC0415
        BenchReportError,
        profile_from_bench,
        score_profile,
    )
    from jrlhf.placement.profile import DeviceProfile  # noqa: PLC0415

    reports = []
    for path in args.from_bench_gpu:
        try:
            reports.append((Path(path).name, json.loads(Path(path).read_text())))
        except (OSError, ValueError) as e:
            print(f"error: bench gpu report {path}: {e}", file=sys.stderr)
            return 2
    if args.score:
        try:
            scored = score_profile(reports, DeviceProfile.load(args.score))
        except (KeyError, TypeError, ValueError) as e:
            print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
            return 2
        print(json.dumps(scored, indent=2))
        return 0
    if not args.out:
        p.error("--out is required (the profile JSON to write)")
    template = args.template or args.device_kind
    if not template:
        p.error("--from-bench-gpu needs --device-kind (or --template): the profile to start from")
    try:
        base = DeviceProfile.load(template)
        if args.device_kind:
            base = base.replace(name=args.device_kind)
        profile = profile_from_bench(reports, base)
    except (BenchReportError, KeyError, TypeError, ValueError) as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    profile.save(args.out)
    print(json.dumps({k: v for k, v in profile.to_dict().items() if k != "measured"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
