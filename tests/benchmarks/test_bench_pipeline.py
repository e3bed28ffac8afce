"""python -m jrlhf.bench pipeline at its smallest size, in one process: the JSON's structure,
and the counts beside the measured bubbles are the schedules' own."""

from __future__ import annotations

import json

import pytest

from benchmarks import pipeline as bench
from jrlhf.cli import bench as bench_cli
from jrlhf.models.pipeline import bubble_fraction
from jrlhf.runtime import fused_schedule as fs


def test_bench_pipeline_reports_measured_bubbles_beside_the_counts(capsys):
    assert "pipeline" in bench_cli.SUITES
    tiny = ["--hidden", "16", "--mlp", "32", "--layers", "2", "--heads", "2", "--rows", "4"]
    rc = bench.main(
        ["--in-process", *tiny, "--microbatches", "2", "--repeats", "1", "--warmup", "1"]
    )
    assert rc == 0
    out = json.loads(capsys.readouterr().out)  # stdout holds the JSON alone
    assert out["benchmark"] == "pipeline" and "t_stage" in out["definition"]
    assert out["decode"] is None  # the slot pipelined decode fills
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
            assert r["count_lockstep"] == pytest.approx(est["bubble"])
        else:
            assert r["count"] == bubble_fraction(2, 2, schedule)
    assert set(row["schedules"]) == {"gpipe", "1f1b", "fused"}
