"""Estimated gain of RLHFuse's migration on GPU clusters: ``python -m benchmarks.migration_study``.

For 7B and 70B PPO (the plan study's workloads, long-tailed response lengths from the longtail
task's law), the time to a scored batch of two synchronous plans, each with its batch knobs tuned
by the estimator (jrlhf.placement.estimator.estimate_tuned):

* ``flatten``: every call on every device (generation at tensor 8);
* ``half-scoring``: the same, but reference, reward and critic score on the first half of the
  devices only, so a tail migrated to a generation replica of the second half decodes beside
  the scoring of the finished samples.

Each is priced unfused, fused (scoring finished samples in calls of the study's scoring chunk as
they finish) and fused with migration of the last ``--migrate-rows`` rows to one generation
replica (jrlhf.placement.estimator.fused_rollout_seconds). Prints a markdown table.
"""

from __future__ import annotations

import argparse

from benchmarks.plan_study import INFER_BATCH_SIZE, tail_lengths, workload_for


def half_scoring(n: int, tensor: int = 8):
    """Flatten on ``n`` devices, with the scoring calls on the first half of them."""
    from jrlhf.meshes.mesh import MeshSpec
    from jrlhf.placement.plan import CallPlacement, ExecutionPlan, flatten

    flat = flatten(n, tensor)
    half = n // 2
    score = CallPlacement(
        MeshSpec((("fsdp", half // tensor), ("tensor", tensor)), tuple(range(half))),
        flat["reference_infer"].rules,
    )
    calls = dict(flat.placements)
    calls.update(reference_infer=score, reward_infer=score, critic_infer=score)
    return ExecutionPlan.of("half-scoring", **calls)


def rows_for(size: str, n: int, profile, migrate_rows: int) -> list[str]:
    from jrlhf.placement.estimator import estimate_tuned, fused_rollout_seconds
    from jrlhf.placement.plan import flatten

    out = []
    for plan in (flatten(n, 8), half_scoring(n)):
        e = estimate_tuned(plan, workload_for(size, n, "ppo"), profile)
        w = e.workload
        lengths = tail_lengths(w.prompts * w.samples_per_prompt, w.gen_len)
        plain = fused_rollout_seconds(plan, w, profile, lengths, INFER_BATCH_SIZE)
        moved = fused_rollout_seconds(plan, w, profile, lengths, INFER_BATCH_SIZE, migrate_rows)
        out.append(
            f"| {size} | {n} | {plan.name} | {'yes' if e.fits else 'no'} | "
            f"{plain['unfused_s']:.1f} | {plain['fused_s']:.1f} | {moved['fused_s']:.1f} | "
            f"{plain['unfused_s'] / moved['fused_s']:.2f}x | {moved['migrate_s'] * 1e3:.1f} |"
        )
    return out


def main(argv: list[str] | None = None) -> int:
    from jrlhf.placement.profile import DeviceProfile

    p = argparse.ArgumentParser(prog="python -m benchmarks.migration_study", description=__doc__)
    p.add_argument("--device-kind", default="h100")
    p.add_argument("--devices", type=int, nargs="*", default=[16, 64])
    p.add_argument("--models", nargs="*", default=["7B", "70B"])
    p.add_argument("--migrate-rows", type=int, default=32)
    args = p.parse_args(argv)
    profile = DeviceProfile.load(args.device_kind)
    lines = [
        f"| model | devices | plan | fits | unfused (s) | fused (s) | fused + migration of the "
        f"last {args.migrate_rows} rows (s) | gain over unfused | move (ms) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for size in args.models:
        for n in args.devices:
            lines += rows_for(size, n, profile, args.migrate_rows)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
