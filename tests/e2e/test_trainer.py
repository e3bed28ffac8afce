"""The trainer end to end on the synthetic task: placements, exact resume, GRPO, CLIs, configs."""

import gc
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


def test_colocated_run_outputs(colocated_run, base_run):
    # The base run's reward model trained in micro-batches of 4 rows (2 pairs) a device
    # (RoleConfig.microbatch_tokens=88, rows of 22 tokens) and learned to rank the pairs.
    rm = [json.loads(line) for line in (base_run / "logs" / "rm" / "metrics.jsonl").open()]
    assert {r["rm/microbatches"] for r in rm} == {4.0} and "rm/weight" not in rm[-1]
    assert np.mean([r["rm/accuracy"] for r in rm]) > 0.6  # on its training pairs; chance 0.5
    rows = metric_rows(colocated_run)
    assert [r["step"] for r in rows[:4]] == [1, 2, 3, 4]
    # the longest response of each rollout: at least the mean, at most the task's limit (12)
    for r in rows[:4]:
        assert r["response_len"] <= r["response_len_max"] <= 12
    summary = json.loads((colocated_run / "summary.json").read_text())
    assert {"gt_score", "kl_to_ref", "reward"} <= set(summary["after"])
    assert (colocated_run / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "RLConfig.iterations = 4" in (colocated_run / "operative_config.gin").read_text()
    assert checkpoint.latest_step_dir(colocated_run).name == "4"


SPLITS = ("train/microbatches", "train/critic/microbatches")


@pytest.mark.parametrize("placement", ["separate", "interleave", "search"])
def test_every_plan_gives_the_same_metrics(placement, base_run, colocated_run, tmp_path):
    """Flatten (the colocated run), separate, interleave and the searched plan: same seed, same
    numbers. The searched plan's run also scores in chunks of 8 rows
    (Memory.infer_batch_size), and the separated one fuses scoring into generation in calls of
    4 rows (Fusion.enabled) and migrates its last 4 decoding rows onto one of the generation
    mesh's replicas (Fusion.migrate_rows), which must not change a number either. The
    interleaved one trains actor and critic in micro-batches sized by tokens
    (RoleConfig.microbatch_tokens: one 22-token row per device), likewise."""
    run_dir = tmp_path / placement
    budget = "RoleConfig.microbatch_tokens=22"  # TaskConfig.max_prompt_len + max_response_len
    extra = {
        "interleave": [f"actor/{budget}", f"critic/{budget}"],
        "search": ["Memory.infer_batch_size=8"],
        "separate": [
            "Fusion.enabled=True", "Fusion.score_rows=4", "Fusion.migrate_rows=4",
            "DecodeConfig.chunk_steps=2",  # rows finish in several chunks: a tail to migrate
        ],
    }.get(placement, [])  # fmt: skip
    bindings = ppo_bindings(base_run, f"RunConfig.placement='{placement}'", *extra)
    assert train.main(["--run-dir", str(run_dir), "--quiet", *bindings]) == 0
    plan_text = (run_dir / "plan.gin").read_text()
    if placement == "search":  # the estimator's choice for this machine, whichever it is
        assert "execution plan '" in plan_text and "(search)" in plan_text
    else:
        assert f"execution plan '{placement}'" in plan_text
    rows = metric_rows(run_dir)
    # what a fused run counts of its fusion and a budgeted one of its splits: in theirs alone
    assert_rows_close(rows, metric_rows(colocated_run), only_in_a=("fusion/", *SPLITS))
    if placement == "interleave":  # minibatches of 16 rows, one row a device: 16 / shards
        for key in SPLITS:
            splits = [r[key] for r in rows if "reward" in r]
            assert len(splits) == 4 and min(splits) > 1, (key, splits)
    if placement == "separate":  # the fused rollouts did migrate their tails
        migrated = [r["fusion/migrated_rows"] for r in rows if "reward" in r]
        assert len(migrated) == 4 and 0 < max(migrated) <= 4, migrated


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
    # The resume runs in this process (its compiled steps are the colocated run's).
    assert train.main([*args, "--resume"]) == 0
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
        ["RLConfig.advantage_estimator='rloo'", "OffPolicy.correction='tis'"],
        ["RLConfig.policy_loss='gspo'", "RLConfig.loss_agg='seq-mean-token-mean'",
         "RLConfig.clip_eps=3e-3", "RLConfig.advantage_estimator='drgrpo'"],
    ],
    ids=["rloo-tis", "gspo-drgrpo"],
)  # fmt: skip
def test_grpo_stage_runs_the_registered_algorithms(extra, base_run, tmp_path):
    """A few GRPO-stage iterations with RLOO advantages (and the truncated-IS correction) and
    with the GSPO loss: the trainer reaches them through RLConfig, and every metric stays
    finite. Synchronous generation samples from the policy the update starts from, so the
    recomputed proximal log-probs equal the generation's up to float rounding: no mismatch, no
    weight capped."""
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
        if "OffPolicy.correction='tis'" in extra:
            assert row["offpolicy/mismatch_abs"] < 1e-4 and row["offpolicy/is_clipfrac"] == 0
            assert abs(row["offpolicy/is_weight_mean"] - 1) < 1e-4
        else:
            assert not any(k.startswith("offpolicy/") for k in row)


