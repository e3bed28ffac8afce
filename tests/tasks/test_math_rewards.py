"""Verifiable math rewards (jrlhf.tasks.math_rewards): math_verify's verdicts on answers written
many ways, its time on a batch and on adversarial answers, the format rewards, weighted sums and
their errors, and the start-up check of the reference answers."""

import json
import logging
import time

import pytest

from jrlhf import data
from jrlhf.config import ConfigError, load_config
from jrlhf.pipeline.task_data import build_task_data
from jrlhf.tasks import RewardBatch, RewardError, get_reward_fn
from jrlhf.tasks.math_rewards import VerifierProcess, math_verify, reference_answer
from jrlhf.tasks.rewards import BatchReward, missing_meta


class _TextBatch(RewardBatch):
    """A batch whose responses are given as text (what a tokenizer would decode)."""

    def __init__(self, responses, metas):
        super().__init__([[1]] * len(responses), [[2]] * len(responses), metas, None)
        self.__dict__["responses"] = list(responses)
        self.__dict__["prompts"] = ["q"] * len(responses)


# (reference, response, verdict): the reference as a record's "answer" gives it.
VERDICTS = [
    # integers: GSM8K's "#### n", boxed, the last number, decimals, currency, units
    ("72", "Natalia sold 48 + 24 = 72 clips. #### 72", 1),
    ("72", "The answer is \\boxed{72}.", 1),
    ("72", "So she sold 72 clips altogether.", 1),
    ("72", "First I get 10, then \\boxed{72}, and also 5.", 1),  # boxed wins over later numbers
    ("72", "72.0", 1),
    ("72", "$72", 1),
    ("72", "72 clips", 1),
    ("72", "\\boxed{73}", 0),
    ("72", "#### 73", 0),
    ("72", "I don't know.", 0),
    ("72", "", 0),
    # fractions: plain, \frac, \dfrac, shorthand \frac12, decimals
    ("1/2", "\\frac{1}{2}", 1),
    ("1/2", "\\boxed{\\dfrac{1}{2}}", 1),
    ("1/2", "0.5", 1),
    ("1/2", "\\boxed{\\frac{2}{4}}", 1),
    ("\\frac{1}{2}", "The answer is 1/2", 1),
    ("0.5", "\\boxed{\\frac12}", 1),
    ("1/3", "0.333333", 1),  # equal to 6 places
    ("1/3", "0.33", 0),
    ("3/4", "\\boxed{\\frac{4}{3}}", 0),
    # units and currency
    ("5", "It costs $5.", 1),
    ("5", "5 dollars", 1),
    ("5", "\\boxed{5 \\text{ dollars}}", 1),
    ("5", "\\$5", 0),  # a LaTeX-escaped dollar sign is not read (math-verify 0.9)
    # thousands separators
    ("1000", "1,000", 1),
    ("1000", "The total is \\boxed{1,000}", 1),
    ("1000", "1000.00", 1),
    ("1,000", "1000", 1),
    ("1000", "\\boxed{100}", 0),
    # negative numbers
    ("-3", "The answer is -3", 1),
    ("-3", "\\boxed{-3}", 1),
    ("-3", "3", 0),
    # percentages
    ("50%", "50%", 1),
    ("50\\%", "\\boxed{50\\%}", 1),
    ("0.5", "50%", 1),
    ("50", "50\\%", 1),
    ("25%", "\\boxed{50\\%}", 0),
    # expressions
    ("\\sqrt{2}", "\\boxed{\\sqrt{2}}", 1),
    ("\\sqrt{2}", "1.41421356", 1),
    ("2\\sqrt{2}", "\\boxed{\\sqrt{8}}", 1),
    ("x+1", "\\boxed{1+x}", 1),
    ("(1, 2)", "\\boxed{(1,2)}", 1),
    ("(1, 2)", "\\boxed{(2,1)}", 0),
]


def test_verdicts_on_answers_written_many_ways():
    refs, responses, expected = zip(*VERDICTS)
    scores = math_verify(_TextBatch(responses, [{"answer": r} for r in refs]))
    wrong = [
        (ref, resp, want, got)
        for ref, resp, want, got in zip(refs, responses, expected, scores)
        if got != want
    ]
    assert not wrong
    n, same = len(VERDICTS), sum(expected)
    print(f"\n{n} verdicts: {same} equivalent, {n - same} not")


