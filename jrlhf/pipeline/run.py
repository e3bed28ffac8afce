"""A run: every configured stage in order (SFT, reward model, PPO/GRPO), in one run directory.

``run`` is what ``python -m jrlhf.train`` executes once the config is valid and the run directory
is prepared: it writes the operative config, builds the task data, places the roles, runs the
stages and prints the held-out summary.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import jax

from jrlhf import metrics as metrics_lib
from jrlhf.config import Config, operative_config
from jrlhf.data import PromptLoader
from jrlhf.pipeline.supervised import run_reward_model, run_sft
from jrlhf.pipeline.task_data import build_task_data
from jrlhf.ppo.trainer import RLTrainer
from jrlhf.runtime.roles import RoleSetup, resolve_model, resolve_plan, role_meshes
from jrlhf.tasks import get_reward_fn

log = logging.getLogger("jrlhf")


def run(cfg: Config, run_dir: Path, quiet: bool = False) -> int:
    """Run every configured stage in order; returns a process exit code."""
    (run_dir / "operative_config.gin").write_text(operative_config())
    (run_dir / "config.json").write_text(cfg.to_json())
    data = build_task_data(cfg)
    if data.save_tokenizer is not None:
        data.save_tokenizer(run_dir)
    log.info(
        "devices: %d x %s; run directory %s", jax.device_count(), jax.devices()[0].platform, run_dir
    )
    plan = resolve_plan(cfg, jax.device_count())
    plan.validate(jax.device_count())
    (run_dir / "plan.gin").write_text(plan.to_gin(f"plan used by this run ({cfg.run.placement})"))
    rows = "; ".join(f"{call} {mesh} [{rules}]" for call, mesh, rules in plan.rows())
    log.info("execution plan %r: %s", plan.name, rows)

    def setup(role: str, init: str, head: str) -> tuple[RoleSetup, str | None]:
        rc = cfg.roles[role]
        model, source = resolve_model(init, rc, head, data.model_overrides, run_dir)
        meshes, rules = role_meshes(cfg, role, plan)
        s = RoleSetup(role, rc, model, meshes, rules)
        for phase in meshes:
            s.shardings(phase)  # fails now, naming the parameter, if a layout cannot divide
        log.info("%s: %s params; %s", role, f"{model.num_params():,}", s.describe())
        return s, source

    def logger_for(stage: str):
        # One metrics.jsonl + TensorBoard directory per stage, so a resumed RL stage can drop
        # the iterations it will redo without touching the supervised stages' records.
        return metrics_lib.MetricsLogger(
            run_dir / "logs" / stage, use_tensorboard=cfg.run.tensorboard
        )

    summary: dict[str, Any] = {}
    for stage in cfg.run.stages:
        logger = logger_for(stage)
        try:
            if stage == "sft":
                actor, source = setup("actor", _stage_init(cfg, "actor", "sft"), "lm")
                run_sft(actor, source, data, cfg, run_dir, logger, cfg.run.seed)
            elif stage == "rm":
                reward, source = setup("reward", _stage_init(cfg, "reward", "rm"), "value")
                run_reward_model(reward, source, data, cfg, run_dir, logger, cfg.run.seed)
            else:
                summary = run_rl(cfg, stage, run_dir, data, logger, setup, RLTrainer, quiet)
        finally:
            logger.close()
    if summary:
        stage_logs = run_dir / "logs" / summary["stage"]
        png = metrics_lib.plot_run(stage_logs / "metrics.jsonl", run_dir / "run.png")
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        before, after = summary["before"], summary["after"]
        key = "gt_score" if "gt_score" in after else "reward"
        label = "ground-truth score" if key == "gt_score" else "reward-model score"
        print(
            f"held-out {label}: before RL {before[key]:.3f} -> after {summary['stage']} "
            f"{after[key]:.3f} (KL to reference {after['kl_to_ref']:.3f}); plot: {png}"
        )
    return 0


def _stage_init(cfg: Config, role: str, stage: str) -> str:
    """The model a supervised stage starts from: the role's init unless it names this stage."""
    init = cfg.roles[role].init
    return "tiny" if init == f"stage:{stage}" else init


def run_rl(cfg, stage, run_dir, data, logger, setup, trainer_cls, quiet) -> dict[str, Any]:
    roles, sources = {}, {}
    needed = ["actor", "reference"] + (["critic"] if stage == "ppo" else [])
    reward_fn = get_reward_fn(cfg.task.reward_fn) if cfg.task.reward_fn else None
    if reward_fn is None:
        needed.append("reward")
    heads = {"actor": "lm", "reference": "lm", "critic": "value", "reward": "value"}
    for role in needed:
        roles[role], sources[role] = setup(role, cfg.roles[role].init, heads[role])
    trainer = trainer_cls(cfg, stage, roles, sources, data, run_dir, reward_fn=reward_fn)
    loader = PromptLoader(data.train_prompts, cfg.rl.prompts_per_iteration, seed=cfg.run.seed)
    resumed = trainer.restore()
    if resumed is not None:
        loader.load_state_dict(resumed)
        logger.truncate_after(trainer.iteration)
        log.info("resumed %s at iteration %d", stage, trainer.iteration)
    summary_path = run_dir / f"{stage}_before.json"
    if summary_path.exists():
        before = json.loads(summary_path.read_text())
    else:
        before = trainer.evaluate(data.heldout_prompts, samples=4)
        summary_path.write_text(json.dumps(before))
    bar = metrics_lib.ProgressBar(
        cfg.rl.iterations,
        initial=trainer.iteration,
        disable=quiet or not cfg.run.progress_bar,
        desc=stage,
    )
    while trainer.iteration < cfg.rl.iterations:
        metrics = trainer.run_iteration(loader.next_batch())
        logger.log(trainer.iteration, metrics)
        bar.update(trainer.iteration, metrics)
        every = cfg.rl.checkpoint_every
        if (every and trainer.iteration % every == 0) or trainer.iteration == cfg.rl.iterations:
            trainer.save(loader.state_dict())
    bar.close()
    trainer.wait_for_checkpoints()
    after = trainer.evaluate(data.heldout_prompts, samples=4)
    logger.log(trainer.iteration, {f"eval/{k}": v for k, v in after.items()})
    return {"stage": stage, "before": before, "after": after, "iterations": trainer.iteration}
