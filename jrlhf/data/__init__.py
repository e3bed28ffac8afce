"""Datasets of prompts, preference pairs and SFT examples, and the NumPy batching around them.

Files are JSON Lines (one JSON object per line) or Parquet (one row per example). A record gives
each sequence either as text, tokenized with a HF ``tokenizer.json`` through :class:`Tokenizer`,
or pre-tokenized as a list of ids:

=============  ===============================  =====================================
kind           text fields                      id fields
=============  ===============================  =====================================
prompts        ``prompt``                       ``prompt_ids``
preferences    ``prompt, chosen, rejected``     ``prompt_ids, chosen_ids, rejected_ids``
SFT            ``prompt, response|completion``  ``prompt_ids, response_ids|completion_ids``
=============  ===============================  =====================================

Every problem (empty line, invalid JSON, a missing or wrongly typed field, an empty sequence, an id
outside the vocabulary) raises ``ValueError("<file>:<line>: <what>")`` (Parquet: ``<file>: row
<i>: <what>``) while loading, so a bad file fails before any compilation or training starts.
Over-long sequences are truncated (prompts keep their last tokens, responses their first ones),
counted on the dataset and reported in one warning at the end of loading.

Text prompts are encoded with the tokenizer's special tokens (its post-processor usually adds
``<bos>``); text responses are encoded without them and get ``eos_id`` appended (``append_eos``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

import numpy as np

logger = logging.getLogger(__name__)

# Field names per role: (text field names, id field names), first match wins.
_PROMPT_FIELDS = (("prompt",), ("prompt_ids",))
_CHOSEN_FIELDS = (("chosen",), ("chosen_ids",))
_REJECTED_FIELDS = (("rejected",), ("rejected_ids",))
_RESPONSE_FIELDS = (("response", "completion"), ("response_ids", "completion_ids"))
_ALL_FIELDS = frozenset(
    name
    for group in (_PROMPT_FIELDS, _CHOSEN_FIELDS, _REJECTED_FIELDS, _RESPONSE_FIELDS)
    for names in group
    for name in names
)


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------
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
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(f"{file}: no tokenizer.json there")
        config_file = file.parent / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        return cls(HFTokenizer.from_file(str(file)), config)

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
        return self._tok.token_to_id(token)

    def id_to_token(self, idx: int) -> str | None:
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
        return self._special("bos")

    @property
    def eos_id(self) -> int | None:
        return self._special("eos")

    @property
    def pad_id(self) -> int | None:
        return self._special("pad")


# ---------------------------------------------------------------------------------------------
# Records and datasets
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class PromptRecord:
    """A prompt; ``meta`` holds the record's other fields (ids, answers for verifiable rewards)."""

    prompt_ids: list[int]
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class PreferenceRecord:
    """A prompt with a preferred (chosen) and a dispreferred (rejected) response."""

    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]


@dataclasses.dataclass(frozen=True)
class SFTRecord:
    """A prompt with its demonstration response."""

    prompt_ids: list[int]
    response_ids: list[int]


@dataclasses.dataclass
class Dataset:
    """Loaded records plus what loading did to them.

    ``num_truncated`` counts records with at least one truncated sequence;
    ``num_truncated_prompts`` / ``num_truncated_responses`` count sequences.
    """

    records: list[Any]
    source: str = ""
    num_truncated: int = 0
    num_truncated_prompts: int = 0
    num_truncated_responses: int = 0

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i):
        return self.records[i]

    def __iter__(self) -> Iterator[Any]:
        return iter(self.records)


class _Row:
    """Where a row came from, for error messages."""

    def __init__(self, source: str, index: int, parquet: bool):
        self.where = f"{source}: row {index}" if parquet else f"{source}:{index}"

    def error(self, what: str) -> ValueError:
        return ValueError(f"{self.where}: {what}")


