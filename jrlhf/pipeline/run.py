"""A run: every configured stage in order (SFT, reward model, DPO, PPO/GRPO), in one run
directory.

``run`` is what ``python -m jrlhf.train`` executes once the config is valid and the run directory
is prepared: it writes the operative config, builds the task data, places the roles, runs the
stages and prints the held-out summary.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

from jrlhf import metrics as metrics_lib
from jrlhf.config import Config
from jrlhf.data import PromptLoader
from jrlhf.meshes.processes import is_primary
from jrlhf.pipeline.run_dir import before_training, write_start_files
from jrlhf.pipeline.supervised import run_dpo, run_reward_model, run_sft
from jrlhf.pipeline.task_data import TaskData, build_task_data, environment_setup
from jrlhf.placement import ExecutionPlan, effective_plan
from jrlhf.ppo import core_algos as algos
from jrlhf.ppo.trainer import RLTrainer
from jrlhf.runtime.gc_freeze import WarmFreeze
from jrlhf.runtime.model_source import resolve_model, role_models, stage_start
from jrlhf.runtime.roles import RoleSetup, setup_role
from jrlhf.tasks import get_reward_fn

log = logging.getLogger("jrlhf")


def run(cfg: Config, run_dir: Path, quiet: bool = False) -> int:
    """Run every configured stage in order; returns a process exit code.

    With several JAX processes every one runs this (SPMD); process 0 alone writes the run's
    files (jrlhf.meshes.processes)."""
    primary = is_primary()
    data = build_task_data(cfg)
    log.info(
        "devices: %d x %s; run directory %s", jax.device_count(), jax.devices()[0].platform, run_dir
    )
    # The one placement of this run: roles, reshard edges, this log line and plan.gin read it.
    models = role_models(cfg, data.model_overrides) if cfg.run.placement == "search" else None
    plan = effective_plan(cfg, jax.device_count(), models)
    # Written once the data and the plan are known to work (a resume's config was checked
    # against the saved one before this): a run refused earlier writes nothing.
    write_start_files(run_dir, cfg, plan.to_gin(f"plan used by this run ({cfg.run.placement})"))
    if data.save_tokenizer is not None and primary:
        data.save_tokenizer(run_dir)
    log.info("%s", plan.describe())

    def setup(role: str, init: str | None = None) -> RoleSetup:
        source = resolve_model(cfg, role, data.model_overrides, run_dir, init=init)
        s = setup_role(cfg, role, plan, source)
        params = f"{s.model.num_params():,} params"
        if s.model.lora is not None:  # how much of it trains
            trained = sum(
                x.size for x in jax.tree.leaves(s.model.trainable(s.model.abstract_params))
            )
            params += f" (LoRA rank {s.model.lora.rank}: {trained:,} trained, the base frozen)"
        log.info("%s: %s; %s", role, params, s.describe())
        return s

    def logger_for(stage: str):
        # One metrics.jsonl + TensorBoard directory per stage, so a resumed RL stage can drop
        # the iterations it will redo without touching the supervised stages' records.
        return metrics_lib.MetricsLogger(
            run_dir / "logs" / stage, use_tensorboard=cfg.run.tensorboard, enabled=primary
        )

    summary: dict[str, Any] = {}
    dpo_summary: dict[str, Any] = {}
    for stage in cfg.run.stages:
        logger = logger_for(stage)
        try:
            if stage == "sft":
                actor = setup("actor", init=stage_start(cfg, "sft"))
                run_sft(actor, data, cfg, run_dir, logger, cfg.run.seed)
            elif stage == "rm":
                reward = setup("reward", init=stage_start(cfg, "rm"))
                run_reward_model(reward, data, cfg, run_dir, logger, cfg.run.seed)
            elif stage == "dpo":
                start = stage_start(cfg, "dpo")
                actor = setup("actor", init=start)
                init = cfg.dpo.reference or start
                reference = resolve_model(
                    cfg, "reference", data.model_overrides, run_dir, init=init
                )
                log.info("dpo: policy from %s, reference from %s", start, init)
                dpo_summary = run_dpo(actor, reference, data, cfg, run_dir, logger, cfg.run.seed)
            else:
                summary = run_rl(cfg, stage, run_dir, data, logger, setup, plan, quiet)
        finally:
            logger.close()
    if dpo_summary and primary:
        before, after = dpo_summary["before"], dpo_summary["after"]
        print(
            f"{dpo_summary['split']} preference accuracy (chosen log-prob margin > 0, "
            f"{after['pairs']} pairs): before dpo {before['logp_accuracy']:.3f} -> after dpo "
            f"{after['logp_accuracy']:.3f} (implicit-reward accuracy {before['accuracy']:.3f} -> "
            f"{after['accuracy']:.3f})"
        )
    if summary and primary:
        stage_logs = run_dir / "logs" / summary["stage"]
        png = metrics_lib.plot_run(stage_logs / "metrics.jsonl", run_dir / "run.png")
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        before, after = summary["before"], summary["after"]
        key = "gt_score" if "gt_score" in after else "reward"
        label = "ground-truth score" if key == "gt_score" else "reward-model score"
        if key == "reward" and cfg.task.reward_fn:
            label = f"reward ({cfg.task.reward_fn})"
        kl = f" (KL to reference {after['kl_to_ref']:.3f})" if "kl_to_ref" in after else ""
        print(
            f"held-out {label}: before RL {before[key]:.3f} -> after {summary['stage']} "
            f"{after[key]:.3f}{kl}; plot: {png}"
        )
    return 0


def run_rl(
    cfg: Config,
    stage: str,
    run_dir: Path,
    data: TaskData,
    logger: metrics_lib.MetricsLogger,
    setup: Callable[[str], RoleSetup],
    plan: ExecutionPlan,
    quiet: bool,
) -> dict[str, Any]:
    """The PPO or GRPO stage: build the trainer, resume if a checkpoint exists, iterate,
    evaluate before and after; returns the run summary."""
    # Roles whose output reaches the loss: no reference without a KL term, no critic in GRPO.
    needed = ["actor"] + (["reference"] if algos.uses_reference(cfg.rl) else [])
    needed += ["critic"] if stage == "ppo" else []
    reward_fn = get_reward_fn(cfg.task.reward_fn, cfg.task) if cfg.task.reward_fn else None
    if reward_fn is None:
        needed.append("reward")
    roles = {role: setup(role) for role in needed}
    env = environment_setup(cfg, data)
    trainer = RLTrainer(cfg, stage, roles, plan, data, run_dir, reward_fn=reward_fn, env=env)
    # Batches of PromptRecords: each prompt's meta travels with it to the reward function.
    loader = PromptLoader(data.train_records(), cfg.rl.prompts_per_iteration, seed=cfg.run.seed)
    resumed = trainer.restore()
    if resumed is not None:
        loader.load_state_dict(resumed)
        log.info("resumed %s at iteration %d", stage, trainer.iteration)
    # Iterations logged after the restored checkpoint (all of them when none was complete) are
    # about to be redone: drop them, as the supervised stages do, so no step is logged twice.
    logger.truncate_after(trainer.iteration)
    before = before_training(
        run_dir,
        stage,
        lambda: trainer.evaluate(data.heldout_prompts, samples=4, meta=data.heldout_meta),
    )
    bar = metrics_lib.ProgressBar(
        cfg.rl.iterations,
        initial=trainer.iteration,
        disable=quiet or not cfg.run.progress_bar or not is_primary(),
        desc=stage,
    )

    def next_prompts():
        batch = loader.next_batch()
        return [r.prompt_ids for r in batch], [r.meta for r in batch]

    freezer = WarmFreeze(cfg.run.gc_freeze, stage)

    def on_iteration(metrics: dict[str, float]) -> None:
        logger.log(trainer.iteration, metrics)
        bar.update(trainer.iteration, metrics)
        freezer.step_done()
        every = cfg.rl.checkpoint_every
        if (every and trainer.iteration % every == 0) or trainer.iteration == cfg.rl.iterations:
            trainer.save(loader.state_dict())

    try:
        trainer.fit(next_prompts, on_iteration)
    finally:
        # A run that stops (e.g. diverged) still completes the saves already under way: each was
        # checked finite before it started.
        bar.close()
        trainer.wait_for_checkpoints()
        freezer.release()
    after = trainer.evaluate(data.heldout_prompts, samples=4, meta=data.heldout_meta)
    # A resumed run that had already finished evaluated this same checkpoint: its record stays
    # the only one for the step.
    logged = any(
        r.get("step") == trainer.iteration and any(k.startswith("eval/") for k in r)
        for r in logger.history
    )
    if not logged:
        logger.log(trainer.iteration, {f"eval/{k}": v for k, v in after.items()})
    return {"stage": stage, "before": before, "after": after, "iterations": trainer.iteration}
