"""LoRA beside the full fine-tune on the arithmetic task: ``python -m jrlhf.bench lora``.

One SFT run of ``configs/arithmetic_grpo.gin`` (its ``sft`` stage, the whole model), then from
that same SFT policy two GRPO-stage runs with the same prompts, samples and iterations: the full
fine-tune at the config's learning rate, and rank-``--rank`` adapters on every projection
(base frozen) at ``--lora-lr`` (adapters take a larger rate, as is usual). Both runs place
generation on a device of its own (``RunConfig.placement='separate'`` on two host devices), so
the weight channel really moves the actor every iteration: ``reshard/bytes`` is what crossed.

Reported per run: held-out exact match before and after RL (the run's own summary.json, 4
samples per held-out prompt), wall time, bytes synced per iteration, and the bytes an
adapters-only sync would send (the design alternative jrlhf.ppo.weights explains); and for the
run's model and ``--presets`` (compiled for abstract state on one CPU device, nothing
allocated), XLA's memory analysis of the GRPO actor train step with and without LoRA: argument,
output, alias and temp bytes, and the peak (argument + output + temp - alias), plus the
optimizer-state bytes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from benchmarks.algorithms import CONFIG, run_train
from benchmarks.report import add_out_argument, check_out, emit


def _train_step_memory(cfg, lora, rows: int, P: int, R: int, rl) -> dict:
    """XLA's memory analysis of the GRPO actor train step (abstract state, one device)."""
    import jax
    import numpy as np

    from jrlhf.meshes.batch import shard_batch
    from jrlhf.meshes.mesh import make_mesh
    from jrlhf.models import lora as lora_lib
    from jrlhf.models.model_def import ModelDef
    from jrlhf.ppo.losses import actor_loss
    from jrlhf.runtime.steps import (
        OptimizerConfig,
        TrainState,
        make_optimizer,
        make_train_step,
        state_shardings,
    )

    model = ModelDef(cfg, "lm", lora)
    mesh = make_mesh("fsdp=1", devices=jax.devices()[:1])
    opt = make_optimizer(OptimizerConfig())
    shardings = state_shardings(model, opt, mesh, "fsdp_tp")
    abstract = jax.eval_shape(
        lambda p: TrainState(np.int32(0), p, opt.init(model.trainable(p))), model.abstract_params
    )
    state = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), abstract, shardings
    )
    T = P + R
    batch = {
        "tokens": np.ones((rows, T), np.int32),
        "positions": np.broadcast_to(np.arange(T, dtype=np.int32), (rows, T)).copy(),
        "segment_ids": np.ones((rows, T), np.int32),
        "response_tokens": np.ones((rows, R), np.int32),
        "mask": np.ones((rows, R), np.float32),
        "old_logprobs": np.zeros((rows, R), np.float32),
        "advantages": np.zeros((rows, R), np.float32),
        "ref_logprobs": np.zeros((rows, R), np.float32),
    }
    loss = actor_loss(P, rl, kl_in_loss=rl.kl_coef > 0)
    step = make_train_step(model, opt, loss, mesh, "fsdp_tp")
    t0 = time.perf_counter()
    compiled = step.jitted.lower(state, shard_batch(batch, mesh, "fsdp_tp")).compile()
    m = compiled.memory_analysis()
    peak = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
    peak -= m.alias_size_in_bytes
    return {
        "params": model.num_params(),
        "trained_params": lora_lib.count(model.trainable(model.abstract_params))[0],
        "opt_state_bytes": lora_lib.count(abstract.opt_state)[1],
        "argument_bytes": int(m.argument_size_in_bytes),
        "output_bytes": int(m.output_size_in_bytes),
        "alias_bytes": int(m.alias_size_in_bytes),
        "temp_bytes": int(m.temp_size_in_bytes),
        "peak_bytes": int(peak),
        "compile_s": round(time.perf_counter() - t0, 1),
    }