def test_reference_answer_keys():
    assert reference_answer({"answer": "She sold 24 in May.\n#### 72"}) == "72"
    assert reference_answer({"answer": 72}) == "72"
    assert reference_answer({"ground_truth": "7", "answer": "8"}) == "7"
    assert reference_answer({"reward_model": {"ground_truth": "9"}}) == "9"
    solution = "Half of 3/2 is $\\boxed{\\frac{3}{4}}$."
    assert reference_answer({"solution": solution}) == solution
    assert reference_answer({"id": 3}) is None
    scores = math_verify(
        _TextBatch(
            ["0.75", "The answer is 72", "\\boxed{9}", "0.5"],
            [
                {"solution": solution},
                {"answer": "She sold 24 in May.\n#### 72"},
                {"reward_model": {"ground_truth": "9"}},
                {"solution": solution},
            ],
        )
    )
    assert scores == [1.0, 1.0, 1.0, 0.0]


def test_a_record_without_reference_is_an_error_naming_the_sample():
    with pytest.raises(RewardError, match=r"needs a reference answer.*sample 1") as info:
        BatchReward(math_verify, "math_verify")(_TextBatch(["1", "2"], [{"answer": "1"}, {}]))
    assert "\n" not in str(info.value)
    assert missing_meta(math_verify, {"q": 1}) == [
        "'ground_truth' or 'reward_model' or 'answer' or 'solution'"
    ]
    assert missing_meta(math_verify, {"solution": "x"}) == []


def test_batch_of_64_is_fast():
    def sample(i):  # 64 different responses (math-verify caches what it parsed before)
        a, b = 48 + i, (48 + i) // 2
        return [
            (f"She sold {a}/2 = {b} clips in May, {a} + {b} = {a + b} in all. #### {a + b}", a + b),
            (f"Let me think. {i} * 5 = {5 * i}, minus 8 is {5 * i - 8}. \\boxed{{{5 * i - 8}}}.",
             5 * i - 8),
            (f"<think>{i}/4 of 8</think>\nThe answer is $\\boxed{{\\dfrac{{{i}}}{{4}}}}$", i / 4),
            (f"The total cost is ${i},250.50, so she pays {i},250.5 dollars.", i * 1000 + 250.5),
        ][i % 4]  # fmt: skip

    responses, refs = zip(*(sample(i) for i in range(1, 65)))
    metas = [{"answer": str(r)} for r in refs]
    math_verify(_TextBatch(["\\boxed{1}"], [{"answer": "1"}]))  # imports math-verify
    start = time.perf_counter()
    scores = math_verify(_TextBatch(responses, metas))
    took = time.perf_counter() - start
    assert scores == [1.0] * 64
    print(f"\nmath_verify: 64 responses in {took * 1e3:.0f} ms")
    assert took < 5.0


ADVERSARIAL = [
    "\\boxed{9^{9^{9^{9}}}}",
    "\\boxed{(2^{2^{30}})!}",
    "\\boxed{" + "+".join(f"x^{{{i}}}" for i in range(3000)) + "}",
]


def test_adversarial_answers_are_bounded(caplog):
    start = time.perf_counter()
    with caplog.at_level(logging.WARNING, logger="jrlhf.tasks.math_rewards"):
        scores = math_verify(_TextBatch(ADVERSARIAL, [{"answer": "7"}] * len(ADVERSARIAL)))
    took = time.perf_counter() - start
    assert scores == [0.0] * len(ADVERSARIAL)
    assert "3 of 3 responses ran out of time" in caplog.text
    print(f"\nmath_verify: {len(ADVERSARIAL)} adversarial answers in {took:.1f} s")
    assert took < 8 * len(ADVERSARIAL)


def test_a_check_past_its_deadline_kills_the_worker():
    # A worker's first check parses with cold caches (seconds on a loaded machine), so the short
    # deadline applies only to the check that must miss it.
    worker = VerifierProcess(deadline_s=60.0)
    try:
        assert worker.check("\\boxed{7}", "7") == (1.0, False)
        worker.deadline_s = 0.3
        start = time.perf_counter()
        assert worker.check(ADVERSARIAL[0], "7") == (0.0, True)  # takes the worker >= 1 s
        assert time.perf_counter() - start < 1.0 and worker.restarts == 1
        assert worker.proc is None
        worker.deadline_s = 60.0
        assert worker.check("\\boxed{7}", "7") == (1.0, False)  # a fresh worker
    finally:
        worker.close()


