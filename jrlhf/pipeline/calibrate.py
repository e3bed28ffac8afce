"""Measure a device profile for the cost estimator (``python -m jrlhf.plan.calibrate``).

Two kinds of short measurements, a minute or two in all:

1. Microbenchmarks: matmul throughput at a few sizes (one device, and all devices at once, which
   tells whether the devices share compute as XLA's fake CPU devices do), memory bandwidth (a
   streaming elementwise op), device-to-device copy bandwidth between two devices, and the fixed
   cost of one jitted call on all devices.
2. Short real profiles of small jrlhf models (two sizes, different from anything the plan bench
   evaluates): a forward (the trainer's log-prob call), a training step (the PPO actor loss with
   AdamW) and a generation (the paged-KV decode engine). Each measured time is fitted to the
   estimator's own cost model, which is linear in the unknowns: for every kind,
   ``measured = fixed + compute_at_full_efficiency / efficiency + layers x layer_overhead``,
   solved by non-negative least squares over the sizes.

The result is a ``DeviceProfile`` JSON; raw numbers go under ``measured``.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jrlhf.config import RLConfig
from jrlhf.decode import DecodeEngine, EngineConfig, SamplingParams
from jrlhf.meshes.mesh import make_mesh
from jrlhf.models.config import tiny_config
from jrlhf.models.model_def import ModelDef
from jrlhf.placement import estimator as est
from jrlhf.placement.plan import flatten
from jrlhf.placement.profile import DeviceProfile
from jrlhf.placement.workload import Workload
from jrlhf.ppo import batch as rl_batch
from jrlhf.ppo.trainer import actor_loss
from jrlhf.reshard import Resharder
from jrlhf.runtime.roles import make_infer
from jrlhf.runtime.steps import OptimizerConfig, init_train_state, make_optimizer, make_train_step

# calibration models: deliberately not the size the plan bench evaluates (held-out check)
CALIBRATION_MODELS = (
    dict(hidden_size=128, intermediate_size=384, num_layers=2, num_heads=4, num_kv_heads=2),
    dict(hidden_size=384, intermediate_size=1024, num_layers=3, num_heads=6, num_kv_heads=2),
)
# (model index, fraction of the devices): the half-device run separates per-device fixed costs
# (which a shared host pays once per device program) from compute
CALIBRATION_RUNS = ((0, 1.0), (1, 1.0), (0, 0.5))


def _time(fn, repeat: int = 5, warmup: int = 1) -> float:
    """Median seconds of ``fn()`` (which must block until its work is done)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ----------------------------------------------------------------------------- microbenchmarks