def test_grpo_without_kl_skips_the_reference_and_matches_the_run_with_it(
    base_run, tmp_path, monkeypatch, capsys, freezers
):
    """With RLConfig.kl_coef=0 the reference reaches no loss: it is not built or scored, no KL
    metric is reported, and rewards and updates are bit-identical to a run that scores it.
    The first run freezes the objects of its first iteration for Python's collector
    (RunConfig.gc_freeze, jrlhf.runtime.gc_freeze) and the second does not; neither changes a
    number."""
    from jrlhf.ppo import core_algos, trainer

    built = []
    frozen_infer = trainer.frozen_infer

    def counting_frozen_infer(*args, **kwargs):
        built.append(args[0])  # GRPO with a Python reward: the reference is the only frozen role
        return frozen_infer(*args, **kwargs)

    monkeypatch.setattr(trainer, "frozen_infer", counting_frozen_infer)
    bindings = [
        "RunConfig.stages=('grpo',)",
        f"actor/RoleConfig.init='ckpt:{base_run}/sft'",
        f"reference/RoleConfig.init='ckpt:{base_run}/sft'",
        "actor/RoleConfig.learning_rate=1e-3",
        "TaskConfig.reward_fn='synthetic_ground_truth'",
        "RLConfig.iterations=1",  # the held-out evaluation after it samples the updated policy
        "RLConfig.samples_per_prompt=4",
        "RLConfig.kl_coef=0.0",
        *SMALL,
    ]
    skipped = tmp_path / "skipped"
    assert train.main(["--run-dir", str(skipped), "--quiet", *bindings]) == 0
    assert built == []
    (freezer,) = freezers
    assert freezer.froze > 0 and freezer.released
    assert "KL to reference" not in capsys.readouterr().out
    assert "kl_to_ref" not in json.loads((skipped / "summary.json").read_text())["after"]

    with monkeypatch.context() as m:  # today's behaviour: the reference is scored regardless
        m.setattr(core_algos, "uses_reference", lambda rl: True)
        scored = tmp_path / "scored"
        unfrozen = [*bindings, "RunConfig.gc_freeze=False"]
        assert train.main(["--run-dir", str(scored), "--quiet", *unfrozen]) == 0
    assert len(built) == 1
    assert freezers[1].froze == 0 and gc.get_freeze_count() == 0

    reference_kl = {"kl", "kl_token_mean", "train/kl_loss", "train/kl_clampfrac", "eval/kl_to_ref"}
    rows, reference_rows = metric_rows(skipped, "grpo"), metric_rows(scored, "grpo")
    assert {"kl", "train/kl_loss", "eval/kl_to_ref"} <= {k for r in reference_rows for k in r}
    # exact, not close
    assert rows == [{k: v for k, v in r.items() if k not in reference_kl} for r in reference_rows]
    assert len(rows) == 2 and rows[0]["kl_coef"] == 0.0 and "eval/gt_score" in rows[1]


