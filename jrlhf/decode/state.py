"""The plain data the decode engine's parts share: its shapes, its device state, its results.

* ``EngineConfig``: the engine's shapes; every compiled program is a function of these (and of
  the model, mesh and rules) alone.
* ``DecodeState``: everything the device holds between calls, one pytree (the K/V page pools,
  the page table, per-slot lengths, last tokens, activity flags, PRNG keys, output buffers),
  with its logical axes (``STATE_AXES``), its shardings on a mesh and ``init_state``, the empty
  state. Rows that migrate between engines travel as ``MOVED_*``. ``data_shards`` says how many
  ways a mesh splits the slots and pages, ``round_slots`` rounds a slot count to a multiple.
* ``GenerationResult``, ``FinishedRow`` and ``Migration``: what ``DecodeEngine.generate`` returns,
  hands to ``on_finished`` and takes to move its last sequences.

Nothing here runs the model or schedules requests: the device programs that transform a
``DecodeState`` are jrlhf.decode.programs, the host loop that calls them jrlhf.decode.scheduler.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh, NamedSharding

from jrlhf.decode.kernels import KERNELS
from jrlhf.decode.page_table import pages_for
from jrlhf.meshes.rules import Rules, axis_size, get_rules, logical_to_spec
from jrlhf.models.config import ModelConfig
from jrlhf.models.transformer import WEIGHT_LAYOUTS

MAX_STOP_IDS = 8  # stop ids are padded to this many so changing them never recompiles


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Shapes of the decode engine; every compiled program is a function of these alone.

    ``num_pages`` is the whole pool (all data shards together); 0 sizes it for every slot at full
    length (``num_slots * max_pages_per_seq``). Prompts are prefilled at most ``max_prefill_rows``
    at a time, padded to a power-of-two length of at least ``min_prefill_len``.

    ``unroll_layers`` makes decode steps run the layers unrolled over per-layer weight copies
    (made once per ``generate``, so the layer weights are held twice while it runs) instead of
    scanning the stacked weights, which copies every layer's weights at every step on CPUs and
    GPUs alike (see ``Transformer.run_layers``). None decides per ``generate``: unrolled on CPU;
    on accelerators when ``layer_copies_fit`` (one process only, so that every process of a
    multi-controller job compiles the same program).

    ``weight_layout`` is how those per-layer copies store every projection kernel
    (``jrlhf.models.transformer.WEIGHT_LAYOUTS``, see ``LayerWeights``): ``"panels"`` packs them
    for the few-row matmul kernel (``jrlhf.kernels.panels``), which streams each weight once;
    ``"out_major"`` stores them output-major, which XLA:CPU multiplies by a few token rows
    almost twice as fast as input-major. None: on CPU panels where they apply (a float32 model
    whose projections pack, on a one-device mesh, on a host with AVX-512 where the kernel
    builds), else out-major; elsewhere the layout is the compiler's or the kernel library's
    business (input-major).

    ``max_observation_tokens`` is the longest observation a multi-turn ``generate`` may append
    between two turns (jrlhf.decode.turns); 0 for single-turn use.

    ``record_routes`` keeps, for a mixture-of-experts model, the experts every layer chose at
    each generated token's forward pass (``GenerationResult.routes``), so that the training
    pass's routing can be compared with the rollout's (jrlhf.models.moe.routing_mismatch).

    ``share_prefixes`` lets the samples of one prompt that are admitted in the same prefill call
    and land on the same data shard share that prompt's prefill and its full KV pages (tokens
    and log-probs are the same as without: only pages and prefill work are saved).

    ``pipeline_batches`` is how many groups of slots are in flight through the pipeline stages
    of a mesh with a stage axis (jrlhf.decode.pipelined): 0 takes one group per stage (the
    delayed inter-batch pipeline, every stage busy at every tick), 1 is naive pipelined decode
    (one batch in flight, the other stages idle); it must divide the stage count. Ignored
    without a stage axis.
    """

    num_slots: int = 8
    page_size: int = 16
    num_pages: int = 0
    max_prompt_len: int = 128
    max_new_tokens: int = 128
    chunk_steps: int = 16
    max_prefill_rows: int = 8
    min_prefill_len: int = 16
    kernel: str = "auto"
    unroll_layers: bool | None = None
    weight_layout: str | None = None
    share_prefixes: bool = True
    max_observation_tokens: int = 0
    record_routes: bool = False
    pipeline_batches: int = 0

    def __post_init__(self):
        for name in (
            "num_slots",
            "page_size",
            "max_prompt_len",
            "max_new_tokens",
            "chunk_steps",
            "max_prefill_rows",
            "min_prefill_len",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1 (got {getattr(self, name)})")
        if self.num_pages < 0:
            raise ValueError(f"EngineConfig.num_pages must be >= 0 (got {self.num_pages})")
        if self.pipeline_batches < 0:
            raise ValueError(
                "EngineConfig.pipeline_batches must be >= 0 (0: one per pipeline stage; got "
                f"{self.pipeline_batches})"
            )
        if self.max_observation_tokens < 0:
            raise ValueError(
                "EngineConfig.max_observation_tokens must be >= 0 "
                f"(got {self.max_observation_tokens})"
            )
        if self.kernel not in KERNELS:
            raise ValueError(f"EngineConfig.kernel {self.kernel!r} unknown (use one of {KERNELS})")
        if self.weight_layout is not None and self.weight_layout not in WEIGHT_LAYOUTS:
            raise ValueError(
                f"EngineConfig.weight_layout {self.weight_layout!r} unknown (use one of "
                f"{WEIGHT_LAYOUTS} or None)"
            )

    @property
    def max_seq_len(self) -> int:
        return self.max_prompt_len + self.max_new_tokens

    @property
    def max_pages_per_seq(self) -> int:
        return pages_for(self.max_seq_len, self.page_size)

    @property
    def total_pages(self) -> int:
        return self.num_pages or self.num_slots * self.max_pages_per_seq


@struct.dataclass
class DecodeState:
    """Everything the device holds between calls; the programs donate it, so the pools are
    updated in place."""

    k_pages: jax.Array  # (layers, pages, page_size, kv_heads, head_dim)
    v_pages: jax.Array
    page_table: jax.Array  # (slots, max_pages) int32, shard-local page ids
    lengths: jax.Array  # (slots,) int32 tokens in the cache
    last_token: jax.Array  # (slots,) int32 next token to feed
    num_generated: jax.Array  # (slots,) int32
    max_new: jax.Array  # (slots,) int32
    active: jax.Array  # (slots,) bool
    keys: jax.Array  # (slots, 2) uint32 per-sequence PRNG key
    tokens: jax.Array  # (slots, max_new_tokens) int32
    sampling_lp: jax.Array  # (slots, max_new_tokens) float32
    raw_lp: jax.Array  # (slots, max_new_tokens) float32
    # Multi-turn (jrlhf.decode.turns): whether the policy sampled each token (False: an
    # observation's) and the sampled tokens the current turn may still take.
    policy: jax.Array  # (slots, max_new_tokens) bool
    turn_left: jax.Array  # (slots,) int32
    # The experts each layer chose at the pass that produced generated token j (the prompt's
    # last token for j = 0): (slots, max_new_tokens, layers, top_k) int32 when the engine
    # records routes (EngineConfig.record_routes), else a (slots, 1, 1, 1) placeholder.
    routes: jax.Array
    # Pipelined decode's counters since the call began (jrlhf.decode.pipelined): ticks, then
    # each stage's busy ticks; (1 + stages,) int32, untouched without stages.
    pipe_counts: jax.Array


STATE_AXES = DecodeState(
    k_pages=("layers", "kv_pages", None, "act_kv_heads", "head_dim"),
    v_pages=("layers", "kv_pages", None, "act_kv_heads", "head_dim"),
    page_table=("slots", None),
    lengths=("slots",),
    last_token=("slots",),
    num_generated=("slots",),
    max_new=("slots",),
    active=("slots",),
    keys=("slots", None),
    tokens=("slots", None),
    sampling_lp=("slots", None),
    raw_lp=("slots", None),
    policy=("slots", None),
    turn_left=("slots",),
    routes=("slots", None, None, None),
    pipe_counts=(None,),
)

# The decode state of migrated sequences in transit (Migration): one row per tail slot, the KV
# of each row's pages in table order; KV heads stay split over tensor.
MOVED_AXES = {
    "kv": ("layers", None, None, None, "act_kv_heads", "head_dim"),
    "rows": (None,),
    "rows2": (None, None),
}
MOVED_ROWS = ("lengths", "last_token", "num_generated", "max_new", "active", "turn_left")
MOVED_ROWS2 = ("keys", "tokens", "sampling_lp", "raw_lp", "policy")


def data_shards(mesh: Mesh, rules: Rules | str) -> int:
    """How many ways slots (and pages) are split on ``mesh``: num_slots must be a multiple."""
    return axis_size(mesh, logical_to_spec(("slots",), mesh, get_rules(rules))[0])


def layer_stages(mesh: Mesh, rules: Rules | str) -> int:
    """How many pipeline stages ``mesh`` splits the layers over (1 without a stage axis)."""
    return axis_size(mesh, logical_to_spec(("layers",), mesh, get_rules(rules))[0])


def round_slots(wanted: int, mesh: Mesh, rules: Rules | str) -> int:
    """``wanted`` slots rounded up to a multiple of the mesh's data shards times its pipeline
    stages (each data shard's slots split into one group per stage, jrlhf.decode.pipelined)."""
    shards = data_shards(mesh, rules) * layer_stages(mesh, rules)
    return -(-max(wanted, 1) // shards) * shards


def state_shardings(mesh: Mesh, rules: Rules) -> DecodeState:
    """The ``DecodeState`` of NamedShardings that lays ``STATE_AXES`` out on ``mesh``."""
    return jax.tree.map(
        lambda axes: NamedSharding(mesh, logical_to_spec(axes, mesh, rules)),
        STATE_AXES,
        is_leaf=lambda x: isinstance(x, tuple),
    )


def moved_shardings(mesh: Mesh, rules: Rules) -> dict[str, NamedSharding]:
    """The shardings of migrated rows (``MOVED_AXES``) arriving on ``mesh``."""
    named = lambda axes: NamedSharding(mesh, logical_to_spec(axes, mesh, rules))  # noqa: E731
    return {
        "k": named(MOVED_AXES["kv"]),
        "v": named(MOVED_AXES["kv"]),
        **{k: named(MOVED_AXES["rows"]) for k in MOVED_ROWS},
        **{k: named(MOVED_AXES["rows2"]) for k in MOVED_ROWS2},
    }


def routes_shape(config: EngineConfig, model: ModelConfig) -> tuple[int, int, int, int]:
    """``DecodeState.routes``' shape: every slot's experts per token and layer when the engine
    records routes, else a placeholder that costs nothing."""
    slots = config.num_slots
    if config.record_routes:
        return (slots, config.max_new_tokens, model.num_layers, model.num_experts_per_tok)
    return (slots, 1, 1, 1)


def init_state(
    config: EngineConfig, model: ModelConfig, num_shards: int, stages: int = 1
) -> DecodeState:
    """The empty state: zeroed pools and buffers, every slot idle, every page-table entry out of
    range (one data shard's ``total_pages // num_shards`` pages are its shard-local ids), the
    counters of ``stages`` pipeline stages zero."""
    ec, c = config, model
    pool = (c.num_layers, ec.total_pages, ec.page_size, c.num_kv_heads, c.head_dim)
    s, n = ec.num_slots, ec.max_new_tokens
    zi = lambda *shape: jnp.zeros(shape, jnp.int32)  # noqa: E731
    return DecodeState(
        k_pages=jnp.zeros(pool, c.jnp_dtype),
        v_pages=jnp.zeros(pool, c.jnp_dtype),
        page_table=jnp.full((s, ec.max_pages_per_seq), ec.total_pages // num_shards, jnp.int32),
        lengths=zi(s),
        last_token=zi(s),
        num_generated=zi(s),
        max_new=zi(s),
        active=jnp.zeros((s,), bool),
        keys=jnp.zeros((s, 2), jnp.uint32),
        tokens=zi(s, n),
        sampling_lp=jnp.zeros((s, n), jnp.float32),
        raw_lp=jnp.zeros((s, n), jnp.float32),
        policy=jnp.zeros((s, n), bool),
        turn_left=zi(s),
        routes=zi(*routes_shape(ec, c)),
        pipe_counts=zi(1 + stages),
    )


@dataclasses.dataclass
class GenerationResult:
    """Completions in request order: prompt 0 samples 0..S-1, then prompt 1, ...

    ``completion_ids`` include the stop token when one ended the sequence. ``raw_logprobs`` are
    the policy's log-probs (temperature 1, no filtering); ``sampling_logprobs`` those of the
    distribution actually sampled from. ``policy_masks`` (multi-turn only, else None): per
    completion, True at the tokens the policy sampled, False at observation tokens (whose
    log-probs are 0). ``episodes`` (filled by jrlhf.ppo.rollout when an environment answered,
    else None): per completion, what its episode recorded (jrlhf.envs.EPISODE_FIELDS).
    ``stats``: the call's counts (prefill calls and rows, decode chunks, pages...); on a mesh
    with pipeline stages also ``pipeline_ticks``, ``pipeline_stage_busy`` (per stage) and
    ``pipeline_bubble`` (jrlhf.decode.scheduler.pipeline_stats).
    """

    completion_ids: list[list[int]]
    sampling_logprobs: list[np.ndarray]
    raw_logprobs: list[np.ndarray]
    prompt_index: np.ndarray
    stats: dict[str, Any]
    policy_masks: list[np.ndarray] | None = None
    episodes: dict[str, np.ndarray] | None = None
    # EngineConfig.record_routes: per completion (tokens, layers, top_k) int32, the experts
    # chosen at the pass that produced each token; else None
    routes: list[np.ndarray] | None = None

    @property
    def lengths(self) -> np.ndarray:
        return np.array([len(c) for c in self.completion_ids], np.int32)


class FinishedRow(NamedTuple):
    """One completion as ``generate`` hands it to ``on_finished``: its request index (the
    position in the result), its prompt's index, tokens, log-probs and, multi-turn, which tokens
    the policy sampled (as in GenerationResult)."""

    index: int
    prompt_index: int
    completion_ids: list[int]
    sampling_logprobs: np.ndarray
    raw_logprobs: np.ndarray
    policy_mask: np.ndarray | None = None


# Called with the rows that finished in a decode chunk (jrlhf.ppo.fusion scores them early).
FinishedCallback = Callable[[list[FinishedRow]], None]


class EngineParts(Protocol):
    """What the scheduler and a migration use of an engine (``DecodeEngine``, a layer above):
    its configuration, its spec (``programs.EngineSpec``), its jitted device programs, and the
    decode state it keeps between calls."""

    config: EngineConfig
    spec: Any
    programs: Any
    state: DecodeState | None


@dataclasses.dataclass(frozen=True)
class Migration:
    """Where the last few sequences of a ``generate`` call finish (RLHFuse's migration).

    Once no prompt waits for a slot and at most ``max_rows`` sequences are still decoding, their
    decode state (KV pages, lengths, last tokens, PRNG keys, tokens and log-probs so far) moves
    to ``engine``, a tail engine on fewer devices (``DecodeEngine.tail``), together with the
    parameters, and they finish there; the devices only the full engine used are free for other
    work meanwhile (jrlhf.ppo.fusion scores the finished samples). The KV is moved, not
    recomputed: every per-sequence input of the decode step arrives unchanged, so the samples
    are those of an unmigrated call (log-probs to float rounding: the tail steps fewer rows).
    ``transfer(tree, shardings)`` moves arrays between the two meshes (the trainer passes its
    Resharder; the default is ``jax.device_put``).
    """

    engine: EngineParts  # a DecodeEngine
    max_rows: int
    transfer: Callable[[Any, Any], Any] = jax.device_put

    def __post_init__(self):
        if not 1 <= self.max_rows <= self.engine.config.num_slots:
            raise ValueError(
                f"migration of at most {self.max_rows} rows needs 1 <= rows <= the tail engine's "
                f"{self.engine.config.num_slots} slots"
            )
