"""``python -m jrlhf.bench
{decode,reshard,interleave,plan,algorithms,rl,async,fusion,staleness,gpu,lora,moe_routing,
pipeline}
[options]``: one JSON object on stdout.

The benchmarks are not part of the installed library: they live in ``benchmarks/`` of the source
checkout (beside the ``jrlhf`` package) and run from there, e.g. after ``pip install -e .``.
``--distributed`` (anywhere among the options) joins a multi-process job first, as on the other
entry points; the benchmark then sees every process's devices.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from jrlhf.devices import keep_host_memory
from jrlhf.runtime import distributed

SUITES = (
    "decode", "reshard", "interleave", "plan", "algorithms", "rl", "async", "fusion", "staleness",
    "gpu", "lora", "moe_routing", "pipeline",
)  # fmt: skip
CHECKOUT = Path(__file__).resolve().parents[2]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # The flag is the launcher's and every entry point's, not a benchmark option: take it out
    # before the benchmark parses its own (an argument after "--" is the benchmark's).
    own = argv[: argv.index("--")] if "--" in argv else argv
    join = "--distributed" in own
    if join:
        argv.remove("--distributed")
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SUITES:
        if argv and argv[0] not in ("-h", "--help"):
            print(f"unknown benchmark {argv[0]!r} (known: {', '.join(SUITES)})", file=sys.stderr)
            return 2
        print(f"usage: python -m jrlhf.bench {{{','.join(SUITES)}}} [options]")
        return 0
    if not (CHECKOUT / "benchmarks" / f"{argv[0]}.py").is_file():
        print(f"error: no benchmarks/ beside {CHECKOUT / 'jrlhf'}: run from a source checkout")
        return 2
    # As every entry point does, before a benchmark starts JAX's backend (the peers the
    # benchmarks run, transformers and TRL, are processes of their own and left alone).
    keep_host_memory()
    if join:
        try:
            # Each benchmark asks for its own device count (before JAX's backends start).
            distributed.initialize(host_devices=None)
        except distributed.DistributedError as e:
            print(f"error: {e}", file=sys.stderr)
            return distributed.end_process(2)
    if str(CHECKOUT) not in sys.path:
        sys.path.insert(0, str(CHECKOUT))
    module = importlib.import_module(f"benchmarks.{argv[0]}")
    return distributed.end_process(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
