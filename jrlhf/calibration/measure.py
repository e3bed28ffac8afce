"""Measure a device profile for the cost estimator (``python -m jrlhf.plan.calibrate``).

Two kinds of measurements, about 5 minutes in all on the 2-core CPU machine with 8 fake devices
(4:59 on 2026-11-29, idle):

1. Microbenchmarks: matmul throughput at a few sizes (one device, and all devices at once, which
   tells whether the devices share compute as XLA's fake CPU devices do), memory bandwidth (a
   streaming elementwise op updating its input in place), device-to-device copy bandwidth
   between two devices, an all-gather over all devices inside a jitted program at two sizes (the
   collectives FSDP and tensor parallelism issue: their bandwidth and per-collective latency),
   and the fixed cost of one jitted call on all devices.
2. Short real profiles of small jrlhf models (two sizes, each on all and on half the devices,
   different from anything the plan bench evaluates): a forward (the trainer's log-prob call), a
   training step (the PPO actor loss with AdamW; timed as the trainer runs its update, several
   steps dispatched back to back before one host sync), a generation (the paged-KV decode
   engine) and the train-to-generation reshard. Each measured time is fitted to the estimator's
   own cost model, which is linear in the unknowns: for every kind,
   ``measured = fixed + compute_at_full_efficiency / efficiency + layers x layer_overhead``
   (on a shared host the layer overhead in two parts: one every device program pays, one the
   call pays once; the runs on all, half and one device tell them apart),
   solved by non-negative least squares over the runs (relative errors, so the small model
   counts as much as the large one). On a machine with several devices, the one-device runs
   also time their training step on two disjoint devices at once: on a shared host that tells
   how far calls on disjoint devices overlap (``call_core_share``). The two sizes' runs on all
   devices also time their step split into ``MICROBATCHES`` micro-batches, so the train fit
   sees what a micro-batch costs on its own (per-layer work it repeats) apart from what a
   step pays once.

Robust to a shared, noisy machine: every measurement is taken in several rounds, and the rounds
interleave all the measurements of a kind (round 1 of every model, then round 2, ...), so a burst
of load from another process lands on one round of many measurements instead of every repeat of
one. Each measurement's samples are cleaned of high outliers (more than ``OUTLIER_MADS`` median
absolute deviations above the median: load only ever adds time) and reduced to their median
(``robust_seconds``). The samples' spread is kept in the profile's ``measured`` section.

The result is a ``DeviceProfile`` JSON; raw numbers go under ``measured``.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jrlhf.config import RLConfig
from jrlhf.decode import DecodeEngine, EngineConfig, SamplingParams
from jrlhf.meshes.batch import check_batch_divides
from jrlhf.meshes.mesh import MeshSpec, make_mesh
from jrlhf.models.config import tiny_config
from jrlhf.models.model_def import ModelDef
from jrlhf.placement import estimator as est
from jrlhf.placement.plan import strategy
from jrlhf.placement.profile import DeviceProfile
from jrlhf.placement.workload import Workload
from jrlhf.ppo import batch as rl_batch
from jrlhf.ppo.losses import actor_loss
from jrlhf.reshard import Resharder
from jrlhf.runtime.roles import make_infer
from jrlhf.runtime.steps import OptimizerConfig, init_train_state, make_optimizer, make_train_step

# calibration models: deliberately not the size the plan bench evaluates (held-out check). Each
# runs prompts of ``prompt_len`` and responses of ``gen_len`` tokens (16 and 16 unless given) on
# the flatten plan with ``tensor``-way tensor parallelism (2 unless given, where it divides). The
# first model runs once more with a long prompt and no tensor parallelism: the fit then tells
# the costs that grow with the context and the tokens (a decode step's reads of the KV cache,
# the activations' elementwise work) from the per-step and per-layer ones, and per-device work
# from tensor parallelism's collectives. It runs a third time on the separate plan (``placement``).
# The larger model runs once more with 8-token prompts and responses and no tensor parallelism:
# a forward gathers every weight whole on each device for few tokens, which tells the gathers'
# writes from the FLOPs.
_SMALL = dict(hidden_size=128, intermediate_size=384, num_layers=2, num_heads=4, num_kv_heads=2)
_LARGER = dict(hidden_size=384, intermediate_size=1024, num_layers=3, num_heads=6, num_kv_heads=2)
CALIBRATION_MODELS = (
    _SMALL,
    _LARGER,
    dict(_SMALL, prompt_len=112, gen_len=16, tensor=1),
    # the first model on the separate plan: generation on half the devices, the rest on the
    # other half, so its reshard takes the resharder's path between disjoint device sets (a
    # twin copy of the training layout onto the generation devices, then a reshard there)
    dict(_SMALL, placement="separate"),
    # the larger model with short sequences and no tensor parallelism (the gathers' writes)
    dict(_LARGER, prompt_len=8, gen_len=8, tensor=1),
)
WORKLOAD_KEYS = ("prompt_len", "gen_len", "tensor", "placement")
# (model index, fraction of the devices): the half- and one-device runs separate per-device fixed
# costs (which a shared host pays once per device program) and collectives from compute
CALIBRATION_RUNS = (
    (0, 1.0),
    (1, 1.0),
    (0, 0.5),
    (1, 0.5),
    (0, 0.25),
    (0, 0.125),
    (1, 0.125),
    (2, 1.0),
    (2, 0.5),
    (2, 0.125),
    (3, 1.0),
    (4, 1.0),
)
# in the order a trainer iteration runs them (generate, score, train, then the reshard of the new
# weights): each kind is timed in the machine state the previous one leaves, as in the trainer,
# e.g. the reshard's fresh copy right after a train step has evicted the caches
MODEL_KINDS = ("generate", "forward", "train", "reshard")
# and after them, in one-device runs on a machine with more devices: the run's train steps on
# its device and on the last device at once (``fit_call_core_share``)
PAIR_KIND = "train_pair"
# and in the two sizes' runs on all devices (``MICROBATCH_RUNS``): the same train steps with the
# batch split into MICROBATCHES micro-batches (a train-fit equation of its own)
MICROBATCH_KIND = "train_microbatched"
MICROBATCHES = 2
MICROBATCH_RUNS = ((0, 1.0), (1, 1.0))
# and in every run, right after its generation: the same generation stopped after
# SHORT_GEN_TOKENS tokens (one decode step), so the generate fit tells what a call pays once
# (prefill, the layer copies, dispatch and syncs) from what each decode step pays
SHORT_GEN_KIND = "generate_short"
SHORT_GEN_TOKENS = 2
# every kind a run may time, in the order a round times them
TIMED_KINDS = (MODEL_KINDS[0], SHORT_GEN_KIND, *MODEL_KINDS[1:], MICROBATCH_KIND, PAIR_KIND)
# bytes the memory-bandwidth microbenchmark streams (read and written in place): above the
# last-level caches of the hosts we run on (32 MiB here), so DRAM's rate is measured
MEMORY_MBYTES = 256
# train steps per timed call (an RL update's epochs x minibatches run back to back)
TRAIN_STEPS = 4
# A sample more than this many (scaled) median absolute deviations above the median is load from
# elsewhere, not the measured program.
OUTLIER_MADS = 3.0


# ------------------------------------------------------------------------------ robust timing
def robust_seconds(samples: Sequence[float]) -> float:
    """The median of ``samples`` after dropping high outliers.

    Another process's load only ever adds time, so samples far above the bulk are dropped: more
    than ``OUTLIER_MADS`` x 1.4826 x MAD above the median (1.4826 x MAD estimates the standard
    deviation of normal noise). With fewer than three samples, or no spread, the plain median.
    """
    xs = sorted(float(x) for x in samples)
    if not xs:
        raise ValueError("no samples")
    med = statistics.median(xs)
    if len(xs) < 3:
        return med
    mad = statistics.median(abs(x - med) for x in xs)
    if mad <= 0:
        return med
    kept = [x for x in xs if x <= med + OUTLIER_MADS * 1.4826 * mad]
    return statistics.median(kept)


def _samples(fn: Callable[[], Any], repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def measure_interleaved(
    tasks: Mapping[str, Callable[[], Any]], rounds: int, repeat: int
) -> dict[str, dict[str, Any]]:
    """Robust seconds of each task (each call must block until its work is done).

    Every task is called once to warm up (compile), then ``rounds`` times over all tasks in
    turn, ``repeat`` calls each: a burst of load from elsewhere hits one round of several tasks,
    which ``robust_seconds`` drops as outliers, rather than every sample of one task. Returns
    name -> {"seconds", "samples" (count), "spread" ((max - min) / robust seconds)}.
    """
    for fn in tasks.values():
        fn()
    samples: dict[str, list[float]] = {name: [] for name in tasks}
    for _ in range(rounds):
        for name, fn in tasks.items():
            samples[name] += _samples(fn, repeat)
    out = {}
    for name, xs in samples.items():
        s = robust_seconds(xs)
        out[name] = {"seconds": s, "samples": len(xs), "spread": (max(xs) - min(xs)) / s}
    return out


# ----------------------------------------------------------------------------- microbenchmarks
def _repeated(f, args, reps: int) -> Callable[[], None]:
    def run():
        for _ in range(reps):
            r = f(*args)
        jax.block_until_ready(r)

    return run


def microbenchmark_tasks(
    sizes: Sequence[int], dtype, mbytes: int, collective_mbytes: int
) -> dict[str, tuple[Callable[[], Any], float]]:
    """name -> (blocking call, units of work per call): FLOPs for matmuls, bytes for memory
    and copies, bytes received per device for the all-gathers ("allgather_*" come with a
    "local_*" twin, the same elementwise program without the gather), 1 for the call overhead."""
    devs = jax.devices()
    n = len(devs)
    tasks: dict[str, tuple[Callable[[], Any], float]] = {}
    mm = jax.jit(lambda a, b: a @ b)
    for s in sizes:
        a = jax.device_put(jnp.ones((s, s), dtype), devs[0])
        reps = max(1, int(2e9 // (2 * s**3)))  # enough work per timing to drown dispatch
        tasks[f"matmul_{s}"] = (_repeated(mm, (a, a), reps), reps * 2.0 * s**3)
    mesh = jax.make_mesh((n,), ("d",))
    split = NamedSharding(mesh, PartitionSpec("d"))
    s = 512
    x = jax.device_put(jnp.ones((n, s, s), dtype), split)
    reps = max(1, int(4e9 // (2 * n * s**3)))
    bmm = jax.jit(lambda v: jnp.einsum("nij,njk->nik", v, v))
    tasks["matmul_all_devices"] = (_repeated(bmm, (x,), reps), reps * 2.0 * n * s**3)
    elems = mbytes * 2**20 // 4
    v = jax.device_put(jnp.ones((elems,), jnp.float32), devs[0])
    # Memory bandwidth as the trainer's programs see it: an update in place (its steps donate
    # their state), over more bytes than a last-level cache holds. A fresh output per call
    # would time the host's first touch of new pages instead: on the 2-core CPU 6 GB/s against
    # 52 GB/s in place, which over-priced every memory-bound term (the optimizer update, the
    # decode step's weight reads) nine times.
    held = {"v": jax.device_put(jnp.ones((MEMORY_MBYTES * 2**20 // 4,), jnp.float32), devs[0])}
    stream = jax.jit(lambda v: v * 0.5 + 1.0, donate_argnums=0)  # stays finite, near 2

    def in_place():
        held["v"] = stream(held["v"])
        held["v"].block_until_ready()

    tasks["memory"] = (in_place, 2.0 * held["v"].size * 4)
    if n > 1:
        tasks["copy"] = (lambda: jax.device_put(v, devs[1]).block_until_ready(), elems * 4.0)
        gather = jax.jit(lambda v: v * 1.0, out_shardings=NamedSharding(mesh, PartitionSpec()))
        local = jax.jit(lambda v: v * 1.0)
        for label, nbytes in (("small", 64 * 1024), ("large", collective_mbytes * 2**20)):
            count = nbytes // 4 // n * n
            y = jax.device_put(jnp.ones((count,), jnp.float32), split)
            received = count * 4.0 * (n - 1) / n
            tasks[f"allgather_{label}"] = (lambda y=y: gather(y).block_until_ready(), received)
            tasks[f"local_{label}"] = (lambda y=y: local(y).block_until_ready(), received)
    tiny = jax.device_put(jnp.ones((n * 8,), jnp.float32), split)
    inc = jax.jit(lambda v: v + 1.0)
    tasks["call"] = (lambda: inc(tiny).block_until_ready(), 1.0)
    return tasks


def _host_cores() -> int:
    """CPU cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # no affinity on this OS
        return max(1, os.cpu_count() or 1)


