"""Where the RL trainer's idle state lives between phases: the memory knobs of ``RLConfig``.

An iteration runs the phases generate -> score -> train -> reshard. State a phase does not
read can leave the devices for it:

* ``Memory.offload``: the reference's and reward model's parameters are read only while
  scoring, the actor's and critic's AdamW state only by the update; an offloaded item lives in
  host memory outside its phases (``jrlhf.config.OFFLOAD_PHASES``) and is copied back when its
  phase begins. The copies keep every value and sharding (``jrlhf.reshard.memory``: a
  ``pinned_host`` memory kind where the backend has one), so the numbers do not change.
* ``Memory.generation_copy = "dropped"``: the actor's generation-layout copy is freed when
  generation ends; the reshard after the update rebuilds it from the training copy (as it does
  with a kept copy). Only a second generation round in one iteration (dynamic sampling) needs
  it rebuilt here, from unchanged training weights, so it is the same copy.

The trainer calls :meth:`Residency.enter` at the start of each phase (inside the phase's timer,
so the transfers count in the phase they delay) and :meth:`Residency.fetch_all` before anything
that reads all of its state outside the loop (checkpoints, evaluation).
"""

from __future__ import annotations

from typing import Any

from jrlhf.config import DROPPED_COPY_PHASES, OFFLOAD_PHASES
from jrlhf.reshard.memory import ParkedTree, park_to_host, restore_from_host


class Residency:
    """Moves a trainer's idle state between device and host memory as its ``RLConfig`` says.

    ``trainer`` is an ``RLTrainer`` whose ``states``, ``scorer`` and ``moved`` hold the state;
    items whose role the run lacks (no critic in GRPO, a Python reward) are ignored.
    """

    def __init__(self, trainer: Any):
        self.trainer = trainer
        rl = trainer.rl
        present = {
            "reference": trainer.scorer.reference is not None,
            "reward": trainer.scorer.reward_model is not None,
            "actor_optimizer": "actor" in trainer.states,
            "critic_optimizer": "critic" in trainer.states,
        }
        self.items = [item for item in rl.memory.offload if present[item]]
        self.drop_copy = rl.memory.generation_copy == "dropped"
        self.parked: dict[str, ParkedTree] = {}
        self.host_bytes = 0  # bytes copied to and from host memory so far

    # -- the items ---------------------------------------------------------------------------
    def _get(self, item: str) -> Any:
        t = self.trainer
        if item in ("reference", "reward"):
            frozen = t.scorer.reference if item == "reference" else t.scorer.reward_model
            return frozen.params
        return t.states[item.removesuffix("_optimizer")].opt_state

    def _set(self, item: str, tree: Any) -> None:
        t = self.trainer
        if item in ("reference", "reward"):
            frozen = t.scorer.reference if item == "reference" else t.scorer.reward_model
            frozen.params = tree
        else:
            role = item.removesuffix("_optimizer")
            t.states[role] = t.states[role].replace(opt_state=tree)

    def _park(self, item: str) -> None:
        parked = park_to_host(self._get(item))
        self._set(item, None)  # the device buffers were freed; nothing may read them
        self.parked[item] = parked
        self.host_bytes += parked.nbytes

    def _restore(self, item: str) -> None:
        parked = self.parked.pop(item)
        self._set(item, restore_from_host(parked))
        self.host_bytes += parked.nbytes

    # -- the schedule ------------------------------------------------------------------------
    def enter(self, phase: str) -> None:
        """Put the state where ``phase`` wants it: offloaded items on device only in their
        phases; a dropped generation copy only from the reshard to the end of generation."""
        for item in self.items:
            wanted = phase in OFFLOAD_PHASES[item]
            if wanted and item in self.parked:
                self._restore(item)
            elif not wanted and item not in self.parked:
                self._park(item)
        if self.drop_copy:
            moved = self.trainer.moved
            if phase in DROPPED_COPY_PHASES:
                if "actor" not in moved and phase == "generate":
                    self.trainer.sync_weights(roles=("actor",))
            else:
                # Only the reference goes: when the generation layout is the training layout
                # the resharder's output may share buffers with the training parameters.
                moved.pop("actor", None)

    def fetch_all(self) -> None:
        """Everything back on device (and the generation copy built): the state of a run with
        no memory knobs, for checkpoints and evaluation. The next ``enter`` moves it out again."""
        for item in list(self.parked):
            self._restore(item)
        if self.drop_copy and "actor" not in self.trainer.moved:
            self.trainer.sync_weights(roles=("actor",))
