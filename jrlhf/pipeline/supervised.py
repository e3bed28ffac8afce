"""Supervised stages of the pipeline: SFT of the actor and Bradley-Terry reward-model training.

Both use the shared functional train step (jrlhf.runtime.steps) on the role's training mesh and the
batch layout of jrlhf.ppo.batch; each writes its result as a model checkpoint into the run
directory (``sft/``, ``rm/``), which later stages reference as ``stage:sft`` / ``stage:rm``.
A stage whose output already exists is skipped, so a resumed pipeline does not redo it; a stage
cut off mid-way resumes from its last mid-stage checkpoint (``sft_checkpoints/``,
``rm_checkpoints/``, removed once the stage's output is written).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jrlhf import checkpoint
from jrlhf.meshes.batch import to_host
from jrlhf.meshes.processes import barrier, is_primary
from jrlhf.ppo import batch as rl_batch
from jrlhf.ppo.core_algos import bradley_terry_loss, sft_loss
from jrlhf.runtime.guard import UpdateGuard, check_finite
from jrlhf.runtime.model_source import load_weights
from jrlhf.runtime.roles import RoleSetup
from jrlhf.runtime.steps import (
    OptimizerConfig,
    init_train_state,
    make_optimizer,
    make_train_step,
    state_shardings,
)

log = logging.getLogger("jrlhf")

# Test hook: exit abruptly (like a preempted job) right after this step, e.g. "sft:40".
EXIT_AT_STEP_ENV = "JRLHF_DEBUG_EXIT_AT_STEP"


def sft_loss_fn(max_prompt_len: int):
    def loss_fn(module, batch):
        logits = module.logits(rl_batch.response_hidden(module, batch, max_prompt_len))
        loss, metrics = sft_loss(logits, batch["response_tokens"], batch["mask"])
        return loss, dict(metrics, weight=batch["mask"].sum())

    return loss_fn


def pack_pairs(pairs: Sequence[Any], max_prompt_len: int, max_response_len: int, pad_id: int):
    """Preference pairs in the batch layout, each pair's chosen row followed by its rejected row
    (chosen rows even, rejected rows odd): split into microbatches of whole pairs (the
    batch size a multiple of RoleConfig.microbatches, checked at start-up), no pair is torn."""
    prompts = [p.prompt_ids for p in pairs for _ in range(2)]
    responses = [r for p in pairs for r in (p.chosen_ids, p.rejected_ids)]
    return rl_batch.pack(prompts, responses, max_prompt_len, max_response_len, pad_id)


def reward_loss_fn(module, batch):
    """Bradley-Terry on a batch of pair rows (``pack_pairs``: chosen even, rejected odd)."""
    scores = rl_batch.sequence_scores(module, batch)
    loss, metrics = bradley_terry_loss(scores[0::2], scores[1::2])
    return loss, dict(metrics, weight=jnp.float32(scores.shape[0] // 2))


def _state_dir(run_dir: Path, name: str) -> Path:
    """Where a supervised stage keeps its resumable mid-stage checkpoints (the trainer
    checkpoint layout of jrlhf.checkpoint, one role)."""
    return run_dir / f"{name}_checkpoints"


def _supervised_stage(
    name: str,
    setup: RoleSetup,
    records,
    make_batch,
    loss_fn,
    stage_cfg,
    cfg,
    run_dir: Path,
    logger,
    seed: int,
) -> Path:
    """Train ``setup``'s model on random batches of ``records`` and save it to run_dir/name.

    A stage whose output already exists is skipped (a resumed pipeline does not redo it). Every
    ``stage_cfg.checkpoint_every`` steps the train state and the step are checkpointed, so a
    stage cut off mid-way resumes where it was, drawing the same batches and never logging a
    metric step twice. Updates that are not finite are skipped and counted
    (jrlhf.runtime.guard); too many in a row stop the run before anything is saved.
    """
    out = run_dir / name
    if (out / checkpoint.MODEL_JSON).exists():
        log.info("%s: %s exists, skipping the stage", name, out)
        return out
    role, steps = setup.name, stage_cfg.steps
    mesh, rules = setup.meshes["train"], setup.rules["train"]
    opt = OptimizerConfig(
        learning_rate=stage_cfg.learning_rate,
        warmup_steps=stage_cfg.warmup_steps,
        total_steps=steps,
        min_lr_ratio=0.1,
        grad_clip=setup.config.grad_clip,
    )
    optimizer = make_optimizer(opt)
    manager = checkpoint.trainer_checkpoint_manager(
        _state_dir(run_dir, name), max_to_keep=2, async_save=False
    )
    shardings = state_shardings(setup.model, optimizer, mesh, rules)
    abstract = jax.eval_shape(
        lambda: init_train_state(setup.model, optimizer, mesh, rules, seed=seed)
    )
    restored = checkpoint.restore_trainer_state(
        manager, {role: checkpoint.restore_target(abstract, shardings)}
    )
    if restored is None:
        done = 0
        params = load_weights(setup.source, mesh, rules, seed)
        state = init_train_state(setup.model, optimizer, mesh, rules, params=params, seed=seed)
    else:
        meta, states = restored
        done, state = int(meta["step"]), states[role]
        log.info("%s: resumed at step %d of %d", name, done, steps)
    logger.truncate_after(done)

    rng = np.random.default_rng([seed, sum(map(ord, name))])

    def draw():
        return rng.choice(len(records), stage_cfg.batch_size, replace=False)

    for _ in range(done):  # the batches the steps already taken drew
        draw()
    step_fn = make_train_step(
        setup.model, optimizer, loss_fn, mesh, rules, microbatches=setup.config.microbatches
    )
    guard = UpdateGuard(cfg.run.max_nonfinite_updates, name)
    pending: list = []  # each step's "skipped" flag, fetched at the next log point
    start, start_step = time.perf_counter(), done
    for i in range(done, steps):
        state, metrics = step_fn(state, make_batch([records[j] for j in draw()]))
        pending.append(metrics["skipped"])
        step = i + 1
        if os.environ.get(EXIT_AT_STEP_ENV) == f"{name}:{step}":
            os._exit(137)  # test hook: a preempted job, no cleanup
        if step % 25 == 0 or step == steps:
            skipped = guard.record(role, to_host(pending), f"step {step}")
            pending = []
            values = {f"{name}/{k}": float(v) for k, v in to_host(metrics).items()}
            values[f"{name}/skipped_updates"] = float(skipped)
            del values[f"{name}/skipped"]
            values[f"{name}/steps_per_s"] = (step - start_step) / (time.perf_counter() - start)
            logger.log(step, values)
        every = stage_cfg.checkpoint_every
        if every and step % every == 0 and step < steps:
            guard.record(role, to_host(pending), f"step {step}")
            pending = []
            check_finite(state, f"{name} {role} at step {step}")
            meta = {"step": step, "stage": name, "seed": seed}
            checkpoint.save_trainer_state(manager, step, meta, {role: state}, {role: setup.model})
    manager.wait_until_finished()
    check_finite(state.params, f"{name} {role} at step {steps}")
    checkpoint.save_model(_fresh(out), setup.model, state.params)
    # The stage's output is complete (model.json written last): its mid-stage states are
    # superseded.
    manager.close()
    barrier(f"{name}:done")
    if is_primary():
        shutil.rmtree(_state_dir(run_dir, name), ignore_errors=True)
    return out


def run_sft(setup: RoleSetup, data, cfg, run_dir: Path, logger, seed: int) -> Path:
    """Supervised fine-tuning of the actor on prompt/response demonstrations."""
    P, R = cfg.task.max_prompt_len, cfg.task.max_response_len

    def make_batch(rows):
        prompts, responses = [r.prompt_ids for r in rows], [r.response_ids for r in rows]
        return rl_batch.pack(prompts, responses, P, R, data.pad_id)

    return _supervised_stage(
        "sft", setup, data.sft_records, make_batch, sft_loss_fn(P), cfg.sft, cfg,
        run_dir, logger, seed,
    )  # fmt: skip


def run_reward_model(setup: RoleSetup, data, cfg, run_dir: Path, logger, seed: int) -> Path:
    """Bradley-Terry training of the reward model on preference pairs."""
    P, R = cfg.task.max_prompt_len, cfg.task.max_response_len

    def make_batch(pairs):
        return pack_pairs(pairs, P, R, data.pad_id)

    return _supervised_stage(
        "rm", setup, data.preference_records, make_batch, reward_loss_fn, cfg.rm, cfg,
        run_dir, logger, seed,
    )  # fmt: skip


def _fresh(path: Path) -> Path:
    """Clear a stage directory left incomplete by an interrupted save (it lacks model.json)."""
    if path.exists() and not (path / checkpoint.MODEL_JSON).exists() and is_primary():
        shutil.rmtree(path)
    barrier(f"fresh:{path}")
    return path
