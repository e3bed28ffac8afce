"""``python -m jrlhf.bench decode``: paged decode throughput, as one JSON object.

Two measurements, each on a random Llama of the given shape, greedy, after a warm-up call so
compiles are excluded:

* ``comparison``: paged decode vs a no-cache recompute loop on the same model, batch and lengths.
  The recompute loop keeps a fixed (batch, prompt + new) token buffer and runs the full forward
  pass over it at every step (one compile, like any jitted loop without a cache), taking the
  logits at the current position. Also reports pages used vs a dense max-length cache, with
  mixed prompt lengths so paging has something to save.
* ``throughput``: tokens/s of paged decode for a ~40M-parameter Llama (hidden 512, 8 layers,
  vocab 8192, batch 16, 64-token prompts, 128 new tokens, float32).

* ``turns``: multi-turn episodes against single-turn generation of the same total tokens on
  the throughput model: ``--turns`` turns of the policy, each but the last answered with
  ``--observation-tokens`` tokens (a constant handler), greedy, alternating repeat by repeat;
  tokens/s of all tokens and of the policy's, and the handler's host time.
* ``groups``: shared prompt prefixes for GRPO groups of 4 and 16 (``--groups``) on the throughput
  model: ``--batch`` samples (batch / group prompts), sampled at temperature 1, generated with
  ``EngineConfig.share_prefixes`` off and on. Reports KV pages taken and at peak, prefill rows and
  the prefill time (a generate call with one new token: prefill plus sampling the first token,
  best of ``--repeats``), the whole generate time, and whether both runs gave the same tokens.

On a GPU it also reports the achieved fraction of HBM bandwidth: (bytes of weights + KV read per
decode step) / step time / peak bandwidth (``--peak-gbps``, default from the device kind).

Elsewhere (CPU) the throughput run measures this machine's streaming read bandwidth in the same
process (a jitted sum over a 256 MiB array, best of a few, right after each timed call and once
more at the end: ``stream_read_gbps`` is the best of all, ``stream_read_gbps_after_each_call``
the rest) and reports tokens/s as a fraction of the weight-read limit: batch / (bytes of weights
read per decode step / bandwidth). The untied
embedding table is not counted (a step gathers one row per sequence from it). The limit is a
decode step's, and the prefill (matmul-bound) is part of the whole call's time, so the steps
after it are also reported alone: ``decode_steps_tokens_per_s`` (tokens after each sequence's
first, over the call's time less ``prefill_and_first_token_s``) and its
``fraction_of_weight_read_limit_decode_steps`` (the best call against the best stream), and
``..._paired``, the median over the timed calls of each call's steps against the stream measured
right after it (this machine's bandwidth drifts with its other tenants' load, by up to 2x within
a minute); ``fraction_of_read_limit_decode_steps`` is the
same rate against the limit of all the bytes a step reads, its sequences' K/V too
(``kv_bytes_read_per_step``, averaged over the steps). It also
times the step's matmuls alone at their decode shapes (a loop of the same projections on
``--batch`` rows, no attention) and large square matmuls (the machine's matmul peak): at batch 16
in float32 a step does 8 FLOPs per weight byte read, so where the peak FLOP/s over the bandwidth
is lower than that, the step is compute-bound and ``weight_read_fraction_at_matmul_peak``
(weight-read time over FLOPs at peak) bounds the fraction of the weight-read limit any
implementation can reach; ``roofline_step_ms`` is the longer of the step's bytes (weights and
K/V) at the stream rate and its matmul FLOPs at the peak, and
``fraction_of_roofline_decode_steps`` the decode steps' time against it.
``prefill_and_first_token_s`` times a generate call with one new token (best of ``--repeats``),
and ``matmul_limit_with_prefill_tokens_per_s`` is the whole call's rate if every step after it
cost only its matmuls (no attention, norms or sampling at all): an
upper bound on tokens/s for this engine's matmuls on this machine. ``--peers`` also
runs transformers' ``generate`` (greedy, float32, same batch, prompts and lengths) on the same
weights, exported with ``save_hf``, in a child process, alternating with the engine repeat by
repeat so both see the same machine load, and prints the ratio. ``--op-profile`` adds the
throughput call's device time by XLA op category (``op_profile``: a ``jax.profiler`` trace of
two more calls, read back in the process; see benchmarks/op_profile.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time

from benchmarks.report import add_out_argument, check_out, emit

_PEAK_GBPS = {"H100": 3350.0, "H200": 4800.0, "A100": 2039.0}


def _model(
    hidden: int,
    layers: int,
    vocab: int,
    heads: int,
    kv_heads: int,
    mlp: int,
    max_len: int,
    dtype: str,
):
    from jrlhf.models.config import ModelConfig
    from jrlhf.models.model_def import ModelDef

    cfg = ModelConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=mlp,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        max_position_embeddings=max(max_len, 2048),
        param_dtype=dtype,
        dtype=dtype,
        eos_token_id=None,
    )
    return ModelDef(cfg)


def _prompts(batch: int, prompt_len: int, vocab: int, mixed: bool, seed: int = 0):
    import numpy as np

    rng = np.random.default_rng(seed)
    lens = [prompt_len] * batch
    if mixed:  # lengths spread over [prompt_len / 4, prompt_len]
        lens = [
            max(1, int(prompt_len * (0.25 + 0.75 * i / max(batch - 1, 1)))) for i in range(batch)
        ]
    return [rng.integers(0, vocab, size=n).tolist() for n in lens]


def _peak_gbps(args) -> float | None:
    import jax

    if args.peak_gbps:
        return args.peak_gbps
    kind = jax.devices()[0].device_kind
    return next((v for k, v in _PEAK_GBPS.items() if k in kind), None)


def _engine(model_def, mesh, batch, prompt_len, new_tokens, args):
    from jrlhf.decode.engine import DecodeEngine, EngineConfig

    return DecodeEngine(
        model_def,
        mesh,
        "dp_tp",
        EngineConfig(
            num_slots=batch,
            page_size=args.page_size,
            max_prompt_len=prompt_len,
            max_new_tokens=new_tokens,
            chunk_steps=args.chunk_steps,
            max_prefill_rows=batch,
            kernel=args.kernel,
            weight_layout=args.weight_layout,
        ),
    )


def _paged(engine, params, prompts, new_tokens, args, peer=None, after=None):
    import jax

    from jrlhf.decode.sampling import SamplingParams

    model_def, page_size = engine.model_def, engine.config.page_size
    batch = len(prompts)
    prompt_len = engine.config.max_prompt_len
    sp = SamplingParams(greedy=True, stop_ids=())
    engine.generate(params, prompts, sp)  # warm-up: compiles
    if peer is not None:
        peer()
    best, peer_best = None, None
    runs = []  # (seconds, what ``after`` measured right after that call)
    for _ in range(args.repeats):
        out = engine.generate(params, prompts, sp)
        if best is None or out.stats["seconds"] < best.stats["seconds"]:
            best = out
        if after is not None:
            runs.append((float(out.stats["seconds"]), after()))
        if peer is not None:  # alternating, so both see the same machine load
            got = peer()
            if peer_best is None or got[0] < peer_best[0]:
                peer_best = got
    # The prefill alone (prompts in, one token out), for the bound a step of matmuls alone allows
    first = SamplingParams(greedy=True, stop_ids=(), max_new_tokens=1)
    engine.generate(params, prompts, first)
    prefill_s = min(
        float(engine.generate(params, prompts, first).stats["seconds"]) for _ in range(args.repeats)
    )
    tokens = int(best.stats["generated_tokens"])
    seconds = float(best.stats["seconds"])
    dense_pages = batch * math.ceil((prompt_len + new_tokens) / page_size)
    result = {
        "kernel": engine.kernel_name,
        "seconds": round(seconds, 4),
        "generated_tokens": tokens,
        "tokens_per_s": round(tokens / seconds, 1),
        "pages_used_peak": int(best.stats["peak_pages_used"]),
        "pages_dense_max_length": dense_pages,
        "page_size": page_size,
        "prefill_and_first_token_s": round(prefill_s, 4),
    }
    result["_completions"] = best.completion_ids
    result["_runs"] = runs
    if peer_best is not None:
        import transformers

        result["_peer"] = {
            "transformers": transformers.__version__,
            "seconds": round(peer_best[0], 4),
            "tokens_per_s": round(batch * new_tokens / peer_best[0], 1),
            "torch_threads": peer_best[2],
            "_completions": peer_best[1],
        }
    if jax.default_backend() == "gpu":
        weight_bytes = _weight_read_bytes(model_def)
        kv_bytes = _kv_read_bytes(model_def, prompts, new_tokens)
        step_s = seconds / new_tokens
        result["bytes_per_step"] = int(weight_bytes + kv_bytes)
        result["achieved_gbps"] = round((weight_bytes + kv_bytes) / step_s / 1e9, 1)
        peak = _peak_gbps(args)
        if peak:
            result["hbm_bandwidth_fraction"] = round(result["achieved_gbps"] / peak, 3)
    return result


def _groups(md, params, mesh, args) -> dict:
    """Shared prompt prefixes off vs on, for each group size (see module docstring)."""
    import numpy as np

    from jrlhf.decode.engine import DecodeEngine, EngineConfig
    from jrlhf.decode.sampling import SamplingParams

    def engine(share: bool):
        return DecodeEngine(
            md,
            mesh,
            "dp_tp",
            EngineConfig(
                num_slots=args.batch,
                page_size=args.page_size,
                max_prompt_len=args.prompt_len,
                max_new_tokens=args.new_tokens,
                chunk_steps=args.chunk_steps,
                max_prefill_rows=args.batch,
                kernel=args.kernel,
                weight_layout=args.weight_layout,
                share_prefixes=share,
            ),
        )

    engines = {share: engine(share) for share in (False, True)}
    out = {}
    for group in args.groups:
        if args.batch % group:
            raise SystemExit(f"--batch {args.batch} is not a multiple of group size {group}")
        prompts = _prompts(args.batch // group, args.prompt_len, args.vocab, mixed=False)
        full = SamplingParams(num_samples=group, seed=1, stop_ids=())
        first = SamplingParams(num_samples=group, seed=1, stop_ids=(), max_new_tokens=1)
        res = {}
        for sp, key in ((first, "prefill"), (full, "generate")):
            for eng in engines.values():
                eng.generate(params, prompts, sp)  # warm-up: compiles
            best = {}
            for _ in range(args.repeats):  # alternating, so both see the same machine load
                for share, eng in engines.items():
                    got = eng.generate(params, prompts, sp)
                    if share not in best or got.stats["seconds"] < best[share].stats["seconds"]:
                        best[share] = got
            res[key] = best
        row = {"prompts": len(prompts), "samples": args.batch}
        for share, name in ((False, "unshared"), (True, "shared")):
            pre, gen = res["prefill"][share], res["generate"][share]
            row[name] = {
                "prefill_rows": int(pre.stats["prefill_rows"]),
                "prefill_seconds": round(pre.stats["seconds"], 4),
                "pages_taken": int(gen.stats["pages_taken"]),
                "pages_peak": int(gen.stats["peak_pages_used"]),
                "generate_seconds": round(gen.stats["seconds"], 4),
                "tokens_per_s": round(gen.stats["generated_tokens"] / gen.stats["seconds"], 1),
            }
        a, b = res["generate"][False], res["generate"][True]
        row["pages_saved"] = row["unshared"]["pages_taken"] - row["shared"]["pages_taken"]
        row["pages_saved_fraction"] = round(row["pages_saved"] / row["unshared"]["pages_taken"], 3)
        row["prefill_seconds_saved"] = round(
            row["unshared"]["prefill_seconds"] - row["shared"]["prefill_seconds"], 4
        )
        row["prefill_speedup"] = round(
            row["unshared"]["prefill_seconds"] / row["shared"]["prefill_seconds"], 2
        )
        row["same_tokens"] = a.completion_ids == b.completion_ids
        row["max_logprob_diff"] = float(
            max(np.max(np.abs(x - y)) for x, y in zip(a.raw_logprobs, b.raw_logprobs))
        )
        out[f"group_{group}"] = row
    return out


def _turns(md, params, mesh, args) -> dict:
    """Multi-turn episodes against single-turn generation of the same total tokens (see module
    docstring): ``--turns`` turns of the policy, each but the last answered with
    ``--observation-tokens`` tokens, which the engine prefills into the slot's pages in one
    chunk (``programs.extend``)."""
    import numpy as np

    from jrlhf.decode.engine import DecodeEngine, EngineConfig
    from jrlhf.decode.sampling import SamplingParams
    from jrlhf.decode.turns import Turns

    n, k = args.turns, args.observation_tokens
    per_turn = (args.new_tokens - (n - 1) * k) // n
    if per_turn < 1:
        raise SystemExit(f"--new-tokens {args.new_tokens} leaves no sampled tokens per turn")
    total = n * per_turn + (n - 1) * k
    engine = DecodeEngine(
        md, mesh, "dp_tp",
        EngineConfig(
            num_slots=args.batch, page_size=args.page_size, max_prompt_len=args.prompt_len,
            max_new_tokens=total, chunk_steps=args.chunk_steps, max_prefill_rows=args.batch,
            kernel=args.kernel, weight_layout=args.weight_layout, max_observation_tokens=k,
        ),
    )  # fmt: skip
    prompts = _prompts(args.batch, args.prompt_len, args.vocab, mixed=False)
    observation = [int(t) for t in np.arange(k) % (args.vocab - 3) + 3]
    handler_s = []

    def handler(ends):
        t0 = time.perf_counter()
        out = [observation for _ in ends]
        handler_s[-1] += time.perf_counter() - t0
        return out

    turns = Turns(handler, max_tokens=per_turn)
    sp = SamplingParams(greedy=True, stop_ids=())
    runs = {"multi_turn": (turns, sp), "single_turn": (None, sp)}
    best: dict = {}
    for _ in range(args.repeats + 1):  # the first round compiles; alternating after it
        for name, (t, sampling) in runs.items():
            handler_s.append(0.0)
            got = engine.generate(params, prompts, sampling, turns=t)
            got.stats["handler_s"] = handler_s[-1]
            if name not in best or got.stats["seconds"] < best[name].stats["seconds"]:
                best[name] = got
    multi, single = best["multi_turn"], best["single_turn"]
    assert all(len(c) == total for c in multi.completion_ids + single.completion_ids)
    policy = int(sum(int(np.sum(m)) for m in multi.policy_masks))
    row = {
        "batch": args.batch, "prompt_len": args.prompt_len, "tokens_per_episode": total,
        "turns": n, "sampled_tokens_per_turn": per_turn, "observation_tokens": k,
    }  # fmt: skip
    for name, got in best.items():
        tokens = int(got.stats["generated_tokens"])
        row[name] = {
            "seconds": round(float(got.stats["seconds"]), 4),
            "tokens_per_s": round(tokens / got.stats["seconds"], 1),
            "decode_chunks": int(got.stats["decode_chunks"]),
            "handler_s": round(got.stats["handler_s"], 5),
        }
    row["multi_turn"]["policy_tokens_per_s"] = round(policy / multi.stats["seconds"], 1)
    row["multi_turn_over_single_turn_seconds"] = round(
        multi.stats["seconds"] / single.stats["seconds"], 3
    )
    return row


def _stream_gbps(mib: int = 256, repeats: int = 5) -> float:
    """Streaming read bandwidth of the default device: a jitted sum over ``mib`` MiB, best of
    ``repeats`` (the array is far larger than any cache)."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((mib * 2**20 // 4,), jnp.float32)
    total = jax.jit(jnp.sum)
    total(x).block_until_ready()
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        total(x).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return x.nbytes / best / 1e9


