"""Reading JSON Lines and Parquet files of prompts, preference pairs and SFT examples.

A record gives each sequence either as text, tokenized with :class:`~jrlhf.data.Tokenizer`, or
pre-tokenized as a list of ids (when both are present, the ids win):

=============  ===============================  =====================================
kind           text fields                      id fields
=============  ===============================  =====================================
prompts        ``prompt``                       ``prompt_ids``
  (optional)   ``answer``                       ``answer_ids``
preferences    ``prompt, chosen, rejected``     ``prompt_ids, chosen_ids, rejected_ids``
SFT            ``prompt, response|completion``  ``prompt_ids, response_ids|completion_ids``
=============  ===============================  =====================================

A prompt record's other fields go into :attr:`PromptRecord.meta` for reward functions; its
optional reference answer is validated and tokenized like a response and lands in
``meta["answer_ids"]``.

Every problem (an empty line, malformed JSON, a missing or wrongly typed field, an empty sequence,
an id outside the vocabulary) raises ``ValueError("<file>:<line>: <what>")`` (Parquet: ``<file>:
row <i>: <what>``) while loading, so a bad file fails before any compilation or training starts.
Over-long sequences are truncated (prompts keep their last tokens, responses their first ones),
counted on the dataset and reported in one warning at the end of loading.

Text prompts are encoded with the tokenizer's special tokens (its post-processor usually adds
``<bos>``); text responses and answers are encoded without them and get ``eos_id`` appended
(``append_eos``); id lists are taken as they are.

Conversations (the layout of HF chat datasets) are rendered with the tokenizer's chat template
(jrlhf.data.chat) and tokenized as transformers' ``apply_chat_template`` does; a message is
``{"role": "system"|"user"|"assistant"|"tool"|..., "content": str}``:

=============  ==========================================================================
kind           conversation fields (ids, then conversations, then text win)
=============  ==========================================================================
prompts        ``messages`` (or ``prompt`` as a message list), rendered with the generation
               prompt; it must not end with an assistant turn
preferences    ``chosen`` and ``rejected`` message lists, either whole conversations that
               differ only in their final assistant turn, or completions of a shared
               ``prompt`` message list
SFT            ``messages`` (or ``prompt`` + ``completion`` message lists); the loss is on
               the assistant turns only (:attr:`SFTRecord.loss_mask`)
=============  ==========================================================================

A conversation's record ends where its template ends the last assistant turn (its end token,
e.g. ``<|im_end|>``): no ``eos_id`` is appended. A malformed conversation (a message without a
role, content that is not a string, a prompt ending with the assistant's turn, a template that
raises) is a one-line error naming the file and line like any other.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jrlhf.data.chat import check_messages
from jrlhf.data.records import (
    ANSWER_IDS,
    Dataset,
    PreferenceRecord,
    PromptRecord,
    SFTRecord,
)
from jrlhf.data.tokenizer import Tokenizer

try:  # Parquet support is the optional "parquet" extra; JSON Lines needs nothing.
    import pyarrow.parquet as pq
except ImportError:  # pragma: no cover - pyarrow is installed in the dev venv
    pq = None

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _Field:
    """One sequence of a record: what to call it in errors, its text and its id field names
    (first match wins)."""

    label: str
    text_names: tuple[str, ...]
    id_names: tuple[str, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return (*self.text_names, *self.id_names)


PROMPT = _Field("prompt", ("prompt",), ("prompt_ids",))
CHOSEN = _Field("chosen response", ("chosen",), ("chosen_ids",))
REJECTED = _Field("rejected response", ("rejected",), ("rejected_ids",))
RESPONSE = _Field("response", ("response", "completion"), ("response_ids", "completion_ids"))
ANSWER = _Field("answer", ("answer",), (ANSWER_IDS,))
MESSAGES = "messages"
# Fields that become a record's sequences; everything else of a prompt row is meta.
_SEQUENCE_NAMES = frozenset(
    [MESSAGES, *(n for f in (PROMPT, CHOSEN, REJECTED, RESPONSE) for n in f.names)]
)


def _is_conversation(value: Any) -> bool:
    """A list of message objects (as opposed to a text or an id list)."""
    return isinstance(value, (list, tuple)) and bool(value) and isinstance(value[0], dict)


class _Row:
    """Where a row came from, for error messages."""

    def __init__(self, source: str, index: int, parquet: bool):
        self.where = f"{source}: row {index}" if parquet else f"{source}:{index}"

    def error(self, what: str) -> ValueError:
        return ValueError(f"{self.where}: {what}")


def _present(row: dict, field: _Field) -> bool:
    return any(row.get(name) is not None for name in field.names)


class _RecordBuilder:
    """Turns raw rows into validated, truncated id lists; keeps the truncation counts."""

    def __init__(self, tokenizer, vocab_size, max_prompt_len, max_response_len, append_eos):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        if self.vocab_size is None and tokenizer is not None:
            self.vocab_size = tokenizer.vocab_size
        self.max_prompt_len = max_prompt_len
        self.max_response_len = max_response_len
        self.append_eos = append_eos
        self.truncated_prompts = 0
        self.truncated_responses = 0
        self.truncated_records = 0
        self._row_truncated = False

    def ids(self, row: dict, at: _Row, field: _Field, *, is_prompt: bool) -> list[int]:
        """The validated ids of ``field`` in ``row`` (tokenized if given as text)."""
        for name in field.id_names:
            if row.get(name) is not None:
                return self._truncate(self._check_ids(row[name], name, at), is_prompt)
        for name in field.text_names:
            if row.get(name) is not None:
                ids = self._encode(row[name], name, field, at, is_prompt)
                return self._truncate(self._check_ids(ids, name, at), is_prompt)
        wanted = " or ".join(repr(n) for n in field.names)
        has = ", ".join(repr(k) for k, v in row.items() if v is not None) or "no fields"
        raise at.error(f"expected an object with {wanted} (it has {has})")

    def _chat_tokenizer(self, at: _Row, name: str):
        if self.tokenizer is None:
            raise at.error(
                f"{name!r} is a conversation, which needs a tokenizer with a chat template "
                "(TaskConfig.tokenizer)"
            )
        if self.tokenizer.chat_template is None:
            raise at.error(
                f"{name!r} is a conversation, but the tokenizer ({self.tokenizer.source}) has no "
                "chat template"
            )
        return self.tokenizer

    def messages(self, value: Any, at: _Row, name: str, *, final: str | None) -> list[dict]:
        """``value`` validated as a conversation (jrlhf.data.chat.check_messages)."""
        try:
            return check_messages(value, final=final)
        except ValueError as e:
            raise at.error(f"{name!r}: {e}") from None

    def _render(self, at: _Row, name: str, fn, *args):
        try:
            return fn(*args)
        except ValueError as e:  # the template raised, or cannot split the conversation
            raise at.error(f"{name!r}: {str(e).splitlines()[0]}") from None

    def prompt_from_messages(self, messages: list[dict], at: _Row, name: str) -> list[int]:
        """The conversation rendered with the generation prompt: a prompt's ids."""
        tok = self._chat_tokenizer(at, name)
        ids = self._render(at, name, tok.apply_chat_template, messages, True)
        return self._truncate(self._check_ids(ids, name, at), is_prompt=True)

    def split_conversation(
        self, messages: list[dict], at: _Row, name: str
    ) -> tuple[list[int], list[int], list[int]]:
        """(prompt ids, response ids, loss mask): the conversation's tokens up to its first
        assistant turn, the rest through its last one, and 1 on the assistant turns' tokens."""
        tok = self._chat_tokenizer(at, name)
        ids, mask = self._render(at, name, tok.encode_chat_with_mask, messages)
        ids = self._check_ids(ids, name, at)
        trained = [i for i, m in enumerate(mask) if m]
        if not trained:
            raise at.error(f"{name!r}: the template rendered no assistant tokens")
        first, last = trained[0], trained[-1] + 1
        if first == 0:
            raise at.error(
                f"{name!r}: the conversation has no prompt before its first assistant turn"
            )
        prompt = self._truncate(ids[:first], is_prompt=True)
        response = self._truncate(ids[first:last], is_prompt=False)
        return prompt, response, mask[first:last][: len(response)]

    def completion(
        self, prompt_ids: list[int], messages: list[dict], at: _Row, name: str
    ) -> list[int]:
        """The ids a conversation adds to ``prompt_ids`` (its prompt rendered with the
        generation prompt), through its last assistant turn."""
        tok = self._chat_tokenizer(at, name)
        ids, mask = self._render(at, name, tok.encode_chat_with_mask, messages)
        n = len(prompt_ids)
        trained = [i for i, m in enumerate(mask) if m]
        if ids[:n] != prompt_ids or not trained or trained[-1] < n:
            raise at.error(
                f"{name!r}: the conversation does not tokenize as its prompt followed by the "
                "assistant's answer"
            )
        return self._truncate(self._check_ids(ids[n : trained[-1] + 1], name, at), False)

    def _encode(self, text: Any, name: str, field: _Field, at: _Row, is_prompt: bool) -> list:
        if not isinstance(text, str):
            raise at.error(f"{name!r} must be a string, got {type(text).__name__}")
        if self.tokenizer is None:
            raise at.error(
                f"text {field.label} but no tokenizer to encode it (use {field.id_names[0]!r})"
            )
        if not text.strip():
            raise at.error(f"{name!r} must be non-empty text")
        ids = self.tokenizer.encode(text, add_special_tokens=is_prompt)
        eos = self.tokenizer.eos_id
        if not is_prompt and self.append_eos and eos is not None and (not ids or ids[-1] != eos):
            ids.append(eos)
        return ids

    def _check_ids(self, ids: Any, name: str, at: _Row) -> list[int]:
        if isinstance(ids, np.ndarray):
            ids = ids.tolist()
        if not isinstance(ids, (list, tuple)):
            raise at.error(f"{name!r} must be a list of ints, got {type(ids).__name__}")
        out = []
        for i, v in enumerate(ids):
            # bool is an int subclass; a true/false in an id list is a data bug, not an id.
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise at.error(f"{name!r}[{i}] must be an int, got {v!r}")
            v = int(v)
            if v < 0 or (self.vocab_size is not None and v >= self.vocab_size):
                limit = f"[0, {self.vocab_size})" if self.vocab_size is not None else ">= 0"
                raise at.error(f"{name!r}[{i}] = {v} is outside the vocabulary {limit}")
            out.append(v)
        if not out:
            raise at.error(f"{name!r} must be a non-empty list of ints")
        return out

    def _truncate(self, ids: list[int], is_prompt: bool) -> list[int]:
        limit = self.max_prompt_len if is_prompt else self.max_response_len
        if limit is not None and len(ids) > limit:
            self._row_truncated = True
            if is_prompt:
                # The end of a prompt is what the response continues from: keep it.
                self.truncated_prompts += 1
                return ids[-limit:]
            self.truncated_responses += 1
            return ids[:limit]
        return ids

    def start_row(self) -> None:
        self._row_truncated = False

    def end_row(self) -> None:
        self.truncated_records += int(self._row_truncated)


