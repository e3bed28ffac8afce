"""The resumable prompt order: seeded shuffled batches with a checkpointable position."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np


class PromptLoader:
    """Batches of a dataset in a seeded shuffled order, with an explicit checkpointable position.

    Epoch ``e`` visits the examples in ``permutation(seed, e)``; a batch never straddles two
    epochs (with ``drop_last`` the tail of an epoch that does not fill a batch is skipped, so every
    batch has exactly ``batch_size`` items and jitted shapes stay fixed). The position is
    ``state = {"epoch", "index", "seed"}`` where ``index`` is how many items of the current epoch's
    order have been consumed; ``load_state_dict(state)`` continues exactly where it left off.

    The items are returned as they are: the trainer loads :class:`~jrlhf.data.PromptRecord` s, so
    each batch carries every prompt's ``meta`` along with its ids. The position depends only on
    the number of items, never on what they are.
    """

    def __init__(
        self,
        data: Sequence[Any],
        batch_size: int,
        seed: int = 0,
        *,
        shuffle: bool = True,
        drop_last: bool = True,
    ):
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if drop_last and len(data) < batch_size:
            raise ValueError(
                f"the dataset has {len(data)} examples, fewer than one batch of {batch_size}"
            )
        if not len(data):
            raise ValueError("the dataset is empty")
        self.data = data
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.seed = int(seed)
        self.epoch = 0
        self.index = 0
        self._order_epoch = -1
        self._order = np.arange(0)

    def _epoch_order(self) -> np.ndarray:
        if self._order_epoch != self.epoch:
            n = len(self.data)
            if self.shuffle:
                # Seeding with (seed, epoch) makes each epoch's order a pure function of the state.
                self._order = np.random.default_rng([self.seed, self.epoch]).permutation(n)
            else:
                self._order = np.arange(n)
            self._order_epoch = self.epoch
        return self._order

    def _epoch_end(self) -> int:
        n = len(self.data)
        return n - n % self.batch_size if self.drop_last else n

    def next_indices(self) -> np.ndarray:
        """Dataset indices of the next batch; advances the position."""
        if self.index >= self._epoch_end():
            self.epoch += 1
            self.index = 0
        order = self._epoch_order()
        idx = order[self.index : min(self.index + self.batch_size, self._epoch_end())]
        self.index += len(idx)
        return idx.copy()

    def next_batch(self) -> list[Any]:
        """The next batch of dataset items; advances the position."""
        return [self.data[int(i)] for i in self.next_indices()]

    def __iter__(self) -> Iterator[list[Any]]:
        """Endless batches (epochs roll over)."""
        while True:
            yield self.next_batch()

    @property
    def steps_per_epoch(self) -> int:
        """Batches per epoch (the last one short unless ``drop_last``)."""
        return -(-self._epoch_end() // self.batch_size)

    def state_dict(self) -> dict[str, int]:
        """The position: ``{"epoch": int, "index": int, "seed": int}`` (JSON-serialisable)."""
        return {"epoch": int(self.epoch), "index": int(self.index), "seed": int(self.seed)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a position saved by :meth:`state_dict`."""
        missing = {"epoch", "index", "seed"} - set(state)
        if missing:
            raise ValueError(f"loader state lacks {sorted(missing)}: {state}")
        index = int(state["index"])
        if not 0 <= index <= len(self.data):
            raise ValueError(
                f"loader state index {index} is outside the dataset of {len(self.data)} examples"
            )
        self.epoch, self.index, self.seed = int(state["epoch"]), index, int(state["seed"])
        self._order_epoch = -1
