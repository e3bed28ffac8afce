"""Never lose a run: divergence caught before anything non-finite is saved, a resume that takes
its configuration from the run directory, fallback from a damaged checkpoint, supervised stages
that resume mid-stage, and bad input reported in one line before any work."""

import asyncio
import collections
import errno
import io
import json
import logging
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from run_helpers import (
    SMALL,
    Preempted,
    assert_rows_close,
    file_size_limit,
    hold_lock,
    metric_rows,
    ppo_bindings,
    preempt_at_step,
)

from jrlhf import checkpoint
from jrlhf import metrics as metrics_lib
from jrlhf.cli import convert, evaluate, train
from jrlhf.data import load_prompts
from jrlhf.event_file import read_records
from jrlhf.meshes import make_mesh
from jrlhf.models import hf
from jrlhf.pipeline.run_dir import OPERATIVE_CONFIG
from jrlhf.pipeline.run_lock import LOCK_FILE, lock_run_dir
from jrlhf.ppo.trainer import RLTrainer
from jrlhf.runtime.guard import TrainingStopped
from jrlhf.storage import (
    quiet_storage_noise,
    settle_abandoned_tasks,
    storage_fault,
    write_atomic,
)
from jrlhf.tasks import SyntheticTask


def _snapshot(run_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}


def _copy(run_dir: Path, to: Path) -> Path:
    shutil.copytree(run_dir, to)
    return to


def _eval_steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in metric_rows(run_dir) if any(k.startswith("eval/") for k in r)]


def test_divergence_stops_the_run_and_keeps_the_last_finite_checkpoint(base_run, tmp_path, capsys):
    run_dir = tmp_path / "diverged"
    bindings = ppo_bindings(
        base_run,
        "actor/RoleConfig.learning_rate=1e8",  # the critic's step stays the colocated run's
        "RLConfig.iterations=8",
        "RLConfig.checkpoint_every=1",
        "RLConfig.keep_checkpoints=2",
        "RunConfig.max_nonfinite_updates=1",
    )
    rc = train.main(["--run-dir", str(run_dir), "--quiet", *bindings])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1, err
    assert "diverged" in err[-1] and "RunConfig.max_nonfinite_updates=1" in err[-1], err
    stopped_at = int(err[-1].split("(last at iteration ")[1].split(")")[0])
    rows = metric_rows(run_dir)
    assert sum(r["train/skipped_updates"] for r in rows) > 0  # counted in metrics
    # The newest saved step is the last iteration before the one that diverged, and every saved
    # step restores with finite values.
    steps = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    assert steps and steps[-1] == stopped_at - 1
    for step in steps:
        _, params = checkpoint.load_model(
            run_dir / "checkpoints" / str(step), make_mesh("fsdp=1"), "fsdp_tp"
        )
        assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(params))


