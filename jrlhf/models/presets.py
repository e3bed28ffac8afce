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


def _qwen3(hidden, intermediate, layers, heads, tied):
    """Qwen/Qwen3-*: q/k norms, no biases, head_dim 128 at every size, 8 KV heads."""
    return dict(
        vocab_size=151936,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        qk_norm=True,
        tie_word_embeddings=tied,
        max_position_embeddings=40960,
        architecture="qwen3",
        bos_token_id=151643,
        eos_token_id=151645,
    )


def qwen3_0_6b(**overrides: Any) -> ModelConfig:
    """Qwen/Qwen3-0.6B: 0.60e9 parameters (tied embeddings), 16 heads of 128 over hidden 1024."""
    return _make(_qwen3(1024, 3072, 28, 16, tied=True), overrides)


def qwen3_1_7b(**overrides: Any) -> ModelConfig:
    """Qwen/Qwen3-1.7B: 1.72e9 parameters (tied embeddings)."""
    return _make(_qwen3(2048, 6144, 28, 16, tied=True), overrides)


def qwen3_4b(**overrides: Any) -> ModelConfig:
    """Qwen/Qwen3-4B: 4.02e9 parameters (tied embeddings)."""
    return _make(_qwen3(2560, 9728, 36, 32, tied=True), overrides)


def qwen3_8b(**overrides: Any) -> ModelConfig:
    """Qwen/Qwen3-8B: 8.19e9 parameters."""
    return _make(_qwen3(4096, 12288, 36, 32, tied=False), overrides)


def qwen3_14b(**overrides: Any) -> ModelConfig:
    """Qwen/Qwen3-14B: 14.8e9 parameters."""
    return _make(_qwen3(5120, 17408, 40, 40, tied=False), overrides)


def qwen3_32b(**overrides: Any) -> ModelConfig:
    """Qwen/Qwen3-32B: 32.8e9 parameters."""
    return _make(_qwen3(5120, 25600, 64, 64, tied=False), overrides)


def _qwen3_moe(hidden, intermediate, expert, layers, heads):
    """Qwen/Qwen3-*-A*B: Qwen3's attention (4 KV heads) and 128 experts a layer, 8 chosen per
    token, their probabilities renormalized (norm_topk_prob true); no shared expert."""
    return dict(
        _qwen3(hidden, intermediate, layers, heads, tied=False),
        num_kv_heads=4,
        architecture="qwen3_moe",
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=expert,
        norm_topk_prob=True,
    )


def qwen3_30b_a3b(**overrides: Any) -> ModelConfig:
    """Qwen/Qwen3-30B-A3B: 30,532,122,624 parameters, 3,353,032,704 active per token."""
    return _make(_qwen3_moe(2048, 6144, 768, 48, 32), overrides)


def qwen3_235b_a22b(**overrides: Any) -> ModelConfig:
    """Qwen/Qwen3-235B-A22B: 235,093,634,560 parameters, 22,190,763,520 active per token."""
    return _make(_qwen3_moe(4096, 12288, 1536, 94, 64), overrides)


def mixtral_8x7b(**overrides: Any) -> ModelConfig:
    """mistralai/Mixtral-8x7B-v0.1: 46,702,792,704 parameters, 12,879,925,248 active per token
    (8 experts of 14336, 2 chosen)."""
    return _make(
        dict(
            vocab_size=32000,
            hidden_size=4096,
            intermediate_size=14336,
            num_layers=32,
            num_heads=32,
            num_kv_heads=8,
            rope_theta=1000000.0,
            rms_norm_eps=1e-5,
            max_position_embeddings=32768,
            architecture="mixtral",
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            bos_token_id=1,
            eos_token_id=2,
        ),
        overrides,
    )


def _gemma(**fields):
    """What every Gemma 2 and 3 model has: (1 + weight) RMSNorms, four a layer, GeGLU,
    embeddings scaled by sqrt(hidden), tied embeddings (a 256k vocabulary: the embedding is
    much of the smaller models), BOS 2, EOS 1."""
    return dict(
        rms_norm_eps=1e-6,
        norm_unit_offset=True,
        post_norms=True,
        hidden_act="gelu_tanh",
        scale_embeddings=True,
        tie_word_embeddings=True,
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
        **fields,
    )


