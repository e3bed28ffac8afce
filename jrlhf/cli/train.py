"""``python -m jrlhf.train [--config FILE.gin ...] [BINDING ...]``: the RLHF pipeline.

With no arguments it runs configs/default.gin: on the built-in synthetic task whose true
preference is known, SFT a tiny actor, train a tiny reward model on preference pairs, then PPO
with actor, critic, reference and reward, and print the held-out ground-truth score of the SFT
and PPO policies and the PPO policy's KL to the reference.

Bindings use gin syntax, e.g. ``RLConfig.iterations=10`` or
``'actor/RoleConfig.train_mesh="fsdp=8"'``. ``--resume`` continues a run directory exactly.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils

from jrlhf.config import DEFAULT_CONFIG, Config, ConfigError, load_config
from jrlhf.meshes.processes import barrier
from jrlhf.ppo.core_algos import check_algorithm_config
from jrlhf.runtime import distributed

log = logging.getLogger("jrlhf")


def setup_logging() -> None:
    """jrlhf's own messages at INFO; libraries (Orbax, absl) only when they warn."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")
    log.setLevel(logging.INFO)
    for noisy in ("absl", "orbax", "jax._src.xla_bridge"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jrlhf.train", description=__doc__.split("\n\n")[0].split(": ", 1)[-1]
    )
    p.add_argument("--config", action="append", default=[], help="gin file (repeatable)")
    p.add_argument("--run-dir", help="output directory (default runs/<timestamp>)")
    p.add_argument("--resume", action="store_true", help="continue the run in --run-dir")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    distributed.add_flag(p)
    p.add_argument("bindings", nargs="*", help="gin bindings, e.g. RLConfig.iterations=10")
    return p


def _run_stamp() -> str:
    """The default run directory's timestamp: process 0's, on every process."""
    now = int(time.time())
    if jax.process_count() > 1:
        now = int(multihost_utils.broadcast_one_to_all(np.int64(now)))
    return time.strftime("%Y%m%d-%H%M%S", time.localtime(now))


def prepare_run_dir(cfg: Config, run_dir: str | None, resume: bool) -> Path:
    """The run directory, checked (a new run never reuses one; a resume needs one) by every
    process before any creates it."""
    path = Path(run_dir or cfg.run.run_dir or "")
    if not str(path) or str(path) == ".":
        path = Path("runs") / f"run-{_run_stamp()}"
    if path.exists() and any(path.iterdir()) and not resume:
        raise ConfigError(
            f"run directory {path} already holds a run: pass --resume to continue it, or choose "
            "another --run-dir"
        )
    if resume and not path.exists():
        raise ConfigError(f"--resume: run directory {path} does not exist")
    barrier("run_dir")
    path.mkdir(parents=True, exist_ok=True)
    return path


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    files = args.config or [str(DEFAULT_CONFIG)]
    bindings = list(args.bindings)
    try:
        cfg = load_config(files, bindings)
        for stage in cfg.run.stages:
            if stage in ("ppo", "grpo"):
                check_algorithm_config(cfg.rl, stage)
        distributed.setup_devices(args.distributed, cfg.run.host_devices)
        run_dir = prepare_run_dir(cfg, args.run_dir, args.resume or cfg.run.resume)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return distributed.end_process(2)
    setup_logging()
    # Imported here, not at the top: XLA reads the virtual-device flag set above when JAX's
    # backends start, and the pipeline starts them.
    from jrlhf.pipeline.run import run  # noqa: PLC0415

    try:
        return distributed.end_process(run(cfg, run_dir, quiet=args.quiet))
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return distributed.end_process(2)


if __name__ == "__main__":
    sys.exit(main())
