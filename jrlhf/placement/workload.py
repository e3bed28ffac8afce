"""What one RLHF iteration asks of the hardware: models, batch and lengths, and FLOP/byte counts.

A ``Workload`` is the part of a run's configuration that the cost estimator needs. The counting
functions here are deliberately plain arithmetic over ``ModelConfig`` fields (no tracing), so they
can be checked by hand in tests and evaluated for 70B models in microseconds.

FLOP conventions (one multiply-add = 2 FLOPs):

* a dense matmul over ``tokens`` rows with ``p`` weight entries costs ``2 * p * tokens``;
* attention scores and the weighted sum each cost ``2 * heads * head_dim`` per (query, key) pair;
  training and scoring compute the full ``S x S`` masked square (our attention is dense), decode
  attends each new token to the cached context;
* the embedding is a gather (no FLOPs); the lm head is a matmul but the trainer only evaluates it
  at the response columns (``jrlhf.ppo.batch.response_hidden``), the value head likewise.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jrlhf.config import DecodeConfig
from jrlhf.data.batch import microbatch_splits
from jrlhf.models.config import FUSED_ATTENTION_DTYPES, ModelConfig
from jrlhf.models.lora import LoraConfig


@dataclasses.dataclass(frozen=True)
class Workload:
    """Models and the shape of one iteration (prompts x samples rows of prompt_len + gen_len)."""

    actor: ModelConfig
    critic: ModelConfig | None  # None for GRPO
    reference: ModelConfig
    reward: ModelConfig | None  # None when a verifiable Python reward is used
    prompts: int  # prompts per iteration
    samples_per_prompt: int
    prompt_len: int
    gen_len: int  # generated tokens per sample
    epochs: int
    minibatch_size: int
    # Decode-engine knobs that change the number of host round trips (DecodeConfig.chunk_steps).
    decode_chunk_steps: int = 8
    # Sequence slots of the decode engine in total over its data shards (DecodeConfig.num_slots;
    # 0 = every row in flight at once). The KV pool holds this many sequences at full length;
    # rows beyond it wait for a free slot, so uniform lengths decode in ceil(rows / slots) waves.
    decode_slots: int = 0
    # Tokens per KV page (DecodeConfig.page_size): the decode kernels read the cache in blocks of
    # pages, which sets how much of it a step reads.
    decode_page_size: int = DecodeConfig.page_size
    # DecodeConfig.layer_loop: "unroll" (or "auto" on a shared-host CPU profile) holds a copy of
    # the layer weights while generating.
    decode_layer_loop: str = "auto"
    # DecodeConfig.pipeline_batches: on a generation mesh with a stage axis, the groups of slots
    # in flight over the stages (0 = one per stage: the delayed inter-batch pipeline).
    decode_pipeline_batches: int = 0
    # Rows per reference / reward / critic scoring call (Memory.infer_batch_size; 0 = all rows
    # in one call). The trainer scores in chunks of this many rows, one after another.
    infer_batch_size: int = 0
    # Gradient-accumulation micro-batches per minibatch (RoleConfig.microbatches of each role).
    actor_microbatches: int = 1
    critic_microbatches: int = 1
    # RoleConfig.microbatch_tokens of each role (> 0: micro-batches sized by tokens per device,
    # which then replace the counts above; priced for full-length rows).
    actor_microbatch_tokens: int = 0
    critic_microbatch_tokens: int = 0
    # Asynchrony.max_staleness: with >= 1, generation of the next batch may overlap the rest of
    # the iteration (jrlhf.placement.estimator.iteration_seconds).
    max_staleness: int = 0
    # Memory knobs (Memory.generation_copy, Memory.offload; jrlhf.ppo.residency). The remat
    # policy of each training call is the role's ModelConfig.remat_policy.
    generation_copy: str = "kept"
    offload: tuple[str, ...] = ()
    # One batch's response lengths as (tokens, rows) pairs, e.g. the long-tailed task's law
    # (``law_lengths``); () = every response gen_len tokens. Generation is then priced as the
    # engine runs it: continuous batching over the decode slots
    # (jrlhf.placement.estimator.rollout_seconds).
    response_lengths: tuple[tuple[int, int], ...] = ()
    # Asynchrony.partial_rollout_tokens (T, with max_staleness k >= 1): each iteration generates
    # one pass of up to T tokens over every unfinished sample of the batches in flight.
    partial_rollout_tokens: int = 0
    # Dynamic sampling (SampleFilters.dynamic_sampling): the fraction of groups whose samples all
    # score the same (no signal; 0: dynamic sampling off) and SampleFilters.max_sampling_rounds.
    no_signal_fraction: float = 0.0
    max_sampling_rounds: int = 4
    # LoRA adapters of the trained roles (RoleConfig.lora_rank; None: full fine-tuning). The
    # memory model then counts the adapters beside the frozen base, gradients and AdamW moments
    # of the adapters (and a value head) only, and the actor's generation copy as a merged copy
    # of its own (jrlhf.ppo.weights: the weight channel sends merged weights).
    actor_lora: LoraConfig | None = None
    critic_lora: LoraConfig | None = None
    # critic/RoleConfig.pipeline_schedule='fused': each minibatch's actor and critic steps run
    # as one fused bidirectional pipeline program (jrlhf.runtime.fused_step; the critic's
    # ModelConfig then says 'gpipe', its scoring's schedule).
    fused_actor_critic: bool = False

    def lora(self, role: str) -> LoraConfig | None:
        """The role's adapters (None: none, or a frozen role)."""
        return {"actor": self.actor_lora, "critic": self.critic_lora}.get(role)

    @property
    def slots(self) -> int:
        """Sequences the decode engine keeps in flight (before rounding to the data shards)."""
        return self.decode_slots if self.decode_slots > 0 else self.rows

    @property
    def infer_chunk(self) -> int:
        """Rows per scoring call."""
        if self.infer_batch_size <= 0:
            return self.rows
        return min(self.infer_batch_size, self.rows)

    def microbatch_tokens(self, role: str) -> int:
        """The role's token budget per device and micro-batch (0: none)."""
        return {"actor": self.actor_microbatch_tokens, "critic": self.critic_microbatch_tokens}.get(
            role, 0
        )

    def microbatches(self, role: str, shards: int = 1) -> int:
        """Micro-batches per minibatch of a trained role (1 for frozen roles). Under a token
        budget, the split the trainer takes (jrlhf.data.batch.fit_microbatches) for a minibatch
        of full-length rows over ``shards`` batch shards: an upper bound when it packs."""
        budget = self.microbatch_tokens(role)
        if budget:
            mb = min(self.minibatch_size, self.rows)
            splits = microbatch_splits(mb, shards) or [1]
            fits = [m for m in splits if mb // (m * shards) * self.seq_len <= budget]
            return fits[0] if fits else splits[-1]
        m = {"actor": self.actor_microbatches, "critic": self.critic_microbatches}.get(role, 1)
        return max(1, m)

    def microbatch_rows(self, role: str, shards: int = 1) -> int:
        """Rows of one training micro-batch (``shards``: see ``microbatches``)."""
        mb = min(self.minibatch_size, self.rows)
        return -(-mb // self.microbatches(role, shards))

    @property
    def rows(self) -> int:
        """Samples per iteration (rollout batch)."""
        return self.prompts * self.samples_per_prompt

    @property
    def lengths(self) -> tuple[tuple[int, int], ...]:
        """One batch's response lengths as (tokens, rows) pairs: ``response_lengths``, or every
        row at gen_len."""
        return self.response_lengths or ((self.gen_len, self.rows),)

    @property
    def seq_len(self) -> int:
        """Packed sequence length used by scoring and training (prompt + response columns)."""
        return self.prompt_len + self.gen_len

    @property
    def train_steps(self) -> int:
        """Optimizer steps per model per iteration."""
        return self.epochs * max(1, -(-self.rows // self.minibatch_size))

    def models(self) -> dict[str, tuple[ModelConfig, str]]:
        """role -> (config, head) for the roles this workload has."""
        out = {"actor": (self.actor, "lm"), "reference": (self.reference, "lm")}
        if self.critic is not None:
            out["critic"] = (self.critic, "value")
        if self.reward is not None:
            out["reward"] = (self.reward, "value")
        return out

    @classmethod
    def from_config(cls, cfg, models: dict[str, ModelConfig]) -> Workload:
        """The workload of a ``jrlhf.config.Config`` whose roles resolved to ``models``.

        ``models`` maps role names to the ``ModelConfig`` each role will run (after overrides);
        the reference defaults to the actor's config and the critic/reward to the actor's too
        when the stage needs them but the dict does not say.
        """
        stages = tuple(cfg.run.stages)
        actor = models["actor"]
        algorithm = "grpo" if "grpo" in stages and "ppo" not in stages else "ppo"
        critic = models.get("critic", actor) if algorithm == "ppo" else None
        reward = None if cfg.task.reward_fn else models.get("reward", actor)
        return cls(
            actor=actor,
            critic=critic,
            reference=models.get("reference", actor),
            reward=reward,
            prompts=cfg.rl.prompts_per_iteration,
            samples_per_prompt=cfg.rl.samples_per_prompt,
            prompt_len=cfg.task.max_prompt_len,
            gen_len=cfg.task.max_response_len,
            epochs=cfg.rl.epochs,
            minibatch_size=cfg.rl.minibatch_size,
            decode_chunk_steps=cfg.decode.chunk_steps,
            decode_slots=cfg.decode.num_slots,
            decode_page_size=cfg.decode.page_size,
            decode_layer_loop=getattr(cfg.decode, "layer_loop", "auto"),
            decode_pipeline_batches=cfg.decode.pipeline_batches,
            infer_batch_size=cfg.rl.memory.infer_batch_size,
            actor_microbatches=_microbatches(cfg, "actor"),
            critic_microbatches=_microbatches(cfg, "critic") if critic is not None else 1,
            actor_microbatch_tokens=_microbatches(cfg, "actor", "microbatch_tokens"),
            critic_microbatch_tokens=(
                _microbatches(cfg, "critic", "microbatch_tokens") if critic is not None else 0
            ),
            max_staleness=cfg.rl.asynchrony.max_staleness,
            partial_rollout_tokens=cfg.rl.asynchrony.partial_rollout_tokens,
            max_sampling_rounds=cfg.rl.filters.max_sampling_rounds,
            generation_copy=cfg.rl.memory.generation_copy,
            offload=tuple(cfg.rl.memory.offload),
            actor_lora=_lora(cfg, "actor"),
            critic_lora=_lora(cfg, "critic") if critic is not None else None,
            fused_actor_critic=critic is not None and _fused(cfg),
        )


def _fused(cfg) -> bool:
    """Whether the critic's RoleConfig asks for the fused actor-critic step."""
    rc = (getattr(cfg, "roles", None) or {}).get("critic")
    return getattr(rc, "pipeline_schedule", "gpipe") == "fused"


def _lora(cfg, role: str) -> LoraConfig | None:
    """The role's RoleConfig LoRA adapters (None without)."""
    rc = (getattr(cfg, "roles", None) or {}).get(role)
    return rc.lora() if rc is not None and hasattr(rc, "lora") else None


def _microbatches(cfg, role: str, field: str = "microbatches") -> int:
    """The role's RoleConfig ``field`` (microbatches, or microbatch_tokens: 0 when unset)."""
    roles = getattr(cfg, "roles", None) or {}
    rc = roles.get(role)
    unset = 1 if field == "microbatches" else 0
    return int(getattr(rc, field, unset) or unset) if rc is not None else unset


def law_lengths(
    lengths: Sequence[int], probs: Sequence[float], rows: int
) -> tuple[tuple[int, int], ...]:
    """``rows`` response lengths that follow a discrete law (``lengths[j]`` with probability
    ``probs[j]``, e.g. jrlhf.tasks.longtail's), as (tokens, rows) pairs: row i takes the law's
    quantile at (i + 0.5) / rows, so a batch is the law's expected batch, with no random draw."""
    cdf = np.cumsum(np.asarray(probs, np.float64))
    cdf /= cdf[-1]
    index = np.minimum(np.searchsorted(cdf, (np.arange(rows) + 0.5) / rows), len(cdf) - 1)
    counts = np.bincount(index, minlength=len(lengths))
    return tuple((int(k), int(n)) for k, n in zip(lengths, counts) if n)


# ------------------------------------------------------------------------------ counting helpers
def itemsize(dtype: str) -> int:
    return np.dtype(dtype).itemsize


def mlp_width(cfg: ModelConfig) -> int:
    """The MLP width one token runs through: intermediate_size, or for a mixture of experts
    its chosen experts' widths together (num_experts_per_tok x the expert width) and the shared
    expert's."""
    if cfg.is_moe:
        return cfg.num_experts_per_tok * cfg.expert_size + cfg.shared_expert_size
    return cfg.intermediate_size


def layer_matmul_params(cfg: ModelConfig) -> int:
    """Weight entries of one decoder layer that one token's matmuls use (attention + MLP; of a
    mixture of experts the router and the chosen experts only: FLOPs follow the active
    parameters, memory the total, ``num_params``)."""
    e, d = cfg.hidden_size, cfg.head_dim
    router = e * cfg.num_experts + (e if cfg.shared_expert_size else 0)  # and the shared gate
    return e * d * (2 * cfg.num_heads + 2 * cfg.num_kv_heads) + 3 * e * mlp_width(cfg) + router


def head_params(cfg: ModelConfig, head: str) -> int:
    """Weight entries of the output head: vocab x hidden (lm head) or hidden (value head)."""
    return cfg.vocab_size * cfg.hidden_size if head == "lm" else cfg.hidden_size


def train_flops_per_token(cfg: ModelConfig, seq: int, head: str = "lm") -> float:
    """Model FLOPs of a training step (forward + backward) per token of ``seq``-long rows, as MFU
    counts them: 6 per matmul weight (the output head's too, tied to the input embedding or not;
    the input-embedding gather is no matmul) plus attention's QK^T and AV over the full square
    (12 x layers x heads x head_dim x sequence), which the model computes, masked."""
    matmul = cfg.num_layers * layer_matmul_params(cfg) + head_params(cfg, head)
    return 6.0 * matmul + 12.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim * seq


def num_params(cfg: ModelConfig, head: str) -> int:
    """All parameters of a model with this head (matches ModelDef's parameter tree)."""
    return (
        cfg.num_params(with_lm_head=False)
        + (head_params(cfg, "lm") if head == "lm" and not cfg.tie_word_embeddings else 0)
        + (head_params(cfg, "value") if head == "value" else 0)
    )


def param_bytes(cfg: ModelConfig, head: str) -> int:
    return num_params(cfg, head) * itemsize(cfg.param_dtype)


def kv_bytes_per_token(cfg: ModelConfig) -> int:
    """K and V of one token over all layers, in the compute dtype (the decode pool's dtype)."""
    return cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * itemsize(cfg.dtype)


def attention_flops(cfg: ModelConfig, queries: int, keys: int) -> float:
    """QK^T and AV for ``queries`` x ``keys`` pairs over all layers."""
    return 4.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim * queries * keys


def forward_flops(cfg: ModelConfig, rows: int, seq: int, head: str, head_tokens: int) -> float:
    """One forward over ``rows`` sequences of ``seq`` tokens; the head runs on ``head_tokens``
    positions (in total over all rows)."""
    body = 2.0 * cfg.num_layers * layer_matmul_params(cfg) * rows * seq
    attn = attention_flops(cfg, seq, seq) * rows
    return body + attn + 2.0 * head_params(cfg, head) * head_tokens


def decode_step_flops(cfg: ModelConfig, slots: int, context: int) -> float:
    """One decode step: every slot runs one token through the model and attends to ``context``."""
    body = 2.0 * (cfg.num_layers * layer_matmul_params(cfg) + head_params(cfg, "lm")) * slots
    return body + attention_flops(cfg, 1, context) * slots


def activation_bytes_per_token(
    cfg: ModelConfig, seq: int, tensor: int, saved: bool, fused_attention: bool = False
) -> float:
    """Activation bytes one token keeps for one layer (saved for backward, or live in forward).

    Saved for backward without remat: the layer input, normed inputs, q/k/v, attention output,
    the attention probabilities row (heads x seq, float32 softmax) and the MLP's gate/up/act
    tensors. Head- and MLP-sized tensors are split over the tensor axis. With
    ``fused_attention`` (``attention_is_fused``) no scores or probabilities reach memory: the
    kernel keeps one float32 log-sum-exp per head.
    """
    e, f = cfg.hidden_size, mlp_width(cfg)
    a = itemsize(cfg.dtype)
    qkv = cfg.head_dim * (cfg.num_heads + 2 * cfg.num_kv_heads)
    per = (4 * e + (qkv + cfg.num_heads * cfg.head_dim + 3 * f) / tensor) * a
    if fused_attention:
        return per + 4 * cfg.num_heads / tensor
    per += 4 * cfg.num_heads / tensor * seq * (2 if saved else 1)  # softmax probs (and scores)
    return per


def attention_is_fused(cfg: ModelConfig, device_fuses: bool) -> bool:
    """Whether ``cfg``'s full-sequence passes run fused (cuDNN) attention on a device whose
    profile says it has the kernel (``DeviceProfile.fused_attention``): ModelConfig.fused_attention
    with the device given instead of JAX's current backend (soft-capped scores, Gemma 2's, are
    never fused: cuDNN's attention has no soft-capping)."""
    if cfg.attention == "auto":
        return device_fuses and cfg.dtype in FUSED_ATTENTION_DTYPES and not cfg.attn_logit_softcap
    return cfg.attention == "cudnn"
