"""``python -m jrlhf.bench fusion``: time to a scored batch with and without inter-stage fusion.

On the long-tailed task (configs/longtail_ppo.gin; jrlhf/tasks/longtail.py) a tiny actor is first
fine-tuned (``--sft-steps`` of the SFT stage) so that its response lengths follow the prompts' long-
tailed targets. Then one PPO trainer is built as ``python -m jrlhf.train`` builds it (reference from
the SFT checkpoint, random reward model and critic) and its rollout is timed on one batch of
prompts, fused (Fusion.enabled: finished rows scored ``--score-rows`` at a time while the tail
decodes) and unfused (generate, then score everything), and with ``--migrate-rows N`` also fused
with migration (Fusion.migrate_rows: the last N decoding rows move to one replica of the
generation mesh), alternating, after one warm-up of each (compiles). The runs give the same
samples (checked) and the same scores to float rounding (the largest difference is reported).

One JSON object on stdout: the measured medians and ratio, the batch's length distribution, the
fused rollout's chunk counts, and jrlhf.placement.estimator.fused_rollout_seconds' prediction for
the same plan and lengths on the ``--profile`` device profile (by default the CPU one, which
serializes calls on this one process: there fusion cannot overlap scoring with decode).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.report import add_out_argument, check_out, emit
from jrlhf.devices import ensure_host_devices

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "longtail_ppo.gin"


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m jrlhf.bench fusion", description=__doc__)
    p.add_argument("--devices", type=int, default=8, help="fake CPU devices (without a GPU)")
    p.add_argument("--placement", default="flatten", help="RunConfig.placement")
    p.add_argument("--prompts", type=int, default=32, help="prompts per batch")
    p.add_argument("--score-rows", type=int, default=8, help="Fusion.score_rows")
    p.add_argument("--chunk-steps", type=int, default=8, help="DecodeConfig.chunk_steps")
    p.add_argument("--sft-steps", type=int, default=150, help="SFT steps before timing")
    p.add_argument("--repeats", type=int, default=3, help="timed rollouts of each kind")
    p.add_argument("--profile", default="cpu", help="device profile of the prediction")
    p.add_argument(
        "--migrate-rows",
        type=int,
        default=8,
        help="Fusion.migrate_rows of a third variant (0: none)",
    )
    add_out_argument(p)
    args = p.parse_args(argv)
    check_out(p, args.out)
    return args


def _bindings(args) -> list[str]:
    return [
        f"RunConfig.host_devices={args.devices}",
        f"RunConfig.placement='{args.placement}'",
        "RunConfig.tensorboard=False",
        "RunConfig.progress_bar=False",
        "TaskConfig.num_heldout=8",
        f"SFTConfig.steps={args.sft_steps}",
        "SFTConfig.checkpoint_every=0",
        f"RLConfig.prompts_per_iteration={args.prompts}",
        f"RLConfig.minibatch_size={args.prompts}",
        "Fusion.enabled=True",
        f"Fusion.score_rows={args.score_rows}",
        f"DecodeConfig.chunk_steps={args.chunk_steps}",
        f"Fusion.migrate_rows={args.migrate_rows}",
    ]


def _trainer(args, run_dir: Path):
    """The PPO trainer on the long-tailed task, its config and the effective plan."""
    import jax

    from jrlhf.config import load_config
    from jrlhf.pipeline.task_data import build_task_data
    from jrlhf.placement import effective_plan
    from jrlhf.ppo.trainer import RLTrainer
    from jrlhf.runtime.model_source import resolve_model
    from jrlhf.runtime.roles import setup_role

    sft = run_dir / "sft"
    bindings = [
        *_bindings(args),
        "RunConfig.stages=('ppo',)",
        f"actor/RoleConfig.init='ckpt:{sft}'",
        f"reference/RoleConfig.init='ckpt:{sft}'",
        "reward/RoleConfig.init='tiny'",
        "critic/RoleConfig.init='tiny'",
    ]
    cfg = load_config([str(CONFIG)], bindings)
    data = build_task_data(cfg)
    plan = effective_plan(cfg, jax.device_count(), None)
    roles = {
        role: setup_role(cfg, role, plan, resolve_model(cfg, role, data.model_overrides, run_dir))
        for role in ("actor", "reference", "reward", "critic")
    }
    trainer = RLTrainer(cfg, "ppo", roles, plan, data, run_dir / "ppo")
    return trainer, cfg, plan, data


def main(argv=None) -> int:
    args = _parse(argv)
    ensure_host_devices(args.devices)
    import numpy as np

    from jrlhf.cli import train
    from jrlhf.placement.estimator import fused_rollout_seconds
    from jrlhf.placement.profile import DeviceProfile
    from jrlhf.placement.workload import Workload

    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        t0 = time.perf_counter()
        sft_args = ["--config", str(CONFIG), "--run-dir", str(run_dir), "--quiet"]
        if train.main([*sft_args, *_bindings(args), "RunConfig.stages=('sft',)"]) != 0:
            return 1
        sft_s = time.perf_counter() - t0
        trainer, cfg, plan, data = _trainer(args, run_dir)
        rollout = trainer.rollout
        fusion_rows = rollout.fusion_rows
        migration = rollout.migration
        prompts = data.train_prompts[: args.prompts]
        meta = data.train_meta[: args.prompts]
        sampling = rollout.sampling(0)
        kinds = ["unfused", "fused"] + (["migrated"] if migration else [])

        def run(kind: str):
            rollout.fusion_rows = 0 if kind == "unfused" else fusion_rows
            rollout.migration = migration if kind == "migrated" else None
            t = time.perf_counter()
            batch = rollout(trainer.gen_params, prompts, sampling, meta=meta)
            return time.perf_counter() - t, batch

        times = {k: [] for k in kinds}
        batches, stats = {}, {}
        for kind in kinds:  # warm-up: compiles every program of each path
            _, batches[kind] = run(kind)
            stats[kind] = dict(rollout.fusion_stats) if kind != "unfused" else {}
        for r in range(args.repeats):
            for kind in kinds[r % len(kinds) :] + kinds[: r % len(kinds)]:  # rotate the order
                seconds, _ = run(kind)
                times[kind].append(seconds)
        plain = batches["unfused"]
        same_samples = all(plain.responses == batches[k].responses for k in kinds)
        max_diff = max(
            float(np.max(np.abs(plain.arrays[k] - batches[kind].arrays[k])))
            for k in ("ref_logprobs", "old_values", "scores")
            for kind in kinds
        )
        lengths = plain.result.lengths
        models = {role: setup.model.config for role, setup in trainer.roles.items()}
        workload = Workload.from_config(cfg, models)
        profile = DeviceProfile.load(args.profile)
        predicted = fused_rollout_seconds(plan, workload, profile, lengths, fusion_rows)
        if migration:
            with_tail = fused_rollout_seconds(
                plan, workload, profile, lengths, fusion_rows, cfg.rl.fusion.migrate_rows,
                cfg.rl.fusion.migrate_replicas,
            )  # fmt: skip
            predicted["migrated_s"] = with_tail["fused_s"]
            predicted["migrate_s"] = with_tail["migrate_s"]
            predicted["overlap_tail"] = with_tail["overlap_tail"]

    med = {k: statistics.median(v) for k, v in times.items()}
    unfused_s, fused_s = med["unfused"], med["fused"]
    out = {
        "benchmark": "fusion",
        "task": "longtail",
        "placement": plan.name,
        "devices": args.devices,
        "rows": len(lengths),
        "score_rows": fusion_rows,
        "chunk_steps": args.chunk_steps,
        "sft_steps": args.sft_steps,
        "sft_seconds": round(sft_s, 2),
        "lengths": {
            "median": float(np.median(lengths)),
            "p90": float(np.percentile(lengths, 90)),
            "max": int(lengths.max()),
            "mean": float(lengths.mean()),
        },
        "same_samples": bool(same_samples),
        "max_score_difference": max_diff,
        "fusion_chunks": stats,
        "measured": {
            **{f"{k}_s": round(v, 4) for k, v in med.items()},
            "fused_over_unfused": round(fused_s / unfused_s, 3),
            **(
                {"migrated_over_unfused": round(med["migrated"] / unfused_s, 3)}
                if "migrated" in med
                else {}
            ),
            **{f"{k}_all_s": [round(t, 4) for t in v] for k, v in times.items()},
        },
        "predicted": {
            "profile": profile.name,
            **{k: (round(v, 4) if isinstance(v, float) else v) for k, v in predicted.items()},
            "fused_over_unfused": round(predicted["fused_s"] / predicted["unfused_s"], 3),
            **(
                {
                    "migrated_over_unfused": round(
                        predicted["migrated_s"] / predicted["unfused_s"], 3
                    )
                }
                if migration
                else {}
            ),
        },
    }
    emit(out, args.out)
    return 0
