"""Functional handle on a model: abstract state first, parameters as a plain pytree.

``ModelDef`` is hashable (config + head), so it can be a static argument of jitted functions. It
derives the abstract parameter tree with ``nnx.eval_shape`` (nothing allocated), the logical axes
from parameter metadata, shardings from a mesh and a rule set, and creates parameters directly in
their sharded layout with ``jax.jit(init, out_shardings=...)``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh

from jrlhf.meshes.rules import Rules, get_rules, tree_shardings
from jrlhf.models.config import ModelConfig
from jrlhf.models.transformer import Transformer

Params = dict[str, Any]  # nested dict of arrays, the pure form of the model's nnx.State


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


@functools.lru_cache(maxsize=64)
def _abstract_split(config: ModelConfig, head: str):
    """The abstract module's (graphdef, state), shared by every ModelDef of one config and head:
    tracing the module takes a noticeable fraction of a second, and a run builds several
    ModelDefs of one config (actor and reference; critic and reward)."""
    module = nnx.eval_shape(lambda: Transformer(config, head=head, rngs=nnx.Rngs(0)))
    return nnx.split(module)


@functools.lru_cache(maxsize=64)
def _init_program(model: ModelDef, mesh: Mesh, rules: Rules):
    """One jitted initializer per model, mesh and rule set. A process builds the same model on
    the same mesh several times (actor and reference; critic and reward; every run of a test
    session or a notebook), and tracing and lowering a module's initializer took about a quarter
    of a second each time on the 2-core CPU machine."""
    return jax.jit(model.init, out_shardings=model.shardings(mesh, rules))


@dataclasses.dataclass(frozen=True)
class ModelDef:
    """A model's config and head kind; everything else is derived from them."""

    config: ModelConfig
    head: str = "lm"

    @property
    def _split(self):
        return _abstract_split(self.config, self.head)

    @property
    def graphdef(self):
        return self._split[0]

    @functools.cached_property
    def logical_axes(self) -> Params:
        """Nested dict of logical-axis tuples, one per parameter."""
        state = self._split[1]
        return nnx.to_pure_dict(
            jax.tree.map(lambda v: v.replace(v.get_metadata()["axes"]), state, is_leaf=_is_variable)
        )

    @functools.cached_property
    def abstract_params(self) -> Params:
        """Nested dict of ShapeDtypeStruct, one per parameter."""
        return nnx.to_pure_dict(self._split[1])

    def shardings(self, mesh: Mesh, rules: Rules | str) -> Params:
        """NamedSharding per parameter; fails naming the parameter if a dim does not divide."""
        return tree_shardings(self.logical_axes, self.abstract_params, mesh, get_rules(rules))

    def init(self, key: jax.Array) -> Params:
        """Random parameters (pure function of the key; jit it with out_shardings)."""
        module = Transformer(self.config, head=self.head, rngs=nnx.Rngs(params=key))
        return nnx.to_pure_dict(nnx.state(module))

    def init_sharded(self, mesh: Mesh, rules: Rules | str, seed: int = 0) -> Params:
        """Create parameters directly in their sharded layout: no full copy on any one device."""
        return _init_program(self, mesh, get_rules(rules))(jax.random.key(seed))

    def bind(self, params: Params) -> Transformer:
        """An NNX module view of ``params`` (cheap; use inside traced functions)."""
        state = jax.tree.map(lambda v: v, self._split[1], is_leaf=_is_variable)
        nnx.replace_by_pure_dict(state, params)
        return nnx.merge(self.graphdef, state)

    def apply(
        self, params: Params, tokens_bt, positions_bt=None, segment_ids_bt=None, one_segment=False
    ):
        """Logits (lm head) or values (value head) for full sequences (``one_segment``: see
        jrlhf.models.transformer.Transformer.hidden)."""
        return self.bind(params)(tokens_bt, positions_bt, segment_ids_bt, one_segment)

    def num_params(self) -> int:
        return sum(x.size for x in jax.tree.leaves(self.abstract_params))
