"""Activation sharding constraints from logical names.

Model code calls ``constrain(x, ("batch", "length", "act_embed"))``. Inside ``activation_sharding
(mesh, rules)`` this becomes ``with_sharding_constraint`` to the rule set's layout; outside it is a
no-op, so the same model code runs unsharded. Enter the context inside the traced function, so each
jitted closure bakes in its own mesh and rules.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax
from jax.sharding import Mesh, NamedSharding

from jrlhf.meshes.rules import Rules, axis_size, get_rules, logical_to_spec

_CURRENT: contextvars.ContextVar[tuple[Mesh, Rules] | None] = contextvars.ContextVar(
    "jrlhf_activation_sharding", default=None
)


@contextlib.contextmanager
def activation_sharding(mesh: Mesh | None, rules) -> Iterator[None]:
    token = _CURRENT.set(None if mesh is None else (mesh, get_rules(rules)))
    try:
        yield
    finally:
        _CURRENT.reset(token)


def constrain(x: jax.Array, logical: tuple[str | None, ...]) -> jax.Array:
    current = _CURRENT.get()
    if current is None:
        return x
    mesh, rules = current
    spec = logical_to_spec(logical, mesh, rules)
    # Skip dimensions that do not divide (e.g. a batch of 1 during decode): a constraint is a
    # hint, and an impossible one would fail compilation.
    if any(size % axis_size(mesh, part) for size, part in zip(x.shape, spec)):
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def layer_stages() -> int:
    """How many pipeline stages the current rules split the stacked layer axis over (the size of
    the mesh axes ``layers`` maps to; 1 outside ``activation_sharding`` or without a stage
    axis). Full-sequence passes pipeline their layers when it is above 1."""
    current = _CURRENT.get()
    if current is None:
        return 1
    mesh, rules = current
    return axis_size(mesh, logical_to_spec(("layers",), mesh, rules)[0])


def current_rules() -> Rules | None:
    current = _CURRENT.get()
    return None if current is None else current[1]


def current_mesh() -> Mesh | None:
    current = _CURRENT.get()
    return None if current is None else current[0]


def shard_count(logical: str) -> int:
    """Over how many devices the current rule set splits the logical axis ``logical`` (1
    outside ``activation_sharding``, or where its mesh axes are absent)."""
    current = _CURRENT.get()
    if current is None:
        return 1
    mesh, rules = current
    return axis_size(mesh, logical_to_spec((logical,), mesh, rules)[0])


def current_layout() -> tuple[Mesh, Rules] | None:
    """The (mesh, rules) of the enclosing ``activation_sharding``, or None outside one."""
    return _CURRENT.get()