def _per_iteration(run_dir: Path, key: str) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "logs" / "grpo" / "metrics.jsonl").open()]
    return [r[key] for r in rows if key in r]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jrlhf.bench lora", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--runs", type=Path, required=True, help="directory for the runs")
    add_out_argument(parser)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--alpha", type=float, default=16.0)
    parser.add_argument("--lora-lr", type=float, default=3e-3)
    parser.add_argument("--sft-steps", type=int, default=0, help="0: the config's")
    parser.add_argument("--iterations", type=int, default=0, help="0: the config's")
    parser.add_argument(
        "--presets", nargs="*", default=["llama3_2_1b"],
        help="model presets whose train-step memory to analyse too (compile only)",
    )  # fmt: skip
    parser.add_argument(
        "--memory-shapes", nargs="*", default=["8x1024", "1x256"],
        help="ROWSxTOKENS minibatches of the presets' train step: activations dominate the "
        "first, parameters and optimizer state the second",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.runs.exists() and any(args.runs.iterdir()):
        parser.error(f"--runs {args.runs} is not empty")
    check_out(parser, args.out)
    args.runs.mkdir(parents=True, exist_ok=True)

    common = ["RunConfig.host_devices=2", f"RunConfig.seed={args.seed}"]
    if args.sft_steps:
        common.append(f"SFTConfig.steps={args.sft_steps}")
    if args.iterations:
        common.append(f"RLConfig.iterations={args.iterations}")
    sft_run = args.runs / "sft"
    sft_seconds = run_train(
        sft_run, [CONFIG], [*common, "RunConfig.stages=('sft',)"], args.runs / "sft.log"
    )
    start = f"'ckpt:{sft_run / 'sft'}'"
    rl_common = [
        *common,
        "RunConfig.stages=('grpo',)",
        "RunConfig.placement='separate'",
        f"actor/RoleConfig.init={start}",
        f"reference/RoleConfig.init={start}",
    ]
    lora_bindings = [
        f"actor/RoleConfig.lora_rank={args.rank}",
        f"actor/RoleConfig.lora_alpha={args.alpha}",
        f"actor/RoleConfig.learning_rate={args.lora_lr}",
    ]
    runs = {}
    for name, extra in (("full", []), ("lora", lora_bindings)):
        run_dir = args.runs / name
        seconds = run_train(run_dir, [CONFIG], [*rl_common, *extra], args.runs / f"{name}.log")
        summary = json.loads((run_dir / "summary.json").read_text())
        synced = _per_iteration(run_dir, "reshard/bytes")
        runs[name] = {
            "heldout_exact_match_before": summary["before"]["gt_score"],
            "heldout_exact_match_after": summary["after"]["gt_score"],
            "seconds": round(seconds, 1),
            "synced_bytes_per_iteration": statistics.fmean(synced) if synced else None,
            # the median: the first iteration's includes compiling the step
            "train_seconds_per_iteration": round(
                statistics.median(_per_iteration(run_dir, "time/train")), 4
            ),
        }
        print(f"{name}: {runs[name]}", file=sys.stderr)

    # The train step's memory: the run's model, then larger presets (compile only).
    import numpy as np

    from jrlhf import checkpoint
    from jrlhf.config import load_config
    from jrlhf.models import lora as lora_lib
    from jrlhf.models.lora import LoraConfig
    from jrlhf.models.presets import get_preset

    cfg = load_config([str(CONFIG)], [])
    lora = LoraConfig(args.rank, args.alpha)
    run_model = checkpoint.read_model_json(sft_run / "sft").config
    P, R = cfg.task.max_prompt_len, cfg.task.max_response_len
    shapes = {"arithmetic run model": (run_model, cfg.rl.minibatch_size, P, R)}
    for preset in args.presets:
        for shape in args.memory_shapes:
            rows, tokens = (int(n) for n in shape.split("x"))
            shapes[f"{preset} {shape}"] = (
                get_preset(preset),
                rows,
                tokens // 2,
                tokens - tokens // 2,
            )
    memory = {}
    for label, (model_cfg, rows, p, r) in shapes.items():
        full = _train_step_memory(model_cfg, None, rows, p, r, cfg.rl)
        low = _train_step_memory(model_cfg, lora, rows, p, r, cfg.rl)
        memory[label] = {
            "rows": rows,
            "tokens_per_row": p + r,
            "full": full,
            "lora": low,
            "peak_ratio_full_over_lora": round(full["peak_bytes"] / low["peak_bytes"], 3),
            "opt_state_ratio_full_over_lora": round(
                full["opt_state_bytes"] / low["opt_state_bytes"], 2
            ),
            "adapter_bytes": lora_lib.num_adapter_params(model_cfg, lora)
            * np.dtype(model_cfg.param_dtype).itemsize,
        }
        print(f"memory {label}: {memory[label]}", file=sys.stderr)
    adapter_bytes = memory["arithmetic run model"]["adapter_bytes"]
    runs["lora"]["adapters_only_sync_bytes"] = adapter_bytes  # the alternative, not what runs

    report = {
        "benchmark": "lora",
        "task": "arithmetic (configs/arithmetic_grpo.gin): SFT, then GRPO full vs LoRA",
        "metric": "held-out exact match, 4 samples per held-out prompt at temperature 1",
        "lora": {
            "rank": args.rank,
            "alpha": args.alpha,
            "targets": list(lora.targets),
            "learning_rate": args.lora_lr,
        },
        "overrides": common,
        "sft_seconds": round(sft_seconds, 1),
        "runs": runs,
        "train_step_memory": memory,
        "sync": "merged weights (jrlhf.ppo.weights): the full model's bytes each iteration",
    }
    emit(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