def collective_fit(
    small: tuple[float, float],
    large: tuple[float, float],
    n: int,
    shared: bool,
) -> tuple[float, float]:
    """(bandwidth, latency per collective) from two all-gathers: (bytes received per device,
    seconds beyond the same program without the gather) at a small and a large size.

    In the estimator's terms (``estimator._comm_s``): ``extra = received / bandwidth + latency``
    per device; on a shared host every device's copy runs on the same cores and memory, and
    every device's thread takes part in the rendezvous, so (at the base profile's
    ``fixed_device_exponent`` of 1) ``extra = n x received / bandwidth + n x latency``.
    """
    k = n if shared else 1
    (b0, t0), (b1, t1) = small, large
    slope = max(t1 - t0, 1e-12) / max(b1 - b0, 1.0)  # seconds per received byte per device
    bandwidth = k / slope
    latency = max(0.0, t0 - b0 * slope) / k
    return float(bandwidth), float(latency)


def _calibration_setup(overrides: dict[str, Any], dtype: str, devices: int, microbatches: int = 1):
    """(model config, plan, workload) of a calibration run: ``overrides`` are the model's, plus
    the workload's ``WORKLOAD_KEYS`` (the plan: the ``placement`` strategy, flatten unless
    given); ``microbatches``: the actor's training micro-batches."""
    shape = {"prompt_len": 16, "gen_len": 16, "tensor": None, "placement": "flatten"}
    shape.update({k: v for k, v in overrides.items() if k in WORKLOAD_KEYS})
    plan = strategy(shape.pop("placement"), devices, tensor=shape.pop("tensor"))
    model = {k: v for k, v in overrides.items() if k not in WORKLOAD_KEYS}
    cfg = tiny_config(vocab_size=64, max_position_embeddings=256, **model).replace(
        param_dtype="float32", dtype=dtype
    )
    w = Workload(
        actor=cfg,
        critic=None,
        reference=cfg,
        reward=None,
        prompts=32,
        samples_per_prompt=1,
        epochs=1,
        minibatch_size=16,
        decode_chunk_steps=8,
        actor_microbatches=microbatches,
        **shape,
    )
    return cfg, plan, w


