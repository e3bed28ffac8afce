"""Never lose a run: divergence caught before anything non-finite is saved, a resume that takes
its configuration from the run directory, fallback from a damaged checkpoint, supervised stages
that resume mid-stage, and bad input reported in one line before any work."""

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from run_helpers import (
    SMALL,
    assert_rows_close,
    metric_rows,
    ppo_bindings,
    train_subprocess,
)

from jrlhf import checkpoint
from jrlhf.cli import evaluate, train
from jrlhf.data import load_prompts
from jrlhf.meshes import make_mesh
from jrlhf.pipeline.run_dir import OPERATIVE_CONFIG
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
        assert json.loads(out.read_text())["num_samples"] == 32
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
    assert train.main(["--run-dir", str(run_dir), "--quiet", *bindings, *SMALL]) == 0
    capsys.readouterr()
    out = tmp_path / "eval.json"
    # test_trainer's evaluation mesh and samples: its programs, from the compilation cache
    args = ["--checkpoint", str(run_dir), "--mesh", "data=2,tensor=2@4:8", "--samples", "2"]
    assert evaluate.main([*args, "--output", str(out)]) == 0
    notes = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("note:")]
    report = json.loads(out.read_text())
    assert report["checkpoint"] == str(run_dir / "sft")
    assert "reward" not in report and "kl_to_ref" not in report, report
    assert report["num_samples"] == 32 and 0.0 <= report["gt_score"] <= 1.0
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
    killed = train_subprocess(args, {"JRLHF_DEBUG_EXIT_AT_STEP": "sft:40"})
    assert killed.returncode == 137, killed.stderr[-2000:]
    assert [r["step"] for r in metric_rows(run_dir, "sft")] == [25]
    # The resume runs in this process (its compiled step is base_run's SFT step).
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
    # Nothing was left behind: the same command is not refused as "already holds a run".
    assert not run_dir.exists()
    assert train.main(["--check", *args]) == 0


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
