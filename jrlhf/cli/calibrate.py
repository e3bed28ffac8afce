"""``python -m jrlhf.plan.calibrate --out PATH [--device-kind NAME]``: measure a device profile.

See jrlhf.pipeline.calibrate for what is measured and how it is fitted.
"""

from __future__ import annotations

import argparse
import json
import sys

from jrlhf.runtime import distributed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m jrlhf.plan.calibrate", description=__doc__.split("\n")[0]
    )
    p.add_argument("--out", required=True, help="profile JSON to write")
    p.add_argument("--device-kind", help="profile name (default: the platform / device kind)")
    p.add_argument("--quick", action="store_true", help="fewer microbenchmark sizes")
    distributed.add_flag(p)
    args = p.parse_args(argv)
    try:
        distributed.setup_devices(args.distributed, 8)
    except distributed.DistributedError as e:
        print(f"error: {e}", file=sys.stderr)
        return distributed.end_process(2)
    # After the device flag: XLA reads it when JAX's backends start.
    from jrlhf.pipeline.calibrate import calibrate  # noqa: PLC0415

    profile = calibrate(args.device_kind, quick=args.quick)
    profile.save(args.out)
    print(json.dumps({k: v for k, v in profile.to_dict().items() if k != "measured"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
