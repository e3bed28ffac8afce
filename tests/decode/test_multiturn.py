"""Multi-turn generation in the paged engine (jrlhf.decode.turns): episodes of several turns with
observations appended to the slot's KV, against turn-by-turn single-turn calls and the trainer's
forward pass."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest

from jrlhf.decode import DecodeEngine, EngineConfig, SamplingParams
from jrlhf.decode.turns import Turns
from jrlhf.envs import Step, env_metrics
from tests.decode.test_decode import _hf, _prompts, _trainer_logprobs

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
def _engine(mesh_text: str = "data=1,tensor=1", kind: str = "llama3"):
    model_def, params, mesh = _hf(kind, mesh_text)
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


# gemma2: sliding windows of 8 on alternate layers and soft-capped attention logits, which the
# observation's chunked prefill must apply as the decode steps do.
@pytest.mark.parametrize("kind", ["llama3", "gemma2"])
def test_greedy_episodes_equal_turn_by_turn_calls_and_the_trainer_forward(kind):
    engine, params = _engine(kind=kind)
    prompts = _prompts(PROMPT_LENS)
    env = ScriptedEnv()
    stops = (2,)
    turns = Turns(env, max_tokens=TURN_TOKENS)
    out = engine.generate(params, prompts, SamplingParams(greedy=True, stop_ids=stops), turns=turns)
    assert out.stats["turns"] > len(prompts)  # episodes did go on past their first turn
    # Observations went into the cache as chunked prefills (programs.extend), several slots and
    # tokens a call, not one token per decode step.
    fed = sum(int(np.sum(~np.asarray(m))) for m in out.policy_masks)
    assert out.stats["observation_tokens"] == fed
    assert 0 < out.stats["extend_calls"] < out.stats["turns"] - len(prompts)
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
    # Migration of the last episodes (between turns included) onto one replica: the same.
    from jrlhf.ppo.fusion import tail_migration

    migration = tail_migration(mesh_engine, 6, 1)
    moved = mesh_engine.generate(mesh_params, prompts, sp, turns=turns, migration=migration)
    assert moved.stats["migrated_rows"] > 0
    assert moved.completion_ids == out.completion_ids
    for a, b in zip(moved.policy_masks, out.policy_masks):
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


# -- rollouts with an environment: what the trainer trains on ---------------------------------
P, R = 8, 20


def _scripted(conversation):
    """A stateless scripted environment: after turn t it answers [50 + t, 60 + t], done after
    turn 2; it records each call's view of the episode."""
    SEEN.append(conversation)
    if conversation.turn >= 3:
        return Step(done=True)
    return Step(observation=[50 + conversation.turn, 60 + conversation.turn], reward=0.5)


SEEN: list = []


def _rollout(env_setup):
    from jrlhf.meshes import make_mesh
    from jrlhf.models import ModelDef, tiny_config
    from jrlhf.ppo import batch as rl_batch
    from jrlhf.ppo.rollout import Rollout
    from jrlhf.ppo.scoring import Scorer
    from jrlhf.runtime.roles import make_infer

    mesh = make_mesh("data=2,tensor=2@0:4")
    model = ModelDef(tiny_config(vocab_size=128))
    params = model.init_sharded(mesh, "dp_tp", seed=1)
    logprobs = make_infer(model, mesh, "dp_tp", rl_batch.logprobs_fn(P))
    scorer = Scorer(
        P, R, 0, lambda arrays: logprobs(params, arrays),
        reward_fn=lambda prompt, response, meta: meta.get("env_reward", 0.0),
    )  # fmt: skip
    config = EngineConfig(
        num_slots=8, page_size=4, max_prompt_len=P, max_new_tokens=R, chunk_steps=4,
        max_observation_tokens=4,
    )  # fmt: skip
    engine = DecodeEngine(model, mesh, "dp_tp", config)
    return Rollout(engine, scorer, env=env_setup), params, model, logprobs


