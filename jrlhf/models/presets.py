"""Model presets: the public architectures of common open models, for planning without checkpoints.

The numbers are those of each model's published HF ``config.json``; a preset builds a
``ModelConfig`` with no weights, so ``python -m jrlhf.plan --actor llama2_70b`` can estimate plans
for hardware and models this machine cannot hold. Weights are stored in bfloat16 as released
(a RoleConfig's ``param_dtype``/``dtype`` still override that, as in the trainer).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jrlhf.models.config import ModelConfig, RopeScaling

_BF16 = dict(param_dtype="bfloat16", dtype="bfloat16")


def llama2_7b(**overrides: Any) -> ModelConfig:
    """meta-llama/Llama-2-7b-hf: 6.74e9 parameters, multi-head attention."""
    return _make(
        dict(
            vocab_size=32000,
            hidden_size=4096,
            intermediate_size=11008,
            num_layers=32,
            num_heads=32,
            num_kv_heads=32,
            rope_theta=10000.0,
            rms_norm_eps=1e-5,
            max_position_embeddings=4096,
            bos_token_id=1,
            eos_token_id=2,
        ),
        overrides,
    )


def llama2_13b(**overrides: Any) -> ModelConfig:
    """meta-llama/Llama-2-13b-hf: 13.0e9 parameters."""
    return _make(
        dict(
            vocab_size=32000,
            hidden_size=5120,
            intermediate_size=13824,
            num_layers=40,
            num_heads=40,
            num_kv_heads=40,
            rope_theta=10000.0,
            rms_norm_eps=1e-5,
            max_position_embeddings=4096,
            bos_token_id=1,
            eos_token_id=2,
        ),
        overrides,
    )


def llama2_70b(**overrides: Any) -> ModelConfig:
    """meta-llama/Llama-2-70b-hf: 69.0e9 parameters, grouped-query attention with 8 KV heads."""
    return _make(
        dict(
            vocab_size=32000,
            hidden_size=8192,
            intermediate_size=28672,
            num_layers=80,
            num_heads=64,
            num_kv_heads=8,
            rope_theta=10000.0,
            rms_norm_eps=1e-5,
            max_position_embeddings=4096,
            bos_token_id=1,
            eos_token_id=2,
        ),
        overrides,
    )


def llama3_2_1b(**overrides: Any) -> ModelConfig:
    """meta-llama/Llama-3.2-1B: 1.24e9 parameters, tied input and output embeddings, 64-wide
    heads (32 query / 8 KV), RoPE with Llama 3's long-context scaling (factor 32)."""
    return _make(
        dict(
            vocab_size=128256,
            hidden_size=2048,
            intermediate_size=8192,
            num_layers=16,
            num_heads=32,
            num_kv_heads=8,
            rope_theta=500000.0,
            rope_scaling=RopeScaling(rope_type="llama3", factor=32.0),
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            max_position_embeddings=131072,
            bos_token_id=128000,
            eos_token_id=128001,
        ),
        overrides,
    )


def llama3_8b(**overrides: Any) -> ModelConfig:
    """meta-llama/Meta-Llama-3-8B: 8.03e9 parameters, 128k vocabulary, 8 KV heads."""
    return _make(
        dict(
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_layers=32,
            num_heads=32,
            num_kv_heads=8,
            rope_theta=500000.0,
            rope_scaling=RopeScaling(),
            rms_norm_eps=1e-5,
            max_position_embeddings=8192,
            bos_token_id=128000,
            eos_token_id=128001,
        ),
        overrides,
    )


def llama3_70b(**overrides: Any) -> ModelConfig:
    """meta-llama/Meta-Llama-3-70B: 70.6e9 parameters."""
    return _make(
        dict(
            vocab_size=128256,
            hidden_size=8192,
            intermediate_size=28672,
            num_layers=80,
            num_heads=64,
            num_kv_heads=8,
            rope_theta=500000.0,
            rms_norm_eps=1e-5,
            max_position_embeddings=8192,
            bos_token_id=128000,
            eos_token_id=128001,
        ),
        overrides,
    )


def llama3_405b(**overrides: Any) -> ModelConfig:
    """meta-llama/Llama-3.1-405B's shape: 126 layers, hidden 16384, 128 heads / 8 KV heads, MLP
    53248, 128k vocabulary; 4.06e11 parameters (the RoPE scaling of 3.1's long context is not
    modelled: positions up to 8192 as Llama 3)."""
    return _make(
        dict(
            vocab_size=128256,
            hidden_size=16384,
            intermediate_size=53248,
            num_layers=126,
            num_heads=128,
            num_kv_heads=8,
            rope_theta=500000.0,
            rms_norm_eps=1e-5,
            max_position_embeddings=8192,
            bos_token_id=128000,
            eos_token_id=128001,
        ),
        overrides,
    )


def qwen2_7b(**overrides: Any) -> ModelConfig:
    """Qwen/Qwen2-7B: 7.62e9 parameters, q/k/v biases, 28 heads (so tensor size 8 cannot split
    them: at most tensor=4, which the planner's divisibility check enforces)."""
    return _make(
        dict(
            vocab_size=152064,
            hidden_size=3584,
            intermediate_size=18944,
            num_layers=28,
            num_heads=28,
            num_kv_heads=4,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            qkv_bias=True,
            max_position_embeddings=32768,
            architecture="qwen2",
            bos_token_id=151643,
            eos_token_id=151643,
        ),
        overrides,
    )


def _make(base: dict[str, Any], overrides: dict[str, Any]) -> ModelConfig:
    return ModelConfig(**{**_BF16, **base, **overrides})


PRESETS: dict[str, Callable[..., ModelConfig]] = {
    "llama2_7b": llama2_7b,
    "llama2_13b": llama2_13b,
    "llama2_70b": llama2_70b,
    "llama3_2_1b": llama3_2_1b,
    "llama3_8b": llama3_8b,
    "llama3_70b": llama3_70b,
    "llama3_405b": llama3_405b,
    "qwen2_7b": qwen2_7b,
}


def get_preset(name: str, **overrides: Any) -> ModelConfig:
    """The preset ``name`` (hyphens and case ignored), failing in one line with the known names."""
    key = name.strip().lower().replace("-", "_")
    if key not in PRESETS:
        raise ValueError(f"unknown model preset {name!r} (known: {', '.join(PRESETS)})")
    return PRESETS[key](**overrides)
