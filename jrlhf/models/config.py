"""Model configuration for the decoder (Llama 2/3, Qwen2/2.5, Qwen3, Mistral, Gemma 2, Gemma 3, and
the mixture-of-experts Qwen3-MoE and Mixtral)."""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp

SUPPORTED_ARCHITECTURES = (
    "llama",
    "qwen2",
    "qwen3",
    "mistral",
    "gemma2",
    "gemma3",
    "qwen3_moe",
    "mixtral",
    "qwen2_moe",
)
# How a mixture-of-experts layer runs its experts (jrlhf.models.moe): "ragged" (tokens sorted by
# expert, grouped matmuls jax.lax.ragged_dot), "dense" (every expert on every token, combined by
# the routing weights: top_k / num_experts of the work is used), "auto" (see moe.choose_impl).
MOE_IMPLS = ("auto", "ragged", "dense")
# The MLP's gate activation: SiLU (SwiGLU) or GELU with the tanh approximation (GeGLU, Gemma's
# gelu_pytorch_tanh).
ACTIVATIONS = ("silu", "gelu_tanh")
# ModelConfig.layer_types entries (HF's names): a sliding layer attends over the last
# ``sliding_window`` positions, a full one over all of them.
LAYER_TYPES = ("full_attention", "sliding_attention")
MOE_ARCHITECTURES = ("qwen3_moe", "mixtral", "qwen2_moe")
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch")
LAYER_LOOPS = ("auto", "scan", "unroll")
ATTENTION_IMPLS = ("auto", "einsum", "cudnn")
FUSED_ATTENTION_DTYPES = ("bfloat16", "float16")
# layer_loop="auto" unrolls models up to this deep on CPU (compile time grows with the depth)
AUTO_UNROLL_LAYERS = 8
DTYPES = ("float32", "bfloat16", "float16")
PIPELINE_SCHEDULES = ("gpipe", "1f1b")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. ``rope_type`` is 'default', 'linear' or 'llama3'."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.rope_type not in ("default", "linear", "llama3"):
            raise ValueError(
                f"rope_type {self.rope_type!r} is not supported (use default, linear or llama3)"
            )


# sizes a model cannot have fewer than one of, and those where 0 means "derived" or "off"
POSITIVE_SIZES = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "max_position_embeddings",
)
NONNEGATIVE_SIZES = (
    "head_dim",
    "sliding_window",
    "query_pre_attn_scalar",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_size",
    "pipeline_microbatches",
)
POSITIVE_REALS = ("rope_theta", "rms_norm_eps")
# 0 means "off" (soft-capping) or "derived" (rope_local_theta: rope_theta)
NONNEGATIVE_REALS = (
    "attn_logit_softcap",
    "final_logit_softcap",
    "rope_local_theta",
    "router_aux_loss_coef",
    "router_z_loss_coef",
)


