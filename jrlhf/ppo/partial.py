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

Multi-turn episodes (jrlhf.envs) span passes too (``EpisodesInFlight``): a pass's budget counts
the environment's tokens as the episode's does, each environment lives from its episode's first
pass to its last, and the policy masks grow with the tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from jrlhf.decode import GenerationResult, SamplingParams
from jrlhf.decode.turns import CONTINUING, TurnEnd, Turns, current_turn_tokens
from jrlhf.envs import EnvSetup, EpisodeRunner
from jrlhf.ppo.staleness import GeneratedBatch

# The engine's generate for one pass: contexts, sampling, and the pass's turn handler (None:
# single-turn).
Generate = Callable[[Sequence[Sequence[int]], SamplingParams, Turns | None], GenerationResult]


def start_batch(
    index: int,
    prompts: list[list[int]],
    meta: Sequence[Mapping[str, Any]] | None,
    samples: int,
    round: int = 0,
    episodes: bool = False,
) -> GeneratedBatch:
    """Round ``round`` of batch ``index`` before its first pass: ``samples`` empty samples per
    prompt (``episodes``: multi-turn ones, with policy masks)."""
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
        policy_masks=[np.zeros((0,), bool) for _ in range(rows)] if episodes else None,
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
    episodes: EpisodesInFlight | None = None,
) -> dict[str, int]:
    """One pass: every unfinished sample of ``batches`` gets up to ``tokens`` more tokens from
    ``generate`` (the current weights, policy ``version``), in one engine call; samples that
    emit a stop id, stop short, or reach ``max_len`` tokens are finished. With ``episodes``
    they are multi-turn episodes (see ``EpisodesInFlight``): one whose environment ends it is
    finished, and an observation due at the pass's end is appended. Updates the batches in
    place; returns the pass's counts (rows decoded, context tokens prefilled again)."""
    todo = [(b, r) for b in batches for r in range(len(b.completions)) if not b.finished[r]]
    if not todo:
        return {"rows": 0, "recomputed_tokens": 0}
    contexts = [b.sample_prompts[r] + b.completions[r] for b, r in todo]
    seeds = tuple(row_seed(run_seed, b.index, r, len(b.completions[r]), b.round) for b, r in todo)
    # Each sample's budget this pass: T, or what is left of max_len (an episode's observations
    # leave its length off the grid of T).
    budgets = tuple(min(tokens, max_len - len(b.completions[r])) for b, r in todo)
    sp = dataclasses.replace(
        sampling, num_samples=1, seeds=seeds, max_new_tokens=tokens, max_new_per_prompt=budgets
    )
    pending: dict[int, list[int]] = {}
    done: set[int] = set()
    turns = None if episodes is None else episodes.turns(todo, max_len, pending, done)
    result = generate(contexts, sp, turns)
    stops = set(sp.stop_ids or ())
    by_context = {int(i): q for q, i in enumerate(result.prompt_index)}
    for i, (b, r) in enumerate(todo):
        q = by_context[i]
        new = [int(t) for t in result.completion_ids[q]]
        lp = np.asarray(result.raw_logprobs[q], np.float32)
        mask = None if turns is None else np.asarray(result.policy_masks[q], bool)
        obs = pending.get(i, [])
        if obs:  # a turn ended with the pass: its observation, for the next pass to prefill
            ended_by_engine = False
            new_all = new + obs
            lp = np.concatenate([lp, np.zeros(len(obs), np.float32)])
            mask = np.concatenate([mask, np.zeros(len(obs), bool)])
        else:
            ended_by_engine = len(new) < budgets[i] or bool(new and new[-1] in stops)
            new_all = new
        b.completions[r] = b.completions[r] + new_all
        b.raw_logprobs[r] = np.concatenate([b.raw_logprobs[r], lp])
        b.token_versions[r] = np.concatenate(
            [b.token_versions[r], np.full(len(new_all), version, np.int64)]
        )
        if mask is not None:
            b.policy_masks[r] = np.concatenate([b.policy_masks[r], mask])
        b.passes[r] += 1
        ended = ended_by_engine or i in done
        b.finished[r] = bool(ended or len(b.completions[r]) >= max_len)
    if episodes is not None:
        for b in {(b.index, b.round): b for b, _ in todo}.values():
            episodes.record(b)
    recomputed = sum(len(c) - len(b.sample_prompts[r]) for c, (b, r) in zip(contexts, todo))
    return {"rows": len(todo), "recomputed_tokens": int(recomputed)}


