"""python -m jrlhf.generate and python -m jrlhf.bench decode, end to end on tiny models."""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import shutil
import statistics

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from benchmarks import decode as bench
from jrlhf.cli import generate
from tests.hf_fixtures import VOCAB, hf_checkpoint
from tests.run_helpers import file_size_limit


def _with_tokenizer(tmp_path):
    """A copy of the random llama3 checkpoint plus a word-level tokenizer.json."""
    model_dir = tmp_path / "model"
    shutil.copytree(hf_checkpoint("llama3"), model_dir)
    vocab = {f"w{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(model_dir / "tokenizer.json"))
    return model_dir


def test_generate_cli_text_and_ids(tmp_path, capsys):
    model_dir = _with_tokenizer(tmp_path)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        json.dumps({"prompt": "w5 w9 w17 w33"})
        + "\n\n"
        + json.dumps({"prompt_ids": [7, 8, 9, 10, 11, 12, 13]})
        + "\n"
        + json.dumps({"prompt_ids": [40]})
        + "\n"
    )
    out = tmp_path / "out.jsonl"
    rc = generate.main(
        [
            "--hf",
            str(model_dir),
            "--prompts",
            str(prompts),
            "--max-new-tokens",
            "5",
            "--temperature",
            "0.8",
            "--top-k",
            "10",
            "--num-samples",
            "2",
            "--num-slots",
            "2",
            "--output",
            str(out),
        ]
    )
    assert rc == 0, capsys.readouterr().err
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [(x["prompt_index"], x["sample_index"]) for x in lines] == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
        (2, 0),
        (2, 1),
    ]
    for x in lines:
        assert 1 <= len(x["completion_ids"]) <= 5
        assert len(x["logprobs"]) == len(x["sampling_logprobs"]) == len(x["completion_ids"])
        assert x["text"].split() == [f"w{i}" for i in x["completion_ids"]]


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"prompt_ids": [1, 2]}\n{"prompt_ids": [3,\n', "prompts.jsonl:2: malformed JSON"),
        ('{"prompt_ids": []}\n', "prompts.jsonl:1: 'prompt_ids' must be"),
        ('{"text": "x"}\n', "prompts.jsonl:1: expected an object"),
        ('{"prompt": "w1 w2"}\n', "prompts.jsonl:1: text prompt but"),  # no tokenizer.json
        ("\n\n", "prompts.jsonl: no records"),
        ('{"prompt_ids": [1, -2]}\n', "prompts.jsonl:1: 'prompt_ids'[1] = -2 is outside"),
    ],
)
def test_generate_cli_reports_bad_input_with_line_number(tmp_path, capsys, content, message):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(content)
    rc = generate.main(
        [
            "--hf",
            str(hf_checkpoint("llama3")),
            "--prompts",
            str(prompts),
            "--max-new-tokens",
            "4",
            "--output",
            str(tmp_path / "o.jsonl"),
        ]
    )
    err = capsys.readouterr().err.strip()
    assert rc == 2 and message in err and len(err.splitlines()) == 1, err


def test_generate_cli_missing_file(tmp_path, capsys):
    rc = generate.main(
        [
            "--hf",
            str(tmp_path / "nope"),
            "--prompts",
            str(tmp_path / "missing.jsonl"),
            "--max-new-tokens",
            "4",
            "--output",
            str(tmp_path / "o.jsonl"),
        ]
    )
    assert rc == 2 and "prompts file not found" in capsys.readouterr().err


