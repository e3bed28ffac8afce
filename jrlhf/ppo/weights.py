"""The weight channel: trained parameters follow the plan's reshard edges after every update.

The actor moves from its training layout to its generation layout, the critic to its inference
layout where the plan scores elsewhere than it trains; between processes when the plan separates
them (jrlhf.reshard: one cached transition per edge, bytes counted by the transition).

A LoRA role (jrlhf.models.lora) sends **merged weights**: the adapters are folded into their
kernels on the training mesh (one compiled ``W + scale * A @ B`` per adapted kernel, a few
percent of a train step's matmul work at the usual ranks) and the plain model moves along the
edge as a fully trained one would. Sending only the adapters would move ~rank/hidden of the
bytes, but the generation side would then have to keep the frozen base beside its merged copy
(twice the generation weights' memory), or re-merge in place by subtracting the previous
adapters (rounding that drifts with every sync in bf16), or decode with unmerged adapters (two
more thin matmuls per projection per decode step, in every decode kernel and weight layout).
Merged, the generation copy, its layouts, offload and the decode kernels are untouched, and the
bytes are those of a full fine-tune, which the resharder already keeps to the zero-redundancy
minimum (the bench reports both figures: ``python -m jrlhf.bench lora``). With generation on
processes of its own, every process calls the merge and only the training group's run it (the
generating processes own none of the training mesh's devices: JAX hands them arrays with no
local shard), then the merged kernels cross as a full fine-tune's would.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from jrlhf.placement.plan import ExecutionPlan
from jrlhf.reshard import Resharder
from jrlhf.runtime.roles import RoleSetup


class WeightChannel:
    """The trained roles' parameters in the layouts of the calls that read them next.

    ``moved[role]`` holds the latest copy per role (the actor's generation layout, the critic's
    inference layout); :meth:`sync` refreshes them from the training states.
    """

    def __init__(self, plan: ExecutionPlan, roles: Mapping[str, RoleSetup], trained: Sequence[str]):
        self.roles = roles
        self.edges = [e for e in plan.reshard_edges() if e.role in trained]
        self.resharder = Resharder()
        self.moved: dict[str, Any] = {}

    def sync(self, states: Mapping[str, Any], roles: Sequence[str] | None = None) -> int:
        """Follow the reshard edges (of ``roles``, default all) from the training ``states``;
        returns the bytes that crossed devices."""
        moved = 0
        for edge in self.edges:
            if roles is not None and edge.role not in roles:
                continue
            setup = self.roles[edge.role]
            phase = "generate" if edge.dst.endswith("_generate") else "infer"
            params = states[edge.role].params
            if setup.model.lora is not None:
                params = setup.model.merge_sharded(
                    params, setup.meshes["train"], setup.rules["train"]
                )
            transition = self.resharder.plan(params, setup.shardings(phase))
            self.moved[edge.role] = transition.run(params)
            moved += transition.bytes_moved
        return moved

    @property
    def gen_params(self) -> Any:
        """The actor's parameters in its generation layout."""
        return self.moved["actor"]

    def infer_params(self, role: str, states: Mapping[str, Any]) -> Any:
        """``role``'s parameters in its inference layout (its training copy where the plan scores
        where it trains)."""
        return self.moved.get(role, states[role].params)