def model_tasks(
    overrides: dict[str, Any], dtype: str, devices: int, microbatched: bool = False
) -> dict[str, Callable]:
    """Blocking calls (already compiled) of one forward, one train step, one generation and one
    reshard (train to generation layout) for a small model on the first ``devices`` devices,
    keyed by ``MODEL_KINDS``; for a one-device run on a machine with more, ``PAIR_KIND``:
    its train steps on its device and on the last one at once; with ``microbatched``,
    ``MICROBATCH_KIND``: its train steps in ``MICROBATCHES`` micro-batches. Time them with
    ``measure_interleaved``."""
    cfg, plan, w = _calibration_setup(overrides, dtype, devices)
    P, R = w.prompt_len, w.gen_len
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(1, cfg.vocab_size, P)) for _ in range(w.rows)]
    responses = [list(rng.integers(1, cfg.vocab_size, R)) for _ in range(w.rows)]
    arrays = rl_batch.pack(prompts, responses, P, R, 0)
    model = ModelDef(cfg, "lm")
    train_p = plan["actor_train"]
    mesh = make_mesh(train_p.mesh)
    params = model.init_sharded(mesh, train_p.rules)

    infer = make_infer(model, mesh, train_p.rules, rl_batch.logprobs_fn(P))
    fields = ("tokens", "positions", "segment_ids", "response_tokens")
    fwd_batch = {k: arrays[k] for k in fields}

    # as the trainer's score phase does it: three calls dispatched back to back, then fetched
    # (the estimator prices one forward: the fit divides by three)
    def three_forwards():
        outs = [infer(params, fwd_batch) for _ in range(3)]
        return [np.asarray(o) for o in outs]

    mb = w.minibatch_size
    tb = {k: arrays[k][:mb] for k in (*fields, "mask")}
    tb.update(
        old_logprobs=np.zeros((mb, R), np.float32),
        advantages=rng.normal(size=(mb, R)).astype(np.float32),
        ref_logprobs=np.zeros((mb, R), np.float32),
        kl_coef=np.zeros((mb,), np.float32),
    )
    trainers = [_Trainer(model, mesh, train_p.rules, P, tb, params)]
    holder = {}

    # as the trainer's update runs them: TRAIN_STEPS steps dispatched back to back and one host
    # sync for their metrics, so each step's dispatch overlaps the previous step's work (the
    # estimator prices one step: the fit divides by TRAIN_STEPS)
    def train_steps():
        jax.device_get([trainers[0].step() for _ in range(TRAIN_STEPS)])

    tasks = {}
    try:  # a minibatch whose micro-batches do not split over the batch shards: no such task
        check_batch_divides(tb, mesh, train_p.rules, MICROBATCHES)
    except ValueError:
        microbatched = False
    if microbatched:
        split = _Trainer(model, mesh, train_p.rules, P, tb, microbatches=MICROBATCHES)

        def train_microbatched():
            jax.device_get([split.step() for _ in range(TRAIN_STEPS)])

        tasks[MICROBATCH_KIND] = train_microbatched
    n = jax.device_count()
    if devices == 1 and n > 1:
        # The same steps on the last device too, dispatched in turn with the first device's as
        # the trainer's update dispatches actor and critic steps: how far two calls on disjoint
        # devices run at the same time (fit_call_core_share).
        spec = MeshSpec(train_p.mesh.axes, (n - 1,))
        trainers.append(_Trainer(model, make_mesh(spec), train_p.rules, P, tb))

        def train_pair():
            jax.device_get([t.step() for _ in range(TRAIN_STEPS) for t in trainers])

        tasks[PAIR_KIND] = train_pair

    gen_p = plan["actor_generate"]
    gen_mesh = make_mesh(gen_p.mesh)
    resharder = Resharder()
    gen_shardings = model.shardings(gen_mesh, gen_p.rules)
    holder["gen"] = resharder(trainers[0].state.params, gen_shardings)
    engine = DecodeEngine(
        model,
        gen_mesh,
        gen_p.rules,
        EngineConfig(
            num_slots=w.rows,
            # the trainer's pages (DecodeConfig.page_size), as the workload prices them
            page_size=w.decode_page_size,
            max_prompt_len=P,
            max_new_tokens=R,
            chunk_steps=w.decode_chunk_steps,
            max_prefill_rows=min(w.rows, 64),
            min_prefill_len=min(16, P),
        ),
    )
    # no stop ids: every sample runs the full gen_len, as the cost model assumes
    sp = SamplingParams(seed=1, stop_ids=(), max_new_tokens=R)

    def generate():
        # Where the layouts agree the generation copy aliases the training parameters, which
        # a train step since the last reshard has donated: rebuild it, as the trainer does.
        if any(x.is_deleted() for x in jax.tree.leaves(holder["gen"])):
            holder["gen"] = resharder(trainers[0].state.params, gen_shardings)
        return engine.generate(holder["gen"], prompts, sp)

    short = dataclasses.replace(sp, max_new_tokens=SHORT_GEN_TOKENS)

    def generate_short():
        if any(x.is_deleted() for x in jax.tree.leaves(holder["gen"])):
            holder["gen"] = resharder(trainers[0].state.params, gen_shardings)
        return engine.generate(holder["gen"], prompts, short)

    def reshard():
        holder["gen"] = jax.block_until_ready(resharder(trainers[0].state.params, gen_shardings))

    return {
        "forward": three_forwards,
        "train": train_steps,
        "generate": generate,
        SHORT_GEN_KIND: generate_short,
        "reshard": reshard,
        **tasks,
    }