def test_generate_output_that_cannot_be_written_is_one_line_and_never_half_written(
    tmp_path, monkeypatch, capsys
):
    """--output on a storage that refuses the write part-way (a real EFBIG) or under a file:
    one line naming the path and the errno, exit status 1, and the previous output, or none,
    where it was: never a truncated one."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt_ids": [7, 8, 9]}\n')
    out = tmp_path / "out.jsonl"
    out.write_text("the previous output\n")
    args = ["--hf", str(hf_checkpoint("llama3")), "--prompts", str(prompts)]
    args += ["--max-new-tokens", "4", "--num-samples", "2", "--num-slots", "2"]
    capsys.readouterr()  # the checkpoint's writer's progress, when this test built it
    real = generate.atomic_file

    @contextlib.contextmanager
    def atomic_file_past_64_bytes(path):
        with file_size_limit(64), real(path) as tmp:
            yield tmp

    monkeypatch.setattr(generate, "atomic_file", atomic_file_past_64_bytes)
    assert generate.main([*args, "--output", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert err == f"error: cannot write --output {out}: File too large (EFBIG)", err
    assert out.read_text() == "the previous output\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl", "prompts.jsonl"]
    monkeypatch.undo()
    under_a_file = prompts / "out.jsonl"
    assert generate.main([*args, "--output", str(under_a_file)]) == 1
    err = capsys.readouterr().err.strip()
    assert err == f"error: cannot write --output {prompts}: File exists (EEXIST)", err


# The throughput model of the bench tests: tiny, one layer
TINY_THROUGHPUT = [
    "--hidden",
    "32",
    "--layers",
    "1",
    "--vocab",
    "64",
    "--heads",
    "4",
    "--kv-heads",
    "2",
    "--mlp",
    "64",
    "--batch",
    "2",
    "--prompt-len",
    "8",
    "--new-tokens",
    "8",
    "--repeats",
    "1",
    "--chunk-steps",
    "8",
    "--page-size",
    "4",
]


def test_bench_decode_prints_json(capsys):
    rc = bench.main(
        [
            "--cmp-hidden",
            "32",
            "--cmp-layers",
            "1",
            "--cmp-vocab",
            "64",
            "--cmp-batch",
            "2",
            "--cmp-prompt-len",
            "8",
            "--cmp-new-tokens",
            "16",
            *TINY_THROUGHPUT,
            "--only",
            "comparison",
        ]
    )
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    cmp = out["comparison"]
    assert cmp["paged"]["generated_tokens"] == cmp["recompute"]["generated_tokens"] == 32
    assert (
        cmp["mixed_prompt_lengths_pages"]["pages_used_peak"]
        < (cmp["mixed_prompt_lengths_pages"]["pages_dense_max_length"])
    )
    assert cmp["greedy_outputs_identical"] is True


def test_bench_decode_throughput_fractions(capsys):
    """The throughput section on a tiny model: its weight and K/V bytes a step (recounted here
    from the shapes) and the decode steps' fractions of the read limits, which agree with each
    other and with the tokens/s and stream rate reported beside them."""
    # The decode steps are timed as a call's time less the prefill call's (each the best of
    # --repeats): 8 new tokens of one call were once, on a loaded machine, no longer than its
    # prefill, and the figures after the steps' time were left out. 32 tokens, best of 3.
    batch, new_tokens, repeats = 2, 32, 3
    args = dict(zip(TINY_THROUGHPUT[::2], TINY_THROUGHPUT[1::2]))
    args.update({"--new-tokens": str(new_tokens), "--repeats": str(repeats)})
    rc = bench.main([*(x for kv in args.items() for x in kv), "--only", "throughput"])
    out = json.loads(capsys.readouterr().out)["throughput"]
    assert rc == 0 and out["generated_tokens"] == batch * new_tokens
    # untied: embedding and LM head 64 x 32 each; one layer: q, o 32 x 32, k, v 32 x 16, gate,
    # up, down 32 x 64, two norms of 32; the final norm; the embedding is not read by a step
    params = 2 * 64 * 32 + (2 * 32 * 32 + 2 * 32 * 16 + 3 * 32 * 64 + 2 * 32) + 32
    assert out["model"]["params"] == params
    assert out["weight_bytes_read_per_step"] == 4 * (params - 64 * 32)
    # K and V of 1 layer x 2 KV heads x 8 dims, 2 sequences of 8 + 32 / 2 positions on average
    assert out["kv_bytes_read_per_step"] == 2 * 1 * 2 * 8 * 4 * (8 + 16) * 2
    w, kv = out["weight_bytes_read_per_step"], out["kv_bytes_read_per_step"]
    # The bench rounds what it reports (seconds to 4 decimals, GB/s and GFLOP/s to 1, fractions
    # to 3) but computes from the unrounded figures; on a fast machine a call's decode steps
    # take a millisecond or so, and a figure recomputed from the rounded parts differs from the
    # reported one by more than any fixed tolerance. So each check takes the range the figure
    # can have over the rounding of its parts (exact parts as the bench used them), widened by
    # the rounding of the figure itself.
    prefill = out["prefill_and_first_token_s"]
    after_first = batch * (new_tokens - 1)  # the tokens of the decode steps
    rate = after_first / (out["seconds"] - prefill)  # as the bench: from the rounded seconds
    assert out["decode_steps_tokens_per_s"] == round(rate, 1)
    gbps = (out["stream_read_gbps"], 1)
    assert_rounding_of(
        out["fraction_of_weight_read_limit_decode_steps"],
        3,
        lambda g: rate / (batch * g * 1e9 / w),
        gbps,
    )
    assert_rounding_of(
        out["fraction_of_read_limit_decode_steps"],
        3,
        lambda g: rate / (batch * g * 1e9 / (w + kv)),
        gbps,
    )
    # each timed call against the stream measured right after it, the median of those; the
    # best stream of the run is the one the figures above take
    calls, streams = out["seconds_each_call"], out["stream_read_gbps_after_each_call"]
    assert len(calls) == len(streams) == repeats and max(streams) <= out["stream_read_gbps"]
    assert min(calls) == out["seconds"]

    def paired(*parts):
        ts, gs = parts[:repeats], parts[repeats:]
        # a call whose rounding interval reaches the prefill's time is unbounded above
        steps = [after_first / (t - prefill) if t > prefill else math.inf for t in ts]
        return statistics.median(r / (batch * g * 1e9 / w) for r, g in zip(steps, gs))

    assert_rounding_of(
        out["fraction_of_weight_read_limit_decode_steps_paired"], 3, paired,
        *((t, 4) for t in calls), *((g, 1) for g in streams),
    )  # fmt: skip
    # the roofline: the longer of all the step's bytes at the stream rate and its FLOPs at peak
    flops = out["matmul_flops_per_step"]

    def roofline(g, peak):
        return max((w + kv) / (g * 1e9), flops / (peak * 1e9))

    peak = (out["matmul_peak_gflops"], 1)
    assert_rounding_of(out["roofline_step_ms"], 3, lambda g, p: roofline(g, p) * 1e3, gbps, peak)
    steps_rate = out["decode_steps_tokens_per_s"]  # the bench divides by the rounded rate here
    assert_rounding_of(
        out["fraction_of_roofline_decode_steps"], 3,
        lambda g, p: roofline(g, p) * steps_rate / batch, gbps, peak,
    )  # fmt: skip


def assert_rounding_of(reported, decimals, f, *parts):
    """``reported`` (rounded to ``decimals``) is ``f`` of the true parts, each of which was
    reported as ``(value, its decimals)``: it lies within the range ``f`` takes over the parts'
    rounding intervals (f is monotone in each part, so the range is at the corners), widened by
    the rounding of ``reported`` itself."""
    boxes = [(v - 0.5 * 10**-d, v + 0.5 * 10**-d) for v, d in parts]
    values = [f(*corner) for corner in itertools.product(*boxes)]
    half = 0.5 * 10**-decimals * (1 + 1e-9)
    assert min(values) - half <= reported <= max(values) + half, (
        reported,
        min(values),
        max(values),
    )


@pytest.mark.parametrize("layout", ["in_major", "out_major", "panels"])
def test_bench_decode_matmul_bound_in_each_weight_layout(layout):
    """The throughput section's matmul-only step runs in the engine's weight layout, whichever
    it is, and counts the same FLOPs in each."""
    from jrlhf.models.config import tiny_config
    from jrlhf.models.model_def import ModelDef

    md = ModelDef(tiny_config(vocab_size=72))  # a vocabulary that does not pack: head out-major
    got = bench._matmul_bound(md, 3, layout, steps=2, repeats=1)
    assert got["matmul_weight_layout"] == layout and got["matmul_only_step_ms"] > 0
    c = md.config
    per_layer = 2 * c.hidden_size * (c.num_heads + c.num_kv_heads) * c.head_dim  # q, k, v, o
    per_layer += 3 * c.hidden_size * c.intermediate_size
    assert got["matmul_flops_per_step"] == 2 * 3 * (
        c.num_layers * per_layer + c.hidden_size * c.vocab_size
    )