def test_dynamic_sampling_trains_full_batches_of_groups_with_signal(
    base_run, tmp_path, monkeypatch
):
    """DAPO's dynamic sampling: groups of equal scores are dropped and the loader's next prompts
    generated until 16 groups with signal are there, for at most 2 rounds, then dropped groups
    fill up; the update always gets the compiled 16 x 4 rows."""
    from jrlhf.ppo.update import Update

    batches = []
    step = Update.step

    def recording_step(self, arrays, kl_coef, iteration):
        batches.append({k: arrays[k].copy() for k in ("mask", "train_scores", "advantages")})
        return step(self, arrays, kl_coef, iteration)

    monkeypatch.setattr(Update, "step", recording_step)
    run_dir = tmp_path / "dapo"
    bindings = [
        "RunConfig.stages=('grpo',)",
        f"actor/RoleConfig.init='ckpt:{base_run}/sft'",
        f"reference/RoleConfig.init='ckpt:{base_run}/sft'",
        "actor/RoleConfig.learning_rate=1e-3",
        "TaskConfig.reward_fn='run_helpers:parity_reward'",  # no signal for about half
        "RLConfig.iterations=1",
        "RLConfig.samples_per_prompt=4",
        "SampleFilters.dynamic_sampling=True",
        "SampleFilters.max_sampling_rounds=2",
        *SMALL,
    ]
    assert train.main(["--run-dir", str(run_dir), "--quiet", *bindings]) == 0
    rows = [r for r in metric_rows(run_dir, "grpo") if "reward" in r]
    assert len(rows) == len(batches) == 1
    for row, batch in zip(rows, batches):
        assert len(batch["mask"]) == 16 * 4
        # Half the prompts have no signal, so one round never finds 16 groups.
        assert row["sampling/rounds"] == 2 and row["sampling/groups_dropped"] > 0, row
        assert row["sampling/groups_kept"] + row["sampling/groups_dropped"] == 32
        # Groups with signal first, then fillers (equal scores, zero advantage).
        signal = np.ptp(batch["train_scores"].reshape(16, 4), axis=1) > 0
        kept = 16 - int(row["sampling/filler_groups"])
        assert kept == min(16, row["sampling/groups_kept"])
        assert signal[:kept].all() and not signal[kept:].any()
        assert not batch["advantages"].reshape(16, -1)[kept:].any()
    # The saved loader position counts every batch the rounds drew: a resume draws what follows.
    assert checkpoint.read_trainer_meta(run_dir)["loader"]["index"] == 2 * 16


def test_evaluate_on_another_mesh_and_export(colocated_run, tmp_path, capsys):
    from jrlhf.cli import convert, evaluate

    rc = evaluate.main(
        ["--checkpoint", str(colocated_run / "checkpoints"), "--mesh", "data=2,tensor=2@4:8",
         "--samples", "2", "--output", str(tmp_path / "eval.json")]
    )  # fmt: skip
    assert rc == 0
    report = json.loads((tmp_path / "eval.json").read_text())
    # the run's 4 held-out prompts (run_helpers.ppo_bindings), 2 samples each
    assert 0.0 <= report["gt_score"] <= 1.0 and report["num_samples"] == 4 * 2
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


@pytest.mark.parametrize(
    "path", sorted((ROOT / "configs" / "algorithms").glob("*.gin")), ids=lambda p: p.stem
)
def test_every_algorithm_fragment_loads_on_the_arithmetic_config(path, monkeypatch):
    """The fragments docs/guide.md's algorithm table names, each on the config they are for."""
    monkeypatch.chdir(ROOT)
    cfg = config.load_config(["configs/arithmetic_grpo.gin", str(path)], [])
    assert cfg.run.stages == ("sft", "grpo") and cfg.task.name == "arithmetic"


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