def _iter_rows(path: Path, skip_blank_lines: bool) -> Iterator[tuple[dict, _Row]]:
    source = str(path)
    if path.suffix == ".parquet":
        if pq is None:
            raise ImportError(
                f"{source}: reading Parquet needs pyarrow (pip install jrlhf[parquet])"
            )
        for i, row in enumerate(pq.read_table(path).to_pylist()):
            yield row, _Row(source, i, parquet=True)
        return
    with open(path, "rb") as f:  # bytes: a line that is not UTF-8 is reported with its number
        for line_no, raw in enumerate(f, start=1):
            at = _Row(source, line_no, parquet=False)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise at.error(
                    f"not UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1})"
                ) from None
            if not line.strip():
                if skip_blank_lines:
                    continue
                raise at.error("empty line")
            # Without its line ending: JSON skips it as whitespace, so an error at the end of
            # the line fell on the line after it, and was reported as column 1.
            text = line.rstrip("\r\n")
            try:
                row = json.loads(text)
            except json.JSONDecodeError as e:
                where = "the end of the line" if e.pos >= len(text) else f"column {e.colno}"
                raise at.error(f"malformed JSON ({e.msg} at {where})") from None
            if not isinstance(row, dict):
                raise at.error(f"expected a JSON object, got {type(row).__name__}")
            yield row, at