class _Trainer:
    """A calibration model's PPO actor step with AdamW on ``mesh``, stepping its own state on
    one fixed batch: ``step()`` dispatches one step and returns its metrics (not fetched)."""

    def __init__(
        self,
        model: ModelDef,
        mesh,
        rules: str,
        prompt_len: int,
        batch,
        params=None,
        microbatches: int = 1,
    ):
        opt = make_optimizer(OptimizerConfig(learning_rate=1e-5))
        self.state = init_train_state(model, opt, mesh, rules, params=params)
        self._step = make_train_step(
            model,
            opt,
            actor_loss(prompt_len, RLConfig(), False),
            mesh,
            rules,
            microbatches=microbatches,
        )
        self._batch = batch

    def step(self):
        self.state, metrics = self._step(self.state, self._batch)
        return metrics


class ModelTimings:
    """The calibration models' blocking calls (``model_tasks`` of every (overrides, devices)
    run), built and warmed up (compiled) once, then timed in rounds: ``round()`` calls every
    task ``repeat`` times in turn. A caller may take rounds between its own measurements (the
    plan bench takes one before each round of trainer iterations), so the profile fitted from
    ``results()`` saw the machine as those measurements did; ``reset()`` forgets the samples
    taken so far (the compiled tasks stay)."""

    def __init__(self, runs: Sequence[tuple[dict[str, Any], int]], dtype: str, repeat: int = 2):
        self.runs = list(runs)
        self.repeat = repeat
        split = _microbatched_runs(self.runs)
        self.tasks = {
            (i, kind): fn
            for i, (overrides, devices) in enumerate(self.runs)
            for kind, fn in model_tasks(overrides, dtype, devices, i in split).items()
        }
        for fn in self.tasks.values():
            fn()
        self.samples: dict[tuple[int, str], list[float]] = {k: [] for k in self.tasks}

    def round(self) -> None:
        """One round: each run's calls ``repeat`` times in turn, in the order of ``TIMED_KINDS``
        (an iteration's, then the micro-batched step and the pair), one run after another."""
        for i in range(len(self.runs)):
            for _ in range(self.repeat):
                for kind in TIMED_KINDS:
                    if (i, kind) in self.tasks:
                        self.samples[(i, kind)] += _samples(self.tasks[(i, kind)], 1)

    def reset(self) -> None:
        self.samples = {k: [] for k in self.tasks}

    def results(self) -> list[tuple[dict[str, Any], int, dict[str, float], dict[str, float]]]:
        """(overrides, devices, robust seconds per kind, spread per kind) for each run, the
        forward and train times per call of the estimator (one forward, one step; a pair's
        two steps at once)."""
        out = []
        for i, (overrides, devices) in enumerate(self.runs):
            seconds, spread = {}, {}
            for kind in TIMED_KINDS:
                if (i, kind) not in self.tasks:
                    continue
                xs = self.samples[(i, kind)]
                if not xs:
                    raise RuntimeError("no calibration round was timed")
                seconds[kind] = robust_seconds(xs)
                spread[kind] = (max(xs) - min(xs)) / seconds[kind]
            seconds["forward"] /= 3  # three forwards per call
            for kind in ("train", MICROBATCH_KIND, PAIR_KIND):
                if kind in seconds:
                    seconds[kind] /= TRAIN_STEPS
            out.append((overrides, devices, seconds, spread))
        return out


