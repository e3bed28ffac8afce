"""Held-out evaluation of a trained policy from its checkpoint, on any mesh.

The run's own config (its operative_config.gin) gives the task, the frozen roles and the
sampling; the rollout is the trainer's (jrlhf.ppo.rollout) with the same evaluation seed, so for
one checkpoint this reports what the run reported after training.

Only what the run had is reported: a run without an RL stage (SFT, reward-model or DPO stages
only) never used the RL stage's reward model or reference, and a role it would have built from
random weights (``tiny``, or the output of a stage it did not run) would score against noise. Such
a reward or KL is left out, and the report's ``not_reported`` says which and why. A DPO run's
reference is the DPO stage's own (DPOConfig.reference, or the policy's start).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jrlhf import checkpoint
from jrlhf.config import Config, load_config
from jrlhf.meshes.mesh import MeshSpec, make_mesh
from jrlhf.meshes.rules import get_rules
from jrlhf.pipeline.run_dir import OPERATIVE_CONFIG
from jrlhf.pipeline.task_data import build_task_data, environment_setup
from jrlhf.ppo import batch as rl_batch
from jrlhf.ppo import core_algos as algos
from jrlhf.ppo.rollout import Rollout
from jrlhf.ppo.scoring import Scorer
from jrlhf.runtime.model_source import ModelSource, TaskOverrides, resolve_model, stage_start
from jrlhf.runtime.roles import frozen_infer
from jrlhf.tasks import get_reward_fn


def find_run_dir(path: Path) -> Path:
    """The run directory a checkpoint belongs to (the nearest parent with operative_config.gin)."""
    for candidate in (path, *path.parents):
        if (candidate / OPERATIVE_CONFIG).exists():
            return candidate
    raise FileNotFoundError(f"{path}: not inside a jrlhf run directory (no operative_config.gin)")


RL_STAGES = ("ppo", "grpo")
# The stages that train the actor, whose output is a run's final policy when it has no RL stage.
ACTOR_STAGES = ("sft", "dpo")


def _run_had(
    cfg: Config, role: str, init: str, overrides: TaskOverrides, run_dir: Path
) -> tuple[ModelSource | None, str]:
    """``role``'s model as ``init`` gives it, if a run without an RL stage had it: weights it
    trained (``stage:NAME``, a stage of this run that finished) or was given (``hf:``,
    ``ckpt:``); else None and why not (``tiny`` is a random model)."""
    setting = f"{role}/RoleConfig.init={init!r}"
    kind, _, where = init.partition(":")
    if kind == "tiny":
        return None, f"{setting} is a random model"
    if kind == "stage":
        if where not in cfg.run.stages:
            return None, f"{setting} names a stage the run did not have"
        if not (run_dir / where).exists():
            return None, f"{setting}: the {where} stage has not finished ({run_dir / where})"
    return resolve_model(cfg, role, overrides, run_dir, init=init), ""


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
    first ``num_prompts``). Reference and reward are those the run had (see the module's
    docstring); the report's ``not_reported`` names any left out, and why."""
    if not ckpt.exists():
        raise FileNotFoundError(f"{ckpt}: does not exist")
    run_dir = find_run_dir(ckpt.absolute())
    cfg = load_config([str(run_dir / OPERATIVE_CONFIG)], [])
    rl = any(s in RL_STAGES for s in cfg.run.stages)
    actor_stages = [s for s in cfg.run.stages if s in ACTOR_STAGES]
    if ckpt.absolute() == run_dir and not rl and actor_stages:
        # A run without an RL stage keeps no trainer checkpoint: its policy is the output of
        # the last stage that trained the actor.
        ckpt = run_dir / actor_stages[-1]
    spec = MeshSpec.parse(mesh_spec)
    mesh, rules = make_mesh(spec), get_rules(rules_name)
    model, params = checkpoint.load_model(ckpt, mesh, rules, role="actor")
    data = build_task_data(cfg)
    P = cfg.task.max_prompt_len
    stages = f"stages {', '.join(cfg.run.stages)}"
    not_reported: dict[str, str] = {}

    # The reference and the reward model the run had: an RL run's (as its config gives them,
    # random or not: that is what it trained and reported against), a DPO run's reference, or,
    # in a run without an RL stage, a model it trained or was given: never a random one.
    reference: ModelSource | None = None
    if rl and algos.uses_reference(cfg.rl):
        reference = resolve_model(cfg, "reference", data.model_overrides, run_dir)
    elif rl:
        not_reported["kl_to_ref"] = "the run's RL stage had no KL term, so no reference"
    elif "dpo" in cfg.run.stages:
        init = cfg.dpo.reference or stage_start(cfg, "dpo")
        reference = resolve_model(cfg, "reference", data.model_overrides, run_dir, init=init)
    else:
        ref_init = cfg.roles["reference"].init
        reference, why = _run_had(cfg, "reference", ref_init, data.model_overrides, run_dir)
        if reference is None:
            not_reported["kl_to_ref"] = f"the run ({stages}) had no reference: {why}"
    reward_fn = get_reward_fn(cfg.task.reward_fn, cfg.task) if cfg.task.reward_fn else None
    reward: ModelSource | None = None
    if reward_fn is None and rl:
        reward = resolve_model(cfg, "reward", data.model_overrides, run_dir)
    elif reward_fn is None:
        reward_init = cfg.roles["reward"].init
        reward, why = _run_had(cfg, "reward", reward_init, data.model_overrides, run_dir)
        if reward is None:
            not_reported["reward"] = f"the run ({stages}) had no reward model: {why}"

    def frozen(source: ModelSource, fn):
        """A frozen role of the run (reference, reward) loaded onto the evaluation mesh."""
        return frozen_infer(source, mesh, rules, fn, cfg.run.seed, cfg.rl.memory.infer_batch_size)

    scorer = Scorer(
        P,
        cfg.task.max_response_len,
        data.pad_id,
        frozen(reference, rl_batch.logprobs_fn(P)) if reference is not None else None,
        reward_model=frozen(reward, rl_batch.sequence_scores) if reward is not None else None,
        reward_fn=reward_fn,
        reward_scale=cfg.rl.reward_scale,
        ground_truth=data.ground_truth,
        decode=data.decode,
        reward_name=cfg.task.reward_fn or None,
        reward_required=False,
    )
    env = environment_setup(cfg, data)  # multi-turn: the held-out episodes run it too
    rollout = Rollout.build(model, mesh, rules, scorer, cfg, data.stop_ids, env=env)
    prompts = data.heldout_prompts[: num_prompts or None]
    meta = data.heldout_meta[: num_prompts or None] if data.heldout_meta else None
    report = rollout.evaluate(params, prompts, samples, greedy, meta=meta)
    report.update(checkpoint=str(ckpt), mesh=str(spec), run_dir=str(run_dir))
    if not_reported:
        report["not_reported"] = not_reported
    return report