def _load(
    path: str | Path,
    kind: str,
    make: Callable[[_RecordBuilder, dict, _Row], Any],
    *,
    skip_blank_lines: bool = False,
    **builder_kwargs,
) -> Dataset:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: {kind} file not found")
    builder = _RecordBuilder(**builder_kwargs)
    records = []
    for row, at in _iter_rows(path, skip_blank_lines):
        builder.start_row()
        records.append(make(builder, row, at))
        builder.end_row()
    if not records:
        raise ValueError(f"{path}: no records")
    ds = Dataset(
        records=records,
        source=str(path),
        num_truncated=builder.truncated_records,
        num_truncated_prompts=builder.truncated_prompts,
        num_truncated_responses=builder.truncated_responses,
    )
    if ds.num_truncated:
        # Only the kinds that were cut: a prompt file has no responses (and no response limit).
        parts = [
            f"{count} {kind} longer than {limit}"
            for count, kind, limit in (
                (ds.num_truncated_prompts, "prompts", builder.max_prompt_len),
                (ds.num_truncated_responses, "responses", builder.max_response_len),
            )
            if count
        ]
        logger.warning(
            "%s: truncated %d of %d records (%s)", path, ds.num_truncated, len(ds), ", ".join(parts)
        )
    return ds


def load_prompts(
    path: str | Path,
    tokenizer: Tokenizer | None = None,
    *,
    max_prompt_len: int | None = None,
    vocab_size: int | None = None,
    append_eos: bool = True,
    skip_blank_lines: bool = False,
) -> Dataset:
    """A dataset of :class:`PromptRecord`; non-prompt fields of each row go into ``meta``.

    An ``answer`` (text) or ``answer_ids`` field is validated like a response (``append_eos``
    applies to a text answer; answers are never truncated) and its ids are stored as
    ``meta["answer_ids"]``. ``skip_blank_lines`` tolerates blank lines (hand-written files, the
    generate CLI); otherwise a blank line is an error, as it usually means a broken writer.
    """

    def make(builder: _RecordBuilder, row: dict, at: _Row) -> PromptRecord:
        conversation = _prompt_conversation(row)
        if conversation is not None and row.get("prompt_ids") is None:
            name, value = conversation
            messages = builder.messages(value, at, name, final="prompt")
            ids = builder.prompt_from_messages(messages, at, name)
        else:
            ids = builder.ids(row, at, PROMPT, is_prompt=True)
        meta = {k: v for k, v in row.items() if k not in _SEQUENCE_NAMES}
        if _present(row, ANSWER):
            answer = row.get("answer")
            if isinstance(answer, (int, float)) and not isinstance(answer, bool):
                row = {**row, "answer": str(answer)}  # a number: tokenized as its text
            meta[ANSWER_IDS] = builder.ids(row, at, ANSWER, is_prompt=False)
        return PromptRecord(ids, meta)

    return _load(
        path,
        "prompts",
        make,
        skip_blank_lines=skip_blank_lines,
        tokenizer=tokenizer,
        vocab_size=vocab_size,
        max_prompt_len=max_prompt_len,
        max_response_len=None,
        append_eos=append_eos,
    )


