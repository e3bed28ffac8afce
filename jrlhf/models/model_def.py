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
from jrlhf.models import lora as lora_lib
from jrlhf.models.config import ModelConfig
from jrlhf.models.lora import LoraConfig
from jrlhf.models.transformer import Transformer

Params = dict[str, Any]  # nested dict of arrays, the pure form of the model's nnx.State


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


@functools.lru_cache(maxsize=64)
def _abstract_split(config: ModelConfig, head: str, lora: LoraConfig | None = None):
    """The abstract module's (graphdef, state), shared by every ModelDef of one config and head:
    tracing the module takes a noticeable fraction of a second, and a run builds several
    ModelDefs of one config (actor and reference; critic and reward)."""
    module = nnx.eval_shape(lambda: Transformer(config, head=head, rngs=nnx.Rngs(0), lora=lora))
    return nnx.split(module)


@functools.lru_cache(maxsize=64)
def _init_program(model: ModelDef, mesh: Mesh, rules: Rules):
    """One jitted initializer per model, mesh and rule set. A process builds the same model on
    the same mesh several times (actor and reference; critic and reward; every run of a test
    session or a notebook), and tracing and lowering a module's initializer took about a quarter
    of a second each time on the 2-core CPU machine."""
    return jax.jit(model.init, out_shardings=model.shardings(mesh, rules))


@functools.lru_cache(maxsize=64)
def _merge_program(model: ModelDef, mesh: Mesh, rules: Rules):
    """One jitted merge per LoRA model, mesh and rule set: the base model's parameters in their
    layout on ``mesh``."""
    return jax.jit(model.merge, out_shardings=model.base.shardings(mesh, rules))


@dataclasses.dataclass(frozen=True)
class ModelDef:
    """A model's config, head kind and LoRA adapters (None: none); everything else is derived
    from them.

    With ``lora`` the parameter tree holds the adapters beside the base weights it adapts;
    :meth:`trainable` is the part an optimizer updates (adapters and a value head), the rest is
    frozen; :attr:`base` is the plain model that :meth:`merge`'s output runs (generation,
    export).
    """

    config: ModelConfig
    head: str = "lm"
    lora: LoraConfig | None = None

    @property
    def _split(self):
        return _abstract_split(self.config, self.head, self.lora)

    @property
    def base(self) -> ModelDef:
        """This model without adapters (itself when it has none)."""
        return self if self.lora is None else dataclasses.replace(self, lora=None)

    def trainable(self, params: Params) -> Params:
        """The parameters an optimizer updates: all of them, or with LoRA the adapters and a
        value head (a tree of the same nesting with only those leaves)."""
        return params if self.lora is None else lora_lib.trainable(params)

    def with_trainable(self, params: Params, trainable: Params) -> Params:
        """``params`` with its :meth:`trainable` part replaced by ``trainable``."""
        return trainable if self.lora is None else lora_lib.combine(params, trainable)

    def merge(self, params: Params) -> Params:
        """Parameters of :attr:`base` computing what ``params`` compute (adapters folded into
        their kernels); ``params`` themselves without LoRA."""
        return params if self.lora is None else lora_lib.merge(params, self.lora)

    def merge_sharded(self, params: Params, mesh: Mesh, rules: Rules | str) -> Params:
        """:meth:`merge` as one compiled program whose output is laid out on ``mesh`` by
        ``rules`` (``params`` themselves without LoRA)."""
        if self.lora is None:
            return params
        return _merge_program(self, mesh, get_rules(rules))(params)

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
        module = Transformer(self.config, head=self.head, rngs=nnx.Rngs(params=key), lora=self.lora)
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
