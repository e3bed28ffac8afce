"""Small random HF checkpoints built with transformers (the independent reference)."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

VOCAB = 128


def _build(kind: str, directory: Path) -> Path:
    import torch
    import transformers as tf

    seeds = {"llama3": 0, "qwen2": 1, "llama_mha": 2, "llama3_rm": 3, "mistral": 4}
    seeds.update(qwen3=5, gemma2=6, gemma3=7, gemma3_mm=8)
    torch.manual_seed(seeds[kind])
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
    )
    if kind in ("llama3", "llama3_rm"):
        cfg = tf.LlamaConfig(
            **common,
            num_attention_heads=8,
            num_key_value_heads=4,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        )
    elif kind == "qwen2":
        cfg = tf.Qwen2Config(
            **common,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            rope_theta=1000000.0,
            eos_token_id=2,
            pad_token_id=0,
        )
    elif kind == "mistral":
        # A sliding window shorter than the test sequences, so the window mask matters.
        cfg = tf.MistralConfig(
            **common,
            num_attention_heads=4,
            num_key_value_heads=2,
            sliding_window=16,
            eos_token_id=2,
        )
    elif kind == "qwen3":
        # head_dim independent of hidden / heads (as Qwen3's: 128 at every size)
        cfg = tf.Qwen3Config(
            **common,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=24,
            tie_word_embeddings=True,
            rope_theta=1000000.0,
            eos_token_id=2,
            pad_token_id=0,
        )
    elif kind == "gemma2":
        # Soft-caps small enough to bite at these scales, a window shorter than the sequences,
        # query_pre_attn_scalar other than head_dim; layer 0 sliding, layer 1 full.
        cfg = tf.Gemma2Config(
            **common,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=8,
            attn_logit_softcapping=1.5,
            final_logit_softcapping=4.0,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        )
    elif kind in ("gemma3", "gemma3_mm"):
        # Local and global layers both (and a local one under each loop form), different RoPE
        # for each (the global one linearly scaled), a short window.
        text = dict(
            **{**common, "num_hidden_layers": 3},
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        )
        if kind == "gemma3":
            cfg = tf.Gemma3TextConfig(**text)
        else:
            vision = dict(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=2,
                image_size=28,
                patch_size=14,
            )
            cfg = tf.Gemma3Config(
                text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=3
            )
    elif kind == "llama_mha":
        cfg = tf.LlamaConfig(**common, num_attention_heads=4, num_key_value_heads=4, eos_token_id=2)
    else:
        raise ValueError(kind)
    if kind == "llama3_rm":
        cfg.num_labels = 1
        model = tf.LlamaForSequenceClassification(cfg)
    elif kind == "gemma3_mm":
        model = tf.Gemma3ForConditionalGeneration(cfg)
    else:
        model = tf.AutoModelForCausalLM.from_config(cfg)
    return randomize_and_save(model, directory)


def randomize_and_save(model, directory: Path, scale: float = 0.08, scales=()) -> Path:
    """Draw ``model``'s weights afresh (from torch's current seed) and save it as a safetensors
    checkpoint in ``directory``: random non-trivial norms and biases, so that a wrong mapping
    cannot hide behind ones or zeros; weights ``scale`` times a normal draw, or the scale of the
    first ``(name suffix, scale)`` of ``scales`` that matches."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                s = next((s for suffix, s in scales if name.endswith(suffix)), scale)
                p.copy_(s * torch.randn_like(p))
    model = model.float().eval()
    model.save_pretrained(directory, safe_serialization=True)
    return directory


@functools.cache
def hf_checkpoint(kind: str) -> Path:
    """Path of a cached random checkpoint: 'llama3', 'qwen2', 'llama_mha', 'mistral',
    'llama3_rm', 'qwen3', 'gemma2', 'gemma3' (text) or 'gemma3_mm' (Gemma3ForConditionalGeneration
    around the same text model's shapes, a tiny vision tower)."""
    root = Path(tempfile.mkdtemp(prefix=f"jrlhf-{kind}-"))
    return _build(kind, root / kind)


def torch_logits(path, tokens, attention_mask=None):
    import numpy as np
    import torch
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(
            torch.tensor(np.asarray(tokens)),
            attention_mask=None if attention_mask is None else torch.tensor(attention_mask),
        )
    return out.logits.numpy()
