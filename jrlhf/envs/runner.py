"""Driving one environment per episode from the decode engine's turn ends.

``EpisodeRunner`` is the engine's turn handler (jrlhf.decode.turns.TurnHandler) for one rollout:
at an episode's first turn end it makes the episode's environment and resets it with the prompt
record's meta, then steps it at every turn end and turns its answer into the observation ids the
engine appends. Environment code runs on daemon threads with a deadline (``timeout_s``; 0 runs
it inline): an exception, a timeout or an answer that is not a ``Step`` ends that episode with
the failure recorded, never the run, until more than ``failure_limit`` of the rollout's episodes
have failed; then one line naming the environment and the first failure stops it (EnvFailure).
A thread that never returns cannot be stopped from Python: it is abandoned (daemon threads do
not keep the process alive). In a multi-controller job process 0 steps every environment and
broadcasts the answers, so every process feeds its slots the same observations whatever the
environment does (a clock, a network call, randomness).
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from jrlhf.decode.turns import CONTINUING, TurnEnd, Turns
from jrlhf.envs.base import Conversation, EnvFailure, Step
from jrlhf.meshes.batch import broadcast_from_first, host_group

# What a batch carries per episode (EpisodeRunner.episode_arrays): its arrays' "episode/<field>"
# rows, which the reward's meta (env_reward) and the iteration's env/* metrics read.
EPISODE_FIELDS = ("env_reward", "turns", "tool_calls", "tool_errors", "failed")


def episode_meta(episodes: Mapping[str, np.ndarray] | None, i: int) -> dict[str, Any]:
    """What episode ``i`` adds to its sample's meta for the reward function: ``env_reward``
    when the environment gave one."""
    if episodes is None or np.isnan(episodes["env_reward"][i]):
        return {}
    return {"env_reward": float(episodes["env_reward"][i])}


def env_metrics(arrays: Mapping[str, np.ndarray]) -> dict[str, float]:
    """The ``env/*`` metrics of scored multi-turn arrays (none for single-turn ones): per
    episode means of turns, tool calls, tool errors and tokens by source (the policy's, the
    observations'), and the number of failed episodes."""
    if "episode/turns" not in arrays:
        return {}
    n = max(len(arrays["episode/turns"]), 1)
    policy = float(np.sum(arrays["loss_mask"]))
    total = float(np.sum(arrays["mask"]))
    return {
        "env/turns": float(np.mean(arrays["episode/turns"])),
        "env/tool_calls": float(np.mean(arrays["episode/tool_calls"])),
        "env/tool_errors": float(np.mean(arrays["episode/tool_errors"])),
        "env/failed_episodes": float(np.sum(arrays["episode/failed"])),
        "env/policy_tokens": policy / n,
        "env/observation_tokens": (total - policy) / n,
    }


@dataclasses.dataclass
class EpisodeStats:
    """What happened in one episode: turns the policy took, observations appended (tool
    calls), tool errors the environment flagged, the failure that ended it (None: none), and the
    environment's reward (summed; None when it gave none)."""

    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    failure: str | None = None
    reward: float | None = None


@dataclasses.dataclass(frozen=True)
class _Outcome:
    """An environment's answer to one turn end: the observation ids (None: the episode ends),
    the step's reward, whether it flagged a tool error, or the failure that ends the episode."""

    ids: list[int] | None = None
    reward: float | None = None
    error: bool = False
    failure: str | None = None


class _Call:
    """One environment call on a daemon thread."""

    def __init__(self, fn: Callable[[], Any]):
        self.result: Any = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self.thread.start()

    def _run(self, fn):
        try:
            self.result = fn()
        except BaseException as e:  # reported to the runner, which records it
            self.error = e
        finally:
            self.done.set()


class EpisodeRunner:
    """The turn handler of one rollout (see the module docstring).

    ``factory()`` makes an environment (``reset``/``step``); ``meta[p]`` is prompt ``p``'s
    record meta; ``encode`` turns text observations into ids (None: environments must answer
    ids); ``decode`` gives the conversation its text; ``episodes`` is how many the rollout holds
    (the failure limit's denominator); ``max_turns`` (0: no cap) ends an episode after that many
    turns of the policy.
    """

    def __init__(
        self,
        factory: Callable[[], Any],
        meta: Sequence[Mapping[str, Any]],
        episodes: int,
        *,
        name: str,
        encode: Callable[[str], list[int]] | None = None,
        decode: Callable[[Sequence[int]], str] | None = None,
        max_turns: int = 0,
        timeout_s: float = 30.0,
        failure_limit: float = 0.25,
        max_observation_tokens: int = 0,
    ):
        self.factory, self.meta, self.episodes = factory, meta, episodes
        self.max_observation_tokens = max_observation_tokens
        self.name, self.encode, self.decode = name, encode, decode
        self.max_turns, self.timeout_s, self.failure_limit = max_turns, timeout_s, failure_limit
        self.envs: dict[int, Any] = {}
        self.stats: dict[int, EpisodeStats] = {}

    # -- the handler ---------------------------------------------------------------------------
    def __call__(self, ends: Sequence[TurnEnd]) -> list[list[int] | None]:
        answers: list[list[int] | None] = [None] * len(ends)
        jobs: dict[int, Callable[[], Any]] = {}
        many = len(host_group()) > 1
        first = jax.process_index() == min(host_group())
        for k, end in enumerate(ends):
            stats = self.stats.setdefault(end.index, EpisodeStats())
            stats.turns += 1
            if end.reason not in CONTINUING or stats.failure is not None:
                continue
            if self.max_turns and stats.turns >= self.max_turns:
                continue
            if first:  # the group's first process steps them (see _shared)
                jobs[k] = self._job(end, stats.turns)
        outcomes = {k: self._outcome(ends[k], o) for k, o in self._run(jobs).items()}
        if many:
            outcomes = self._shared(outcomes, len(ends))
        for k, outcome in outcomes.items():
            answers[k] = self._record(ends[k], outcome)
        failed = [s for s in self.stats.values() if s.failure is not None]
        if len(failed) > self.failure_limit * self.episodes:
            raise EnvFailure(
                f"environment {self.name!r} failed in {len(failed)} of {self.episodes} episodes "
                f"(more than EnvConfig.failure_limit {self.failure_limit:g}); first: "
                f"{failed[0].failure}"
            )
        return answers

    def _job(self, end: TurnEnd, turn: int) -> Callable[[], Any]:
        meta = self.meta[end.prompt_index]
        env = self.envs.get(end.index)
        fresh = env is None
        if fresh:
            env = self.envs[end.index] = self.factory()
        conversation = Conversation(end.prompt, end.tokens, end.policy, turn, meta, self.decode)

        def job():
            if fresh:
                env.reset(meta)
            return env.step(conversation)

        return job

    def _run(self, jobs: Mapping[int, Callable[[], Any]]) -> dict[int, tuple[Any, str | None]]:
        """(result, failure) of every job: inline without a timeout, else on daemon threads
        that share one deadline."""
        out: dict[int, tuple[Any, str | None]] = {}
        if not self.timeout_s:
            for k, job in jobs.items():
                try:
                    out[k] = (job(), None)
                except Exception as e:
                    out[k] = (None, f"{type(e).__name__}: {e}")
            return out
        calls = {k: _Call(job) for k, job in jobs.items()}
        deadline = time.monotonic() + self.timeout_s
        for k, call in calls.items():
            if not call.done.wait(max(0.0, deadline - time.monotonic())):
                out[k] = (None, f"no answer within EnvConfig.timeout_s {self.timeout_s:g} s")
            elif call.error is not None:
                out[k] = (None, f"{type(call.error).__name__}: {call.error}")
            else:
                out[k] = (call.result, None)
        return out

    def _outcome(self, end: TurnEnd, outcome: tuple[Any, str | None]) -> _Outcome:
        """What an environment's answer to ``end`` means: observation ids, reward, tool error,
        or the failure that ends the episode."""
        step, failure = outcome
        if failure is None and not isinstance(step, Step):
            failure = f"step returned {type(step).__name__}, not a Step"
        if failure is None and step.reward is not None and not math.isfinite(step.reward):
            failure = f"step returned a non-finite reward {step.reward!r}"
        ids: list[int] = []
        if failure is None:
            obs = step.observation
            if isinstance(obs, str):
                if obs and self.encode is None:
                    failure = "a text observation, and this run has no tokenizer to encode it"
                else:
                    ids = self.encode(obs) if obs else []
            else:
                try:
                    ids = [int(t) for t in obs]
                except (TypeError, ValueError):
                    failure = f"observation {obs!r} is neither text nor token ids"
        limit = self.max_observation_tokens
        if failure is None and limit and len(ids) > limit:
            failure = (
                f"an observation of {len(ids)} tokens, more than "
                f"EnvConfig.max_observation_tokens {limit}"
            )
        if failure is not None:
            return _Outcome(failure=failure)
        reward = None if step.reward is None else float(step.reward)
        return _Outcome(None if step.done else ids, reward, bool(step.error))

    def _record(self, end: TurnEnd, outcome: _Outcome) -> list[int] | None:
        """Update ``end``'s episode with ``outcome``; its observation ids (None: it ends)."""
        stats = self.stats[end.index]
        if outcome.failure is not None:
            where = f"episode {end.index} (prompt {end.prompt_index}), turn {stats.turns}"
            stats.failure = f"{where}: {outcome.failure}"
            return None
        if outcome.reward is not None:
            stats.reward = (stats.reward or 0.0) + outcome.reward
        stats.tool_errors += outcome.error
        if not outcome.ids:
            return None
        stats.tool_calls += 1
        return outcome.ids

    def _shared(self, outcomes: dict[int, _Outcome], count: int) -> dict[int, _Outcome]:
        """The first process's outcomes on every process of the group generating (a
        multi-controller job steps each episode's environment once, so that every process feeds
        the same observations): per turn end, int32 ``[kind, error, length, ids...]`` and a
        float32 reward (NaN: none)."""
        width = 3 + max(1, self.max_observation_tokens)
        rows = np.zeros((count, width), np.int32)
        rows[:, 0] = -1  # no step taken
        rewards = np.full((count,), np.nan, np.float32)
        if jax.process_index() == min(host_group()):
            for k, o in outcomes.items():
                ids = o.ids or []
                kind = 2 if o.failure is not None else (1 if o.ids is not None else 0)
                rows[k, :3] = (kind, o.error, len(ids))
                rows[k, 3 : 3 + len(ids)] = ids
                rewards[k] = np.nan if o.reward is None else o.reward
        rows, rewards = broadcast_from_first(rows), broadcast_from_first(rewards)
        shared = {}
        for k, row in enumerate(rows):
            kind = int(row[0])
            if kind < 0:
                continue
            if kind == 2:
                mine = outcomes.get(k)
                shared[k] = _Outcome(failure=mine.failure if mine else "see the first process")
                continue
            reward = None if np.isnan(rewards[k]) else float(rewards[k])
            ids = [int(t) for t in row[3 : 3 + int(row[2])]] if kind == 1 else None
            shared[k] = _Outcome(ids, reward, bool(row[1]))
        return shared

    # -- across partial passes and resumes ------------------------------------------------------
    def restore(self, episodes: Mapping[str, np.ndarray], indices: Sequence[int]) -> None:
        """Take the records of episodes ``indices`` (finished ones: their records are final)
        saved with a round (``episode_arrays``' form) as this runner's. An episode under way
        gets its record back from ``replay``."""
        for i in indices:
            reward = float(episodes["env_reward"][i])
            self.stats[i] = EpisodeStats(
                turns=int(episodes["turns"][i]),
                tool_calls=int(episodes["tool_calls"][i]),
                tool_errors=int(episodes["tool_errors"][i]),
                failure="failed before the resume" if episodes["failed"][i] else None,
                reward=None if math.isnan(reward) else reward,
            )

    def replay(self, episodes: Sequence[tuple[int, int, list[int], list[int], np.ndarray]]):
        """Rebuild the environments of unfinished episodes after a resume (environments are
        Python objects no checkpoint holds): each ``(index, prompt_index, prompt, tokens,
        policy)`` gets a fresh environment, reset with its prompt's meta and stepped at every
        recorded turn end that an observation followed, which must answer that observation
        again. Returns the indices of the episodes whose environment failed or answered
        otherwise (not replayable: their failure is recorded and they end). The group's first
        process steps the environments and the others take its verdict."""
        lost = np.zeros((len(episodes),), np.int32)
        if jax.process_index() == min(host_group()):
            for n, (index, prompt_index, prompt, tokens, policy) in enumerate(episodes):
                why = self._replay_one(index, prompt_index, prompt, tokens, policy)
                if why is not None:
                    lost[n] = 1
                    self.stats.setdefault(
                        index, EpisodeStats()
                    ).failure = (
                        f"episode {index} (prompt {prompt_index}) not replayable on resume: {why}"
                    )
        if len(host_group()) > 1:
            lost = broadcast_from_first(lost)
        out = [episodes[n][0] for n in np.flatnonzero(lost)]
        for index in out:  # the other processes record the first one's verdict
            stats = self.stats.setdefault(index, EpisodeStats())
            stats.failure = stats.failure or "not replayable on resume (see the first process)"
        return out

    def _replay_one(self, index, prompt_index, prompt, tokens, policy) -> str | None:
        """Why episode ``index``'s environment cannot be rebuilt from its tokens (None: it
        was)."""
        policy = np.asarray(policy, bool)
        meta = self.meta[prompt_index]
        env = self.envs[index] = self.factory()
        ends = [i for i in range(len(policy) - 1) if policy[i] and not policy[i + 1]]
        # Every turn of an episode under way ended with an observation (a tool call); its
        # errors and rewards come back from the environment's answers.
        stats = self.stats[index] = EpisodeStats(turns=len(ends), tool_calls=len(ends))
        for turn, i in enumerate(ends, start=1):
            recorded = i + 1
            while recorded < len(policy) and not policy[recorded]:
                recorded += 1
            conversation = Conversation(
                prompt, tokens[: i + 1], policy[: i + 1], turn, meta, self.decode
            )

            def job(fresh=turn == 1, conversation=conversation):
                if fresh:
                    env.reset(meta)
                return env.step(conversation)

            outcome = self._outcome(None, self._run({0: job})[0])
            if outcome.failure is not None:
                return outcome.failure
            # An unfinished episode's observations were appended whole (one cut to the room
            # left ends its episode), so the answer must be the recorded tokens exactly.
            want, got = list(tokens[i + 1 : recorded]), outcome.ids
            if got != want:
                return f"turn {turn}'s observation {got} differs from the recorded {want}"
            stats.tool_errors += outcome.error
            if outcome.reward is not None:
                stats.reward = (stats.reward or 0.0) + outcome.reward
        if not ends:  # the first turn is still under way: as before its first turn end
            self.envs.pop(index)
            self.stats.pop(index)
        return None

    # -- after the rollout -------------------------------------------------------------------------
    def episode_arrays(self, indices: Sequence[int]) -> dict[str, np.ndarray]:
        """Per episode of ``indices`` (request indices), what the batch carries with it
        (``EPISODE_FIELDS``): the environment's summed reward (NaN where it gave none), turns,
        tool calls, tool errors, and whether a failure ended it."""
        stats = [self.stats.get(int(i), EpisodeStats(turns=1)) for i in indices]
        nan = float("nan")
        return {
            "env_reward": np.asarray([nan if s.reward is None else s.reward for s in stats]),
            "turns": np.asarray([s.turns for s in stats], np.float64),
            "tool_calls": np.asarray([s.tool_calls for s in stats], np.float64),
            "tool_errors": np.asarray([s.tool_errors for s in stats], np.float64),
            "failed": np.asarray([s.failure is not None for s in stats], np.float64),
        }


@dataclasses.dataclass(frozen=True)
class EnvSetup:
    """A run's environment, resolved (jrlhf.config.EnvConfig): how to make one per episode, the
    turn stop ids and limits, and the tokenizer's text functions. ``runner`` and ``turns`` give
    one rollout its handler."""

    name: str
    factory: Callable[[], Any]
    stop_ids: tuple[int, ...] = ()
    max_turn_tokens: int = 0
    max_turns: int = 0
    timeout_s: float = 30.0
    failure_limit: float = 0.25
    encode: Callable[[str], list[int]] | None = None
    decode: Callable[[Sequence[int]], str] | None = None
    max_observation_tokens: int = 0

    def runner(self, meta: Sequence[Mapping[str, Any]], episodes: int) -> EpisodeRunner:
        """The turn handler of one rollout of ``episodes`` episodes over prompts with ``meta``."""
        return EpisodeRunner(
            self.factory, meta, episodes, name=self.name, encode=self.encode,
            decode=self.decode, max_turns=self.max_turns, timeout_s=self.timeout_s,
            failure_limit=self.failure_limit, max_observation_tokens=self.max_observation_tokens,
        )  # fmt: skip

    def turns(self, runner: EpisodeRunner) -> Turns:
        return Turns(runner, self.stop_ids, self.max_turn_tokens)
