"""``python -m jrlhf.bench pipeline``: the bubble of each pipelined training schedule measured
from real runs, beside the schedule's own count and the cost estimator's price.

For each count of micro-batches ``M`` (``--microbatches``, each model's) the PPO actor's and
critic's train steps of one minibatch run over ``--stages`` stages on each schedule:

* ``gpipe``, ``1f1b``: the actor's step, then the critic's (``RoleConfig.pipeline_schedule``,
  jrlhf.models.pipeline / jrlhf.runtime.pipeline_step);
* ``fused``: both in one bidirectional pipeline program (critic/RoleConfig.pipeline_schedule=
  'fused', jrlhf.runtime.fused_step) on the table the PPO update builds
  (``fused_schedule.step_schedule``).

The measured bubble (``DEFINITION``): ``1 - sum over the models of M x t_stage / t_step``, where
``t_stage`` is one stage's forward and backward (``jax.vjp`` of its ``L / S`` layers, pulled
back) on one micro-batch, timed as a program of its own on one device, the slowest stage's
(each process times its own; the actor's and the critic's layers are the same here), and
``t_step`` the measured time of the pipelined steps of both models. Everything in a step that
is not that useful layer work counts: the schedule's filler, 1F1B's and the fused program's
recompute, stages waiting on each other, stage sends, embedding, heads, losses, optimizer and
dispatch.
``bubble_measured`` takes the medians (of ``--repeats`` step calls, of 10 x as many stage
calls), ``bubble_measured_min`` the fastest calls, the ones other load on the machine disturbed
least. Beside them, per schedule:

* ``count``: the schedule's own count of idle slots: ``pipeline.bubble_fraction(S, M,
  schedule)`` for GPipe and 1F1B; the fused table's idle share (``Schedule.bubble``), and
  ``count_path``, ``1 - 6M / path``: the share of the table's critical path
  (``Schedule.critical_path``, a forward one unit, a backward with its recompute three, idle
  slots free: what the program runs) that is not the two models' useful work;
* ``estimator``: jrlhf.placement.estimator.train_schedule_prices on the ``cpu`` profile for the
  same models, minibatch and ``stage=S`` placement: ``seconds`` of both steps and ``bubble``
  (the priced layer work's share that is filler or recompute).

By default each stage is a process of its own (``python -m jrlhf.launch``, one device each,
``S`` processes), each pinned to a core (``--pin``; core ``s`` modulo the cores there are), as
``bench async`` pins its groups: a stage then idles when the schedule gives it nothing, as on
accelerators. ``--in-process`` runs one process of ``S`` virtual devices instead (the tests'
way): the stages then share every core, so the step's time counts the work computed, filler
included, not idle time.

The ``decode`` section (``--decode-tokens``, 0 leaves it out) times pipelined decode
(jrlhf.decode.pipelined) on the same processes, the engine's mesh spanning them (a stage a
process): greedy decoding of the same prompts with the delayed inter-batch pipeline (``G = S``
groups of slots in flight), naive pipelined decode (``G = 1``) and tensor parallelism over the
same devices (``benchmarks.pipelined_decode.measure``: tokens/s, best of ``--repeats``, and the
staged runs' ticks, busy ticks and bubble as the engine counts them on the device), with the
speed-up of ``G = S`` over ``G = 1`` beside the one its busy ticks allow (its busy stage-ticks
over naive decode's, per token).

Models: random Llama-like (``--hidden``, ``--layers``, ...), float32, PPO losses (KL in the
actor's loss), SGD; rows: ``benchmarks.fused_pipeline.rl_batch`` draws.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import pipelined_decode
from benchmarks.fused_pipeline import HEADS, LOSSES, SGD, P, R, rl_batch, tiny
from benchmarks.report import add_out_argument, check_out, emit
from jrlhf.devices import ensure_host_devices
from jrlhf.meshes import make_mesh
from jrlhf.models import ModelDef
from jrlhf.models import fused_schedule as fs
from jrlhf.models.pipeline import bubble_fraction
from jrlhf.runtime.fused_step import make_fused_train_step
from jrlhf.runtime.pipeline_step import pipeline_parts
from jrlhf.runtime.steps import init_train_state, make_train_step

ROOT = Path(__file__).resolve().parent.parent
SCHEDULES = ("gpipe", "1f1b", "fused")
RULES = "fsdp_tp"
DEFINITION = (
    "bubble = 1 - sum over the actor and the critic of M x t_stage / t_step: t_stage, one "
    "stage's forward and backward (jax.vjp of its L/S layers, pulled back) on one micro-batch, "
    "timed alone on one device (the slowest stage's; the actor's and the critic's layers are "
    "the same here); t_step, the measured time of both models' pipelined train steps of one "
    "minibatch (gpipe, 1f1b: the two steps one after the other; fused: the one program). "
    "Filler, recompute, waits between stages, sends, embedding, heads, losses, optimizer and "
    "dispatch all count as bubble. bubble_measured: medians of the calls; "
    "bubble_measured_min: the fastest calls (the least disturbed by other load)."
)


def _batch(rows: int) -> dict[str, np.ndarray]:
    """A PPO minibatch of ``rows`` rows: draws of ``rl_batch`` (8 rows each) stacked."""
    draws = [rl_batch(min(8, rows - k), seed=k // 8) for k in range(0, rows, 8)]
    return {k: np.concatenate([d[k] for d in draws]) for k in draws[0]}


def _config(args, micro: int, schedule: str = "gpipe"):
    return tiny(
        hidden_size=args.hidden,
        intermediate_size=args.mlp,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.heads,
        pipeline_microbatches=micro,
        pipeline_schedule=schedule,
    )


def _times_s(run, calls: int) -> list[float]:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return times


def _stage_program(args, micro: int):
    """One stage's forward and backward on one micro-batch, alone on this process's first
    device: a call that runs it once and waits for it. The actor's layers; the critic's are
    the same here (only their heads differ, outside the stages), so this times both."""
    model = ModelDef(_config(args, micro), head="lm")
    with jax.default_device(jax.local_devices()[0]):
        params = model.init(jax.random.key(0))
        batch = jax.tree.map(jnp.asarray, _batch(args.rows))
        parts = pipeline_parts(model, LOSSES["lm"], params, batch, args.stages, "1f1b")
        stage = jax.tree.map(lambda a: a[0], parts.stage_params)  # stage 0's L/S layers
        x = parts.embed(jnp.int32(0))
        aux = jax.tree.map(lambda a: a[0], parts.aux)

    @jax.jit
    def work(stage, x, aux):
        y, pull = jax.vjp(lambda p, x: parts.stage_fn(p, x, aux, jnp.int32(0)), stage, x)
        return pull(jnp.ones_like(y))

    return lambda: jax.block_until_ready(work(stage, x, aux))


def _steps(args, mesh, micro: int) -> dict:
    """Per schedule, a call that runs both models' train steps of one minibatch and waits.
    The steps do not donate their states, so every call starts from the same ones (one per
    model, shared by the schedules: only their programs differ)."""
    batch = _batch(args.rows)
    models = {
        schedule: {h: ModelDef(_config(args, micro, schedule), head=h) for h in HEADS}
        for schedule in ("gpipe", "1f1b")
    }
    states = {
        h: init_train_state(models["gpipe"][h], SGD, mesh, RULES, seed=i)
        for i, h in enumerate(HEADS)
    }
    out = {}
    for schedule in ("gpipe", "1f1b"):
        steps = {
            h: make_train_step(models[schedule][h], SGD, LOSSES[h], mesh, RULES, donate=False)
            for h in HEADS
        }

        def run(steps=steps):
            jax.block_until_ready([steps[h](states[h], batch) for h in HEADS])

        out[schedule] = run
    table = fs.step_schedule(args.stages, (micro, micro), args.rows, (args.hidden,) * 2).schedule
    fused = make_fused_train_step(
        *((models["gpipe"][h], SGD, LOSSES[h]) for h in HEADS), mesh, RULES, table, donate=False
    )
    out["fused"] = lambda: jax.block_until_ready(fused(*states.values(), batch, batch))
    return out


def measure(args) -> dict:
    """This process's timings, per micro-batch count: its stage program alone and the steps of
    each schedule (``--repeats`` calls after ``--warmup``, the stage program 10 x as many; the
    schedules take turns within each repeat, so load on the machine hits all of them); then
    pipelined decode's (``decode``) unless ``--decode-tokens`` is 0."""
    mesh = make_mesh(f"stage={args.stages}")
    out: dict = {}
    if args.decode_tokens:
        out["decode"] = pipelined_decode.measure(
            devices=args.stages, hidden=args.hidden, layers=args.layers,
            new_tokens=args.decode_tokens, repeats=args.repeats,
        )  # fmt: skip
    for micro in args.microbatches:
        stage = _stage_program(args, micro)
        steps = _steps(args, mesh, micro)
        for run in (stage, *steps.values()):
            for _ in range(args.warmup):
                run()
        stage_s = _times_s(stage, 10 * args.repeats)  # a short program: more calls
        times: dict[str, list[float]] = {s: [] for s in steps}
        for _ in range(args.repeats):
            for name, run in steps.items():
                start = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - start)
        out[str(micro)] = {
            "stage_s": statistics.median(stage_s),
            "stage_s_min": min(stage_s),
            "step_s_all": times,
        }
    return out


