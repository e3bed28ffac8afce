"""A functional, sharded training step: explicit in/out shardings, donated state, optax.

``make_train_step`` turns any ``loss_fn(module, batch) -> (loss, metrics)`` into a jitted step over
a ``TrainState`` whose parameters and optimizer state live in their mesh layout. SFT, reward-model
training and the PPO actor/critic updates all go through it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jrlhf.meshes.batch import check_batch_divides, shard_batch
from jrlhf.meshes.context import activation_sharding, layer_stages
from jrlhf.meshes.rules import Rules, get_rules
from jrlhf.models import lora as lora_lib
from jrlhf.models.model_def import ModelDef, Params
from jrlhf.models.transformer import Transformer
from jrlhf.runtime.guard import tree_is_finite
from jrlhf.runtime.pipeline_step import grads_1f1b
from jrlhf.shared_programs import shared_program

# loss_fn(module, batch) -> (loss, metrics). metrics may carry "weight": how much this batch
# counts when microbatches are accumulated (the number of tokens a token-mean loss averages).
LossFn = Callable[[Transformer, dict[str, jax.Array]], tuple[jax.Array, dict[str, jax.Array]]]


@flax.struct.dataclass
class TrainState:
    """``params``: the model's whole tree; ``opt_state``: the optimizer's state of its
    trainable part (``ModelDef.trainable``: all of it, or with LoRA the adapters)."""

    step: jax.Array
    params: Params
    opt_state: Any


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with warmup + cosine/constant schedule and global-norm clipping."""

    learning_rate: float = 1e-5
    warmup_steps: int = 0
    total_steps: int = 0  # > 0 enables cosine decay to min_lr_ratio * learning_rate
    min_lr_ratio: float = 0.0
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float = 1.0


@shared_program()
def make_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
    if cfg.total_steps > 0:
        schedule = optax.warmup_cosine_decay_schedule(
            0.0 if cfg.warmup_steps else cfg.learning_rate,
            cfg.learning_rate,
            max(cfg.warmup_steps, 1) if cfg.warmup_steps else 1,
            max(cfg.total_steps, cfg.warmup_steps + 1),
            end_value=cfg.learning_rate * cfg.min_lr_ratio,
        )
    elif cfg.warmup_steps > 0:
        schedule = optax.linear_schedule(0.0, cfg.learning_rate, cfg.warmup_steps)
    else:
        schedule = optax.constant_schedule(cfg.learning_rate)
    # Decay matrices only: norms and biases keep their scale.
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # noqa: E731
    parts = [
        optax.adamw(
            schedule,
            b1=cfg.b1,
            b2=cfg.b2,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            mask=decay_mask,
        )
    ]
    if cfg.grad_clip > 0:
        parts.insert(0, optax.clip_by_global_norm(cfg.grad_clip))
    return optax.chain(*parts)


def _replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def opt_state_shardings(opt_state: Any, param_shardings: Params, mesh: Mesh) -> Any:
    """Shardings for an optimizer state: leaves mirroring a parameter take its sharding.

    Optax states hold trees shaped like the parameters (Adam's mu/nu); a leaf whose key path ends
    with a parameter's path and has its shape is laid out like that parameter, anything else
    (counts, scalars) is replicated.
    """
    by_path = {}
    for path, sharding in jax.tree_util.tree_leaves_with_path(param_shardings):
        by_path[tuple(str(getattr(p, "key", p)) for p in path)] = sharding

    def pick(path, leaf):
        keys = tuple(str(getattr(p, "key", getattr(p, "name", p))) for p in path)
        for start in range(len(keys)):
            sharding = by_path.get(keys[start:])
            if sharding is not None and len(sharding.spec) <= len(getattr(leaf, "shape", ())):
                return sharding
        return _replicated(mesh)

    return jax.tree_util.tree_map_with_path(pick, opt_state)


def state_shardings(
    model: ModelDef, optimizer: optax.GradientTransformation, mesh: Mesh, rules: Rules | str
) -> TrainState:
    """The TrainState's shardings: parameters by their logical axes, optimizer moments like the
    parameters they follow (only the trainable ones', ``ModelDef.trainable``), everything else
    replicated."""
    return _state_shardings(model, optimizer, mesh, get_rules(rules))


