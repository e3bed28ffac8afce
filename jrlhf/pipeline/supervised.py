"""Supervised stages of the pipeline: SFT of the actor, Bradley-Terry reward-model training and
direct preference optimization (DPO) of the actor.

All use the shared functional train step (jrlhf.runtime.steps) on the role's training mesh and the
batch layout of jrlhf.ppo.batch; each writes its result as a model checkpoint into the run
directory (``sft/``, ``rm/``, ``dpo/``), which later stages reference as ``stage:sft`` /
``stage:rm`` / ``stage:dpo``. A stage whose output already exists is skipped, so a resumed
pipeline does not redo it; a stage cut off mid-way resumes from its last mid-stage checkpoint
(``sft_checkpoints/``, ``rm_checkpoints/``, ``dpo_checkpoints/``, removed once the stage's output
is written).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jrlhf import checkpoint
from jrlhf.data.batch import fit_microbatches
from jrlhf.meshes.batch import batch_shards, to_host
from jrlhf.meshes.processes import barrier, is_primary
from jrlhf.meshes.rules import Rules
from jrlhf.models.model_def import ModelDef, Params
from jrlhf.models.moe import add_router_losses
from jrlhf.pipeline.run_dir import before_training
from jrlhf.ppo import batch as rl_batch
from jrlhf.ppo.core_algos import (
    DPO_MEAN_LOGPROBS,
    bradley_terry_loss,
    dpo_loss,
    sequence_logprobs,
    sft_loss,
)
from jrlhf.runtime.gc_freeze import warm_freeze
from jrlhf.runtime.guard import UpdateGuard, check_finite
from jrlhf.runtime.model_source import ModelSource, load_weights
from jrlhf.runtime.preempt import exit_at_step_if_asked
from jrlhf.runtime.roles import RoleSetup, make_infer
from jrlhf.runtime.steps import (
    OptimizerConfig,
    init_train_state,
    make_optimizer,
    make_train_step,
    state_shardings,
)
from jrlhf.shared_programs import shared_program
from jrlhf.storage import write_atomic

log = logging.getLogger("jrlhf")

# Test hook: exit abruptly (like a preempted job) right after this step, e.g. "sft:40".
# Stages whose batches are preference pairs (a chosen row, then its rejected row).
PAIR_STAGES = ("rm", "dpo")


@shared_program()
def sft_loss_fn(max_prompt_len: int):
    def loss_fn(module, batch):
        hidden, stats = rl_batch.response_hidden(module, batch, max_prompt_len, with_stats=True)
        loss, metrics = sft_loss(module.logits(hidden), batch["response_tokens"], batch["mask"])
        loss, metrics = add_router_losses(
            module.config, stats, batch["segment_ids"] > 0, loss, metrics
        )
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
    scores, stats = rl_batch.sequence_scores(module, batch, with_stats=True)
    loss, metrics = bradley_terry_loss(scores[0::2], scores[1::2])
    loss, metrics = add_router_losses(module.config, stats, batch["segment_ids"] > 0, loss, metrics)
    return loss, dict(metrics, weight=jnp.float32(scores.shape[0] // 2))


@shared_program()
def dpo_loss_fn(max_prompt_len: int, dpo):
    """DPO (``core_algos.dpo_loss``) on a batch of pair rows (``pack_pairs``) carrying each
    row's reference log-prob, computed once before training (``batch["ref_logprobs"]``, in the
    loss type's form: sum, or per-token mean)."""
    mean = dpo.loss_type in DPO_MEAN_LOGPROBS

    def loss_fn(module, batch):
        logp_bt, stats = rl_batch.response_logprobs(module, batch, max_prompt_len, with_stats=True)
        policy_b = sequence_logprobs(logp_bt, batch["mask"], mean=mean)
        ref_b = batch["ref_logprobs"]
        has_tokens_b = batch["mask"].sum(axis=-1) > 0
        pair_b = has_tokens_b[0::2] & has_tokens_b[1::2]
        loss, metrics = dpo_loss(
            policy_b[0::2], policy_b[1::2], ref_b[0::2], ref_b[1::2],
            dpo.beta, dpo.loss_type, dpo.label_smoothing, pair_b,
        )  # fmt: skip
        loss, metrics = add_router_losses(
            module.config, stats, batch["segment_ids"] > 0, loss, metrics
        )
        return loss, dict(metrics, weight=pair_b.sum().astype(jnp.float32))

    return loss_fn


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
    target = checkpoint.restore_target(abstract, shardings)
    target = target.replace(params=setup.model.trainable(target.params))
    restored = checkpoint.restore_trainer_state(manager, {role: target})
    if restored is None:
        done = 0
        params = load_weights(setup.source, mesh, rules, seed)
        state = init_train_state(setup.model, optimizer, mesh, rules, params=params, seed=seed)
    else:
        meta, states = restored
        done, state = int(meta["step"]), states[role]
        if setup.model.lora is not None:  # the adapters, on the frozen base from its source
            params = load_weights(setup.source, mesh, rules, seed)
            state = state.replace(params=setup.model.with_trainable(params, state.params))
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
    # RoleConfig.microbatch_tokens: the fewest micro-batches within the budget, of whole pairs
    # in the pair stages (every batch has the same shape, so one split and one compile).
    budget, unit = setup.config.microbatch_tokens, 2 if name in PAIR_STAGES else 1
    shards = batch_shards(mesh, rules)

    def split(batch):
        if not budget:
            return batch, setup.config.microbatches
        m, batch = fit_microbatches(batch, budget, shards, cfg.task.max_prompt_len, unit=unit)
        return batch, m

    guard = UpdateGuard(cfg.run.max_nonfinite_updates, name)
    pending: list = []  # each step's "skipped" flag, fetched at the next log point
    start, start_step = time.perf_counter(), done
    with warm_freeze(cfg.run.gc_freeze, name) as freezer:
        for i in range(done, steps):
            batch, m = split(make_batch([records[j] for j in draw()]))
            state, metrics = step_fn(state, batch, m)
            pending.append(metrics["skipped"])
            freezer.step_done()
            step = i + 1
            exit_at_step_if_asked(name, step)  # a test's preemption, no cleanup
            if step % 25 == 0 or step == steps:
                skipped = guard.record(role, to_host(pending), f"step {step}")
                pending = []
                values = {f"{name}/{k}": float(v) for k, v in to_host(metrics).items()}
                values[f"{name}/skipped_updates"] = float(skipped)
                del values[f"{name}/skipped"]
                if budget:  # the split a token budget chose; the accumulated weight means nothing
                    values[f"{name}/microbatches"] = float(m)
                    del values[f"{name}/weight"]
                values[f"{name}/steps_per_s"] = (step - start_step) / (time.perf_counter() - start)
                logger.log(step, values)
            every = stage_cfg.checkpoint_every
            if every and step % every == 0 and step < steps:
                guard.record(role, to_host(pending), f"step {step}")
                pending = []
                check_finite(state, f"{name} {role} at step {step}")
                meta = {"step": step, "stage": name, "seed": seed}
                models = {role: setup.model}
                bases = {role: checkpoint.base_entry(setup.source.weights, seed)}
                checkpoint.save_trainer_state(manager, step, meta, {role: state}, models, bases)
    manager.wait_until_finished()
    check_finite(state.params, f"{name} {role} at step {steps}")
    # A LoRA stage's output is its adapters merged into the base: a plain model checkpoint.
    merged = setup.model.merge_sharded(state.params, mesh, rules)
    checkpoint.save_model(_fresh(out), setup.model.base, merged)
    # The stage's output is complete (model.json written last): its mid-stage states are
    # superseded.
    manager.close()
    barrier(f"{name}:done")
    if is_primary():
        shutil.rmtree(_state_dir(run_dir, name), ignore_errors=True)
    return out