class _Loader:
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

    def ids(self, row: dict, at: _Row, fields, *, is_prompt: bool) -> list[int]:
        text_names, id_names = fields
        for name in id_names:
            if name in row and row[name] is not None:
                return self._finish(self._check_ids(row[name], name, at), name, at, is_prompt)
        for name in text_names:
            if name in row and row[name] is not None:
                text = row[name]
                if not isinstance(text, str):
                    raise at.error(f"field {name!r} must be a string, got {type(text).__name__}")
                if self.tokenizer is None:
                    raise at.error(
                        f"field {name!r} is text but no tokenizer was given "
                        f"(pass tokenizer=... or use {id_names[0]!r})"
                    )
                if not text.strip():
                    raise at.error(f"field {name!r} is empty")
                ids = self.tokenizer.encode(text, add_special_tokens=is_prompt)
                eos = self.tokenizer.eos_id
                needs_eos = not is_prompt and self.append_eos and eos is not None
                if needs_eos and (not ids or ids[-1] != eos):
                    ids.append(eos)
                return self._finish(self._check_ids(ids, name, at), name, at, is_prompt)
        wanted = " or ".join(repr(n) for n in (*text_names, *id_names))
        raise at.error(f"missing field {wanted}")

    def _check_ids(self, ids: Any, name: str, at: _Row) -> list[int]:
        if isinstance(ids, np.ndarray):
            ids = ids.tolist()
        if not isinstance(ids, (list, tuple)):
            raise at.error(f"field {name!r} must be a list of ints, got {type(ids).__name__}")
        out = []
        for i, v in enumerate(ids):
            # bool is an int subclass; a true/false in an id list is a data bug, not an id.
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise at.error(f"field {name!r}[{i}] must be an int, got {v!r}")
            v = int(v)
            if v < 0 or (self.vocab_size is not None and v >= self.vocab_size):
                limit = f"[0, {self.vocab_size})" if self.vocab_size is not None else ">= 0"
                raise at.error(f"field {name!r}[{i}] = {v} is outside the vocabulary {limit}")
            out.append(v)
        if not out:
            raise at.error(f"field {name!r} is empty")
        return out

    def _finish(self, ids: list[int], name: str, at: _Row, is_prompt: bool) -> list[int]:
        del name, at
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

    def start_row(self):
        self._row_truncated = False

    def end_row(self):
        self.truncated_records += int(self._row_truncated)


