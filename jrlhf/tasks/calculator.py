"""A tool-use task: the arithmetic task with a calculator the policy may call.

The prompt is the arithmetic task's (``<bos> a + b =``, digits least significant first). A
response may call the calculator: ``<calc> a + b </calc>`` ends the policy's turn (the turn stop
token, ``EnvConfig.turn_stop=('</calc>',)``); the environment (:class:`CalculatorEnv`, registered
as ``calculator``) answers ``<result> c </result>``, appended to the episode, and the policy goes
on to write its final answer and ``<eos>``. A malformed call is answered ``<result> <unk>
</result>`` and counted as a tool error. The reward (``calculator_answer``) and the held-out
exact match score the final answer: the tokens after the last ``</result>`` (the whole response
when there is none) against the reference answer.

SFT demonstrations call the calculator with probability ``tool_frac`` (with the right result
in the demonstration, as the environment would answer); the others answer directly, right with
probability ``demo_good_frac`` (carries ignored otherwise, as in the arithmetic task). Three-digit
operands by default, which a small model adds badly by itself: RL with the tool teaches it to
call the tool, whose results copied out are right.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jrlhf.data import SFTRecord
from jrlhf.envs import Conversation, Step, register_environment
from jrlhf.tasks.arithmetic import BOS, DIGITS, EOS, OPS, PAD, SEP, UNK, ArithmeticTask
from jrlhf.tasks.rewards import register_reward_fn

CALL, END_CALL, RESULT, END_RESULT = "<calc>", "</calc>", "<result>", "</result>"
TOOL_TOKENS = (CALL, END_CALL, RESULT, END_RESULT)


class CalculatorTask(ArithmeticTask):
    """The arithmetic task with calculator tokens (see the module docstring).

    Token ids: the arithmetic task's 0-16, then ``<calc>`` 17, ``</calc>`` 18, ``<result>`` 19,
    ``</result>`` 20, then ``<unused*>`` up to 24.
    """

    def __init__(self, seed: int = 0, *, digits: int = 3, tool_frac: float = 0.5, **kwargs: Any):
        super().__init__(seed, digits=digits, **kwargs)
        if not 0.0 <= tool_frac <= 1.0:
            raise ValueError(f"tool_frac {tool_frac} must be in [0, 1]")
        self.tool_frac = tool_frac
        base = [PAD, BOS, EOS, UNK, SEP, *DIGITS, *OPS, *TOOL_TOKENS]
        base += [f"<unused{i}>" for i in range(-(-len(base) // 8) * 8 - len(base))]
        self.tokens = tuple(base)
        self.vocab_size = len(base)
        self._id = {t: i for i, t in enumerate(base)}
        self.call_id, self.end_call_id = self._id[CALL], self._id[END_CALL]
        self.result_id, self.end_result_id = self._id[RESULT], self._id[END_RESULT]

    @property
    def max_response_len(self) -> int:
        """A call (``<calc>``, two operands, the operator, ``</calc>``), its result in tags, the
        answer and ``<eos>``."""
        return (2 * self.digits + 3) + (self.digits + 3) + (self.digits + 2)

    # -- the tool ---------------------------------------------------------------------------------
    def call(self, a: int, op: str, b: int) -> list[int]:
        """The policy's call of ``a op b`` (operands as in the prompt)."""
        return [self.call_id, *self.encode_problem(a, op, b)[1:-1], self.end_call_id]

    def result(self, value: int | None) -> list[int]:
        """The calculator's answer (``<unk>`` for a malformed call)."""
        body = [self.unk_id] if value is None else self._number_ids(value)
        return [self.result_id, *body, self.end_result_id]

    def evaluate_call(self, ids: Sequence[int]) -> int | None:
        """The value of the call in ``ids`` (the tokens from its ``<calc>`` to ``</calc>``),
        None when it is not ``digits op digits`` with at most the task's digits per operand (a
        negative difference is malformed too)."""
        ids = [int(t) for t in ids]
        if len(ids) < 2 or ids[0] != self.call_id or ids[-1] != self.end_call_id:
            return None
        body = [self.tokens[t] for t in ids[1:-1]]
        ops = [i for i, t in enumerate(body) if t in OPS]
        if len(ops) != 1:
            return None
        i = ops[0]
        left, right = body[:i], body[i + 1 :]
        if not left or not right or any(t not in DIGITS for t in left + right):
            return None
        if max(len(left), len(right)) > self.digits:
            return None
        a, b = self._number(left), self._number(right)
        value = a + b if body[i] == "+" else a - b
        return value if value >= 0 else None

    def final_answer(self, response_ids: Sequence[int]) -> list[int]:
        """The tokens after the last ``</result>`` (all of them without one)."""
        r = [int(t) for t in response_ids]
        if self.end_result_id in r:
            return r[len(r) - r[::-1].index(self.end_result_id) :]
        return r

    # -- demonstrations and scores ---------------------------------------------------------------
    def sft_examples(self, n: int) -> list[SFTRecord]:
        """``n`` demonstrations: with probability ``tool_frac`` a call, its result and the
        answer copied from it; else a direct answer (see the module docstring)."""
        rng = np.random.default_rng([self.seed, 31])
        out = []
        for record in super().sft_examples(n):
            if rng.random() < self.tool_frac:
                a, op, b = self.decode_problem(record.prompt_ids)
                right = self.answer(record.prompt_ids)
                value = a + b if op == "+" else a - b
                response = [*self.call(a, op, b), *self.result(value), *right]
                record = SFTRecord(record.prompt_ids, response)
            out.append(record)
        return out

    def score(self, prompt_ids: Sequence[int], response_ids: Sequence[int]) -> float:
        """1.0 when the final answer up to its first ``<eos>`` is right (the response must have
        ended), else 0.0."""
        return super().score(prompt_ids, self.final_answer(response_ids))


_TASK = CalculatorTask()  # the vocabulary the environment and the reward read (seed-free)


class CalculatorEnv:
    """Answers a turn that ends with ``</calc>`` with the call's value in ``<result>`` tags
    (``<unk>`` and a tool error when the call is malformed); any other turn end finishes the
    episode."""

    def reset(self, meta: Mapping[str, Any]) -> None:
        pass

    def step(self, conversation: Conversation) -> Step:
        turn = conversation.last_turn_ids
        if not turn or turn[-1] != _TASK.end_call_id or _TASK.call_id not in turn:
            return Step(done=True)
        start = len(turn) - 1 - turn[::-1].index(_TASK.call_id)
        value = _TASK.evaluate_call(turn[start:])
        return Step(observation=_TASK.result(value), error=value is None)


def calculator_answer(
    prompt_ids: Sequence[int], response_ids: Sequence[int], meta: Mapping[str, Any] | None = None
) -> float:
    """1.0 when the final answer (after the last ``</result>``) is the reference answer
    (``meta["answer_ids"]``, ``<eos>`` included), else 0.0."""
    del prompt_ids
    answer = [int(t) for t in (meta or {}).get("answer_ids", ())]
    if not answer:
        raise ValueError("reward 'calculator_answer' needs each prompt's 'answer_ids'")
    return float(_TASK.final_answer(response_ids) == answer)


calculator_answer.required_meta = ("answer_ids",)
register_environment("calculator", CalculatorEnv)
register_reward_fn("calculator_answer", calculator_answer)