@shared_program()
def _state_shardings(
    model: ModelDef, optimizer: optax.GradientTransformation, mesh: Mesh, rules: Rules
) -> TrainState:
    params = model.shardings(mesh, rules)
    abstract_opt = jax.eval_shape(optimizer.init, model.trainable(model.abstract_params))
    return TrainState(
        step=_replicated(mesh),
        params=params,
        opt_state=opt_state_shardings(abstract_opt, params, mesh),
    )


@shared_program()
def _state_init_program(
    model: ModelDef, optimizer: optax.GradientTransformation, mesh: Mesh, rules: Rules, fresh: bool
) -> Callable:
    """The jitted TrainState initializer: from a random key (``fresh``) or from parameters.
    Shared, like the train steps, by every state built of one model, optimizer and layout in a
    process (make_optimizer returns one optimizer per config)."""

    def init(key_or_params):
        params = model.init(key_or_params) if fresh else key_or_params
        return TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(model.trainable(params)))

    return jax.jit(init, out_shardings=state_shardings(model, optimizer, mesh, rules))


def init_train_state(
    model: ModelDef,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    rules: Rules | str,
    params: Params | None = None,
    seed: int = 0,
) -> TrainState:
    """A sharded TrainState; fresh random parameters unless ``params`` are given."""
    rules = get_rules(rules)
    if params is None:
        return _state_init_program(model, optimizer, mesh, rules, True)(jax.random.key(seed))
    params = jax.device_put(params, state_shardings(model, optimizer, mesh, rules).params)
    return _state_init_program(model, optimizer, mesh, rules, False)(params)


