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
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

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
# Fields that become a record's sequences; everything else of a prompt row is meta.
_SEQUENCE_NAMES = frozenset(n for f in (PROMPT, CHOSEN, REJECTED, RESPONSE) for n in f.names)


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
        ids = builder.ids(row, at, PROMPT, is_prompt=True)
        meta = {k: v for k, v in row.items() if k not in _SEQUENCE_NAMES}
        if _present(row, ANSWER):
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


def write_jsonl(path: str | Path, rows: Sequence[dict[str, Any]]) -> Path:
    """Write ``rows`` as JSON Lines (the format the loaders read); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path
