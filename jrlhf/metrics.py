"""Observability for training runs: a JSONL + TensorBoard metrics log, phase timers, a progress
bar and a summary plot.

Layout of a run directory::

    run_dir/metrics.jsonl   one JSON object per log call: {"step": int, "time": float, key: value}
    run_dir/tb/             TensorBoard event files (one scalar per key)

Each JSONL line is flushed as it is written, so a killed run keeps everything it logged. One rule
for resuming: a run resumed at iteration ``i`` calls ``truncate_after(i)``, which drops every
record with a step > i (logged after the checkpoint it resumes from, about to be redone) from
metrics.jsonl *and* from the TensorBoard event files, so neither shows a step twice.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from tqdm.auto import tqdm

from jrlhf.event_file import EventFileWriter, read_records
from jrlhf.storage import naming

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
TB_DIR = "tb"
TIME_PREFIX = "time/"


def _to_float(value: Any) -> float:
    # Accepts Python numbers, NumPy scalars and 0-d JAX/NumPy arrays (which fetch to host here).
    if hasattr(value, "item"):
        value = value.item()
    return float(value)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl (or of ``run_dir/metrics.jsonl`` given a directory).

    A torn last line (a run killed mid-write) is skipped with a warning; a bad line elsewhere is
    an error naming the line.
    """
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    lines = path.read_text(encoding="utf-8").splitlines()
    out = []
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines):
                logger.warning("%s:%d: skipping a torn last line", path, i)
                continue
            raise ValueError(f"{path}:{i}: not a JSON object") from None
    return out


def truncate_events(tb_dir: str | Path, step: int) -> int:
    """Drop the events with a step > ``step`` from every TensorBoard event file in ``tb_dir``
    (each file rewritten atomically, keeping its other records byte for byte); returns how
    many were dropped. Readers other than TensorBoard (which alone honours ``purge_step``) see
    the cut too."""
    dropped = 0
    tb_dir = Path(tb_dir)
    if not tb_dir.is_dir():
        return 0
    for path in sorted(p for p in tb_dir.glob("*tfevents*") if not p.name.endswith(".tmp")):
        keep, before = [], 0
        for record, event in read_records(path):
            before += 1
            # The file_version header is written at step 0; keep it whatever the cut.
            if event.step <= step or event.is_header:
                keep.append(record)
        if len(keep) == before and sum(map(len, keep)) == path.stat().st_size:
            continue
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(b"".join(keep))
        os.replace(tmp, path)
        dropped += before - len(keep)
    return dropped