def _estimator(args, micro: int) -> dict:
    """The estimator's prices of the three schedules (jrlhf.placement.estimator), cpu profile."""
    from jrlhf.placement import estimator as est
    from jrlhf.placement.plan import CallPlacement
    from jrlhf.placement.profile import DeviceProfile
    from jrlhf.placement.workload import Workload

    cfg = _config(args, micro)
    w = Workload(
        actor=cfg,
        critic=cfg,
        reference=cfg,
        reward=None,
        prompts=args.rows,
        samples_per_prompt=1,
        prompt_len=P,
        gen_len=R,
        epochs=1,
        minibatch_size=args.rows,
    )
    placement = CallPlacement(f"stage={args.stages}", RULES)
    return est.train_schedule_prices(w, placement, DeviceProfile.load("cpu"))


def report(args, per_process: list[dict], load_before: tuple[float, ...]) -> dict:
    """The JSON report from every process's timings (process 0's step times: the steps are
    collective, every process waits for the slowest stage)."""
    train = []
    for micro in args.microbatches:
        key = str(micro)
        # the slowest stage paces the programs (their sends end every tick); both models'
        # micro-batches are work
        stage_s = max(p[key]["stage_s"] for p in per_process)
        stage_min = max(p[key]["stage_s_min"] for p in per_process)
        table = fs.step_schedule(
            args.stages, (micro, micro), args.rows, (args.hidden,) * 2
        ).schedule
        prices = _estimator(args, micro)
        rows = {}
        for schedule in SCHEDULES:
            times = per_process[0][key]["step_s_all"][schedule]
            step = statistics.median(times)
            if schedule == "fused":
                count = {
                    "count": table.bubble(),
                    "count_path": 1 - 6 * micro / table.critical_path(((1, 3), (1, 3))),
                    "ticks": table.ticks,
                }
            else:
                count = {"count": bubble_fraction(args.stages, micro, schedule)}
            rows[schedule] = {
                "step_s": step,
                "step_s_min": min(times),
                "step_s_all": times,
                "bubble_measured": 1 - 2 * micro * stage_s / step,
                # the fastest calls: the least disturbed by other load on the machine
                "bubble_measured_min": 1 - 2 * micro * stage_min / min(times),
                **count,
                "estimator": prices[schedule],
            }
        train.append(
            {
                "microbatches": micro,
                "stage_s": stage_s,
                "stage_s_min": stage_min,
                "stage_s_per_process": [
                    {k: p[key][k] for k in ("stage_s", "stage_s_min")} for p in per_process
                ],
                "schedules": rows,
            }
        )
    return {
        "benchmark": "pipeline",
        "definition": DEFINITION,
        "setting": {k: v for k, v in vars(args).items() if k not in ("out", "worker")},
        "cpu_count": os.cpu_count(),
        # the machine's 1-minute load average before and after the runs (others' jobs too)
        "load_average": {"before": load_before[0], "after": os.getloadavg()[0]},
        "train": train,
        "decode": _decode_report(args, per_process[0].get("decode")),
    }


