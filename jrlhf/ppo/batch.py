"""Reading the model on the prompt+response batch layout (defined once, in jrlhf.data.batch).

Rows are ``[left pad][prompt][response][right pad]`` with the prompt ending at column P-1 and the
response starting at column P; response-aligned arrays (B, R) take column j from the hidden state
at column P-1+j. ``pack`` is re-exported here because every RL caller packs and then reads.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jrlhf.data.batch import pack, pack_segments
from jrlhf.models.logprobs import chunked_logprobs, entropy_from_logits, token_logprobs
from jrlhf.models.moe import EXPERTS
from jrlhf.models.transformer import Transformer
from jrlhf.shared_programs import shared_program

__all__ = [
    "logprobs_fn",
    "pack",
    "pack_segments",
    "response_hidden",
    "response_logprobs",
    "response_values",
    "sequence_scores",
    "values_fn",
]


def response_hidden(
    module: Transformer, batch: dict, max_prompt_len: int, with_stats: bool = False
):
    """Hidden states (B, R, E) at the columns that predict each response token; with
    ``with_stats`` also a routed model's per-layer routing stats over the whole rows
    (``Transformer.hidden``: (L, B, T, ...), the rows' own layout even when packed).

    A packed batch (``pack_index``, jrlhf.data.batch.pack_segments: several samples per row, no
    padding between them) is read at the packed positions, gathered back into the (B, R)
    response-aligned order, so everything downstream is the same as for the padded layout.
    """
    packed = "pack_index" in batch
    hidden, stats = module.hidden(
        batch["tokens"],
        batch["positions"],
        batch["segment_ids"],
        one_segment=not packed,
        with_stats=True,
    )
    if packed:
        flat = hidden.reshape(-1, hidden.shape[-1])
        hidden = jnp.take(flat, batch["pack_index"], axis=0)
    else:
        hidden = hidden[:, max_prompt_len - 1 : -1]
    return (hidden, stats) if with_stats else hidden


def response_logprobs(
    module: Transformer,
    batch: dict,
    max_prompt_len: int,
    with_entropy: bool = False,
    chunk: int = 0,
    with_stats: bool = False,
):
    """float32 log-probs (B, R) of the response tokens (and their entropies if asked; and,
    ``with_stats``, a routed model's routing stats as in :func:`response_hidden`).

    ``chunk`` > 0 computes them ``chunk`` positions at a time (jrlhf.models.logprobs.
    chunked_logprobs): never more than (chunk, vocab) logits at once, forward or backward.
    """
    hidden, stats = response_hidden(module, batch, max_prompt_len, with_stats=True)
    out = hidden_logprobs(module, hidden, batch["response_tokens"], with_entropy, chunk)
    return (out, stats) if with_stats else out


def hidden_logprobs(
    module: Transformer, hidden: jax.Array, targets: jax.Array, with_entropy=False, chunk=0
):
    """:func:`response_logprobs` from the response hidden states (:func:`response_hidden`)."""
    if chunk:
        return chunked_logprobs(module.logits, hidden, targets, chunk, with_entropy)
    logits = module.logits(hidden)
    logp = token_logprobs(logits, targets)
    if with_entropy:
        return logp, entropy_from_logits(logits)
    return logp


def response_values(
    module: Transformer, batch: dict, max_prompt_len: int, with_stats: bool = False
):
    """Critic values (B, R) of the states in which each response token was chosen (and,
    ``with_stats``, a routed model's routing stats as in :func:`response_hidden`)."""
    hidden, stats = response_hidden(module, batch, max_prompt_len, with_stats=True)
    values = module.values(hidden)
    return (values, stats) if with_stats else values


def sequence_scores(module: Transformer, batch: dict, with_stats: bool = False):
    """Reward-model scores (B,): the value head at each row's final real token (and,
    ``with_stats``, a routed model's routing stats over the rows)."""
    hidden, stats = module.hidden(
        batch["tokens"],
        batch["positions"],
        batch["segment_ids"],
        "pack_index" not in batch,
        with_stats=True,
    )
    last = jnp.take_along_axis(hidden, batch["last_index"][:, None, None], axis=1)[:, 0]
    scores = module.values(last)
    return (scores, stats) if with_stats else scores


def response_routes(module: Transformer, batch: dict, max_prompt_len: int) -> jax.Array:
    """A routed model's response log-probs and chosen experts in one float32 array
    (B, R, 1 + layers * top_k): ``[..., 0]`` the log-probs, ``[..., 1:]`` the experts chosen at
    the columns that predict each response token (exact as float32), layer-major; padded
    (unpacked) rows only. One array so that chunked inference calls join it like any other."""
    hidden, stats = response_hidden(module, batch, max_prompt_len, with_stats=True)
    logp = hidden_logprobs(module, hidden, batch["response_tokens"])
    experts = stats[EXPERTS][:, :, max_prompt_len - 1 : -1]  # (L, B, R, k)
    b, r = logp.shape
    experts = jnp.transpose(experts, (1, 2, 0, 3)).reshape(b, r, -1).astype(jnp.float32)
    return jnp.concatenate([logp[..., None], experts], axis=-1)


@shared_program()
def routes_fn(max_prompt_len: int):
    """``(module, batch) -> response_routes(module, batch, max_prompt_len)``, one object per
    prompt length (see :func:`logprobs_fn`)."""
    return lambda module, batch: response_routes(module, batch, max_prompt_len)


@shared_program()
def logprobs_fn(max_prompt_len: int):
    """``(module, batch) -> response_logprobs(module, batch, max_prompt_len)``: one function
    object per prompt length, so the inference calls built on it share their programs
    (jrlhf.shared_programs)."""
    return lambda module, batch: response_logprobs(module, batch, max_prompt_len)


@shared_program()
def values_fn(max_prompt_len: int):
    """``(module, batch) -> response_values(module, batch, max_prompt_len)``, one object per
    prompt length (see :func:`logprobs_fn`)."""
    return lambda module, batch: response_values(module, batch, max_prompt_len)
