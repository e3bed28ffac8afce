"""jrlhf.tasks: the synthetic task's ground truth, splits, determinism, tokenizer, files; the
long-tailed variant's length distribution."""

import numpy as np
import pytest

from jrlhf import data
from jrlhf.tasks import (
    REWARD_FNS,
    LongTailTask,
    SyntheticTask,
    get_reward_fn,
    register_reward_fn,
    required_meta,
    with_meta,
)


@pytest.fixture(scope="module")
def task():
    return SyntheticTask(seed=0)


def ids(task, text):
    return [task.tokens.index(w) for w in text.split()]


def test_vocab_layout(task):
    assert task.vocab_size == 32
    assert task.tokens[:6] == ("<pad>", "<bos>", "<eos>", "<unk>", "=", "um")
    assert (task.pad_id, task.bos_id, task.eos_id) == (0, 1, 2)
    assert task.tokens[task.class_symbols(1)[0]] == "b0"
    assert task.class_of(task.tokens.index("c5")) == 2
    assert task.class_of(task.filler_id) == -1 and task.class_of(999) == -1
    assert task.model_overrides()["eos_token_id"] == 2


def test_score_hand_computed(task):
    p = ids(task, "<bos> b0 a1 b3 c2 b5 =")  # b is the majority class
    assert task.target_class(p) == 1
    eos = " <eos>"
    cases = [
        ("b0 b1 b2 b3 b4 b5 b0 b1" + eos, 1.0),  # ideal
        ("b0 b1 b2 b3 a0 um c1 b1" + eos, 5 / 8),
        ("a0 a1 a2 a3 a4 a5 a0 a1" + eos, 0.0),  # confidently wrong
        ("b0 b1 b2" + eos, 3 / 8),  # short
        ("b0 b1 b2 b3 b4 b5 b0 b1 b2 b3" + eos, (8 - 0.5 * 2) / 8),  # two tokens too long
        ("b0 b1 b2 b3 b4 b5 b0 b1", (8 - 0.5) / 8),  # no <eos>: one overflow
        ("b0 b1 b2 b3 b4 b5 b0 b1 <pad> <pad>", (8 - 0.5) / 8),  # right padding is not content
        ("b0 b1" + eos + " b2 b3 <pad>", 2 / 8),  # everything after <eos> is ignored
        ("um um um um um um um um um um um um", 0.0),  # clipped at 0
        ("", 0.0),
    ]
    for text, want in cases:
        assert task.score(p, ids(task, text)) == pytest.approx(want), text
    # Left-padded prompts score the same as unpadded ones.
    assert task.score([0, 0, *p], ids(task, "b0 b1" + eos)) == pytest.approx(2 / 8)
    # Ties between classes go to the smallest class index; prompts without symbols score 0.
    assert task.target_class(ids(task, "<bos> c0 a0 =")) == 0
    assert task.score(ids(task, "<bos> ="), ids(task, "a0 <eos>")) == 0.0
    got = task.score_batch([p, p], [ids(task, "b0 <eos>"), ids(task, "a0 <eos>")])
    assert got.dtype == np.float32 and got.tolist() == pytest.approx([1 / 8, 0.0])


def test_prompts_have_strict_majority_and_fit(task):
    for p in task.prompts(300) + task.prompts(100, "heldout"):
        assert p[0] == task.bos_id and p[-1] == task.sep_id
        assert task.prompt_len[0] + 2 <= len(p) <= task.max_prompt_len
        counts = np.bincount([task.class_of(t) for t in p[1:-1]], minlength=task.num_classes)
        top = np.sort(counts)[::-1]
        assert top[0] > top[1]
        assert task.score(p, task.ideal_response(p)) == 1.0


