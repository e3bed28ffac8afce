"""Nothing non-finite is saved, and a run whose updates stop being finite stops.

The train step (jrlhf.runtime.steps) skips an update whose loss or gradient norm is not finite,
and reports ``skipped`` in its metrics for it and for an update whose resulting parameters are
not finite (an overflow: applied, so every later update is reported skipped too);
:class:`UpdateGuard` counts skipped updates in a row per role and stops the run, in one line
naming the role and the step, when there are more than ``RunConfig.max_nonfinite_updates``.
:func:`check_finite` is the last line of defence before a save.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jrlhf.meshes.batch import to_host


class TrainingStopped(RuntimeError):
    """The run stopped itself (e.g. diverged); the message is one line naming why."""


class UpdateGuard:
    """Counts each role's skipped (non-finite) updates in a row across calls to :meth:`record`."""

    def __init__(self, limit: int, stage: str):
        self.limit, self.stage = limit, stage
        self.in_a_row: dict[str, int] = {}
        self.total: dict[str, int] = {}

    def record(self, role: str, skipped: Iterable[float], where: str) -> int:
        """Account for ``role``'s updates (1 for each skipped, 0 for each applied, in order);
        returns how many were skipped. Raises :class:`TrainingStopped` once more than ``limit``
        in a row were skipped; ``where`` names the position (e.g. ``"iteration 3"``)."""
        count = 0
        for s in np.asarray(list(skipped), dtype=np.float64).ravel():
            if s > 0:
                count += 1
                self.in_a_row[role] = self.in_a_row.get(role, 0) + 1
            else:
                self.in_a_row[role] = 0
            if self.in_a_row.get(role, 0) > self.limit:
                raise TrainingStopped(
                    f"{self.stage}: {role} diverged: {self.in_a_row[role]} updates in a row had a "
                    f"non-finite loss, gradient norm or result (last at {where}); stopped before "
                    f"saving anything non-finite (limit RunConfig.max_nonfinite_updates="
                    f"{self.limit})"
                )
        self.total[role] = self.total.get(role, 0) + count
        return count


def tree_is_finite(tree: Any) -> jax.Array:
    """Whether every floating-point leaf of ``tree`` is finite: a scalar (traceable)."""
    leaves = [
        jnp.all(jnp.isfinite(x))
        for x in jax.tree.leaves(tree)
        if jnp.issubdtype(x.dtype, jnp.inexact)
    ]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)


_all_finite = jax.jit(tree_is_finite)


def check_finite(tree: Any, what: str) -> None:
    """Raise :class:`TrainingStopped` naming ``what`` when ``tree`` holds a non-finite value."""
    if not bool(to_host(_all_finite(tree))):
        raise TrainingStopped(f"{what}: non-finite values; refusing to save them")
