"""Multi-turn generation: where a turn ends, and what the engine asks between turns.

An episode is one sequence in one slot of the paged engine: the policy samples a turn, the turn
ends (at one of ``Turns.stop_ids``, e.g. a closing tool-call tag, or after ``Turns.max_tokens``
sampled tokens), the engine hands the episode so far to ``Turns.handler``, and the handler's
answer (an observation's token ids) is appended to the same slot: one chunked prefill
(``jrlhf.decode.programs.extend``) writes those tokens' K/V into the slot's pages, on top of its
cache (only the new tokens are computed), and samples the next turn's first token; the episode
then decodes on, interleaved with every other slot (continuous batching). The episode
ends at an end-of-sequence id, at the total token budget, or when the handler answers None.

The ids the policy trained on are those it generated: nothing is decoded to text and tokenized
again. Each token of the result carries whether the policy sampled it (``policy`` True) or the
environment supplied it (False); the trainer's loss mask keeps only the former.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np


class TurnEnd(NamedTuple):
    """One episode whose turn just ended, as the engine hands it to ``Turns.handler``.

    ``index``/``prompt_index``/``sample_index``: the request (its position in the result), its
    prompt and its sample number; ``prompt``: the prompt's ids; ``tokens``: every token after the
    prompt so far (policy and observation tokens); ``policy``: which of them the policy sampled;
    ``reason``: ``"stop"`` (a turn stop id), ``"turn_budget"`` (``Turns.max_tokens`` sampled),
    ``"eos"`` (an end-of-sequence id: the episode ends whatever the answer) or ``"length"`` (the
    total budget is spent: likewise); ``room``: how many more tokens the episode may hold.
    """

    index: int
    prompt_index: int
    sample_index: int
    prompt: list[int]
    tokens: list[int]
    policy: np.ndarray
    reason: str
    room: int


# Called once per decode chunk with the episodes whose turn ended in it; returns, for each, the
# observation ids to append (the episode goes on) or None (it ends). Answers to episodes that
# end anyway ("eos", "length") are ignored: the call lets an environment see its episode's end.
TurnHandler = Callable[[Sequence[TurnEnd]], Sequence[Sequence[int] | None]]

CONTINUING = ("stop", "turn_budget")


@dataclasses.dataclass(frozen=True)
class Turns:
    """Multi-turn generation for one ``DecodeEngine.generate`` call (see the module docstring).

    ``stop_ids``: tokens that end a turn (at most ``MAX_STOP_IDS`` of the engine); ``max_tokens``:
    sampled tokens per turn (0: no limit but the episode's); ``handler``: see ``TurnHandler``;
    ``sampled`` (one per prompt; None: all 0): tokens each prompt's current turn has sampled
    already, when a prompt is an episode continued from an earlier call (jrlhf.ppo.partial),
    so its turn may sample ``max_tokens`` minus that many more.
    An observation longer than the engine's ``max_observation_tokens`` is refused by the engine
    in one line naming the request.
    """

    handler: TurnHandler
    stop_ids: tuple[int, ...] = ()
    max_tokens: int = 0
    sampled: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.max_tokens < 0:
            raise ValueError(f"Turns.max_tokens must be >= 0 (got {self.max_tokens})")
        if self.sampled is not None and any(n < 0 for n in self.sampled):
            raise ValueError(f"Turns.sampled must be >= 0 (got {self.sampled})")
        if not self.stop_ids and not self.max_tokens:
            raise ValueError("Turns needs stop_ids or max_tokens: otherwise no turn ever ends")


def current_turn_tokens(policy: Sequence[bool] | np.ndarray) -> int:
    """How many tokens the current turn has sampled: the policy's tokens at the end of an
    episode's ``policy`` mask, since its last observation (or its start)."""
    mask = np.asarray(policy, bool)
    start = len(mask)
    while start > 0 and mask[start - 1]:
        start -= 1
    return len(mask) - start


def end_reason(last: int, generated: int, max_new: int, eos: Sequence[int], turns: Turns) -> str:
    """Why a slot stopped after ``generated`` tokens, the last ``last``: "eos", "length", "stop"
    or "turn_budget" (the engine's order: an end-of-sequence id or the budget end the episode
    before a turn ends)."""
    if last in eos:
        return "eos"
    if generated >= max_new:
        return "length"
    if last in turns.stop_ids:
        return "stop"
    return "turn_budget"