def _decode_report(args, runs: dict | None) -> dict | None:
    """Pipelined decode's runs (process 0's: the engine's calls are collective), with the
    delayed pipeline's speed-up over naive pipelined decode beside the one its counts allow."""
    if runs is None:
        return None
    s = args.stages
    delayed, naive = runs[f"stage={s},batches={s}"], runs[f"stage={s},batches=1"]

    def busy_per_tick(run):  # the stages' busy share of the ticks
        return 1 - run["pipeline_bubble"]

    return {
        **runs,
        "delayed_over_naive_tokens_per_s": delayed["tokens_per_s"] / naive["tokens_per_s"],
        "delayed_over_naive_from_counts": busy_per_tick(delayed) / busy_per_tick(naive),
        "delayed_over_tensor_tokens_per_s": delayed["tokens_per_s"]
        / runs[f"tensor={s}"]["tokens_per_s"],
    }


def _launch(args) -> list[dict]:
    """Run ``measure`` in a job of one process per stage (one device each, pinned) and collect
    each process's timings."""
    with tempfile.TemporaryDirectory(prefix="jrlhf-bench-pipeline-") as tmp:
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        total = os.cpu_count() or 1
        cores = ["--cores", ";".join(str(s % total) for s in range(args.stages))]
        options = [
            "--stages", str(args.stages),
            "--microbatches", ",".join(map(str, args.microbatches)),
            "--repeats", str(args.repeats), "--warmup", str(args.warmup),
            "--rows", str(args.rows), "--hidden", str(args.hidden), "--mlp", str(args.mlp),
            "--layers", str(args.layers), "--heads", str(args.heads),
            "--decode-tokens", str(args.decode_tokens),
        ]  # fmt: skip
        cmd = [
            sys.executable, "-m", "jrlhf.launch", "--processes", str(args.stages),
            "--devices-per-process", "1", *(cores if args.pin else []), "--",
            "bench", "pipeline", *options, "--worker", tmp,
        ]  # fmt: skip
        out = subprocess.run(
            cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout
        )
        if out.returncode != 0:
            raise RuntimeError(f"the pipeline job failed:\n{out.stderr[-3000:]}")
        return [json.loads((Path(tmp) / f"p{i}.json").read_text()) for i in range(args.stages)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jrlhf.bench pipeline", description=__doc__)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument(
        "--microbatches",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[2, 4, 8],
        help="comma-separated pipeline micro-batch counts (each model's), e.g. 2,4,8",
    )
    p.add_argument("--repeats", type=int, default=5, help="timed calls of each program")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls first (compilation)")
    p.add_argument("--rows", type=int, default=32, help="minibatch rows")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--mlp", type=int, default=1408)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument(
        "--decode-tokens",
        type=int,
        default=32,
        help="decode: tokens each sequence generates (0: no decode section)",
    )
    p.add_argument("--timeout", type=int, default=1800, help="seconds for the job")
    p.add_argument(
        "--in-process",
        action="store_true",
        help="one process of --stages virtual devices sharing every core, not a process a stage",
    )
    p.add_argument(
        "--pin",
        type=int,
        choices=(0, 1),
        default=1,
        help="1 (default): stage s's process on core s (modulo the cores); 0: unpinned",
    )
    p.add_argument("--worker", help=argparse.SUPPRESS)  # inside the job: write timings here
    add_out_argument(p)
    args = p.parse_args(argv)
    check_out(p, args.out)
    bad = [m for m in args.microbatches if m < 1 or args.rows % m]
    if args.stages < 2 or args.layers % args.stages or bad:
        p.error(
            f"need --stages >= 2 dividing --layers {args.layers}, and micro-batch counts >= 1 "
            f"dividing --rows {args.rows} (not {bad})"
        )
    if args.warmup < 1 or args.repeats < 1:
        p.error("need --warmup >= 1 and --repeats >= 1")
    if args.worker:
        timings = measure(args)
        path = Path(args.worker) / f"p{jax.process_index()}.json"
        path.write_text(json.dumps(timings))
        return 0
    load = os.getloadavg()
    if args.in_process:
        ensure_host_devices(args.stages)  # unless the caller chose its devices (the tests' 8)
        per_process = [measure(args)]
    else:
        per_process = _launch(args)
    emit(report(args, per_process, load), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
