"""Held-out evaluation of a trained policy from its checkpoint, on any mesh.

The run's own config (its operative_config.gin) gives the task, the frozen roles and the
sampling; the rollout is the trainer's (jrlhf.ppo.rollout) with the same evaluation seed, so for
one checkpoint this reports what the run reported after training.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jrlhf import checkpoint
from jrlhf.config import load_config
from jrlhf.meshes.mesh import MeshSpec, make_mesh
from jrlhf.meshes.rules import get_rules
from jrlhf.pipeline.run_dir import OPERATIVE_CONFIG
from jrlhf.pipeline.task_data import build_task_data
from jrlhf.ppo import batch as rl_batch
from jrlhf.ppo import core_algos as algos
from jrlhf.ppo.rollout import Rollout
from jrlhf.ppo.scoring import Scorer
from jrlhf.runtime.model_source import resolve_model
from jrlhf.runtime.roles import frozen_infer
from jrlhf.tasks import get_reward_fn


def find_run_dir(path: Path) -> Path:
    """The run directory a checkpoint belongs to (the nearest parent with operative_config.gin)."""
    for candidate in (path, *path.parents):
        if (candidate / OPERATIVE_CONFIG).exists():
            return candidate
    raise FileNotFoundError(f"{path}: not inside a jrlhf run directory (no operative_config.gin)")


def evaluate_checkpoint(
    ckpt: Path,
    mesh_spec: str,
    rules_name: str = "dp_tp",
    num_prompts: int = 0,
    samples: int = 4,
    greedy: bool = False,
) -> dict[str, Any]:
    """Restore the actor of ``ckpt`` (a run directory, its checkpoints/ or one step) onto
    ``mesh_spec`` and score ``samples`` completions of each held-out prompt (all of them, or the
    first ``num_prompts``). Reference and reward come from the run's config."""
    if not ckpt.exists():
        raise FileNotFoundError(f"{ckpt}: does not exist")
    run_dir = find_run_dir(ckpt.absolute())
    cfg = load_config([str(run_dir / OPERATIVE_CONFIG)], [])
    spec = MeshSpec.parse(mesh_spec)
    mesh, rules = make_mesh(spec), get_rules(rules_name)
    model, params = checkpoint.load_model(ckpt, mesh, rules, role="actor")
    data = build_task_data(cfg)
    P = cfg.task.max_prompt_len

    def frozen(role: str, fn):
        """A frozen role of the run (reference, reward) loaded onto the evaluation mesh."""
        source = resolve_model(cfg, role, data.model_overrides, run_dir)
        return frozen_infer(source, mesh, rules, fn, cfg.run.seed, cfg.rl.infer_batch_size)

    reward_fn = get_reward_fn(cfg.task.reward_fn) if cfg.task.reward_fn else None
    scorer = Scorer(
        P,
        cfg.task.max_response_len,
        data.pad_id,
        # As the run did: without a KL term it had no reference, and reports no KL.
        frozen("reference", rl_batch.logprobs_fn(P)) if algos.uses_reference(cfg.rl) else None,
        reward_model=None if reward_fn else frozen("reward", rl_batch.sequence_scores),
        reward_fn=reward_fn,
        reward_scale=cfg.rl.reward_scale,
        ground_truth=data.ground_truth,
        decode=data.decode,
        reward_name=cfg.task.reward_fn or None,
    )
    rollout = Rollout.build(model, mesh, rules, scorer, cfg, data.eos_id)
    prompts = data.heldout_prompts[: num_prompts or None]
    meta = data.heldout_meta[: num_prompts or None] if data.heldout_meta else None
    report = rollout.evaluate(params, prompts, samples, greedy, meta=meta)
    report.update(checkpoint=str(ckpt), mesh=str(spec), run_dir=str(run_dir))
    return report
