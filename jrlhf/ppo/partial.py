"""Partial rollouts: a batch generated a few tokens at a time across weight updates.

With ``Asynchrony.partial_rollout_tokens = T`` (and ``max_staleness = k >= 1``), batch ``j`` is
created at iteration ``max(j - k, 0)`` (as the bounded-staleness schedule wants it,
jrlhf.ppo.staleness) but not generated in one go: every iteration runs one *pass* that gives each
unfinished sample of every batch in flight at most T more tokens, under the weights of that
iteration. A sample whose tokens span several passes keeps its earlier tokens, behaviour
log-probs and per-token versions, and continues under the newer weights; a batch is trained when
all its samples have ended (T x k >= max_response_len guarantees it for every batch past the
first k, which may need extra passes at the iteration that trains them).

The KV cache of a continued sample is *recomputed*: its prompt and tokens so far are prefilled
again under the current weights, so each pass's decode attends over keys and values of one
policy. Keeping the older policy's KV pages instead would save that prefill but mix two policies
inside one forward (the behaviour log-probs would then belong to neither); the price of
recomputing is reported per iteration (``partial/recomputed_tokens``).

Samples are decoded one row per context (each with its own seed, drawn from the run seed, the
batch, the sample and how far it has got), so the engine's shared prompt prefixes do not apply
to partial passes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from jrlhf.decode import GenerationResult, SamplingParams
from jrlhf.ppo.staleness import GeneratedBatch

Generate = Callable[[Sequence[Sequence[int]], SamplingParams], GenerationResult]


def start_batch(
    index: int,
    prompts: list[list[int]],
    meta: Sequence[Mapping[str, Any]] | None,
    samples: int,
    round: int = 0,
) -> GeneratedBatch:
    """Round ``round`` of batch ``index`` before its first pass: ``samples`` empty samples per
    prompt."""
    rows = len(prompts) * samples
    return GeneratedBatch(
        index=index,
        prompts=[list(p) for p in prompts],
        meta=None if meta is None else list(meta),
        prompt_index=np.repeat(np.arange(len(prompts)), samples),
        completions=[[] for _ in range(rows)],
        raw_logprobs=[np.zeros((0,), np.float32) for _ in range(rows)],
        token_versions=[np.zeros((0,), np.int64) for _ in range(rows)],
        finished=[False] * rows,
        passes=[0] * rows,
        round=round,
    )


def row_seed(run_seed: int, batch: int, row: int, done: int, round: int = 0) -> int:
    """The sampling seed of one pass of one sample: a pure function of where it is, so a
    resumed run continues it identically."""
    where = [run_seed, batch, row, done, 0x5EED] + ([round] if round else [])
    return int(np.random.default_rng(where).integers(2**31))


def run_pass(
    batches: Sequence[GeneratedBatch],
    generate: Generate,
    sampling: SamplingParams,
    *,
    version: int,
    tokens: int,
    max_len: int,
    run_seed: int,
) -> dict[str, int]:
    """One pass: every unfinished sample of ``batches`` gets up to ``tokens`` more tokens from
    ``generate`` (the current weights, policy ``version``), in one engine call; samples that
    emit a stop id, stop short, or reach ``max_len`` tokens are finished. Updates the batches
    in place; returns the pass's counts (rows decoded, context tokens prefilled again)."""
    todo = [(b, r) for b in batches for r in range(len(b.completions)) if not b.finished[r]]
    if not todo:
        return {"rows": 0, "recomputed_tokens": 0}
    contexts = [b.sample_prompts[r] + b.completions[r] for b, r in todo]
    seeds = tuple(row_seed(run_seed, b.index, r, len(b.completions[r]), b.round) for b, r in todo)
    sp = dataclasses.replace(sampling, num_samples=1, seeds=seeds, max_new_tokens=tokens)
    result = generate(contexts, sp)
    stops = set(sp.stop_ids or ())
    by_context = {int(i): q for q, i in enumerate(result.prompt_index)}
    for i, (b, r) in enumerate(todo):
        q = by_context[i]
        new = [int(t) for t in result.completion_ids[q]]
        b.completions[r] = b.completions[r] + new
        b.raw_logprobs[r] = np.concatenate(
            [b.raw_logprobs[r], np.asarray(result.raw_logprobs[q], np.float32)]
        )
        b.token_versions[r] = np.concatenate(
            [b.token_versions[r], np.full(len(new), version, np.int64)]
        )
        b.passes[r] += 1
        ended = len(new) < tokens or (new and new[-1] in stops)
        b.finished[r] = bool(ended or len(b.completions[r]) >= max_len)
    recomputed = sum(len(c) - len(b.sample_prompts[r]) for c, (b, r) in zip(contexts, todo))
    return {"rows": len(todo), "recomputed_tokens": int(recomputed)}


def continuation_metrics(rounds: Sequence[GeneratedBatch]) -> dict[str, float]:
    """``partial/continued_frac``: the trained batch's samples (of all its ``rounds``) that
    spanned more than one pass (continued across an update); ``partial/passes_max``: the most
    passes one sample took."""
    passes = np.asarray([n for b in rounds for n in (b.passes or [1] * len(b.completions))])
    return {
        "partial/continued_frac": float(np.mean(passes > 1)) if len(passes) else 0.0,
        "partial/passes_max": float(passes.max(initial=0)),
    }
