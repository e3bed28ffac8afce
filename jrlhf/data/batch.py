"""The one prompt+response batch layout, shared by SFT, reward-model training, scoring and PPO/GRPO.

With P = max prompt length and R = max response length, every row has P + R columns::

    [left pad][prompt][response][right pad]
    |<-------- P ------->|<------- R ------->|

the prompt ends at column P-1 and the response starts at column P, which is exactly what
generation after left-padded prompts produces. Pads have segment id 0 and position 0; real tokens
have segment id 1 and positions counting from 0 at the first prompt token through the response.

Per-token quantities (log-probs, values, advantages, SFT losses) are *response-aligned*: arrays of
shape (B, R) whose column j belongs to response token j and is computed from the hidden state at
column P-1+j, the state in which that token was chosen (jrlhf.ppo.batch reads the model there).
A sequence score (a reward model's) is read at ``last_index``, each row's final real token.

This module is NumPy only, so the data side of every stage uses it without importing a model.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def pack(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    max_prompt_len: int,
    max_response_len: int,
    pad_id: int = 0,
) -> dict[str, np.ndarray]:
    """Pack prompt/response pairs into the layout above (host side).

    Returns ``tokens``, ``positions``, ``segment_ids`` (B, P+R) int32; ``response_tokens`` (B, R)
    int32 (``tokens[:, P:]``); ``mask`` (B, R) float32, 1 on response tokens; and
    ``last_index`` (B,) int32, the column of each row's final real token (P-1 for an empty
    response). A prompt or response longer than its maximum, or an empty prompt, is an error
    (truncate when loading, see jrlhf.data.datasets).
    """
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    P, R = max_prompt_len, max_response_len
    for name, seqs, limit in (("prompt", prompts, P), ("response", responses, R)):
        for i, seq in enumerate(seqs):
            if len(seq) > limit:
                raise ValueError(
                    f"{name} {i} has {len(seq)} tokens, more than max_{name}_len {limit}"
                )
    for i, p in enumerate(prompts):
        if not len(p):
            raise ValueError(f"prompt {i} is empty")
    b = len(prompts)
    tokens = np.full((b, P + R), pad_id, np.int32)
    positions = np.zeros((b, P + R), np.int32)
    segments = np.zeros((b, P + R), np.int32)
    mask = np.zeros((b, R), np.float32)
    last = np.zeros((b,), np.int32)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        start, end = P - len(p), P + len(r)
        tokens[i, start:P] = p
        tokens[i, P:end] = r
        positions[i, start:end] = np.arange(end - start)
        segments[i, start:end] = 1
        mask[i, : len(r)] = 1.0
        last[i] = end - 1
    return {
        "tokens": tokens,
        "positions": positions,
        "segment_ids": segments,
        "response_tokens": tokens[:, P:].copy(),
        "mask": mask,
        "last_index": last,
    }


def pack_segments(
    batch: dict[str, np.ndarray],
    max_prompt_len: int,
    row_len: int,
    groups: int = 1,
    row_multiple: int = 1,
) -> dict[str, np.ndarray]:
    """Repack the real tokens of the padded layout above into rows of ``row_len`` columns, several
    samples per row (host side), for training without computing on padding.

    Each sample's prompt+response tokens stay contiguous; a row holds samples one after another
    with segment ids 1, 2, ... and positions restarting at 0 for each (the attention mask is by
    segment and position, jrlhf.models.attention, so a sample sees exactly what it saw padded);
    unused columns are padding (segment 0). Samples are placed first-fit in decreasing length.

    Returns a copy of ``batch`` whose ``tokens``, ``positions`` and ``segment_ids`` are the
    packed rows, plus ``pack_index`` (B, R) int32: for response token j of sample b, the flat
    index (row * row_len + column) of the packed position whose hidden state predicts it (P-1+j
    in the padded layout); 0 where ``mask`` is 0. Response-aligned fields are unchanged.

    ``groups`` > 1 packs each run of B/groups consecutive samples into its own block of rows, and
    ``pack_index`` counts within the block, so splitting every field's leading axis into
    ``groups`` micro-batches keeps each sample with its rows. The rows per block are the most any
    block needs, rounded up to a multiple of ``row_multiple`` and of ceil(samples per block / 8),
    so a run sees at most 8 shapes (one compilation each).
    """
    tokens, segments, mask = batch["tokens"], batch["segment_ids"], batch["mask"]
    b = tokens.shape[0]
    P = max_prompt_len
    if b % groups:
        raise ValueError(f"{b} samples do not split into {groups} groups")
    real = segments > 0
    starts = np.argmax(real, axis=1)
    lengths = real.sum(axis=1)
    if int(lengths.max(initial=0)) > row_len:
        raise ValueError(f"a sample has {int(lengths.max())} tokens, more than row_len {row_len}")
    per = b // groups
    placements = []  # per group: list of (sample, row, column)
    rows_needed = 1
    for g in range(groups):
        free: list[int] = []  # columns left in each open row
        placed = []
        for i in sorted(range(g * per, (g + 1) * per), key=lambda i: (-lengths[i], i)):
            n = int(lengths[i])
            row = next((r for r, left in enumerate(free) if left >= n), len(free))
            if row == len(free):
                free.append(row_len)
            placed.append((i, row, row_len - free[row]))
            free[row] -= n
        placements.append(placed)
        rows_needed = max(rows_needed, len(free))
    step = int(np.lcm(max(row_multiple, 1), -(-per // 8)))
    rows = -(-rows_needed // step) * step
    out = dict(batch)
    out["tokens"] = np.zeros((groups * rows, row_len), tokens.dtype)
    out["positions"] = np.zeros((groups * rows, row_len), batch["positions"].dtype)
    out["segment_ids"] = np.zeros((groups * rows, row_len), segments.dtype)
    pack_index = np.zeros(mask.shape, np.int32)
    seg_count = np.zeros((groups * rows,), np.int32)
    for g, placed in enumerate(placements):
        for i, row, col in placed:
            n, s = int(lengths[i]), int(starts[i])
            r = g * rows + row
            seg_count[r] += 1
            out["tokens"][r, col : col + n] = tokens[i, s : s + n]
            out["positions"][r, col : col + n] = batch["positions"][i, s : s + n]
            out["segment_ids"][r, col : col + n] = seg_count[r]
            # Response token j is predicted at padded column P-1+j, i.e. at offset P-1+j-s.
            j = np.nonzero(mask[i] > 0)[0]
            pack_index[i, j] = row * row_len + col + (P - 1 + j - s)
    out["pack_index"] = pack_index
    return out


def microbatch_splits(rows: int, shards: int, unit: int = 1) -> list[int]:
    """Micro-batch counts ``m``, ascending, that split ``rows`` rows into equal micro-batches
    whose rows divide over ``shards`` devices and into whole units of ``unit`` rows (the two
    rows of a preference pair)."""
    return [
        m
        for m in range(1, rows + 1)
        if rows % m == 0 and (rows // m) % shards == 0 and (rows // m) % unit == 0
    ]


def fit_microbatches(
    batch: dict[str, np.ndarray],
    budget: int,
    shards: int,
    max_prompt_len: int,
    pack: bool = False,
    unit: int = 1,
) -> tuple[int, dict[str, np.ndarray]]:
    """(m, batch): the fewest micro-batches ``m`` (of :func:`microbatch_splits`) in which no
    device holds more than ``budget`` token columns (rows x row length) per micro-batch; with
    ``pack``, the batch packed into ``m`` blocks (:func:`pack_segments`), counted by its packed
    rows, so a batch of short samples takes fewer micro-batches than a full-length one (verl's
    dynamic batch size). The finest split when none fits; ``(1, batch)`` when the rows do not
    split over ``shards`` at all (the train step then refuses the batch in one line)."""
    rows, row_len = batch["tokens"].shape
    splits = microbatch_splits(rows, shards, unit)
    out = batch
    for m in splits or [1]:
        out = pack_segments(batch, max_prompt_len, row_len, m, shards) if pack else batch
        if out["tokens"].shape[0] // (m * shards) * row_len <= budget:
            return m, out
    return (splits or [1])[-1], out