def test_heldout_disjoint_and_deterministic(task):
    train = {tuple(p) for p in task.prompts(2000)}
    held = {tuple(p) for p in task.prompts(500, "heldout")}
    assert not train & held
    # Another seed's train split is disjoint from this seed's held-out split too.
    other = {tuple(p) for p in SyntheticTask(seed=7).prompts(2000)}
    assert not other & held
    assert other != train
    assert SyntheticTask(seed=0).prompts(50) == task.prompts(50)
    assert task.prompts(50) == task.prompts(80)[:50]
    assert SyntheticTask(seed=0).sft_examples(20) == task.sft_examples(20)
    assert SyntheticTask(seed=0).preference_pairs(20) == task.preference_pairs(20)
    # Held-out pairs (what the dpo stage evaluates on) are on held-out prompts only.
    held_pairs = task.preference_pairs(50, "heldout")
    assert all(task.split_of(r.prompt_ids) == "heldout" for r in held_pairs)
    assert all(task.split_of(r.prompt_ids) == "train" for r in task.preference_pairs(50))
    with pytest.raises(ValueError, match="split 'test' unknown"):
        task.prompts(1, "test")


def test_demos_are_mediocre_and_pairs_ranked(task):
    sft = task.sft_examples(1000)
    demo = np.mean([task.score(r.prompt_ids, r.response_ids) for r in sft])
    # demo_good_frac + (1 - demo_good_frac) * demo_target_prob = 0.44: headroom to 1.0.
    assert 0.35 < demo < 0.55
    assert all(r.response_ids[-1] == task.eos_id for r in sft)
    pairs = task.preference_pairs(300)
    margins = [
        task.score(r.prompt_ids, r.chosen_ids) - task.score(r.prompt_ids, r.rejected_ids)
        for r in pairs
    ]
    assert min(margins) > 0
    # Some chosen responses are long or unterminated, and some rejected ones are confidently
    # wrong (all one non-target class), so a reward model must read the prompt.
    assert any(task.eos_id not in r.chosen_ids + r.rejected_ids for r in pairs)
    noisy = SyntheticTask(seed=0, label_noise_beta=2.0).preference_pairs(300)
    flipped = sum(
        task.score(r.prompt_ids, r.chosen_ids) < task.score(r.prompt_ids, r.rejected_ids)
        for r in noisy
    )
    assert 0 < flipped < 150


def test_tokenizer_round_trip(task, tmp_path):
    tok = data.Tokenizer.from_file(task.save_tokenizer(tmp_path))
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.vocab_size) == (0, 1, 2, 32)
    for p in task.prompts(20):
        text = tok.decode(p)
        assert tok.encode(text, add_special_tokens=True) == p
    assert tok.decode([1, 6, 12, 2], skip_special_tokens=False) == "<bos> a0 b0 <eos>"
    assert (tmp_path / "tokenizer_config.json").exists()
    assert (tmp_path / "special_tokens_map.json").exists()


@pytest.mark.parametrize("fmt", ["text", "ids"])
def test_jsonl_written_by_task_loads(task, tmp_path, fmt):
    paths = task.write_jsonl(
        tmp_path, num_prompts=30, num_heldout=10, num_sft=40, num_pairs=50, fmt=fmt
    )
    tok = data.Tokenizer.from_file(paths["tokenizer"])
    prompts = data.load_prompts(paths["prompts"], tok)
    assert [r.prompt_ids for r in prompts] == task.prompts(30)
    assert prompts[0].meta["target_class"] == task.target_class(prompts[0].prompt_ids)
    held = data.load_prompts(paths["heldout_prompts"], tok)
    assert [r.prompt_ids for r in held] == task.prompts(10, "heldout")
    assert list(data.load_sft(paths["sft"], tok)) == task.sft_examples(40)
    pairs = data.load_preferences(paths["preferences"], tok, append_eos=False)
    assert list(pairs) == task.preference_pairs(50)


def test_reward_registry(task):
    fn = get_reward_fn("synthetic_ground_truth")
    assert fn is REWARD_FNS["synthetic_ground_truth"]
    p = task.prompts(1)[0]
    assert fn(p, task.ideal_response(p)) == 1.0
    assert fn(p, task.ideal_response(p), {"anything": 1}) == 1.0  # meta is accepted, unused
    with pytest.raises(
        ValueError,
        match=r"unknown reward function .nope. \(known: answer_match, boxed_format, "
        r"calculator_answer, env_reward, format, math_v",
    ):
        get_reward_fn("nope")
    with pytest.raises(ValueError, match="already registered"):
        register_reward_fn("answer_match", lambda p, r: 0.0)


