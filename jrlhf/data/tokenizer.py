"""The tokenizer the data files and the generate CLI share: a HF ``tokenizer.json`` plus the
special-token ids that loading and generation need (bos, eos, pad)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

from tokenizers import Tokenizer as HFTokenizer

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


class Tokenizer:
    """A thin wrapper over a ``tokenizers.Tokenizer`` loaded from a HF ``tokenizer.json``.

    Special-token ids come from ``tokenizer_config.json`` next to the file when present (its
    ``bos_token``/``eos_token``/``pad_token`` entries, strings or ``{"content": ...}`` dicts), else
    from common token spellings found in the vocabulary.
    """

    _FALLBACKS: ClassVar[dict[str, tuple[str, ...]]] = {
        "bos": ("<bos>", "<s>", "<|begin_of_text|>", "<|startoftext|>"),
        "eos": ("<eos>", "</s>", "<|end_of_text|>", "<|endoftext|>", "<|eot_id|>", "<|im_end|>"),
        "pad": ("<pad>", "[PAD]", "<|pad|>", "<|finetune_right_pad_id|>"),
    }

    def __init__(self, tokenizer: Any, config: dict[str, Any] | None = None):
        self._tok = tokenizer
        self.config = dict(config or {})

    @classmethod
    def from_file(cls, path: str | Path) -> Tokenizer:
        """Load ``tokenizer.json`` (a file, or a directory holding it and tokenizer_config.json)."""
        path = Path(path)
        file = path / TOKENIZER_FILE if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(f"{file}: no {TOKENIZER_FILE} there")
        config_file = file.parent / TOKENIZER_CONFIG_FILE
        try:
            config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{config_file}: malformed tokenizer config ({e})") from None
        try:
            return cls(HFTokenizer.from_file(str(file)), config)
        except Exception as e:  # the tokenizers library raises its own exception type
            raise ValueError(f"{file}: malformed tokenizer ({str(e).splitlines()[0]})") from None

    @classmethod
    def from_dir_if_present(cls, directory: str | Path) -> Tokenizer | None:
        """The tokenizer of a model directory, or None when it has no ``tokenizer.json``."""
        return cls.from_file(directory) if (Path(directory) / TOKENIZER_FILE).is_file() else None

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` runs the post-processor (e.g. adds bos)."""
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """The id of ``token``, None if it is not in the vocabulary."""
        return self._tok.token_to_id(token)

    def id_to_token(self, idx: int) -> str | None:
        """The token spelled by ``idx``, None if out of range."""
        return self._tok.id_to_token(int(idx))

    def _special(self, kind: str) -> int | None:
        entry = self.config.get(f"{kind}_token")
        if isinstance(entry, dict):
            entry = entry.get("content")
        if isinstance(entry, str):
            idx = self._tok.token_to_id(entry)
            if idx is not None:
                return idx
        for token in self._FALLBACKS[kind]:
            idx = self._tok.token_to_id(token)
            if idx is not None:
                return idx
        return None

    @property
    def bos_id(self) -> int | None:
        """Beginning-of-sequence id, if the tokenizer has one."""
        return self._special("bos")

    @property
    def eos_id(self) -> int | None:
        """End-of-sequence id, if the tokenizer has one."""
        return self._special("eos")

    @property
    def pad_id(self) -> int | None:
        """Padding id, if the tokenizer has one."""
        return self._special("pad")
