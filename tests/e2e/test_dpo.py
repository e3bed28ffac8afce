"""The DPO stage end to end from the shared SFT run, cut off mid-way and resumed: held-out
preference accuracy rises, the reference scores the pairs once per process, the output is a
model source; and its configuration errors are one line naming the field."""

import json

import pytest
from run_helpers import ROOT, SMALL, Preempted, metric_rows, preempt_at_step

from jrlhf.cli import evaluate, train
from jrlhf.config import load_config
from jrlhf.pipeline import evaluate as pipeline_evaluate
from jrlhf.pipeline import supervised
from jrlhf.runtime.model_source import resolve_model, stage_start

PAIRS, HELDOUT = 512, 128


def dpo_args(base_run, run_dir, *extra):
    return [
        "--run-dir", str(run_dir), "--quiet", "--config", str(ROOT / "configs" / "dpo_tiny.gin"),
        "RunConfig.stages=('dpo',)", f"actor/RoleConfig.init='ckpt:{base_run}/sft'",
        f"TaskConfig.num_preference_pairs={PAIRS}", f"TaskConfig.num_heldout_pairs={HELDOUT}",
        "TaskConfig.num_sft_examples=1",  # no SFT here: not worth drawing
        "DPOConfig.steps=30", "DPOConfig.checkpoint_every=15", *SMALL, *extra,
    ]  # fmt: skip


def counting_reference(monkeypatch):
    """Every reference pass the stage makes, as the number of pairs it scored."""
    calls = []
    real = supervised.reference_logprobs

    def counted(scorer, reference, pairs, seed):
        calls.append(len(pairs))
        return real(scorer, reference, pairs, seed)

    monkeypatch.setattr(supervised, "reference_logprobs", counted)
    return calls


@pytest.fixture(scope="module")
def dpo_run(base_run, tmp_path_factory):
    """30 DPO steps from base_run's SFT policy, which is also the reference: cut off after step
    16 (checkpointed at 15), then resumed to the end. Returns the run directory, the pairs each
    reference pass of the resumed process scored, and its stderr."""
    run_dir = tmp_path_factory.mktemp("dpo") / "run"
    with pytest.MonkeyPatch.context() as mp:
        preempt_at_step(mp, "dpo:16")
        with pytest.raises(Preempted):
            train.main(dpo_args(base_run, run_dir))
    with pytest.MonkeyPatch.context() as mp:
        calls = counting_reference(mp)
        assert train.main(["--run-dir", str(run_dir), "--resume", "--quiet"]) == 0
    return run_dir, calls


def test_dpo_raises_held_out_preference_accuracy(dpo_run):
    run_dir, calls = dpo_run
    # The resumed process's one pass of the reference over every pair, training and held-out.
    assert calls == [PAIRS + HELDOUT]
    summary = json.loads((run_dir / "dpo_summary.json").read_text())
    before, after = summary["before"], summary["after"]
    assert summary["split"] == "held-out" and after["pairs"] == HELDOUT
    # The policy starts as its reference: every implicit-reward margin is 0 (ties count wrong).
    assert before["accuracy"] == 0.0 and before["reward_margin"] == 0.0
    assert after["logp_accuracy"] > before["logp_accuracy"] + 0.1, summary
    assert after["accuracy"] > 0.7 and after["loss"] < before["loss"], summary
    # Resumed at step 15: the held-out 'before' (step 0) was not evaluated again, no step was
    # logged twice.
    rows = metric_rows(run_dir, "dpo")
    assert [r["step"] for r in rows] == [0, 25, 30, 30]
    assert rows[0]["eval/heldout_logp_accuracy"] == before["logp_accuracy"]
    assert rows[-1]["eval/heldout_accuracy"] == after["accuracy"]
    assert (run_dir / "dpo" / "model.json").exists()
    assert not (run_dir / "dpo_checkpoints").exists()  # superseded by the stage's output


