"""``python -m jrlhf.train [--config FILE.gin ...] [BINDING ...]``: the RLHF pipeline.

With no arguments it runs configs/default.gin: on the built-in synthetic task whose true
preference is known, SFT a tiny actor, train a tiny reward model on preference pairs, then PPO
with actor, critic, reference and reward, and print the held-out ground-truth score of the SFT
and PPO policies and the PPO policy's KL to the reference.

Bindings use gin syntax, e.g. ``RLConfig.iterations=10`` or
``'actor/RoleConfig.train_mesh="fsdp=8"'``. ``--resume`` continues a run directory exactly, with
the configuration saved in it (jrlhf.pipeline.run_dir). ``--check`` validates the configuration
and the run directory, builds what the run builds before its first step without running a
model (jrlhf.pipeline.start_check) and writes nothing.
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
from jrlhf.meshes.processes import barrier, is_primary
from jrlhf.pipeline.run_dir import discard_failed_start, holds_run, resume_config
from jrlhf.ppo.core_algos import check_algorithm_config
from jrlhf.runtime import distributed
from jrlhf.runtime.guard import TrainingStopped
from jrlhf.tasks.rewards import RewardError, get_reward_fn

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
    p.add_argument(
        "--check",
        action="store_true",
        help="validate the config, run directory, data, reward function, meshes and model "
        "shapes, running no model; write nothing",
    )
    distributed.add_flag(p)
    p.add_argument("bindings", nargs="*", help="gin bindings, e.g. RLConfig.iterations=10")
    return p


def _run_stamp() -> str:
    """The default run directory's timestamp: process 0's, on every process."""
    now = int(time.time())
    if jax.process_count() > 1:
        now = int(multihost_utils.broadcast_one_to_all(np.int64(now)))
    return time.strftime("%Y%m%d-%H%M%S", time.localtime(now))


def load_run_config(args: argparse.Namespace) -> tuple[Config, Path | None, bool]:
    """(config, run directory or None for a new timestamped one, resume) for the command line
    ``args``: a new run's config from its files and bindings, a resume's from the run directory
    (jrlhf.pipeline.run_dir). Checks everything that needs no devices (JAX's backends are not
    started: the device setup comes after); creates nothing."""
    files, bindings = list(args.config), list(args.bindings)
    resume, where, cfg = args.resume, args.run_dir, None
    if not resume or not where:
        # A new run's config; it may also be where RunConfig.resume / run_dir are set.
        cfg = load_config(files or [str(DEFAULT_CONFIG)], bindings)
        resume, where = resume or cfg.run.resume, where or cfg.run.run_dir
    path = Path(where) if where else None
    if resume:
        if path is None:
            raise ConfigError("--resume (RunConfig.resume) needs the run's --run-dir")
        if not path.exists():
            raise ConfigError(f"--resume (RunConfig.resume): run directory {path} does not exist")
        cfg = resume_config(path, files, bindings)
    elif path is not None and holds_run(path):
        raise ConfigError(
            f"run directory {path} already holds a run: pass --resume to continue it, or "
            "choose another --run-dir"
        )
    for stage in cfg.run.stages:
        if stage in ("ppo", "grpo"):
            check_algorithm_config(cfg.rl, stage)
    if cfg.task.reward_fn:
        get_reward_fn(cfg.task.reward_fn)  # a registered name or an importable module:function
    return cfg, path, resume


def check(cfg: Config, run_dir: Path | None, resume: bool) -> int:
    """``--check``: build and check everything the run would before its first step
    (jrlhf.pipeline.start_check), writing nothing; the run's one-line error, or "config ok"."""
    # Imported here, not at the top: after the device set-up, as for the run.
    from jrlhf.pipeline.start_check import check_run  # noqa: PLC0415

    try:
        plan = check_run(cfg)
    except (ConfigError, ValueError, FileNotFoundError, RewardError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1 if isinstance(e, RewardError) else 2
    where = run_dir or "runs/run-<timestamp>"
    if is_primary():
        print(
            f"config ok: {'resume' if resume else 'new run'} in {where} on {jax.device_count()} "
            f"devices, plan {plan.name!r}"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg, run_dir, resume = load_run_config(args)
        distributed.setup_devices(args.distributed, cfg.run.host_devices)
        if args.check:
            return distributed.end_process(check(cfg, run_dir, resume))
        run_dir = run_dir or Path("runs") / f"run-{_run_stamp()}"
        barrier("run_dir")  # every process has checked the directory before any creates it
        created = not run_dir.exists()
        run_dir.mkdir(parents=True, exist_ok=True)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return distributed.end_process(2)
    setup_logging()
    # Imported here, not at the top: XLA reads the virtual-device flag set above when JAX's
    # backends start, and the pipeline starts them.
    from jrlhf.pipeline.run import run  # noqa: PLC0415

    try:
        return distributed.end_process(run(cfg, run_dir, quiet=args.quiet))
    except (ConfigError, ValueError, FileNotFoundError, TrainingStopped, RewardError) as e:
        print(f"error: {e}", file=sys.stderr)
        # A new run refused before any progress leaves nothing, so the same command can run
        # again once fixed; a run that got further keeps its directory for inspection.
        if not resume and created:
            discard_failed_start(run_dir)
        stopped = isinstance(e, TrainingStopped | RewardError)  # the run stopped itself
        return distributed.end_process(1 if stopped else 2)


if __name__ == "__main__":
    sys.exit(main())
