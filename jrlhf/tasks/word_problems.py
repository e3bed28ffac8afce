"""GSM8K-shaped word problems in chat form, and a small instruct-style checkpoint to learn them:
the files behind configs/gsm8k_grpo_tiny.gin, the CPU twin of configs/gsm8k_grpo.gin.

``python -m jrlhf.tasks.word_problems --out DIR`` writes, with no download:

* ``DIR/model``: a small random Qwen3 checkpoint as a HF directory (config.json, safetensors), with
  a byte-level BPE tokenizer trained on the problems (digits split one per token, as Qwen's and
  Llama 3's are), a ChatML ``chat_template`` in tokenizer_config.json, and generation_config.json
  ending generation at ``<|im_end|>`` or ``<|endoftext|>``;
* ``DIR/data``: ``train.jsonl`` and ``heldout.jsonl`` (prompts: ``messages`` with a system and a
  user turn, ``answer`` the GSM8K-style solution ending in ``#### N``), ``sft.jsonl``
  (conversations whose assistant turn is a demonstration).

A problem is one addition or subtraction of numbers below ``max_operand`` (10 by default:
one-digit facts, which a small model learns in the minutes a CPU allows) in one of a few
sentences. Demonstrations are right with probability ``demo_good_frac``; the others add or
subtract digit by digit without carries or borrows, so SFT leaves headroom that a verifier
reward can close (the built-in arithmetic task does the same with bare digits). Train and held-out
problems are disjoint: a CRC32 of the question decides the split.
"""

from __future__ import annotations

import argparse
import json
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

SYSTEM = "Solve the problem. End with the answer after ####."
END_OF_TEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
# A ChatML template in the style of Qwen's (without its default system prompt and tool calls).
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
NAMES = ("Ann", "Ben", "Cleo", "Dev", "Eva", "Finn", "Gus", "Hana", "Ivo", "Jun")
ITEMS = ("apples", "books", "coins", "cards", "eggs", "pens", "shells", "stamps")
# (sentence, operator): {n} a name, {x} an item, {a} and {b} the operands.
SENTENCES = (
    ("{n} has {a} {x}. {n} buys {b} more. How many {x} does {n} have now?", "+"),
    ("A box holds {a} {x} and another holds {b}. How many {x} are there in all?", "+"),
    ("{n} has {a} {x} and gives {b} away. How many {x} are left?", "-"),
    ("{n} had {a} {x}. After losing some, {n} has {b}. How many {x} were lost?", "-"),
)
_STREAM_PROMPTS, _STREAM_SFT = 21, 22