def load_preferences(
    path: str | Path,
    tokenizer: Tokenizer | None = None,
    *,
    max_prompt_len: int | None = None,
    max_response_len: int | None = None,
    vocab_size: int | None = None,
    append_eos: bool = True,
) -> Dataset:
    """A dataset of :class:`PreferenceRecord`."""

    def make(builder: _RecordBuilder, row: dict, at: _Row) -> PreferenceRecord:
        if _is_conversation(row.get("chosen")) or _is_conversation(row.get("rejected")):
            return _conversation_pair(builder, row, at)
        return PreferenceRecord(
            builder.ids(row, at, PROMPT, is_prompt=True),
            builder.ids(row, at, CHOSEN, is_prompt=False),
            builder.ids(row, at, REJECTED, is_prompt=False),
        )

    return _load(
        path,
        "preferences",
        make,
        tokenizer=tokenizer,
        vocab_size=vocab_size,
        max_prompt_len=max_prompt_len,
        max_response_len=max_response_len,
        append_eos=append_eos,
    )


def load_sft(
    path: str | Path,
    tokenizer: Tokenizer | None = None,
    *,
    max_prompt_len: int | None = None,
    max_response_len: int | None = None,
    vocab_size: int | None = None,
    append_eos: bool = True,
) -> Dataset:
    """A dataset of :class:`SFTRecord` (response field ``response`` or ``completion``)."""

    def make(builder: _RecordBuilder, row: dict, at: _Row) -> SFTRecord:
        if row.get(MESSAGES) is not None or _is_conversation(row.get("prompt")):
            if row.get(MESSAGES) is not None:
                name, value = MESSAGES, row[MESSAGES]
            else:  # TRL's conversational prompt-completion form
                completion = row.get("completion")
                if not _is_conversation(completion):
                    raise at.error("a 'prompt' message list needs a 'completion' message list")
                name, value = "prompt+completion", [*row["prompt"], *completion]
            messages = builder.messages(value, at, name, final="assistant")
            return SFTRecord(*builder.split_conversation(messages, at, name))
        return SFTRecord(
            builder.ids(row, at, PROMPT, is_prompt=True),
            builder.ids(row, at, RESPONSE, is_prompt=False),
        )

    return _load(
        path,
        "SFT data",
        make,
        tokenizer=tokenizer,
        vocab_size=vocab_size,
        max_prompt_len=max_prompt_len,
        max_response_len=max_response_len,
        append_eos=append_eos,
    )


