"""jrlhf.metrics: JSONL + TensorBoard logging, resume truncation, timers, progress bar, plot."""

import json
import time

import jax.numpy as jnp
import numpy as np
import pytest

from jrlhf import event_file, metrics


def test_jsonl_lines_are_flushed_and_typed(tmp_path):
    log = metrics.MetricsLogger(tmp_path, use_tensorboard=False)
    log.log(1, {"reward": 0.5, "kl": np.float32(0.25), "loss": jnp.asarray(2.0)})
    # Readable before close: a killed run keeps what it logged.
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 1
    rec = json.loads(lines[0])
    assert rec["step"] == 1 and rec["reward"] == 0.5 and rec["kl"] == 0.25 and rec["loss"] == 2.0
    assert isinstance(rec["time"], float)
    log.log(2, {"reward": float("nan")})
    log.close()
    recs = metrics.read_metrics(tmp_path)
    assert [r["step"] for r in recs] == [1, 2]
    assert recs[1]["reward"] is None  # strict JSON: NaN written as null
    assert log.latest("reward") == 0.5


def test_resume_truncates_later_steps_and_appends(tmp_path):
    with metrics.MetricsLogger(tmp_path, use_tensorboard=False) as log:
        for step in range(1, 8):
            log.log(step, {"reward": step / 10})
    # Simulate a torn last line from a kill mid-write.
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 8, "rew')
    # Resume from the checkpoint at step 4: steps 5..8 will be redone.
    with metrics.MetricsLogger(tmp_path, use_tensorboard=False) as log:
        assert log.truncate_after(4) == 3  # 5, 6, 7 (the torn 8 was never a record)
        assert [r["step"] for r in log.history] == [1, 2, 3, 4]
        for step in range(5, 7):
            log.log(step, {"reward": 1.0})
    recs = metrics.read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5, 6]
    assert [r["reward"] for r in recs[3:]] == [0.4, 1.0, 1.0]
    # Without truncate_after the logger just appends.
    with metrics.MetricsLogger(tmp_path, use_tensorboard=False) as log:
        log.log(7, {"reward": 2.0})
    assert len(metrics.read_metrics(tmp_path)) == 7
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2: not a JSON object"):
        (tmp_path / "bad").mkdir()
        (tmp_path / "bad" / "metrics.jsonl").write_text('{"step": 1}\n{oops\n{"step": 3}\n')
        metrics.read_metrics(tmp_path / "bad")


def _tb_scalars(tb_dir):
    """(tag, step, value) triples from the event files, read by an independent reader:
    tensorboard's own when installed, else tensorboardX's protobufs and CRC (both import torch,
    so only here, in the tests that read event files)."""
    files = sorted(p for p in tb_dir.iterdir() if "tfevents" in p.name)
    assert files and all(p.stat().st_size > 0 for p in files)
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        EventAccumulator = None
    if EventAccumulator is not None:
        acc = EventAccumulator(str(tb_dir))
        acc.Reload()
        return [(t, e.step, e.value) for t in acc.Tags()["scalars"] for e in acc.Scalars(t)]
    from tensorboardX.proto import event_pb2
    from tensorboardX.record_writer import masked_crc32c

    out = []
    for path in files:  # TFRecord framed: len, crc, data, crc
        buf = path.read_bytes()
        pos = 0
        while pos < len(buf):
            header = buf[pos : pos + 8]
            n = int.from_bytes(header, "little")
            data = buf[pos + 12 : pos + 12 + n]
            assert int.from_bytes(buf[pos + 8 : pos + 12], "little") == masked_crc32c(header)
            assert int.from_bytes(buf[pos + 12 + n : pos + 16 + n], "little") == masked_crc32c(data)
            event = event_pb2.Event.FromString(data)
            if pos == 0:
                assert event.file_version == "brain.Event:2" and event.step == 0
            pos += 12 + n + 4
            for v in event.summary.value:
                out.append((v.tag, event.step, v.simple_value))
    return out


