"""``python -m jrlhf.bench gpu``: the figures only an accelerator can give, as one JSON object.

Sections (``--sections``, default all, run in this order; each is written to ``--out`` as soon as
it finishes, so a run stopped early keeps what it measured; a section that fails records its
error and the others still run):

* ``ceilings``: the device's own limits, measured in this process: memory bandwidth as a copy
  (``x + 1`` over a ``--bandwidth-mib`` bf16 array: bytes read plus bytes written) and as a read
  (a sum over it: bytes read), and the bf16 matmul rate (``--matmul-size`` square products on
  random data). Each is the median of several timed batches of back-to-back calls. Also the
  host link: the same array parked in host memory and brought back the way the trainer offloads
  state (``to_host_gbps``, ``from_host_gbps``).
* ``kernel``: the paged-attention kernels (``pallas``: the compiled Pallas/Triton kernel on a
  GPU; ``blocked``; ``reference``) on random bf16 pools: relative error against the reference
  computed in float32 on the same (upcast) inputs, time per call, and the K/V bytes of the pages
  each call must read over that time, against the measured read bandwidth. Also the unit test's
  float32 case with out-of-range page ids.
* ``decode``: greedy paged decode (the trainer's ``DecodeEngine``) of bf16 Llamas of the shapes of
  ``--models`` (default Llama-3.2-1B and Llama-3-8B, random weights), ``--batch`` sequences of
  ``--prompt-len`` tokens and ``--new-tokens`` new ones, with each kernel of ``--decode-kernels``.
  A decode step's time is (full generate - a generate of one new token) / (new tokens - 1): the
  prefill and the first sampled token left out. Bytes a step must read: every weight but an untied
  input embedding (one row per sequence is gathered) plus the K/V of the mean context; their rate
  over the step time is reported as a fraction of the measured read bandwidth (the roofline).
  The kernels run with the engine's default layer loop (``unrolled_layers`` says what it chose);
  ``--decode-unroll`` and ``--decode-scan`` add the first kernel with the loop forced.
  ``--decode-einsum-prefill`` adds the first kernel with the prefill's attention in the einsum
  form (``ModelConfig.attention='einsum'``) instead of cuDNN's.
* ``train``: the actor's PPO train step (``make_train_step`` with the trainer's ``actor_loss``:
  forward, backward, AdamW, the update guard) on a ``--train-model`` shape with float32 parameters
  and bf16 compute, ``--train-batch`` rows of ``--train-prompt`` + ``--train-response`` tokens.
  Model FLOPs per step: jrlhf.placement.workload.train_flops_per_token x tokens ((6 x matmul
  weights + 12 x layers x hidden x sequence) per token: the LM head counted, the
  input-embedding gather not; attention's full square, as the model computes it). MFU is those
  FLOPs over the median step time, against the measured bf16 matmul rate and against the
  datasheet's dense bf16 peak where the device is known. One run per ``--train-attention``
  (``cudnn``: cuDNN flash attention; ``einsum``: float32 scores and probabilities materialized),
  on the same initial weights and batch.
* ``attention``: one layer's attention alone at the train shape (``--train-batch`` rows of
  ``--train-prompt`` + ``--train-response`` tokens, the heads of ``--train-model``, bf16, a
  causal mask), forward and forward + backward: ``einsum`` (float32 scores), ``cudnn_mask`` (the
  model's fused path: the boolean (position, segment) mask as a (B, 1, T, S) bias, whose gradient
  JAX's cuDNN wrapper always computes) and ``cudnn_causal`` (cuDNN's own causal mask, no bias:
  what the mask costs over the same kernel). Outputs and q/k/v gradients are compared with the
  einsum form's; ``bias_cost_per_train_step_ms`` is (cudnn_mask - cudnn_causal) forward +
  backward x layers. The cuDNN variants need a GPU.

On a machine without an accelerator every section still runs (``--small`` shrinks the shapes so
it takes seconds on a CPU); its figures are then the CPU's and say so in ``backend``.
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import sys
import time
import traceback

from benchmarks.report import add_out_argument, check_out, write

SECTIONS = ("ceilings", "kernel", "decode", "train", "attention")
# Datasheet dense bf16 matmul peaks (FLOP/s) and HBM bandwidths (GB/s), for reference only: the
# fractions this benchmark reports are against what it measures.
_DATASHEET = {
    "H200": {"bf16_flops": 989e12, "hbm_gbps": 4800.0},
    "H100": {"bf16_flops": 989e12, "hbm_gbps": 3350.0},
    "A100": {"bf16_flops": 312e12, "hbm_gbps": 2039.0},
}
_TINY = dict(
    vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
    num_kv_heads=2, param_dtype="bfloat16", dtype="bfloat16", max_position_embeddings=2048,
)  # fmt: skip


def _datasheet(kind: str) -> dict:
    return next((v for k, v in _DATASHEET.items() if k in kind), {})


def _timed(fn, calls: int, trials: int) -> float:
    """Median over ``trials`` of the seconds per call of ``calls`` back-to-back calls of ``fn``
    (one sync per trial, so dispatch overlaps execution as in a real loop); after one warm-up."""
    import jax

    jax.block_until_ready(fn())
    per_call = []
    for _ in range(trials):
        t0 = time.perf_counter()
        out = [fn() for _ in range(calls)]
        jax.block_until_ready(out)
        per_call.append((time.perf_counter() - t0) / calls)
        del out
    return statistics.median(per_call)


def jax_backend() -> str:
    import jax

    return jax.default_backend()


def _model_config(name: str, **overrides):
    from jrlhf.models.config import ModelConfig
    from jrlhf.models.presets import get_preset

    if name == "tiny":
        return ModelConfig(**{**_TINY, **overrides})
    return get_preset(name, **overrides)


# ------------------------------------------------------------------------------------- ceilings
def ceilings(args) -> dict:
    import jax
    import jax.numpy as jnp

    n = args.bandwidth_mib * 2**20 // 2
    x = jax.random.normal(jax.random.key(0), (n,), jnp.bfloat16)
    nbytes = x.nbytes
    add = jax.jit(lambda x: x + 1)
    total = jax.jit(lambda x: jnp.sum(x, dtype=jnp.float32))
    copy_s = _timed(lambda x=x: add(x), calls=10, trials=5)
    read_s = _timed(lambda x=x: total(x), calls=10, trials=5)
    m = args.matmul_size
    a = jax.random.normal(jax.random.key(1), (m, m), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(2), (m, m), jnp.bfloat16)
    dot = jax.jit(jnp.dot)
    mm_s = _timed(lambda: dot(a, b), calls=20, trials=5)
    return {
        "bandwidth_bytes": nbytes,
        "copy_gbps": round(2 * nbytes / copy_s / 1e9, 1),  # read + write
        "read_gbps": round(nbytes / read_s / 1e9, 1),
        "matmul_size": m,
        "matmul_bf16_tflops": round(2 * m**3 / mm_s / 1e12, 3),
        "host_link": _host_link(x),
    }


def _host_link(x) -> dict:
    """Device <-> host memory copy rates of ``x`` on the path the trainer parks state with
    (``jrlhf.reshard.park_to_host`` / ``restore_from_host``: the backend's host memory kind, or
    NumPy without one): what ``Memory.offload`` pays per byte (``DeviceProfile.host_bandwidth``).
    Each is the median of 5 timed copies after a warm-up."""
    import jax

    from jrlhf.reshard import park_to_host, restore_from_host

    to_host, from_host, path = [], [], None
    x = x + 0  # a copy: parking consumes its input
    for i in range(6):
        t0 = time.perf_counter()
        parked = park_to_host(x)
        t1 = time.perf_counter()
        x = restore_from_host(parked)
        jax.block_until_ready(x)
        t2 = time.perf_counter()
        path = parked.path
        if i:  # the first round allocates the host buffers
            to_host.append(t1 - t0)
            from_host.append(t2 - t1)
    return {
        "path": path,
        "bytes": x.nbytes,
        "to_host_gbps": round(x.nbytes / statistics.median(to_host) / 1e9, 2),
        "from_host_gbps": round(x.nbytes / statistics.median(from_host) / 1e9, 2),
    }


# --------------------------------------------------------------------------------------- kernel
def _kernel_case(key, batch, heads, kv_heads, head_dim, page_size, max_len, layers, dtype):
    """Random pools and a shuffled page table: every sequence gets its own pages, lengths spread
    over [1, max_len]."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(int(jax.random.randint(key, (), 0, 2**30)))
    per_seq = -(-max_len // page_size)
    pages = batch * per_seq
    k1, k2, k3 = jax.random.split(key, 3)
    shape = (layers, pages, page_size, kv_heads, head_dim)
    k_pool = jax.random.normal(k1, shape, jnp.float32).astype(dtype)
    v_pool = jax.random.normal(k2, shape, jnp.float32).astype(dtype)
    q = jax.random.normal(k3, (batch, heads, head_dim), jnp.float32).astype(dtype)
    table = rng.permutation(pages).reshape(batch, per_seq).astype(np.int32)
    lengths = rng.integers(1, max_len + 1, batch).astype(np.int32)
    return q, k_pool, v_pool, jnp.asarray(table), jnp.asarray(lengths)


def _rel_err(got, want) -> float:
    import numpy as np

    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if not np.isfinite(got).all():
        return float("nan")
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def kernel(args, bandwidth: dict) -> dict:
    import jax
    import jax.numpy as jnp

    from jrlhf.decode.kernels import paged_attention_reference, select_kernel

    names = list(args.kernels)
    out: dict = {}
    # The unit test's case (tests/decode/test_decode_kernels.py): float32, an out-of-range page id.
    ks = jax.random.split(jax.random.key(0), 3)
    small = (
        jax.random.normal(ks[2], (3, 4, 32)),
        jax.random.normal(ks[0], (2, 12, 16, 2, 32)),
        jax.random.normal(ks[1], (2, 12, 16, 2, 32)),
        jnp.int32(1),
        jnp.array([[3, 5, 7, 0], [1, 2, 12, 12], [11, 10, 9, 8]], jnp.int32),
        jnp.array([20, 5, 64], jnp.int32),
    )
    with jax.default_matmul_precision("highest"):
        want = paged_attention_reference(*small)
    out["float32_test_case_rel_err"] = {}
    for name in names:
        try:
            got = select_kernel(name)[1](*small)
            out["float32_test_case_rel_err"][name] = _rel_err(got, want)
        except Exception as e:  # a kernel that fails to compile is a result
            out["float32_test_case_rel_err"][name] = f"error: {type(e).__name__}: {e}"[:500]
    c = args.kernel_shape
    q, k_pool, v_pool, table, lengths = _kernel_case(
        jax.random.key(1), c["batch"], c["heads"], c["kv_heads"], c["head_dim"],
        c["page_size"], c["max_len"], 2, jnp.bfloat16,
    )  # fmt: skip
    layer = jnp.int32(1)
    f32 = [a.astype(jnp.float32) for a in (q, k_pool, v_pool)]
    with jax.default_matmul_precision("highest"):
        want = jax.jit(paged_attention_reference)(*f32, layer, table, lengths)
    pages_read = int(sum(-(-int(n) // c["page_size"]) for n in lengths))
    kv_bytes = 2 * pages_read * c["page_size"] * c["kv_heads"] * c["head_dim"] * 2
    rows = {}
    for name in names:
        try:
            fn = jax.jit(select_kernel(name)[1])
            got = fn(q, k_pool, v_pool, layer, table, lengths)
            err = _rel_err(got.astype(jnp.float32), want)
            secs = _timed(
                lambda fn=fn: fn(q, k_pool, v_pool, layer, table, lengths), *args.kernel_timing
            )
            gbps = kv_bytes / secs / 1e9
            rows[name] = {
                "rel_err_vs_float32_reference": err,
                "us_per_call": round(secs * 1e6, 1),
                "kv_gbps": round(gbps, 1),
                "fraction_of_read_bandwidth": round(gbps / bandwidth["read_gbps"], 3)
                if bandwidth.get("read_gbps")
                else None,
            }
        except Exception as e:
            rows[name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
    out["bf16_case"] = {**c, "layers": 2, "kv_bytes_read": kv_bytes, "kernels": rows}
    return out


# --------------------------------------------------------------------------------------- decode
def decode(args, bandwidth: dict) -> dict:
    import jax
    import numpy as np

    from benchmarks.decode import _weight_read_bytes
    from jrlhf.decode.engine import DecodeEngine, EngineConfig
    from jrlhf.decode.sampling import SamplingParams
    from jrlhf.meshes import make_mesh
    from jrlhf.models.model_def import ModelDef

    mesh = make_mesh("data=1,tensor=1")
    out = {}
    for name in args.models:
        cfg = _model_config(name, param_dtype="bfloat16", dtype="bfloat16")
        md = ModelDef(cfg)
        t0 = time.perf_counter()
        params = md.init_sharded(mesh, "dp_tp", seed=0)
        jax.block_until_ready(params)
        init_s = time.perf_counter() - t0
        rng = np.random.default_rng(0)
        prompts = [rng.integers(0, cfg.vocab_size, args.prompt_len).tolist()
                   for _ in range(args.batch)]  # fmt: skip
        weights = _weight_read_bytes(md)
        kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
        mean_ctx = args.prompt_len + args.new_tokens / 2
        step_bytes = weights + kv_per_token * mean_ctx * args.batch
        row: dict = {
            "params": md.num_params(),
            "weight_bytes_read_per_step": weights,
            "kv_bytes_read_per_step_mean": int(kv_per_token * mean_ctx * args.batch),
            "init_s": round(init_s, 2),
            "roofline_tokens_per_s": round(
                args.batch * bandwidth["read_gbps"] * 1e9 / step_bytes, 1
            )
            if bandwidth.get("read_gbps")
            else None,
            "kernels": {},
        }
        outputs = {}
        first_kernel, ps = args.decode_kernels[0], args.page_size
        variants = [(k, None, md, ps) for k in args.decode_kernels]
        if args.decode_unroll:  # the first kernel again, layers unrolled over per-layer copies
            variants.append((first_kernel, True, md, ps))
        if args.decode_scan:  # the first kernel again, layers scanned over the stacked weights
            variants.append((first_kernel, False, md, ps))
        if args.decode_einsum_prefill:  # the first kernel again, prefill attention not fused
            einsum = ModelDef(cfg.replace(attention="einsum"))
            variants.append((first_kernel, None, einsum, ps))
        # the first kernel again with other KV page sizes
        variants += [(first_kernel, None, md, n) for n in args.decode_page_sizes if n != ps]
        for kname, unroll, vmd, page_size in variants:
            label = kname + {None: "", True: "/unrolled", False: "/scan"}[unroll]
            label += "/einsum-prefill" if vmd is not md else ""
            label += f"/page{page_size}" if page_size != ps else ""
            try:
                engine = DecodeEngine(
                    vmd,
                    mesh,
                    "dp_tp",
                    EngineConfig(
                        num_slots=args.batch,
                        page_size=page_size,
                        max_prompt_len=args.prompt_len,
                        max_new_tokens=args.new_tokens,
                        chunk_steps=args.chunk_steps,
                        max_prefill_rows=args.batch,
                        kernel=kname,
                        unroll_layers=unroll,
                    ),
                )
                full = SamplingParams(greedy=True, stop_ids=())
                first = SamplingParams(greedy=True, stop_ids=(), max_new_tokens=1)
                t0 = time.perf_counter()
                engine.generate(params, prompts, full)  # compiles
                engine.generate(params, prompts, first)
                compile_s = time.perf_counter() - t0
                best_full, best_first = math.inf, math.inf
                # at least 3 of each: the step time is a difference of two best times
                # (--small: 2, shapes whose 31 steps stand clear of the noise)
                for _ in range(max(args.repeats, 2 if args.small else 3)):
                    res = engine.generate(params, prompts, full)
                    best_full = min(best_full, res.stats["seconds"])
                    first_s = engine.generate(params, prompts, first).stats["seconds"]
                    best_first = min(best_first, first_s)
                outputs[label] = (res.completion_ids, res.raw_logprobs)
                step_s = (best_full - best_first) / (args.new_tokens - 1)
                achieved = step_bytes / step_s / 1e9
                row["kernels"][label] = {
                    "unrolled_layers": bool(res.stats["unrolled_layers"]),
                    "warmup_and_compile_s": round(compile_s, 2),
                    "generate_s": round(best_full, 4),
                    "prefill_and_first_token_s": round(best_first, 4),
                    "tokens_per_s": round(args.batch * args.new_tokens / best_full, 1),
                    "decode_step_ms": round(step_s * 1e3, 3),
                    "decode_tokens_per_s": round(args.batch / step_s, 1),
                    "achieved_read_gbps": round(achieved, 1),
                    "fraction_of_read_roofline": round(achieved / bandwidth["read_gbps"], 3)
                    if bandwidth.get("read_gbps")
                    else None,
                }
                del engine
            except Exception as e:
                row["kernels"][label] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            gc.collect()
        names = list(outputs)
        row["agreement"] = {  # every variant against the first
            f"{names[0]} vs {b}": _agreement(outputs[names[0]], outputs[b]) for b in names[1:]
        }
        out[name] = row
        del params
        gc.collect()
    return {
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "chunk_steps": args.chunk_steps,
        "page_size": args.page_size,
        "models": out,
    }


def _agreement(a, b) -> dict:
    """How two greedy runs of one model agree. Random weights give nearly flat next-token
    distributions, so rounding differences between kernels flip near-ties and the sequences part
    ways; what must match is each step taken from the same context: the log-probs up to the first
    differing token (a wrong kernel differs from the first step on)."""
    import numpy as np

    (ta, la), (tb, lb) = a, b
    firsts, diffs = [], [0.0]
    for x, y, lx, ly in zip(ta, tb, la, lb):
        n = min(len(x), len(y))
        first = next((i for i in range(n) if x[i] != y[i]), n)
        firsts.append(first)
        upto = first + 1 if first < n else n  # the differing token's own log-prob too
        if upto:
            diffs.append(float(np.max(np.abs(np.asarray(lx[:upto]) - np.asarray(ly[:upto])))))
    return {
        "identical_sequences": f"{sum(x == y for x, y in zip(ta, tb))}/{len(ta)}",
        "first_difference_min": int(min(firsts)),
        "first_difference_median": float(np.median(firsts)),
        "max_logprob_diff_up_to_first_difference": max(diffs),
    }


# ---------------------------------------------------------------------------------------- train
def train(args, ceil: dict) -> dict:
    import jax
    import numpy as np

    from jrlhf.config import RLConfig
    from jrlhf.data.batch import pack
    from jrlhf.meshes import make_mesh
    from jrlhf.models.model_def import ModelDef
    from jrlhf.placement.workload import train_flops_per_token
    from jrlhf.ppo.losses import actor_loss
    from jrlhf.runtime.steps import (
        OptimizerConfig,
        init_train_state,
        make_optimizer,
        make_train_step,
    )

    P, R, B = args.train_prompt, args.train_response, args.train_batch
    mesh = make_mesh("fsdp=1,tensor=1")
    opt = make_optimizer(OptimizerConfig(learning_rate=1e-5))
    base = _model_config(args.train_model, param_dtype="float32", dtype="bfloat16")
    rng = np.random.default_rng(0)
    batch = pack(
        [rng.integers(1, base.vocab_size, P).tolist() for _ in range(B)],
        [rng.integers(1, base.vocab_size, R).tolist() for _ in range(B)],
        P,
        R,
    )
    batch = {k: batch[k] for k in ("tokens", "positions", "segment_ids", "response_tokens", "mask")}
    batch.update(
        old_logprobs=np.full((B, R), -np.log(base.vocab_size), np.float32),
        advantages=rng.normal(size=(B, R)).astype(np.float32),
    )
    seq = P + R
    flops = train_flops_per_token(base, seq) * B * seq
    sheet = _datasheet(jax.devices()[0].device_kind)

    def one(attention: str) -> dict:
        cfg = base.replace(remat_policy=args.remat, layer_loop="scan", attention=attention)
        model = ModelDef(cfg)
        state = init_train_state(model, opt, mesh, "fsdp_tp")
        step = make_train_step(model, opt, actor_loss(P, RLConfig(), False), mesh, "fsdp_tp")
        holder = {"state": state}

        def run():
            holder["state"], metrics = step(holder["state"], batch)
            return metrics

        t0 = time.perf_counter()
        first = jax.device_get(run())
        compile_s = time.perf_counter() - t0
        times = []
        for _ in range(args.train_steps):
            t0 = time.perf_counter()
            metrics = jax.device_get(run())
            times.append(time.perf_counter() - t0)
        step_s = statistics.median(times)
        achieved = flops / step_s
        mem = jax.devices()[0].memory_stats() or {}
        holder.clear()  # the train state's buffers go before the next run
        gc.collect()
        return {
            "first_step_s": round(compile_s, 2),
            "step_median_s": round(step_s, 4),
            "step_runs_s": [round(t, 4) for t in times],
            "tokens_per_s": round(B * seq / step_s, 1),
            "achieved_tflops": round(achieved / 1e12, 2),
            "mfu_vs_measured_matmul": round(achieved / (ceil["matmul_bf16_tflops"] * 1e12), 4)
            if ceil.get("matmul_bf16_tflops")
            else None,
            "mfu_vs_datasheet": round(achieved / sheet["bf16_flops"], 4) if sheet else None,
            "loss_first_last": [float(first["loss"]), float(metrics["loss"])],
            "skipped_updates": float(first["skipped"]) + float(metrics["skipped"]),
            # the process's peak so far: the runs go in --train-attention order
            "peak_bytes_in_use_so_far": mem.get("peak_bytes_in_use"),
        }

    return {
        "model": args.train_model,
        "params": ModelDef(base).num_params(),
        "param_dtype": "float32",
        "compute_dtype": "bfloat16",
        "remat_policy": args.remat,
        "batch": B,
        "prompt": P,
        "response": R,
        "sequence": seq,
        "tokens_per_step": B * seq,
        "model_flops_per_step": flops,
        "attention": {a: one(a) for a in args.train_attention},
    }


# ------------------------------------------------------------------------------------ attention
def attention(args) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jrlhf.models.attention import attention_mask, fused_attention, masked_attention

    cfg = _model_config(args.train_model)
    b, t = args.train_batch, args.train_prompt + args.train_response
    h, kv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    keys = jax.random.split(jax.random.key(3), 4)
    q = jax.random.normal(keys[0], (b, t, h, d), jnp.bfloat16)
    k = jax.random.normal(keys[1], (b, t, kv, d), jnp.bfloat16)
    v = jax.random.normal(keys[2], (b, t, kv, d), jnp.bfloat16)
    cotangent = jax.random.normal(keys[3], (b, t, h, d), jnp.bfloat16)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    mask = attention_mask(pos, pos, jnp.ones_like(pos), jnp.ones_like(pos))
    variants = {"einsum": lambda q, k, v: masked_attention(q, k, v, mask)}
    if jax.default_backend() == "gpu":
        variants["cudnn_mask"] = lambda q, k, v: fused_attention(q, k, v, mask)
        variants["cudnn_causal"] = lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation="cudnn"
        )
    calls, trials = (2, 2) if args.small else (10, 5)
    rows, results = {}, {}
    for name, fn in variants.items():
        fwd = jax.jit(fn)
        fwd_bwd = jax.jit(lambda q, k, v, fn=fn: jax.vjp(fn, q, k, v)[1](cotangent))
        results[name] = [np.asarray(x, np.float32) for x in (fwd(q, k, v), *fwd_bwd(q, k, v))]
        rows[name] = {
            "forward_ms": round(1e3 * _timed(lambda f=fwd: f(q, k, v), calls, trials), 3),
            "forward_backward_ms": round(
                1e3 * _timed(lambda f=fwd_bwd: f(q, k, v), calls, trials), 3
            ),
        }
    ref = results["einsum"]
    for name in rows:  # relative to the einsum form's largest magnitude (bf16 outputs)
        rows[name]["max_rel_diff_vs_einsum"] = {
            part: float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-30))
            for part, got, want in zip(("out", "dq", "dk", "dv"), results[name], ref)
        }
    out = {
        "model": args.train_model,
        "batch": b,
        "sequence": t,
        "heads": h,
        "kv_heads": kv,
        "head_dim": d,
        "variants": rows,
    }
    if "cudnn_causal" in rows:
        extra = (
            rows["cudnn_mask"]["forward_backward_ms"] - rows["cudnn_causal"]["forward_backward_ms"]
        )
        out["bias_cost_per_train_step_ms"] = round(extra * cfg.num_layers, 2)
    else:
        out["note"] = "no GPU: the cuDNN variants did not run"
    return out


# ----------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m jrlhf.bench gpu",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--sections", default=",".join(SECTIONS))
    p.add_argument("--small", action="store_true", help="shapes that run in seconds on a CPU")
    p.add_argument("--bandwidth-mib", type=int, default=2048)
    p.add_argument("--matmul-size", type=int, default=8192)
    p.add_argument("--kernels", default="pallas,blocked,reference")
    p.add_argument("--models", default="llama3_2_1b,llama3_8b")
    p.add_argument("--decode-kernels", default="pallas,blocked")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--chunk-steps", type=int, default=32)
    p.add_argument("--page-size", type=int, default=16, help="decode: KV page size (tokens)")
    p.add_argument(
        "--decode-page-sizes",
        default="",
        help="decode: also run the first kernel with each of these page sizes (comma-separated)",
    )
    p.add_argument(
        "--decode-unroll",
        action="store_true",
        help="decode: also run the first kernel with EngineConfig.unroll_layers=True",
    )
    p.add_argument(
        "--decode-scan",
        action="store_true",
        help="decode: also run the first kernel with EngineConfig.unroll_layers=False",
    )
    p.add_argument(
        "--decode-einsum-prefill",
        action="store_true",
        help="decode: also run the first kernel with ModelConfig.attention='einsum' (the "
        "prefill's attention not fused)",
    )
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--train-model", default="llama3_2_1b")
    p.add_argument("--train-batch", type=int, default=8)
    p.add_argument("--train-prompt", type=int, default=256)
    p.add_argument("--train-response", type=int, default=768)
    p.add_argument("--train-steps", type=int, default=5)
    p.add_argument("--remat", default="none")
    p.add_argument(
        "--train-attention",
        default="cudnn,einsum",
        help="train: ModelConfig.attention of each run, in order (cudnn needs a GPU)",
    )
    add_out_argument(p)  # written after every section
    args = p.parse_args(argv)
    check_out(p, args.out)
    sections = args.sections.split(",")
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        raise SystemExit(f"bench gpu: unknown section(s) {unknown} (known: {', '.join(SECTIONS)})")
    args.kernel_shape = dict(batch=64, heads=32, kv_heads=8, head_dim=128, page_size=16,
                             max_len=2048)  # fmt: skip
    args.kernel_timing = (20, 5)  # calls per timed batch, batches
    if args.small:
        args.bandwidth_mib, args.matmul_size = 16, 256
        args.kernels = args.kernels.replace("pallas,", "pallas_interpret,")
        args.kernel_shape = dict(batch=4, heads=4, kv_heads=2, head_dim=32, page_size=16,
                                 max_len=64)  # fmt: skip
        args.kernel_timing = (1, 1)  # interpret-mode Pallas is slow on a CPU
        args.models, args.decode_kernels = "tiny", "blocked,reference"
        # 31 decode steps, so that a step's time (a whole call less the prefill call) stands
        # clear of a loaded machine's noise: with 7, one CI run measured -0.001 ms
        args.batch, args.prompt_len, args.new_tokens, args.chunk_steps = 4, 16, 32, 8
        args.train_model, args.train_batch, args.train_prompt = "tiny", 2, 16
        args.train_response, args.train_steps, args.repeats = 16, 2, 1
        if jax_backend() != "gpu":
            args.train_attention = "einsum"
    args.kernels = args.kernels.split(",")
    args.models = args.models.split(",")
    args.decode_kernels = args.decode_kernels.split(",")
    args.decode_page_sizes = [int(n) for n in args.decode_page_sizes.split(",") if n]
    args.train_attention = args.train_attention.split(",")

    import jax

    dev = jax.devices()[0]
    out: dict = {
        "benchmark": "gpu",
        "backend": jax.default_backend(),
        "device": dev.device_kind,
        "jax": jax.__version__,
        "datasheet": _datasheet(dev.device_kind),
    }
    if jax.default_backend() != "gpu":
        out["note"] = "no GPU: these are this machine's figures, not an accelerator's"

    def save():
        return write(out, args.out)

    runners = {
        "ceilings": lambda: ceilings(args),
        "kernel": lambda: kernel(args, out.get("ceilings", {})),
        "decode": lambda: decode(args, out.get("ceilings", {})),
        "train": lambda: train(args, out.get("ceilings", {})),
        "attention": lambda: attention(args),
    }
    failed = False
    for name in sections:
        t0 = time.perf_counter()
        try:
            out[name] = runners[name]()
        except Exception as e:  # record it, run the other sections
            failed = True
            out[name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            traceback.print_exc()
        out[name]["section_s"] = round(time.perf_counter() - t0, 1)
        print(f"bench gpu: {name} done in {out[name]['section_s']} s", file=sys.stderr)
        save()
        gc.collect()
    print(save())
    return 1 if failed else 0
