"""Where a call's device time goes, by XLA op: a JAX profiler trace read back in the same process.

``op_profile(fn)`` traces a few calls of ``fn`` with ``jax.profiler`` and reads the trace with
``jax.profiler.ProfileData`` (no TensorBoard or xprof needed). Every XLA op event's exclusive time
(its own duration less that of the events nested in it: a ``while`` loop's body ops are counted
once, under their own names) is summed by category, the op's name without its ``.N`` suffix
(``ynn_fusion.43`` -> ``ynn_fusion``: on XLA:CPU the YNNPACK fusions are its dots), and by op.
The runtime's own events (thunk dispatch, thread-pool waits, completion markers) are left out:
one inside an op (a dot waiting for the threads sharing its work) counts as that op's time.

On XLA:CPU the ops run on the host's XLA threads (``/host:CPU`` lines named ``XLAEigen`` and
``XLAPjRtCpuClient``). ``op_time_over_wall`` is how many ops were in flight at once on average
(an op split across threads counts once), ``cpu_time_over_wall`` how many cores the process
kept busy (its CPU time over the calls' wall time). On accelerators the ops are read from the
devices' ``XLA Ops`` lines instead (not yet run on one: check the categories there before
trusting them).
"""

from __future__ import annotations

import collections
import glob
import os
import re
import resource
import tempfile
import time

_RUNTIME = ("ThunkExecutor::", "SlinkyThreadPool::", "ThreadpoolListener::", "end: ")


def _op_lines(profile):
    """The trace lines holding XLA op events: the devices' ``XLA Ops`` lines if any, else the
    host's XLA threads (its thread pool, and the client's thread, which runs small programs
    inline)."""
    device = [
        line
        for plane in profile.planes
        if plane.name.startswith("/device:")
        for line in plane.lines
        if line.name == "XLA Ops"
    ]
    if device:
        return device
    return [
        line
        for plane in profile.planes
        if plane.name == "/host:CPU"
        for line in plane.lines
        if "XLAEigen" in line.name or "XLAPjRtCpuClient" in line.name
    ]


def exclusive_times(events) -> list[tuple[str, int]]:
    """(name, exclusive ns) for the op ``events`` of one thread, given as (start_ns, duration_ns,
    name): each op's duration less that of the ops directly nested in it. The runtime's events
    are dropped first: one around ops (a dispatch) is not an op, and one inside an op (a dot
    waiting for the threads that share its work) is part of that op's time."""
    ops = [e for e in events if not e[2].startswith(_RUNTIME)]
    out: list[list] = []
    stack: list[tuple[int, int]] = []  # (end_ns, index into out)
    for start, dur, name in sorted(ops, key=lambda e: (e[0], -e[1])):
        while stack and stack[-1][0] <= start:
            stack.pop()
        if stack:
            out[stack[-1][1]][1] -= dur
        out.append([name, dur])
        stack.append((start + dur, len(out) - 1))
    return [(name, ns) for name, ns in out]


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def op_profile(fn, calls: int = 2, top: int = 12) -> dict:
    """Per-category XLA op time of ``calls`` calls of ``fn`` (which must block until its results
    are ready), after one untraced warm-up call: for the ``top`` categories milliseconds and
    events per call and the share of all op time; op time over wall time; the ``top`` ops."""
    import jax

    fn()
    with tempfile.TemporaryDirectory(prefix="jrlhf-op-profile-") as trace_dir:
        jax.profiler.start_trace(trace_dir)
        t0, cpu0 = time.perf_counter(), _cpu_seconds()
        try:
            for _ in range(calls):
                fn()
            wall, cpu = time.perf_counter() - t0, _cpu_seconds() - cpu0
        finally:
            jax.profiler.stop_trace()
        files = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
        if not files:
            return {"error": "the profiler wrote no trace"}
        profile = jax.profiler.ProfileData.from_file(max(files, key=os.path.getmtime))
        lines = _op_lines(profile)
        ns: collections.Counter = collections.Counter()
        count: collections.Counter = collections.Counter()
        per_op: collections.Counter = collections.Counter()
        busy_lines = 0
        for line in lines:
            times = exclusive_times((ev.start_ns, ev.duration_ns, ev.name) for ev in line.events)
            busy_lines += bool(times)
            for name, excl in times:
                category = re.sub(r"\.\d+$", "", name)
                ns[category] += excl
                count[category] += 1
                per_op[name] += excl
    total = sum(ns.values())
    if not total:
        return {"error": "no XLA op events in the trace on this backend"}
    return {
        "calls": calls,
        "wall_ms_per_call": round(wall / calls * 1e3, 2),
        "op_ms_per_call": round(total / calls / 1e6, 2),
        # Ops in flight at once, on average: an op one thread issues and others help with (a
        # YNNPACK dot split across the pool) counts once, so this is concurrency between ops.
        "op_time_over_wall": round(total / 1e9 / wall, 2),
        # This process's CPU time over wall time: the cores it kept busy (host work included).
        "cpu_time_over_wall": round(cpu / wall, 2),
        "threads_with_ops": busy_lines,
        "categories": {
            name: {
                "ms_per_call": round(t / calls / 1e6, 3),
                "share": round(t / total, 3),
                "events_per_call": round(count[name] / calls, 1),
            }
            for name, t in ns.most_common(top)
        },
        # The costliest single ops (find their shapes in the program's HLO, e.g. with
        # XLA_FLAGS=--xla_dump_to=DIR: cpu_after_optimizations.txt names them the same)
        "top_ops_ms_per_call": {
            name: round(t / calls / 1e6, 3) for name, t in per_op.most_common(top)
        },
    }