def test_tensorboard_events_contain_tags(tmp_path):
    with metrics.MetricsLogger(tmp_path) as log:
        log.log(3, {"reward/mean": 0.75, "time/train": 1.5})
        log.log(4, {"reward/mean": 0.5})
    scalars = _tb_scalars(tmp_path / "tb")
    assert ("reward/mean", 3, 0.75) in scalars
    assert ("reward/mean", 4, 0.5) in scalars
    assert ("time/train", 3, 1.5) in scalars


def test_event_encoding_matches_the_protobufs():
    """jrlhf.event_file's hand-written encoding against tensorboardX's protobuf classes and CRC."""
    from tensorboardX.proto import event_pb2
    from tensorboardX.record_writer import masked_crc32c

    assert event_file.crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
    rng = np.random.default_rng(0)
    for n in (0, 1, 7, 300):
        data = rng.bytes(n)
        assert event_file.masked_crc32c(data) == masked_crc32c(data)
    cases = [("reward/mean", 0.75, 3), ("time/train", -1.5e30, 2**40), ("ключ", np.nan, 0),
             ("x" * 200, np.inf, 127), ("neg", -np.inf, 128), ("s", 1e-45, -5)]  # fmt: skip
    for tag, value, step in cases:
        raw = event_file.scalar_event(tag, value, step, 1234.5)
        ref = event_pb2.Event.FromString(raw)
        assert (ref.step, ref.wall_time, len(ref.summary.value)) == (step, 1234.5, 1)
        (v,) = ref.summary.value
        assert v.tag == tag
        np.testing.assert_array_equal(np.float32(v.simple_value), np.float32(value))
        mine = event_file.Event(raw)
        assert (mine.step, mine.is_header, list(mine.scalars)) == (step, False, [tag])
        np.testing.assert_array_equal(np.float32(mine.scalars[tag]), np.float32(value))
        built = event_pb2.Event(step=step, wall_time=1234.5)
        built.summary.value.add(tag=tag, simple_value=value)
        assert event_file.Event(built.SerializeToString()).step == step
    # beyond float32's range: infinite, as protobuf stores it (struct.pack would raise)
    for big in (1e39, -1e300):
        (v,) = event_pb2.Event.FromString(event_file.scalar_event("b", big, 1, 0.0)).summary.value
        assert v.simple_value == np.copysign(np.inf, big)
    # fields of another wire type than the schema's are skipped, not fatal
    odd = event_file._length_delimited(2, b"xx") + event_file._key(5, 0) + b"\x01"
    odd += event_file._length_delimited(
        5, event_file._length_delimited(1, event_file._key(1, 0) + b"\x07")
    )
    parsed = event_file.Event(odd)
    assert (parsed.step, parsed.is_header, parsed.scalars) == (0, False, {})
    header = event_pb2.Event.FromString(event_file.version_event(7.0))
    assert header.file_version == "brain.Event:2" and header.step == 0 and header.wall_time == 7.0
    assert event_file.Event(event_file.version_event(7.0)).is_header