# ------------------------------------------------------------------------------- format, sums
def test_format_rewards():
    fmt, boxed = get_reward_fn("format"), get_reward_fn("boxed_format")
    responses = [
        "<think>\n2 + 3 = 5\n</think>\n<answer>\n5\n</answer>",
        "<think>\n2 + 3 = 5\n</think>\n<answer>\n5\n</answer> trailing",
        "The answer is \\boxed{5}.",
        "\\boxed{5} or \\boxed{6}",
    ]
    batch = _TextBatch(responses, [{}] * 4)
    assert fmt(batch) == [1.0, 0.0, 0.0, 0.0]
    assert boxed(batch) == [0.0, 0.0, 1.0, 0.0]

    class Task:  # the TaskConfig field the format reward reads
        format_pattern = r".*Answer: \S+"

    custom = get_reward_fn("format", Task())
    assert custom(_TextBatch(["x\nAnswer: 5", "x\nAnswer:"], [{}, {}])) == [1.0, 0.0]


def test_weighted_sums():
    batch = _TextBatch(["\\boxed{5}", "\\boxed{6}", "5"], [{"answer": "5"}] * 3)
    total = get_reward_fn("math_verify + 0.5*boxed_format")
    assert BatchReward(total, "sum")(batch).tolist() == [1.5, 0.5, 1.0]
    assert BatchReward(get_reward_fn("2 * math_verify + boxed_format*-1"), "s")(batch).tolist() == [
        1.0,
        -1.0,
        2.0,
    ]
    assert total.required_meta == (("ground_truth", "reward_model", "answer", "solution"),)
    # A per-sample function (of ids) mixes with batch ones.
    mixed = get_reward_fn("math_verify + 0.1*synthetic_ground_truth")
    assert len(BatchReward(mixed, "m")(batch)) == 3
    for spec, error in [
        ("math_verify + nope", r"unknown reward function 'nope'"),
        ("math_verify + 0.1*", r"cannot read the term '0.1\*'"),
        ("math_verify + math_verify", "appears twice"),
        ("math_verify + 0.1*nomodule_xyz:fn", r"cannot import 'nomodule_xyz'"),
    ]:
        with pytest.raises(ValueError, match=rf"TaskConfig.reward_fn.*{error}") as info:
            get_reward_fn(spec)
        assert "\n" not in str(info.value)


# ------------------------------------------------------------------------------- a files task
@pytest.fixture(scope="module")
def gsm8k_files(tmp_path_factory):
    from tests.data.test_chat import make_checkpoint

    root = tmp_path_factory.mktemp("gsm8k")
    make_checkpoint(root, "qwen", generation={"eos_token_id": [5, 3]})  # <|im_end|>, <|endoftext|>
    sft = [
        {
            "messages": [
                {"role": "user", "content": f"What is {i} + {i}?"},
                {"role": "assistant", "content": f"The answer is \\boxed{{{2 * i}}}."},
            ]
        }
        for i in range(16)
    ]
    (root / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sft))
    rows = [
        {
            "messages": [{"role": "user", "content": f"What is {i} + {i}?"}],
            "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}",
        }
        for i in range(8)
    ]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    bad = [*rows[:3], {"messages": rows[0]["messages"], "id": 3}]
    (root / "bad.jsonl").write_text("".join(json.dumps(r) + "\n" for r in bad))
    return root


def _cfg(root, prompts, reward, *extra):
    return load_config(
        [],
        [
            "TaskConfig.name='files'",
            f"TaskConfig.prompts='{root / prompts}'",
            f"TaskConfig.tokenizer='{root}'",
            "TaskConfig.max_prompt_len=32",
            "TaskConfig.max_response_len=8",
            f"TaskConfig.reward_fn='{reward}'",
            "RunConfig.stages=('grpo',)",
            "RLConfig.samples_per_prompt=2",
            *extra,
        ],
    )


def test_files_task_with_math_reward(gsm8k_files):
    task = build_task_data(_cfg(gsm8k_files, "train.jsonl", "math_verify + 0.1*format"))
    tok = data.Tokenizer.from_file(gsm8k_files)
    assert task.train_prompts[0] == tok.apply_chat_template(
        [{"role": "user", "content": "What is 0 + 0?"}], True
    )
    assert reference_answer(task.train_meta[3]) == "6"
    with pytest.raises(ConfigError, match=r"reads 'ground_truth' or .* record 4 of .*bad\.jsonl"):
        build_task_data(_cfg(gsm8k_files, "bad.jsonl", "math_verify"))
    with pytest.raises(ConfigError, match=r"TaskConfig.format_pattern: not a regex"):
        _cfg(gsm8k_files, "train.jsonl", "format", "TaskConfig.format_pattern='(['")
