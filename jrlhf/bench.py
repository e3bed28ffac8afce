"""Benchmarks with JSON output: ``python -m jrlhf.bench {decode,reshard} [options]``.

Each subcommand lives beside the code it measures (jrlhf/decode/bench.py, jrlhf/reshard/bench.py)
and prints one JSON object on stdout.
"""

from __future__ import annotations

import importlib
import sys

SUITES = {
    "decode": "jrlhf.decode.bench",
    "reshard": "jrlhf.reshard.bench",
    "interleave": "jrlhf.plan.overlap",
    "plan": "jrlhf.plan.bench",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SUITES:
        if argv and argv[0] not in ("-h", "--help"):
            print(f"unknown benchmark {argv[0]!r} (known: {', '.join(SUITES)})", file=sys.stderr)
            return 2
        print(f"usage: python -m jrlhf.bench {{{','.join(SUITES)}}} [options]")
        return 0
    module = importlib.import_module(SUITES[argv[0]])
    return module.main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
