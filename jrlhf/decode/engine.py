"""Paged-KV generation with continuous batching on a generation mesh: the public ``DecodeEngine``.

An engine is three parts, each in its own module, composed here:

* the decode state, one pytree the device keeps between calls, and the plain data the parts
  share (``EngineConfig``, ``GenerationResult``, ``Migration``...): jrlhf.decode.state;
* the device programs (prefill ``insert``, ``decode_chunk``, migration's ``extract``/``adopt``,
  multi-turn ``extend``), pure functions of a static ``EngineSpec``, the weights and the state,
  jitted once per spec: jrlhf.decode.programs;
* the host scheduler that runs one ``generate`` call over them (admission, page allocation,
  chunks, finished rows, turns, migration): jrlhf.decode.scheduler.

This module holds only the composition: building (or reusing) the spec and programs, holding
the state between calls, and the methods other modules call. The names other modules import
from here (``EngineConfig``, ``GenerationResult``, ``FinishedRow``, ``Migration``,
``round_slots``...) are re-exported from their homes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from jrlhf.decode import scheduler
from jrlhf.decode.pipelined import staged_chunk
from jrlhf.decode.programs import (
    EngineSpec,
    Programs,
    decode_chunk,
    engine_spec,
    jit_programs,
)
from jrlhf.decode.sampling import SamplingParams
from jrlhf.decode.scheduler import layer_copies_fit
from jrlhf.decode.state import (
    DecodeState,
    EngineConfig,
    FinishedCallback,
    FinishedRow,
    GenerationResult,
    Migration,
    data_shards,
    round_slots,
)
from jrlhf.decode.turns import Turns
from jrlhf.meshes.rules import Rules, get_rules
from jrlhf.models.config import ModelConfig
from jrlhf.models.model_def import ModelDef, Params
from jrlhf.shared_programs import shared_program

__all__ = [
    "DecodeEngine",
    "DecodeState",
    "EngineConfig",
    "FinishedCallback",
    "FinishedRow",
    "GenerationResult",
    "Migration",
    "data_shards",
    "layer_copies_fit",
    "round_slots",
]


# Bounded, so that a long-lived process that builds many differently shaped engines does not keep
# every program.
@shared_program(maxsize=16)
def engine_parts(
    model_def: ModelDef, mesh: Mesh, rules: Rules, config: EngineConfig
) -> tuple[EngineSpec, Programs]:
    """The spec and jitted programs of an engine. jax.jit caches traces and executables per
    function object, so an engine built again with the same model, mesh, rules and config (the
    trainer rebuilt in one process, evaluation after training) gets the same ones and neither
    traces, lowers nor compiles again. ``engine_parts.cache_clear()`` forgets them (an A/B of
    engine variants in one process)."""
    spec = engine_spec(model_def, mesh, rules, config)
    return spec, jit_programs(spec, staged_chunk if spec.stages > 1 else decode_chunk)


class DecodeEngine:
    """Continuous-batching generator for one model on one generation mesh.

    Construct once and call ``generate`` every RL iteration: the device state (including the page
    pools) persists and is reused, programs compile on first use only, and parameters are used
    in place (pass them already sharded on ``mesh``). A ``stage`` axis in ``mesh`` splits the
    layers and their KV pages over pipeline stages, and decode steps run as a pipeline with
    groups of slots in flight (jrlhf.decode.pipelined); the samples are the same.
    """

    def __init__(
        self,
        model_def: ModelDef,
        mesh: Mesh | None = None,
        rules: Rules | str = "dp_tp",
        config: EngineConfig | None = None,
    ):
        if mesh is None:
            mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "tensor"))
        parts = engine_parts(model_def, mesh, get_rules(rules), config or EngineConfig())
        self.spec: EngineSpec = parts[0]
        self.programs: Programs = parts[1]
        # None until the first generate, and while one runs (the programs donate it).
        self.state: DecodeState | None = None

    @property
    def model_def(self) -> ModelDef:
        return self.spec.model_def

    @property
    def cfg(self) -> ModelConfig:
        return self.spec.cfg

    @property
    def config(self) -> EngineConfig:
        return self.spec.config

    @property
    def mesh(self) -> Mesh:
        return self.spec.mesh

    @property
    def rules(self) -> Rules:
        return self.spec.rules

    @property
    def kernel_name(self) -> str:
        """The paged-attention kernel decode steps run (jrlhf.decode.kernels)."""
        return self.spec.kernel_name

    @property
    def num_shards(self) -> int:
        """How many ways slots and pages are split (the mesh's data shards)."""
        return self.spec.num_shards

    def generate(
        self,
        params: Params,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingParams | None = None,
        on_finished: FinishedCallback | None = None,
        migration: Migration | None = None,
        turns: Turns | None = None,
    ) -> GenerationResult:
        """Generate ``sampling.num_samples`` completions for every prompt (token-id lists).

        ``on_finished``, when given, receives the rows that finished in each decode chunk, once
        the next chunk has been dispatched (so the host work it does overlaps that chunk's
        decode), and the last ones after the loop; it must not touch the engine. ``migration``
        moves the last few sequences onto a tail engine on fewer devices (see Migration). The
        samples are the same with or without either. ``turns`` makes every sequence an episode
        of several turns (jrlhf.decode.turns).
        """
        return scheduler.generate(self, params, prompts, sampling, on_finished, migration, turns)

    def tail(self, mesh: Mesh, rows: int) -> DecodeEngine:
        """A tail engine for migration (see Migration): this engine's model, rules and shapes
        on ``mesh`` (fewer devices), with slots for ``rows`` sequences (rounded up to the mesh's
        data shards) and a pool that holds each of them at full length."""
        slots = round_slots(rows, mesh, self.rules)
        config = dataclasses.replace(
            self.config, num_slots=slots, num_pages=0, max_prefill_rows=min(slots, 64)
        )
        return DecodeEngine(self.model_def, mesh, self.rules, config)

    def unrolls(self, layers: Any) -> bool:
        """Whether this ``generate`` runs the layers unrolled (``EngineConfig.unroll_layers``)."""
        return scheduler.unrolls(self.config, layers)

    def weight_layout(self) -> str:
        """How the unrolled layer copies store their kernels (``EngineConfig.weight_layout``)."""
        return self.spec.weight_layout

    def compile_counts(self) -> dict[str, int]:
        """How many programs each jitted entry point has compiled (for tests and logs)."""
        return {
            "insert": self.programs.insert._cache_size(),
            "decode_chunk": self.programs.decode_chunk._cache_size(),
        }
