"""The majority-class task with long-tailed response lengths (``TaskConfig.name = "longtail"``).

Each prompt also says how long its answer must be: ``<bos> x_1 ... x_n <lenK> =`` asks for K
symbols of the prompt's majority class, then ``<eos>``. K comes from a geometric grid,
``round(response_len * 2 ** (j / 2))`` for j = 0, 1, ... while it leaves room for ``<eos>`` within
``max_response_len`` (3, 4, 6, 8, 12, 17, 24, 34, 48 by default), and j is drawn with probability
proportional to ``2 ** (-tail_index * j / 2)``: a discretized Pareto law, P(K > x) ~ x^-tail_index,
capped by the grid. With the defaults the median target is 4 tokens, about 8% of prompts ask for
24 or more and 2% for 48 (12x the median): the long tail that leaves most generation slots idle
while a few sequences finish, which is what inter-stage fusion (Fusion.enabled) exploits.

Everything else (ground truth with K read from the prompt, mediocre SFT demonstrations of the
right length, preference pairs, splits, the tokenizer) is :class:`SyntheticTask`'s, except that
preference responses of a wrong length are drawn both shorter and longer than K.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jrlhf.tasks.synthetic import SyntheticTask


class LongTailTask(SyntheticTask):
    """:class:`SyntheticTask` whose prompts carry a long-tailed target length (module
    docstring). Token ids are the synthetic task's, then one ``<lenK>`` token per grid length."""

    def __init__(
        self,
        seed: int = 0,
        *,
        response_len: int = 3,
        max_response_len: int = 64,
        tail_index: float = 1.0,
        **kwargs,
    ):
        if response_len < 1:
            raise ValueError(f"response_len {response_len} must be >= 1")
        if tail_index <= 0:
            raise ValueError(f"tail_index {tail_index} must be > 0")
        grid: list[int] = []
        j = 0
        while (k := round(response_len * 2 ** (j / 2))) < max_response_len:
            if k not in grid:
                grid.append(k)
            j += 1
        self.lengths: tuple[int, ...] = tuple(grid)
        weights = 2.0 ** (-tail_index * np.arange(len(grid)) / 2)
        self.length_probs = weights / weights.sum()
        self.tail_index = float(tail_index)
        # Set before the base constructor, which asks _extra_tokens for the vocabulary.
        super().__init__(
            seed, response_len=response_len, max_response_len=max_response_len, **kwargs
        )
        first = self.tokens.index(f"<len{grid[0]}>")
        self._length_of = {first + i: k for i, k in enumerate(grid)}
        self._length_id = {k: first + i for i, k in enumerate(grid)}

    def _extra_tokens(self) -> tuple[str, ...]:
        return tuple(f"<len{k}>" for k in self.lengths)

    @property
    def max_prompt_len(self) -> int:
        """Longest prompt: ``<bos>`` + symbols + the length token + ``=``."""
        return self.prompt_len[1] + 3

    def length_token(self, k: int) -> int:
        """The id of ``<lenK>`` (K one of ``lengths``)."""
        return self._length_id[int(k)]

    def target_length(self, prompt_ids: Sequence[int]) -> int:
        """K from the prompt's ``<lenK>`` token (``response_len`` when it has none)."""
        for t in prompt_ids:
            k = self._length_of.get(int(t))
            if k is not None:
                return k
        return self.response_len

    def _other_length(self, k: int, rng: np.random.Generator) -> int:
        # Both shorter and longer than asked: a reward model that saw only longer ones (the base
        # task's range) learns "shorter is better", which a policy exploits by answering short.
        return int(rng.integers(1, min(self.max_response_len, 2 * k + 2)))

    def _draw_prompt(self, rng: np.random.Generator) -> list[int]:
        prompt = super()._draw_prompt(rng)
        k = self.lengths[int(rng.choice(len(self.lengths), p=self.length_probs))]
        return [*prompt[:-1], self.length_token(k), self.sep_id]
