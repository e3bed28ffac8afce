"""``python -m jrlhf.train --check``: everything a run builds before its first model step, built
and checked without running a model or writing anything.

What the run itself does at start-up (jrlhf.pipeline.run) and in each stage's set-up, in the same
order and with the same one-line errors: the task data read and validated (every data file, the
tokenizer, the prompts' meta a reward function reads), the user's reward function imported and
called on dummy samples (jrlhf.tasks.rewards.check_reward_fn), the execution plan on this job's
devices, and every role each stage sets up: its model resolved (a checkpoint's vocabulary
against the tokenizer), each of its meshes built on the devices and its parameters' shardings
derived from the abstract parameter tree (``nnx.eval_shape``: nothing allocated), which fails,
naming the setting that chose the mesh, where a dimension does not divide. Nothing is loaded,
compiled or run.
"""

from __future__ import annotations

import jax

from jrlhf.config import Config
from jrlhf.meshes.mesh import blame_setting
from jrlhf.pipeline.task_data import build_task_data
from jrlhf.placement import ExecutionPlan, effective_plan
from jrlhf.ppo import core_algos as algos
from jrlhf.runtime.model_source import resolve_model, role_models, stage_start
from jrlhf.runtime.roles import RoleSetup, mesh_setting, setup_role


def stage_roles(cfg: Config, stage: str) -> list[tuple[str, str | None]]:
    """(role, init) of every role ``stage`` sets up, as jrlhf.pipeline.run does (init None:
    the role's own RoleConfig.init)."""
    if stage == "sft":
        return [("actor", stage_start(cfg, "sft"))]
    if stage == "rm":
        return [("reward", stage_start(cfg, "rm"))]
    if stage == "dpo":
        return [("actor", stage_start(cfg, "dpo"))]
    # RL: roles whose output reaches the loss (no reference without a KL term, no critic in GRPO,
    # no reward model with a reward function).
    needed = ["actor"] + (["reference"] if algos.uses_reference(cfg.rl) else [])
    needed += ["critic"] if stage == "ppo" else []
    needed += [] if cfg.task.reward_fn else ["reward"]
    return [(role, None) for role in needed]


def check_run(cfg: Config) -> ExecutionPlan:
    """Build and check what a run of ``cfg`` builds before its first step (see the module
    docstring), on the devices JAX has; returns the run's execution plan. Raises the run's own
    one-line errors (ConfigError, ValueError, FileNotFoundError, RewardError)."""
    data = build_task_data(cfg)
    models = role_models(cfg, data.model_overrides) if cfg.run.placement == "search" else None
    plan = effective_plan(cfg, jax.device_count(), models)
    built: dict[tuple[str, str | None], RoleSetup] = {}
    for stage in cfg.run.stages:
        for role, init in stage_roles(cfg, stage):
            if (role, init) in built:
                continue
            # run_dir None: a stage:NAME source is the model that stage starts from (the same
            # architecture as its output, which does not exist yet).
            source = resolve_model(cfg, role, data.model_overrides, None, init=init)
            built[role, init] = setup_role(cfg, role, plan, source)
        if stage == "dpo":
            # The frozen reference scores the pairs on the actor's training mesh.
            actor = built["actor", stage_start(cfg, "dpo")]
            init = cfg.dpo.reference or stage_start(cfg, "dpo")
            reference = resolve_model(cfg, "reference", data.model_overrides, None, init=init)
            setting = mesh_setting(cfg, "actor", "train", plan.for_role("actor", "train"))
            with blame_setting(setting):
                reference.model.shardings(actor.meshes["train"], actor.rules["train"])
    return plan
