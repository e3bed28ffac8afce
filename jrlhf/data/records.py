"""What a data file holds once loaded: one record type per kind of file, and the Dataset around
them (records plus what loading did to them)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

# The meta key under which a prompt record's reference answer arrives as token ids (see
# jrlhf.data.datasets.load_prompts); reward functions read it from there.
ANSWER_IDS = "answer_ids"


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
    """A prompt with its demonstration response. ``loss_mask`` (one 0/1 per response token, or
    None for all ones) marks the tokens SFT trains on: a conversation's assistant turns, not the
    user turns and template tokens between them."""

    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int] | None = None


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
