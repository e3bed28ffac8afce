"""Multi-turn generation in the paged engine (jrlhf.decode.turns): episodes of several turns with
observations appended to the slot's KV, against turn-by-turn single-turn calls and the trainer's
forward pass."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from jrlhf.decode import DecodeEngine, EngineConfig, SamplingParams
from jrlhf.decode.turns import Turns
from tests.test_decode import _hf, _prompts, _trainer_logprobs

ENGINE = EngineConfig(
    num_slots=4,
    page_size=4,
    max_prompt_len=48,
    max_new_tokens=20,
    chunk_steps=4,
    max_prefill_rows=4,
    max_observation_tokens=4,
)
PROMPT_LENS = (3, 11, 17, 5, 1, 8)
TURN_TOKENS = 3


@functools.cache
def _engine(mesh_text: str = "data=1,tensor=1"):
    model_def, params, mesh = _hf("llama3", mesh_text)
    return DecodeEngine(model_def, mesh, "dp_tp", ENGINE), params


def _observation(prompt_index: int, turn: int) -> list[int] | None:
    """The scripted environment: observation ``turn`` (1-based) of an episode, None after 3."""
    if turn > 3:
        return None
    return [5 + turn, 40 + prompt_index][: 1 + (prompt_index + turn) % 2]


class ScriptedEnv:
    """A turn handler that records what it saw and answers ``_observation``."""

    def __init__(self):
        self.seen = []

    def __call__(self, ends):
        out = []
        for e in ends:
            self.seen.append(e)
            turn = 1 + int(np.sum(~e.policy[1:] & e.policy[:-1]))  # observations so far + 1
            out.append(_observation(e.prompt_index, turn))
        return out


def _turn_by_turn(engine, params, prompt, prompt_index, stops):
    """The reference: each turn one single-turn greedy call from the prompt plus everything so
    far, the observation appended by hand."""
    tokens, policy, turn = [], [], 0
    while True:
        room = ENGINE.max_new_tokens - len(tokens)
        sp = SamplingParams(greedy=True, stop_ids=stops, max_new_tokens=min(TURN_TOKENS, room))
        new = engine.generate(params, [prompt + tokens], sp).completion_ids[0]
        tokens += new
        policy += [True] * len(new)
        if new[-1] in stops or len(tokens) >= ENGINE.max_new_tokens:
            return tokens, policy
        turn += 1
        obs = _observation(prompt_index, turn)
        if obs is None:
            return tokens, policy
        obs = obs[: ENGINE.max_new_tokens - len(tokens)]
        tokens += obs
        policy += [False] * len(obs)
        if len(tokens) >= ENGINE.max_new_tokens:
            return tokens, policy


def test_greedy_episodes_equal_turn_by_turn_calls_and_the_trainer_forward():
    engine, params = _engine()
    prompts = _prompts(PROMPT_LENS)
    env = ScriptedEnv()
    stops = (2,)
    turns = Turns(env, max_tokens=TURN_TOKENS)
    out = engine.generate(params, prompts, SamplingParams(greedy=True, stop_ids=stops), turns=turns)
    assert out.stats["turns"] > len(prompts)  # episodes did go on past their first turn
    for i, prompt in enumerate(prompts):
        want, want_policy = _turn_by_turn(engine, params, prompt, i, stops)
        assert out.completion_ids[i] == want, i
        np.testing.assert_array_equal(out.policy_masks[i], want_policy)
    # Every token's raw log-prob is the trainer's at the policy's tokens, 0 at observations.
    trainer = _trainer_logprobs(engine.model_def, params, prompts, out.completion_ids)
    for got, mask, ref in zip(out.raw_logprobs, out.policy_masks, trainer):
        np.testing.assert_allclose(got[mask], ref[mask], atol=1e-5, rtol=0)
        assert np.all(got[~mask] == 0)
    # The handler saw each turn's end with the episode so far, and why it ended.
    assert {e.reason for e in env.seen} <= {"turn_budget", "length", "eos"}
    assert all(len(e.tokens) == len(e.policy) for e in env.seen)


def test_sampled_episodes_turn_stop_ids_and_meshes_agree():
    """Sampling several episodes a prompt with a turn stop id the model emits: each turn ends
    at that id (or the turn budget), the log-probs are the trainer's, and a data x tensor mesh
    gives the same episodes as one device."""
    engine, params = _engine()
    prompts = _prompts(PROMPT_LENS)
    plain = engine.generate(params, prompts, SamplingParams(seed=4, num_samples=2))
    stop = int(np.bincount(np.concatenate(plain.completion_ids)).argmax())  # a common token
    turns = Turns(ScriptedEnv(), stop_ids=(stop,), max_tokens=5)
    sp = SamplingParams(seed=4, num_samples=2, temperature=0.9)
    out = engine.generate(params, prompts, sp, turns=turns)
    for toks, mask in zip(out.completion_ids, out.policy_masks):
        toks = np.asarray(toks)
        ends = np.nonzero(mask[:-1] & ~mask[1:])[0]  # each turn's last token
        assert all(toks[j] == stop or _turn_len(mask, j) == 5 for j in ends)
    assert any(toks[j] == stop for toks in out.completion_ids for j in range(len(toks)))
    reps = [prompts[int(i)] for i in out.prompt_index]
    trainer = _trainer_logprobs(engine.model_def, params, reps, out.completion_ids)
    for got, mask, ref in zip(out.raw_logprobs, out.policy_masks, trainer):
        np.testing.assert_allclose(got[mask], ref[mask], atol=1e-5, rtol=0)
    mesh_engine, mesh_params = _engine("data=2,tensor=2")
    other = mesh_engine.generate(mesh_params, prompts, sp, turns=turns)
    assert other.completion_ids == out.completion_ids
    for a, b in zip(other.policy_masks, out.policy_masks):
        np.testing.assert_array_equal(a, b)


def _turn_len(mask: np.ndarray, end: int) -> int:
    start = end
    while start > 0 and mask[start - 1]:
        start -= 1
    return end - start + 1


def test_multiturn_refusals_name_the_setting_and_the_request():
    engine, params = _engine()
    prompts = _prompts((3,))
    with pytest.raises(ValueError, match="needs stop_ids or max_tokens"):
        Turns(ScriptedEnv())
    long = Turns(lambda ends: [[7] * 9 for _ in ends], max_tokens=2)
    with pytest.raises(ValueError, match="request 0: an observation of 9 tokens .* 4"):
        engine.generate(params, prompts, SamplingParams(greedy=True), turns=long)
    bad = Turns(lambda ends: [[10**6] for _ in ends], max_tokens=2)
    with pytest.raises(ValueError, match="request 0: observation token id 1000000 outside"):
        engine.generate(params, prompts, SamplingParams(greedy=True), turns=bad)
    single = DecodeEngine(engine.model_def, engine.mesh, "dp_tp", EngineConfig())
    with pytest.raises(ValueError, match="max_observation_tokens > 0"):
        single.generate(params, prompts, SamplingParams(greedy=True), turns=long)
