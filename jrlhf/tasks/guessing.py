"""A stateful multi-turn task: guess a secret digit, told higher or lower after each guess.

Every prompt is ``<bos> guess :``; its record's meta holds a secret digit (``meta["secret"]``,
drawn by the prompt's position). The policy guesses a digit and ends its turn with ``?`` (the
turn stop token, ``EnvConfig.turn_stop=('?',)``); the environment (:class:`GuessEnv`, registered
as ``guess_number``) answers ``higher``, ``lower`` or ``correct``, keeping the secret and the
number of guesses as its state. After ``correct`` the policy ends the episode with ``<eos>``.
The environment gives reward 1.0 on the first correct guess (``TaskConfig.reward_fn=
'env_reward'``); the held-out score is the fraction of episodes that found the secret.

SFT demonstrations search by halving (at most four guesses for ten digits) with probability
``demo_good_frac``; the others guess any digit not yet ruled out, so they take more turns and
sometimes run out of them: RL has room to make the search shorter and surer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jrlhf.data import SFTRecord
from jrlhf.envs import Conversation, Step, register_environment
from jrlhf.tasks.arithmetic import WordLevelVocab

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
DIGITS = tuple("0123456789")
GUESS, COLON, ASK = "guess", ":", "?"
HIGHER, LOWER, CORRECT = "higher", "lower", "correct"
_STREAM_SECRETS, _STREAM_SFT = 41, 42


class GuessTask(WordLevelVocab):
    """The guessing game (see the module docstring); ``max_turns`` guesses at most."""

    def __init__(self, seed: int = 0, *, max_turns: int = 5, demo_good_frac: float = 0.5):
        self.seed, self.max_turns, self.demo_good_frac = int(seed), max_turns, demo_good_frac
        tokens = [PAD, BOS, EOS, UNK, *DIGITS, GUESS, COLON, ASK, HIGHER, LOWER, CORRECT]
        tokens += [f"<unused{i}>" for i in range(-(-len(tokens) // 8) * 8 - len(tokens))]
        self.tokens = tuple(tokens)
        self.vocab_size = len(tokens)
        self._id = {t: i for i, t in enumerate(tokens)}
        self.pad_id, self.bos_id, self.eos_id, self.unk_id = 0, 1, 2, 3
        self.ask_id = self._id[ASK]
        self.replies = {r: self._id[r] for r in (HIGHER, LOWER, CORRECT)}

    @property
    def max_prompt_len(self) -> int:
        return 3

    @property
    def max_response_len(self) -> int:
        """``max_turns`` guesses and answers (3 tokens each) and ``<eos>``."""
        return 3 * self.max_turns + 1

    def model_overrides(self) -> dict[str, Any]:
        return dict(
            vocab_size=self.vocab_size,
            bos_token_id=self.bos_id,
            eos_token_id=self.eos_id,
            pad_token_id=self.pad_id,
        )

    # -- the game ---------------------------------------------------------------------------------
    def prompt(self) -> list[int]:
        return [self.bos_id, self._id[GUESS], self._id[COLON]]

    def prompts(self, n: int, split: str = "train") -> list[list[int]]:
        """``n`` prompts (all the same ids: the secret is in the meta)."""
        if split not in ("train", "heldout"):
            raise ValueError(f"split {split!r} unknown (use 'train' or 'heldout')")
        return [self.prompt() for _ in range(n)]

    def prompt_meta(self, prompts: Sequence[Sequence[int]]) -> list[dict[str, Any]]:
        """Each prompt's secret, by its position (the same stream for every list of prompts)."""
        rng = np.random.default_rng([self.seed, _STREAM_SECRETS])
        return [{"secret": int(s)} for s in rng.integers(0, 10, size=len(prompts))]

    def reply(self, guess: int, secret: int) -> str:
        return CORRECT if guess == secret else (HIGHER if secret > guess else LOWER)

    def _episode(self, secret: int, rng: np.random.Generator, halving: bool) -> list[int]:
        lo, hi, out = 0, 9, []
        for _ in range(self.max_turns):
            guess = (lo + hi) // 2 if halving else int(rng.integers(lo, hi + 1))
            answer = self.reply(guess, secret)
            out += [self._id[str(guess)], self.ask_id, self._id[answer]]
            if answer == CORRECT:
                return [*out, self.eos_id]
            lo, hi = (guess + 1, hi) if answer == HIGHER else (lo, guess - 1)
        return out

    def sft_examples(self, n: int) -> list[SFTRecord]:
        """``n`` transcripts: halving with probability ``demo_good_frac``, else random guesses
        among the digits not yet ruled out."""
        rng = np.random.default_rng([self.seed, _STREAM_SFT])
        return [
            SFTRecord(
                self.prompt(),
                self._episode(int(rng.integers(10)), rng, rng.random() < self.demo_good_frac),
            )
            for _ in range(n)
        ]

    def preference_pairs(self, n: int, split: str = "train") -> list:
        raise ValueError("the guess_number task has no preference pairs (it has no rm/dpo data)")

    def score(self, prompt_ids: Sequence[int], response_ids: Sequence[int]) -> float:
        """1.0 when the episode holds the environment's ``correct``, else 0.0."""
        return float(self.replies[CORRECT] in [int(t) for t in response_ids])


_TASK = GuessTask()  # the vocabulary the environment reads (seed-free)


class GuessEnv:
    """Keeps the secret (``reset``) and answers each ``digit ?`` turn; a turn that is not one
    digit then ``?`` is answered ``<unk>`` and counted as a tool error. Reward 1.0 on the first
    correct guess."""

    def reset(self, meta: Mapping[str, Any]) -> None:
        if "secret" not in meta:
            raise ValueError("the guess_number environment needs each prompt's 'secret'")
        self.secret = int(meta["secret"])
        self.found = False

    def step(self, conversation: Conversation) -> Step:
        turn = conversation.last_turn_ids
        word = [_TASK.tokens[t] for t in turn]
        if len(word) != 2 or word[0] not in DIGITS or word[1] != ASK:
            return Step(observation=[_TASK.unk_id], error=True)
        answer = _TASK.reply(int(word[0]), self.secret)
        reward = 1.0 if answer == CORRECT and not self.found else None
        self.found |= answer == CORRECT
        return Step(observation=[_TASK.replies[answer]], reward=reward)


register_environment("guess_number", GuessEnv)