def matmul_flops(sizes=(256, 512, 1024), dtype=jnp.float32) -> dict[str, float]:
    """FLOP/s of an (s x s) @ (s x s) matmul on one device, per size."""
    out = {}
    dev = jax.devices()[0]
    f = jax.jit(lambda a, b: a @ b)
    for s in sizes:
        a = jax.device_put(jnp.ones((s, s), dtype), dev)
        b = jax.device_put(jnp.ones((s, s), dtype), dev)
        reps = max(1, int(2e9 // (2 * s**3)))  # enough work per timing to drown dispatch

        def run(a=a, b=b, reps=reps):
            for _ in range(reps):
                r = f(a, b)
            r.block_until_ready()

        out[str(s)] = reps * 2 * s**3 / _time(run, repeat=3)
    return out


def matmul_flops_all_devices(size: int = 512, dtype=jnp.float32) -> float:
    """Total FLOP/s when every device runs its own (s x s) matmul at the same time."""
    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("d",))
    sh = NamedSharding(mesh, PartitionSpec("d"))
    a = jax.device_put(jnp.ones((n, size, size), dtype), sh)
    f = jax.jit(lambda x: jnp.einsum("nij,njk->nik", x, x))
    reps = max(1, int(4e9 // (2 * n * size**3)))

    def run():
        for _ in range(reps):
            r = f(a)
        r.block_until_ready()

    return reps * 2 * n * size**3 / _time(run, repeat=3)


def memory_bandwidth(mbytes: int = 64) -> float:
    """Bytes/s of a streaming ``x * 2 + 1`` (read + write) on one device."""
    n = mbytes * 2**20 // 4
    x = jax.device_put(jnp.ones((n,), jnp.float32), jax.devices()[0])
    f = jax.jit(lambda v: v * 2.0 + 1.0)
    return 2 * n * 4 / _time(lambda: f(x).block_until_ready())


def copy_bandwidth(mbytes: int = 32) -> float:
    """Bytes/s of a device-to-device copy between the first two devices."""
    devs = jax.devices()
    if len(devs) < 2:
        return float("nan")
    n = mbytes * 2**20 // 4
    x = jax.device_put(jnp.ones((n,), jnp.float32), devs[0])
    return n * 4 / _time(lambda: jax.device_put(x, devs[1]).block_until_ready())


def call_overhead() -> float:
    """Seconds of one trivial jitted call over all devices, including the host sync."""
    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("d",))
    x = jax.device_put(jnp.ones((n * 8,), jnp.float32), NamedSharding(mesh, PartitionSpec("d")))
    f = jax.jit(lambda v: v + 1.0)
    return _time(lambda: f(x).block_until_ready(), repeat=51, warmup=3)


# ------------------------------------------------------------------------------ model profiles
def _calibration_setup(overrides: dict[str, Any], dtype: str, devices: int):

    cfg = tiny_config(vocab_size=64, max_position_embeddings=256, **overrides).replace(
        param_dtype="float32", dtype=dtype
    )
    plan = flatten(devices)
    w = Workload(
        actor=cfg,
        critic=None,
        reference=cfg,
        reward=None,
        prompts=32,
        samples_per_prompt=1,
        prompt_len=16,
        gen_len=16,
        epochs=1,
        minibatch_size=16,
        decode_chunk_steps=8,
    )
    return cfg, plan, w


def profile_model(overrides: dict[str, Any], dtype: str, devices: int) -> dict[str, float]:
    """Measured seconds of one forward, one train step, one generation and one reshard (train
    to generation layout) for a small model on the first ``devices`` devices."""
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

    infer = make_infer(model, mesh, train_p.rules, lambda m, b: rl_batch.response_logprobs(m, b, P))
    fields = ("tokens", "positions", "segment_ids", "response_tokens")
    fwd_batch = {k: arrays[k] for k in fields}

    # as the trainer's score phase does it: three calls dispatched back to back, then fetched
    def three_forwards():
        outs = [infer(params, fwd_batch) for _ in range(3)]
        return [np.asarray(o) for o in outs]

    forward = _time(three_forwards, repeat=5) / 3

    opt = make_optimizer(OptimizerConfig(learning_rate=1e-5))
    state = init_train_state(model, opt, mesh, train_p.rules, params=params)
    step = make_train_step(model, opt, actor_loss(P, RLConfig(), False), mesh, train_p.rules)
    mb = w.minibatch_size
    tb = {k: arrays[k][:mb] for k in (*fields, "mask")}
    tb.update(
        old_logprobs=np.zeros((mb, R), np.float32),
        advantages=rng.normal(size=(mb, R)).astype(np.float32),
        ref_logprobs=np.zeros((mb, R), np.float32),
        kl_coef=np.zeros((mb,), np.float32),
    )
    holder = {"state": state}

    def train_once():
        holder["state"], m = step(holder["state"], tb)
        jax.device_get(m)

    train = _time(train_once, repeat=5)

    gen_p = plan["actor_generate"]
    gen_mesh = make_mesh(gen_p.mesh)
    resharder = Resharder()
    gen_shardings = model.shardings(gen_mesh, gen_p.rules)
    gen_params = resharder(holder["state"].params, gen_shardings)
    reshard = _time(
        lambda: jax.block_until_ready(resharder(holder["state"].params, gen_shardings)), repeat=5
    )
    engine = DecodeEngine(
        model,
        gen_mesh,
        gen_p.rules,
        EngineConfig(
            num_slots=w.rows,
            page_size=8,
            max_prompt_len=P,
            max_new_tokens=R,
            chunk_steps=w.decode_chunk_steps,
            max_prefill_rows=min(w.rows, 64),
            min_prefill_len=min(16, P),
        ),
    )
    # no stop ids: every sample runs the full gen_len, as the cost model assumes
    sp = SamplingParams(seed=1, stop_ids=(), max_new_tokens=R)
    generate = _time(lambda: engine.generate(gen_params, prompts, sp), repeat=3)
    return {"forward": forward, "train": train, "generate": generate, "reshard": reshard}


def _nnls2(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares for two non-negative unknowns (columns of ``a``)."""
    best, best_err = np.zeros(2), float("inf")
    candidates = [np.linalg.lstsq(a, b, rcond=None)[0]]
    for j in range(2):  # one unknown pinned at zero
        col = a[:, j]
        x = np.zeros(2)
        x[j] = max(0.0, float(col @ b) / float(col @ col)) if col @ col > 0 else 0.0
        candidates.append(x)
    for x in candidates:
        if (x >= 0).all():
            err = float(np.sum((a @ x - b) ** 2))
            if err < best_err:
                best, best_err = x, err
    return best


def fit_profile(
    base: DeviceProfile, measurements: list[tuple[dict, int, dict[str, float]]], dtype: str
):
    """Fit efficiencies and per-layer overheads so the estimator reproduces ``measurements``.

    The estimator is linear in ``1/efficiency`` and in the layer overhead of each kind, so each
    coefficient is read off by evaluating it at two settings.
    """
    kinds = (
        ("forward", "forward_efficiency", "forward_layer_overhead_s"),
        ("train", "train_efficiency", "train_layer_overhead_s"),
        ("generate", "decode_efficiency", "decode_layer_overhead_s"),
    )
    profile = base
    fits = {}
    for kind, eff_field, layer_field in kinds:

        def model_time(prof, overrides, devices, kind=kind):
            _, plan, w = _calibration_setup(overrides, dtype, devices)
            if kind == "forward":
                return est.infer_seconds(w, "reference", plan["reference_infer"], prof)
            if kind == "train":
                return est.train_seconds(w, "actor", plan["actor_train"], prof) / w.train_steps
            return est.generate_seconds(w, plan["actor_generate"], prof)

        rows, ys = [], []
        for overrides, devices, measured in measurements:
            p0 = profile.replace(**{eff_field: 1.0, layer_field: 0.0})
            t0 = model_time(p0, overrides, devices)
            t_half = model_time(p0.replace(**{eff_field: 2.0}), overrides, devices)
            t_layer = model_time(p0.replace(**{layer_field: 1e-3}), overrides, devices)
            work = 2 * (t0 - t_half)  # the term divided by efficiency, at efficiency 1
            layers = (t_layer - t0) / 1e-3  # the coefficient of the layer overhead
            fixed = t0 - work
            rows.append([work, layers])
            ys.append(measured[kind] - fixed)
        inv_eff, layer_overhead = _nnls2(np.array(rows), np.array(ys))
        eff = 1.0 / inv_eff if inv_eff > 0 else 10.0
        eff = float(min(10.0, eff))
        profile = profile.replace(**{eff_field: eff, layer_field: float(layer_overhead)})
        fits[kind] = {"efficiency": eff, "layer_overhead_s": float(layer_overhead)}
    # the resharder: a fixed cost plus its bytes at a fitted fraction of the link bandwidth
    rows, ys = [], []
    for overrides, devices, measured in measurements:
        _, plan, w = _calibration_setup(overrides, dtype, devices)
        edge = plan.reshard_edges()[0]
        p0 = profile.replace(reshard_overhead_s=0.0, reshard_efficiency=1.0)
        rows.append([1.0, est.reshard_seconds(w, edge, plan, p0)])
        ys.append(measured["reshard"])
    overhead, inv_eff = _nnls2(np.array(rows), np.array(ys))
    profile = profile.replace(
        reshard_overhead_s=float(overhead),
        reshard_efficiency=float(min(10.0, 1.0 / inv_eff)) if inv_eff > 0 else 10.0,
    )
    fits["reshard"] = {
        "overhead_s": profile.reshard_overhead_s,
        "efficiency": profile.reshard_efficiency,
    }
    return profile, fits


def calibrate(device_kind: str | None = None, quick: bool = False) -> DeviceProfile:
    devices = jax.devices()
    platform = devices[0].platform
    n = len(devices)
    dtype = "float32" if platform == "cpu" else "bfloat16"
    jdtype = jnp.dtype(dtype)
    sizes = (256, 512) if quick else (256, 512, 1024)
    mm = matmul_flops(sizes, jdtype)
    one = max(mm.values())
    all_devices = matmul_flops_all_devices(512, jdtype)
    # Fake CPU devices share the host's cores: n devices together are not n times faster.
    shared = platform == "cpu" and all_devices < 0.5 * n * one
    bw = memory_bandwidth(32 if quick else 64)
    copy = copy_bandwidth(16 if quick else 32)
    overhead = call_overhead()
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
        intra_node_bandwidth=float(copy),
        inter_node_bandwidth=float(copy),
        devices_per_node=n,
        # on a shared host the measured call is n device programs on the same cores
        call_overhead_s=float(overhead / n if shared else overhead),
        collective_latency_s=0.0,
        shared_host=bool(shared),
    )
    measurements = []
    for index, fraction in CALIBRATION_RUNS:
        k = max(1, int(n * fraction))
        overrides = CALIBRATION_MODELS[index]
        measurements.append((overrides, k, profile_model(overrides, dtype, k)))
    profile, fits = fit_profile(base, measurements, dtype)
    notes = (
        f"measured by python -m jrlhf.plan.calibrate on {n} x {platform} "
        f"({devices[0].device_kind}); compute dtype {dtype}."
    )
    if shared:
        notes += (
            " These are XLA's fake CPU devices: all of them are threads on the same cores and "
            "memory, so rates are for the whole machine (shared_host=true), work on n devices "
            "costs n x the per-device work, and calls on disjoint devices do not overlap "
            "usefully - interleaving is not faster here. memory_bytes is host RAM / devices. "
            "The machine is shared with other jobs, so rates vary by tens of percent run to run."
        )
    measured = {
        "matmul_flops_one_device": mm,
        "matmul_flops_all_devices": all_devices,
        "memory_bandwidth": bw,
        "copy_bandwidth_device0_to_1": copy,
        "call_overhead_s": overhead,
        "models": [
            {"overrides": o, "devices": k, "seconds": m, "dtype": dtype} for o, k, m in measurements
        ],
        "fits": fits,
    }
    return profile.replace(notes=notes, measured=measured)