def test_trained_tokens_masks_and_logprobs_are_the_generated_ones_turn_by_turn():
    """A scripted environment and a deterministic (greedy) policy: the packed arrays the update
    trains on hold exactly the generated ids, the loss mask is the policy mask (observations
    out), the rollout log-probs are the engine's (0 at observations) and equal the trainer's own
    forward pass at the policy's tokens; each turn the environment saw is a prefix of the
    episode; the environment's reward reaches the reward function; and the actor loss does
    not depend on anything at the observation tokens."""
    from jrlhf.config import RLConfig
    from jrlhf.envs import EnvSetup, load_environment
    from jrlhf.ppo.losses import actor_loss

    SEEN.clear()
    env = EnvSetup(
        "scripted", load_environment("tests.decode.test_multiturn:_scripted"), max_turn_tokens=3
    )
    rollout, params, model, logprobs = _rollout(env)
    prompts = _prompts((3, 8, 5, 1))
    batch = rollout(params, prompts, SamplingParams(greedy=True, stop_ids=(2,)), meta=None)
    arrays, result = batch.arrays, batch.result
    trainer_lp = np.asarray(logprobs(params, arrays))
    assert env_metrics(arrays)["env/tool_calls"] > 0
    for i, (ids, mask) in enumerate(zip(result.completion_ids, result.policy_masks)):
        n = len(ids)
        np.testing.assert_array_equal(arrays["response_tokens"][i, :n], ids)
        np.testing.assert_array_equal(arrays["loss_mask"][i, :n], mask)
        assert not arrays["loss_mask"][i, n:].any()
        np.testing.assert_array_equal(arrays["old_logprobs"][i, :n], result.raw_logprobs[i])
        np.testing.assert_allclose(
            arrays["old_logprobs"][i, :n][mask], trainer_lp[i, :n][mask], atol=1e-5
        )
        # observations sit where the script put them: [50 + t, 60 + t] after turn t
        obs = [t for t, m in zip(ids, mask) if not m]
        assert obs == [x for t in range(1, len(obs) // 2 + 1) for x in (50 + t, 60 + t)]
        # the environment's reward (0.5 a step) reached the reward function
        assert arrays["scores"][i] == pytest.approx(0.5 * len(obs) // 2)
    for conv in SEEN:  # every turn the environment saw is a prefix of its episode
        episode = next(
            ids for ids, p in zip(result.completion_ids, prompts) if p == conv.prompt_ids
        )
        assert episode[: len(conv.response_ids)] == conv.response_ids
        assert conv.last_turn_ids == conv.response_ids[-len(conv.last_turn_ids) :]
        assert len(conv.last_turn_ids) == 3  # the turn budget ended each turn
    # The loss ignores observation tokens: scrambling them changes nothing.
    rl = RLConfig()
    loss_fn = actor_loss(P, rl, kl_in_loss=False)
    rows = len(prompts)
    rng = np.random.default_rng(0)
    train = {k: arrays[k] for k in ("tokens", "positions", "segment_ids", "response_tokens")}
    train.update(
        mask=arrays["mask"], loss_mask=arrays["loss_mask"], old_logprobs=arrays["old_logprobs"],
        ref_logprobs=arrays["old_logprobs"], kl_coef=np.zeros((rows,), np.float32),
        advantages=rng.normal(size=arrays["mask"].shape).astype(np.float32),
    )  # fmt: skip
    module = model.bind(params)
    loss, _ = loss_fn(module, train)
    obs = (arrays["mask"] > 0) & (arrays["loss_mask"] == 0)
    scrambled = dict(train)
    scrambled["advantages"] = np.where(obs, 100.0, train["advantages"]).astype(np.float32)
    scrambled["old_logprobs"] = np.where(obs, -50.0, train["old_logprobs"]).astype(np.float32)
    loss2, _ = loss_fn(module, scrambled)
    assert obs.any() and float(loss) == pytest.approx(float(loss2), abs=1e-6)


def _raises(conversation):
    if conversation.prompt_ids[0] % 2:
        raise RuntimeError("tool crashed")
    return Step(observation=[7], done=conversation.turn >= 2)


class _Sleeper:
    def reset(self, meta):
        pass

    def step(self, conversation):
        import time

        time.sleep(5 if conversation.prompt_ids[0] == 11 else 0)
        return Step(observation=[7])


def test_environment_failures_end_their_episode_until_the_limit_then_the_run():
    """Exceptions and timeouts end the episode they happen in, recorded in the metrics; more
    failed episodes than the limit stop the rollout in one line naming the environment."""
    from jrlhf.envs import EnvFailure, EnvSetup, load_environment

    prompts = [[11, 3, 4], [12, 3, 4], [14, 5, 6], [16, 7, 8]]  # one odd first token
    env = EnvSetup(
        "raises", load_environment("tests.decode.test_multiturn:_raises"), max_turn_tokens=2,
        failure_limit=0.25, timeout_s=0,
    )  # fmt: skip
    rollout, params, _, _ = _rollout(env)
    batch = rollout(params, prompts, SamplingParams(greedy=True, stop_ids=(2,)))
    assert env_metrics(batch.arrays)["env/failed_episodes"] == 1.0
    assert not (~batch.result.policy_masks[0]).any()  # the failing episode got no observation
    assert (~batch.result.policy_masks[1]).any()
    strict = dataclasses.replace(env, failure_limit=0.0)
    rollout.env = strict
    with pytest.raises(EnvFailure, match="environment 'raises' failed in 1 of 4 .* tool crashed"):
        rollout(params, prompts, SamplingParams(greedy=True, stop_ids=(2,)))
    slow = EnvSetup("sleeper", _Sleeper, max_turn_tokens=2, max_turns=2, timeout_s=0.3)
    rollout.env = slow
    batch = rollout(params, prompts, SamplingParams(greedy=True, stop_ids=(2,)))
    assert env_metrics(batch.arrays)["env/failed_episodes"] == 1.0  # prompt 0 slept too long


def test_calculator_run_trains_with_tool_calls_and_evaluates_alike(tmp_path, monkeypatch):
    """configs/calculator_grpo.gin, shortened, with episodes generated ahead of the update in
    partial passes (Asynchrony.max_staleness=2, partial_rollout_tokens=10: an episode's turns
    and environment span passes and policy versions, the batches in flight carry their masks
    and episode records to the update): GRPO from a random policy, whose episodes call the
    calculator (env/* metrics), the environment's tokens masked; `python -m jrlhf.evaluate` on
    the final checkpoint reports the run's own held-out numbers (the same episodes). The same
    run preempted in its second iteration (index 1), with episodes under way (their
    environments replayed on resume), resumes to the same numbers. The synchronous loop runs
    it in tests/e2e/test_multiprocess.py, against 2 processes."""
    import json

    from jrlhf import checkpoint, train
    from jrlhf.cli import evaluate
    from tests.run_helpers import Preempted, assert_rows_close, metric_rows, preempt_at

    run = tmp_path / "calc"
    short = [
        "RunConfig.stages=('grpo',)", "actor/RoleConfig.init='tiny'",
        "RLConfig.iterations=2", "RLConfig.prompts_per_iteration=8",
        "RLConfig.samples_per_prompt=4", "RLConfig.minibatch_size=16", "TaskConfig.num_heldout=8",
        "RunConfig.tensorboard=False",
        "Asynchrony.max_staleness=2", "Asynchrony.partial_rollout_tokens=10",
    ]  # fmt: skip
    args = ["--config", "configs/calculator_grpo.gin", "--quiet", *short]
    assert train.main(["--run-dir", str(run), *args]) == 0
    rows = [r for r in metric_rows(run, "grpo") if "env/tool_calls" in r]
    assert len(rows) == 2
    assert all(r["env/tool_calls"] > 0 and r["env/observation_tokens"] > 0 for r in rows)
    assert all(r["env/failed_episodes"] == 0 for r in rows)
    assert [r["staleness/max"] for r in rows] == [0.0, 1.0]
    assert rows[1]["partial/continued_frac"] > 0  # episodes went on across an update
    assert all(r["response_len_max"] <= 20 for r in rows)  # observations or not, within budget
    out = tmp_path / "eval.json"
    assert evaluate.main(["--checkpoint", str(run), "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    after = json.loads((run / "summary.json").read_text())["after"]
    for key in ("gt_score", "reward", "response_len"):
        np.testing.assert_allclose(report[key], after[key], rtol=1e-4, atol=1e-5, err_msg=key)

    killed = tmp_path / "killed"
    resumable = [
        "--run-dir", str(killed), *args, "RLConfig.checkpoint_every=1",
        "RLConfig.async_checkpoint=False",
    ]  # fmt: skip
    preempt_at(monkeypatch, 1)
    with pytest.raises(Preempted):
        train.main(resumable)
    monkeypatch.undo()
    assert checkpoint.latest_step_dir(killed).name == "1"
    assert train.main([*resumable, "--resume"]) == 0
    assert_rows_close(metric_rows(killed, "grpo"), metric_rows(run, "grpo"))


def test_episodes_cross_the_sample_channel_and_checkpoints_whole():
    """A multi-turn round's policy masks and episode records survive the data plane's packing
    and the checkpoint's JSON, and its samples' meta carries the environment's reward."""
    from jrlhf.ppo.samples import pack_batch, unpack_batch
    from jrlhf.ppo.staleness import GeneratedBatch

    g = GeneratedBatch(
        index=3, prompts=[[1, 2], [3]], meta=[{"a": 1}, {"a": 2}],
        prompt_index=np.asarray([0, 0, 1]), completions=[[5, 6, 7], [8], [9, 9]],
        raw_logprobs=[np.asarray([-1.0, 0.0, -2.0], np.float32), np.zeros(1, np.float32),
                      np.asarray([-0.5, -0.25], np.float32)],
        token_versions=[np.full(3, 2), np.full(1, 2), np.full(2, 2)],
        policy_masks=[np.asarray([True, False, True]), np.asarray([True]),
                      np.asarray([True, True])],
        episodes={"env_reward": np.asarray([0.5, np.nan, 1.0]), "turns": np.asarray([2.0, 1, 1])},
    )  # fmt: skip
    for back in (unpack_batch(*pack_batch(g)), GeneratedBatch.from_json(g.to_json())):
        for a, b in zip(back.policy_masks, g.policy_masks):
            np.testing.assert_array_equal(a, b)
        for k, v in g.episodes.items():
            np.testing.assert_array_equal(back.episodes[k], v)
        assert back.sample_meta == [
            {"a": 1, "env_reward": 0.5},
            {"a": 1},
            {"a": 2, "env_reward": 1.0},
        ]


def test_guessing_game_environment_keeps_its_state_over_turns():
    """The stateful example (jrlhf.tasks.guessing): replaying SFT transcripts turn by turn, the
    environment answers exactly what each transcript says, rewards only the first correct
    guess, and flags a malformed turn as a tool error."""
    from jrlhf.envs import Conversation, load_environment
    from jrlhf.tasks.guessing import GuessTask

    task = GuessTask(seed=3)
    make = load_environment("guess_number")
    for record in task.sft_examples(40):
        pairs = list(zip(record.response_ids[0::3], record.response_ids[2::3]))
        # The transcript's secret: the one digit consistent with every answer it shows (a
        # transcript that ran out of turns may leave several: any of them answers alike).
        secret = next(
            s for s in range(10)
            if all(task.reply(int(task.tokens[g]), s) == task.tokens[a] for g, a in pairs)
        )  # fmt: skip
        env = make()
        env.reset({"secret": secret})
        ids = list(record.response_ids)
        rewards = []
        for t in range(0, len(ids) - 2, 3):
            turn = ids[t : t + 2]
            mask = np.asarray([True] * (t + 2))
            mask[2:t:3] = False
            step = env.step(Conversation(task.prompt(), ids[: t + 2], mask, t // 3 + 1, {}))
            assert step.observation == [ids[t + 2]], (turn, step)
            rewards.append(step.reward)
        assert rewards.count(1.0) == int(task.replies["correct"] in ids)
    env = make()
    env.reset({"secret": 4})
    bad = env.step(Conversation(task.prompt(), [5, 5], np.ones(2, bool), 1, {}))
    assert bad.error and bad.observation == [task.unk_id]