def _gemma2(hidden, intermediate, layers, heads, kv_heads, head_dim, scalar):
    """google/gemma-2-*: sliding window 4096 on every other layer (layer 0 sliding), attention
    scores soft-capped at 50 and the logits at 30."""
    return _gemma(
        vocab_size=256000,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        query_pre_attn_scalar=scalar,
        rope_theta=10000.0,
        sliding_window=4096,
        layer_types=tuple(
            "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)
        ),
        attn_logit_softcap=50.0,
        final_logit_softcap=30.0,
        max_position_embeddings=8192,
        architecture="gemma2",
    )


def gemma2_2b(**overrides: Any) -> ModelConfig:
    """google/gemma-2-2b: 2.61e9 parameters."""
    return _make(_gemma2(2304, 9216, 26, 8, 4, 256, 256), overrides)


def gemma2_9b(**overrides: Any) -> ModelConfig:
    """google/gemma-2-9b: 9.24e9 parameters; attention scale 224 ** -0.5 (hidden / heads)."""
    return _make(_gemma2(3584, 14336, 42, 16, 8, 256, 224), overrides)


def gemma2_27b(**overrides: Any) -> ModelConfig:
    """google/gemma-2-27b: 27.2e9 parameters; heads of 128, attention scale 144 ** -0.5."""
    return _make(_gemma2(4608, 36864, 46, 32, 16, 128, 144), overrides)


def _gemma3(vocab, hidden, intermediate, layers, heads, kv_heads, head_dim, scalar, window):
    """google/gemma-3-*: q/k norms, 5 sliding layers to 1 full, the sliding layers' RoPE base
    10k, the full layers' 1M; above 1B the full layers' RoPE linearly scaled by 8 (128k
    context). The 4B, 12B and 27B are multimodal checkpoints: these are their text towers."""
    small = hidden == 1152
    return _gemma(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        query_pre_attn_scalar=scalar,
        qk_norm=True,
        rope_theta=1000000.0,
        rope_scaling=RopeScaling() if small else RopeScaling("linear", 8.0),
        rope_local_theta=10000.0,
        sliding_window=window,
        layer_types=tuple(
            "sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(layers)
        ),
        max_position_embeddings=32768 if small else 131072,
        architecture="gemma3",
    )


def gemma3_1b(**overrides: Any) -> ModelConfig:
    """google/gemma-3-1b-pt (a text model): 1.00e9 parameters, one KV head, window 512."""
    return _make(_gemma3(262144, 1152, 6912, 26, 4, 1, 256, 256, 512), overrides)


def gemma3_4b(**overrides: Any) -> ModelConfig:
    """google/gemma-3-4b-pt's text tower: 3.88e9 parameters (a 262208-token vocabulary)."""
    return _make(_gemma3(262208, 2560, 10240, 34, 8, 4, 256, 256, 1024), overrides)


def gemma3_12b(**overrides: Any) -> ModelConfig:
    """google/gemma-3-12b-pt's text tower: 11.8e9 parameters."""
    return _make(_gemma3(262208, 3840, 15360, 48, 16, 8, 256, 256, 1024), overrides)


def gemma3_27b(**overrides: Any) -> ModelConfig:
    """google/gemma-3-27b-pt's text tower: 27.0e9 parameters; heads of 128, attention scale
    168 ** -0.5 (hidden / heads)."""
    return _make(_gemma3(262208, 5376, 21504, 62, 32, 16, 128, 168, 1024), overrides)


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
    "qwen3_0_6b": qwen3_0_6b,
    "qwen3_1_7b": qwen3_1_7b,
    "qwen3_4b": qwen3_4b,
    "qwen3_8b": qwen3_8b,
    "qwen3_14b": qwen3_14b,
    "qwen3_32b": qwen3_32b,
    "qwen3_30b_a3b": qwen3_30b_a3b,
    "qwen3_235b_a22b": qwen3_235b_a22b,
    "mixtral_8x7b": mixtral_8x7b,
    "gemma2_2b": gemma2_2b,
    "gemma2_9b": gemma2_9b,
    "gemma2_27b": gemma2_27b,
    "gemma3_1b": gemma3_1b,
    "gemma3_4b": gemma3_4b,
    "gemma3_12b": gemma3_12b,
    "gemma3_27b": gemma3_27b,
}


def get_preset(name: str, **overrides: Any) -> ModelConfig:
    """The preset ``name`` (hyphens and case ignored), failing in one line with the known names."""
    key = name.strip().lower().replace("-", "_")
    if key not in PRESETS:
        raise ValueError(f"unknown model preset {name!r} (known: {', '.join(PRESETS)})")
    return PRESETS[key](**overrides)