class MetricsLogger:
    """Append metrics to ``run_dir/metrics.jsonl`` and TensorBoard; keep the history in memory.

    A resumed run calls :meth:`truncate_after` with the iteration it resumes at. ``enabled=False``
    keeps the in-memory history only (e.g. on non-zero processes of a multi-host run).
    """

    def __init__(
        self,
        run_dir: str | Path,
        use_tensorboard: bool = True,
        *,
        enabled: bool = True,
    ):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / METRICS_FILE
        self.tb_dir = self.run_dir / TB_DIR
        self.enabled = enabled
        self.use_tensorboard = use_tensorboard and enabled
        self.history: list[dict[str, Any]] = []
        self._file = None
        self._tb = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            self.history = read_metrics(self.path)
        # Held open for the logger's lifetime (closed in close()); one open per line would cost
        # a syscall pair per log call for nothing.
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115

    def _writer(self) -> EventFileWriter:
        # Opened on first use, so a resume's truncate_after (called before anything is logged)
        # rewrites the earlier files without an open writer of its own among them. The suffix
        # keeps two writers opened in the same second from sharing (and clobbering) one file.
        if self._tb is None:
            self._tb = EventFileWriter(self.tb_dir, filename_suffix=f".{uuid.uuid4().hex[:8]}")
        return self._tb

    def truncate_after(self, step: int) -> int:
        """Drop records with ``step > step`` from metrics.jsonl (atomically) and from the
        TensorBoard event files; returns how many metrics.jsonl records were dropped."""
        if not self.enabled:
            self.history = [r for r in self.history if r.get("step", -1) <= step]
            return 0
        if self._tb is not None:
            # Its file is rewritten below; later scalars go to a fresh file.
            self._tb.close()
            self._tb = None
        truncate_events(self.tb_dir, step)
        if not self.path.exists():
            return 0
        records = read_metrics(self.path)
        keep = [r for r in records if r.get("step", -1) <= step]
        tmp = self.path.with_suffix(".jsonl.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            for r in keep:
                f.write(json.dumps(r) + "\n")
        os.replace(tmp, self.path)
        if self._file is not None:
            # The open handle still points at the replaced file: reopen to append to the new one.
            self._file.close()
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
        self.history = keep
        return len(records) - len(keep)

    def log(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """Record ``metrics`` at ``step``; returns the record written.

        Values become floats; non-finite ones are written as JSON ``null`` (strict JSON) and
        still go to TensorBoard as they are.
        """
        values = {k: _to_float(v) for k, v in metrics.items()}
        record = {"step": int(step), "time": time.time()}
        record.update({k: (v if math.isfinite(v) else None) for k, v in values.items()})
        self.history.append(record)
        if self._file is not None:
            with naming(self.path):  # a full disk's error names the file
                self._file.write(json.dumps(record) + "\n")
                self._file.flush()
        if self.use_tensorboard:
            writer = self._writer()
            with naming(writer.path):
                writer.add_scalars(int(step), values)
        return record

    def latest(self, key: str, default: float | None = None) -> float | None:
        """The most recent logged value of ``key``."""
        for record in reversed(self.history):
            if record.get(key) is not None:
                return record[key]
        return default

    def close(self) -> None:
        """Flush and close the files (idempotent); both are closed even when flushing one
        fails (a full disk), and the first failure is raised."""
        file, tb, self._file, self._tb = self._file, self._tb, None, None
        try:
            if file is not None:
                with naming(self.path):
                    file.close()
        finally:
            if tb is not None:
                with naming(tb.path):
                    tb.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------
# Phase timers
# ---------------------------------------------------------------------------------------------
class _Phase:
    """Yielded inside a timed phase; ``block_on(x)`` waits for ``x`` before the clock stops."""

    def __init__(self):
        self._pending: list[Any] = []

    def block_on(self, value: Any) -> Any:
        self._pending.append(value)
        return value

    def _wait(self, block: bool) -> None:
        if self._pending and block:
            # JAX dispatch is asynchronous: without this the clock would stop when the work is
            # queued, not when it is done, and the time would land in whichever phase syncs next.
            jax.block_until_ready(self._pending)
        self._pending.clear()


class PhaseTimer:
    """Accumulated wall time per phase (generate, reshard, score, train, ...).

    ::

        timer = PhaseTimer()
        with timer.phase("train") as ph:
            state = train_step(state, batch)
            ph.block_on(state)          # stop the clock when the step is done, not dispatched
        metrics.update(timer.summary())  # {"time/train": seconds, ...}
        timer.reset()
    """

    def __init__(self, block: bool = True):
        self.block = block
        self.totals: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)

    @contextlib.contextmanager
    def phase(self, name: str, block: bool | None = None) -> Iterator[_Phase]:
        """Time the body under ``name``; values passed to ``block_on`` are waited for first."""
        handle = _Phase()
        start = time.perf_counter()
        try:
            yield handle
        finally:
            handle._wait(self.block if block is None else block)
            self.totals[name] += time.perf_counter() - start
            self.counts[name] += 1

    __call__ = phase

    def summary(self, prefix: str = TIME_PREFIX) -> dict[str, float]:
        """``{prefix + phase: total seconds}`` since the last reset."""
        return {f"{prefix}{k}": v for k, v in self.totals.items()}

    def reset(self) -> None:
        self.totals.clear()
        self.counts.clear()


# ---------------------------------------------------------------------------------------------
# Progress bar
# ---------------------------------------------------------------------------------------------
class ProgressBar:
    """A tqdm bar over training steps showing reward, KL and tokens/s.

    ``disable=None`` disables it when stderr is not a terminal (log files, CI), so batch jobs
    don't fill logs with carriage returns; ``update`` is then a cheap no-op apart from bookkeeping.
    """

    REWARD_KEYS = ("reward", "reward/mean", "rewards/mean", "score", "score/mean")
    KL_KEYS = ("kl", "kl/mean", "actor/kl", "kl_mean")

    def __init__(
        self,
        total: int,
        initial: int = 0,
        disable: bool | None = None,
        desc: str = "train",
    ):
        if disable is None:
            disable = not (hasattr(sys.stderr, "isatty") and sys.stderr.isatty())
        self.disabled = disable
        self.step = initial
        self._last_time = time.perf_counter()
        self._bar = None
        if not disable:
            self._bar = tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True)

    @classmethod
    def _first(cls, metrics: Mapping[str, Any], keys) -> float | None:
        for k in keys:
            if k in metrics and metrics[k] is not None:
                return _to_float(metrics[k])
        return None

    def update(
        self, step: int, metrics: Mapping[str, Any] | None = None, tokens: int | None = None
    ) -> dict[str, str]:
        """Move to ``step``; ``tokens`` processed since the last update give tokens/s.

        Returns the postfix shown (also when disabled, which makes it testable).
        """
        metrics = metrics or {}
        now = time.perf_counter()
        elapsed, self._last_time = now - self._last_time, now
        postfix = {"step": str(step)}
        reward = self._first(metrics, self.REWARD_KEYS)
        if reward is not None:
            postfix["reward"] = f"{reward:.3f}"
        kl = self._first(metrics, self.KL_KEYS)
        if kl is not None:
            postfix["kl"] = f"{kl:.4f}"
        if tokens is not None and elapsed > 0:
            postfix["tok/s"] = f"{tokens / elapsed:.0f}"
        elif "tokens_per_sec" in metrics:
            postfix["tok/s"] = f"{_to_float(metrics['tokens_per_sec']):.0f}"
        if self._bar is not None:
            self._bar.update(max(0, step - self.step))
            self._bar.set_postfix(postfix, refresh=True)
        self.step = step
        return postfix

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


