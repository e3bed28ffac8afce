"""``python -m jrlhf.evaluate --checkpoint DIR [--mesh SPEC]``: score a trained policy.

Restores the actor of a trainer checkpoint (a run directory, its ``checkpoints/`` or one step)
onto ``--mesh``, which need not be the mesh it was trained on, samples completions for held-out
prompts and reports, as JSON, the reward-model score, the ground-truth score (for tasks that know
it, such as the built-in synthetic task) and the KL to the reference policy.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from jrlhf.runtime.devices import ensure_host_devices


def find_run_dir(path: Path) -> Path:
    """The run directory a checkpoint belongs to (the nearest parent with operative_config.gin)."""
    for candidate in (path, *path.parents):
        if (candidate / "operative_config.gin").exists():
            return candidate
    raise FileNotFoundError(f"{path}: not inside a jrlhf run directory (no operative_config.gin)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jrlhf.evaluate", description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True, help="run dir, checkpoints dir or step dir")
    p.add_argument("--mesh", default="data=4,tensor=2", help="evaluation mesh, e.g. data=8")
    p.add_argument("--rules", default="dp_tp", help="rule set for the evaluation mesh")
    p.add_argument("--num-prompts", type=int, default=0, help="held-out prompts (0: all)")
    p.add_argument("--samples", type=int, default=4, help="samples per prompt")
    p.add_argument("--greedy", action="store_true")
    p.add_argument("--output", help="also write the JSON report here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    ensure_host_devices()
    from jrlhf import checkpoint
    from jrlhf.cli.train import build_task_data
    from jrlhf.config import ConfigError, load_config
    from jrlhf.decode import DecodeEngine, EngineConfig, SamplingParams, round_slots
    from jrlhf.meshes import MeshSpec, get_rules, make_mesh
    from jrlhf.ppo import batch as rl_batch
    from jrlhf.ppo.scoring import Scorer
    from jrlhf.runtime.roles import frozen_infer, resolve_model
    from jrlhf.tasks import get_reward_fn

    try:
        ckpt = Path(args.checkpoint)
        if not ckpt.exists():
            raise FileNotFoundError(f"{ckpt}: does not exist")
        run_dir = find_run_dir(ckpt.absolute())
        cfg = load_config([str(run_dir / "operative_config.gin")], [])
        mesh = make_mesh(MeshSpec.parse(args.mesh))
        rules = get_rules(args.rules)
        model, params = checkpoint.load_model(ckpt, mesh, rules, role="actor")
        data = build_task_data(cfg)
        P, R = cfg.task.max_prompt_len, cfg.task.max_response_len
        prompts = data.heldout_prompts[: args.num_prompts or None]

        def frozen(role: str, head: str, fn):
            """A frozen role of the run (reference, reward) loaded onto the evaluation mesh."""
            rc = cfg.roles[role]
            role_model, source = resolve_model(rc.init, rc, head, data.model_overrides, run_dir)
            return frozen_infer(role_model, source, mesh, rules, fn, cfg.run.seed)

        reward_fn = get_reward_fn(cfg.task.reward_fn) if cfg.task.reward_fn else None
        scorer = Scorer(
            P,
            R,
            data.pad_id,
            frozen("reference", "lm", lambda m, b: rl_batch.response_logprobs(m, b, P)),
            reward_model=None if reward_fn else frozen("reward", "value", rl_batch.sequence_scores),
            reward_fn=reward_fn,
            ground_truth=data.ground_truth,
        )
    except (ConfigError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    rows = len(prompts) * args.samples
    engine = DecodeEngine(
        model,
        mesh,
        rules,
        EngineConfig(
            num_slots=round_slots(min(rows, 64), mesh, rules),
            page_size=8,
            max_prompt_len=P,
            max_new_tokens=R,
            chunk_steps=8,
            min_prefill_len=min(16, P),
        ),
    )
    sampling = SamplingParams(
        greedy=args.greedy,
        temperature=cfg.rl.temperature,
        num_samples=args.samples,
        seed=cfg.run.seed + 12345,
        stop_ids=(data.eos_id,) if data.eos_id is not None else None,
        max_new_tokens=R,
    )
    result = engine.generate(params, prompts, sampling)
    rep = [prompts[int(i)] for i in result.prompt_index]
    arrays = scorer(rep, result.completion_ids, result.raw_logprobs)
    report = scorer.summarize(arrays, rep, result.completion_ids)
    report.update(checkpoint=str(ckpt), mesh=str(MeshSpec.parse(args.mesh)), run_dir=str(run_dir))
    text = json.dumps(report, indent=2)
    print(text)
    if args.output:
        Path(args.output).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
