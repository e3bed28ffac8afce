"""A decoder-only transformer in Flax NNX covering Llama 2/3, Qwen2/2.5, Qwen3, Mistral, Gemma 2
and Gemma 3 (text) configs.

Every parameter carries logical axis names in its ``axes`` metadata; jrlhf/meshes turns them into
shardings. Layers are created stacked (one leading ``layers`` dimension) and run under
``lax.scan`` so compile time does not grow with depth.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jrlhf.kernels.panels import fits, panel_matmul, panel_matmuls, to_panels
from jrlhf.meshes.context import constrain, layer_stages
from jrlhf.models import lora as lora_lib
from jrlhf.models import pipeline
from jrlhf.models.attention import (
    AttendFn,
    aligned_attend,
    dense_attend,
    fused_attention_fits,
    layer_choice,
    select_choice,
)
from jrlhf.models.config import ModelConfig, remat_policy
from jrlhf.models.moe import MoE, gated_activation
from jrlhf.models.rope import apply_rope, rope_kinds, rope_tables

HEADS = ("lm", "value")


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def token_matmul(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """``x @ kernel`` over ``x``'s last axis, its leading (batch, length) axes flattened into one
    token axis for the product. XLA:CPU differentiates a 3-D ``bte,ef->btf`` einsum into a weight
    gradient whose activation operand it first writes transposed, in a strided copy fused with
    the elementwise backward (a fifth of a small model's train step); the 2-D product's
    gradient reads it in place. Leading axes merge major-first, so a batch sharding carries over.
    """
    lead = x.shape[:-1]
    out = jnp.matmul(x.reshape(-1, x.shape[-1]), kernel)
    return out.reshape(*lead, kernel.shape[-1])


def project(x: jax.Array, kernel: jax.Array, n_in: int = 1) -> jax.Array:
    """``x``'s last axis contracted with ``kernel``'s ``n_in`` input axes (merged), the output's
    last axis the kernel's output axes merged. The kernel is input-major as the modules store it,
    or in the layout of the unrolled ``LayerWeights`` being run (decode on CPU): output-major, or
    packed panels (``jrlhf.kernels.panels``)."""
    layout = _LAYOUT.get()
    if isinstance(kernel, lora_lib.Adapted):
        # LoRA (jrlhf.models.lora): the base product plus the thin low-rank one. Decode runs
        # merged weights in its own layouts, so adapters only ever meet in-major kernels.
        if layout != "in_major":
            raise ValueError(
                f"LoRA adapters run unmerged in the in-major layout only, not {layout}"
            )
        base = project(x, kernel.kernel, n_in)
        return base + kernel.delta(x, token_matmul).astype(base.dtype)
    if layout == "panels":
        return panel_matmul(x, kernel)
    if layout == "out_major":
        return left_matmul(kernel.reshape(-1, math.prod(kernel.shape[kernel.ndim - n_in :])), x)
    return token_matmul(x, kernel.reshape(math.prod(kernel.shape[:n_in]), -1))


def project_all(x: jax.Array, kernels: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
    """``project(x, kernel)`` for each of ``kernels`` (one input axis each): with packed panels
    one native call for all of them (they read the same rows), else one product each."""
    if _LAYOUT.get() == "panels" and not any(isinstance(k, lora_lib.Adapted) for k in kernels):
        return panel_matmuls(x, kernels)
    return tuple(project(x, kernel) for kernel in kernels)


def left_matmul(matrix: jax.Array, x: jax.Array, out_dtype=None) -> jax.Array:
    """``x @ matrix.T`` computed as ``(matrix @ x.T).T``, the (out, in) weight the left operand."""
    lead = x.shape[:-1]
    out = jax.lax.dot_general(
        matrix,
        x.reshape(-1, x.shape[-1]),
        (((1,), (1,)), ((), ())),
        preferred_element_type=out_dtype,
    )
    # The barrier keeps XLA from folding the transpose back into the product, which would make
    # the weight the packed right operand again.
    out = jax.lax.optimization_barrier(out).T
    return out.reshape(*lead, matrix.shape[0])


# Projection kernels by name, with how many of their leading axes are input features.
PROJECTIONS = {
    "q_kernel": 1,
    "k_kernel": 1,
    "v_kernel": 1,
    "o_kernel": 2,
    "gate_kernel": 1,
    "up_kernel": 1,
    "down_kernel": 1,
}

# How the unrolled layers' projection kernels are stored (see LayerWeights).
WEIGHT_LAYOUTS = ("in_major", "out_major", "panels")

# The layout of the projection kernels the layers being traced read (see LayerWeights).
_LAYOUT = contextvars.ContextVar("jrlhf_kernel_layout", default="in_major")

# The layers' output (before the final norm) that ``Transformer.hidden`` returns instead of
# running the layers (see ``layers_output``).
_LAYERS_OUTPUT = contextvars.ContextVar("jrlhf_layers_output", default=None)


@contextlib.contextmanager
def layers_output(x_bte: jax.Array) -> Iterator[None]:
    """Inside, ``Transformer.hidden`` skips the embedding and the layers and returns
    ``final_norm(x_bte)``: a schedule that runs the layers itself (the 1F1B pipeline step,
    jrlhf.runtime.pipeline_step) differentiates the caller's loss from the layers' output on."""
    token = _LAYERS_OUTPUT.set(x_bte)
    try:
        yield
    finally:
        _LAYERS_OUTPUT.reset(token)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerWeights:
    """One pure parameter dict per layer, for running the layers unrolled (``unstack_layers``).

    ``layout`` (``WEIGHT_LAYOUTS``) is how every projection kernel (``PROJECTIONS``) is stored:

    * ``in_major``: as the modules store it;
    * ``out_major``: output axes first, like a torch ``Linear`` weight, multiplied as the left
      operand. XLA:CPU packs a product's right operand, so ``x @ W`` with a few token rows (a
      decode step) repacks the whole weight at every call; ``W_out_major @ x.T`` streams it
      instead (the decode step's matmuls at 16 rows of the bench model: 11 ms against 20 ms);
    * ``panels``: packed for the few-row matmul kernel (``jrlhf.kernels.panels.to_panels``),
      which streams each weight once (float32 on a single-device CPU mesh: it is one custom
      call, which XLA does not partition).

    ``head`` is the LM head for ``Transformer.logits``: (vocab, embed) when out-major (or
    panels whose vocab does not pack), panels of the (embed, vocab) head when packed.
    """

    layers: tuple[Any, ...]
    layout: str = dataclasses.field(default="in_major", metadata=dict(static=True))
    head: jax.Array | None = None


def _relayout(layout: str, path, leaf: jax.Array) -> jax.Array:
    n_in = PROJECTIONS.get(getattr(path[-1], "key", None))
    if n_in is None or layout == "in_major":
        return leaf
    if layout == "out_major":
        return jnp.transpose(leaf, (*range(n_in, leaf.ndim), *range(n_in)))
    return to_panels(leaf.reshape(math.prod(leaf.shape[:n_in]), -1))


def unstack_layers(layers: Any, layout: str = "in_major") -> LayerWeights:
    """Per-layer parameter dicts from the stacked ``params["layers"]`` (a copy of each weight),
    with the projection kernels in ``layout`` (``WEIGHT_LAYOUTS``)."""
    if layout not in WEIGHT_LAYOUTS:
        raise ValueError(f"weight layout {layout!r} unknown (use one of {WEIGHT_LAYOUTS})")
    num = jax.tree.leaves(layers)[0].shape[0]
    per_layer = tuple(jax.tree.map(lambda a, i=i: a[i], layers) for i in range(num))
    relayout = functools.partial(_relayout, layout)
    per_layer = tuple(jax.tree_util.tree_map_with_path(relayout, p) for p in per_layer)
    return LayerWeights(per_layer, layout)


_unstack_program = jax.jit(unstack_layers, static_argnames=("layout",))


def panels_fit(cfg: ModelConfig) -> bool:
    """Whether every layer projection of ``cfg`` packs into whole panels (``layout="panels"``)."""
    outs = (
        cfg.num_heads * cfg.head_dim,
        cfg.num_kv_heads * cfg.head_dim,
        cfg.hidden_size,
        cfg.intermediate_size,
    )
    return all(fits(n) for n in outs)


def decode_weights(params: Any, layout: str) -> LayerWeights:
    """``unstack_layers`` of an LM's parameters (one compiled copy program) and, unless
    ``in_major``, the LM head in the same layout: out-major the tied embedding itself or a
    transposed copy of ``lm_head``; as panels a packed copy (out-major where the vocabulary does
    not pack)."""
    weights = _unstack_program(params["layers"], layout=layout)
    if layout == "in_major":
        return weights
    tied = "lm_head" not in params
    if layout == "panels" and fits(params["embedding"].shape[0]):
        # Packed in one program from lm_head (embed, vocab) or the tied embedding (vocab,
        # embed): an eager transpose first, and one back for the packing, took 5-8 ms of the
        # 31 ms this function took for bench decode's model (a 16 MB head), now 19 ms.
        head = _head_panels_program(params["embedding" if tied else "lm_head"], tied)
    else:
        head = params["embedding"] if tied else params["lm_head"].T
    return dataclasses.replace(weights, head=head)


@functools.partial(jax.jit, static_argnums=1)
def _head_panels_program(head: jax.Array, vocab_major: bool) -> jax.Array:
    return to_panels(head.T if vocab_major else head)


@contextlib.contextmanager
def _kernel_layout(layout: str) -> Iterator[None]:
    token = _LAYOUT.set(layout)
    try:
        yield
    finally:
        _LAYOUT.reset(token)


def _kernel(module: nnx.Module, name: str, dtype) -> Any:
    """The projection ``name``'s kernel in compute ``dtype``, paired with its LoRA adapter
    where the model has one (jrlhf.models.lora.Adapted; ``project`` computes both)."""
    return lora_lib.adapted(
        module, name, getattr(module, f"{name}_kernel")[...].astype(dtype), dtype
    )


def _param(rngs: nnx.Rngs, cfg: ModelConfig, shape, axes, init: str = "normal") -> nnx.Param:
    dtype = cfg.jnp_param_dtype
    if init == "normal":
        value = cfg.initializer_range * jax.random.normal(rngs.params(), shape, jnp.float32)
        value = value.astype(dtype)
    elif init == "ones":
        value = jnp.ones(shape, dtype)
    else:
        value = jnp.zeros(shape, dtype)
    return nnx.Param(value, axes=tuple(axes))


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis (``dim``: hidden_size by default; head_dim for q/k norms)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dim: int | None = None):
        self.eps = cfg.rms_norm_eps
        self.dtype = cfg.jnp_dtype
        self.unit_offset = cfg.norm_unit_offset
        init = "zeros" if cfg.norm_unit_offset else "ones"
        self.scale = _param(rngs, cfg, (dim or cfg.hidden_size,), ("norm",), init=init)

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.unit_offset:  # Gemma: (1 + weight) in float32, then the cast
            return (normed * (1.0 + self.scale[...].astype(jnp.float32))).astype(self.dtype)
        return self.scale[...].astype(self.dtype) * normed.astype(self.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        e, h, k, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.dtype = cfg.jnp_dtype
        self.head_dim = d
        self.q_kernel = _param(rngs, cfg, (e, h, d), ("embed", "heads", "head_dim"))
        self.k_kernel = _param(rngs, cfg, (e, k, d), ("embed", "kv_heads", "head_dim"))
        self.v_kernel = _param(rngs, cfg, (e, k, d), ("embed", "kv_heads", "head_dim"))
        self.o_kernel = _param(rngs, cfg, (h, d, e), ("heads", "head_dim", "embed"))
        self.query_scale = cfg.query_scale
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg, rngs=rngs, dim=d)
            self.k_norm = RMSNorm(cfg, rngs=rngs, dim=d)
        self.use_bias = cfg.qkv_bias
        if cfg.qkv_bias:
            self.q_bias = _param(rngs, cfg, (h, d), ("heads", "head_dim"), init="zeros")
            self.k_bias = _param(rngs, cfg, (k, d), ("kv_heads", "head_dim"), init="zeros")
            self.v_bias = _param(rngs, cfg, (k, d), ("kv_heads", "head_dim"), init="zeros")

    def qkv(self, x_bte, cos, sin):
        dt = self.dtype
        b, t = x_bte.shape[:2]

        q, k, v = (
            out.reshape(b, t, -1, self.head_dim)  # (b, t, heads, head_dim)
            for out in project_all(x_bte, [_kernel(self, name, dt) for name in ("q", "k", "v")])
        )
        if self.use_bias:
            q = q + self.q_bias[...].astype(dt)
            k = k + self.k_bias[...].astype(dt)
            v = v + self.v_bias[...].astype(dt)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, cos, sin, self.query_scale)
        q = constrain(q, ("batch", "length", "act_heads", "head_dim"))
        k = constrain(apply_rope(k, cos, sin), ("batch", "length", "act_kv_heads", "head_dim"))
        v = constrain(v, ("batch", "length", "act_kv_heads", "head_dim"))
        return q, k, v

    def out(self, attn_bthd):
        # One merged (heads * head_dim) contraction: with two contracting dims XLA:CPU transposed
        # both operands (copying the whole kernel at every decode step) before the matmul.
        b, t, h, d = attn_bthd.shape
        return project(attn_bthd.reshape(b, t, h * d), _kernel(self, "o", self.dtype), 2)


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        e, f = cfg.hidden_size, cfg.intermediate_size
        self.dtype = cfg.jnp_dtype
        self.hidden_act = cfg.hidden_act
        self.gate_kernel = _param(rngs, cfg, (e, f), ("embed", "mlp"))
        self.up_kernel = _param(rngs, cfg, (e, f), ("embed", "mlp"))
        self.down_kernel = _param(rngs, cfg, (f, e), ("mlp", "embed"))

    def __call__(self, x_bte):
        dt = self.dtype
        gate, up = project_all(x_bte, (_kernel(self, "gate", dt), _kernel(self, "up", dt)))
        hidden = constrain(
            gated_activation(gate, up, self.hidden_act), ("batch", "length", "act_mlp")
        )
        return project(hidden, _kernel(self, "down", dt))


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.input_norm = RMSNorm(cfg, rngs=rngs)
        self.attn = Attention(cfg, rngs=rngs)
        self.post_attn_norm = RMSNorm(cfg, rngs=rngs)  # the MLP's input norm
        self.moe = cfg.is_moe
        self.mlp = MoE(cfg, rngs=rngs, param=_param) if cfg.is_moe else MLP(cfg, rngs=rngs)
        self.post_norms = cfg.post_norms
        if cfg.post_norms:  # Gemma: the attention's and the MLP's outputs normed too
            self.attn_out_norm = RMSNorm(cfg, rngs=rngs)
            self.mlp_out_norm = RMSNorm(cfg, rngs=rngs)

    def __call__(self, x_bte, cos, sin, attend: AttendFn, layer_idx, cache):
        """(new hidden states, cache, routing stats): the stats are a routed layer's
        (jrlhf.models.moe: router logits and chosen experts per token), {} for a dense one."""
        q, k, v = self.attn.qkv(self.input_norm(x_bte), cos, sin)
        attn, cache = attend(q, k, v, layer_idx, cache)
        out = self.attn.out(attn)
        x_bte = x_bte + (self.attn_out_norm(out) if self.post_norms else out)
        stats: dict[str, jax.Array] = {}
        if self.moe:
            out, stats = self.mlp(self.post_attn_norm(x_bte))
        else:
            out = self.mlp(self.post_attn_norm(x_bte))
        x_bte = x_bte + (self.mlp_out_norm(out) if self.post_norms else out)
        return constrain(x_bte, ("batch", "length", "act_embed")), cache, stats


def _stacked_layers(cfg: ModelConfig, rngs: nnx.Rngs) -> DecoderLayer:
    """One DecoderLayer whose parameters have a leading ``layers`` dimension."""
    keys = jax.random.split(rngs.params(), cfg.num_layers)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: DecoderLayer(cfg, rngs=nnx.Rngs(0))))
    state = jax.vmap(lambda key: nnx.state(DecoderLayer(cfg, rngs=nnx.Rngs(params=key))))(keys)
    for _, variable in nnx.to_flat_state(state):
        variable.set_metadata("axes", ("layers", *variable.get_metadata()["axes"]))
    return nnx.merge(graphdef, state)


class Transformer(nnx.Module):
    """Decoder with either a language-model head (``head="lm"``) or a scalar value head."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        head: str = "lm",
        rngs: nnx.Rngs,
        lora: lora_lib.LoraConfig | None = None,
    ):
        if head not in HEADS:
            raise ValueError(f"head {head!r} unknown (use one of {HEADS})")
        self.config = cfg
        self.head = head
        self.embedding = _param(rngs, cfg, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"))
        self.layers = _stacked_layers(cfg, rngs)
        self.final_norm = RMSNorm(cfg, rngs=rngs)
        if head == "lm" and not cfg.tie_word_embeddings:
            self.lm_head = _param(rngs, cfg, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"))
        if head == "value":
            self.value_head = _param(rngs, cfg, (cfg.hidden_size, 1), ("embed", None))
        if lora is not None:  # last: the base draws the same numbers as without adapters
            lora_lib.attach(self.layers, lora, rngs.params())

    # -- pieces, used by the decode engine -------------------------------------------------------
    def embed(self, tokens_bt: jax.Array) -> jax.Array:
        dt = self.config.jnp_dtype
        x = jnp.take(self.embedding[...], tokens_bt, axis=0).astype(dt)
        if self.config.scale_embeddings:  # Gemma: by sqrt(hidden_size), rounded to the dtype
            x = x * jnp.asarray(self.config.hidden_size**0.5, dt)
        return constrain(x, ("batch", "length", "act_embed"))

    def run_layers(
        self,
        x_bte,
        positions_bt,
        attend: AttendFn,
        cache: Any = None,
        layer_params: LayerWeights | None = None,
        with_stats: bool = False,
    ):
        """Run the layers; ``attend`` sees (q, k, v, layer_idx, cache) per layer, ``layer_idx``
        a Python int in the unrolled loop, a traced int32 under the scan (per-layer choices go
        through ``layer_choice``, static where the index is).

        The stacked layers run under ``lax.scan`` or unrolled over static slices
        (``ModelConfig.layer_loop``; by default unrolled for shallow models on CPU).
        ``layer_params`` (one pure parameter dict per layer, see ``unstack_layers``) runs them
        unrolled instead, with the layer index a constant: decode uses this on CPU, where the
        scan's per-layer dynamic slice of every stacked weight is materialised as a copy before
        each matmul, doubling the weight traffic that bounds a decode step.

        Returns (final normed hidden, cache), and with ``with_stats`` a third item: the routed
        layers' stats (jrlhf.models.moe) stacked over layers, {} for a dense model.
        """
        graphdef, state = nnx.split(self.layers)
        if layer_params is None and self.config.unroll_layers:
            layer_params = unstack_layers(nnx.to_pure_dict(state))
        x_bte, cache, stacked = self.layer_loop(
            graphdef, state, x_bte, positions_bt, attend, cache, layer_params
        )
        out = self.final_norm(x_bte), cache
        return (*out, stacked) if with_stats else out

    def layer_loop(
        self,
        graphdef,
        state,
        x_bte,
        positions_bt,
        attend: AttendFn,
        cache: Any = None,
        layer_params: LayerWeights | None = None,
        first_layer: Any = 0,
    ):
        """Run the stacked layers of ``state`` (all of the model's, or a pipeline stage's run of
        consecutive ones starting at ``first_layer``: a traced index under the pipeline's
        vmap over stages) unrolled over ``layer_params`` if given, else under ``lax.scan``;
        (the output before the final norm, cache, the routing stats stacked over the layers).
        See ``run_layers``."""
        tables, kinds = rope_tables(positions_bt, self.config), rope_kinds(self.config)
        if layer_params is not None:
            per_layer = []
            with _kernel_layout(layer_params.layout):
                for k, params in enumerate(layer_params.layers):
                    idx = first_layer + k
                    layer_state = jax.tree.map(lambda v: v, state, is_leaf=_is_variable)
                    nnx.replace_by_pure_dict(layer_state, params)
                    layer = nnx.merge(graphdef, layer_state)
                    options, which = layer_choice(kinds, idx)
                    cos, sin = select_choice([tables[o] for o in options], which)
                    with lora_lib.layer(idx):
                        x_bte, cache, stats = layer(x_bte, cos, sin, attend, idx, cache)
                    per_layer.append(stats)
            return x_bte, cache, jax.tree.map(lambda *xs: jnp.stack(xs), *per_layer)

        def body(carry, layer_state):
            x, cache, idx = carry
            layer = nnx.merge(graphdef, layer_state)
            options, which = layer_choice(kinds, idx)
            cos, sin = select_choice([tables[k] for k in options], which)
            with lora_lib.layer(idx):
                x, cache, stats = layer(x, cos, sin, attend, idx, cache)
            return (x, cache, idx + 1), stats

        policy = remat_policy(self.config.remat_policy)
        if self.config.remat_policy != "none":
            body = jax.checkpoint(body, policy=policy, prevent_cse=False)
        first = jnp.asarray(first_layer, jnp.int32)
        (x_bte, cache, _), stacked = jax.lax.scan(body, (x_bte, cache, first), state)
        return x_bte, cache, stacked

    def logits(self, hidden_bte: jax.Array, weights: LayerWeights | None = None) -> jax.Array:
        """float32 logits (..., vocab) from final hidden states (by ``weights.head`` if given),
        soft-capped where the model says (``final_logit_softcap``)."""
        dt = self.config.jnp_dtype
        if weights is not None and weights.head is not None:
            if weights.head.ndim == 3:  # panels
                out = panel_matmul(hidden_bte, weights.head)
            else:
                out = left_matmul(weights.head.astype(dt), hidden_bte, jnp.float32)
        else:
            if self.config.tie_word_embeddings:
                kernel = self.embedding[...].astype(dt).T
            else:
                kernel = self.lm_head[...].astype(dt)
            out = jnp.einsum(
                "...e,ev->...v", hidden_bte, kernel, preferred_element_type=jnp.float32
            )
        cap = self.config.final_logit_softcap
        return cap * jnp.tanh(out / cap) if cap else out

    def values(self, hidden_bte: jax.Array) -> jax.Array:
        """float32 scalar per position (..., ) from final hidden states."""
        kernel = self.value_head[...].astype(self.config.jnp_dtype)
        out = jnp.einsum("...e,eo->...o", hidden_bte, kernel, preferred_element_type=jnp.float32)
        return out[..., 0]

    def hidden(
        self,
        tokens_bt,
        positions_bt=None,
        segment_ids_bt=None,
        one_segment=False,
        with_stats: bool = False,
    ):
        """Final normalized hidden states (B, T, E) for a full sequence; with ``with_stats``
        (hidden, routing stats): a routed model's per-layer router logits (L, B, T, X) and
        chosen experts (L, B, T, k) (jrlhf.models.moe), {} for a dense one.

        ``one_segment`` says the rows are laid out as jrlhf.data.batch.pack lays them out: at
        most one segment each, its tokens contiguous at positions counting from 0. With fused
        attention (and no sliding window) such rows run shifted to start at column 0, under
        cuDNN's own causal mask instead of a bias built from the (position, segment) mask
        (``aligned_causal_attention``); the hidden states come back in the rows' own columns.
        The real tokens' states are those of the masked form.

        Under an activation-sharding context whose rules split the layers over a ``stage``
        axis, the layers run as a pipeline (``pipelined_layers``, docs/pipelines.md); inside
        ``layers_output(x)`` the layers do not run at all and this is ``final_norm(x)``.
        """
        if positions_bt is None:
            positions_bt = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1]), tokens_bt.shape)
        if segment_ids_bt is None:
            segment_ids_bt = jnp.ones_like(tokens_bt)
        cfg = self.config
        t = tokens_bt.shape[1]
        injected = _LAYERS_OUTPUT.get()
        stages = layer_stages()
        if with_stats and cfg.is_moe and (injected is not None or stages > 1):
            # the stages' loops run apart: nothing gathers their routing stats
            raise ValueError(
                "a mixture-of-experts model's routing stats (router losses, "
                "routes) are not collected through pipeline stages"
            )
        if injected is not None:
            out = self.final_norm(injected)
            return (out, {}) if with_stats else out
        if stages > 1:
            # Layers split over pipeline stages: the masked form (equal for the real tokens)
            # for every row layout, each micro-batch's masks built by the stage that holds it.
            x = self.pipelined_layers(self.embed(tokens_bt), positions_bt, segment_ids_bt, stages)
            out = self.final_norm(x)
            return (out, {}) if with_stats else out
        if (
            one_segment
            and cfg.fused_attention
            and not cfg.sliding_window
            and fused_attention_fits(t, t, cfg.head_dim)
        ):
            return self._aligned_hidden(tokens_bt, segment_ids_bt, with_stats)
        attend = dense_attend(
            positions_bt,
            segment_ids_bt,
            cfg.layer_windows,
            fused=cfg.fused_attention,
            softcap=cfg.attn_logit_softcap,
        )
        hidden, _, stats = self.run_layers(
            self.embed(tokens_bt), positions_bt, attend, with_stats=True
        )
        return (hidden, stats) if with_stats else hidden

    def pipelined_layers(self, x_bte, positions_bt, segment_ids_bt, stages: int) -> jax.Array:
        """The layers (before the final norm) of a full-sequence pass as a pipeline over
        ``stages`` stages (jrlhf.models.pipeline): the rows in ``pipeline_microbatches``
        micro-batches (default: one per stage), padded with empty rows to a multiple of it."""
        cfg = self.config
        micro = cfg.pipeline_microbatches or stages
        rows = x_bte.shape[0]
        padded = -(-rows // micro) * micro
        xs, pos, seg = (
            pipeline.to_microbatches(pipeline.pad_rows(a, padded), micro)
            for a in (x_bte, positions_bt, segment_ids_bt)
        )
        _, state = nnx.split(self.layers)
        stage_fn = self.stage_function(stages)
        out = pipeline.gpipe(stage_fn, pipeline.split_stages(state, stages), xs, (pos, seg))
        out = out.reshape(padded, *out.shape[2:])[:rows]
        return constrain(out, ("batch", "length", "act_embed"))

    def stage_function(self, stages: int):
        """``stage_fn(stage_state, x_bte, (positions_bt, segment_ids_bt), stage)``: one pipeline
        stage's ``num_layers / stages`` layers (``stage_state``: their stacked state, as nnx
        variables or a pure dict of arrays with a leading axis of that many layers) on one
        micro-batch, its masks and RoPE tables built from that micro-batch's positions and
        segment ids; ``stage`` may be traced (the layer index for per-layer choices is
        ``stage * num_layers / stages + k``)."""
        cfg = self.config
        graphdef, template = nnx.split(self.layers)
        per_stage = cfg.num_layers // stages
        windows = cfg.layer_windows

        def stage_fn(stage_state, x, aux, stage):
            if not isinstance(stage_state, nnx.State):
                pure, stage_state = (
                    stage_state,
                    jax.tree.map(lambda v: v, template, is_leaf=_is_variable),
                )
                nnx.replace_by_pure_dict(stage_state, pure)
            positions, segments = aux
            attend = dense_attend(
                positions,
                segments,
                windows,
                fused=cfg.fused_attention,
                softcap=cfg.attn_logit_softcap,
            )
            params = None
            if cfg.unroll_layers:
                params = unstack_layers(nnx.to_pure_dict(stage_state))
            # (a pipeline stage's routing stats are not collected: with_stats needs the whole
            # model's layers in one loop)
            out, _, _ = self.layer_loop(
                graphdef, stage_state, x, positions, attend, None, params, stage * per_stage
            )
            return out

        return stage_fn

    def _aligned_hidden(self, tokens_bt, segment_ids_bt, with_stats=False):
        """``hidden`` of one-segment rows, each rotated left by its left padding so that its
        tokens sit at columns 0..n-1 (their positions), and the states rotated back."""
        t = tokens_bt.shape[1]
        real = segment_ids_bt > 0
        start_b = jnp.argmax(real, axis=1)  # the first real column (0 for an empty row)
        cols = jnp.arange(t, dtype=jnp.int32)
        read = (cols[None, :] + start_b[:, None]) % t
        positions_bt = jnp.broadcast_to(cols, tokens_bt.shape)
        tokens_bt = jnp.take_along_axis(tokens_bt, read, axis=1)
        hidden, _, stats = self.run_layers(
            self.embed(tokens_bt), positions_bt, aligned_attend, with_stats=True
        )
        back = (cols[None, :] - start_b[:, None]) % t
        hidden = jnp.take_along_axis(hidden, back[:, :, None], axis=1)
        hidden = constrain(hidden, ("batch", "length", "act_embed"))
        if not with_stats:
            return hidden
        # the routing stats (L, B, T, ...) rotated back to the rows' own columns too
        stats = jax.tree.map(
            lambda a: jnp.take_along_axis(a, back[None, :, :, None], axis=2), stats
        )
        return hidden, stats

    def __call__(self, tokens_bt, positions_bt=None, segment_ids_bt=None, one_segment=False):
        """Logits (B, T, V) for ``head="lm"``, values (B, T) for ``head="value"``;
        ``one_segment``: see ``hidden``."""
        hidden = self.hidden(tokens_bt, positions_bt, segment_ids_bt, one_segment)
        if self.head == "value":
            return self.values(hidden)
        return constrain(self.logits(hidden), ("batch", "length", "act_vocab"))
