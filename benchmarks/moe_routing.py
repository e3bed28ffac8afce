"""``python -m jrlhf.bench moe_routing``: how often a mixture-of-experts model's training pass
routes differently from its rollout, and what that does to the log-prob mismatch.

The decode engine generates sampled completions recording each layer's chosen experts
(``EngineConfig.record_routes``); one full training-style pass over prompt + completion then
routes the same tokens again. Prints one JSON object: the fraction of (token, layer) pairs and
of tokens whose expert sets differ, and the mean and max ``|rollout log-prob - training
log-prob|`` over all tokens, over the tokens routed differently and over the rest, per compute
dtype. ``--hf DIR`` reads a HF checkpoint (qwen3_moe or mixtral; prompts from the arithmetic
task when its vocabulary fits, else random tokens); without it a random tiny Qwen3-MoE model.
"""

from __future__ import annotations

import argparse

import numpy as np

from benchmarks.report import add_out_argument, check_out, emit
from jrlhf.devices import ensure_host_devices


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jrlhf.bench moe_routing", description=__doc__)
    p.add_argument("--hf", default="", help="HF checkpoint directory (default: a random model)")
    p.add_argument("--dtypes", default="float32,bfloat16", help="compute dtypes to measure")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--samples", type=int, default=4, help="samples per prompt")
    p.add_argument("--max-new", type=int, default=16)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    add_out_argument(p)
    args = p.parse_args(argv)
    check_out(p, args.out)
    return args


def _model(args, dtype):
    from jrlhf.meshes import make_mesh
    from jrlhf.models import ModelDef, hf
    from jrlhf.models.config import tiny_config

    mesh = make_mesh("fsdp=1")
    if args.hf:
        model, params = hf.load_hf(args.hf, mesh, "dp_tp", dtype=dtype)
        return model, params, mesh
    cfg = tiny_config(
        architecture="qwen3_moe",
        qk_norm=True,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        dtype=dtype,
    )
    model = ModelDef(cfg, "lm")
    return model, model.init_sharded(mesh, "dp_tp", seed=args.seed), mesh


def _prompts(args, vocab):
    from jrlhf.tasks.arithmetic import ArithmeticTask

    task = ArithmeticTask(seed=args.seed)
    if args.hf and task.vocab_size == vocab:
        return task.prompts(args.prompts, split="heldout"), task.max_prompt_len
    rng = np.random.default_rng(args.seed)
    return [rng.integers(3, vocab, size=8).tolist() for _ in range(args.prompts)], 8


def measure(args, dtype: str) -> dict:
    """The routing and log-prob mismatch of one compute dtype."""
    import jax

    from jrlhf.decode import DecodeEngine, EngineConfig, SamplingParams
    from jrlhf.models.logprobs import token_logprobs
    from jrlhf.models.moe import EXPERTS, routing_mismatch

    model, params, mesh = _model(args, dtype)
    prompts, max_prompt = _prompts(args, model.config.vocab_size)
    engine = DecodeEngine(
        model,
        mesh,
        "dp_tp",
        EngineConfig(
            num_slots=32,
            page_size=8,
            max_prompt_len=max_prompt,
            max_new_tokens=args.max_new,
            record_routes=True,
        ),
    )
    sampling = SamplingParams(
        temperature=args.temperature, num_samples=args.samples, seed=args.seed
    )
    out = engine.generate(params, prompts, sampling)
    rep = [prompts[i] for i in out.prompt_index]
    total = max(len(p) + len(c) for p, c in zip(rep, out.completion_ids))
    n = len(rep)
    tokens = np.zeros((n, total), np.int32)
    segments = np.zeros((n, total), np.int32)
    for i, (p, c) in enumerate(zip(rep, out.completion_ids)):
        tokens[i, : len(p) + len(c)] = p + c
        segments[i, : len(p) + len(c)] = 1
    positions = np.broadcast_to(np.arange(total, dtype=np.int32), (n, total))

    def train_pass(params):
        module = model.bind(params)
        hidden, stats = module.hidden(tokens, positions, segments, with_stats=True)
        return token_logprobs(module.logits(hidden)[:, :-1], tokens[:, 1:]), stats[EXPERTS]

    lp, experts = jax.device_get(jax.jit(train_pass)(params))
    rollout_routes, train_routes, gaps = [], [], []
    for i, (p, c) in enumerate(zip(rep, out.completion_ids)):
        col = slice(len(p) - 1, len(p) - 1 + len(c))
        rollout_routes.append(out.routes[i])
        train_routes.append(np.transpose(experts[:, i, col], (1, 0, 2)))
        gaps.append(np.abs(out.raw_logprobs[i] - lp[i, col]))
    rollout, train = np.concatenate(rollout_routes), np.concatenate(train_routes)
    gap = np.concatenate(gaps)
    flipped = np.any(np.sort(rollout, -1) != np.sort(train, -1), axis=(-1, -2))

    def stat(x):
        return {"mean": float(x.mean()), "max": float(x.max())} if x.size else None

    return {
        "tokens": int(gap.size),
        **routing_mismatch(rollout, train),
        "logprob_gap": stat(gap),
        "logprob_gap_routing_differs": stat(gap[flipped]),
        "logprob_gap_routing_same": stat(gap[~flipped]),
    }


def main(argv: list[str] | None = None) -> int:
    """Run the measurement and print one JSON object; returns the exit status."""
    args = _parse(list(argv or []))
    ensure_host_devices(8)
    report = {
        "model": args.hf or "random tiny qwen3_moe (8 experts, top-2)",
        "prompts": args.prompts,
        "samples_per_prompt": args.samples,
        "temperature": args.temperature,
        "by_dtype": {d: measure(args, d) for d in args.dtypes.split(",")},
    }
    emit(report, args.out)
    return 0
