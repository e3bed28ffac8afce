"""Multi-turn episodes across partial passes (jrlhf.ppo.partial.EpisodesInFlight): under the same
weights, episodes decoded a few tokens a pass (their turns and observations cut by the passes'
ends) equal the episodes of one multi-turn engine call, token for token, mask for mask, record
for record; a round saved mid-way and restored (its environments replayed from its tokens) goes
on to the same episodes; an environment that answers otherwise on replay ends its episode."""

from __future__ import annotations

import numpy as np

from jrlhf.decode import SamplingParams
from jrlhf.envs import EnvSetup, Step
from jrlhf.ppo import partial
from jrlhf.ppo.staleness import GeneratedBatch
from tests.decode.test_decode import _prompts
from tests.decode.test_multiturn import ENGINE, PROMPT_LENS, _engine

STOPS = (2,)  # the episode's end-of-sequence id
TURN_TOKENS = 3
PASS_TOKENS = 7  # cuts turns (3 tokens) inside and at their ends


class Counter:
    """A stateful environment: it counts its turns (the count is state a replay must rebuild)
    and answers 1-2 ids that depend on the count and its prompt, ending after 3 turns."""

    calls = 0  # every step of every instance (the unreplayable variant's state)

    def reset(self, meta):
        self.prompt, self.turn = meta["p"], 0

    def step(self, conversation):
        self.turn += 1
        Counter.calls += 1
        if self.turn > 3:
            return Step(done=True, reward=1.0)
        ids = [5 + self.turn, 40 + self.prompt][: 1 + (self.prompt + self.turn) % 2]
        return Step(observation=ids, reward=0.25, error=self.turn == 2)


class Forgetful(Counter):
    """Answers as ``Counter`` until it is rebuilt: its replies then shift (a clock, a network)."""

    shift = 0

    def step(self, conversation):
        step = super().step(conversation)
        if step.done or not Forgetful.shift:
            return step
        return Step(observation=[t + Forgetful.shift for t in step.observation])


class Watched(partial.EpisodesInFlight):
    """Keeps each pass's observations appended after the pass."""

    def __init__(self, env):
        super().__init__(env)
        self.appended = []

    def turns(self, todo, max_len, pending, done):
        self.appended.append(pending)
        return super().turns(todo, max_len, pending, done)


def _setup(factory=Counter) -> EnvSetup:
    return EnvSetup(
        name="counter", factory=factory, max_turn_tokens=TURN_TOKENS, timeout_s=0.0,
        max_observation_tokens=ENGINE.max_observation_tokens,
    )  # fmt: skip


def _passes(engine, params, prompts, meta, setup, until=None, batch=None, episodes=None):
    """Greedy partial passes of PASS_TOKENS over one round until it completes (or ``until``
    passes); the round, its episodes, and where each pass left each row."""
    sp = SamplingParams(greedy=True, stop_ids=STOPS)
    episodes = episodes or Watched(setup)
    batch = batch or partial.start_batch(0, prompts, meta, samples=1, episodes=True)

    def generate(contexts, s, turns):
        return engine.generate(params, contexts, s, turns=turns)

    n, ends = 0, []
    while not batch.complete and (until is None or n < until):
        partial.run_pass(
            [batch], generate, sp, version=n, tokens=PASS_TOKENS, max_len=ENGINE.max_new_tokens,
            run_seed=0, episodes=episodes,
        )  # fmt: skip
        ends.append([len(c) for c in batch.completions])
        n += 1
    return batch, episodes, ends


def _one_call(engine, params, prompts, meta, setup):
    runner = setup.runner(meta, len(prompts))
    sp = SamplingParams(greedy=True, stop_ids=STOPS)
    out = engine.generate(params, prompts, sp, turns=setup.turns(runner))
    out.episodes = runner.episode_arrays(range(len(prompts)))
    return out


def _assert_same_episodes(batch, out):
    assert batch.completions == out.completion_ids
    for got, want in zip(batch.policy_masks, out.policy_masks):
        np.testing.assert_array_equal(got, want)
    for got, want, mask in zip(batch.raw_logprobs, out.raw_logprobs, out.policy_masks):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)  # the KV recomputed per pass
        assert np.all(got[~mask] == 0)
    for key, want in out.episodes.items():
        np.testing.assert_array_equal(batch.episodes[key], want, err_msg=key)


def test_episodes_across_passes_equal_one_multi_turn_call():
    engine, params = _engine()
    prompts = _prompts(PROMPT_LENS)
    meta = [{"p": p} for p in range(len(prompts))]
    out = _one_call(engine, params, prompts, meta, _setup())
    batch, episodes, ends = _passes(engine, params, prompts, meta, _setup())
    assert max(batch.passes) >= 3 and out.stats["turns"] > 2 * len(prompts)
    # passes did end inside a turn (its budget spans them), and at a turn's end or with an
    # observation left over (appended after the pass): the cases this checks
    inside = sum(
        bool(mask[n - 1] and mask[n])
        for r, mask in enumerate(batch.policy_masks)
        for n in {e[r] for e in ends if 0 < e[r] < len(mask)}
    )
    appended = sum(len(p) for p in episodes.appended)
    assert inside and appended, (inside, appended)
    _assert_same_episodes(batch, out)
    assert batch.episodes["tool_errors"].sum() > 0 and batch.episodes["tool_calls"].sum() > 0


def test_a_round_saved_mid_way_resumes_to_the_same_episodes_and_unreplayable_ones_end():
    engine, params = _engine()
    prompts = _prompts(PROMPT_LENS)
    meta = [{"p": p} for p in range(len(prompts))]
    out = _one_call(engine, params, prompts, meta, _setup())
    half, _, _ = _passes(engine, params, prompts, meta, _setup(), until=2)
    saved = half.to_json()
    assert not GeneratedBatch.from_json(saved).complete
    # A new process: the round from its checkpoint, the environments replayed, then on.
    again = GeneratedBatch.from_json(saved)
    episodes = partial.EpisodesInFlight(_setup())
    episodes.restore(again)
    done, _, _ = _passes(engine, params, prompts, meta, None, batch=again, episodes=episodes)
    _assert_same_episodes(done, out)

    # An environment that answers otherwise once rebuilt: its episodes under way end, failed.
    Forgetful.shift = 0
    half, _, _ = _passes(engine, params, prompts, meta, _setup(Forgetful), until=2)
    again = GeneratedBatch.from_json(half.to_json())
    under_way = [r for r in range(len(prompts)) if not again.finished[r] and
                 not again.policy_masks[r].all()]  # fmt: skip
    assert under_way  # some had an observation to replay
    Forgetful.shift = 1
    episodes = partial.EpisodesInFlight(_setup(Forgetful))
    episodes.restore(again)
    assert [r for r in under_way if again.finished[r]] == under_way
    assert again.episodes["failed"][under_way].all()
    failure = episodes.runner(again).stats[under_way[0]].failure
    assert "not replayable on resume" in failure and "differs from the recorded" in failure
