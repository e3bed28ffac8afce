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