def test_dpo_output_is_a_model_source(dpo_run):
    run_dir, _ = dpo_run
    cfg = load_config([], ["RunConfig.stages=('ppo',)", "actor/RoleConfig.init='stage:dpo'"])
    assert resolve_model(cfg, "actor", {}, run_dir).weights == f"ckpt:{run_dir / 'dpo'}"
    # SFT -> DPO -> PPO with the actor's init the DPO output: SFT starts fresh, DPO from SFT's
    # output, PPO from DPO's; before any stage has run the actor resolves to SFT's start.
    cfg = load_config(
        [], ["RunConfig.stages=('sft', 'dpo', 'ppo')", "actor/RoleConfig.init='stage:dpo'"]
    )
    assert [stage_start(cfg, s) for s in ("sft", "dpo")] == ["tiny", "stage:sft"]
    assert resolve_model(cfg, "actor", {}).weights is None


def test_evaluate_a_dpo_run_against_its_own_reference_and_no_random_reward(
    dpo_run, base_run, tmp_path, capsys, monkeypatch
):
    """evaluate on a DPO run scores its final policy (the run directory means the DPO output)
    against the reference DPO had (the policy's start: base_run's SFT policy), not the random
    ``tiny`` reference role, and reports no reward: the run had no reward model, only a random
    one would score it (the one-line note says so)."""
    run_dir, _ = dpo_run
    loaded = []
    real = pipeline_evaluate.frozen_infer

    def recording(source, *args, **kwargs):
        loaded.append(source.weights)
        return real(source, *args, **kwargs)

    monkeypatch.setattr(pipeline_evaluate, "frozen_infer", recording)
    out = tmp_path / "eval.json"
    args = ["--checkpoint", str(run_dir), "--mesh", "data=2,tensor=2@4:8", "--samples", "2"]
    assert evaluate.main([*args, "--output", str(out)]) == 0
    notes = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("note:")]
    report = json.loads(out.read_text())
    assert report["checkpoint"] == str(run_dir / "dpo")
    assert loaded == [f"ckpt:{base_run}/sft"]  # the reference only, and DPO's
    assert "reward" not in report and report["kl_to_ref"] > 0, report
    why = "the run (stages dpo) had no reward model: reward/RoleConfig.init='tiny' is a random"
    why += " model"
    assert report["not_reported"] == {"reward": why}
    assert notes == [f"note: not reported: reward, as {why}"]


@pytest.mark.parametrize(
    "binding,message",
    [
        ("DPOConfig.beta=0", "DPOConfig.beta: must be > 0"),
        ("DPOConfig.loss_type='kto'", "DPOConfig.loss_type: unknown loss type 'kto'"),
        ("DPOConfig.steps=0", "DPOConfig.steps: must be >= 1"),
        ("DPOConfig.label_smoothing=0.5", "DPOConfig.label_smoothing: must be in [0, 0.5)"),
        (
            "DPOConfig.label_smoothing=0.1 DPOConfig.loss_type='ipo'",
            "DPOConfig.label_smoothing: applies to loss_type 'sigmoid' only",
        ),
        ("DPOConfig.reference='stage:rm'", "DPOConfig.reference: 'stage:rm'"),
        ("DPOConfig.infer_batch_size=0", "DPOConfig.infer_batch_size: must be >= 1"),
        (
            "actor/RoleConfig.microbatches=3",
            "DPOConfig.batch_size: 32 pairs do not split into actor/RoleConfig.microbatches=3",
        ),
        ("actor/RoleConfig.init='stage:ppo'", "actor/RoleConfig.init: 'stage:ppo': use one of"),
        ("DPOConfig.batch_size=2.5", "DPOConfig.batch_size: expects an int"),
    ],
)
def test_dpo_config_errors_are_one_line_naming_the_field(binding, message, tmp_path, capsys):
    config = str(ROOT / "configs" / "dpo_tiny.gin")
    args = ["--check", "--run-dir", str(tmp_path / "r"), "--config", config]
    rc = train.main([*args, *binding.split(" ")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and message in err and "\n" not in err, err