def value_problem(name: str, value: Any) -> str | None:
    """Why ``value`` cannot be the model field ``name`` (a size below its minimum, a
    non-positive or non-finite theta or epsilon), or None; the type is checked elsewhere."""
    if name in POSITIVE_SIZES or name in NONNEGATIVE_SIZES:
        low = 1 if name in POSITIVE_SIZES else 0
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
            return f"{name} must be an integer >= {low} (got {value!r})"
    real = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if name in POSITIVE_REALS and not (real and 0 < value < math.inf):
        return f"{name} must be a finite number > 0 (got {value!r})"
    if name in NONNEGATIVE_REALS and not (real and 0 <= value < math.inf):
        return f"{name} must be a finite number >= 0 (got {value!r})"
    return None


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of one decoder-only transformer.

    ``param_dtype`` is how weights are stored; ``dtype`` is the compute dtype of matmuls
    (norms, softmax and logits are always computed in float32).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = 0  # 0 means hidden_size // num_heads
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    rms_norm_eps: float = 1e-6
    qkv_bias: bool = False
    tie_word_embeddings: bool = False
    sliding_window: int = 0  # 0 disables sliding-window attention
    # Which layers the window applies to, one entry per layer (LAYER_TYPES; Gemma 2 alternates,
    # Gemma 3 has 5 sliding layers to 1 full); empty: every layer (Mistral). Per-layer choices
    # (window, RoPE table) are taken from the layer index, under the scanned loop as unrolled.
    layer_types: tuple[str, ...] = ()
    # RoPE base of the sliding layers, with no frequency scaling (Gemma 3's rope_local_base_freq);
    # 0: the same RoPE as the full layers.
    rope_local_theta: float = 0.0
    # RMSNorm over head_dim of each query and key head before RoPE (Qwen3, Gemma 3).
    qk_norm: bool = False
    # RMSNorms scale by (1 + weight), in float32 before the cast (Gemma); the weight is stored as
    # the checkpoint stores it.
    norm_unit_offset: bool = False
    # Norms on the attention and MLP outputs too, before each residual add: four per layer
    # (Gemma 2 and 3).
    post_norms: bool = False
    hidden_act: str = "silu"  # ACTIVATIONS
    # Embeddings times sqrt(hidden_size), in the compute dtype (Gemma).
    scale_embeddings: bool = False
    # The attention scale is query_pre_attn_scalar ** -0.5 (Gemma); 0: head_dim ** -0.5.
    query_pre_attn_scalar: int = 0
    # cap * tanh(x / cap) of the attention scores (Gemma 2) and of the final logits; 0 is off.
    attn_logit_softcap: float = 0.0
    final_logit_softcap: float = 0.0
    max_position_embeddings: int = 2048
    architecture: str = "llama"
    param_dtype: str = "float32"
    dtype: str = "float32"
    remat_policy: str = "none"
    # How full-sequence passes (training, scoring) loop over the layers: "scan" (lax.scan over
    # the stacked weights; compile time independent of depth) or "unroll" (one copy of the layer
    # program per layer, static weight slices: on CPU the scan zero-fills, writes and re-slices
    # its per-layer residual and gradient stacks, which the unrolled program does not do; for
    # shallow models). "auto": unroll on CPU for models of at most AUTO_UNROLL_LAYERS layers
    # without remat, scan otherwise (see unroll_layers). The decode engine chooses its own
    # (EngineConfig.unroll_layers).
    layer_loop: str = "auto"
    # Attention of full-sequence passes: "einsum" (masked_attention: float32 scores and
    # probabilities materialized, kept for the backward pass), "cudnn" (fused_attention: cuDNN
    # flash attention, GPU only, bfloat16/float16 compute), or "auto": cudnn on a GPU backend
    # with a 16-bit compute dtype, einsum otherwise (see fused_attention). Decode uses the
    # paged kernels whatever this says.
    attention: str = "auto"
    # Mixture of experts (0 experts: a dense MLP in every layer). Every layer's MLP is then
    # ``num_experts`` SwiGLU experts of width ``moe_intermediate_size`` (0: intermediate_size),
    # of which a softmax router picks ``num_experts_per_tok`` per token; ``norm_topk_prob``
    # renormalizes the chosen ones' probabilities to sum to 1 (Mixtral always; Qwen3-MoE per
    # checkpoint). No capacity: every token reaches all of its experts (dropless).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    # A shared expert every token runs through besides its routed ones, this wide, its output
    # scaled by sigmoid(x @ shared_expert_gate) (Qwen2-MoE); 0: none (Qwen3-MoE, Mixtral).
    shared_expert_size: int = 0
    moe_impl: str = "auto"  # MOE_IMPLS
    # Training options (the actor's loss adds them, its metrics report them): the load-balancing
    # loss (Switch Transformer: num_experts * sum_e tokens_fraction_e * mean_prob_e, averaged
    # over layers) and the router z-loss (mean logsumexp(router logits)^2, ST-MoE).
    router_aux_loss_coef: float = 0.0
    router_z_loss_coef: float = 0.0
    # Pipeline parallelism (jrlhf.models.pipeline): when a pass's mesh and rules split the
    # layers over a ``stage`` axis, its batch goes through the stages in this many
    # micro-batches (rows padded up to a multiple); 0: as many as there are stages. More
    # micro-batches shrink the bubble, (S-1)/(M+S-1) of the stage time.
    pipeline_microbatches: int = 0
    # How train steps schedule them (PIPELINE_SCHEDULES): "gpipe" (autodiff through all the
    # forwards, then all the backwards: every micro-batch's activations kept), "1f1b" (each
    # micro-batch's backward right after its forward leaves the last stage, at most 2S - 1 in
    # flight a stage; its rows must split evenly). Scoring passes are forwards only: GPipe.
    pipeline_schedule: str = "gpipe"
    initializer_range: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None

    def __post_init__(self):
        for name in (*POSITIVE_SIZES, *NONNEGATIVE_SIZES, *POSITIVE_REALS, *NONNEGATIVE_REALS):
            problem = value_problem(name, getattr(self, name))
            if problem:
                raise ValueError(problem)
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture {self.architecture!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        if self.head_dim == 0:
            if self.hidden_size % self.num_heads:
                raise ValueError(
                    f"hidden_size {self.hidden_size} is not divisible by num_heads "
                    f"{self.num_heads}; set head_dim explicitly"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.remat_policy not in REMAT_POLICIES:
            raise ValueError(
                f"remat_policy {self.remat_policy!r} unknown (use one of {REMAT_POLICIES})"
            )
        if self.layer_loop not in LAYER_LOOPS:
            raise ValueError(f"layer_loop {self.layer_loop!r} unknown (use one of {LAYER_LOOPS})")
        if self.layer_loop == "unroll" and self.remat_policy != "none":
            raise ValueError(
                f"layer_loop 'unroll' runs without remat; remat_policy {self.remat_policy!r} "
                "needs layer_loop 'scan'"
            )
        if self.pipeline_schedule not in PIPELINE_SCHEDULES:
            raise ValueError(
                f"pipeline_schedule {self.pipeline_schedule!r} unknown "
                f"(use one of {PIPELINE_SCHEDULES})"
            )
        if self.attention not in ATTENTION_IMPLS:
            raise ValueError(f"attention {self.attention!r} unknown (use one of {ATTENTION_IMPLS})")
        if self.attention == "cudnn" and self.dtype not in FUSED_ATTENTION_DTYPES:
            raise ValueError(
                f"attention 'cudnn' needs a 16-bit compute dtype {FUSED_ATTENTION_DTYPES}, "
                f"got dtype {self.dtype!r}"
            )
        for field in ("param_dtype", "dtype"):
            if getattr(self, field) not in DTYPES:
                raise ValueError(f"{field} {getattr(self, field)!r} unknown (use one of {DTYPES})")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {self.hidden_act!r} unknown (use one of {ACTIVATIONS})")
        if isinstance(self.layer_types, list):
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if self.layer_types:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(
                    f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers"
                )
            unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if unknown:
                raise ValueError(f"layer_types {unknown[0]!r} unknown (use one of {LAYER_TYPES})")
            if "sliding_attention" in self.layer_types and not self.sliding_window:
                raise ValueError("layer_types has sliding_attention layers but sliding_window is 0")
        if self.attention == "cudnn" and self.attn_logit_softcap:
            raise ValueError(
                "attention 'cudnn' cannot soft-cap attention scores (attn_logit_softcap "
                f"{self.attn_logit_softcap}); use attention 'einsum' or 'auto'"
            )
        if self.moe_impl not in MOE_IMPLS:
            raise ValueError(f"moe_impl {self.moe_impl!r} unknown (use one of {MOE_IMPLS})")
        if self.num_experts:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ValueError(
                    f"num_experts_per_tok must be in 1..num_experts={self.num_experts} "
                    f"(got {self.num_experts_per_tok})"
                )
        elif (
            self.num_experts_per_tok
            or self.shared_expert_size
            or self.router_aux_loss_coef
            or self.router_z_loss_coef
        ):
            raise ValueError(
                "num_experts is 0 (a dense model) but num_experts_per_tok, shared_expert_size "
                "or a router loss coefficient is set"
            )
        if self.architecture in MOE_ARCHITECTURES and not self.num_experts:
            raise ValueError(f"architecture {self.architecture!r} needs num_experts >= 1")
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))

    @property
    def jnp_param_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.param_dtype)

    @property
    def jnp_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)

    @property
    def eos_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    @property
    def unroll_layers(self) -> bool:
        """Whether full-sequence passes run the layers unrolled on this process's backend
        (``unrolls_layers_on``)."""
        return self.unrolls_layers_on(jax.default_backend() == "cpu")

    def unrolls_layers_on(self, cpu: bool) -> bool:
        """Whether full-sequence passes run the layers unrolled on a CPU backend (``cpu``) or an
        accelerator: ``layer_loop`` "unroll", or "auto" on CPU for a model of at most
        ``AUTO_UNROLL_LAYERS`` layers without remat (measured on 4 layers: the GRPO train step
        21% faster than under the scan). The cost model asks it for a device it only has a
        profile of (jrlhf.placement.estimator)."""
        if self.layer_loop == "auto":
            return cpu and self.remat_policy == "none" and self.num_layers <= AUTO_UNROLL_LAYERS
        return self.layer_loop == "unroll"

    @property
    def fused_attention(self) -> bool:
        """Whether full-sequence passes run cuDNN flash attention: ``attention`` "cudnn", or
        "auto" on a GPU backend with a bfloat16/float16 compute dtype."""
        if self.attention == "auto":
            # cuDNN's attention has no soft-capping of the scores: those models take the einsum
            return (
                jax.default_backend() == "gpu"
                and self.dtype in FUSED_ATTENTION_DTYPES
                and not self.attn_logit_softcap
            )
        return self.attention == "cudnn"

    @property
    def layer_windows(self) -> tuple[int, ...]:
        """Each layer's sliding window (0: full attention), from ``layer_types``."""
        if not self.layer_types:
            return (self.sliding_window,) * self.num_layers
        return tuple(
            self.sliding_window if kind == "sliding_attention" else 0 for kind in self.layer_types
        )

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def expert_size(self) -> int:
        """Each expert's SwiGLU width (``moe_intermediate_size``, or intermediate_size)."""
        return self.moe_intermediate_size or self.intermediate_size

    @property
    def query_scale(self) -> float:
        """What the queries are multiplied by so that the kernels' ``head_dim ** -0.5`` makes
        the model's attention scale (``query_pre_attn_scalar``); 1.0 for most models."""
        if not self.query_pre_attn_scalar:
            return 1.0
        return math.sqrt(self.head_dim / self.query_pre_attn_scalar)

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def num_params(self, with_lm_head: bool = True) -> int:
        """Parameter count computed from the shapes (no allocation)."""
        e, f, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = e * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        if self.qkv_bias:
            attn += d * (self.num_heads + 2 * self.num_kv_heads)
        norms = (4 if self.post_norms else 2) * e + (2 * d if self.qk_norm else 0)
        if self.num_experts:
            mlp = self.num_experts * 3 * e * self.expert_size + e * self.num_experts
            if self.shared_expert_size:  # its three kernels and its gate's one column
                mlp += 3 * e * self.shared_expert_size + e
        else:
            mlp = 3 * e * f
        per_layer = attn + mlp + norms
        total = self.vocab_size * e + self.num_layers * per_layer + e
        if with_lm_head and not self.tie_word_embeddings:
            total += self.vocab_size * e
        return total

    def num_active_params(self, with_lm_head: bool = True) -> int:
        """Parameters one token runs through: ``num_params`` with only ``num_experts_per_tok``
        of each layer's experts (the router counted whole); ``num_params`` for dense models."""
        total = self.num_params(with_lm_head)
        idle = self.num_experts - self.num_experts_per_tok
        return total - self.num_layers * idle * 3 * self.hidden_size * self.expert_size

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        data = json.loads(text)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown model config field(s): {', '.join(unknown)}")
        return cls(**data)


def remat_policy(name: str):
    """Map a config name onto a ``jax.checkpoint`` policy (None means no remat)."""
    policies = jax.checkpoint_policies
    return {
        "none": None,
        "full": policies.nothing_saveable,
        "dots": policies.checkpoint_dots,
        "dots_no_batch": policies.dots_with_no_batch_dims_saveable,
    }[name]


def tiny_config(**overrides: Any) -> ModelConfig:
    """A small Llama-3-style config used by demos, tests and the default job."""
    base = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        rope_theta=10000.0,
        max_position_embeddings=512,
    )
    base.update(overrides)
    return ModelConfig(**base)