class WordProblems:
    """One-step addition and subtraction word problems (see the module docstring)."""

    def __init__(
        self,
        seed: int = 0,
        *,
        max_operand: int = 10,
        demo_good_frac: float = 0.5,
        heldout_frac: float = 0.2,
    ):
        if not 2 <= max_operand <= 10**6:
            raise ValueError(f"max_operand {max_operand} must be in [2, 1000000]")
        if not 0.0 <= demo_good_frac <= 1.0:
            raise ValueError(f"demo_good_frac {demo_good_frac} must be in [0, 1]")
        self.seed, self.max_operand = int(seed), int(max_operand)
        self.demo_good_frac, self.heldout_frac = demo_good_frac, heldout_frac

    def split_of(self, question: str) -> str:
        """``"heldout"`` or ``"train"``: a seed-independent hash of the question decides."""
        return "heldout" if zlib.crc32(question.encode()) < self.heldout_frac * 2**32 else "train"

    def _stream(self, rng: np.random.Generator, split: str) -> Iterator[dict[str, Any]]:
        if split not in ("train", "heldout"):
            raise ValueError(f"split {split!r} unknown (use 'train' or 'heldout')")
        while True:
            sentence, op = SENTENCES[int(rng.integers(len(SENTENCES)))]
            a, b = (int(v) for v in rng.integers(1, self.max_operand, size=2))
            if op == "-" and a < b:
                a, b = b, a
            n, x = NAMES[int(rng.integers(len(NAMES)))], ITEMS[int(rng.integers(len(ITEMS)))]
            question = sentence.format(n=n, x=x, a=a, b=b)
            if self.split_of(question) == split:
                yield dict(question=question, a=a, op=op, b=b)

    @staticmethod
    def solution(a: int, op: str, b: int, result: int) -> str:
        """A GSM8K-style solution: the working, then ``#### result``."""
        return f"{a} {op} {b} = {result}\n#### {result}"

    @staticmethod
    def mistaken(a: int, op: str, b: int) -> int:
        """The result digit by digit without carries or borrows (``|x - y|`` per digit)."""
        width = max(len(str(a)), len(str(b)))
        da, db = str(a).zfill(width), str(b).zfill(width)
        pairs = zip(map(int, da), map(int, db), strict=True)
        return int("".join(str((x + y) % 10 if op == "+" else abs(x - y)) for x, y in pairs))

    @staticmethod
    def messages(question: str) -> list[dict[str, str]]:
        """The prompt's conversation: the system instruction and the question."""
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]

    def prompts(self, n: int, split: str = "train") -> list[dict[str, Any]]:
        """``n`` prompt records of ``split``: ``messages`` and the reference ``answer``."""
        stream = self._stream(np.random.default_rng([self.seed, _STREAM_PROMPTS]), split)
        out = []
        for p in (next(stream) for _ in range(n)):
            right = p["a"] + p["b"] if p["op"] == "+" else p["a"] - p["b"]
            answer = self.solution(p["a"], p["op"], p["b"], right)
            out.append({"messages": self.messages(p["question"]), "answer": answer})
        return out

    def sft_conversations(self, n: int) -> list[dict[str, Any]]:
        """``n`` train conversations whose assistant turn is right with probability
        ``demo_good_frac``, else carries and borrows ignored."""
        rng = np.random.default_rng([self.seed, _STREAM_SFT])
        stream = self._stream(rng, "train")
        out = []
        for p in (next(stream) for _ in range(n)):
            a, op, b = p["a"], p["op"], p["b"]
            right = a + b if op == "+" else a - b
            result = right if rng.random() < self.demo_good_frac else self.mistaken(a, op, b)
            reply = {"role": "assistant", "content": self.solution(a, op, b, result)}
            out.append({"messages": [*self.messages(p["question"]), reply]})
        return out

    def corpus(self, n: int = 2000) -> list[str]:
        """Text to train the tokenizer on: questions and solutions of both splits."""
        texts = [SYSTEM, *(f"{role}\n" for role in ("system", "user", "assistant"))]
        for split in ("train", "heldout"):
            for record in self.prompts(n // 2, split):
                texts += [record["messages"][1]["content"], record["answer"]]
        return texts


def train_tokenizer(texts: Sequence[str], vocab_size: int = 384) -> HFTokenizer:
    """A byte-level BPE over ``texts`` with digits split one per token and the ChatML specials
    (``<|endoftext|>`` 0, ``<|im_start|>`` 1, ``<|im_end|>`` 2)."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(False, False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def write_jsonl(path: Path, records: Sequence[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def write_checkpoint(out_dir: Path, tokenizer: HFTokenizer, seed: int = 0, **model: Any) -> Path:
    """A random Qwen3 checkpoint sized by ``model`` (``tiny_config`` fields) with ``tokenizer``,
    the ChatML template and both end ids, as a HF directory."""
    import jax  # noqa: PLC0415 - the data-only uses of this module need no JAX

    from jrlhf.models import ModelDef, tiny_config  # noqa: PLC0415
    from jrlhf.models.hf import save_hf  # noqa: PLC0415

    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    end_ids = [tokenizer.token_to_id(IM_END), tokenizer.token_to_id(END_OF_TEXT)]
    fields = dict(
        architecture="qwen3",
        qk_norm=True,
        vocab_size=-(-vocab // 64) * 64,
        head_dim=16,
        tie_word_embeddings=True,
        rope_theta=1e6,
        eos_token_id=tuple(end_ids),
        pad_token_id=end_ids[1],
    )
    fields.update(model)
    model_def = ModelDef(tiny_config(**fields), "lm")
    save_hf(model_def, model_def.init(jax.random.key(seed)), out_dir)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": END_OF_TEXT,
        "chat_template": CHATML_TEMPLATE,
        "model_max_length": fields.get("max_position_embeddings", 512),
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    generation = {"eos_token_id": end_ids, "pad_token_id": end_ids[1]}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return out_dir


def write_recipe_files(
    out: str | Path,
    *,
    seed: int = 0,
    num_train: int = 4096,
    num_heldout: int = 256,
    num_sft: int = 8192,
    max_operand: int = 10,
    **model: Any,
) -> Path:
    """The checkpoint and data files of the GSM8K-shaped recipe under ``out`` (see the module
    docstring); ``model`` overrides the checkpoint's shape."""
    out = Path(out)
    task = WordProblems(seed, max_operand=max_operand)
    write_checkpoint(out / "model", train_tokenizer(task.corpus()), seed, **model)
    write_jsonl(out / "data" / "train.jsonl", task.prompts(num_train, "train"))
    write_jsonl(out / "data" / "heldout.jsonl", task.prompts(num_heldout, "heldout"))
    write_jsonl(out / "data" / "sft.jsonl", task.sft_conversations(num_sft))
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory to write model/ and data/ into")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-train", type=int, default=4096)
    parser.add_argument("--num-heldout", type=int, default=256)
    parser.add_argument("--num-sft", type=int, default=8192)
    parser.add_argument("--max-operand", type=int, default=10, help="operands are below this")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if (out / "model").exists() and any((out / "model").iterdir()):
        raise SystemExit(f"{out / 'model'}: exists and is not empty; choose another --out")
    write_recipe_files(
        out,
        seed=args.seed,
        num_train=args.num_train,
        num_heldout=args.num_heldout,
        num_sft=args.num_sft,
        max_operand=args.max_operand,
    )
    print(f"wrote {out / 'model'} and {out / 'data'}")


if __name__ == "__main__":
    main()
