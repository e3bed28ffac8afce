"""A train step's gradients on the 1F1B pipeline schedule (``ModelConfig.pipeline_schedule``).

GPipe (``Transformer.hidden`` under a stage axis) is autodiff through the whole schedule, so a
device keeps every micro-batch's activations until the backward. 1F1B starts each
micro-batch's backward as soon as its forward leaves the last stage, which needs the loss of
that micro-batch right there: here the caller's ``loss_fn(module, batch)`` runs per
micro-batch on the last stage's output (``jrlhf.models.transformer.layers_output`` makes the
module's ``hidden`` return it), and ``jrlhf.models.pipeline.one_f_one_b`` runs the schedule
with gradients by hand. The micro-batches add up as the train step's gradient accumulation
adds its own: each weighs in by its ``metrics["weight"]``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jrlhf.models import pipeline
from jrlhf.models.model_def import ModelDef, Params
from jrlhf.models.transformer import layers_output


@dataclasses.dataclass(frozen=True)
class PipelineParts:
    """One model's loss on one batch cut for a hand-scheduled pipeline: ``stage_fn`` and the
    stacked ``stage_params`` (leaves (S, K, ...)); ``aux`` the micro-batches' positions and
    segment ids; ``micro`` their count; ``embed(m)`` / ``embed_grads(m, dx)`` the first stage's
    input of micro-batch ``m`` and the gradients its cotangent gives; ``head(m, y)`` (dy,
    gradients of the parameters outside the stages, weighted statistics) of the micro-batch's
    weighted loss at the last stage's output ``y`` (see ``pipeline.one_f_one_b``)."""

    stage_fn: Any
    stage_params: Any
    aux: Any
    micro: int
    embed: Callable
    embed_grads: Callable
    head: Callable


def pipeline_parts(
    model: ModelDef,
    loss_fn,
    params: Params,
    batch: dict[str, jax.Array],
    stages: int,
    schedule: str,
) -> PipelineParts:
    """``model``'s ``loss_fn`` on ``batch`` in the pieces a hand-scheduled pipeline over
    ``stages`` stages runs. The rows must split into ``pipeline_microbatches`` (default:
    ``stages``) equal micro-batches; ``schedule`` names the schedule in that error."""
    micro = model.config.pipeline_microbatches or stages
    rows = batch["tokens"].shape[0]
    if rows % micro:
        raise ValueError(
            f"a batch of {rows} rows does not split into pipeline_microbatches={micro} for the "
            f"{schedule} schedule (use a multiple, or the gpipe schedule, which pads)"
        )
    split = jax.tree.map(lambda a: a.reshape(micro, rows // micro, *a.shape[1:]), batch)
    module = model.bind(params)
    stage_fn = module.stage_function(stages)
    _, state = nnx.split(module.layers)
    stage_params = nnx.to_pure_dict(pipeline.split_stages(state, stages))
    layers = params["layers"]
    rest = {k: v for k, v in params.items() if k != "layers"}

    def with_rest(outer: Params) -> Any:
        return model.bind({**outer, "layers": layers})

    def micro_batch(m) -> dict[str, jax.Array]:
        return jax.tree.map(lambda a: a[m], split)

    def embed(m):
        return with_rest(rest).embed(split["tokens"][m])

    def embed_grads(m, dx):
        _, vjp = jax.vjp(lambda outer: with_rest(outer).embed(split["tokens"][m]), rest)
        return vjp(dx)[0]

    def head(m, y):
        mb = micro_batch(m)

        def weighted_loss(outer, y):
            with layers_output(y):
                value, metrics = loss_fn(with_rest(outer), mb)
            weight = metrics.get("weight", jnp.float32(1.0))
            return value * weight, (value, metrics, weight)

        _, vjp, (value, metrics, weight) = jax.vjp(weighted_loss, rest, y, has_aux=True)
        d_rest, dy = vjp(jnp.ones((), jnp.float32))
        stats = (*jax.tree.map(lambda x: x * weight, (value, metrics)), weight)
        return dy, d_rest, stats

    aux = (split["positions"], split["segment_ids"])
    return PipelineParts(stage_fn, stage_params, aux, micro, embed, embed_grads, head)


def finish(
    model: ModelDef, g_stages: Any, g_rest: Params, stats: Any
) -> tuple[jax.Array, dict[str, jax.Array], Params]:
    """(loss, metrics, gradients of the trainable part) from a hand-scheduled pipeline's sums:
    the stage gradients (S, K, ...) back to the layer stack, everything divided by the summed
    weight (a weighted mean over the micro-batches, as ``jax.value_and_grad`` of the whole
    batch's loss gives it)."""
    value, metrics, weight = stats
    weight = jnp.maximum(weight, 1e-9)
    g_layers = jax.tree.map(lambda g: g.reshape(-1, *g.shape[2:]), g_stages)
    grads = jax.tree.map(lambda g: g / weight, {**g_rest, "layers": g_layers})
    value, metrics = jax.tree.map(lambda x: x / weight, (value, metrics))
    if "weight" in metrics:  # the batch's own weight, as value_and_grad of the whole reports
        metrics = dict(metrics, weight=weight)
    return value, metrics, model.trainable(grads)


def grads_1f1b(
    model: ModelDef, loss_fn, params: Params, batch: dict[str, jax.Array], stages: int
) -> tuple[jax.Array, dict[str, jax.Array], Params]:
    """(loss, metrics, gradients of the trainable part) of ``loss_fn`` on ``batch``, as
    ``jax.value_and_grad`` of it gives them (weighted mean over the pipeline's micro-batches),
    computed on the 1F1B schedule over ``stages`` stages. The rows must split into
    ``pipeline_microbatches`` (default: ``stages``) equal micro-batches."""
    p = pipeline_parts(model, loss_fn, params, batch, stages, "1f1b")
    g_stages, g_rest, stats = pipeline.one_f_one_b(
        p.stage_fn, p.stage_params, p.aux, p.micro, p.embed, p.embed_grads, p.head
    )
    return finish(model, g_stages, g_rest, stats)
