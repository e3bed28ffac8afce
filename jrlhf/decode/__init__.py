"""Paged-KV generation: page tables, prefill + decode loop, sampling, continuous batching.

``DecodeEngine`` (engine.py) composes the decode state and shared data (state.py), the device
programs (programs.py) and the host scheduler (scheduler.py)."""

from jrlhf.decode.engine import DecodeEngine
from jrlhf.decode.kernels import paged_attention_reference, select_kernel
from jrlhf.decode.page_table import PageAllocator, pages_for
from jrlhf.decode.sampling import SamplingParams, filter_logits, sample_tokens
from jrlhf.decode.state import (
    DecodeState,
    EngineConfig,
    GenerationResult,
    Migration,
    data_shards,
    round_slots,
)

__all__ = [
    "DecodeEngine",
    "DecodeState",
    "EngineConfig",
    "GenerationResult",
    "Migration",
    "PageAllocator",
    "SamplingParams",
    "data_shards",
    "filter_logits",
    "paged_attention_reference",
    "pages_for",
    "round_slots",
    "sample_tokens",
    "select_kernel",
]