def _matmul_bound(model_def, batch: int, layout: str, steps: int = 64, repeats: int = 3) -> dict:
    """The decode step's matmuls alone, at its shapes and in the engine's weight layout
    (``layout``: see ``LayerWeights``): a jitted loop of ``steps`` steps of the per-layer
    projections (q, k, v, o, gate, up, down) and the LM head on ``batch`` rows, with fresh
    weights of the model's shapes and no attention, norms or sampling. Its time per step is
    what the step would cost if everything but the matmuls were free; its FLOP/s are this
    machine's matmul throughput at decode shapes."""
    import jax
    import jax.numpy as jnp

    from jrlhf.kernels.panels import fits, panel_matmul, to_panels
    from jrlhf.models.transformer import left_matmul

    c = model_def.config
    e, q, kv, f = (
        c.hidden_size,
        c.num_heads * c.head_dim,
        c.num_kv_heads * c.head_dim,
        c.intermediate_size,
    )
    dt = c.jnp_dtype
    shapes = [(e, q), (e, kv), (e, kv), (q, e), (e, f), (e, f), (f, e), (e, c.vocab_size)]
    keys = iter(jax.random.split(jax.random.key(1), len(shapes) * c.num_layers))
    weight = lambda shape: (0.02 * jax.random.normal(next(keys), shape)).astype(dt)  # noqa: E731
    if layout == "out_major":
        shapes = [(n, k) for k, n in shapes]
        mm = lambda x, w: left_matmul(w, x)  # noqa: E731
    elif layout == "panels":
        mm = panel_matmul
        plain = weight
        weight = lambda shape: to_panels(plain(shape))  # noqa: E731
    else:
        mm = jnp.matmul
    layers = [[weight(s) for s in shapes[:-1]] for _ in range(c.num_layers)]
    head_mm = mm
    if layout == "panels" and not fits(c.vocab_size):  # the engine keeps such a head out-major
        head = plain(shapes[-1][::-1])
        head_mm = lambda x, w: left_matmul(w, x)  # noqa: E731
    else:
        head = weight(shapes[-1])
    reps = q // kv

    @jax.jit
    def run(x, layers, head):
        def body(_, carry):
            x, acc = carry
            for wq, wk, wv, wo, wg, wu, wd in layers:
                a = mm(x, wq) + jnp.tile(mm(x, wk) + mm(x, wv), (1, reps))
                x = x + mm(a, wo)
                x = x + mm(jax.nn.silu(mm(x, wg)) * mm(x, wu), wd)
            # every logit is read, so no part of the head's product can be dropped
            return 0.5 * x, acc + head_mm(x, head).astype(jnp.float32).max()

        return jax.lax.fori_loop(0, steps, body, (x, jnp.float32(0)))

    x = jnp.ones((batch, e), dt)
    jax.block_until_ready(run(x, layers, head))
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(run(x, layers, head))
        best = min(best, time.perf_counter() - t0)
    flops = 2 * batch * (c.num_layers * sum(a * b for a, b in shapes[:-1]) + e * c.vocab_size)
    step = best / steps
    return {
        "matmul_weight_layout": layout,
        "matmul_flops_per_step": flops,
        "matmul_only_step_ms": round(step * 1e3, 3),
        "matmul_gflops_at_decode_shapes": round(flops / step / 1e9, 1),
        "matmul_limit_tokens_per_s": round(batch / step, 1),
    }


