"""Reward functions from user code, named by import path (``TaskConfig.reward_fn='mod:fn'``):
batch and per-sample forms, reference answers from the prompt records, and errors that name the
sample at fault."""

import json
import textwrap

import numpy as np
import pytest
from run_helpers import SMALL, metric_rows

from jrlhf.cli import train
from jrlhf.data import write_jsonl
from jrlhf.tasks import BatchReward, RewardBatch, RewardError, SyntheticTask, get_reward_fn

USER_MODULE = '''
import json, math, os

def first_letter(batch):
    """Batch form: the share of response words starting with the record's answer letter."""
    with open(os.environ["USER_REWARD_LOG"], "a") as f:
        f.write(json.dumps({"n": len(batch), "answers": [m["answer"] for m in batch.meta],
                            "prompt": batch.prompts[0], "response": batch.responses[0],
                            "ids": list(batch.response_ids[0])}) + "\\n")
    out = []
    for text, meta in zip(batch.responses, batch.meta):
        words = text.split()
        out.append(sum(w.startswith(meta["answer"]) for w in words) / max(len(words), 1))
    return out

def breaks_on_a(batch):
    """Raises for any response holding an 'a' symbol."""
    for text in batch.responses:
        if "a" in text:
            raise KeyError("no a allowed")
    return [0.0] * len(batch)

def nan_for_long(prompt_ids, response_ids, meta):
    return math.nan if len(response_ids) > 3 else 1.0
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    name = f"user_rewards_{tmp_path.name}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("USER_REWARD_LOG", str(tmp_path / "calls.jsonl"))
    return name


def _batch(responses, answers=None):
    prompts = [[1, 7, 8, 4]] * len(responses)
    meta = [{"answer": a} for a in (answers or ["x"] * len(responses))]
    return RewardBatch(prompts, responses, meta, decode=lambda ids: " ".join(f"t{i}" for i in ids))


def test_batch_and_per_sample_forms_and_errors_naming_the_sample(user_module):
    first = BatchReward(get_reward_fn(f"{user_module}:first_letter"), "first_letter")
    assert first.batched
    scores = first(_batch([[1, 2], [3]], answers=["t1", "t9"]))
    np.testing.assert_allclose(scores, [0.5, 0.0])
    # A batch function that raises is retried sample by sample to name the culprit.
    breaks = BatchReward(get_reward_fn(f"{user_module}:breaks_on_a"), "breaks_on_a")
    batch = RewardBatch(
        [[1], [1], [1]], [[2], [3], [4]], [{}] * 3, decode=lambda ids: "a" if ids == [4] else "b"
    )
    with pytest.raises(
        RewardError,
        match=r"breaks_on_a' raised KeyError: 'no a allowed' on sample 2 "
        r"\(prompt 'b', response 'a'\)",
    ):
        breaks(batch)
    per_sample = BatchReward(get_reward_fn(f"{user_module}:nan_for_long"), "nan_for_long")
    assert not per_sample.batched
    with pytest.raises(RewardError, match=r"'nan_for_long' returned nan on sample 1 "):
        per_sample(_batch([[1, 2], [1, 2, 3, 4]]))
    with pytest.raises(RewardError, match="returned 1 scores on a batch of 2"):
        BatchReward(lambda b: [1.0])(_batch([[1], [2]]))


@pytest.mark.parametrize(
    "name,message",
    [
        ("no_such_module_xyz:fn", "cannot import 'no_such_module_xyz'"),
        ("json:no_such_fn", "'json' has no 'no_such_fn'"),
        ("nope", "unknown reward function 'nope'"),
    ],
)
def test_bad_reward_fn_names_fail_at_start_in_one_line(name, message, tmp_path, capsys):
    rc = train.main(["--check", "--run-dir", str(tmp_path / "r"), f"TaskConfig.reward_fn='{name}'"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and message in err and "TaskConfig.reward_fn" in err


def _answer_task(tmp_path):
    """The synthetic task as JSONL, each prompt with an ``answer`` field: its majority class's
    letter (the words of that class start with it)."""
    task = SyntheticTask(seed=0)
    files = task.write_jsonl(
        tmp_path / "data", num_prompts=64, num_heldout=8, num_sft=8, num_pairs=8
    )  # 8 held-out prompts x 4 samples: the rows of an iteration (16 x 2), its programs
    for key in ("prompts", "heldout_prompts"):
        rows = [json.loads(line) for line in files[key].read_text().splitlines()]
        for row in rows:
            row["answer"] = chr(ord("a") + row["target_class"])
        write_jsonl(files[key], rows)
    return files


def test_a_jsonl_task_with_answers_trains_through_a_user_reward_by_import_path(
    base_run, user_module, tmp_path
):
    files = _answer_task(tmp_path)
    run_dir = tmp_path / "run"
    bindings = [
        "RunConfig.stages=('grpo',)",
        "TaskConfig.name='files'",
        f"TaskConfig.prompts='{files['prompts']}'",
        f"TaskConfig.heldout_prompts='{files['heldout_prompts']}'",
        f"TaskConfig.tokenizer='{tmp_path / 'data'}'",
        f"TaskConfig.reward_fn='{user_module}:first_letter'",
        f"actor/RoleConfig.init='ckpt:{base_run}/sft'",
        f"reference/RoleConfig.init='ckpt:{base_run}/sft'",
        "RLConfig.iterations=2",
        "RLConfig.samples_per_prompt=2",
        *SMALL,
    ]
    assert train.main(["--run-dir", str(run_dir), "--quiet", *bindings]) == 0
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    # The start-up check (4 dummy samples, before any stage), held-out before (8 prompts x 4
    # samples), 2 iterations (16 prompts x 2), held-out after.
    assert [c["n"] for c in calls] == [4, 32, 32, 32, 32]
    assert set(calls[2]["answers"]) <= set("abcd") and calls[2]["prompt"].endswith("=")
    assert calls[2]["response"] and calls[2]["ids"]  # text decoded from the ids
    rewards = [r["reward"] for r in metric_rows(run_dir, "grpo") if "reward" in r]
    assert len(rewards) == 2 and all(0.0 <= r <= 1.0 for r in rewards)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert 0.0 < summary["after"]["reward"] <= 1.0


def test_a_reward_that_raises_stops_the_run_in_one_line_naming_the_sample(
    base_run, user_module, tmp_path, capsys
):
    files = _answer_task(tmp_path)
    bindings = [
        "RunConfig.stages=('grpo',)",
        "TaskConfig.name='files'",
        f"TaskConfig.prompts='{files['prompts']}'",
        f"TaskConfig.tokenizer='{tmp_path / 'data'}'",
        f"TaskConfig.reward_fn='{user_module}:breaks_on_a'",
        f"actor/RoleConfig.init='ckpt:{base_run}/sft'",
        f"reference/RoleConfig.init='ckpt:{base_run}/sft'",
        "RLConfig.iterations=1",
        "RLConfig.samples_per_prompt=2",
        *SMALL,
    ]
    rc = train.main(["--run-dir", str(tmp_path / "run"), "--quiet", *bindings])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1, err
    assert ":breaks_on_a' raised KeyError: 'no a allowed' on sample " in err[-1], err
    assert "response '" in err[-1]
