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
import threading
import time
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils

from jrlhf.config import DEFAULT_CONFIG, Config, ConfigError, load_config
from jrlhf.meshes.processes import barrier, is_primary
from jrlhf.pipeline.run_dir import (
    RunDirRefused,
    check_run_dir_free,
    discard_failed_start,
    holds_run,
    lock_for_run,
    resume_config,
)
from jrlhf.ppo.core_algos import check_algorithm_config
from jrlhf.runtime import distributed
from jrlhf.runtime.guard import TrainingStopped
from jrlhf.storage import (
    describe_os_error,
    quiet_storage_noise,
    settle_abandoned_tasks,
    settle_writers,
    storage_fault,
)
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
        # A registered name, an importable module:function, or a weighted sum of them.
        get_reward_fn(cfg.task.reward_fn, cfg.task)
    return cfg, path, resume


def storage_message(fault: str, removed: bool) -> str:
    """The one line a run stopped by a storage fault (jrlhf.storage) ends with;
    ``removed``: a new run's directory was removed, as it held no progress."""
    if removed:
        return (
            f"cannot write {fault}: the run stopped before any progress and left nothing (run "
            "the same command again once there is space and the directory is writable)"
        )
    return (
        f"cannot write {fault}: the run stopped after its last complete checkpoint (free space "
        "or make the directory writable, then pass --resume to continue from it)"
    )


def check(cfg: Config, run_dir: Path | None, resume: bool) -> int:
    """``--check``: build and check everything the run would before its first step
    (jrlhf.pipeline.start_check), writing nothing; the run's one-line error, or "config ok".
    A run directory another run holds is refused as the start would, without taking its lock."""
    # Imported here, not at the top: after the device set-up, as for the run.
    from jrlhf.pipeline.start_check import check_run  # noqa: PLC0415

    try:
        if run_dir is not None:
            check_run_dir_free(run_dir)
        plan = check_run(cfg)
    except (RunDirRefused, ConfigError, ValueError, FileNotFoundError, RewardError) as e:
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
    lock = None
    try:
        cfg, run_dir, resume = load_run_config(args)
        distributed.setup_devices(args.distributed, cfg.run.host_devices)
        if args.check:
            return distributed.end_process(check(cfg, run_dir, resume))
        run_dir = run_dir or Path("runs") / f"run-{_run_stamp()}"
        # Every process looks before any creates it: a process that looked after a peer's
        # mkdir would take a failed start for a resumed one and skip the peers' discard
        # barriers (they then wait out the refusal's wait for it).
        created = not run_dir.exists()
        barrier("run_dir")
        run_dir.mkdir(parents=True, exist_ok=True)
        # One writer per run directory, for the whole run; a second start or resume of it is
        # refused here, before it writes anything (and without removing what it did not make).
        lock = lock_for_run(run_dir, resume)
    except (ConfigError, ValueError, RunDirRefused) as e:
        print(f"error: {e}", file=sys.stderr)
        return distributed.end_process(2)
    except OSError as e:  # the run directory cannot be made (a read-only parent, a file)
        print(f"error: cannot create run directory {describe_os_error(e)}", file=sys.stderr)
        return distributed.end_process(2)
    setup_logging()
    quiet_storage_noise()
    settle_abandoned_tasks()  # a damaged checkpoint's abandoned reads end before its warning
    # Imported here, not at the top: XLA reads the virtual-device flag set above when JAX's
    # backends start, and the pipeline starts them.
    from jrlhf.pipeline.run import run  # noqa: PLC0415

    threads = set(threading.enumerate())
    try:
        return distributed.end_process(run(cfg, run_dir, quiet=args.quiet))
    except Exception as e:
        # A full disk or a read-only or forbidden directory, at any write (Orbax's background
        # saves included): one line naming the path and errno. Orbax renames a step into place
        # only once complete, so the newest listed checkpoint is intact.
        fault = storage_fault(e, where=run_dir)
        reported = (ConfigError, ValueError, FileNotFoundError, TrainingStopped, RewardError)
        if fault is None and not isinstance(e, reported):
            raise
        if fault:
            settle_writers(threads)
        # A new run refused before any progress leaves nothing, so the same command can run
        # again once fixed; a run that got further keeps its directory for inspection.
        removed = not resume and created and discard_failed_start(run_dir)
        print(f"error: {storage_message(fault, removed) if fault else e}", file=sys.stderr)
        stopped = fault or isinstance(e, TrainingStopped | RewardError)  # stopped by itself
        return distributed.end_process(1 if stopped else 2)
    finally:
        if lock is not None:
            lock.release()


if __name__ == "__main__":
    sys.exit(main())
