"""Hugging Face checkpoint interop without torch: config.json + safetensors in and out.

Loading maps each HF tensor onto our layout as a NumPy view over the memory-mapped file and builds
every parameter with ``jax.make_array_from_callback``: each device reads only its own shard, and no
device ever holds the full model. Export writes the same format back so transformers (and vLLM)
load it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np
from jax.sharding import Mesh
from safetensors.numpy import save_file

from jrlhf.data.tokenizer import checkpoint_end_ids
from jrlhf.meshes.batch import to_host
from jrlhf.meshes.processes import barrier, is_primary
from jrlhf.meshes.rules import Rules, path_str
from jrlhf.models.config import ModelConfig, RopeScaling
from jrlhf.models.model_def import ModelDef, Params
from jrlhf.models.safetensors_io import INDEX_NAME, CheckpointError, SafetensorsReader

_ARCH_CLASS = {
    "llama": "Llama",
    "qwen2": "Qwen2",
    "qwen3": "Qwen3",
    "mistral": "Mistral",
    "gemma2": "Gemma2",
    "gemma3": "Gemma3",
    "qwen3_moe": "Qwen3Moe",
    "mixtral": "Mixtral",
    "qwen2_moe": "Qwen2Moe",
}
# HF model_type of each architecture where the two differ (Gemma 3's text model), and back.
_HF_MODEL_TYPE = {"gemma3": "gemma3_text"}
_ARCH_OF_MODEL_TYPE = {_HF_MODEL_TYPE.get(a, a): a for a in _ARCH_CLASS}
_GEMMA = ("gemma2", "gemma3")
# Gemma3TextConfig's defaults (transformers): the hub's multimodal Gemma 3 config.json files
# leave them out of text_config.
_GEMMA3_TEXT_DEFAULTS = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
    "sliding_window_pattern": 6,
    "tie_word_embeddings": True,
    "bos_token_id": 2,
    "eos_token_id": 1,
    "pad_token_id": 0,
}
# Where the text model's tensors of a multimodal Gemma 3 checkpoint (Gemma3ForConditionalGeneration)
# live: as transformers 5 saves them, and as the hub's files have them. The vision tower and the
# projector are left out.
_GEMMA3_TEXT_PREFIXES = ("model.language_model.", "language_model.model.")
_GEMMA3_VISION_PREFIXES = (
    "model.vision_tower.",
    "model.multi_modal_projector.",
    "vision_tower.",
    "multi_modal_projector.",
)
_GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
)
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


# ---------------------------------------------------------------------------------------------
# config.json <-> ModelConfig
# ---------------------------------------------------------------------------------------------
def config_from_hf(hf: dict[str, Any], source: str = "config.json") -> tuple[ModelConfig, str]:
    """(ModelConfig, head) from a HF config dict; one-line error for what we cannot represent."""
    model_type = hf.get("model_type")
    archs = hf.get("architectures") or []
    if model_type == "gemma3":  # multimodal: its language model only (see load_hf)
        if not isinstance(hf.get("text_config"), dict):
            raise CheckpointError(f"{source}: a gemma3 config without a text_config")
        if any(a.endswith("ForSequenceClassification") for a in archs):
            raise CheckpointError(
                f"{source}: multimodal Gemma 3 sequence classifiers are not supported"
            )
        top = {k: hf[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in hf}
        hf = {**top, **hf["text_config"], "model_type": "gemma3_text"}
        archs = ["Gemma3ForCausalLM"]
    if model_type not in _ARCH_OF_MODEL_TYPE and model_type != "gemma3":
        raise CheckpointError(
            f"{source}: model_type {model_type!r} is not supported "
            f"(supported: {', '.join(_ARCH_OF_MODEL_TYPE)}, and gemma3's text model)"
        )
    arch = _ARCH_OF_MODEL_TYPE[hf["model_type"]]
    if arch == "gemma3":
        hf = {**_GEMMA3_TEXT_DEFAULTS, **hf}
    archs = archs or [f"{_ARCH_CLASS[arch]}ForCausalLM"]
    head = "value" if any(a.endswith("ForSequenceClassification") for a in archs) else "lm"
    if head == "value" and hf.get("num_labels", len(hf.get("id2label") or [0])) != 1:
        raise CheckpointError(f"{source}: sequence-classification heads must have num_labels=1")
    if arch in _GEMMA:
        act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in _GELU_TANH:
            raise CheckpointError(
                f"{source}: hidden_activation {act!r} unsupported (gelu_pytorch_tanh only)"
            )
        if hf.get("use_bidirectional_attention"):
            raise CheckpointError(f"{source}: use_bidirectional_attention=true is not supported")
    elif hf.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{source}: hidden_act {hf['hidden_act']!r} unsupported (silu only)")
    if hf.get("mlp_bias"):
        raise CheckpointError(f"{source}: mlp_bias=true is not supported")
    model_type = arch
    moe = _moe_fields(hf, arch, source)
    if model_type == "qwen2":
        qkv_bias = True
    elif model_type == "qwen2_moe":  # q/k/v biases by default, as Qwen2
        qkv_bias = bool(hf.get("qkv_bias", True))
    else:
        if hf.get("attention_bias"):
            raise CheckpointError(f"{source}: attention_bias=true (o_proj bias) is not supported")
        qkv_bias = False
    rope = dict(hf.get("rope_parameters") or {})
    legacy = hf.get("rope_scaling") or {}
    local_theta = 0.0
    if isinstance(rope.get("full_attention"), dict):  # per layer type (Gemma 3, transformers 5)
        local = dict(rope.get("sliding_attention") or {})
        if local.get("rope_type", local.get("type", "default")) != "default":
            raise CheckpointError(
                f"{source}: sliding layers' rope_type {local.get('rope_type')!r} unsupported "
                "(default only)"
            )
        local_theta = float(local.get("rope_theta", hf.get("rope_local_base_freq", 10000.0)))
        rope = dict(rope["full_attention"])
    elif model_type == "gemma3":
        local_theta = float(hf.get("rope_local_base_freq", 10000.0))
    rope = {**legacy, **rope}
    theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    try:
        scaling = RopeScaling(
            rope_type=rope_type,
            factor=float(rope.get("factor", 1.0)),
            low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
            high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(
                rope.get("original_max_position_embeddings", 8192)
            ),
        )
    except ValueError as e:
        raise CheckpointError(f"{source}: {e}") from None
    sliding = hf.get("sliding_window") or 0
    qwen = ("qwen2", "qwen3", "qwen3_moe", "qwen2_moe")
    if model_type in qwen and not hf.get("use_sliding_window", False):
        sliding = 0
    if model_type in ("qwen3_moe", "qwen2_moe") and sliding:
        raise CheckpointError(
            f"{source}: {model_type} with use_sliding_window=true is not supported"
        )
    layer_types = hf.get("layer_types")
    num_layers = hf.get("num_hidden_layers")
    if layer_types is None and sliding and model_type in ("qwen2", "qwen3"):
        # transformers' default: the window on the layers from max_window_layers on
        first = hf.get("max_window_layers", 28)
        if isinstance(num_layers, int) and isinstance(first, int):
            layer_types = [
                "sliding_attention" if i >= first else "full_attention" for i in range(num_layers)
            ]
    if layer_types is None and model_type in _GEMMA and isinstance(num_layers, int):
        # transformers' defaults: Gemma 2 alternates sliding and full layers; Gemma 3 has one
        # full layer in every sliding_window_pattern.
        pattern = 2 if model_type == "gemma2" else int(hf.get("sliding_window_pattern", 6))
        layer_types = [
            "sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(num_layers)
        ]
    layer_types = tuple(layer_types or ())
    if not sliding or all(t == "sliding_attention" for t in layer_types):
        # No window (transformers' layer_types then say full everywhere), or one on every layer
        layer_types = ()
        local_theta = local_theta if sliding else 0.0
    softcap = {
        name: float(hf.get(name) or 0.0)
        for name in ("attn_logit_softcapping", "final_logit_softcapping")
    }
    gemma = model_type in _GEMMA
    num_heads = hf["num_attention_heads"]
    try:
        cfg = ModelConfig(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or 0,
            rope_theta=float(theta),
            rope_scaling=scaling,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            qkv_bias=qkv_bias,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", gemma)),
            sliding_window=int(sliding),
            layer_types=layer_types,
            rope_local_theta=local_theta,
            qk_norm=model_type in ("qwen3", "gemma3", "qwen3_moe"),
            norm_unit_offset=gemma,
            post_norms=gemma,
            hidden_act="gelu_tanh" if gemma else "silu",
            scale_embeddings=gemma,
            query_pre_attn_scalar=(hf.get("query_pre_attn_scalar") or 0) if gemma else 0,
            attn_logit_softcap=softcap["attn_logit_softcapping"],
            final_logit_softcap=softcap["final_logit_softcapping"],
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            architecture=model_type,
            initializer_range=float(hf.get("initializer_range", 0.02)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
            pad_token_id=hf.get("pad_token_id"),
            **moe,
        )
    except KeyError as e:
        raise CheckpointError(f"{source}: required field {e.args[0]!r} is missing") from None
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{source}: {e}") from None
    return cfg, head


def _moe_fields(hf: dict[str, Any], arch: str, source: str) -> dict[str, Any]:
    """The ModelConfig mixture-of-experts fields of a qwen3_moe, qwen2_moe or mixtral config
    ({} for the dense families); a layout we cannot represent fails with one line."""
    if arch not in ("qwen3_moe", "mixtral", "qwen2_moe"):
        return {}
    num = hf.get("num_local_experts", hf.get("num_experts", 8 if arch == "mixtral" else 128))
    fields = dict(num_experts=num, num_experts_per_tok=hf.get("num_experts_per_tok", 2))
    if arch == "mixtral":  # the experts are intermediate_size wide; top-k always renormalized
        return dict(fields, norm_topk_prob=True)
    # Qwen3-MoE, Qwen2-MoE: every layer routed (dense layers in between are not supported)
    if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1:
        raise CheckpointError(
            f"{source}: {arch} with dense layers (mlp_only_layers "
            f"{hf.get('mlp_only_layers')}, decoder_sparse_step {hf.get('decoder_sparse_step')}) "
            "is not supported"
        )
    if arch == "qwen2_moe":  # and its shared expert
        fields["shared_expert_size"] = hf.get("shared_expert_intermediate_size", 5632)
    return dict(
        fields,
        moe_intermediate_size=hf.get("moe_intermediate_size", 768 if arch == "qwen3_moe" else 1408),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
    )


def config_to_hf(cfg: ModelConfig, head: str = "lm") -> dict[str, Any]:
    """A HF config dict that transformers' Llama/Qwen2/Qwen3/Mistral/Gemma2 classes load, and
    its Gemma3ForCausalLM (model_type gemma3_text) for Gemma 3."""
    cls = _ARCH_CLASS[cfg.architecture]
    if head == "value":
        text = "Text" if cfg.architecture == "gemma3" else ""
        arch = f"{cls}{text}ForSequenceClassification"
    else:
        arch = f"{cls}ForCausalLM"
    rope_parameters: dict[str, Any] = {"rope_type": cfg.rope_scaling.rope_type}
    if cfg.rope_scaling.rope_type != "default":
        rope_parameters["factor"] = cfg.rope_scaling.factor
    if cfg.rope_scaling.rope_type == "llama3":
        rope_parameters.update(
            low_freq_factor=cfg.rope_scaling.low_freq_factor,
            high_freq_factor=cfg.rope_scaling.high_freq_factor,
            original_max_position_embeddings=cfg.rope_scaling.original_max_position_embeddings,
        )
    out: dict[str, Any] = {
        "architectures": [arch],
        "model_type": _HF_MODEL_TYPE.get(cfg.architecture, cfg.architecture),
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "initializer_range": cfg.initializer_range,
        # Both spellings: transformers >= 5 reads rope_parameters, older readers (and vLLM)
        # read rope_theta / rope_scaling.
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {**rope_parameters, "rope_theta": cfg.rope_theta},
        "rope_scaling": None if cfg.rope_scaling.rope_type == "default" else rope_parameters,
        "torch_dtype": cfg.param_dtype,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_id)
        if isinstance(cfg.eos_token_id, tuple)
        else cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
    }
    if cfg.architecture == "llama":
        out.update(attention_bias=False, mlp_bias=False)
    if cfg.architecture in ("mistral", "mixtral"):
        out["sliding_window"] = cfg.sliding_window or None
    if cfg.is_moe:
        # both spellings of the expert count (transformers 5 maps num_experts onto it)
        out.update(
            num_local_experts=cfg.num_experts,
            num_experts_per_tok=cfg.num_experts_per_tok,
            router_aux_loss_coef=cfg.router_aux_loss_coef,
            output_router_logits=False,
        )
    if cfg.architecture == "qwen2_moe":
        out.update(
            shared_expert_intermediate_size=cfg.shared_expert_size,
            qkv_bias=cfg.qkv_bias,
            max_window_layers=cfg.num_layers,
        )
    if cfg.architecture in ("qwen3_moe", "qwen2_moe"):
        out.update(
            num_experts=cfg.num_experts,
            moe_intermediate_size=cfg.expert_size,
            norm_topk_prob=cfg.norm_topk_prob,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            use_sliding_window=False,
            sliding_window=None,
        )
        if cfg.architecture == "qwen3_moe":
            out["attention_bias"] = False
    if cfg.architecture == "mixtral":
        out["intermediate_size"] = cfg.expert_size
    if cfg.architecture in ("qwen2", "qwen3"):
        out["use_sliding_window"] = bool(cfg.sliding_window)
        out["sliding_window"] = cfg.sliding_window or None
        # transformers reads layer_types (below); older readers the first sliding layer
        sliding = [i for i, w in enumerate(cfg.layer_windows) if w]
        out["max_window_layers"] = sliding[0] if sliding else cfg.num_layers
        if cfg.architecture == "qwen3":
            out["attention_bias"] = False
    if cfg.layer_types or cfg.architecture in ("qwen2", "qwen3", *_GEMMA):
        out["layer_types"] = [
            "sliding_attention" if w else "full_attention" for w in cfg.layer_windows
        ]
    if cfg.architecture in _GEMMA:
        out.update(
            hidden_act="gelu_pytorch_tanh",
            hidden_activation="gelu_pytorch_tanh",
            attention_bias=False,
            query_pre_attn_scalar=cfg.query_pre_attn_scalar or cfg.head_dim,
            sliding_window=cfg.sliding_window or None,
            attn_logit_softcapping=cfg.attn_logit_softcap or None,
            final_logit_softcapping=cfg.final_logit_softcap or None,
        )
    if cfg.architecture == "gemma3":
        # RoPE per layer type (transformers 5) and the older spelling (rope_local_base_freq;
        # rope_scaling for the full layers only).
        local = cfg.rope_local_theta or cfg.rope_theta
        out["rope_parameters"] = {
            "full_attention": out["rope_parameters"],
            "sliding_attention": {"rope_type": "default", "rope_theta": local},
        }
        out["rope_local_base_freq"] = local
    if head == "value":
        out["num_labels"] = 1
        out["id2label"] = {"0": "LABEL_0"}
        out["label2id"] = {"LABEL_0": 0}
    return out


# ---------------------------------------------------------------------------------------------
# weight map: our parameter path <-> HF tensor name, with layout transforms both ways
# ---------------------------------------------------------------------------------------------
def _same(x, cfg):
    return x


@dataclasses.dataclass(frozen=True)
class _Tensor:
    path: tuple[str, ...]
    hf_name: str  # "{i}" is the layer index for stacked parameters
    to_ours: Callable[[np.ndarray, ModelConfig], np.ndarray] = _same  # a view when possible
    to_hf: Callable[[np.ndarray, ModelConfig], np.ndarray] = _same

    @property
    def stacked(self) -> bool:
        return self.path[0] == "layers"

    @property
    def per_expert(self) -> bool:
        """One HF tensor per (layer, expert): ``{j}`` in the name is the expert index, ours
        stacks them on the axis after ``layers``."""
        return "{j}" in self.hf_name


def _t(x, cfg):
    return x.T


def _qkv_in(heads_attr):
    def to_ours(x, cfg):  # (H*D, E) -> (E, H, D)
        return x.reshape(getattr(cfg, heads_attr), cfg.head_dim, -1).transpose(2, 0, 1)

    def to_hf(x, cfg):  # (E, H, D) -> (H*D, E)
        return x.transpose(1, 2, 0).reshape(-1, x.shape[0])

    return to_ours, to_hf


def _bias(heads_attr):
    def to_ours(x, cfg):
        return x.reshape(getattr(cfg, heads_attr), cfg.head_dim)

    def to_hf(x, cfg):
        return x.reshape(-1)

    return to_ours, to_hf


def _o_to_ours(x, cfg):  # (E, H*D) -> (H, D, E)
    return x.reshape(x.shape[0], cfg.num_heads, cfg.head_dim).transpose(1, 2, 0)


def _o_to_hf(x, cfg):  # (H, D, E) -> (E, H*D)
    return x.transpose(2, 0, 1).reshape(x.shape[2], -1)


def weight_map(cfg: ModelConfig, head: str, prefix: str = "model.") -> list[_Tensor]:
    """Our parameters and the HF tensors they are; ``prefix`` is where the decoder's tensors
    live (a multimodal Gemma 3's text model: ``_GEMMA3_TEXT_PREFIXES``)."""
    L = prefix + "layers.{i}."
    q_in, q_out = _qkv_in("num_heads")
    kv_in, kv_out = _qkv_in("num_kv_heads")
    # Gemma's four norms a layer: ours is the MLP's input norm, theirs the attention's output's
    mlp_in = "pre_feedforward_layernorm" if cfg.post_norms else "post_attention_layernorm"
    entries = [
        _Tensor(("embedding",), prefix + "embed_tokens.weight", _same, _same),
        _Tensor(("final_norm", "scale"), prefix + "norm.weight", _same, _same),
        _Tensor(("layers", "input_norm", "scale"), L + "input_layernorm.weight", _same, _same),
        _Tensor(("layers", "post_attn_norm", "scale"), L + mlp_in + ".weight", _same, _same),
        _Tensor(("layers", "attn", "q_kernel"), L + "self_attn.q_proj.weight", q_in, q_out),
        _Tensor(("layers", "attn", "k_kernel"), L + "self_attn.k_proj.weight", kv_in, kv_out),
        _Tensor(("layers", "attn", "v_kernel"), L + "self_attn.v_proj.weight", kv_in, kv_out),
        _Tensor(
            ("layers", "attn", "o_kernel"), L + "self_attn.o_proj.weight", _o_to_ours, _o_to_hf
        ),
    ]
    if cfg.architecture == "mixtral":  # the routed MLP: router and per-expert w1 (gate) w3 w2
        M = L + "block_sparse_moe."
        entries += [
            _Tensor(("layers", "mlp", "router_kernel"), M + "gate.weight", _t, _t),
            _Tensor(("layers", "mlp", "gate_experts"), M + "experts.{j}.w1.weight", _t, _t),
            _Tensor(("layers", "mlp", "up_experts"), M + "experts.{j}.w3.weight", _t, _t),
            _Tensor(("layers", "mlp", "down_experts"), M + "experts.{j}.w2.weight", _t, _t),
        ]
    elif cfg.is_moe:  # Qwen3-MoE's names
        M = L + "mlp."
        entries.append(_Tensor(("layers", "mlp", "router_kernel"), M + "gate.weight", _t, _t))
        entries += [
            _Tensor(("layers", "mlp", f"{w}_experts"), M + f"experts.{{j}}.{w}_proj.weight", _t, _t)
            for w in ("gate", "up", "down")
        ]
        if cfg.shared_expert_size:  # Qwen2-MoE
            entries += [
                _Tensor(
                    ("layers", "mlp", f"shared_{w}_kernel"),
                    M + f"shared_expert.{w}_proj.weight",
                    _t,
                    _t,
                )
                for w in ("gate", "up", "down")
            ]
            entries.append(
                _Tensor(
                    ("layers", "mlp", "shared_expert_gate"), M + "shared_expert_gate.weight", _t, _t
                )
            )
    else:
        entries += [
            _Tensor(("layers", "mlp", f"{w}_kernel"), L + f"mlp.{w}_proj.weight", _t, _t)
            for w in ("gate", "up", "down")
        ]
    if cfg.qkv_bias:
        qb_in, qb_out = _bias("num_heads")
        kb_in, kb_out = _bias("num_kv_heads")
        entries += [
            _Tensor(("layers", "attn", "q_bias"), L + "self_attn.q_proj.bias", qb_in, qb_out),
            _Tensor(("layers", "attn", "k_bias"), L + "self_attn.k_proj.bias", kb_in, kb_out),
            _Tensor(("layers", "attn", "v_bias"), L + "self_attn.v_proj.bias", kb_in, kb_out),
        ]
    if cfg.qk_norm:
        entries += [
            _Tensor(("layers", "attn", f"{x}_norm", "scale"), L + f"self_attn.{x}_norm.weight")
            for x in "qk"
        ]
    if cfg.post_norms:
        entries += [
            _Tensor(("layers", "attn_out_norm", "scale"), L + "post_attention_layernorm.weight"),
            _Tensor(("layers", "mlp_out_norm", "scale"), L + "post_feedforward_layernorm.weight"),
        ]
    if head == "lm" and not cfg.tie_word_embeddings:
        entries.append(_Tensor(("lm_head",), "lm_head.weight", _t, _t))
    if head == "value":
        entries.append(_Tensor(("value_head",), "score.weight", _t, _t))
    return entries


def _get(tree: dict, path: tuple[str, ...]):
    for key in path:
        tree = tree[key]
    return tree


def _set(tree: dict, path: tuple[str, ...], value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


# ---------------------------------------------------------------------------------------------
# load
# ---------------------------------------------------------------------------------------------
def _read_config_json(path: str | os.PathLike) -> tuple[dict[str, Any], Path]:
    config_path = Path(path) / "config.json"
    if not config_path.exists():
        raise CheckpointError(f"{config_path}: not found (is {path} a HF checkpoint directory?)")
    try:
        return json.loads(config_path.read_text()), config_path
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{config_path}: malformed JSON ({e})") from None


def read_hf_config(path: str | os.PathLike) -> tuple[ModelConfig, str]:
    hf, config_path = _read_config_json(path)
    try:  # generation stops at any end id: generation_config.json's list and config.json's
        ends = checkpoint_end_ids(path)
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    if ends:
        hf = {**hf, "eos_token_id": ends[0] if len(ends) == 1 else list(ends)}
    return config_from_hf(hf, str(config_path))


def _tensor_prefix(path, reader: SafetensorsReader) -> tuple[str, tuple[str, ...]]:
    """(where the decoder's tensors live, prefixes of tensors to leave out): ``model.``, but a
    multimodal Gemma 3 checkpoint's text model in either of ``_GEMMA3_TEXT_PREFIXES``, its
    vision tower and projector left out."""
    hf, _ = _read_config_json(path)
    if hf.get("model_type") != "gemma3":
        return "model.", ()
    for prefix in _GEMMA3_TEXT_PREFIXES:
        if prefix + "embed_tokens.weight" in reader:
            return prefix, _GEMMA3_VISION_PREFIXES
    raise CheckpointError(
        f"{path}: a gemma3 checkpoint without its text model's embed_tokens.weight under "
        f"{' or '.join(_GEMMA3_TEXT_PREFIXES)}"
    )


def load_hf(
    path: str | os.PathLike,
    mesh: Mesh,
    rules: Rules | str,
    *,
    param_dtype: str | None = None,
    dtype: str | None = None,
    remat_policy: str | None = None,
) -> tuple[ModelDef, Params]:
    """Load a HF checkpoint directly into parameters sharded over ``mesh`` by ``rules``.

    Every tensor is checked (presence, shape) before any device memory is touched; a problem
    fails with one line naming the file and tensor.
    """
    cfg, head = read_hf_config(path)
    overrides = {
        k: v
        for k, v in dict(param_dtype=param_dtype, dtype=dtype, remat_policy=remat_policy).items()
        if v is not None
    }
    cfg = cfg.replace(**overrides)
    model = ModelDef(cfg, head)
    reader = SafetensorsReader(path)
    shardings = model.shardings(mesh, rules)
    prefix, left_out = _tensor_prefix(path, reader)
    entries = weight_map(cfg, head, prefix)

    expected_names = set()
    for entry in entries:
        want = _get(model.abstract_params, entry.path).shape
        per_layer = want[1:] if entry.stacked else want
        if entry.per_expert:
            per_layer = per_layer[1:]
        layers = range(cfg.num_layers) if entry.stacked else [None]
        experts = range(cfg.num_experts) if entry.per_expert else [None]
        for i, j in ((i, j) for i in layers for j in experts):
            name = entry.hf_name.format(i=i, j=j)
            expected_names.add(name)
            if name not in reader:
                raise CheckpointError(f"{path}: tensor {name!r} is missing")
            stored = reader.get(name)
            try:
                view_shape = entry.to_ours(stored, cfg).shape
            except ValueError:
                view_shape = None
            if view_shape != per_layer:
                raise CheckpointError(
                    f"{reader.file_of(name)}: tensor {name!r} has shape {list(stored.shape)}, "
                    f"which does not fit parameter {'/'.join(entry.path)} {list(per_layer)}"
                )
    tied_heads = {"lm_head.weight", "language_model.lm_head.weight"}
    ignorable = tied_heads if cfg.tie_word_embeddings else set()
    unexpected = [
        k
        for k in reader
        if k not in expected_names
        and k not in ignorable
        and not k.endswith(_IGNORED_SUFFIXES)
        and not k.startswith(left_out)
    ]
    if unexpected:
        raise CheckpointError(
            f"{reader.file_of(unexpected[0])}: tensor {unexpected[0]!r} is not used by a "
            f"{cfg.architecture} {head} model ({len(unexpected)} unexpected tensors)"
        )

    np_dtype = np.dtype(ml_dtypes.bfloat16 if cfg.param_dtype == "bfloat16" else cfg.param_dtype)
    params: Params = {}
    for entry in entries:
        shape = _get(model.abstract_params, entry.path).shape

        def callback(index, entry=entry, shape=shape):
            if not entry.stacked:
                view = entry.to_ours(reader.get(entry.hf_name), cfg)
                return np.asarray(view[index], dtype=np_dtype)
            layers = range(shape[0])[index[0]]
            if entry.per_expert:  # (layers, experts, ...): this shard's experts of each layer
                experts = range(shape[1])[index[1]]
                return np.stack(
                    [
                        np.stack(
                            [
                                np.asarray(
                                    entry.to_ours(reader.get(entry.hf_name.format(i=i, j=j)), cfg)[
                                        index[2:]
                                    ],
                                    dtype=np_dtype,
                                )
                                for j in experts
                            ]
                        )
                        for i in layers
                    ]
                )
            pieces = [
                entry.to_ours(reader.get(entry.hf_name.format(i=i)), cfg)[index[1:]] for i in layers
            ]
            return np.stack([np.asarray(p, dtype=np_dtype) for p in pieces])

        array = jax.make_array_from_callback(shape, _get(shardings, entry.path), callback)
        _set(params, entry.path, array)
    return model, params


# ---------------------------------------------------------------------------------------------
# export
# ---------------------------------------------------------------------------------------------
def save_hf(
    model: ModelDef,
    params: Params,
    out_dir: str | os.PathLike,
    *,
    tokenizer_from: str | os.PathLike | None = None,
    max_shard_bytes: int = 5 * 1024**3,
    overwrite: bool = False,
) -> Path:
    """Write config.json + safetensors (sharded with an index past ``max_shard_bytes``).

    The directory is assembled next to ``out_dir`` and moved into place at the end, so an
    interrupted export never leaves a half-written checkpoint where a good one was. A LoRA
    model (jrlhf.models.lora) is written merged: HF checkpoints hold plain weights.
    """
    model, params = model.base, model.merge(params)
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise FileExistsError(f"{out_dir}: exists and is not empty (pass overwrite=True)")
    cfg = model.config
    tensors: dict[str, np.ndarray] = {}
    for entry in weight_map(cfg, model.head):
        try:
            value = to_host(_get(params, entry.path))
        except KeyError:
            raise KeyError(f"params lack {path_str(entry.path)}") from None
        if entry.per_expert:
            for i in range(cfg.num_layers):
                for j in range(cfg.num_experts):
                    tensors[entry.hf_name.format(i=i, j=j)] = np.ascontiguousarray(
                        entry.to_hf(value[i, j], cfg)
                    )
        elif entry.stacked:
            for i in range(cfg.num_layers):
                tensors[entry.hf_name.format(i=i)] = np.ascontiguousarray(
                    entry.to_hf(value[i], cfg)
                )
        else:
            tensors[entry.hf_name] = np.ascontiguousarray(entry.to_hf(value, cfg))
    if is_primary():
        _write_hf_dir(out_dir, tensors, model, tokenizer_from, max_shard_bytes)
    barrier(f"save_hf:{out_dir}")  # every process returns once the export is in place
    return out_dir


def _write_hf_dir(
    out_dir: Path,
    tensors: dict[str, np.ndarray],
    model: ModelDef,
    tokenizer_from: str | os.PathLike | None,
    max_shard_bytes: int,
) -> None:
    """Process 0's part of save_hf: stage the files beside ``out_dir``, then move them in."""
    cfg = model.config
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        shards: list[dict[str, np.ndarray]] = [{}]
        size = 0
        for name in sorted(tensors):
            nbytes = tensors[name].nbytes
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append({})
                size = 0
            shards[-1][name] = tensors[name]
            size += nbytes
        metadata = {"format": "pt"}
        if len(shards) == 1:
            save_file(shards[0], str(staging / "model.safetensors"), metadata=metadata)
        else:
            weight_map_json = {}
            for k, shard in enumerate(shards):
                fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(staging / fname), metadata=metadata)
                weight_map_json.update({name: fname for name in shard})
            total = sum(t.nbytes for t in tensors.values())
            (staging / INDEX_NAME).write_text(
                json.dumps(
                    {"metadata": {"total_size": total}, "weight_map": weight_map_json}, indent=2
                )
            )
        (staging / "config.json").write_text(json.dumps(config_to_hf(cfg, model.head), indent=2))
        if tokenizer_from is not None:
            for fname in _TOKENIZER_FILES:
                src = Path(tokenizer_from) / fname
                if src.exists():
                    shutil.copy2(src, staging / fname)
        if out_dir.exists():
            backup = out_dir.with_name(out_dir.name + ".old")
            shutil.rmtree(backup, ignore_errors=True)
            out_dir.rename(backup)
            staging.rename(out_dir)
            shutil.rmtree(backup, ignore_errors=True)
        else:
            staging.rename(out_dir)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