class EpisodesInFlight:
    """Multi-turn episodes (jrlhf.envs) across partial passes: the environments of every round in
    flight live from its first pass to its last, one ``EpisodeRunner`` a round, so an episode
    spans passes (and weight versions) as its tokens do.

    A pass hands the engine each unfinished sample's prompt and tokens so far (its current
    turn's sampled count too, so a turn's budget spans passes), and its turn ends to
    ``turns``, which passes them on, with the whole episode so far, to the round's runner. The
    pass's token budget is not the episode's: a slot the pass cuts mid-turn goes on at the next
    pass without asking the environment; one cut on a turn's last token (a turn stop id, or
    the turn's budget spent) is a turn end, whose observation is appended after the pass, as is
    an observation longer than what is left of the pass. After a resume, ``restore`` rebuilds
    the environments by replaying each unfinished episode.
    """

    def __init__(self, env: EnvSetup):
        self.env = env
        self.runners: dict[tuple[int, int], EpisodeRunner] = {}

    def runner(self, g: GeneratedBatch) -> EpisodeRunner:
        """Round ``g``'s runner (made at its first pass)."""
        key = (g.index, g.round)
        if key not in self.runners:
            meta = g.meta if g.meta is not None else [{}] * len(g.prompts)
            self.runners[key] = self.env.runner(meta, len(g.completions))
        return self.runners[key]

    def drop(self, g: GeneratedBatch) -> None:
        """Forget round ``g``'s environments (it is being trained on)."""
        self.runners.pop((g.index, g.round), None)

    def record(self, g: GeneratedBatch) -> None:
        """Round ``g``'s episode records as of now (``GeneratedBatch.episodes``: saved with
        it, and what its scores read once it is complete)."""
        g.episodes = self.runner(g).episode_arrays(range(len(g.completions)))

    def restore(self, g: GeneratedBatch) -> None:
        """After a resume: round ``g``'s records, and its unfinished episodes' environments
        replayed from their tokens; an episode whose environment does not answer as recorded
        ends with that failure."""
        runner = self.runner(g)
        if g.episodes is not None:
            runner.restore(g.episodes, [r for r in range(len(g.completions)) if g.finished[r]])
        rows = [r for r in range(len(g.completions)) if not g.finished[r] and g.completions[r]]
        replays = [
            (r, int(g.prompt_index[r]), g.sample_prompts[r], g.completions[r], g.policy_masks[r])
            for r in rows
        ]
        for r in runner.replay(replays):
            g.finished[r] = True
        self.record(g)

    def turns(
        self,
        todo: Sequence[tuple[GeneratedBatch, int]],
        max_len: int,
        pending: dict[int, list[int]],
        done: set[int],
    ) -> Turns:
        """The engine's turn handler for one pass over ``todo`` ((round, row) by the pass's
        request index): fills ``pending`` (request -> the observation appended after the pass)
        and ``done`` (requests whose episode its environment ended)."""
        stop_ids, max_tokens = self.env.stop_ids, self.env.max_turn_tokens

        def handler(ends: Sequence[TurnEnd]) -> list[list[int] | None]:
            answers: list[list[int] | None] = [None] * len(ends)
            asked: dict[tuple[int, int], list[tuple[int, TurnEnd, bool]]] = {}
            for k, end in enumerate(ends):
                g, r = todo[end.index]
                tokens = g.completions[r] + list(end.tokens)
                policy = np.concatenate([g.policy_masks[r], np.asarray(end.policy, bool)])
                reason, cut = end.reason, False
                if reason == "length" and len(tokens) < max_len:  # the pass's budget
                    if tokens[-1] in stop_ids:
                        reason, cut = "stop", True
                    elif max_tokens and current_turn_tokens(policy) >= max_tokens:
                        reason, cut = "turn_budget", True
                    else:
                        continue  # mid-turn: the next pass goes on with it
                whole = TurnEnd(
                    r, int(g.prompt_index[r]), r, g.sample_prompts[r], tokens, policy, reason,
                    max_len - len(tokens),
                )  # fmt: skip
                asked.setdefault((g.index, g.round), []).append((k, whole, cut))
            for items in asked.values():
                g = todo[ends[items[0][0]].index][0]
                replies = self.runner(g)([whole for _, whole, _ in items])
                for (k, whole, cut), reply in zip(items, replies):
                    if whole.reason not in CONTINUING:
                        continue  # the episode ends anyway ("eos", "length")
                    i = ends[k].index
                    if reply is None or not len(reply):
                        done.add(i)
                        continue
                    obs = [int(t) for t in reply][: whole.room]
                    if cut or len(obs) > ends[k].room:
                        pending[i] = obs  # the engine ends this slot's pass
                    else:
                        answers[k] = obs
            return answers

        sampled = tuple(current_turn_tokens(g.policy_masks[r]) for g, r in todo)
        return Turns(handler, stop_ids, max_tokens, sampled=sampled)


def continuation_metrics(rounds: Sequence[GeneratedBatch]) -> dict[str, float]:
    """``partial/continued_frac``: the trained batch's samples (of all its ``rounds``) that
    spanned more than one pass (continued across an update); ``partial/passes_max``: the most
    passes one sample took."""
    passes = np.asarray([n for b in rounds for n in (b.passes or [1] * len(b.completions))])
    return {
        "partial/continued_frac": float(np.mean(passes > 1)) if len(passes) else 0.0,
        "partial/passes_max": float(passes.max(initial=0)),
    }
