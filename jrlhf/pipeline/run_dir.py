"""The run directory: what a run writes at start, when a directory holds a run, and how a resume
takes its configuration from it.

A run directory is the source of truth on ``--resume``: the configuration is the one saved in
``operative_config.gin`` when the run started; command-line files and bindings may only change
the fields of :data:`MAY_CHANGE_ON_RESUME` (how long to train, how often to save, what to show),
anything else is refused in one line before anything is written.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax

from jrlhf.config import RL_SUB_CONFIGS, Config, ConfigError, load_config, operative_config
from jrlhf.meshes.processes import barrier, fetch, is_primary, post
from jrlhf.pipeline.run_lock import (
    LOCK_FILE,
    RunDirInUse,
    RunLock,
    lock_run_dir,
    run_dir_holder,
)
from jrlhf.storage import describe_os_error, write_atomic

OPERATIVE_CONFIG = "operative_config.gin"  # the gin bindings the run was started with
CONFIG_JSON = "config.json"  # every field's value, for people and tools that do not read gin
PLAN_GIN = "plan.gin"  # the execution plan the run used (jrlhf.placement)

# Written by a run before its first stage; what a stage writes (its output, checkpoints, logs)
# is progress.
PROGRESS = (
    "sft", "rm", "dpo", "sft_checkpoints", "rm_checkpoints", "dpo_checkpoints", "checkpoints",
    "logs",
)  # fmt: skip

# Fields a resume may change: the run's length and its bookkeeping, never what it computes.
MAY_CHANGE_ON_RESUME = frozenset(
    {
        "RunConfig.run_dir",
        "RunConfig.resume",
        "RunConfig.progress_bar",
        "RunConfig.tensorboard",
        "RunConfig.host_devices",
        "RunConfig.max_nonfinite_updates",
        "RLConfig.iterations",
        "RLConfig.checkpoint_every",
        "RLConfig.keep_checkpoints",
        "RLConfig.async_checkpoint",
        "RLConfig.eval_every",
        "SFTConfig.checkpoint_every",
        "RewardModelConfig.checkpoint_every",
        "DPOConfig.checkpoint_every",
    }
)

_SECTIONS = {
    "run": "RunConfig",
    "task": "TaskConfig",
    "sft": "SFTConfig",
    "rm": "RewardModelConfig",
    "dpo": "DPOConfig",
    "rl": "RLConfig",
    "decode": "DecodeConfig",
}


def config_fields(cfg: Config) -> Iterator[tuple[str, Any]]:
    """(gin name, value) of every field of ``cfg``, e.g. ``("actor/RoleConfig.init", "tiny")``;
    RLConfig's sub-configs by their own names (``("Asynchrony.max_staleness", 1)``)."""
    for attr, section in _SECTIONS.items():
        for f in dataclasses.fields(getattr(cfg, attr)):
            value = getattr(getattr(cfg, attr), f.name)
            if attr == "rl" and f.name in RL_SUB_CONFIGS:
                for sub in dataclasses.fields(value):
                    yield f"{type(value).__name__}.{sub.name}", getattr(value, sub.name)
            else:
                yield f"{section}.{f.name}", value
    for role, rc in cfg.roles.items():
        for f in dataclasses.fields(rc):
            yield f"{role}/RoleConfig.{f.name}", getattr(rc, f.name)


def resume_config(run_dir: Path, files: list[str], bindings: list[str]) -> Config:
    """The configuration of the run in ``run_dir``: its saved operative config with ``files``
    and ``bindings`` applied on top; a ConfigError when they change a field outside
    :data:`MAY_CHANGE_ON_RESUME`, or when ``run_dir`` holds no saved config."""
    saved = run_dir / OPERATIVE_CONFIG
    if not saved.is_file():
        raise ConfigError(f"--resume: {saved} does not exist (not a jrlhf run directory)")
    before = dict(config_fields(load_config([str(saved)], [])))
    cfg = load_config([str(saved), *files], bindings)
    for name, value in config_fields(cfg):
        if name not in MAY_CHANGE_ON_RESUME and value != before[name]:
            raise ConfigError(
                f"--resume: {name} would change from {before[name]!r} to {value!r}; a resumed "
                f"run keeps the configuration saved in {saved} (a resume may change only "
                f"{', '.join(sorted(MAY_CHANGE_ON_RESUME))})"
            )
    return cfg


