"""Supervised stages of the pipeline: SFT of the actor and Bradley-Terry reward-model training.

Both use the shared functional train step (jrlhf.train_step) on the role's training mesh and the
batch layout of jrlhf.ppo.batch; each writes its result as a model checkpoint into the run
directory (``sft/``, ``rm/``), which later stages reference as ``stage:sft`` / ``stage:rm``.
A stage whose output already exists is skipped, so a resumed pipeline does not redo it.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jrlhf import checkpoint
from jrlhf.ppo import batch as rl_batch
from jrlhf.ppo.core_algos import bradley_terry_loss, sft_loss
from jrlhf.roles import RoleSetup, load_weights
from jrlhf.train_step import (
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
            values = {f"{tag}/{k}": float(v) for k, v in jax.device_get(metrics).items()}
            values[f"{tag}/steps_per_s"] = (i + 1) / (time.perf_counter() - start)
            logger.log(i + 1, values)
    return state.params


def run_sft(setup: RoleSetup, source, data, cfg, run_dir: Path, logger, seed: int) -> Path:
    """Supervised fine-tuning of the actor on prompt/response demonstrations."""
    out = run_dir / "sft"
    if (out / checkpoint.MODEL_JSON).exists():
        log.info("sft: %s exists, skipping the stage", out)
        return out
    P, R = cfg.task.max_prompt_len, cfg.task.max_response_len
    records = data.sft_records
    rng = np.random.default_rng([seed, 1])

    def batches():
        while True:
            idx = rng.choice(len(records), cfg.sft.batch_size, replace=False)
            chosen = [records[i] for i in idx]
            yield rl_batch.pack(
                [r.prompt_ids for r in chosen], [r.response_ids for r in chosen], P, R, data.pad_id
            )

    params = load_weights(setup.model, source, setup.meshes["train"], setup.rules["train"], seed)
    opt = OptimizerConfig(
        learning_rate=cfg.sft.learning_rate,
        warmup_steps=cfg.sft.warmup_steps,
        total_steps=cfg.sft.steps,
        min_lr_ratio=0.1,
        grad_clip=setup.config.grad_clip,
    )
    params = _train_loop(
        setup, params, sft_loss_fn(P), batches(), cfg.sft.steps, opt, logger, "sft", seed
    )
    checkpoint.save_model(_fresh(out), setup.model, params)
    return out


def run_reward_model(setup: RoleSetup, source, data, cfg, run_dir: Path, logger, seed: int):
    """Bradley-Terry training of the reward model on preference pairs."""
    out = run_dir / "rm"
    if (out / checkpoint.MODEL_JSON).exists():
        log.info("rm: %s exists, skipping the stage", out)
        return out
    P, R = cfg.task.max_prompt_len, cfg.task.max_response_len
    pairs = data.preference_records
    rng = np.random.default_rng([seed, 2])

    def batches():
        while True:
            idx = rng.choice(len(pairs), cfg.rm.batch_size, replace=False)
            chosen = [pairs[i] for i in idx]
            prompts = [p.prompt_ids for p in chosen] * 2
            responses = [p.chosen_ids for p in chosen] + [p.rejected_ids for p in chosen]
            yield rl_batch.pack(prompts, responses, P, R, data.pad_id)

    params = load_weights(setup.model, source, setup.meshes["train"], setup.rules["train"], seed)
    opt = OptimizerConfig(
        learning_rate=cfg.rm.learning_rate,
        warmup_steps=cfg.rm.warmup_steps,
        total_steps=cfg.rm.steps,
        min_lr_ratio=0.1,
        grad_clip=setup.config.grad_clip,
    )
    params = _train_loop(
        setup, params, reward_loss_fn, batches(), cfg.rm.steps, opt, logger, "rm", seed
    )
    checkpoint.save_model(_fresh(out), setup.model, params)
    return out


def _fresh(path: Path) -> Path:
    """Clear a stage directory left incomplete by an interrupted save (it lacks model.json)."""
    import shutil

    if path.exists() and not (path / checkpoint.MODEL_JSON).exists():
        shutil.rmtree(path)
    return path
