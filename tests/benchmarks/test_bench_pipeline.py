"""python -m jrlhf.bench pipeline at its smallest size, in one process: the JSON's structure,
and the counts beside the measured bubbles are the schedules' own."""

from __future__ import annotations

import argparse
import json

import pytest

from benchmarks import pipeline as bench
from jrlhf.cli import bench as bench_cli
from jrlhf.models import fused_schedule as fs
from jrlhf.models.pipeline import bubble_fraction


def test_bench_pipeline_reports_measured_bubbles_beside_the_counts(capsys):
    assert "pipeline" in bench_cli.SUITES
    tiny = ["--hidden", "16", "--mlp", "32", "--layers", "2", "--heads", "2", "--rows", "4"]
    rc = bench.main([
        "--in-process", *tiny, "--microbatches", "2", "--repeats", "1", "--warmup", "1",
        "--decode-tokens", "0",
    ])  # fmt: skip
    assert rc == 0
    out = json.loads(capsys.readouterr().out)  # stdout holds the JSON alone
    assert out["benchmark"] == "pipeline" and "t_stage" in out["definition"]
    assert out["decode"] is None  # --decode-tokens 0 (the engines' equality: test_pipelined_decode)
    assert set(out["load_average"]) == {"before", "after"}
    (row,) = out["train"]
    assert row["microbatches"] == 2 and row["stage_s"] > 0
    useful = 2 * 2 * row["stage_s"]  # both models' 2 micro-batches
    table = fs.step_schedule(2, (2, 2), 4, (16, 16)).schedule
    for schedule, r in row["schedules"].items():
        assert r["step_s"] > 0 and r["bubble_measured"] == pytest.approx(1 - useful / r["step_s"])
        fastest = 2 * 2 * row["stage_s_min"] / r["step_s_min"]
        assert r["bubble_measured_min"] == pytest.approx(1 - fastest)
        est = r["estimator"]
        assert est["seconds"] > 0 and 0 <= est["bubble"] < 1
        if schedule == "fused":
            assert r["count"] == table.bubble() and r["ticks"] == table.ticks == est["ticks"]
            assert r["count_path"] == pytest.approx(est["bubble"])
        else:
            assert r["count"] == bubble_fraction(2, 2, schedule)
    assert set(row["schedules"]) == {"gpipe", "1f1b", "fused"}


def test_decode_report_sets_the_measured_speed_up_beside_the_counts():
    """The delayed pipeline's speed-up over naive pipelined decode, measured and as the busy
    stage-ticks allow: with S = 2, a bubble of 0.1 against naive decode's 0.55 allows 2x."""
    runs = {
        "stage=2,batches=2": {"tokens_per_s": 300.0, "pipeline_bubble": 0.1},
        "stage=2,batches=1": {"tokens_per_s": 200.0, "pipeline_bubble": 0.55},
        "tensor=2": {"tokens_per_s": 400.0},
    }
    args = argparse.Namespace(stages=2)
    out = bench._decode_report(args, runs)
    assert out["delayed_over_naive_tokens_per_s"] == pytest.approx(1.5)
    assert out["delayed_over_naive_from_counts"] == pytest.approx(2.0)
    assert out["delayed_over_tensor_tokens_per_s"] == pytest.approx(0.75)
    assert bench._decode_report(args, None) is None
