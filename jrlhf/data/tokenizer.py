"""The tokenizer the data files and the generate CLI share: a HF ``tokenizer.json`` plus the
special-token ids that loading and generation need (bos, eos, pad), the checkpoint's chat
template (jrlhf.data.chat) and its end ids."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

from tokenizers import Tokenizer as HFTokenizer

from jrlhf.data.chat import SPECIAL_TOKEN_NAMES, ChatTemplate, ChatTemplateError, template_source

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
GENERATION_CONFIG_FILE = "generation_config.json"
MODEL_CONFIG_FILE = "config.json"
# Files of a tokenizer directory that travel with it (run directories, HF exports).
TOKENIZER_FILES = (
    TOKENIZER_FILE,
    TOKENIZER_CONFIG_FILE,
    SPECIAL_TOKENS_MAP_FILE,
    CHAT_TEMPLATE_FILE,
    GENERATION_CONFIG_FILE,
)


def _read_json(path: Path, what: str) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        out = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: malformed {what} ({e})") from None
    if not isinstance(out, dict):
        raise ValueError(f"{path}: malformed {what} (expected a JSON object)")
    return out


def eos_ids_of(config: dict[str, Any], source: str) -> tuple[int, ...]:
    """``eos_token_id`` of a config.json / generation_config.json dict: an int, a list of ints
    or absent; anything else is a one-line error naming ``source``."""
    value = config.get("eos_token_id")
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in values):
        raise ValueError(f"{source}: eos_token_id must be an id or a list of ids, got {value!r}")
    return tuple(values)


def checkpoint_end_ids(directory: str | Path) -> tuple[int, ...]:
    """The end ids a checkpoint directory declares: ``generation_config.json``'s
    ``eos_token_id`` (an int or a list, e.g. Qwen's ``<|im_end|>`` and ``<|endoftext|>``)
    followed by config.json's, without repeats."""
    directory = Path(directory)
    out: list[int] = []
    for name, what in (
        (GENERATION_CONFIG_FILE, "generation config"),
        (MODEL_CONFIG_FILE, "config"),
    ):
        path = directory / name
        for i in eos_ids_of(_read_json(path, what), str(path)):
            if i not in out:
                out.append(i)
    return tuple(out)


class Tokenizer:
    """A thin wrapper over a ``tokenizers.Tokenizer`` loaded from a HF ``tokenizer.json``.

    Special-token ids come from ``tokenizer_config.json`` next to the file when present (its
    ``bos_token``/``eos_token``/``pad_token`` entries, strings or ``{"content": ...}`` dicts), else
    from common token spellings found in the vocabulary. ``chat_template`` is the checkpoint's
    template source (``chat_template.jinja`` or the config's entry; None without one), and
    ``end_ids`` the ids generation stops at: ``eos_id`` plus the checkpoint's own
    (:func:`checkpoint_end_ids`, given as ``checkpoint_eos_ids``).
    """

    _FALLBACKS: ClassVar[dict[str, tuple[str, ...]]] = {
        "bos": ("<bos>", "<s>", "<|begin_of_text|>", "<|startoftext|>"),
        "eos": ("<eos>", "</s>", "<|end_of_text|>", "<|endoftext|>", "<|eot_id|>", "<|im_end|>"),
        "pad": ("<pad>", "[PAD]", "<|pad|>", "<|finetune_right_pad_id|>"),
    }

    def __init__(
        self,
        tokenizer: Any,
        config: dict[str, Any] | None = None,
        *,
        chat_template: str | None = None,
        checkpoint_eos_ids: Sequence[int] = (),
        source: str = "tokenizer",
    ):
        self._tok = tokenizer
        self.config = dict(config or {})
        self.source = source
        if chat_template is None:
            chat_template = template_source(self.config, None)
        self._chat_source = chat_template
        self._chat: ChatTemplate | None = None
        self.checkpoint_eos_ids = tuple(int(i) for i in checkpoint_eos_ids)

    @classmethod
    def from_file(cls, path: str | Path) -> Tokenizer:
        """Load ``tokenizer.json`` (a file, or a directory holding it and tokenizer_config.json)."""
        path = Path(path)
        file = path / TOKENIZER_FILE if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(f"{file}: no {TOKENIZER_FILE} there")
        config = _read_json(file.parent / TOKENIZER_CONFIG_FILE, "tokenizer config")
        # special_tokens_map.json fills what the config leaves out (older checkpoints).
        specials = _read_json(file.parent / SPECIAL_TOKENS_MAP_FILE, "special tokens map")
        for name in SPECIAL_TOKEN_NAMES:
            if config.get(name) is None and specials.get(name) is not None:
                config[name] = specials[name]
        jinja_file = file.parent / CHAT_TEMPLATE_FILE
        jinja_text = jinja_file.read_text(encoding="utf-8") if jinja_file.is_file() else None
        end_ids = checkpoint_end_ids(file.parent)
        try:
            hf = HFTokenizer.from_file(str(file))
        except Exception as e:  # the tokenizers library raises its own exception type
            raise ValueError(f"{file}: malformed tokenizer ({str(e).splitlines()[0]})") from None
        tok = cls(
            hf,
            config,
            chat_template=template_source(config, jinja_text),
            checkpoint_eos_ids=end_ids,
            source=str(file.parent),
        )
        if tok._chat_source is not None:
            try:
                tok.chat_template  # noqa: B018 - compile now: a broken template fails at load
            except ChatTemplateError as e:
                raise ValueError(f"{file.parent}: {e}") from None
        return tok

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
    def special_tokens(self) -> dict[str, str]:
        """The named special tokens of the config (``bos_token``: ``"<s>"``, ...), the
        variables a chat template sees."""
        out = {}
        for name in SPECIAL_TOKEN_NAMES:
            entry = self.config.get(name)
            if isinstance(entry, dict):
                entry = entry.get("content")
            if isinstance(entry, str):
                out[name] = entry
        return out

    @property
    def chat_template(self) -> ChatTemplate | None:
        """The checkpoint's chat template, compiled (None without one)."""
        if self._chat is None and self._chat_source is not None:
            self._chat = ChatTemplate(self._chat_source, self.special_tokens)
        return self._chat

    def _template(self) -> ChatTemplate:
        if self.chat_template is None:
            raise ValueError(
                f"{self.source}: the tokenizer has no chat template (no chat_template.jinja or "
                "chat_template entry in tokenizer_config.json) to render messages with"
            )
        return self.chat_template

    def render_chat(self, messages: Sequence[dict], add_generation_prompt: bool = False) -> str:
        """``messages`` rendered with the chat template (transformers' ``apply_chat_template``
        with ``tokenize=False``)."""
        return self._template().render(messages, add_generation_prompt=add_generation_prompt)

    def apply_chat_template(
        self, messages: Sequence[dict], add_generation_prompt: bool = False
    ) -> list[int]:
        """Token ids of the rendered conversation, as transformers' ``apply_chat_template``
        gives them: the text encoded without the post-processor (the template writes any
        ``<bos>`` itself)."""
        return self.encode(self.render_chat(messages, add_generation_prompt))

    def encode_chat_with_mask(self, messages: Sequence[dict]) -> tuple[list[int], list[int]]:
        """(ids, mask): the rendered conversation's ids and 1 on each token of an assistant
        turn (any token overlapping one of :meth:`ChatTemplate.assistant_spans`), 0 elsewhere."""
        text, spans = self._template().assistant_spans(messages)
        enc = self._tok.encode(text, add_special_tokens=False)
        mask = []
        k = 0
        for start, end in enc.offsets:
            while k < len(spans) and start >= spans[k][1]:
                k += 1
            mask.append(int(k < len(spans) and end > spans[k][0]))
        return list(enc.ids), mask

    @property
    def end_ids(self) -> tuple[int, ...]:
        """Every id generation stops at: ``eos_id`` first, then the checkpoint's
        (generation_config.json / config.json ``eos_token_id``), without repeats."""
        out = [] if self.eos_id is None else [self.eos_id]
        out += [i for i in self.checkpoint_eos_ids if i not in out]
        return tuple(out)

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