def _weight_read_bytes(model_def) -> int:
    """Bytes of parameters one decode step reads: all but an untied embedding table."""
    import jax

    c = model_def.config
    n = model_def.num_params()
    if not c.tie_word_embeddings:
        n -= c.vocab_size * c.hidden_size
    return n * jax.numpy.dtype(c.param_dtype).itemsize


def _kv_read_bytes(model_def, prompts, new_tokens: int) -> float:
    """Bytes of K and V a decode step reads, averaged over the steps: every layer's keys and
    values of each sequence's context (its prompt and half the new tokens, on average)."""
    import jax

    c = model_def.config
    itemsize = jax.numpy.dtype(c.dtype).itemsize
    avg_ctx = sum(len(p) for p in prompts) / len(prompts) + new_tokens / 2
    return 2 * c.num_layers * c.num_kv_heads * c.head_dim * itemsize * avg_ctx * len(prompts)


def _hf_peer(model_def, params, prompts, new_tokens, stack, threads: int = 0):
    """transformers' model on the same weights, in a child process (so torch's and XLA's thread
    pools never share one), ready for greedy ``generate`` over the same batch: returns a function
    that runs it once and gives (seconds, completions)."""
    import subprocess
    import tempfile

    from jrlhf.devices import allocator_defaults
    from jrlhf.models.hf import save_hf

    tmp = stack.enter_context(tempfile.TemporaryDirectory())
    save_hf(model_def, params, tmp, overwrite=True)
    with open(f"{tmp}/prompts.json", "w") as f:
        json.dump(prompts, f)
    cmd = [sys.executable, "-m", "benchmarks.decode", "--peer-worker", tmp, str(new_tokens)]
    cmd += ["--peer-threads", str(threads)]
    # glibc's allocator as a transformers user has it (jrlhf.devices.keep_host_memory)
    env = allocator_defaults(os.environ)
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    stack.callback(proc.wait)
    stack.callback(proc.stdin.close)

    def run():
        proc.stdin.write("run\n")
        proc.stdin.flush()
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError("the transformers peer process exited (see its stderr)")
        out = json.loads(line)
        return out["seconds"], out["completions"], out["threads"]

    return run


