"""Supervised stages of the pipeline: SFT of the actor and Bradley-Terry reward-model training.

Both use the shared functional train step (jrlhf.runtime.steps) on the role's training mesh and the
batch layout of jrlhf.ppo.batch; each writes its result as a model checkpoint into the run
directory (``sft/``, ``rm/``), which later stages reference as ``stage:sft`` / ``stage:rm``.
A stage whose output already exists is skipped, so a resumed pipeline does not redo it.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from jrlhf import checkpoint
from jrlhf.meshes.batch import to_host
from jrlhf.meshes.processes import barrier, is_primary
from jrlhf.ppo import batch as rl_batch
from jrlhf.ppo.core_algos import bradley_terry_loss, sft_loss
from jrlhf.runtime.model_source import load_weights
from jrlhf.runtime.roles import RoleSetup
from jrlhf.runtime.steps import (
    OptimizerConfig,
    init_train_state,
    make_optimizer,
    make_train_step,
)

log = logging.getLogger("jrlhf")


def sft_loss_fn(max_prompt_len: int):
    def loss_fn(module, batch):
        logits = module.logits(rl_batch.response_hidden(module, batch, max_prompt_len))
        loss, metrics = sft_loss(logits, batch["response_tokens"], batch["mask"])
        return loss, dict(metrics, weight=batch["mask"].sum())

    return loss_fn


def reward_loss_fn(module, batch):
    """Bradley-Terry on a batch whose first half is chosen rows and second half rejected rows."""
    scores = rl_batch.sequence_scores(module, batch)
    half = scores.shape[0] // 2
    loss, metrics = bradley_terry_loss(scores[:half], scores[half:])
    return loss, dict(metrics, weight=jnp.float32(half))


def _train_loop(
    setup: RoleSetup,
    params,
    loss_fn,
    batches,
    steps: int,
    opt: OptimizerConfig,
    logger: Any,
    tag: str,
    seed: int,
):
    mesh, rules = setup.meshes["train"], setup.rules["train"]
    optimizer = make_optimizer(opt)
    state = init_train_state(setup.model, optimizer, mesh, rules, params=params, seed=seed)
    step_fn = make_train_step(
        setup.model, optimizer, loss_fn, mesh, rules, microbatches=setup.config.microbatches
    )
    start = time.perf_counter()
    for i in range(steps):
        state, metrics = step_fn(state, next(batches))
        if (i + 1) % 25 == 0 or i + 1 == steps:
            values = {f"{tag}/{k}": float(v) for k, v in to_host(metrics).items()}
            values[f"{tag}/steps_per_s"] = (i + 1) / (time.perf_counter() - start)
            logger.log(i + 1, values)
    return state.params


def _supervised_stage(
    name: str,
    setup: RoleSetup,
    records,
    make_batch,
    loss_fn,
    stage_cfg,
    run_dir: Path,
    logger,
    seed: int,
) -> Path:
    """Train ``setup``'s model on random batches of ``records`` and save it to run_dir/name.

    A stage whose output already exists is skipped (a resumed pipeline does not redo it).
    """
    out = run_dir / name
    if (out / checkpoint.MODEL_JSON).exists():
        log.info("%s: %s exists, skipping the stage", name, out)
        return out
    rng = np.random.default_rng([seed, sum(map(ord, name))])

    def batches():
        while True:
            idx = rng.choice(len(records), stage_cfg.batch_size, replace=False)
            yield make_batch([records[i] for i in idx])

    params = load_weights(setup.source, setup.meshes["train"], setup.rules["train"], seed)
    opt = OptimizerConfig(
        learning_rate=stage_cfg.learning_rate,
        warmup_steps=stage_cfg.warmup_steps,
        total_steps=stage_cfg.steps,
        min_lr_ratio=0.1,
        grad_clip=setup.config.grad_clip,
    )
    params = _train_loop(
        setup, params, loss_fn, batches(), stage_cfg.steps, opt, logger, name, seed
    )
    checkpoint.save_model(_fresh(out), setup.model, params)
    return out


def run_sft(setup: RoleSetup, data, cfg, run_dir: Path, logger, seed: int) -> Path:
    """Supervised fine-tuning of the actor on prompt/response demonstrations."""
    P, R = cfg.task.max_prompt_len, cfg.task.max_response_len

    def make_batch(rows):
        prompts, responses = [r.prompt_ids for r in rows], [r.response_ids for r in rows]
        return rl_batch.pack(prompts, responses, P, R, data.pad_id)

    return _supervised_stage(
        "sft", setup, data.sft_records, make_batch, sft_loss_fn(P), cfg.sft, run_dir,
        logger, seed,
    )  # fmt: skip


def run_reward_model(setup: RoleSetup, data, cfg, run_dir: Path, logger, seed: int) -> Path:
    """Bradley-Terry training of the reward model on preference pairs."""
    P, R = cfg.task.max_prompt_len, cfg.task.max_response_len

    def make_batch(pairs):
        # chosen rows first, rejected rows second: reward_loss_fn splits the batch in half.
        prompts = [p.prompt_ids for p in pairs] * 2
        responses = [p.chosen_ids for p in pairs] + [p.rejected_ids for p in pairs]
        return rl_batch.pack(prompts, responses, P, R, data.pad_id)

    return _supervised_stage(
        "rm", setup, data.preference_records, make_batch, reward_loss_fn, cfg.rm,
        run_dir, logger, seed,
    )  # fmt: skip


def _fresh(path: Path) -> Path:
    """Clear a stage directory left incomplete by an interrupted save (it lacks model.json)."""
    if path.exists() and not (path / checkpoint.MODEL_JSON).exists() and is_primary():
        shutil.rmtree(path)
    barrier(f"fresh:{path}")
    return path