# ---------------------------------------------------------------------------------------------
# Plot
# ---------------------------------------------------------------------------------------------
def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in records:
        v = r.get(key)
        if isinstance(v, (int, float)) and "step" in r:
            xs.append(r["step"])
            ys.append(v)
    return xs, ys


def plot_run(metrics_jsonl: str | Path, out_png: str | Path | None = None) -> Path:
    """A PNG with reward/score, KL and per-phase time panels vs step; returns its path.

    Panels pick keys by name: containing ``reward`` or ``score``; containing ``kl``; starting with
    ``time/``. A panel with no matching key says so instead of failing.
    """
    # The object API with an explicit Agg canvas draws off-screen without touching the global
    # matplotlib backend of the caller (a notebook keeps its own).
    metrics_jsonl = Path(metrics_jsonl)
    records = read_metrics(metrics_jsonl)
    if out_png is None:
        base = metrics_jsonl if metrics_jsonl.is_dir() else metrics_jsonl.parent
        out_png = base / "metrics.png"
    out_png = Path(out_png)
    keys = sorted({k for r in records for k in r if k not in ("step", "time")})
    panels = [
        (
            "reward / score",
            [k for k in keys if ("reward" in k or "score" in k) and not k.startswith(TIME_PREFIX)],
        ),
        ("KL", [k for k in keys if "kl" in k.lower() and not k.startswith(TIME_PREFIX)]),
        ("time per phase (s)", [k for k in keys if k.startswith(TIME_PREFIX)]),
    ]
    fig = Figure(figsize=(7, 8), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), 1, sharex=True)
    for ax, (title, panel_keys) in zip(axes, panels):
        ax.set_title(title, fontsize=10)
        drawn = 0
        for k in panel_keys[:8]:  # beyond a handful of lines a panel is unreadable
            xs, ys = _series(records, k)
            if xs:
                # a series of one point (an evaluation at the end) shows only with a marker
                marker = "o" if len(xs) < 3 else None
                ax.plot(xs, ys, label=k, linewidth=1.2, marker=marker, markersize=4)
                drawn += 1
        if drawn:
            ax.legend(fontsize=7, loc="best")
            ax.grid(alpha=0.3)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    axes[-1].set_xlabel("step")
    # Fixed margins: tight_layout measures every label and took a third of the plot's time
    fig.subplots_adjust(left=0.1, right=0.97, bottom=0.06, top=0.96, hspace=0.25)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, format="png")
    return out_png