def apply_update(
    model: ModelDef,
    optimizer: optax.GradientTransformation,
    state: TrainState,
    value: jax.Array,
    metrics: dict[str, jax.Array],
    grads: Params,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """The optimizer step of a train step (traced inside its jit): ``state`` updated with
    ``grads`` unless the loss or gradient norm is not finite, and the step's metrics (``loss``,
    ``grad_norm``, ``skipped`` added)."""
    grad_norm = optax.tree.norm(grads)
    # The guard (jrlhf.runtime.guard): an update whose loss or gradient norm is not finite
    # is skipped, the state kept as it was; the caller counts skips in a row. The decision
    # is taken before the update, so the keep-or-replace select fuses into the update's
    # own elementwise passes and the donated state is updated in place. Deciding on the
    # new parameters' finiteness too would need the old and the new state side by side
    # and three more passes over them (docs/plans.md, "the optimizer update's compiled
    # passes"). With finite gradients an AdamW step overflows only where the settings are
    # absurd (a learning rate near the float range, learning rate x weight decay above 2,
    # float16 parameters whose eps and squared gradients round to zero). That case is
    # still caught but not undone: it and every update after it (the parameters stay
    # non-finite) are reported ``skipped``, so the guard stops the run, and check_finite
    # refuses to save such a state.
    ok = jnp.isfinite(value) & jnp.isfinite(grad_norm)
    trainable = model.trainable(state.params)
    updates, opt_state = optimizer.update(grads, state.opt_state, trainable)
    updated = (state.step + 1, optax.apply_updates(trainable, updates), opt_state)
    old = (state.step, trainable, state.opt_state)
    step_n, trainable, opt_state = jax.tree.map(
        lambda new, old: jnp.where(ok, new, old), updated, old
    )
    new_state = TrainState(step_n, model.with_trainable(state.params, trainable), opt_state)
    ok = ok & tree_is_finite(trainable)
    metrics = dict(metrics, loss=value, grad_norm=grad_norm, skipped=1.0 - ok)
    return new_state, metrics


@shared_program()
def make_train_step(
    model: ModelDef,
    optimizer: optax.GradientTransformation,
    loss_fn: LossFn,
    mesh: Mesh,
    rules: Rules | str,
    *,
    microbatches: int = 1,
    donate: bool = True,
) -> Callable[[TrainState, dict[str, jax.Array]], tuple[TrainState, dict[str, jax.Array]]]:
    """Jitted ``step(state, batch) -> (state, metrics)`` with the state donated.

    An update whose loss or gradient norm is not finite is skipped (the state returned
    unchanged) and ``metrics["skipped"]`` is 1; one whose new parameters overflow is reported
    as skipped too, but applied (see the guard's comment below): callers count skips with
    jrlhf.runtime.guard.UpdateGuard.

    With ``microbatches > 1`` the batch's leading axis is split and gradients are accumulated
    under ``lax.scan`` (one optimizer update), trading time for activation memory. A call may
    pass its own ``microbatches`` (``step(state, batch, microbatches=m)``: the split a token
    budget chose for this batch, jrlhf.data.batch.fit_microbatches); each count compiles once.
    """
    rules = get_rules(rules)
    shardings = state_shardings(model, optimizer, mesh, rules)

    # Gradients of the trainable part only (with LoRA the adapters: no gradient, and no optimizer
    # state, for the frozen base). LoRA dropout draws from a key of the step count, so a resumed
    # run repeats the masks of the uninterrupted one.
    dropout = model.lora is not None and model.lora.dropout > 0

    def grads_of(params, batch, key=None):
        stages = layer_stages()
        if stages > 1 and model.config.pipeline_schedule == "1f1b":
            # the layers over pipeline stages on the 1F1B schedule, gradients by hand
            with lora_lib.dropout_key(key):
                return grads_1f1b(model, loss_fn, params, batch, stages)

        def loss(trainable):
            with lora_lib.dropout_key(key):
                return loss_fn(model.bind(model.with_trainable(params, trainable)), batch)

        (value, metrics), grads = jax.value_and_grad(loss, has_aux=True)(model.trainable(params))
        return value, metrics, grads

    def build(microbatches: int):
        def step(state: TrainState, batch):
            key = jax.random.fold_in(jax.random.key(0), state.step) if dropout else None
            with activation_sharding(mesh, rules):
                if microbatches == 1:
                    value, metrics, grads = grads_of(state.params, batch, key)
                else:
                    split = jax.tree.map(
                        lambda x: x.reshape(microbatches, x.shape[0] // microbatches, *x.shape[1:]),
                        batch,
                    )

                    # Each microbatch counts by its metrics["weight"] (e.g. its number of loss
                    # tokens), so a token-mean loss accumulates to the full batch's token mean.
                    def body(acc, mb_i):
                        mb, i = mb_i
                        mb_key = None if key is None else jax.random.fold_in(key, i)
                        value, metrics, grads = grads_of(state.params, mb, mb_key)
                        w = metrics.get("weight", jnp.float32(1.0))
                        scaled = jax.tree.map(lambda x: x * w, (value, metrics, grads))
                        return jax.tree.map(jnp.add, acc, (*scaled, w)), None

                    shapes = jax.eval_shape(
                        grads_of, state.params, jax.tree.map(lambda x: x[0], split)
                    )
                    zero = jax.tree.map(jnp.zeros_like, (*shapes, jnp.float32(0.0)))
                    (*total, weight), _ = jax.lax.scan(
                        body, zero, (split, jnp.arange(microbatches))
                    )
                    weight = jnp.maximum(weight, 1e-9)
                    value, metrics, grads = jax.tree.map(lambda x: x / weight, tuple(total))
            return apply_update(model, optimizer, state, value, metrics, grads)

        return jax.jit(
            step,
            in_shardings=(shardings, None),
            out_shardings=(shardings, _replicated(mesh)),
            donate_argnums=(0,) if donate else (),
        )

    compiled: dict[int, Callable] = {}

    def jitted_for(m: int) -> Callable:
        if m not in compiled:
            compiled[m] = build(m)
        return compiled[m]

    def run(state, batch, microbatches: int = microbatches):
        check_batch_divides(batch, mesh, rules, microbatches)
        return jitted_for(microbatches)(state, shard_batch(batch, mesh, rules))

    run.jitted = jitted_for(microbatches)  # the default split's, for compile counts and AOT
    return run
