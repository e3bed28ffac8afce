"""A built-in task with exact answers: multi-digit addition and subtraction, one token per digit.

A prompt is ``<bos> a_1 .. a_d + b_1 .. b_d =`` (or ``-``; ``a >= b`` for subtraction, so answers
are never negative), operands of ``digits`` digits with leading zeros; the answer is the result's
digits without leading zeros, then ``<eos>``. Numbers are written least significant digit first
(``reverse=True``, the default): each answer digit then depends on the operands' digits at its
position and the carry from the digit before it, an order a small causal model can learn (most
significant first makes it predict carries it has not computed yet). A response scores
1 when it is exactly the answer (up to its first ``<eos>``), else 0: :meth:`ArithmeticTask.score`,
which ``TaskConfig.reward_fn='answer_match'`` reproduces from each prompt's reference answer.

SFT demonstrations are right with probability ``demo_good_frac``; the others make the classic
mistake of ignoring carries and borrows (digit-wise sum mod 10, digit-wise difference), so the
SFT policy answers problems without a carry well and the others badly: the headroom RL closes.
Preference pairs rank the right answer over a mistaken one. Train and held-out problems are
disjoint (a CRC32 hash of the prompt's ids decides the split, independent of the seed).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers, processors

from jrlhf.data import ANSWER_IDS, PreferenceRecord, SFTRecord, Tokenizer, write_jsonl

PAD, BOS, EOS, UNK, SEP = "<pad>", "<bos>", "<eos>", "<unk>", "="
DIGITS = tuple("0123456789")
OPS = ("+", "-")
_STREAM_PROMPTS, _STREAM_SFT, _STREAM_PAIRS = 11, 12, 13


class WordLevelVocab:
    """The tokenizer of a built-in task whose vocabulary is ``self._id`` (token -> id, with
    ``<pad>``, ``<bos>``, ``<eos>``, ``<unk>`` among them): word-level over whitespace,
    ``<bos>`` prepended to encoded text."""

    _id: dict[str, int]
    bos_id: int

    def hf_tokenizer(self) -> HFTokenizer:
        """Word-level over the vocabulary; ``<bos>`` prepended to encoded text."""
        tok = HFTokenizer(models.WordLevel(dict(self._id), unk_token=UNK))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tok.add_special_tokens([PAD, BOS, EOS, UNK])
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, self.bos_id)]
        )
        return tok

    def tokenizer(self) -> Tokenizer:
        """The task's tokenizer as a :class:`jrlhf.data.Tokenizer`."""
        config = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK}
        return Tokenizer(self.hf_tokenizer(), config)

    def save_tokenizer(self, directory: str | Path) -> Path:
        """Write tokenizer.json and tokenizer_config.json; returns the directory."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.hf_tokenizer().save(str(directory / "tokenizer.json"))
        (directory / "tokenizer_config.json").write_text(
            '{"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", '
            '"eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>"}\n'
        )
        return directory


class ArithmeticTask(WordLevelVocab):
    """Addition and subtraction of ``digits``-digit numbers (see the module docstring).

    Token ids: 0 ``<pad>``, 1 ``<bos>``, 2 ``<eos>``, 3 ``<unk>``, 4 ``=``, 5-14 the digits,
    15 ``+``, 16 ``-``, then ``<unused*>`` up to a multiple of 8 (24).
    """

    def __init__(
        self,
        seed: int = 0,
        *,
        digits: int = 2,
        ops: Sequence[str] = OPS,
        reverse: bool = True,
        demo_good_frac: float = 0.5,
        heldout_frac: float = 0.2,
    ):
        if not 1 <= digits <= 9:
            raise ValueError(f"digits {digits} must be in [1, 9]")
        if not ops or any(op not in OPS for op in ops):
            raise ValueError(f"ops {tuple(ops)} must be a non-empty subset of {OPS}")
        self.seed, self.digits, self.ops = int(seed), int(digits), tuple(ops)
        self.reverse = reverse
        self.demo_good_frac, self.heldout_frac = demo_good_frac, heldout_frac
        tokens = [PAD, BOS, EOS, UNK, SEP, *DIGITS, *OPS]
        tokens += [f"<unused{i}>" for i in range(-(-len(tokens) // 8) * 8 - len(tokens))]
        self.tokens: tuple[str, ...] = tuple(tokens)
        self.vocab_size = len(tokens)
        self.pad_id, self.bos_id, self.eos_id, self.unk_id, self.sep_id = 0, 1, 2, 3, 4
        self._id = {t: i for i, t in enumerate(tokens)}

    # -- sizes ------------------------------------------------------------------------------------
    @property
    def max_prompt_len(self) -> int:
        """``<bos>``, two operands, the operator and ``=``."""
        return 2 * self.digits + 3

    @property
    def max_response_len(self) -> int:
        """The longest answer (a carry adds a digit) and ``<eos>``."""
        return self.digits + 2

    def model_overrides(self) -> dict[str, Any]:
        """Fields for ``jrlhf.models.tiny_config(**task.model_overrides(), ...)``."""
        return dict(
            vocab_size=self.vocab_size,
            bos_token_id=self.bos_id,
            eos_token_id=self.eos_id,
            pad_token_id=self.pad_id,
        )

    # -- problems ---------------------------------------------------------------------------------
    def _number_ids(self, n: int, width: int | None = None) -> list[int]:
        text = str(n).zfill(width) if width else str(n)
        return [self._id[c] for c in (text[::-1] if self.reverse else text)]

    def _number(self, symbols: Sequence[str]) -> int:
        return int("".join(symbols[::-1] if self.reverse else symbols))

    def encode_problem(self, a: int, op: str, b: int) -> list[int]:
        """The prompt ids of ``a op b =``."""
        d = self.digits
        return [
            self.bos_id, *self._number_ids(a, d), self._id[op], *self._number_ids(b, d),
            self.sep_id,
        ]  # fmt: skip

    def decode_problem(self, prompt_ids: Sequence[int]) -> tuple[int, str, int]:
        """``(a, op, b)`` of a prompt (padding ignored)."""
        text = [self.tokens[int(t)] for t in prompt_ids if int(t) not in (self.pad_id, self.bos_id)]
        if not text or text[-1] != SEP:
            raise ValueError(f"not an arithmetic prompt: {' '.join(text)}")
        op = next(t for t in text if t in OPS)
        i = text.index(op)
        return self._number(text[:i]), op, self._number(text[i + 1 : -1])

    def answer(self, prompt_ids: Sequence[int]) -> list[int]:
        """The right answer's ids, ``<eos>`` included."""
        a, op, b = self.decode_problem(prompt_ids)
        return [*self._number_ids(a + b if op == "+" else a - b), self.eos_id]

    def split_of(self, prompt_ids: Sequence[int]) -> str:
        """``"heldout"`` or ``"train"``: a seed-independent hash of the ids decides."""
        h = zlib.crc32(np.asarray(prompt_ids, np.int32).tobytes())
        return "heldout" if h < self.heldout_frac * 2**32 else "train"

    def _stream(self, rng: np.random.Generator, split: str):
        if split not in ("train", "heldout"):
            # No prompt would ever match: the stream would never yield.
            raise ValueError(f"split {split!r} unknown (use 'train' or 'heldout')")
        top = 10**self.digits
        while True:
            op = self.ops[int(rng.integers(len(self.ops)))]
            a, b = int(rng.integers(top)), int(rng.integers(top))
            if op == "-" and a < b:
                a, b = b, a
            p = self.encode_problem(a, op, b)
            if self.split_of(p) == split:
                yield p

    def prompts(self, n: int, split: str = "train") -> list[list[int]]:
        """``n`` problems of a split (deterministic; ``prompts(n)`` prefixes ``prompts(n + k)``)."""
        stream = self._stream(np.random.default_rng([self.seed, _STREAM_PROMPTS]), split)
        return [next(stream) for _ in range(n)]

    def prompt_meta(self, prompts: Sequence[Sequence[int]]) -> list[dict[str, Any]]:
        """Each prompt's reference answer as ``meta["answer_ids"]`` (what answer_match reads)."""
        return [{ANSWER_IDS: self.answer(p)} for p in prompts]

    # -- responses --------------------------------------------------------------------------------
    def mistaken_answer(self, prompt_ids: Sequence[int], rng: np.random.Generator) -> list[int]:
        """A wrong answer: carries (borrows) ignored, or, where that is right, one digit off."""
        a, op, b = self.decode_problem(prompt_ids)
        da, db = str(a).zfill(self.digits), str(b).zfill(self.digits)
        pairs = zip(map(int, da), map(int, db), strict=True)
        digits = [(x + y) % 10 if op == "+" else abs(x - y) for x, y in pairs]
        wrong = [*self._number_ids(int("".join(map(str, digits)))), self.eos_id]
        if wrong == self.answer(prompt_ids):
            i = int(rng.integers(len(wrong) - 1))
            value = int(self.tokens[wrong[i]])
            wrong[i] = self._id[str((value + 1 + int(rng.integers(9))) % 10)]
        return wrong

    def sft_examples(self, n: int) -> list[SFTRecord]:
        """``n`` (train problem, demonstration) pairs, right with probability demo_good_frac."""
        rng = np.random.default_rng([self.seed, _STREAM_SFT])
        stream = self._stream(rng, "train")
        out = []
        for p in (next(stream) for _ in range(n)):
            good = rng.random() < self.demo_good_frac
            out.append(SFTRecord(p, self.answer(p) if good else self.mistaken_answer(p, rng)))
        return out

    def preference_pairs(self, n: int, split: str = "train") -> list[PreferenceRecord]:
        """``n`` (problem, right answer, mistaken answer) triples on problems of ``split``."""
        rng = np.random.default_rng([self.seed, _STREAM_PAIRS])
        stream = self._stream(rng, split)
        return [
            PreferenceRecord(p, self.answer(p), self.mistaken_answer(p, rng))
            for p in (next(stream) for _ in range(n))
        ]

    def score(self, prompt_ids: Sequence[int], response_ids: Sequence[int]) -> float:
        """1.0 when the response up to its first ``<eos>`` is the answer, else 0.0; an
        unterminated response is wrong."""
        r = [int(t) for t in response_ids]
        if self.eos_id not in r:
            return 0.0
        return float(r[: r.index(self.eos_id) + 1] == self.answer(prompt_ids))

    def _text(self, ids: Sequence[int]) -> str:
        return " ".join(self.tokens[int(i)] for i in ids if int(i) != self.bos_id)

    def write_jsonl(
        self, directory: str | Path, *, num_prompts: int = 1024, num_heldout: int = 128,
        num_sft: int = 1024, num_pairs: int = 1024,
    ) -> dict[str, Path]:  # fmt: skip
        """The task as files jrlhf.data reads: prompts and held-out prompts with an ``answer``
        field (the reference answer's text, ``<eos>`` spelled out), sft.jsonl, preferences.jsonl
        and the tokenizer."""
        directory = Path(directory)

        def prompt_rows(prompts):
            return [
                {"prompt": self._text(p), "answer": self._text(self.answer(p))} for p in prompts
            ]

        paths = {
            "prompts": write_jsonl(
                directory / "prompts.jsonl", prompt_rows(self.prompts(num_prompts))
            ),
            "heldout_prompts": write_jsonl(
                directory / "heldout_prompts.jsonl",
                prompt_rows(self.prompts(num_heldout, "heldout")),
            ),
            "sft": write_jsonl(
                directory / "sft.jsonl",
                [
                    {"prompt": self._text(r.prompt_ids), "response": self._text(r.response_ids)}
                    for r in self.sft_examples(num_sft)
                ],
            ),
            "preferences": write_jsonl(
                directory / "preferences.jsonl",
                [
                    {
                        "prompt": self._text(r.prompt_ids),
                        "chosen": self._text(r.chosen_ids),
                        "rejected": self._text(r.rejected_ids),
                    }
                    for r in self.preference_pairs(num_pairs)
                ],
            ),
        }
        paths["tokenizer"] = self.save_tokenizer(directory)
        return paths
