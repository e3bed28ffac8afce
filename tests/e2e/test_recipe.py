"""The GSM8K-shaped recipe's CPU twin (configs/gsm8k_grpo_tiny.gin) end to end: a small random
Qwen3 checkpoint with a ChatML template and synthetic word problems (jrlhf.tasks.word_problems)
loads, renders, trains (SFT on conversations, then GRPO scored by math-verify), checkpoints,
evaluates, and exports to HF where transformers reloads it with equal logits. The
test scores with a weighted sum (``math_verify + 0.1*format``) where the recipe has
``math_verify`` alone."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jrlhf.tasks.word_problems import WordProblems, write_recipe_files
from tests.run_helpers import metric_rows

CONFIG = "configs/gsm8k_grpo_tiny.gin"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return write_recipe_files(
        # 8 held-out prompts of 4 samples: an iteration's 32 rows, so its programs
        tmp_path_factory.mktemp("gsm8k_tiny"),
        num_train=256,
        num_heldout=8,
        num_sft=1024,
    )


def _paths(root) -> list[str]:
    return [
        f"TaskConfig.prompts='{root}/data/train.jsonl'",
        f"TaskConfig.heldout_prompts='{root}/data/heldout.jsonl'",
        f"TaskConfig.sft_data='{root}/data/sft.jsonl'",
        f"TaskConfig.tokenizer='{root}/model'",
        f"SFTConfig.init='hf:{root}/model'",
    ]


def test_word_problems_are_gsm8k_shaped_and_split():
    task = WordProblems(seed=0)
    train, heldout = task.prompts(64), task.prompts(64, "heldout")
    assert not {r["messages"][1]["content"] for r in train} & {
        r["messages"][1]["content"] for r in heldout
    }
    for r in train:
        a, op, b = r["answer"].split(" = ")[0].split()
        assert r["answer"].endswith(f"#### {int(a) + int(b) if op == '+' else int(a) - int(b)}")
    right = 0
    for demo in task.sft_conversations(200):
        reply = demo["messages"][-1]
        assert reply["role"] == "assistant"
        a, op, b = reply["content"].split(" = ")[0].split()
        value = int(a) + int(b) if op == "+" else int(a) - int(b)
        right += reply["content"].endswith(f"#### {value}")
    # Half the demonstrations ignore carries and borrows: wrong where the problem has one.
    assert 10 < 200 - right < 100


def test_recipe_twin_end_to_end(files, tmp_path):
    import jax
    import torch
    import transformers as tf

    from jrlhf import checkpoint, train
    from jrlhf.cli import convert, evaluate
    from jrlhf.data import Tokenizer
    from jrlhf.meshes import make_mesh

    # The prompts are rendered as transformers renders them with the checkpoint's template.
    record = json.loads((files / "data/train.jsonl").read_text().splitlines()[0])
    hf_tok = tf.AutoTokenizer.from_pretrained(files / "model")
    want = hf_tok.apply_chat_template(record["messages"], add_generation_prompt=True)
    want = list(want["input_ids"] if hasattr(want, "keys") else want)  # transformers 5: a dict
    ours = Tokenizer.from_file(files / "model").apply_chat_template(
        record["messages"], add_generation_prompt=True
    )
    assert list(ours) == list(want)

    run = tmp_path / "run"
    short = [
        *_paths(files), "SFTConfig.steps=30", "RLConfig.iterations=2",
        "RLConfig.prompts_per_iteration=8", "RLConfig.samples_per_prompt=4",
        "RLConfig.minibatch_size=16", "TaskConfig.num_heldout=8",
        "RunConfig.tensorboard=False", "TaskConfig.reward_fn='math_verify + 0.1*format'",
    ]  # fmt: skip
    assert train.main(["--config", CONFIG, "--run-dir", str(run), "--quiet", *short]) == 0
    assert (run / "generation_config.json").exists()  # the end ids travel with the run
    rows = [r for r in metric_rows(run, "grpo") if "reward" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(0.0 <= r["reward"] <= 1.1 for r in rows)  # a weighted sum of two rewards
    # (resuming a finished run for more iterations: tests/e2e/test_reliability.py)

    out = tmp_path / "eval.json"
    assert evaluate.main(["--checkpoint", str(run), "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    after = json.loads((run / "summary.json").read_text())["after"]
    for key in ("reward", "response_len"):
        np.testing.assert_allclose(report[key], after[key], rtol=1e-4, atol=1e-5, err_msg=key)

    hf_dir = tmp_path / "hf"
    assert convert.main(["--from", str(run), "--to-hf", str(hf_dir)]) == 0
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (hf_dir / name).exists(), name
    model, params = checkpoint.load_model(run, make_mesh("fsdp=1"), "fsdp_tp")
    assert model.config.architecture == "qwen3"
    tokens = np.asarray([want[:24], want[-24:]])
    logits = np.asarray(jax.jit(model.apply)(params, tokens))
    hf_model = tf.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf_model(torch.tensor(tokens)).logits.numpy()
    assert np.abs(logits - ref).max() < 1e-4
