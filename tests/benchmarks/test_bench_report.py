"""Every ``python -m jrlhf.bench`` benchmark takes ``--out FILE`` the same way
(benchmarks/report.py): a path that cannot be written is refused in one line before any measuring,
and the report is written whole, never leaving a partial file over an earlier one."""

from __future__ import annotations

import importlib
import json

import pytest

from benchmarks import report
from jrlhf.cli import bench as bench_cli

# options a benchmark requires besides --out (the trainer runs' folder)
REQUIRED = {suite: ["--runs", "{tmp}/runs"] for suite in ("algorithms", "staleness", "lora")}


@pytest.mark.parametrize("suite", bench_cli.SUITES)
def test_every_benchmark_refuses_an_unwritable_out_before_any_work(suite, tmp_path, capsys):
    module = importlib.import_module(f"benchmarks.{suite}")
    extra = [a.format(tmp=tmp_path) for a in REQUIRED.get(suite, [])]
    missing = tmp_path / "no_such_folder" / "report.json"
    with pytest.raises(SystemExit) as e:
        module.main([*extra, "--out", str(missing)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--out" in err and "does not exist" in err, err
    with pytest.raises(SystemExit):
        module.main([*extra, "--out", str(tmp_path)])  # a folder, not a file
    assert "is a directory" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()  # nothing was started


def test_the_report_is_printed_and_written_whole(tmp_path, capsys, monkeypatch):
    out = tmp_path / "r.json"
    out.write_text('{"earlier": true}\n')
    report.emit({"a": 1, "b": [1.5, 2]}, out)
    printed = capsys.readouterr().out
    assert json.loads(printed) == json.loads(out.read_text()) == {"a": 1, "b": [1.5, 2]}

    # a report that cannot be serialized leaves the earlier file as it was, and no temporary
    with pytest.raises(TypeError):
        report.emit({"x": object()}, out)
    assert json.loads(out.read_text()) == {"a": 1, "b": [1.5, 2]}

    def failing_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(report.os, "replace", failing_replace)
    with pytest.raises(OSError):
        report.write({"c": 3}, out)
    assert json.loads(out.read_text()) == {"a": 1, "b": [1.5, 2]}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]
    assert report.write({"c": 3}, None) == json.dumps({"c": 3}, indent=2)
