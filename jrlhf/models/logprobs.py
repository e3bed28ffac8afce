"""Log-probabilities and entropies of a language model's next-token distributions.

The decode engine (rollout log-probs) and the trainer (current-policy log-probs) both read them
from here, so the two engines cannot compute them differently.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import Array


def _f32(x: Array) -> Array:
    """At least float32 (float64 stays float64 when x64 is enabled)."""
    x = jnp.asarray(x)
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def token_logprobs(logits_btv: Array, targets_bt: Array) -> Array:
    """``log softmax(logits)[target]`` per token, in float32.

    ``logits_btv[:, t]`` must already be the prediction for ``targets_bt[:, t]``. Computed as the
    gathered logit minus the logsumexp, which avoids materialising a second ``(b, t, v)`` array.
    Out-of-range targets (e.g. an ignore index) are clamped into range; mask them out.
    """
    logits_btv = _f32(logits_btv)
    v = logits_btv.shape[-1]
    targets_bt = jnp.clip(jnp.asarray(targets_bt), 0, v - 1)
    target_logit_bt = jnp.take_along_axis(logits_btv, targets_bt[..., None], axis=-1)[..., 0]
    return target_logit_bt - jax.nn.logsumexp(logits_btv, axis=-1)


def entropy_from_logits(logits_btv: Array) -> Array:
    """Entropy of the categorical distribution at each position, in float32: ``(b, t)``."""
    logits_btv = _f32(logits_btv)
    logp_btv = jax.nn.log_softmax(logits_btv, axis=-1)
    return -jnp.sum(jnp.exp(logp_btv) * logp_btv, axis=-1)


def chunked_logprobs(
    logits_fn: Callable[[Array], Array],
    hidden_bte: Array,
    targets_bt: Array,
    chunk: int,
    with_entropy: bool = False,
):
    """:func:`token_logprobs` (and :func:`entropy_from_logits`) of ``logits_fn(hidden_bte)``
    computed ``chunk`` positions at a time, so at most (chunk, vocab) logits exist at once, in
    the forward pass and in the backward pass alike (each chunk's logits are recomputed there
    instead of stored: one more head matmul). Each position's values are those of the unchunked
    functions; a trailing partial chunk is padded and cut off.
    """
    b, t, e = hidden_bte.shape
    n = b * t
    pad = -n % chunk
    h = jnp.pad(hidden_bte.reshape(n, e), ((0, pad), (0, 0))).reshape(-1, chunk, e)
    y = jnp.pad(jnp.asarray(targets_bt).reshape(n), (0, pad)).reshape(-1, chunk)

    @jax.checkpoint
    def one(args):
        h_ce, y_c = args
        logits = logits_fn(h_ce)
        logp = token_logprobs(logits, y_c)
        return (logp, entropy_from_logits(logits)) if with_entropy else (logp,)

    out = jax.lax.map(one, (h, y))
    out = tuple(o.reshape(-1)[:n].reshape(b, t) for o in out)
    return out if with_entropy else out[0]