def test_resume_takes_the_config_from_the_run_directory(colocated_run, tmp_path, capsys):
    run_dir = _copy(colocated_run, tmp_path / "run")
    saved = _snapshot(run_dir)
    # A binding that changes what the run computes is refused before anything is written.
    rc = train.main(["--run-dir", str(run_dir), "--resume", "--quiet", "TaskConfig.num_heldout=8"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and "TaskConfig.num_heldout would change" in err, err
    assert _snapshot(run_dir) == saved
    # So is another config file (default.gin's 40 iterations would be allowed, its stages not).
    rc = train.main(["--run-dir", str(run_dir), "--resume", "--config", "configs/default.gin"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "RunConfig.stages would change" in err, err
    assert _snapshot(run_dir) == saved
    # Without --config the finished run resumes with its own config: nothing to train, the same
    # summary, and the final evaluation is not recorded twice.
    assert train.main(["--run-dir", str(run_dir), "--resume", "--quiet"]) == 0
    assert (run_dir / OPERATIVE_CONFIG).read_bytes() == saved[OPERATIVE_CONFIG]
    assert _eval_steps(run_dir) == [4]
    assert json.loads((run_dir / "summary.json").read_text())["iterations"] == 4
    # The number of iterations may change; the new value is then the run's.
    args = ["--run-dir", str(run_dir), "--resume", "--quiet", "RLConfig.iterations=5"]
    assert train.main(args) == 0
    assert [r["step"] for r in metric_rows(run_dir) if "reward" in r] == [1, 2, 3, 4, 5]
    assert _eval_steps(run_dir) == [4, 5]
    assert "RLConfig.iterations = 5" in (run_dir / OPERATIVE_CONFIG).read_text()


def _event_steps(tb_dir: Path, tag: str) -> list[int]:
    return sorted(
        e.step
        for path in tb_dir.glob("*tfevents*")
        for _, e in read_records(path)
        if tag in e.scalars
    )


def test_rl_stage_stopped_before_its_first_checkpoint_logs_each_iteration_once(
    base_run, colocated_run, tmp_path, monkeypatch, capsys
):
    """Stopped after iteration 3 of 4 with no checkpoint yet, the PPO stage restarts at 0 on
    --resume: metrics.jsonl and TensorBoard hold iterations 1..4 once each, the numbers of the
    uninterrupted colocated run."""
    run_dir = tmp_path / "run"
    bindings = ppo_bindings(base_run, "RLConfig.checkpoint_every=4", "RunConfig.tensorboard=True")
    args = ["--run-dir", str(run_dir), "--quiet", *bindings]
    update = metrics_lib.ProgressBar.update

    def stop_after_three(self, step, *a, **k):
        update(self, step, *a, **k)
        if step == 3:  # logged, not checkpointed
            raise TrainingStopped("stopped for the test")

    monkeypatch.setattr(metrics_lib.ProgressBar, "update", stop_after_three)
    assert train.main(args) == 1
    assert [r["step"] for r in metric_rows(run_dir)] == [1, 2, 3]
    assert checkpoint.latest_step_dir(run_dir) is None
    monkeypatch.undo()
    assert train.main([*args, "--resume"]) == 0
    assert [r["step"] for r in metric_rows(run_dir) if "reward" in r] == [1, 2, 3, 4]
    assert _event_steps(run_dir / "logs" / "ppo" / "tb", "reward") == [1, 2, 3, 4]
    assert_rows_close(metric_rows(run_dir), metric_rows(colocated_run))
    capsys.readouterr()


def _damage(step_dir: Path, how: str) -> Path:
    files = sorted(
        (p for p in (step_dir / "actor_params").rglob("*") if p.is_file()),
        key=lambda p: p.stat().st_size,
    )
    victim = files[-1]
    if how == "truncate":
        victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 3])
    else:
        victim.unlink()
    return victim


@pytest.mark.parametrize("how", ["truncate", "delete"])
def test_damaged_newest_checkpoint_falls_back_to_the_previous_step(
    how, colocated_run, tmp_path, capsys, caplog
):
    run_dir = _copy(colocated_run, tmp_path / "run")
    victim = _damage(run_dir / "checkpoints" / "4", how)
    damaged = victim.read_bytes() if victim.exists() else None
    if how == "truncate":
        # Resuming from step 2 redoes iterations 3 and 4 exactly as the uninterrupted run did.
        assert train.main(["--run-dir", str(run_dir), "--resume", "--quiet"]) == 0
        assert "step 4 of" in caplog.text and "damaged" in caplog.text
        assert_rows_close(metric_rows(run_dir), metric_rows(colocated_run))
        # The damaged step was set aside, not deleted; the redone step 4 took its place.
        kept = run_dir / "checkpoints" / "4.damaged" / victim.relative_to(run_dir / "checkpoints/4")
        assert kept.read_bytes() == damaged
        assert checkpoint.latest_step_dir(run_dir).name == "4"
    else:
        out = tmp_path / "eval.json"
        # test_trainer's evaluation mesh and samples: its programs, from the compilation cache
        mesh = "data=2,tensor=2@4:8"
        args = ["--checkpoint", str(run_dir), "--mesh", mesh, "--output", str(out)]
        assert evaluate.main([*args, "--samples", "2"]) == 0
        assert "step 4 of" in caplog.text and "trying an older step" in caplog.text
        assert json.loads(out.read_text())["num_samples"] == 4 * 2  # 4 held-out prompts
        assert not victim.exists() and damaged is None
    capsys.readouterr()


def test_evaluate_an_sft_only_run_reports_no_reward_or_kl_from_random_models(tmp_path, capsys):
    """An SFT-only run had no reward model (reward's init names the rm stage it did not run) and
    no reference (a random ``tiny`` one): evaluate scores its final policy (the run directory
    means its SFT output) and leaves reward and KL out, saying why in one line, instead of
    scoring it against random models (or refusing the run directory)."""
    run_dir = tmp_path / "sft"
    bindings = ["RunConfig.stages=('sft',)", "SFTConfig.steps=2"]
    bindings.append("reference/RoleConfig.init='tiny'")
    bindings.append("TaskConfig.num_heldout=4")  # test_trainer's, as its mesh and samples
    assert train.main(["--run-dir", str(run_dir), "--quiet", *SMALL, *bindings]) == 0
    capsys.readouterr()
    out = tmp_path / "eval.json"
    # test_trainer's evaluation mesh and samples: its programs, from the compilation cache
    args = ["--checkpoint", str(run_dir), "--mesh", "data=2,tensor=2@4:8", "--samples", "2"]
    assert evaluate.main([*args, "--output", str(out)]) == 0
    notes = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("note:")]
    report = json.loads(out.read_text())
    assert report["checkpoint"] == str(run_dir / "sft")
    assert "reward" not in report and "kl_to_ref" not in report, report
    assert report["num_samples"] == 4 * 2 and 0.0 <= report["gt_score"] <= 1.0
    why = {
        "kl_to_ref": "the run (stages sft) had no reference: reference/RoleConfig.init='tiny' is "
        "a random model",
        "reward": "the run (stages sft) had no reward model: reward/RoleConfig.init='stage:rm' "
        "names a stage the run did not have",
    }
    assert report["not_reported"] == why
    assert notes == [f"note: not reported: kl_to_ref, as {why['kl_to_ref']}; reward, as "
                     f"{why['reward']}"]  # fmt: skip


@pytest.mark.parametrize(
    "args, message",
    [
        (["--samples", "0"], "argument --samples: must be >= 1, got 0"),
        (["--samples", "-2"], "argument --samples: must be >= 1, got -2"),
        (["--num-prompts", "-1"], "argument --num-prompts: must be >= 0, got -1"),
    ],
)
def test_evaluate_refuses_counts_it_would_read_otherwise(args, message, tmp_path, capsys):
    """0 samples a prompt was taken as the run's own samples_per_prompt, -1 prompts as all but
    the last: refused, before any checkpoint is read."""
    with pytest.raises(SystemExit) as e:
        evaluate.main(["--checkpoint", str(tmp_path / "nowhere"), *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err[-1].endswith(message), err


def test_keep_checkpoints_zero_is_refused(colocated_run, tmp_path, capsys):
    rc = train.main(["--run-dir", str(tmp_path / "r"), "RLConfig.keep_checkpoints=0"])
    assert rc == 2 and "RLConfig.keep_checkpoints: must be >= 1" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_sft_killed_mid_stage_resumes_where_it_was(base_run, tmp_path, caplog):
    """Killed after SFT step 40 (checkpointed at 25), the stage resumes at 25: the same numbers
    as base_run's uninterrupted SFT, no metric step written twice."""
    run_dir = tmp_path / "sft"
    args = [
        "--run-dir", str(run_dir), "--quiet",
        "RunConfig.stages=('sft',)", "SFTConfig.steps=60", "SFTConfig.checkpoint_every=25",
        *SMALL,
    ]  # fmt: skip
    # Preempted in this process (the hook raises; a real exit: tests/e2e/test_trainer.py), whose
    # compiled step is base_run's SFT step.
    with pytest.MonkeyPatch.context() as mp:
        preempt_at_step(mp, "sft:40")
        with pytest.raises(Preempted):
            train.main(args)
    assert [r["step"] for r in metric_rows(run_dir, "sft")] == [25]
    assert train.main([*args, "--resume"]) == 0
    assert "resumed at step 25 of 60" in caplog.text
    ours, ref = metric_rows(run_dir, "sft"), metric_rows(base_run, "sft")
    drop = {"sft/steps_per_s"}
    assert [r["step"] for r in ours] == [25, 50, 60]
    assert_rows_close(
        [{k: v for k, v in r.items() if k not in drop} for r in ours],
        [{k: v for k, v in r.items() if k not in drop} for r in ref],
    )
    assert (run_dir / "sft" / "model.json").exists()
    assert not (run_dir / "sft_checkpoints").exists()  # superseded by the stage's output


def test_a_tokenizer_larger_than_the_model_is_refused_and_leaves_nothing(
    base_run, tmp_path, capsys
):
    from tokenizers import Tokenizer as HFTokenizer

    data = tmp_path / "data"
    files = SyntheticTask(seed=0).write_jsonl(data, num_prompts=32, num_heldout=16)
    tok = HFTokenizer.from_file(str(data / "tokenizer.json"))
    tok.add_tokens([f"extra{i}" for i in range(40)])
    tok.save(str(data / "tokenizer.json"))
    run_dir = tmp_path / "run"
    args = [
        "--run-dir", str(run_dir), "--quiet",
        "TaskConfig.name='files'", f"TaskConfig.prompts='{files['prompts']}'",
        f"TaskConfig.tokenizer='{data}'", *ppo_bindings(base_run),
    ]  # fmt: skip
    rc = train.main(args)
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err, err
    assert "RoleConfig.init" in err and "vocabulary of" in err and "TaskConfig.tokenizer" in err
    # Nothing was left behind, and --check, which builds the roles' models, refuses the same
    # command with the same line.
    assert not run_dir.exists()
    assert train.main(["--check", *args]) == 2
    assert capsys.readouterr().err.strip() == err


def test_non_utf8_jsonl_names_the_file_and_line(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(b'{"prompt_ids": [1, 2]}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=rf"{path}:2: not UTF-8 \(byte 0xe9"):
        load_prompts(path, None, max_prompt_len=8)


def test_planner_refuses_a_device_count_it_cannot_plan_for(capsys):
    from jrlhf.cli import plan

    rc = plan.main(["--config", "configs/ppo_tiny.gin", "--devices", "1000000000"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and "at most 65536 devices" in err


def test_one_run_at_a_time_in_a_run_directory(colocated_run, tmp_path, capsys):
    """A start or resume of a run directory another process holds is refused in one line naming
    it, before anything is written or removed; a killed holder leaves no stale lock."""
    me = f"on host {socket.gethostname()}"
    # Two new runs in one directory: the first has taken the lock, nothing else yet.
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    holder = hold_lock(fresh)
    try:
        rc = train.main(["--run-dir", str(fresh), "--quiet", *SMALL])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and "\n" not in err, err
        assert f"is in use by another run (pid {holder.pid} {me}" in err, err
        assert sorted(p.name for p in fresh.iterdir()) == [LOCK_FILE]  # the first run's, kept
        # A resume of a run another process holds.
        run_dir = _copy(colocated_run, tmp_path / "run")
        saved = {k: v for k, v in _snapshot(run_dir).items() if k != LOCK_FILE}
        holder2 = hold_lock(run_dir)
        try:
            rc = train.main(["--run-dir", str(run_dir), "--resume", "--quiet"])
            err = capsys.readouterr().err.strip()
            assert rc == 2 and "\n" not in err and f"(pid {holder2.pid} {me}" in err, err
            assert {k: v for k, v in _snapshot(run_dir).items() if k != LOCK_FILE} == saved
        finally:
            holder2.kill()
            holder2.wait()
            holder2.stdout.close()
    finally:
        holder.kill()  # as kill -9 would: no cleanup
        holder.wait()
        holder.stdout.close()
    # The kernel released the killed holders' locks: the directories are free again, and a
    # run releases its own lock when it ends.
    assert train.main(["--run-dir", str(run_dir), "--resume", "--quiet"]) == 0
    with lock_run_dir(run_dir), lock_run_dir(fresh):
        pass
    assert f"pid {os.getpid()} {me}" in (run_dir / LOCK_FILE).read_text()
    capsys.readouterr()


def test_a_start_in_an_unwritable_place_is_one_line(tmp_path, monkeypatch, capsys):
    """A run directory that cannot be created (under a file: ENOTDIR) or written (read-only:
    EROFS, injected, since root may write anywhere) is refused in one line naming the path."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    rc = train.main(["--run-dir", str(blocker / "run"), "--quiet", *SMALL])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err, err
    assert f"{blocker / 'run'}: Not a directory (ENOTDIR)" in err, err
    real_open = os.open

    def read_only(path, *args, **kwargs):
        if str(path).endswith(LOCK_FILE):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only)
    run_dir = tmp_path / "ro"
    run_dir.mkdir()
    rc = train.main(["--run-dir", str(run_dir), "--quiet", *SMALL])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err, err
    assert f"{run_dir / LOCK_FILE}: Read-only file system (EROFS)" in err, err


def test_a_full_disk_ends_the_run_in_one_line_after_its_last_checkpoint(
    base_run, colocated_run, tmp_path, monkeypatch, capsys, caplog
):
    """Storage faults at a synchronous write (metrics.jsonl, ENOSPC injected) and in Orbax's
    asynchronous checkpoint save (a real EFBIG from the kernel: the file size limit lowered
    for the save of iteration 4) each end the run with one line naming the path and the errno;
    the newest checkpoint listed is the last complete one, and --resume continues from it to
    the uninterrupted run's numbers."""
    run_dir = tmp_path / "run"
    args = ["--run-dir", str(run_dir), "--quiet", *ppo_bindings(base_run)]
    log = metrics_lib.MetricsLogger.log

    def full_at_three(self, step, metrics):
        if step == 3 and self.enabled:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))
        return log(self, step, metrics)

    with monkeypatch.context() as m:
        m.setattr(metrics_lib.MetricsLogger, "log", full_at_three)
        assert train.main(args) == 1
    err = capsys.readouterr().err.strip()
    metrics = run_dir / "logs" / "ppo" / "metrics.jsonl"
    assert "\n" not in err and f"{metrics}: No space left on device (ENOSPC)" in err, err
    assert checkpoint.latest_step_dir(run_dir).name == "2"

    # Iterations 3 and 4 again; the save of iteration 4 fails in Orbax's background thread.
    save = RLTrainer.save
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)

    def save_past_the_size_limit(self, loader_state):
        if self.iteration == 4:
            resource.setrlimit(resource.RLIMIT_FSIZE, (4096, limit[1]))
        save(self, loader_state)

    xfsz = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead
    try:
        with monkeypatch.context() as m:
            m.setattr(RLTrainer, "save", save_past_the_size_limit)
            assert train.main([*args, "--resume"]) == 1
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, xfsz)
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "File too large (EFBIG)" in err[0], err
    assert f"{run_dir / 'checkpoints'}/4" in err[0], err
    # Orbax logged the failure of each background write with a traceback: dropped.
    assert not [r for r in caplog.records if r.name == "absl" and r.levelno >= logging.ERROR]
    assert checkpoint.latest_step_dir(run_dir).name == "2"
    assert train.main([*args, "--resume"]) == 0
    assert checkpoint.latest_step_dir(run_dir).name == "4"
    assert_rows_close(metric_rows(run_dir), metric_rows(colocated_run))
    capsys.readouterr()


# TensorStore 0.1.86's error for a write to a full tmpfs (an Orbax save), as it was raised.
_TENSORSTORE_ENOSPC = (
    'RESOURCE_EXHAUSTED: Error writing "b/0" in OCDBT database at local file '
    '"/r/checkpoints/2.orbax-checkpoint-tmp/ocdbt.process_0/": Failed writing: '
    '"/r/checkpoints/2.orbax-checkpoint-tmp/ocdbt.process_0/d/6966d8": Failed to write 152711 '
    "bytes to file 4: No space left on device [os_error_code='28']"
)


def test_storage_faults_are_recognised_however_they_arrive(monkeypatch, caplog):
    written = "/r/checkpoints/2.orbax-checkpoint-tmp/ocdbt.process_0/d/6966d8"
    try:
        try:
            raise ValueError(_TENSORSTORE_ENOSPC)
        except ValueError as e:
            raise RuntimeError("background save failed") from e
    except RuntimeError as e:
        wrapped = e
    assert storage_fault(wrapped) == f"{written}: No space left on device (ENOSPC)"
    denied = OSError(errno.EACCES, os.strerror(errno.EACCES), "/r/x")
    assert storage_fault(ExceptionGroup("saves", [ValueError("x"), denied])) == (
        "/r/x: Permission denied (EACCES)"
    )
    for other in (ValueError("bad config"), FileNotFoundError(errno.ENOENT, "gone", "/r/y")):
        assert storage_fault(other) is None
    # What Orbax and TensorStore print on their threads about it is dropped, nothing else.
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u.exc_value))
    quiet_storage_noise()
    absl = logging.getLogger("absl")
    absl.error("save failed", exc_info=wrapped)
    absl.error("something else failed", exc_info=ValueError("other"))
    assert [r.getMessage() for r in caplog.records if r.name == "absl"] == ["something else failed"]
    fields = "exc_type exc_value exc_traceback err_msg object"
    Unraisable = collections.namedtuple("Unraisable", fields)
    closed, other = RuntimeError("Event loop is closed"), RuntimeError("other")
    for exc in (closed, other):
        sys.unraisablehook(Unraisable(RuntimeError, exc, None, None, None))
    assert seen == [other]


def test_convert_names_its_flag_and_a_storage_fault_in_one_line(
    colocated_run, tmp_path, monkeypatch, capsys
):
    """An export over a non-empty directory is refused naming --overwrite, before the model is
    loaded; one the storage refuses (a real EFBIG: the file size limit lowered) is one line
    naming the output directory and the errno, and leaves nothing where the export would be."""
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    args = ["--from", str(colocated_run / "checkpoints")]
    assert convert.main([*args, "--to-hf", str(taken)]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "pass --overwrite to replace it" in err, err
    assert [p.name for p in taken.iterdir()] == ["keep.txt"]
    out = tmp_path / "hf"
    save_hf, limit = hf.save_hf, resource.getrlimit(resource.RLIMIT_FSIZE)

    def save_hf_past_the_size_limit(*a, **k):
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, limit[1]))
        try:
            return save_hf(*a, **k)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, limit)

    monkeypatch.setattr(hf, "save_hf", save_hf_past_the_size_limit)
    xfsz = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead
    try:
        rc = convert.main([*args, "--to-hf", str(out)])
    finally:
        signal.signal(signal.SIGXFSZ, xfsz)
    err = capsys.readouterr().err.strip()
    assert rc == 1 and "\n" not in err, err
    assert f"cannot write {out}: File too large (EFBIG)" in err, err
    assert not out.exists() and not list(tmp_path.glob(".hf.*"))