def _iter_rows(path: Path) -> Iterator[tuple[dict, _Row]]:
    source = str(path)
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as e:  # pragma: no cover - pyarrow is a dependency of the venv
            raise ImportError(f"{source}: reading Parquet needs pyarrow ({e})") from None
        table = pq.read_table(path)
        for i, row in enumerate(table.to_pylist()):
            yield row, _Row(source, i, parquet=True)
        return
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            at = _Row(source, line_no, parquet=False)
            if not line.strip():
                raise at.error("empty line")
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise at.error(f"invalid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(row, dict):
                raise at.error(f"expected a JSON object, got {type(row).__name__}")
            yield row, at


def _load(path, kind: str, make, **loader_kwargs) -> Dataset:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    loader = _Loader(**loader_kwargs)
    records = []
    for row, at in _iter_rows(path):
        loader.start_row()
        records.append(make(loader, row, at))
        loader.end_row()
    if not records:
        raise ValueError(f"{path}: no records")
    ds = Dataset(
        records=records,
        source=str(path),
        num_truncated=loader.truncated_records,
        num_truncated_prompts=loader.truncated_prompts,
        num_truncated_responses=loader.truncated_responses,
    )
    if ds.num_truncated:
        logger.warning(
            "%s: truncated %d of %d %s records (%d prompts longer than %s, %d responses longer "
            "than %s)",
            path,
            ds.num_truncated,
            len(ds),
            kind,
            ds.num_truncated_prompts,
            loader.max_prompt_len,
            ds.num_truncated_responses,
            loader.max_response_len,
        )
    return ds


def load_prompts(
    path: str | Path,
    tokenizer: Tokenizer | None = None,
    *,
    max_prompt_len: int | None = None,
    vocab_size: int | None = None,
) -> Dataset:
    """A dataset of :class:`PromptRecord`; non-prompt fields of each row go into ``meta``."""

    def make(loader, row, at):
        ids = loader.ids(row, at, _PROMPT_FIELDS, is_prompt=True)
        meta = {k: v for k, v in row.items() if k not in _ALL_FIELDS}
        return PromptRecord(ids, meta)

    return _load(
        path,
        "prompt",
        make,
        tokenizer=tokenizer,
        vocab_size=vocab_size,
        max_prompt_len=max_prompt_len,
        max_response_len=None,
        append_eos=False,
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

    def make(loader, row, at):
        return PreferenceRecord(
            loader.ids(row, at, _PROMPT_FIELDS, is_prompt=True),
            loader.ids(row, at, _CHOSEN_FIELDS, is_prompt=False),
            loader.ids(row, at, _REJECTED_FIELDS, is_prompt=False),
        )

    return _load(
        path,
        "preference",
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

    def make(loader, row, at):
        return SFTRecord(
            loader.ids(row, at, _PROMPT_FIELDS, is_prompt=True),
            loader.ids(row, at, _RESPONSE_FIELDS, is_prompt=False),
        )

    return _load(
        path,
        "SFT",
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


# ---------------------------------------------------------------------------------------------
# Deterministic, resumable prompt order
# ---------------------------------------------------------------------------------------------
class PromptLoader:
    """Batches of a dataset in a seeded shuffled order, with an explicit checkpointable position.

    Epoch ``e`` visits the examples in ``permutation(seed, e)``; a batch never straddles two
    epochs (with ``drop_last`` the tail of an epoch that does not fill a batch is skipped, so every
    batch has exactly ``batch_size`` items and jitted shapes stay fixed). The position is
    ``state = {"epoch", "index", "seed"}`` where ``index`` is how many items of the current epoch's
    order have been consumed; ``load_state_dict(state)`` continues exactly where it left off.
    """

    def __init__(
        self,
        data: Sequence[Any],
        batch_size: int,
        seed: int = 0,
        *,
        shuffle: bool = True,
        drop_last: bool = True,
    ):
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if drop_last and len(data) < batch_size:
            raise ValueError(
                f"the dataset has {len(data)} examples, fewer than one batch of {batch_size}"
            )
        if not len(data):
            raise ValueError("the dataset is empty")
        self.data = data
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.seed = int(seed)
        self.epoch = 0
        self.index = 0
        self._order_epoch = -1
        self._order = np.arange(0)

    def _epoch_order(self) -> np.ndarray:
        if self._order_epoch != self.epoch:
            n = len(self.data)
            if self.shuffle:
                # Seeding with (seed, epoch) makes each epoch's order a pure function of the state.
                self._order = np.random.default_rng([self.seed, self.epoch]).permutation(n)
            else:
                self._order = np.arange(n)
            self._order_epoch = self.epoch
        return self._order

    def _epoch_end(self) -> int:
        n = len(self.data)
        return n - n % self.batch_size if self.drop_last else n

    def next_indices(self) -> np.ndarray:
        """Dataset indices of the next batch; advances the position."""
        if self.index >= self._epoch_end():
            self.epoch += 1
            self.index = 0
        order = self._epoch_order()
        idx = order[self.index : min(self.index + self.batch_size, self._epoch_end())]
        self.index += len(idx)
        return idx.copy()

    def next_batch(self) -> list[Any]:
        """The next batch of dataset items; advances the position."""
        return [self.data[int(i)] for i in self.next_indices()]

    def __iter__(self) -> Iterator[list[Any]]:
        """Endless batches (epochs roll over)."""
        while True:
            yield self.next_batch()

    @property
    def steps_per_epoch(self) -> int:
        return -(-self._epoch_end() // self.batch_size)

    def state_dict(self) -> dict[str, int]:
        """The position: ``{"epoch": int, "index": int, "seed": int}`` (JSON-serialisable)."""
        return {"epoch": int(self.epoch), "index": int(self.index), "seed": int(self.seed)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a position saved by :meth:`state_dict`."""
        missing = {"epoch", "index", "seed"} - set(state)
        if missing:
            raise ValueError(f"loader state lacks {sorted(missing)}: {state}")
        index = int(state["index"])
        if not 0 <= index <= len(self.data):
            raise ValueError(
                f"loader state index {index} is outside the dataset of {len(self.data)} examples"
            )
        self.epoch, self.index, self.seed = int(state["epoch"]), index, int(state["seed"])
        self._order_epoch = -1


# ---------------------------------------------------------------------------------------------
# Padding
# ---------------------------------------------------------------------------------------------
class PromptBatch(NamedTuple):
    """Left-padded prompts: ``[pad ... pad][prompt]`` per row, all rows ending at the last column.

    ``positions_bt`` count from 0 at the first real token (0 on padding); ``segment_ids_bt`` are 0
    on padding and 1 on tokens, which is what the model's attention mask uses.
    """

    tokens_bt: np.ndarray
    positions_bt: np.ndarray
    segment_ids_bt: np.ndarray
    lengths_b: np.ndarray


def left_pad_prompts(
    prompts: Sequence[Sequence[int]], length: int | None = None, pad_id: int = 0
) -> PromptBatch:
    """Left-pad prompts to ``length`` (default: the longest); longer prompts are an error."""
    lengths = np.array([len(p) for p in prompts], np.int32)
    if length is None:
        length = int(lengths.max()) if len(prompts) else 0
    if (lengths > length).any():
        i = int(np.argmax(lengths > length))
        raise ValueError(f"prompt {i} has {lengths[i]} tokens, more than the length {length}")
    b = len(prompts)
    tokens = np.full((b, length), pad_id, np.int32)
    positions = np.zeros((b, length), np.int32)
    segments = np.zeros((b, length), np.int32)
    for i, p in enumerate(prompts):
        n = len(p)
        if n:
            tokens[i, length - n :] = p
            positions[i, length - n :] = np.arange(n)
            segments[i, length - n :] = 1
    return PromptBatch(tokens, positions, segments, lengths)


class SequenceBatch(NamedTuple):
    """Prompt + response rows for training and scoring.

    Layout ``"aligned"`` (default), width ``prompt_len + response_len``::

        [left pad][prompt][response][right pad]
        |<----- prompt_len ----->|<-- response_len -->|

    every response starts at column ``prompt_len``, which is what generation after left-padded
    prompts produces. Layout ``"right"``, width ``prompt_len + response_len`` too::

        [prompt][response][right pad]

    which wastes no columns between prompt and response (SFT, reward-model training).

    - ``positions_bt``: 0 at the first prompt token, +1 per real token through the response; 0
      on padding. ``segment_ids_bt``: 1 on real tokens, 0 on padding.
    - ``targets_bt[:, t] = tokens_bt[:, t + 1]`` (next-token prediction; the last column is
      ``pad_id``), so ``logits_btv[:, t]`` is scored against ``targets_bt[:, t]``.
    - ``loss_mask_bt[:, t]`` = 1 where ``targets_bt[:, t]`` is a response token: the loss covers
      the response only (for SFT: never the prompt).
    - ``response_mask_bt[:, t]`` = 1 where ``tokens_bt[:, t]`` itself is a response token.
    - ``last_index_b``: column of each row's last real token (read a reward/value head there).
    """

    tokens_bt: np.ndarray
    positions_bt: np.ndarray
    segment_ids_bt: np.ndarray
    targets_bt: np.ndarray
    loss_mask_bt: np.ndarray
    response_mask_bt: np.ndarray
    prompt_lengths_b: np.ndarray
    response_lengths_b: np.ndarray
    last_index_b: np.ndarray


LAYOUTS = ("aligned", "right")


def make_sequence_batch(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    prompt_len: int | None = None,
    response_len: int | None = None,
    pad_id: int = 0,
    layout: str = "aligned",
) -> SequenceBatch:
    """Concatenate prompts and responses into one padded batch (see :class:`SequenceBatch`).

    ``prompt_len``/``response_len`` default to the longest in the batch; sequences longer than
    them are an error (truncate when loading). Responses may be empty.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} unknown (use one of {LAYOUTS})")
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    p_lens = np.array([len(p) for p in prompts], np.int32)
    r_lens = np.array([len(r) for r in responses], np.int32)
    if prompt_len is None:
        prompt_len = int(p_lens.max()) if len(prompts) else 0
    if response_len is None:
        response_len = int(r_lens.max()) if len(responses) else 0
    for name, lens, limit in (("prompt", p_lens, prompt_len), ("response", r_lens, response_len)):
        if (lens > limit).any():
            i = int(np.argmax(lens > limit))
            raise ValueError(f"{name} {i} has {lens[i]} tokens, more than {name}_len {limit}")
    if (p_lens == 0).any():
        raise ValueError(f"prompt {int(np.argmin(p_lens))} is empty")
    b, width = len(prompts), prompt_len + response_len
    tokens = np.full((b, width), pad_id, np.int32)
    positions = np.zeros((b, width), np.int32)
    segments = np.zeros((b, width), np.int32)
    response_mask = np.zeros((b, width), np.int32)
    last = np.zeros((b,), np.int32)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        n_p, n_r = len(p), len(r)
        start = prompt_len - n_p if layout == "aligned" else 0
        r_start = start + n_p
        tokens[i, start:r_start] = p
        tokens[i, r_start : r_start + n_r] = r
        positions[i, start : r_start + n_r] = np.arange(n_p + n_r)
        segments[i, start : r_start + n_r] = 1
        response_mask[i, r_start : r_start + n_r] = 1
        last[i] = r_start + n_r - 1
    targets = np.full_like(tokens, pad_id)
    targets[:, :-1] = tokens[:, 1:]
    loss_mask = np.zeros_like(response_mask)
    loss_mask[:, :-1] = response_mask[:, 1:]
    return SequenceBatch(
        tokens, positions, segments, targets, loss_mask, response_mask, p_lens, r_lens, last
    )


def make_sft_batch(
    records: Sequence[SFTRecord],
    prompt_len: int | None = None,
    response_len: int | None = None,
    pad_id: int = 0,
    layout: str = "right",
) -> SequenceBatch:
    """An SFT batch: the loss mask covers response tokens only."""
    return make_sequence_batch(
        [r.prompt_ids for r in records],
        [r.response_ids for r in records],
        prompt_len,
        response_len,
        pad_id,
        layout,
    )


def make_preference_batch(
    records: Sequence[PreferenceRecord],
    prompt_len: int | None = None,
    response_len: int | None = None,
    pad_id: int = 0,
    layout: str = "right",
) -> tuple[SequenceBatch, SequenceBatch]:
    """(chosen, rejected) batches of the same shape; row ``i`` of both is pair ``i``."""
    prompts = [r.prompt_ids for r in records]
    if response_len is None:
        response_len = max(max(len(r.chosen_ids), len(r.rejected_ids)) for r in records)
    if prompt_len is None:
        prompt_len = max(len(p) for p in prompts)
    chosen = make_sequence_batch(
        prompts, [r.chosen_ids for r in records], prompt_len, response_len, pad_id, layout
    )
    rejected = make_sequence_batch(
        prompts, [r.rejected_ids for r in records], prompt_len, response_len, pad_id, layout
    )
    return chosen, rejected