def sft_batch(rows: Sequence[Any], max_prompt_len: int, max_response_len: int, pad_id: int):
    """SFT records in the batch layout; a record's ``loss_mask`` (a conversation's: its
    assistant turns only) zeroes the loss on the response tokens it marks 0."""
    prompts, responses = [r.prompt_ids for r in rows], [r.response_ids for r in rows]
    batch = rl_batch.pack(prompts, responses, max_prompt_len, max_response_len, pad_id)
    for i, r in enumerate(rows):
        loss_mask = getattr(r, "loss_mask", None)
        if loss_mask is not None:
            batch["mask"][i, : len(loss_mask)] *= np.asarray(loss_mask, np.float32)
    return batch


def run_sft(setup: RoleSetup, data, cfg, run_dir: Path, logger, seed: int) -> Path:
    """Supervised fine-tuning of the actor on prompt/response demonstrations."""
    P, R = cfg.task.max_prompt_len, cfg.task.max_response_len

    def make_batch(rows):
        return sft_batch(rows, P, R, data.pad_id)

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


@dataclasses.dataclass
class PairScorer:
    """Summed response log-probs of preference pairs (two per pair: chosen, rejected) under a
    language model on one mesh, ``pairs_per_call`` pairs at a time: the last call is filled up
    with the first pairs, so one compiled program per model serves any number of pairs."""

    mesh: Any
    rules: Rules
    max_prompt_len: int
    max_response_len: int
    pad_id: int
    pairs_per_call: int
    _infers: dict = dataclasses.field(default_factory=dict)

    def __call__(self, model: ModelDef, params: Params, pairs: Sequence[Any]) -> np.ndarray:
        if not pairs:
            return np.zeros(0, np.float32)
        if model not in self._infers:
            P = self.max_prompt_len

            def summed(module, batch):
                logp_bt = rl_batch.response_logprobs(module, batch, P)
                return sequence_logprobs(logp_bt, batch["mask"])

            rows = 2 * self.pairs_per_call
            self._infers[model] = make_infer(model, self.mesh, self.rules, summed, rows)
        infer, n = self._infers[model], self.pairs_per_call
        outs = []  # device arrays, fetched together: the calls run back to back
        for start in range(0, len(pairs), n):
            chunk = [pairs[i % len(pairs)] for i in range(start, start + n)]
            packed = pack_pairs(chunk, self.max_prompt_len, self.max_response_len, self.pad_id)
            outs.append(infer(params, packed))
        return np.concatenate(to_host(outs))[: 2 * len(pairs)]


