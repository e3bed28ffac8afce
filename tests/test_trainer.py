"""The trainer end to end on the synthetic task: placements, exact resume, GRPO, CLIs, configs."""

import json

import numpy as np
import pytest
from run_helpers import (
    ROOT,
    SMALL,
    assert_rows_close,
    metric_rows,
    ppo_bindings,
    train_subprocess,
)

from jrlhf import checkpoint, config
from jrlhf.cli import train


def test_colocated_run_outputs(colocated_run):
    rows = metric_rows(colocated_run)
    assert [r["step"] for r in rows[:4]] == [1, 2, 3, 4]
    summary = json.loads((colocated_run / "summary.json").read_text())
    assert {"gt_score", "kl_to_ref", "reward"} <= set(summary["after"])
    assert (colocated_run / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "RLConfig.iterations = 4" in (colocated_run / "operative_config.gin").read_text()
    assert checkpoint.latest_step_dir(colocated_run).name == "4"


@pytest.mark.parametrize("placement", ["separate", "interleave", "search", "flatten"])
def test_every_plan_gives_the_same_metrics(placement, base_run, colocated_run, tmp_path):
    """Flatten (the colocated run), separate, interleave and the searched plan: same seed, same
    numbers. The second flatten run scores in chunks of 8 rows (RLConfig.infer_batch_size)."""
    run_dir = tmp_path / placement
    extra = ["RLConfig.infer_batch_size=8"] if placement == "flatten" else []
    bindings = ppo_bindings(base_run, f"RunConfig.placement='{placement}'", *extra)
    assert train.main(["--run-dir", str(run_dir), "--quiet", *bindings]) == 0
    plan_text = (run_dir / "plan.gin").read_text()
    if placement == "search":  # the estimator's choice for this machine, whichever it is
        assert "execution plan '" in plan_text and "(search)" in plan_text
    else:
        assert f"execution plan '{placement}'" in plan_text
    assert_rows_close(metric_rows(run_dir), metric_rows(colocated_run))


def test_killed_run_resumes_exactly(base_run, colocated_run, tmp_path):
    run_dir = tmp_path / "killed"
    args = ["--run-dir", str(run_dir), "--quiet", *ppo_bindings(base_run)]
    # Saved synchronously, step 2 is on disk before iteration 3 starts. An asynchronous save could
    # still be committing when the process dies 1.5 iterations later (seen with warm compilation
    # caches on a loaded machine). The resumed run saves asynchronously, like the colocated run.
    sync = "RLConfig.async_checkpoint=False"
    killed = train_subprocess([*args, sync], {"JRLHF_DEBUG_EXIT_AT_ITERATION": "3"})
    assert killed.returncode == 137, killed.stderr[-2000:]
    assert checkpoint.latest_step_dir(run_dir).name == "2"
    # A save that was cut off mid-write (Orbax's temporary directory) is never taken as a step.
    partial = run_dir / "checkpoints" / "3.orbax-checkpoint-tmp-123"
    (partial / "actor_params").mkdir(parents=True)
    assert checkpoint.latest_step_dir(run_dir).name == "2"
    resumed = train_subprocess([*args, "--resume"])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert_rows_close(metric_rows(run_dir), metric_rows(colocated_run), rtol=1e-5, atol=1e-6)


def test_grpo_with_verifiable_reward_improves(base_run, tmp_path):
    run_dir = tmp_path / "grpo"
    bindings = [
        "RunConfig.stages=('grpo',)",
        f"actor/RoleConfig.init='ckpt:{base_run}/sft'",
        f"reference/RoleConfig.init='ckpt:{base_run}/sft'",
        "actor/RoleConfig.learning_rate=1e-3",
        "TaskConfig.reward_fn='synthetic_ground_truth'",
        "RLConfig.iterations=12",
        "RLConfig.samples_per_prompt=4",
        "RLConfig.kl_coef=0.01",
        "RLConfig.kl_estimator='k3'",
        *SMALL,
    ]
    assert train.main(["--run-dir", str(run_dir), "--quiet", *bindings]) == 0
    rewards = [r["reward"] for r in metric_rows(run_dir, "grpo") if "reward" in r]
    assert len(rewards) == 12
    first, last = np.mean(rewards[:3]), np.mean(rewards[-3:])
    assert last > first + 0.1, rewards
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["after"]["gt_score"] > summary["before"]["gt_score"]


@pytest.mark.parametrize(
    "extra",
    [
        ["RLConfig.advantage_estimator='rloo'"],
        ["RLConfig.policy_loss='gspo'", "RLConfig.loss_agg='seq-mean-token-mean'",
         "RLConfig.clip_eps=3e-3", "RLConfig.advantage_estimator='drgrpo'"],
    ],
    ids=["rloo", "gspo-drgrpo"],
)  # fmt: skip
def test_grpo_stage_runs_the_registered_algorithms(extra, base_run, tmp_path):
    """A few GRPO-stage iterations with RLOO advantages and with the GSPO loss: the trainer
    reaches them through RLConfig, and every metric stays finite."""
    run_dir = tmp_path / "run"
    bindings = [
        "RunConfig.stages=('grpo',)",
        f"actor/RoleConfig.init='ckpt:{base_run}/sft'",
        f"reference/RoleConfig.init='ckpt:{base_run}/sft'",
        # The shapes and learning rate of the GRPO run above, so its compiled programs are reused.
        "actor/RoleConfig.learning_rate=1e-3",
        "TaskConfig.reward_fn='synthetic_ground_truth'",
        "RLConfig.iterations=2",
        "RLConfig.samples_per_prompt=4",
        *SMALL,
        *extra,
    ]
    assert train.main(["--run-dir", str(run_dir), "--quiet", *bindings]) == 0
    rows = [r for r in metric_rows(run_dir, "grpo") if "reward" in r]
    assert len(rows) == 2
    for row in rows:
        assert {"train/policy_loss", "train/kl_loss", "train/clipfrac", "kl_token_mean"} <= set(row)
        for k, v in row.items():
            assert np.isfinite(v), (k, v)


def test_evaluate_on_another_mesh_and_export(colocated_run, tmp_path, capsys):
    from jrlhf.cli import convert, evaluate

    rc = evaluate.main(
        ["--checkpoint", str(colocated_run / "checkpoints"), "--mesh", "data=2,tensor=2@4:8",
         "--samples", "2", "--output", str(tmp_path / "eval.json")]
    )  # fmt: skip
    assert rc == 0
    report = json.loads((tmp_path / "eval.json").read_text())
    assert 0.0 <= report["gt_score"] <= 1.0 and report["num_samples"] == 32
    out = tmp_path / "hf"
    assert convert.main(["--from", str(colocated_run), "--to-hf", str(out)]) == 0
    assert (out / "tokenizer.json").exists()

    import jax
    import torch
    import transformers as tf

    from jrlhf.meshes import make_mesh

    model, params = checkpoint.load_model(colocated_run, make_mesh("fsdp=1"), "fsdp_tp")
    tokens = np.random.default_rng(0).integers(0, model.config.vocab_size, (2, 12))
    ours = np.asarray(jax.jit(model.apply)(params, tokens))
    hf_model = tf.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf_model(torch.tensor(tokens)).logits.numpy()
    assert np.abs(ours - ref).max() < 1e-4


@pytest.mark.parametrize(
    "binding,message",
    [
        ("RLConfig.bogus=1", "RLConfig' doesn't have a parameter named 'bogus'"),
        ("NoSuchThing.x=1", "No configurable matching 'NoSuchThing'"),
        ("RunConfig.stages=('sft','kto')", "unknown stage 'kto'"),
        ("actor/RoleConfig.train_mesh='fsdp:2'", "actor/RoleConfig.train_mesh"),
        ("RLConfig.minibatch_size=7", "RLConfig.minibatch_size: 7 does not divide"),
        ("actor/RoleConfig.train_rules='nope'", "unknown rule set 'nope'"),
    ],
)
def test_bad_config_fails_at_startup_with_one_line(binding, message, tmp_path, capsys):
    rc = train.main(["--run-dir", str(tmp_path / "r"), binding])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert message in err and "\n" not in err
    assert not (tmp_path / "r").exists()  # nothing was created before the config was valid


def test_existing_run_is_not_clobbered(colocated_run, capsys):
    before = sorted(p.name for p in colocated_run.iterdir())
    assert train.main(["--run-dir", str(colocated_run), "--quiet"]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert sorted(p.name for p in colocated_run.iterdir()) == before


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.gin")), ids=lambda p: p.name)
def test_every_config_file_loads(path, monkeypatch):
    monkeypatch.chdir(ROOT)
    cfg = config.load_config([str(path)], [])
    assert cfg.run.stages


def test_indivisible_mesh_fails_before_training(base_run, tmp_path, capsys):
    bindings = ppo_bindings(base_run, "actor/RoleConfig.train_mesh='tensor=8'")
    assert train.main(["--run-dir", str(tmp_path / "r"), "--quiet", *bindings]) == 2
    err = capsys.readouterr().err.strip()
    assert "not divisible by mesh axis 'tensor'" in err and "\n" not in err


def test_training_from_jsonl_files_with_a_tokenizer(tmp_path, capsys):
    from jrlhf.tasks import SyntheticTask

    files = SyntheticTask(seed=0).write_jsonl(
        tmp_path / "data", num_prompts=64, num_heldout=16, num_sft=64, num_pairs=64
    )
    common = [
        "TaskConfig.name='files'",
        f"TaskConfig.prompts='{files['prompts']}'",
        f"TaskConfig.heldout_prompts='{files['heldout_prompts']}'",
        f"TaskConfig.sft_data='{files['sft']}'",
        f"TaskConfig.preference_data='{files['preferences']}'",
        f"TaskConfig.tokenizer='{tmp_path / 'data'}'",
        "RunConfig.stages=('sft', 'rm')",
        "SFTConfig.steps=3",
        "RewardModelConfig.steps=3",
        *SMALL,
    ]
    run_dir = tmp_path / "run"
    assert train.main(["--run-dir", str(run_dir), "--quiet", *common]) == 0
    assert (run_dir / "sft" / "model.json").exists() and (run_dir / "rm" / "model.json").exists()
    assert (run_dir / "tokenizer.json").exists()
    # A malformed line is reported with its file and line number before anything is trained.
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "<bos> a0 a1 ="}\n{"prompt": \n')
    bindings = [b for b in common if not b.startswith("TaskConfig.prompts=")]
    rc = train.main(
        [
            "--run-dir",
            str(tmp_path / "bad_run"),
            "--quiet",
            f"TaskConfig.prompts='{bad}'",
            *bindings,
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert rc == 2 and f"{bad}:2" in err
    assert not (tmp_path / "bad_run" / "sft").exists()


def test_evaluate_cli_reports_the_in_run_held_out_score(colocated_run, tmp_path):
    """One rollout path: `python -m jrlhf.evaluate` on the final checkpoint, on the actor's
    generation mesh, reports the numbers the run itself reported after training."""
    from jrlhf.cli import evaluate

    plan = (colocated_run / "plan.gin").read_text()
    gen_mesh = plan.split("actor/RoleConfig.generate_mesh = '")[1].split("'")[0]
    out = tmp_path / "eval.json"
    args = ["--checkpoint", str(colocated_run), "--mesh", gen_mesh, "--output", str(out)]
    assert evaluate.main(args) == 0
    report = json.loads(out.read_text())
    after = json.loads((colocated_run / "summary.json").read_text())["after"]
    assert report["num_samples"] == after["num_samples"]
    for key in ("gt_score", "reward", "kl_to_ref", "response_len"):
        np.testing.assert_allclose(report[key], after[key], rtol=1e-4, atol=1e-5, err_msg=key)
