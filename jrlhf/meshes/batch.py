"""How a batch of examples is laid over a mesh: rows split over the rule set's ``batch`` axes.

The one place that puts host batches on devices, for training steps and inference calls alike.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from jrlhf.meshes.rules import Rules, axis_size, get_rules, logical_to_spec


def batch_sharding(mesh: Mesh, rules: Rules | str, ndim: int) -> NamedSharding:
    """Batch arrays are split over the rule set's ``batch`` axes and replicated otherwise."""
    logical = ("batch",) + (None,) * (ndim - 1)
    return NamedSharding(mesh, logical_to_spec(logical, mesh, get_rules(rules)))


def batch_shardings(batch: dict[str, Any], mesh: Mesh, rules: Rules | str) -> dict[str, Any]:
    """The sharding of every field of ``batch``."""
    return {k: batch_sharding(mesh, rules, jnp.ndim(v)) for k, v in batch.items()}


def check_batch_divides(
    batch: dict[str, Any], mesh: Mesh, rules: Rules | str, microbatches: int = 1
) -> None:
    """One-line error when a batch cannot be split over the mesh's batch axes."""
    for name, value in batch.items():
        spec = batch_sharding(mesh, rules, jnp.ndim(value)).spec
        axes = spec[0] if spec else None
        n = axis_size(mesh, axes)
        size = jnp.shape(value)[0]
        if size % (n * microbatches):
            raise ValueError(
                f"batch field {name!r} has {size} rows, not divisible by the batch mesh axes "
                f"{axes} (size {n}) x microbatches {microbatches}"
            )


def shard_batch(batch: dict[str, Any], mesh: Mesh, rules: Rules | str) -> dict[str, jax.Array]:
    """Put a host batch on ``mesh``, rows split over the batch axes."""
    return jax.device_put(batch, batch_shardings(batch, mesh, rules))