def reference_logprobs(
    scorer: PairScorer, reference: ModelSource, pairs: Sequence[Any], seed: int
) -> np.ndarray:
    """The frozen reference's summed log-probs of every pair's rows: the dpo stage's one pass of
    the reference over its pairs, before training (its weights are dropped after)."""
    params = load_weights(reference, scorer.mesh, scorer.rules, seed)
    return scorer(reference.model, params, pairs)


def _loss_form(sums: np.ndarray, counts: np.ndarray, loss_type: str) -> np.ndarray:
    """Summed log-probs in the form the DPO loss type compares: sums, or per-token means."""
    if loss_type not in DPO_MEAN_LOGPROBS:
        return sums.astype(np.float32)
    return np.where(counts > 0, sums / np.maximum(counts, 1), 0.0).astype(np.float32)


def preference_metrics(
    policy_sums: np.ndarray, ref_sums: np.ndarray, counts: np.ndarray, dpo
) -> dict[str, float]:
    """How a policy ranks preference pairs (rows as ``pack_pairs`` lays them out):
    ``logp_accuracy``, the fraction of pairs whose chosen response it finds likelier (summed
    log-probs), and ``logp_margin``, their mean difference; and against the reference, the DPO
    loss, its implicit-reward ``accuracy`` and ``reward_margin`` (core_algos.dpo_loss)."""
    policy = _loss_form(policy_sums, counts, dpo.loss_type)
    ref = _loss_form(ref_sums, counts, dpo.loss_type)
    pair = (counts[0::2] > 0) & (counts[1::2] > 0)
    loss, metrics = dpo_loss(
        policy[0::2], policy[1::2], ref[0::2], ref[1::2],
        dpo.beta, dpo.loss_type, dpo.label_smoothing, pair,
    )  # fmt: skip
    margin = (policy_sums[0::2] - policy_sums[1::2])[pair]
    return {
        "logp_accuracy": float(np.mean(margin > 0)) if margin.size else 0.0,
        "logp_margin": float(np.mean(margin)) if margin.size else 0.0,
        "accuracy": float(metrics["accuracy"]),
        "reward_margin": float(metrics["reward_margin"]),
        "loss": float(loss),
        "pairs": int(pair.sum()),
    }


def _log_once(logger, step: int, values: dict[str, float]) -> None:
    """Log ``values`` at ``step`` unless a resumed stage already did."""
    if not any(r.get("step") == step and values.keys() <= r.keys() for r in logger.history):
        logger.log(step, values)


DPO_SUMMARY = "dpo_summary.json"