def test_reward_functions_get_meta():
    def old(prompt_ids, response_ids):
        return float(len(response_ids))

    adapted = with_meta(old)
    assert adapted([1], [2, 3], {"x": 1}) == 2.0 and adapted.__name__ == "old"
    assert with_meta(adapted) is adapted  # idempotent
    new = lambda p, r, meta: float(meta["k"])  # noqa: E731
    assert with_meta(new) is new
    register_reward_fn("test_two_args", old)
    try:
        assert get_reward_fn("test_two_args")([1], [2], {}) == 1.0
    finally:
        REWARD_FNS.pop("test_two_args")


def test_answer_match():
    fn = get_reward_fn("answer_match")
    assert required_meta(fn) == ("answer_ids",)
    assert required_meta(get_reward_fn("synthetic_ground_truth")) == ()
    meta = {"answer_ids": [12, 13, 2]}
    assert fn([1, 4], [12, 13, 2], meta) == 1.0
    assert fn([1, 4], np.array([12, 13, 2]), meta) == 1.0
    assert fn([1, 4], [12, 13], meta) == 0.0  # did not stop where the answer does
    assert fn([1, 4], [12, 13, 2, 2], meta) == 0.0
    with pytest.raises(ValueError, match="needs a reference answer"):
        fn([1, 4], [12], {})


# -- the arithmetic task ---------------------------------------------------------------------------
def test_arithmetic_answers_against_python_integers():
    from jrlhf.tasks import ArithmeticTask

    for reverse in (True, False):
        _check_arithmetic(ArithmeticTask(seed=3, digits=3, reverse=reverse))


def _check_arithmetic(task):
    rng = np.random.default_rng(0)
    for _ in range(300):
        op = "+-"[int(rng.integers(2))]
        a, b = sorted(int(x) for x in rng.integers(1000, size=2))[::-1]
        prompt = task.encode_problem(a, op, b)
        assert len(prompt) == task.max_prompt_len and task.decode_problem(prompt) == (a, op, b)
        expected = str(a + b if op == "+" else a - b)
        answer = task.answer(prompt)
        written = "".join(task.tokens[t] for t in answer[:-1])
        assert (written[::-1] if task.reverse else written) == expected
        assert answer[-1] == task.eos_id and len(answer) <= task.max_response_len
        assert task.score(prompt, answer) == 1.0
        assert task.score(prompt, [*answer, 7, 7]) == 1.0  # tokens after <eos> are ignored
        assert task.score(prompt, answer[:-1]) == 0.0  # unterminated
        wrong = task.mistaken_answer(prompt, rng)
        assert wrong != answer and task.score(prompt, wrong) == 0.0


def test_arithmetic_splits_demos_pairs_and_jsonl(tmp_path):
    from jrlhf.tasks import ArithmeticTask, get_reward_fn

    task = ArithmeticTask(seed=0)
    train, held = task.prompts(500), task.prompts(100, "heldout")
    assert not {tuple(p) for p in train} & {tuple(p) for p in held}
    with pytest.raises(ValueError, match="split 'test' unknown"):
        task.prompts(1, "test")
    assert all(
        task.split_of(r.prompt_ids) == "heldout" for r in task.preference_pairs(9, "heldout")
    )
    demos = task.sft_examples(2000)
    right = np.mean([task.score(r.prompt_ids, r.response_ids) for r in demos])
    assert abs(right - task.demo_good_frac) < 0.05
    for pair in [*task.preference_pairs(25), *task.preference_pairs(25, "heldout")]:
        assert task.score(pair.prompt_ids, pair.chosen_ids) == 1.0
        assert task.score(pair.prompt_ids, pair.rejected_ids) == 0.0
    # answer_match on each prompt's reference answer is the task's own score.
    match = get_reward_fn("answer_match")
    for p, meta in zip(held[:20], task.prompt_meta(held[:20])):
        assert match(p, task.answer(p), meta) == 1.0 == task.score(p, task.answer(p))
    files = task.write_jsonl(tmp_path, num_prompts=40, num_heldout=8, num_sft=8, num_pairs=8)
    tok = data.Tokenizer.from_file(files["tokenizer"])
    loaded = data.load_prompts(files["prompts"], tok, max_prompt_len=task.max_prompt_len)
    assert [r.prompt_ids for r in loaded] == task.prompts(40)
    assert [r.meta[data.ANSWER_IDS] for r in loaded] == [task.answer(p) for p in task.prompts(40)]