def _microbatched_runs(
    runs: Sequence[tuple[dict[str, Any], int]], n: int | None = None
) -> set[int]:
    """Indices of ``runs`` that also time micro-batched steps: for each of ``MICROBATCH_RUNS``,
    the first run of its model on its devices, of ``n`` (default: all here; on one device
    several fractions are the same run: it is timed once)."""
    n = n or jax.device_count()
    out = set()
    for index, fraction in MICROBATCH_RUNS:
        wanted = (CALIBRATION_MODELS[index], max(1, int(n * fraction)))
        first = next((i for i, run in enumerate(runs) if tuple(run) == wanted), None)
        if first is not None:
            out.add(first)
    return out


def profile_models(
    runs: Sequence[tuple[dict[str, Any], int]], dtype: str, rounds: int = 3, repeat: int = 2
) -> list[tuple[dict[str, Any], int, dict[str, float], dict[str, float]]]:
    """(overrides, devices, robust seconds per kind, spread per kind) for each (overrides,
    devices) run, all runs' measurements interleaved in rounds (``ModelTimings``)."""
    timings = ModelTimings(runs, dtype, repeat)
    for _ in range(rounds):
        timings.round()
    return timings.results()


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    """The cosine of the angle between two columns (1 when they are proportional)."""
    norm = float(np.linalg.norm(a) * np.linalg.norm(b))
    return float(a @ b) / norm if norm else 1.0


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares for a few non-negative unknowns (columns of ``a``): the best unconstrained
    solution over every subset of the unknowns left free (the rest pinned at zero) that comes out
    non-negative. Exact for the handful of unknowns a calibration fits."""
    k = a.shape[1]
    best, best_err = np.zeros(k), float(np.sum(b**2))
    for mask in range(1, 2**k):
        free = [j for j in range(k) if mask >> j & 1]
        x = np.zeros(k)
        x[free] = np.linalg.lstsq(a[:, free], b, rcond=None)[0]
        if (x >= 0).all():
            err = float(np.sum((a @ x - b) ** 2))
            if err < best_err - 1e-15 * max(1.0, best_err):
                best, best_err = x, err
    return best


# Rates each kind's fit finds besides its efficiency and layer overheads, as (profile field, the
# value that means "not priced" when the fit finds no such cost): forwards and training steps
# stream their activations at their own fractions of the memory bandwidth, a forward writes its
# FSDP-gathered weights at its own fraction of the link bandwidth, and a decode step reads the
# KV cache at its own.
EXTRA_RATES = {
    "forward": (("forward_activation_efficiency", 0.0), ("forward_gather_efficiency", 0.0)),
    "train": (("train_activation_efficiency", 0.0),),
    "generate": (("decode_kv_efficiency", 10.0),),
}
# ... and on a shared host, where n fake devices each run small decode matmuls over their own
# weight copy, a decode step's weight reads at their own rate, added to its FLOPs' time
SHARED_HOST_RATES = {
    "generate": (("decode_weight_efficiency", 0.0), ("decode_copy_efficiency", 0.0)),
}
# per-call fixed costs fitted besides the per-layer ones (their coefficients read off alike)
CALL_OVERHEADS = {"generate": "decode_call_overhead_s"}
# fixed_device_exponent values the shared-host fit tries
DEVICE_EXPONENTS = tuple(i / 10 for i in range(11))


def fit_profile(
    base: DeviceProfile, measurements: list[tuple[dict, int, dict[str, float]]], dtype: str
):
    """Fit efficiencies and per-layer overheads so the estimator reproduces ``measurements``.

    The estimator is linear in ``1/efficiency`` and in the layer overheads of each kind, so each
    coefficient is read off by evaluating it at two settings. Each run's equation is divided by
    its measured time: the fit minimises relative errors, as the plan bench judges them, so the
    largest run does not decide alone. On a shared host the exponent with which per-device
    costs grow past ``host_cores`` programs (``fixed_device_exponent``) is not linear: each of
    ``DEVICE_EXPONENTS`` is fitted in turn and the one with the smallest relative error kept.
    """
    if not base.shared_host:
        return _fit_linear(base, measurements, dtype)[:2]
    fitted = [
        _fit_linear(base.replace(fixed_device_exponent=x), measurements, dtype)
        for x in DEVICE_EXPONENTS
    ]
    profile, fits, _ = min(fitted, key=lambda f: f[2])
    fits["fixed_device_exponent"] = profile.fixed_device_exponent
    share, pairs = fit_call_core_share(measurements)
    if pairs:
        profile = profile.replace(call_core_share=share)
        fits["call_core_share"] = {"value": share, "pairs": pairs}
    return profile, fits


def fit_call_core_share(
    measurements: Sequence[tuple[dict, int, dict[str, float]]],
) -> tuple[float, list[float]]:
    """The shared host's ``call_core_share`` from the runs that timed a training step alone and
    two of them at once on disjoint devices (``PAIR_KIND``): each pair's time over the sum of
    its two steps alone, and their median, kept within [0.5, 1] (two equal calls at once take
    at least one's time and at most both's). 1.0 and no ratios where no run timed a pair."""
    ratios = [m[PAIR_KIND] / (2 * m["train"]) for _, _, m in measurements if PAIR_KIND in m]
    if not ratios:
        return 1.0, []
    return float(min(1.0, max(0.5, statistics.median(ratios)))), [round(r, 4) for r in ratios]


def _fit_linear(
    base: DeviceProfile, measurements: list[tuple[dict, int, dict[str, float]]], dtype: str
):
    """``fit_profile`` with ``base``'s fixed_device_exponent: the profile, the fits, and the
    sum of squared relative residuals of the forward, train and generate fits."""
    kinds = (
        ("forward", "forward_efficiency", "forward_layer_overhead_s"),
        ("train", "train_efficiency", "train_layer_overhead_s"),
        ("generate", "decode_efficiency", "decode_layer_overhead_s"),
    )
    profile = base
    fits = {}
    residual = 0.0
    for kind, eff_field, layer_field in kinds:
        once_field = layer_field.replace("_overhead_s", "_overhead_once_s")

        def model_time(prof, overrides, devices, microbatches, kind=kind):
            _, plan, w = _calibration_setup(overrides, dtype, devices, microbatches)
            if kind == "forward":
                return est.infer_seconds(w, "reference", plan["reference_infer"], prof)
            if kind == "train":
                return est.train_seconds(w, "actor", plan["actor_train"], prof) / w.train_steps
            return est.generate_seconds(w, plan["actor_generate"], prof)

        rates = EXTRA_RATES[kind] + (SHARED_HOST_RATES.get(kind, ()) if base.shared_host else ())
        rows, ys = [], []
        # (overrides, devices, measured seconds, micro-batches): every run's call of this kind,
        # and for training, the runs' micro-batched steps too
        cases = [(o, n, m[kind], 1) for o, n, m in measurements]
        if kind == "train":
            cases += [
                (o, n, m[MICROBATCH_KIND], MICROBATCHES)
                for o, n, m in measurements
                if MICROBATCH_KIND in m
            ]
        if kind == "generate":
            cases += [
                ({**o, "gen_len": SHORT_GEN_TOKENS}, n, m[SHORT_GEN_KIND], 1)
                for o, n, m in measurements
                if SHORT_GEN_KIND in m
            ]
        call_field = CALL_OVERHEADS.get(kind)
        for overrides, devices, seconds, mbs in cases:
            p0 = profile.replace(
                **{eff_field: 1.0, layer_field: 0.0, once_field: 0.0},
                **{field: 1.0 for field, _ in rates},
                **({call_field: 0.0} if call_field else {}),
            )
            t0 = model_time(p0, overrides, devices, mbs)
            t_half = model_time(p0.replace(**{eff_field: 2.0}), overrides, devices, mbs)
            t_layer = model_time(p0.replace(**{layer_field: 1e-3}), overrides, devices, mbs)
            t_once = model_time(p0.replace(**{once_field: 1e-3}), overrides, devices, mbs)
            work = 2 * (t0 - t_half)  # the term divided by efficiency, at efficiency 1
            layers = (t_layer - t0) / 1e-3  # the coefficient of the per-device layer overhead
            once = (t_once - t0) / 1e-3  # ... and of the once-per-call one
            # each extra rate's term at efficiency 1 (its time halves at efficiency 2)
            extra = [
                2 * (t0 - model_time(p0.replace(**{field: 2.0}), overrides, devices, mbs))
                for field, _ in rates
            ]
            fixed = t0 - work - sum(extra)
            scale = 1.0 / max(seconds, 1e-9)
            row = [work * scale, layers * scale]
            if profile.shared_host:  # elsewhere both overheads are paid alike: one unknown
                row.append(once * scale)
            if call_field:  # the coefficient of the per-call overhead
                t_call = model_time(p0.replace(**{call_field: 1e-3}), overrides, devices, mbs)
                row.append((t_call - t0) / 1e-3 * scale)
            rows.append(row + [e * scale for e in extra])
            ys.append((seconds - fixed) * scale)
        x = _nnls(np.array(rows), np.array(ys))
        residual += float(np.sum((np.array(rows) @ x - np.array(ys)) ** 2))
        inv_eff, layer_overhead = x[0], x[1]
        layer_once = x[2] if profile.shared_host else 0.0
        eff = 1.0 / inv_eff if inv_eff > 0 else 10.0
        eff = float(min(10.0, eff))
        profile = profile.replace(
            **{eff_field: eff, layer_field: float(layer_overhead), once_field: float(layer_once)}
        )
        fits[kind] = {
            "efficiency": eff,
            "layer_overhead_s": float(layer_overhead),
            "layer_overhead_once_s": float(layer_once),
        }
        if call_field:
            call = float(x[2 + profile.shared_host])
            profile = profile.replace(**{call_field: call})
            fits[kind]["call_overhead_s"] = call
        for (field, unpriced), inv in zip(rates, x[len(x) - len(rates) :]):
            value = float(min(10.0, 1.0 / inv)) if inv > 0 else unpriced
            profile = profile.replace(**{field: value})
            fits[kind][field] = value
    cases = []
    for overrides, devices, measured in measurements:
        _, plan, w = _calibration_setup(overrides, dtype, devices)
        cases.append((w, plan, measured["reshard"]))
    profile, fits["reshard"] = fit_reshard(profile, cases)
    return profile, fits, residual


def fit_reshard(
    profile: DeviceProfile, cases: Sequence[tuple[Workload, Any, float]]
) -> tuple[DeviceProfile, dict[str, Any]]:
    """Fit the resharder's terms of ``profile`` to measured reshards of the actor, given as
    (workload, plan, seconds): a fixed cost plus its bytes at a fitted fraction of the link
    bandwidth; where a move is between disjoint device sets, a cost per shard of its twin
    copy. On a shared host the bytes are two terms, the shards the collectives write and the
    target copy on every device; they get rates of their own only where the runs tell them
    apart (below). Moves between the same layouts alias their source and are left out: the
    estimator prices them at zero. Returns the profile and the fitted values."""
    shared = profile.shared_host
    p0 = profile.replace(
        reshard_overhead_s=0.0,
        reshard_efficiency=1.0,
        reshard_copy_efficiency=1.0,
        reshard_twin_shard_s=0.0,
    )
    rows, twins, ys = [], [], []
    for w, plan, measured in cases:
        edge = plan.reshard_edges()[0]
        if est.same_layout(w.actor, "lm", plan[edge.src], plan[edge.dst]):
            continue

        def seconds(w=w, edge=edge, plan=plan, **changes):
            return est.reshard_seconds(w, edge, plan, p0.replace(**changes))

        t0 = seconds()
        moved = 2 * (t0 - seconds(reshard_efficiency=2.0))  # at efficiency 1
        copy = 2 * (t0 - seconds(reshard_copy_efficiency=2.0)) if shared else 0.0
        twin = (seconds(reshard_twin_shard_s=1e-3) - t0) / 1e-3
        fixed = (seconds(reshard_overhead_s=1e-3) - t0) / 1e-3
        scale = 1.0 / max(measured, 1e-9)
        rows.append([fixed * scale, moved * scale] + ([copy * scale] if shared else []))
        twins.append(twin * scale)
        # less the collective latency (and, off a shared host, the copy at memory bandwidth)
        ys.append((measured - (t0 - moved - copy)) * scale)
    if not rows:  # one device, or only same layouts
        return profile, {"not_fitted": "every reshard measured aliases its source"}
    # Where every same-devices run's collectives write (nearly) its whole target, each device
    # receiving part of every parameter but the small replicated ones, the two byte terms are
    # as good as proportional and a fit of both only splits the noise between them (rates
    # that moved 1.3-2x between two plan-bench runs): one rate then prices both
    # (reshard_copy_efficiency 0 falls back to reshard_efficiency). A move between disjoint
    # devices does not tell them apart either: its twin copy's bytes come with a per-shard
    # cost that only such moves pay.
    a = np.array([row for row, t in zip(rows, twins) if t == 0])
    split = shared and len(a) > 1 and _cosine(a[:, 1], a[:, 2]) < 0.999
    if shared and not split:
        rows = [[fixed, moved + copy] for fixed, moved, copy in rows]
    fit_twin = any(t > 0 for t in twins)
    if fit_twin:
        rows = [[*row, t] for row, t in zip(rows, twins)]
    x = _nnls(np.array(rows), np.array(ys))

    def efficiency(inv: float) -> float:
        return float(min(10.0, 1.0 / inv)) if inv > 0 else 10.0

    profile = profile.replace(
        reshard_overhead_s=float(x[0]),
        reshard_efficiency=efficiency(x[1]),
        reshard_copy_efficiency=efficiency(x[2]) if split else 0.0,
        reshard_twin_shard_s=float(x[-1]) if fit_twin else 0.0,
    )
    return profile, {
        "overhead_s": profile.reshard_overhead_s,
        "efficiency": profile.reshard_efficiency,
        "copy_efficiency": profile.reshard_copy_efficiency,
        "twin_shard_s": profile.reshard_twin_shard_s,
    }


def calibrate(device_kind: str | None = None, quick: bool = False) -> DeviceProfile:
    """Measure this machine's devices (microbenchmarks, then the calibration models, each in
    interleaved rounds) and fit a profile. ``quick``: fewer sizes and rounds."""
    base = measure_base(device_kind, quick)
    timings = ModelTimings(model_runs(), compute_dtype())
    for _ in range(3 if quick else 5):
        timings.round()
    return fit_measured(base, timings.results())


def compute_dtype() -> str:
    """The dtype the calibration runs compute in: float32 on CPU, bfloat16 on accelerators."""
    return "float32" if jax.devices()[0].platform == "cpu" else "bfloat16"


def model_runs() -> list[tuple[dict[str, Any], int]]:
    """The calibration models' (overrides, devices) runs on this machine's devices."""
    n = jax.device_count()
    runs = [
        (CALIBRATION_MODELS[index], max(1, int(n * fraction)))
        for index, fraction in CALIBRATION_RUNS
    ]
    # a separated placement needs two devices at least
    return [
        (overrides, devices)
        for overrides, devices in runs
        if devices > 1 or overrides.get("placement", "flatten") == "flatten"
    ]


def measure_base(device_kind: str | None = None, quick: bool = False) -> DeviceProfile:
    """The microbenchmarks' profile, before any model is fitted: rates, call overhead and
    collectives; their raw numbers under ``measured`` (``fit_measured`` completes it)."""
    devices = jax.devices()
    platform = devices[0].platform
    n = len(devices)
    dtype = compute_dtype()
    jdtype = jnp.dtype(dtype)
    sizes = (256, 512) if quick else (256, 512, 1024)
    tasks = microbenchmark_tasks(sizes, jdtype, 32 if quick else 64, 8 if quick else 16)
    timed = measure_interleaved({k: fn for k, (fn, _) in tasks.items()}, 3 if quick else 5, 3)
    rate = {k: work / timed[k]["seconds"] for k, (_, work) in tasks.items()}
    mm = {str(s): rate[f"matmul_{s}"] for s in sizes}
    one = max(mm.values())
    all_devices = rate["matmul_all_devices"]
    # Fake CPU devices share the host's cores: n devices together are not n times faster.
    shared = platform == "cpu" and all_devices < 0.5 * n * one
    bw = rate["memory"]
    overhead = timed["call"]["seconds"]
    if n > 1:
        copy = rate["copy"]
        extra = {
            label: (
                tasks[f"allgather_{label}"][1],
                max(
                    0.0, timed[f"allgather_{label}"]["seconds"] - timed[f"local_{label}"]["seconds"]
                ),
            )
            for label in ("small", "large")
        }
        coll_bw, coll_latency = collective_fit(extra["small"], extra["large"], n, shared)
    else:
        copy = coll_bw = float("nan")
        coll_latency = 0.0
    # Collectives on one host (fake CPU devices, or one node's links) move at the all-gather's
    # measured rate; a device_put between two devices is a different path (host dispatch of a
    # whole-array copy), kept for reference.
    link = coll_bw if n > 1 and np.isfinite(coll_bw) else bw
    if platform == "cpu":
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // n
    else:
        stats = devices[0].memory_stats() or {}
        memory = int(stats.get("bytes_limit", 0)) or 80 * 2**30
    name = device_kind or (platform if platform == "cpu" else devices[0].device_kind)
    base = DeviceProfile(
        name=name,
        memory_bytes=int(memory),
        matmul_flops=float(max(one, all_devices) if shared else one),
        peak_flops=float(max(one, all_devices / n if not shared else all_devices)),
        memory_bandwidth=float(bw),
        intra_node_bandwidth=float(link),
        inter_node_bandwidth=float(link),
        devices_per_node=n,
        # on a shared host the measured call is n device programs on the same cores
        call_overhead_s=float(overhead / n if shared else overhead),
        collective_latency_s=float(coll_latency),
        shared_host=bool(shared),
        host_cores=_host_cores() if shared else 1,
        # Fake CPU devices and host memory are the same RAM: parking is a memcpy. A real
        # accelerator's host link is not measured here (0: offload is priced as impossible).
        host_bandwidth=float(bw) if shared else 0.0,
    )
    notes = (
        f"measured by python -m jrlhf.plan.calibrate on {n} x {platform} "
        f"({devices[0].device_kind}); compute dtype {dtype}."
    )
    if shared:
        notes += (
            " These are XLA's fake CPU devices: all of them are threads on the same cores and "
            "memory, so rates are for the whole machine (shared_host=true), work on n devices "
            "costs n x the per-device work, and calls on disjoint devices run at the same time "
            "only as far as one call leaves the cores idle (call_core_share, fitted from "
            "one-device training steps run in pairs). memory_bytes is host RAM / devices. "
            "The machine is shared with other jobs, so rates vary by tens of percent run to run."
            " host_bandwidth (not calibrated): the fake devices and pinned_host are both host "
            "RAM, so parking is a memcpy, priced at memory_bandwidth."
        )
    else:
        notes += " host_bandwidth not measured: set it to the host link's rate to price offload."
    measured = {
        "matmul_flops_one_device": mm,
        "matmul_flops_all_devices": all_devices,
        "memory_bandwidth": bw,
        "copy_bandwidth_device0_to_1": copy,
        "allgather_bandwidth": coll_bw,
        "allgather_latency_s": coll_latency,
        "call_overhead_s": overhead,
        "microbenchmark_spread": {k: round(v["spread"], 3) for k, v in timed.items()},
    }
    return base.replace(notes=notes, measured=measured)


def fit_measured(
    base: DeviceProfile,
    results: Sequence[tuple[dict[str, Any], int, dict[str, float], dict[str, float]]],
    dtype: str | None = None,
) -> DeviceProfile:
    """``base`` (``measure_base``) with the models fitted to ``results``
    (``ModelTimings.results``), which are kept under ``measured``; ``dtype``: what the rounds
    computed in (default: this machine's ``compute_dtype``, as a calibration here runs them)."""
    dtype = dtype or compute_dtype()
    profile, fits = fit_profile(base, [(o, k, m) for o, k, m, _ in results], dtype)
    models = [
        {"overrides": o, "devices": k, "seconds": m, "spread": sp, "dtype": dtype}
        for o, k, m, sp in results
    ]
    return profile.replace(measured={**base.measured, "models": models, "fits": fits})