def run_dpo(
    setup: RoleSetup,
    reference: ModelSource,
    data,
    cfg,
    run_dir: Path,
    logger,
    seed: int,
) -> dict[str, Any]:
    """Direct preference optimization of the actor (``setup``, starting from its source) against
    the frozen ``reference`` on the task's preference pairs; returns the stage's summary: how
    the policy ranks the held-out pairs before and after (``preference_metrics``).

    The reference scores every pair once, before training, on the actor's training mesh; the
    batches carry its log-probs. Training is the shared supervised loop (mid-stage checkpoints,
    resume, the non-finite guard); the summary is kept in ``dpo_summary.json``.
    """
    name, dpo = "dpo", cfg.dpo
    out, summary_path = run_dir / name, run_dir / DPO_SUMMARY
    if (out / checkpoint.MODEL_JSON).exists() and summary_path.exists():
        log.info("%s: %s exists, skipping the stage", name, out)
        return json.loads(summary_path.read_text())
    P, R = cfg.task.max_prompt_len, cfg.task.max_response_len
    train, heldout, split = data.preference_records, data.heldout_preference_records, "held-out"
    if not heldout:
        heldout, split = train[: cfg.task.num_heldout_pairs], "training"
        log.warning(
            "%s: no held-out preference pairs (TaskConfig.heldout_preference_data): evaluating "
            "on the first %d training pairs",
            name,
            len(heldout),
        )
    mesh, rules = setup.meshes["train"], setup.rules["train"]
    scorer = PairScorer(mesh, rules, P, R, data.pad_id, dpo.infer_batch_size)
    start = time.perf_counter()
    ref_sums = reference_logprobs(scorer, reference, [*train, *heldout], seed)
    log.info(
        "%s: reference log-probs of %d pairs in %.1f s (%s)",
        name,
        len(train) + len(heldout),
        time.perf_counter() - start,
        reference.weights or "random init",
    )
    counts = np.array([len(r) for p in [*train, *heldout] for r in (p.chosen_ids, p.rejected_ids)])
    n = 2 * len(train)
    ref_form = _loss_form(ref_sums[:n], counts[:n], dpo.loss_type)

    def evaluate(policy_sums: np.ndarray) -> dict[str, float]:
        return preference_metrics(policy_sums, ref_sums[n:], counts[n:], dpo)

    def eval_values(metrics: dict[str, float]) -> dict[str, float]:
        return {f"eval/{split.replace('-', '')}_{k}": v for k, v in metrics.items()}

    def evaluate_start() -> dict[str, float]:
        if reference == setup.source:  # the policy starts as its reference: scored already
            start_sums = ref_sums[n:]
        else:
            start_sums = scorer(setup.model, load_weights(setup.source, mesh, rules, seed), heldout)
        before = evaluate(start_sums)
        _log_once(logger, 0, eval_values(before))
        return before

    before = before_training(run_dir, name, evaluate_start)

    def make_batch(idx):
        idx = np.asarray(idx)
        batch = pack_pairs([train[i] for i in idx], P, R, data.pad_id)
        batch["ref_logprobs"] = ref_form[np.stack([2 * idx, 2 * idx + 1], 1).reshape(-1)]
        return batch

    _supervised_stage(
        name, setup, list(range(len(train))), make_batch, dpo_loss_fn(P, dpo), dpo, cfg,
        run_dir, logger, seed,
    )  # fmt: skip
    params = load_weights(ModelSource(setup.model, f"ckpt:{out}"), mesh, rules, seed)
    after = evaluate(scorer(setup.model, params, heldout))
    _log_once(logger, dpo.steps, eval_values(after))
    log.info(
        "%s: %s preference accuracy %.3f -> %.3f (implicit reward %.3f -> %.3f)",
        name, split, before["logp_accuracy"], after["logp_accuracy"],
        before["accuracy"], after["accuracy"],
    )  # fmt: skip
    summary = {"stage": name, "split": split, "before": before, "after": after}
    if is_primary():
        write_atomic(summary_path, json.dumps(summary, indent=2))
    return summary


def _fresh(path: Path) -> Path:
    """Clear a stage directory left incomplete by an interrupted save (it lacks model.json)."""
    if path.exists() and not (path / checkpoint.MODEL_JSON).exists() and is_primary():
        shutil.rmtree(path)
    barrier(f"fresh:{path}")
    return path
