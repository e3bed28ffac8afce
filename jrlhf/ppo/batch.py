"""The prompt+response batch layout shared by SFT, reward-model training, scoring and PPO/GRPO.

Every row is ``[left pad][prompt][response][right pad]`` with the prompt ending at column P-1
(P = max prompt length) and the response starting at column P, for a total of P + R columns.
Pads have segment id 0 and position 0; real tokens have segment id 1 and positions counting from
0 at the first prompt token. Per-token RL quantities (log-probs, values, advantages) are
*response-aligned*: arrays of shape (B, R) whose column j belongs to response token j, computed
from the hidden state at column P-1+j (the state in which that token was chosen).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jrlhf.data import make_sequence_batch
from jrlhf.models.transformer import Transformer
from jrlhf.ppo.core_algos import entropy_from_logits, token_logprobs


def pack(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    max_prompt_len: int,
    max_response_len: int,
    pad_id: int = 0,
) -> dict[str, np.ndarray]:
    """Pack prompt/response pairs into the layout above (NumPy, host side).

    Returns tokens/positions/segment_ids (B, P+R) int32, ``response_tokens`` and ``mask`` (B, R)
    and ``last_index`` (B,), the column of each row's final real token.
    """
    rows = make_sequence_batch(
        prompts, responses, max_prompt_len, max_response_len, pad_id, layout="aligned"
    )
    P = max_prompt_len
    return {
        "tokens": rows.tokens_bt,
        "positions": rows.positions_bt,
        "segment_ids": rows.segment_ids_bt,
        "response_tokens": rows.tokens_bt[:, P:].copy(),
        "mask": rows.response_mask_bt[:, P:].astype(np.float32),
        "last_index": rows.last_index_b.astype(np.int32),
    }


def response_hidden(module: Transformer, batch: dict, max_prompt_len: int) -> jax.Array:
    """Hidden states (B, R, E) at the columns that predict each response token."""
    hidden = module.hidden(batch["tokens"], batch["positions"], batch["segment_ids"])
    return hidden[:, max_prompt_len - 1 : -1]


def response_logprobs(
    module: Transformer, batch: dict, max_prompt_len: int, with_entropy: bool = False
):
    """float32 log-probs (B, R) of the response tokens (and their entropies if asked)."""
    logits = module.logits(response_hidden(module, batch, max_prompt_len))
    logp = token_logprobs(logits, batch["response_tokens"])
    if with_entropy:
        return logp, entropy_from_logits(logits)
    return logp


def response_values(module: Transformer, batch: dict, max_prompt_len: int) -> jax.Array:
    """Critic values (B, R) of the states in which each response token was chosen."""
    return module.values(response_hidden(module, batch, max_prompt_len))


def sequence_scores(module: Transformer, batch: dict) -> jax.Array:
    """Reward-model scores (B,): the value head at each row's final real token."""
    hidden = module.hidden(batch["tokens"], batch["positions"], batch["segment_ids"])
    last = jnp.take_along_axis(hidden, batch["last_index"][:, None, None], axis=1)[:, 0]
    return module.values(last)