def holds_run(path: Path) -> bool:
    """Whether ``path`` is a directory with anything in it but its lock file (which a run that
    was killed before writing anything else leaves behind)."""
    return path.is_dir() and any(p.name != LOCK_FILE for p in path.iterdir())


class RunDirRefused(Exception):
    """This run cannot use its run directory (another run's, or not writable); one line."""


def _primary_refusal(key: str, refusal: str) -> str:
    """Process 0's ``refusal`` ("" for none), on every process of the job."""
    if jax.process_count() > 1:  # the others learn process 0's outcome
        if is_primary():
            post(key, refusal.encode())
        else:
            refusal = fetch(key).decode()
    return refusal


def lock_for_run(run_dir: Path, resume: bool) -> RunLock | None:
    """Process 0's exclusive lock on the existing ``run_dir`` for the life of the run
    (jrlhf.pipeline.run_lock), taken before the run writes anything; None on other processes.
    Every process calls it; all raise the same RunDirRefused when the directory is another
    run's (locked by it, or, for a new run, holding a run that started, and perhaps ended,
    since the directory was last looked at) or the lock file cannot be written."""
    lock, refusal = None, ""
    if is_primary():
        try:
            lock = lock_run_dir(run_dir)
            if not resume and holds_run(run_dir):
                refusal = (
                    f"run directory {run_dir} already holds a run (started by another process "
                    "meanwhile): pass --resume to continue it, or choose another --run-dir"
                )
        except RunDirInUse as e:
            refusal = str(e)
        except OSError as e:
            refusal = f"cannot write {describe_os_error(e)}"
    refusal = _primary_refusal("run_dir_lock", refusal)
    if refusal:
        if lock is not None:
            lock.release()
        raise RunDirRefused(refusal)
    return lock


def check_run_dir_free(run_dir: Path) -> None:
    """``--check``: the RunDirRefused a start or resume in ``run_dir`` would raise because
    another run holds it (lock_for_run), found without taking its lock or writing anything.
    Every process calls it; process 0 looks."""
    refusal = ""
    if is_primary():
        holder = run_dir_holder(run_dir)
        refusal = str(RunDirInUse(run_dir, holder)) if holder is not None else ""
    refusal = _primary_refusal("run_dir_check", refusal)
    if refusal:
        raise RunDirRefused(refusal)


def has_progress(path: Path) -> bool:
    """Whether a run in ``path`` got past its start: a stage wrote output, a checkpoint or a
    metric."""
    for name in PROGRESS:
        p = path / name
        files = [p] if p.is_file() else p.rglob("*") if p.is_dir() else []
        if any(f.is_file() and f.stat().st_size > 0 for f in files):
            return True
    return False


def write_start_files(run_dir: Path, cfg: Config, plan_gin: str) -> None:
    """The operative config, every field's value and the plan, written by process 0; files
    whose content is unchanged are not rewritten (a resume rewrites only what it changed)."""
    if not is_primary():
        return
    texts = {
        OPERATIVE_CONFIG: operative_config(),
        CONFIG_JSON: cfg.to_json(),
        PLAN_GIN: plan_gin,
    }
    for name, text in texts.items():
        path = run_dir / name
        if not path.exists() or path.read_text() != text:
            write_atomic(path, text)  # a resume reads it: never half-written


def before_training(run_dir: Path, stage: str, evaluate: Callable[[], dict]) -> dict:
    """A stage's held-out evaluation before it trains: ``evaluate()``, kept by process 0 in
    ``<stage>_before.json`` so that a resumed stage, whose model has moved on, reads it instead.
    Every process calls it."""
    path = run_dir / f"{stage}_before.json"
    evaluated = path.exists()
    barrier(f"{stage}:before")  # every process has looked before process 0 writes it
    if evaluated:
        return json.loads(path.read_text())
    before = evaluate()
    if is_primary():
        write_atomic(path, json.dumps(before))
    return before


def discard_failed_start(run_dir: Path) -> bool:
    """Remove a new run's directory when the run failed before any progress, so the same
    command can be run again; returns whether it was removed. Every process calls it."""
    barrier(f"discard:{run_dir}")
    removed = not has_progress(run_dir)
    # Every process has looked before the primary removes anything: a process still walking
    # the directory while it goes would fail with FileNotFoundError instead of the one-line
    # error the run stopped with.
    barrier(f"checked:{run_dir}")
    if removed and is_primary():
        shutil.rmtree(run_dir, ignore_errors=True)
    barrier(f"discarded:{run_dir}")
    return removed