def _peer_worker(directory: str, new_tokens: int, threads: int) -> int:
    """The child of ``_hf_peer``: one timed greedy ``generate`` per "run" line on stdin."""
    import torch
    import transformers as tf

    if threads:
        torch.set_num_threads(threads)

    model = tf.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with open(f"{directory}/prompts.json") as f:
        ids = torch.tensor(json.load(f))  # equal lengths: no padding
    for _ in sys.stdin:
        with torch.no_grad():
            t0 = time.perf_counter()
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                pad_token_id=0,
            )
            seconds = time.perf_counter() - t0
        completions = out[:, ids.shape[1] :].tolist()
        out = {"seconds": seconds, "completions": completions, "threads": torch.get_num_threads()}
        print(json.dumps(out), flush=True)
    return 0


def _recompute(model_def, params, prompts, new_tokens, repeats: int):
    """Greedy loop without a cache: full forward over a fixed-length buffer at every step."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    batch = len(prompts)
    total = max(len(p) for p in prompts) + new_tokens
    buf = np.zeros((batch, total), np.int32)
    lens = np.array([len(p) for p in prompts], np.int32)
    for i, p in enumerate(prompts):
        buf[i, : len(p)] = p

    @jax.jit
    def run(params, buf, lens):
        def body(i, buf):
            logits = model_def.apply(params, buf)
            cur = lens + i - 1
            nxt = jnp.argmax(logits[jnp.arange(batch), cur], axis=-1).astype(jnp.int32)
            return buf.at[jnp.arange(batch), cur + 1].set(nxt)

        return jax.lax.fori_loop(0, new_tokens, body, buf)

    jax.block_until_ready(run(params, buf, lens))
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(run(params, buf, lens))
        best = min(best, time.perf_counter() - t0)
    out = np.asarray(run(params, buf, lens))
    completions = [out[i, len(p) : len(p) + new_tokens].tolist() for i, p in enumerate(prompts)]
    return {
        "_completions": completions,
        "seconds": round(best, 4),
        "generated_tokens": batch * new_tokens,
        "tokens_per_s": round(batch * new_tokens / best, 1),
    }


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark(s) and print one JSON object."""
    p = argparse.ArgumentParser(
        prog="python -m jrlhf.bench decode",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--only", choices=("comparison", "throughput", "groups", "turns"), default=None)
    p.add_argument("--turns", type=int, default=4, help="turns: the policy's turns per episode")
    p.add_argument(
        "--observation-tokens", type=int, default=16, help="turns: tokens of each observation"
    )
    p.add_argument(
        "--groups",
        type=lambda text: [int(g) for g in text.split(",")],
        default=[4, 16],
        help="groups: samples per prompt to compare with and without shared prefixes",
    )
    p.add_argument("--mesh", default=None, help='generation mesh, e.g. "data=2,tensor=4"')
    p.add_argument("--kernel", default="auto")
    p.add_argument(
        "--weight-layout",
        default=None,
        choices=("in_major", "out_major", "panels"),
        help="EngineConfig.weight_layout of the decode steps' weight copies (default: auto)",
    )
    p.add_argument("--chunk-steps", type=int, default=32)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--peak-gbps", type=float, default=None)
    p.add_argument(
        "--peers",
        action="store_true",
        help="throughput: also time transformers' generate on the same weights (needs torch)",
    )
    # comparison model (small, so the recompute loop finishes in seconds on 2 cores)
    p.add_argument("--cmp-hidden", type=int, default=128)
    p.add_argument("--cmp-layers", type=int, default=2)
    p.add_argument("--cmp-vocab", type=int, default=1024)
    p.add_argument("--cmp-batch", type=int, default=4)
    p.add_argument("--cmp-prompt-len", type=int, default=64)
    p.add_argument("--cmp-new-tokens", type=int, default=256)
    # throughput model (~40M parameters)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--mlp", type=int, default=2048)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--dtype", default="float32")
    p.add_argument(
        "--peer-threads",
        type=int,
        default=0,
        help="torch threads for --peers (0: torch's default; on a loaded machine its OpenMP "
        "threads can slow down many-fold, where 1 thread does not)",
    )
    p.add_argument(
        "--op-profile",
        action="store_true",
        help="throughput: also trace two generate calls and report their time by XLA op",
    )
    p.add_argument("--peer-worker", nargs=2, default=None, help=argparse.SUPPRESS)
    add_out_argument(p)
    args = p.parse_args(argv)
    check_out(p, args.out)
    if args.peer_worker:
        return _peer_worker(args.peer_worker[0], int(args.peer_worker[1]), args.peer_threads)

    from jrlhf.devices import ensure_host_devices

    if args.mesh:
        ensure_host_devices()
    import jax

    from jrlhf.meshes import make_mesh

    mesh = make_mesh(args.mesh or "data=1,tensor=1")
    out: dict = {
        "backend": jax.default_backend(),
        "device": jax.devices()[0].device_kind,
        "mesh": dict(mesh.shape),
    }
    if jax.default_backend() != "gpu":
        out["note"] = "no GPU: the Pallas kernel and HBM bandwidth figures were not measured"

    if args.only in (None, "comparison"):
        total = args.cmp_prompt_len + args.cmp_new_tokens
        md = _model(
            args.cmp_hidden,
            args.cmp_layers,
            args.cmp_vocab,
            4,
            2,
            4 * args.cmp_hidden,
            total,
            args.dtype,
        )
        params = md.init_sharded(mesh, "dp_tp", seed=0)
        prompts = _prompts(args.cmp_batch, args.cmp_prompt_len, args.cmp_vocab, mixed=False)
        engine = _engine(md, mesh, args.cmp_batch, args.cmp_prompt_len, args.cmp_new_tokens, args)
        paged = _paged(engine, params, prompts, args.cmp_new_tokens, args)
        recompute = _recompute(md, params, prompts, args.cmp_new_tokens, args.repeats)
        same = paged.pop("_completions") == recompute.pop("_completions")
        mixed_prompts = _prompts(args.cmp_batch, args.cmp_prompt_len, args.cmp_vocab, mixed=True)
        mixed = _paged(engine, params, mixed_prompts, args.cmp_new_tokens, args)
        out["comparison"] = {
            "model": {
                "hidden": args.cmp_hidden,
                "layers": args.cmp_layers,
                "vocab": args.cmp_vocab,
                "params": md.num_params(),
            },
            "batch": args.cmp_batch,
            "prompt_len": args.cmp_prompt_len,
            "new_tokens": args.cmp_new_tokens,
            "paged": paged,
            "recompute": recompute,
            "speedup": round(paged["tokens_per_s"] / recompute["tokens_per_s"], 2),
            "greedy_outputs_identical": same,
            "mixed_prompt_lengths_pages": {
                "pages_used_peak": mixed["pages_used_peak"],
                "pages_dense_max_length": mixed["pages_dense_max_length"],
            },
        }
        del params
    if args.only in (None, "throughput"):
        md = _model(
            args.hidden,
            args.layers,
            args.vocab,
            args.heads,
            args.kv_heads,
            args.mlp,
            args.prompt_len + args.new_tokens,
            args.dtype,
        )
        params = md.init_sharded(mesh, "dp_tp", seed=0)
        prompts = _prompts(args.batch, args.prompt_len, args.vocab, mixed=False)
        engine = _engine(md, mesh, args.batch, args.prompt_len, args.new_tokens, args)
        with contextlib.ExitStack() as stack:
            peer = None
            if args.peers:
                peer = _hf_peer(md, params, prompts, args.new_tokens, stack, args.peer_threads)
            # Off GPU, the stream rate is measured again right after each timed call, so that
            # each call has a limit taken under the same load from the machine's other tenants
            after = _stream_gbps if jax.default_backend() != "gpu" else None
            res = _paged(engine, params, prompts, args.new_tokens, args, peer=peer, after=after)
        completions = res.pop("_completions")
        runs = res.pop("_runs")
        if args.op_profile:
            from benchmarks.op_profile import op_profile
            from jrlhf.decode.sampling import SamplingParams

            greedy = SamplingParams(greedy=True, stop_ids=())
            res["op_profile"] = op_profile(lambda: engine.generate(params, prompts, greedy))
        if jax.default_backend() != "gpu":
            # the best rate seen in the run: the limit is the machine's, at its least loaded
            gbps = max([_stream_gbps(), *(g for _, g in runs)])
            read = _weight_read_bytes(md)
            limit = args.batch * gbps * 1e9 / read
            res["stream_read_gbps"] = round(gbps, 1)
            res["weight_bytes_read_per_step"] = read
            res["weight_read_limit_tokens_per_s"] = round(limit, 1)
            res["fraction_of_weight_read_limit"] = round(res["tokens_per_s"] / limit, 3)
            # The limit is a decode step's: every step after the first token reads the weights
            # once for ``batch`` tokens. The prefill before it (the prompts' tokens at once) is
            # bound by matmul throughput, not by the weights' read, so the steps alone are
            # measured against the limit too: tokens after the first ones over the time after
            # the prefill call's (``prefill_and_first_token_s``).
            steps_s = res["seconds"] - res["prefill_and_first_token_s"]
            if steps_s > 0:
                rate = (res["generated_tokens"] - args.batch) / steps_s
                res["decode_steps_tokens_per_s"] = round(rate, 1)
                res["fraction_of_weight_read_limit_decode_steps"] = round(rate / limit, 3)
                # Each timed call's steps against the limit measured right after it (the median
                # over ``--repeats`` calls): on a shared machine whose bandwidth drifts, a rate
                # and a limit taken at the same time, where the figure above sets the best call
                # against the best stream of the whole run.
                paired = [
                    (res["generated_tokens"] - args.batch)
                    / (t - res["prefill_and_first_token_s"])
                    / (args.batch * g * 1e9 / read)
                    for t, g in runs
                    if t > res["prefill_and_first_token_s"]
                ]
                res["seconds_each_call"] = [round(t, 4) for t, _ in runs]
                res["stream_read_gbps_after_each_call"] = [round(g, 1) for _, g in runs]
                if paired:
                    res["fraction_of_weight_read_limit_decode_steps_paired"] = round(
                        statistics.median(paired), 3
                    )
                # A step also reads its sequences' K/V (a third of the weights' bytes on the
                # bench model): the same steps against the limit of all the bytes they read
                kv = _kv_read_bytes(md, prompts, args.new_tokens)
                res["kv_bytes_read_per_step"] = int(kv)
                res["fraction_of_read_limit_decode_steps"] = round(
                    rate / (args.batch * gbps * 1e9 / (read + kv)), 3
                )
            # What the step's matmuls alone cost here: if this limit is below the weight-read
            # one, the step is bound by matmul throughput at batch ``batch``, not by bandwidth.
            res.update(_matmul_bound(md, args.batch, engine.weight_layout()))
            res["fraction_of_matmul_limit"] = round(
                res["tokens_per_s"] / res["matmul_limit_tokens_per_s"], 3
            )
            # The whole generate call if every step after the prefill cost only its matmuls:
            # what no attention, norm or sampling work at all would reach, prefill included.
            steps_after_prefill = args.new_tokens - 1
            res["matmul_limit_with_prefill_tokens_per_s"] = round(
                res["generated_tokens"]
                / (
                    res["prefill_and_first_token_s"]
                    + steps_after_prefill * res["matmul_only_step_ms"] / 1e3
                ),
                1,
            )
            # Even at the machine's best matmul rate (large square products), a step cannot
            # beat flops / peak: the best fraction of the weight-read limit reachable is then
            # (weight bytes / bandwidth) / (flops / peak).
            from benchmarks.rl import _matmul_peak  # one home for the peak measurement

            peak = _matmul_peak(2048, repeats=3)
            res["matmul_peak_gflops"] = round(peak / 1e9, 1)
            res["weight_read_fraction_at_matmul_peak"] = round(
                (read / (gbps * 1e9)) / (res["matmul_flops_per_step"] / peak), 3
            )
            if "decode_steps_tokens_per_s" in res:
                # The step's roofline on this machine: its bytes (weights and K/V) at the best
                # stream rate or its matmul FLOPs at the peak, whichever takes longer. At batch
                # 16 in float32 the two are close here, so a step near the roofline must keep
                # the memory and the multiply-adds busy at once.
                roofline_s = max((read + kv) / (gbps * 1e9), res["matmul_flops_per_step"] / peak)
                res["roofline_step_ms"] = round(roofline_s * 1e3, 3)
                res["fraction_of_roofline_decode_steps"] = round(
                    roofline_s / (args.batch / res["decode_steps_tokens_per_s"]), 3
                )
        if peer is not None:
            hf = res.pop("_peer")
            same = sum(a == b for a, b in zip(completions, hf.pop("_completions")))
            hf["greedy_sequences_identical"] = f"{same}/{len(completions)}"
            hf["jrlhf_over_transformers"] = round(res["tokens_per_s"] / hf["tokens_per_s"], 3)
            res["transformers"] = hf
        out["throughput"] = {
            "model": {
                "hidden": args.hidden,
                "layers": args.layers,
                "vocab": args.vocab,
                "heads": args.heads,
                "kv_heads": args.kv_heads,
                "mlp": args.mlp,
                "params": md.num_params(),
                "dtype": args.dtype,
            },
            "batch": args.batch,
            "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens,
            **res,
        }
    if args.only in (None, "groups"):
        md = _model(
            args.hidden,
            args.layers,
            args.vocab,
            args.heads,
            args.kv_heads,
            args.mlp,
            args.prompt_len + args.new_tokens,
            args.dtype,
        )
        params = md.init_sharded(mesh, "dp_tp", seed=0)
        out["groups"] = {
            "batch": args.batch,
            "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens,
            "page_size": args.page_size,
            "mlp": args.mlp,
            **_groups(md, params, mesh, args),
        }
    if args.only in (None, "turns"):
        md = _model(
            args.hidden, args.layers, args.vocab, args.heads, args.kv_heads, args.mlp,
            args.prompt_len + args.new_tokens, args.dtype,
        )  # fmt: skip
        params = md.init_sharded(mesh, "dp_tp", seed=0)
        out["turns"] = _turns(md, params, mesh, args)
    emit(out, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
