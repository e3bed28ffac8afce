"""A prompt record's meta reaches the reward function: JSONL file -> build_task_data ->
PromptLoader batches -> samples of each prompt -> Scorer -> reward_fn(prompt, response, meta)."""

import json

import numpy as np
import pytest

from jrlhf import data
from jrlhf.cli import train
from jrlhf.config import ConfigError, load_config
from jrlhf.pipeline.task_data import build_task_data
from jrlhf.ppo.scoring import Scorer, sample_meta
from jrlhf.tasks import REWARD_FNS, SyntheticTask, get_reward_fn, register_reward_fn

P, R = 8, 6


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A 'files' task: text prompts of the synthetic vocabulary, each with a reference answer."""
    root = tmp_path_factory.mktemp("task")
    SyntheticTask(0).save_tokenizer(root)
    symbols = ["a0", "a1", "b0", "b1", "c0", "c1"]
    rows = [
        {"prompt": f"{symbols[i % 6]} {symbols[(i + 1) % 6]} =", "answer": symbols[i % 6], "q": i}
        for i in range(8)
    ]
    data.write_jsonl(root / "prompts.jsonl", rows)
    data.write_jsonl(root / "heldout.jsonl", rows[:4])
    return root


def _bindings(files, *extra):
    return [
        "TaskConfig.name='files'",
        f"TaskConfig.prompts='{files / 'prompts.jsonl'}'",
        f"TaskConfig.heldout_prompts='{files / 'heldout.jsonl'}'",
        f"TaskConfig.tokenizer='{files}'",
        f"TaskConfig.max_prompt_len={P}",
        f"TaskConfig.max_response_len={R}",
        "RunConfig.stages=('grpo',)",
        "RLConfig.samples_per_prompt=2",
        *extra,
    ]


def _cfg(files, *extra):
    return load_config([], _bindings(files, *extra))


def test_answers_reach_the_reward_function(files):
    cfg = _cfg(files, "TaskConfig.reward_fn='answer_match'")
    task = build_task_data(cfg)
    tok = data.Tokenizer.from_file(files)
    # The answer text is tokenized like a response: its symbol, then <eos>.
    for i, meta in enumerate(task.train_meta):
        assert meta["q"] == i
        assert meta[data.ANSWER_IDS] == [*tok.encode(meta["answer"]), tok.eos_id]
    assert [m["q"] for m in task.heldout_meta] == [0, 1, 2, 3]

    loader = data.PromptLoader(task.train_records(), 4, seed=3)
    batch = loader.next_batch()
    prompts, meta = [r.prompt_ids for r in batch], [r.meta for r in batch]
    # Two samples per prompt, as the engine returns them: the first one right, the second wrong.
    prompt_index = np.repeat(np.arange(4), 2)
    rows = [prompts[i] for i in prompt_index]
    responses = []
    for k, i in enumerate(prompt_index):
        answer = meta[i][data.ANSWER_IDS]
        responses.append(list(answer) if k % 2 == 0 else [answer[0], answer[0], tok.eos_id])

    def zeros(arrays):
        return np.zeros(arrays["mask"].shape, np.float32)

    scorer = Scorer(P, R, task.pad_id, zeros, reward_fn=get_reward_fn(cfg.task.reward_fn))
    arrays = scorer(
        rows, responses, [np.zeros(len(r)) for r in responses], meta=sample_meta(meta, prompt_index)
    )
    np.testing.assert_array_equal(arrays["scores"], [1, 0] * 4)

    # A user's reward of the raw record: reads its own field and the text answer.
    seen = []

    def by_text(prompt_ids, response_ids, meta):
        seen.append(meta["q"])
        return float(tok.decode(response_ids) == meta["answer"])

    register_reward_fn("test_answer_text", by_text)
    try:
        scorer = Scorer(P, R, task.pad_id, zeros, reward_fn=get_reward_fn("test_answer_text"))
        arrays = scorer(
            rows,
            responses,
            [np.zeros(len(r)) for r in responses],
            meta=sample_meta(meta, prompt_index),
        )
    finally:
        REWARD_FNS.pop("test_answer_text")
    np.testing.assert_array_equal(arrays["scores"], [1, 0] * 4)
    assert seen == [batch[i].meta["q"] for i in prompt_index]


def test_two_argument_rewards_still_work():
    calls = []

    def old(prompt_ids, response_ids):
        calls.append((list(prompt_ids), list(response_ids)))
        return float(len(response_ids))

    def zeros(arrays):
        return np.zeros(arrays["mask"].shape, np.float32)

    scorer = Scorer(4, 4, 0, zeros, reward_fn=old)
    arrays = scorer(
        [[1, 2], [3]], [[5, 6, 7], [8]], [np.zeros(3), np.zeros(1)], meta=[{}, {"x": 1}]
    )
    np.testing.assert_array_equal(arrays["scores"], [3, 1])
    arrays = scorer([[1, 2]], [[5]], [np.zeros(1)])  # no meta at all
    assert arrays["scores"].tolist() == [1] and calls[-1] == ([1, 2], [5])
    with pytest.raises(ValueError, match="1 meta entries for 2 rows"):
        scorer([[1], [2]], [[3], [4]], [np.zeros(1)] * 2, meta=[{}])


def test_missing_answer_fails_before_any_model(files, tmp_path):
    rows = [json.loads(line) for line in (files / "prompts.jsonl").read_text().splitlines()]
    del rows[2]["answer"]
    path = data.write_jsonl(tmp_path / "p.jsonl", rows)
    cfg = _cfg(files, "TaskConfig.reward_fn='answer_match'", f"TaskConfig.prompts='{path}'")
    with pytest.raises(ConfigError, match=r"'answer_match' reads 'answer_ids' .*record 3 of"):
        build_task_data(cfg)
    synthetic = load_config([], ["TaskConfig.reward_fn='answer_match'"])
    with pytest.raises(ConfigError, match="synthetic task's prompts"):
        build_task_data(synthetic)


def test_grpo_run_hands_meta_to_the_reward(files, tmp_path):
    """One tiny GRPO iteration from the JSONL task: every sample's reward call saw its record."""
    seen = []

    def spy(prompt_ids, response_ids, meta):
        seen.append(meta["q"])
        return float(response_ids == meta[data.ANSWER_IDS])

    register_reward_fn("test_spy", spy)
    try:
        bindings = _bindings(
            files,
            "TaskConfig.reward_fn='test_spy'",
            "actor/RoleConfig.init='tiny'",
            "reference/RoleConfig.init='tiny'",
            "RLConfig.iterations=1",
            "RLConfig.prompts_per_iteration=4",
            "RLConfig.minibatch_size=8",
            "RLConfig.epochs=1",
            "RunConfig.tensorboard=False",
        )
        rc = train.main(["--run-dir", str(tmp_path / "run"), "--quiet", *bindings])
    finally:
        REWARD_FNS.pop("test_spy")
    assert rc == 0
    # The start-up check on 4 dummy samples of the task's prompts (jrlhf.tasks.rewards), then
    # the held-out evaluation before and after (4 prompts x 4 samples each) and one iteration's
    # 4 prompts x 2 samples; every record's own q arrived.
    assert len(seen) == 4 + 16 + 8 + 16
    seen = seen[4:]
    assert sorted(set(seen[:16])) == [0, 1, 2, 3]
    assert set(seen[16:24]) <= set(range(8))
