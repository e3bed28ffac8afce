"""A synthetic RLHF task whose true preference is known: "answer in the prompt's majority class".

Symbols are ``num_classes`` classes of ``class_size`` tokens each, spelled ``a0 a1 ... b0 ...``.
A prompt is ``<bos> x_1 ... x_n =`` with ``n`` in ``prompt_len`` content symbols in which one class
(the *target*) holds a strict majority over each other class. The ideal response is
``response_len`` (K) symbols of the target class followed by ``<eos>``.

Ground truth (:meth:`SyntheticTask.score`, in [0, 1])::

    r        = response up to its first <eos>            (tokens after <eos> are ignored)
    good     = number of target-class symbols among the first K tokens of r
    overflow = max(0, len(r) - K) + (1 if r had no <eos>)
    score    = clip((good - overflow_penalty * overflow) / K, 0, 1)

Why this shape: it is a per-token, prompt-dependent signal (a 2-layer model must read the prompt
to find the target class, and a reward model must learn both the prompt's class and the count),
yet dense enough for a tiny policy to improve within a few hundred RL steps on a CPU.

SFT demonstrations are deliberately mediocre: a fraction ``demo_good_frac`` are ideal, the rest
fill each of the K slots with the filler word ``um`` (prob ``demo_filler_prob``), a target symbol
(``demo_target_prob``) or a symbol of another class. Imitating that mixture gives an expected
score of ``demo_good_frac + (1 - demo_good_frac) * demo_target_prob`` (0.44 by default) when
sampling at temperature 1, and near 0 greedily (``um`` is the single likeliest token), while 1.0
is reachable: the headroom RL has to close. Preference pairs are two responses of random quality
for one prompt, ordered by the true score (optionally with Bradley-Terry label noise).

Train and held-out prompts are disjoint: a prompt belongs to the held-out split iff a CRC32 hash
of its ids falls into ``heldout_frac`` of the hash range, independent of the seed.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers, processors

from jrlhf.data import PreferenceRecord, SFTRecord, Tokenizer, write_jsonl

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SEP, FILLER = "=", "um"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
_SPLITS = ("train", "heldout")
# Salts for independent random streams drawn from one seed.
_STREAM_PROMPTS, _STREAM_SFT, _STREAM_PAIRS = 1, 2, 3


class SyntheticTask:
    """The majority-class task (see the module docstring); everything is a function of ``seed``.

    Token ids: 0 ``<pad>``, 1 ``<bos>``, 2 ``<eos>``, 3 ``<unk>``, 4 ``=``, 5 ``um``, then the
    class symbols, then ``<unused*>`` up to ``vocab_size`` (default: rounded up to a multiple of
    8, i.e. 32 for the default 4 x 6 symbols).
    """

    def __init__(
        self,
        seed: int = 0,
        *,
        num_classes: int = 4,
        class_size: int = 6,
        prompt_len: tuple[int, int] = (6, 8),
        response_len: int = 8,
        max_response_len: int = 12,
        vocab_size: int | None = None,
        demo_good_frac: float = 0.3,
        demo_filler_prob: float = 0.5,
        demo_target_prob: float = 0.2,
        overflow_penalty: float = 0.5,
        heldout_frac: float = 0.2,
        label_noise_beta: float | None = None,
    ):
        if num_classes < 2 or class_size < 1:
            raise ValueError("need at least 2 classes of at least 1 symbol")
        if num_classes > 26:
            raise ValueError("at most 26 classes (symbols are spelled a0, b0, ...)")
        lo, hi = prompt_len
        if not 3 <= lo <= hi:
            raise ValueError(f"prompt_len {prompt_len} must satisfy 3 <= lo <= hi")
        if max_response_len < response_len + 1:
            raise ValueError("max_response_len must leave room for response_len symbols + <eos>")
        if not 0.0 < heldout_frac < 1.0:
            raise ValueError(f"heldout_frac {heldout_frac} must be in (0, 1)")
        if demo_filler_prob + demo_target_prob > 1.0:
            raise ValueError("demo_filler_prob + demo_target_prob must be <= 1")
        self.seed = int(seed)
        self.num_classes = num_classes
        self.class_size = class_size
        self.prompt_len = (int(lo), int(hi))
        self.response_len = int(response_len)
        self.max_response_len = int(max_response_len)
        self.demo_good_frac = demo_good_frac
        self.demo_filler_prob = demo_filler_prob
        self.demo_target_prob = demo_target_prob
        self.overflow_penalty = overflow_penalty
        self.heldout_frac = heldout_frac
        self.label_noise_beta = label_noise_beta

        words = [f"{chr(ord('a') + c)}{j}" for c in range(num_classes) for j in range(class_size)]
        tokens = [*SPECIAL_TOKENS, SEP, FILLER, *words, *self._extra_tokens()]
        needed = len(tokens)
        if vocab_size is None:
            vocab_size = -(-needed // 8) * 8
        if vocab_size < needed:
            raise ValueError(f"vocab_size {vocab_size} < the {needed} tokens the task needs")
        tokens += [f"<unused{i}>" for i in range(vocab_size - needed)]
        self.tokens: tuple[str, ...] = tuple(tokens)
        self.vocab_size = vocab_size
        self.pad_id, self.bos_id, self.eos_id, self.unk_id = 0, 1, 2, 3
        self.sep_id, self.filler_id = 4, 5
        self.first_symbol_id = 6
        # class_of[id] = class index of a symbol, -1 for everything else.
        self._class_of = np.full(vocab_size, -1, np.int64)
        n_sym = num_classes * class_size
        self._class_of[6 : 6 + n_sym] = np.arange(n_sym) // class_size

    def _extra_tokens(self) -> tuple[str, ...]:
        """Tokens a variant of the task adds after the class symbols (none here)."""
        return ()

    # -- sizes ------------------------------------------------------------------------------------
    @property
    def max_prompt_len(self) -> int:
        """Longest prompt in tokens (``<bos>`` + symbols + ``=``)."""
        return self.prompt_len[1] + 2

    def model_overrides(self) -> dict[str, Any]:
        """Fields for ``jrlhf.models.tiny_config(**task.model_overrides(), ...)``."""
        return dict(
            vocab_size=self.vocab_size,
            bos_token_id=self.bos_id,
            eos_token_id=self.eos_id,
            pad_token_id=self.pad_id,
        )

    def class_symbols(self, c: int) -> np.ndarray:
        """Token ids of class ``c``."""
        start = self.first_symbol_id + c * self.class_size
        return np.arange(start, start + self.class_size)

    def class_of(self, token_id: int) -> int:
        """Class of a symbol id; -1 for specials, ``=``, ``um`` and unused ids."""
        t = int(token_id)
        return int(self._class_of[t]) if 0 <= t < self.vocab_size else -1

    # -- prompts ----------------------------------------------------------------------------------
    def target_class(self, prompt_ids: Sequence[int]) -> int:
        """The class with the most symbols in the prompt (ties: smallest index; none: -1)."""
        ids = np.asarray(prompt_ids, np.int64).reshape(-1)
        ids = ids[(ids >= 0) & (ids < self.vocab_size)]
        classes = self._class_of[ids]
        classes = classes[classes >= 0]
        if classes.size == 0:
            return -1
        return int(np.argmax(np.bincount(classes, minlength=self.num_classes)))

    def split_of(self, prompt_ids: Sequence[int]) -> str:
        """``"heldout"`` or ``"train"``: a seed-independent hash of the ids decides."""
        h = zlib.crc32(np.asarray(prompt_ids, np.int32).tobytes())
        return "heldout" if h < self.heldout_frac * 2**32 else "train"

    def _draw_prompt(self, rng: np.random.Generator) -> list[int]:
        lo, hi = self.prompt_len
        n = int(rng.integers(lo, hi + 1))
        target = int(rng.integers(self.num_classes))
        others = [c for c in range(self.num_classes) if c != target]
        # The target needs a strict majority over every other class; start from a count that
        # makes that possible and resample the rest until it holds.
        min_m = max(2, math.ceil(n / self.num_classes) + 1)
        m = int(rng.integers(min(min_m, n), min(min_m + 1, n) + 1))
        while True:
            rest = rng.choice(others, size=n - m)
            if n - m == 0 or np.bincount(rest, minlength=self.num_classes).max() < m:
                break
        classes = np.concatenate([np.full(m, target), rest]).astype(np.int64)
        rng.shuffle(classes)
        symbols = self.first_symbol_id + classes * self.class_size
        symbols = symbols + rng.integers(self.class_size, size=n)
        return [self.bos_id, *symbols.tolist(), self.sep_id]

    def _prompt_stream(self, rng: np.random.Generator, split: str):
        if split not in _SPLITS:
            raise ValueError(f"split {split!r} unknown (use one of {_SPLITS})")
        while True:
            p = self._draw_prompt(rng)
            if self.split_of(p) == split:
                yield p

    def prompts(self, n: int, split: str = "train") -> list[list[int]]:
        """``n`` prompts of a split (deterministic; ``prompts(n)`` prefixes ``prompts(n + k)``)."""
        stream = self._prompt_stream(np.random.default_rng([self.seed, _STREAM_PROMPTS]), split)
        return [next(stream) for _ in range(n)]

    def target_length(self, prompt_ids: Sequence[int]) -> int:
        """K, the number of target symbols the ideal response to ``prompt_ids`` has (here
        always ``response_len``; jrlhf.tasks.longtail reads it from the prompt)."""
        del prompt_ids
        return self.response_len

    # -- responses --------------------------------------------------------------------------------
    def ideal_response(self, prompt_ids: Sequence[int], rng=None) -> list[int]:
        """A response with score 1.0: K target symbols then ``<eos>``."""
        rng = rng if rng is not None else np.random.default_rng(0)
        target = max(self.target_class(prompt_ids), 0)
        return [
            *rng.choice(self.class_symbols(target), size=self.target_length(prompt_ids)).tolist(),
            self.eos_id,
        ]

    def _mixed_response(
        self, rng, focus: int, p_focus: float, p_filler: float, length: int, eos: bool = True
    ) -> list[int]:
        """``length`` tokens: a ``focus``-class symbol w.p. ``p_focus``, ``um`` w.p. ``p_filler``,
        else a symbol of another class; then ``<eos>`` unless ``eos=False``."""
        other_classes = [c for c in range(self.num_classes) if c != focus]
        out = []
        for x in rng.random(length):
            if x < p_focus:
                c = focus
            elif x < p_focus + p_filler:
                out.append(self.filler_id)
                continue
            else:
                c = int(rng.choice(other_classes))
            out.append(
                int(self.first_symbol_id + c * self.class_size + rng.integers(self.class_size))
            )
        return [*out, self.eos_id] if eos else out

    def demo_response(self, prompt_ids: Sequence[int], rng: np.random.Generator) -> list[int]:
        """One noisy SFT demonstration (ideal with prob ``demo_good_frac``)."""
        target = max(self.target_class(prompt_ids), 0)
        k = self.target_length(prompt_ids)
        if rng.random() < self.demo_good_frac:
            return self._mixed_response(rng, target, 1.0, 0.0, k)
        return self._mixed_response(rng, target, self.demo_target_prob, self.demo_filler_prob, k)

    def sft_examples(self, n: int) -> list[SFTRecord]:
        """``n`` (train prompt, noisy demonstration) pairs; responses end with ``<eos>``."""
        rng = np.random.default_rng([self.seed, _STREAM_SFT])
        stream = self._prompt_stream(rng, "train")
        return [SFTRecord(p, self.demo_response(p, rng)) for p in (next(stream) for _ in range(n))]

    def _random_quality_response(self, prompt_ids, rng) -> list[int]:
        target = max(self.target_class(prompt_ids), 0)
        # Half the responses concentrate on a wrong class: without these "confidently wrong"
        # answers a reward model can rank pairs by how uniform a response is, never reading the
        # prompt, and a policy trained on it learns to repeat one class whatever the prompt.
        focus = target
        if rng.random() < 0.5:
            focus = int(rng.choice([c for c in range(self.num_classes) if c != target]))
        q = float(rng.random())
        u = rng.random()
        k = self.target_length(prompt_ids)
        length, eos = k, True
        if u < 0.15:
            # Unterminated, as generation cut at max_response_len produces.
            length, eos = self.max_response_len, False
        elif u < 0.4:
            # Other lengths, so the reward model sees what over/under-length costs.
            length = self._other_length(k, rng)
        return self._mixed_response(rng, focus, q, (1.0 - q) / 2, length, eos)

    def _other_length(self, k: int, rng: np.random.Generator) -> int:
        """A length other than the ideal ``k`` for a preference response: from just under ``k``
        up to the longest."""
        return int(rng.integers(max(1, k - 3), self.max_response_len))

    def preference_pairs(self, n: int, split: str = "train") -> list[PreferenceRecord]:
        """``n`` (prompt, chosen, rejected) triples on prompts of ``split``, ranked by the true
        score.

        Pairs with equal scores are redrawn. With ``label_noise_beta`` set, the order is kept with
        probability ``sigmoid(beta * (score_hi - score_lo))`` (Bradley-Terry noise).
        """
        rng = np.random.default_rng([self.seed, _STREAM_PAIRS])
        stream = self._prompt_stream(rng, split)
        out = []
        while len(out) < n:
            p = next(stream)
            a = self._random_quality_response(p, rng)
            b = self._random_quality_response(p, rng)
            sa, sb = self.score(p, a), self.score(p, b)
            if sa == sb:
                continue
            hi, lo = (a, b) if sa > sb else (b, a)
            if self.label_noise_beta is not None:
                keep = 1.0 / (1.0 + math.exp(-self.label_noise_beta * abs(sa - sb)))
                if rng.random() >= keep:
                    hi, lo = lo, hi
            out.append(PreferenceRecord(p, hi, lo))
        return out

    # -- ground truth -----------------------------------------------------------------------------
    def score(self, prompt_ids: Sequence[int], response_ids: Sequence[int]) -> float:
        """The true score in [0, 1] (see the module docstring). Padding in either is harmless."""
        target = self.target_class(prompt_ids)
        r = [int(t) for t in response_ids]
        terminated = self.eos_id in r
        if terminated:
            r = r[: r.index(self.eos_id)]
        else:
            # Right padding of an unterminated response is not part of it.
            while r and r[-1] == self.pad_id:
                r.pop()
        if target < 0:
            return 0.0
        k = self.target_length(prompt_ids)
        good = sum(1 for t in r[:k] if self.class_of(t) == target)
        overflow = max(0, len(r) - k) + (0 if terminated else 1)
        return float(min(1.0, max(0.0, (good - self.overflow_penalty * overflow) / k)))

    def score_batch(self, prompts: Sequence[Sequence[int]], responses) -> np.ndarray:
        """``score`` per row, float32 (B,); rows may be lists or padded arrays."""
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        return np.array([self.score(p, r) for p, r in zip(prompts, responses)], np.float32)

    # -- text and files ---------------------------------------------------------------------------
    def hf_tokenizer(self):
        """The task's ``tokenizers.Tokenizer``: word-level over the symbols, ``<bos>`` prepended."""
        vocab = {t: i for i, t in enumerate(self.tokens)}
        tok = HFTokenizer(models.WordLevel(vocab, unk_token=UNK))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tok.add_special_tokens(list(SPECIAL_TOKENS))
        # HF convention: encoding with special tokens adds <bos>; task prompts start with it.
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, self.bos_id)]
        )
        return tok

    def tokenizer_config(self) -> dict[str, Any]:
        """Contents of tokenizer_config.json (transformers' PreTrainedTokenizerFast reads it)."""
        return {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS,
            "eos_token": EOS,
            "pad_token": PAD,
            "unk_token": UNK,
            "model_max_length": self.max_prompt_len + self.max_response_len,
            "padding_side": "left",
            "clean_up_tokenization_spaces": False,
        }

    def tokenizer(self) -> Tokenizer:
        """The task's tokenizer as a :class:`jrlhf.data.Tokenizer`."""
        return Tokenizer(self.hf_tokenizer(), self.tokenizer_config())

    def save_tokenizer(self, directory: str | Path) -> Path:
        """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json; returns dir."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.hf_tokenizer().save(str(directory / "tokenizer.json"))
        (directory / "tokenizer_config.json").write_text(
            json.dumps(self.tokenizer_config(), indent=2)
        )
        special = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK}
        (directory / "special_tokens_map.json").write_text(json.dumps(special, indent=2))
        return directory

    def _text(self, ids: Sequence[int]) -> str:
        # <bos> is left out because the tokenizer's post-processor adds it to prompts; <eos> is
        # spelled out because some preference responses are deliberately unterminated.
        return " ".join(self.tokens[i] for i in ids if i != self.bos_id)

    def write_jsonl(
        self,
        directory: str | Path,
        *,
        num_prompts: int = 512,
        num_heldout: int = 128,
        num_sft: int = 1024,
        num_pairs: int = 1024,
        fmt: str = "text",
    ) -> dict[str, Path]:
        """Write the task's data in the format :mod:`jrlhf.data` reads, plus its tokenizer.

        Files: prompts.jsonl, heldout_prompts.jsonl, sft.jsonl, preferences.jsonl and the
        tokenizer files. ``fmt="text"`` writes text fields (``prompt``, ``response``, ``chosen``,
        ``rejected``; responses spell out their ``<eos>``; load with the tokenizer and
        ``append_eos=False`` to keep unterminated responses as they are), ``fmt="ids"`` writes
        ``*_ids`` lists.
        """
        if fmt not in ("text", "ids"):
            raise ValueError(f"fmt {fmt!r} unknown (use 'text' or 'ids')")
        directory = Path(directory)

        def field(name: str, ids: Sequence[int]) -> dict[str, Any]:
            return {name: self._text(ids)} if fmt == "text" else {f"{name}_ids": list(ids)}

        def prompt_rows(prompts):
            return [{**field("prompt", p), "target_class": self.target_class(p)} for p in prompts]

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
                    {**field("prompt", r.prompt_ids), **field("response", r.response_ids)}
                    for r in self.sft_examples(num_sft)
                ],
            ),
            "preferences": write_jsonl(
                directory / "preferences.jsonl",
                [
                    {
                        **field("prompt", r.prompt_ids),
                        **field("chosen", r.chosen_ids),
                        **field("rejected", r.rejected_ids),
                    }
                    for r in self.preference_pairs(num_pairs)
                ],
            ),
        }
        paths["tokenizer"] = self.save_tokenizer(directory)
        return paths
