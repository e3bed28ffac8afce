"""Host-side page allocation for the paged KV cache.

The pool is split into one partition per data shard (the pool's page axis is sharded like the
sequence slots), and a slot only ever holds pages of its own shard, so decode attention never
reads across devices. Page ids in the table are local to the shard.

Admission reserves a sequence's worst case (prompt + max new tokens) against its shard's free
pages, but pages are only taken from the free list as the sequence grows, and all of them (and the
unused reservation) return when it finishes. So an admitted sequence can always grow (no
preemption, no crash), and a full pool simply admits fewer sequences (back-pressure). Free lists
are min-heaps: allocation is deterministic.

Samples of one prompt can share its full prompt pages (``admit(..., share_from=owner)``): their
table rows start with the owner's page ids, each page counts its holders, and it returns to the
free list when the last one releases it. Only full pages are shared; the page holding the end of
the prompt is written by every sample's decode steps, so each sample has its own copy of it.
"""

from __future__ import annotations

import heapq
import math

import numpy as np


def pages_for(tokens: int, page_size: int) -> int:
    """Pages needed to hold ``tokens`` cached tokens."""
    return math.ceil(max(tokens, 0) / page_size)


class PageAllocator:
    """Free lists, reservations and the page table of every slot (see module docstring)."""

    def __init__(
        self,
        num_shards: int,
        pages_per_shard: int,
        slots_per_shard: int,
        page_size: int,
        max_pages_per_seq: int,
    ):
        self.num_shards = num_shards
        self.pages_per_shard = pages_per_shard
        self.slots_per_shard = slots_per_shard
        self.page_size = page_size
        self.max_pages_per_seq = max_pages_per_seq
        num_slots = num_shards * slots_per_shard
        # Unused entries hold an out-of-range id: writes through them are dropped on device.
        self.table = np.full((num_slots, max_pages_per_seq), pages_per_shard, np.int32)
        self._free = [list(range(pages_per_shard)) for _ in range(num_shards)]
        self._reserved = [0] * num_shards  # pages promised to admitted sequences, not yet taken
        self._owned: dict[int, list[int]] = {}
        self._budget: dict[int, int] = {}  # slot -> pages it may still take
        self._holders = np.zeros((num_shards, pages_per_shard), np.int32)  # slots per page
        self.used = 0
        self.peak_used = 0
        self.taken = 0  # pages ever taken from the free lists
        self.dirty = True

    def shard_of(self, slot: int) -> int:
        return slot // self.slots_per_shard

    def available(self, shard: int) -> int:
        """Pages of ``shard`` neither taken nor promised."""
        return len(self._free[shard]) - self._reserved[shard]

    def can_admit(self, slot: int, max_tokens: int, shared: int = 0) -> bool:
        """Whether ``slot`` can reserve a sequence of ``max_tokens`` cached tokens whose first
        ``shared`` pages come from another slot."""
        return pages_for(max_tokens, self.page_size) - shared <= self.available(self.shard_of(slot))

    def admit(
        self, slot: int, max_tokens: int, share_from: int | None = None, shared: int = 0
    ) -> None:
        """Reserve pages for a sequence that will cache at most ``max_tokens`` tokens; with
        ``share_from``, its first ``shared`` pages are that slot's (already taken) pages."""
        if slot in self._owned:
            raise RuntimeError(f"slot {slot} is already in use")
        shard = self.shard_of(slot)
        need = pages_for(max_tokens, self.page_size)
        if share_from is None:
            shared = 0
        else:
            source = self._owned.get(share_from)
            if source is None or self.shard_of(share_from) != shard or len(source) < shared:
                raise RuntimeError(
                    f"slot {slot} cannot share {shared} pages of slot {share_from} (not in use, "
                    "another shard, or fewer pages)"
                )
        if need > self.max_pages_per_seq or need - shared > self.available(shard):
            raise RuntimeError(f"slot {slot}: cannot reserve {need - shared} pages")
        self._reserved[shard] += need - shared
        self._owned[slot] = []
        self._budget[slot] = need - shared
        if shared:
            pages = self._owned[share_from][:shared]
            self._owned[slot] = list(pages)
            self.table[slot, :shared] = pages
            self._holders[shard, pages] += 1
            self.dirty = True

    def grow(self, slot: int, tokens: int) -> None:
        """Make sure ``slot`` has pages for ``tokens`` cached tokens (within its reservation)."""
        owned = self._owned[slot]
        shard = self.shard_of(slot)
        want = min(pages_for(tokens, self.page_size), len(owned) + self._budget[slot])
        while len(owned) < want:
            page = heapq.heappop(self._free[shard])
            self._holders[shard, page] = 1
            self._reserved[shard] -= 1
            self._budget[slot] -= 1
            self.table[slot, len(owned)] = page
            owned.append(page)
            self.used += 1
            self.taken += 1
            self.dirty = True
        self.peak_used = max(self.peak_used, self.used)

    def release(self, slot: int) -> None:
        """Drop a finished sequence's pages (a shared page returns once its last holder is done)
        and its unused reservation."""
        shard = self.shard_of(slot)
        for page in self._owned.pop(slot):
            self._holders[shard, page] -= 1
            if not self._holders[shard, page]:
                heapq.heappush(self._free[shard], page)
                self.used -= 1
        self._reserved[shard] -= self._budget.pop(slot)
        self.table[slot] = self.pages_per_shard
        self.dirty = True

    def global_rows(self, slot: int) -> np.ndarray:
        """The slot's page-table row as ids into the whole pool; unused entries out of range."""
        row = self.table[slot].astype(np.int64)
        total = self.num_shards * self.pages_per_shard
        return np.where(
            row < self.pages_per_shard, row + self.shard_of(slot) * self.pages_per_shard, total
        ).astype(np.int32)
