"""Schedules of an RL iteration: who generates, scores and trains which batch, and who waits for
whom. Each composes the same parts (the rollout, the scorer, the update through the trainer's
``learn``, the weight and sample channels):

* :class:`Synchronous`: generate, score, train on the same batch (with dynamic sampling's
  extra rounds);
* :class:`BoundedStaleness`: train on a batch generated up to ``Asynchrony.max_staleness``
  updates earlier while the next ones are generated (partial rollouts continue unfinished
  samples across updates).
"""

from jrlhf.ppo.schedules.bounded import BoundedStaleness
from jrlhf.ppo.schedules.synchronous import Synchronous

__all__ = ["BoundedStaleness", "Synchronous"]