def test_arithmetic_task_data_for_a_run():
    from jrlhf.config import load_config
    from jrlhf.pipeline.task_data import build_task_data

    bindings = [
        "TaskConfig.name='arithmetic'", "TaskConfig.max_prompt_len=7",
        "TaskConfig.max_response_len=4", "TaskConfig.reward_fn='answer_match'",
        "TaskConfig.num_heldout=16",
    ]  # fmt: skip
    data_ = build_task_data(load_config([], bindings))
    assert len(data_.heldout_prompts) == 16 and data_.model_overrides["vocab_size"] == 24
    p, meta = data_.heldout_prompts[0], data_.heldout_meta[0]
    assert data_.ground_truth(p, meta[data.ANSWER_IDS]) == 1.0
    assert data_.decode(p).endswith("=")
    with pytest.raises(ValueError, match="the arithmetic task needs max_prompt_len >= 7"):
        build_task_data(load_config([], [*bindings, "TaskConfig.max_prompt_len=6"]))


def test_longtail_lengths_are_heavy_tailed():
    """Target lengths follow the discretized Pareto law of jrlhf.tasks.longtail (re-derived
    here): median 4, a few prompts ask for 6-12x the median; the SFT demonstrations and the ideal
    response have the prompt's length, and the ground truth reads it from the prompt."""
    task = LongTailTask(seed=0)
    assert task.lengths == (3, 4, 6, 8, 12, 17, 24, 34, 48)
    assert task.max_prompt_len == 11 and task.vocab_size == 40
    # The synthetic task's ids are unchanged; the length tokens come after the class symbols.
    base = SyntheticTask()
    assert task.tokens[:30] == base.tokens[:30]
    assert task.tokens[task.length_token(48)] == "<len48>"
    prompts = task.prompts(4000)
    assert max(len(p) for p in prompts) <= task.max_prompt_len
    k = np.array([task.target_length(p) for p in prompts])
    expected = 2.0 ** (-np.arange(9) / 2)
    expected /= expected.sum()
    freq = np.array([np.mean(k == n) for n in task.lengths])
    # 4000 draws: each frequency within 4 standard errors of its probability.
    assert np.all(np.abs(freq - expected) < 4 * np.sqrt(expected * (1 - expected) / 4000) + 1e-3)
    assert np.median(k) == 4
    assert 0.05 < np.mean(k >= 24) < 0.12 and np.mean(k == 48) > 0.01
    assert np.percentile(k, 99) >= 10 * np.median(k)
    # Demonstrations are K symbols plus <eos>; the ideal response scores 1, one symbol too many
    # costs overflow_penalty / K.
    for rec in task.sft_examples(50):
        assert len(rec.response_ids) == task.target_length(rec.prompt_ids) + 1
    long = next(p for p in prompts if task.target_length(p) == 48)
    ideal = task.ideal_response(long)
    assert len(ideal) == 49 and task.score(long, ideal) == 1.0
    assert task.score(long, [*ideal[:-1], ideal[0], task.eos_id]) == pytest.approx(1 - 0.5 / 48)
    assert task.score(long, [*ideal[:4], task.eos_id]) == pytest.approx(4 / 48)
    # The same response is perfect for a prompt that asks for 4.
    short = next(p for p in prompts if task.target_length(p) == 4)
    assert task.score(short, task.ideal_response(short)) == 1.0
    # Preference pairs show the reward model answers shorter than asked as well as longer.
    pairs = task.preference_pairs(300)
    responses = [(r.prompt_ids, x) for r in pairs for x in (r.chosen_ids, r.rejected_ids)]
    terminated = [(p, x) for p, x in responses if x[-1] == task.eos_id]
    assert any(len(x) - 1 < task.target_length(p) - 3 for p, x in terminated)
    assert any(len(x) - 1 > task.target_length(p) for p, x in terminated)
    with pytest.raises(ValueError, match="tail_index"):
        LongTailTask(tail_index=0)