def test_a_write_cut_short_names_its_file_and_leaves_the_previous_one(tmp_path, monkeypatch):
    """A write that fails part-way (a full disk) is reported with the file's path, and a start
    file a resume reads is left as it was, never half-written."""
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # as a write or flush raises it

    class FullDisk(io.StringIO):
        def flush(self):
            raise full

    logger = metrics_lib.MetricsLogger(tmp_path / "logs", use_tensorboard=False)
    logger._file.close()
    logger._file = FullDisk()
    with pytest.raises(OSError) as info:
        logger.log(1, {"x": 1.0})
    metrics = tmp_path / "logs" / "metrics.jsonl"
    assert storage_fault(info.value) == f"{metrics}: No space left on device (ENOSPC)"
    logger.close()

    path = tmp_path / OPERATIVE_CONFIG
    write_atomic(path, "RLConfig.iterations = 4\n")

    def half_then_full(self, text, *args, **kwargs):
        with open(self, "w") as f:
            f.write(text[: len(text) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(Path, "write_text", half_then_full)
    with pytest.raises(OSError) as info:
        write_atomic(path, "RLConfig.iterations = 8\n")
    assert storage_fault(info.value) == f"{path}: No space left on device (ENOSPC)"
    monkeypatch.undo()
    assert path.read_text() == "RLConfig.iterations = 4\n"
    assert [p.name for p in tmp_path.iterdir() if p.is_file()] == [OPERATIVE_CONFIG]


def test_a_storage_fault_in_a_save_is_the_only_line_on_stderr(base_run, tmp_path):
    """End to end, as a user runs it: the SFT stage's first checkpoint cannot be written (a real
    EFBIG); stderr holds the one line naming the file and the errno, and nothing else but log
    lines: no traceback from Orbax's threads, TensorStore's callbacks or the interpreter's exit.
    No checkpoint step is left listed."""
    run_dir = tmp_path / "run"
    args = [
        "--run-dir", str(run_dir), "--quiet", *SMALL,
        "RunConfig.stages=('sft',)", "SFTConfig.steps=20", "SFTConfig.checkpoint_every=10",
    ]  # fmt: skip
    # No file past 32 KiB can be written: EFBIG, as a full disk refuses a write, but for this
    # process alone (Python ignores SIGXFSZ, so the write fails instead of the process).
    limited = (
        "import resource, runpy, sys; "
        "resource.setrlimit(resource.RLIMIT_FSIZE, (32 * 1024, resource.RLIM_INFINITY)); "
        "sys.argv[0] = 'jrlhf.train'; runpy.run_module('jrlhf.train', run_name='__main__')"
    )
    env = dict(os.environ, JAX_DEFAULT_MATMUL_PRECISION="highest")
    out = subprocess.run(
        [sys.executable, "-c", limited, *args], env=env, capture_output=True, text=True, timeout=600
    )
    log_line = re.compile(r"\d{4}-\d\d-\d\d [\d:,]+ (INFO|WARNING) ")
    # JAX warns (2 lines) when a program it compiled cannot be added to its compilation cache,
    # which the limit applies to as well.
    cache = re.compile(r".*UserWarning: Error writing persistent compilation|\s+warnings\.warn")
    lines = [
        line
        for line in out.stderr.splitlines()
        if line.strip() and not log_line.match(line) and not cache.match(line)
    ]
    assert out.returncode == 1 and len(lines) == 1, out.stderr[-3000:]
    assert lines[0].startswith(f"error: cannot write {run_dir / 'sft_checkpoints'}/"), lines
    assert "File too large (EFBIG)" in lines[0], lines
    assert checkpoint.latest_step_dir(run_dir / "sft_checkpoints") is None


def test_evaluate_output_that_cannot_be_written_is_one_line_and_never_half_written(
    tmp_path, monkeypatch, capsys
):
    """evaluate --output on a storage that refuses the write part-way (a real EFBIG) or in a
    directory that does not exist: one line naming the path and the errno, exit status 1, and
    the previous report, or none, where it was: never a truncated one."""
    run_dir = tmp_path / "sft"
    bindings = ["RunConfig.stages=('sft',)", "SFTConfig.steps=2"]
    assert train.main(["--run-dir", str(run_dir), "--quiet", *bindings, *SMALL]) == 0
    out = tmp_path / "eval.json"
    out.write_text("the previous report\n")
    # test_trainer's evaluation mesh and samples: its programs, from the compilation cache
    args = ["--checkpoint", str(run_dir), "--mesh", "data=2,tensor=2@4:8", "--samples", "2"]
    capsys.readouterr()
    write_atomic = evaluate.write_atomic

    def write_past_64_bytes(*a, **k):
        with file_size_limit(64):
            return write_atomic(*a, **k)

    monkeypatch.setattr(evaluate, "write_atomic", write_past_64_bytes)
    assert evaluate.main([*args, "--output", str(out)]) == 1
    err = [ln for ln in capsys.readouterr().err.splitlines() if not ln.startswith("note:")]
    assert err == [f"error: cannot write --output {out}: File too large (EFBIG)"], err
    assert out.read_text() == "the previous report\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval.json", "sft"]
    monkeypatch.undo()
    nowhere = tmp_path / "missing" / "eval.json"
    assert evaluate.main([*args, "--output", str(nowhere)]) == 1
    err = [ln for ln in capsys.readouterr().err.splitlines() if not ln.startswith("note:")]
    assert err == [f"error: cannot write --output {nowhere}: No such file or directory (ENOENT)"]


def test_reads_a_failed_restore_abandoned_end_before_its_event_loop_closes():
    """Orbax runs a restore's reads as tasks of a loop of its own and closes it as soon as one
    fails; a read still in TensorStore's hands then completes into the closed loop ("Event
    loop is closed", printed from TensorStore's thread next to the one-line error). As the
    entry points set them up, loops let such reads end first."""
    policy = asyncio.get_event_loop_policy()
    settle_abandoned_tasks()
    late, reads, threads = [], [], []

    async def damaged():
        raise ValueError("damaged chunk")

    async def read_in_flight():
        # a read another thread completes a little later, as TensorStore's do
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def complete():
            time.sleep(0.2)
            try:
                loop.call_soon_threadsafe(done.set_result, b"chunk")
            except RuntimeError as e:
                late.append(e)

        threads.append(threading.Thread(target=complete))
        threads[0].start()
        reads.append(await done)

    async def restore():
        await asyncio.gather(read_in_flight(), damaged())

    try:
        loop = asyncio.new_event_loop()  # as orbax's asyncio_utils.run_sync does
        with pytest.raises(ValueError, match="damaged chunk"):
            try:
                loop.run_until_complete(restore())
            finally:
                loop.close()
    finally:
        asyncio.set_event_loop_policy(policy)
    threads[0].join()
    assert not late and reads == [b"chunk"]