def test_resume_truncates_tensorboard_too(tmp_path):
    with metrics.MetricsLogger(tmp_path) as log:
        for step in range(1, 7):
            log.log(step, {"reward": step / 10, "kl": 0.5})
    # A run killed mid-write leaves a torn record at the end of its event file.
    (events,) = (tmp_path / "tb").iterdir()
    with open(events, "ab") as f:
        f.write(b"\x10\x00\x00")
    with metrics.MetricsLogger(tmp_path) as log:  # resumed from the checkpoint at step 3
        log.truncate_after(3)
        for step in (4, 5):
            log.log(step, {"reward": step, "kl": 0.25})
        # Cutting back while a writer is open (its file is rewritten, a fresh one follows).
        log.truncate_after(4)
        log.log(5, {"reward": 50.0, "kl": 0.125})
    scalars = _tb_scalars(tmp_path / "tb")
    rewards = sorted((s, v) for tag, s, v in scalars if tag == "reward")
    assert [s for s, _ in rewards] == [1, 2, 3, 4, 5]
    assert [v for _, v in rewards] == pytest.approx([0.1, 0.2, 0.3, 4.0, 50.0])
    assert sorted(s for tag, s, _ in scalars if tag == "kl") == [1, 2, 3, 4, 5]
    rows = metrics.read_metrics(tmp_path)
    assert [(r["step"], r["reward"]) for r in rows] == [
        (1, 0.1),
        (2, 0.2),
        (3, 0.3),
        (4, 4.0),
        (5, 50.0),
    ]
    # Every file is still a well-formed event file (the reader stops at nothing torn).
    for path in (tmp_path / "tb").iterdir():
        size = sum(len(rec) for rec, _ in event_file.read_records(path))
        assert size == path.stat().st_size
    assert metrics.truncate_events(tmp_path / "tb", 5) == 0
    assert metrics.truncate_events(tmp_path / "missing", 0) == 0


def test_phase_timer_accumulates_and_blocks(tmp_path):
    timer = metrics.PhaseTimer()
    start = time.perf_counter()
    for _ in range(2):
        with timer.phase("generate"):
            time.sleep(0.02)
    elapsed = time.perf_counter() - start  # on a loaded machine, any length beyond 0.04 s
    with timer("train") as ph:
        out = ph.block_on(jnp.ones((64, 64)) @ jnp.ones((64, 64)))
    assert float(out[0, 0]) == 64.0
    summary = timer.summary()
    assert set(summary) == {"time/generate", "time/train"}
    assert 0.04 <= summary["time/generate"] <= elapsed
    assert timer.counts["generate"] == 2
    # A failing phase still records its time.
    with pytest.raises(RuntimeError), timer.phase("score"):
        raise RuntimeError("boom")
    assert timer.counts["score"] == 1
    timer.reset()
    assert timer.summary() == {}


def test_progress_bar_disabled_off_tty(capsys):
    bar = metrics.ProgressBar(total=10)  # pytest captures stderr: not a TTY
    assert bar.disabled
    postfix = bar.update(1, {"reward/mean": 0.5, "kl": 0.01}, tokens=1000)
    assert postfix["step"] == "1" and postfix["reward"] == "0.500" and postfix["kl"] == "0.0100"
    assert "tok/s" in postfix
    bar.close()
    assert capsys.readouterr().err == ""
    bar = metrics.ProgressBar(total=10, disable=False)
    bar.update(2, {"score": 1.0})
    bar.close()
    assert "reward=1.000" in capsys.readouterr().err  # forced on: drawn to stderr


def test_plot_run_png(tmp_path):
    with metrics.MetricsLogger(tmp_path, use_tensorboard=False) as log:
        for step in range(5):
            log.log(step, {"reward/mean": step, "kl": 0.1 * step, "time/generate": 0.5})
    out = metrics.plot_run(tmp_path / "metrics.jsonl", tmp_path / "plots" / "run.png")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
    # Missing keys (no KL, no timings) still produce a plot.
    (tmp_path / "sparse").mkdir()
    (tmp_path / "sparse" / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2}\n')
    out = metrics.plot_run(tmp_path / "sparse" / "metrics.jsonl")
    assert out == tmp_path / "sparse" / "metrics.png"
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_truncate_on_an_open_logger_keeps_appending_to_the_file(tmp_path):
    with metrics.MetricsLogger(tmp_path, use_tensorboard=False) as log:
        for step in (1, 2, 3):
            log.log(step, {"reward": float(step)})
    with metrics.MetricsLogger(tmp_path, use_tensorboard=False) as log:
        assert log.truncate_after(1) == 2
        log.log(2, {"reward": 20.0})
    rows = metrics.read_metrics(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["reward"]) for r in rows] == [(1, 1.0), (2, 20.0)]
