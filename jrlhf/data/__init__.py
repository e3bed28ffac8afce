"""Data: files of prompts, preference pairs and SFT examples, their tokenizer, the resumable
prompt order and the one prompt+response batch layout.

- :mod:`jrlhf.data.tokenizer`: :class:`Tokenizer` (a HF ``tokenizer.json`` and its special ids);
- :mod:`jrlhf.data.records`: the record types and :class:`Dataset`;
- :mod:`jrlhf.data.datasets`: JSON Lines / Parquet loading with one-line ``file:line`` errors;
- :mod:`jrlhf.data.loader`: :class:`PromptLoader`, seeded batches with a checkpointable position;
- :mod:`jrlhf.data.batch`: ``pack``, the prompt+response layout every stage trains and scores on.
"""

from jrlhf.data.datasets import load_preferences, load_prompts, load_sft, write_jsonl
from jrlhf.data.loader import PromptLoader
from jrlhf.data.records import ANSWER_IDS, Dataset, PreferenceRecord, PromptRecord, SFTRecord
from jrlhf.data.tokenizer import Tokenizer

__all__ = [
    "ANSWER_IDS",
    "Dataset",
    "PreferenceRecord",
    "PromptLoader",
    "PromptRecord",
    "SFTRecord",
    "Tokenizer",
    "load_preferences",
    "load_prompts",
    "load_sft",
    "write_jsonl",
]