def _prompt_conversation(row: dict) -> tuple[str, Any] | None:
    """(field, value) of a prompt row's conversation: ``messages``, or ``prompt`` given as a
    message list (verl's and TRL's layout); None for a text or id prompt."""
    if row.get(MESSAGES) is not None:
        return MESSAGES, row[MESSAGES]
    if isinstance(row.get("prompt"), (list, tuple)) and not _is_ids(row["prompt"]):
        return "prompt", row["prompt"]
    return None


def _is_ids(value: Any) -> bool:
    return all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in value)


def _conversation_pair(builder: _RecordBuilder, row: dict, at: _Row) -> PreferenceRecord:
    """A preference pair of two conversations: with a shared ``prompt`` message list, ``chosen``
    and ``rejected`` are its completions; without one, they are whole conversations that share
    every message but their final assistant turn (that shared part is the prompt)."""
    for name in ("chosen", "rejected"):
        if not _is_conversation(row.get(name)):
            raise at.error(f"{name!r} must be a message list like the other answer")
    if row.get("prompt") is not None:
        prompt = builder.messages(row["prompt"], at, "prompt", final="prompt")
        chosen = builder.messages(row["chosen"], at, "chosen", final="assistant")
        rejected = builder.messages(row["rejected"], at, "rejected", final="assistant")
        chosen, rejected = [*prompt, *chosen], [*prompt, *rejected]
    else:
        chosen = builder.messages(row["chosen"], at, "chosen", final="assistant")
        rejected = builder.messages(row["rejected"], at, "rejected", final="assistant")
        prompt = chosen[:-1]
        if not prompt or rejected[:-1] != prompt:
            raise at.error(
                "'chosen' and 'rejected' must share every message but their final assistant "
                "turn (or give the shared turns as a 'prompt' message list)"
            )
    builder.messages(prompt, at, "prompt", final="prompt")
    prompt_ids = builder.prompt_from_messages(prompt, at, "prompt")
    # Completions continue the untruncated prompt: compare against it before truncation.
    full_prompt = builder.tokenizer.apply_chat_template(prompt, True)
    return PreferenceRecord(
        prompt_ids,
        builder.completion(full_prompt, chosen, at, "chosen"),
        builder.completion(full_prompt, rejected, at, "rejected"),
    )


def write_jsonl(path: str | Path, rows: Sequence[dict[str, Any]]) -> Path:
    """Write ``rows`` as JSON Lines (the format the loaders read); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path
