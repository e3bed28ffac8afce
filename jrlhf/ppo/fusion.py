"""Inter-stage fusion (RLHFuse): score finished samples while the long tail still generates.

Without fusion a rollout generates every sample, then scores them all (reference log-probs,
reward, critic values). With ``Fusion.enabled`` the decode engine hands over the rows that
finished in each decode chunk (``DecodeEngine.generate(on_finished=...)``, called right after the
next chunk is dispatched); once ``score_rows`` finished rows have accumulated they are packed and
their scoring calls dispatched, and the rest are scored when generation ends. Every scoring call
has ``score_rows`` rows (the last one padded by repeating rows), so one compiled program per role
serves them all.

What overlaps: the host work of a chunk (packing, a Python reward function) runs while the
devices decode the next chunk. The device scoring calls overlap the tail's decode only where they
run on other devices than generation *and* those devices execute concurrently (GPUs, or devices
of another process; neither measured here). On one CPU process XLA runs computations one at a
time, so there the fused rollout costs the unfused one's device time plus the overheads of its
extra, smaller scoring calls
(``python -m jrlhf.bench fusion`` measures both; jrlhf.placement.estimator.fused_rollout_seconds
prices them).

Samples are identical with and without fusion (the engine's programs do not change). Scores are
the same up to float rounding: a row scored in a batch of ``score_rows`` rows can differ from the
same row scored among all rows in the last bits, because XLA may tile a matmul over the batch
differently (tests/ppo/test_fusion.py bounds it).

Migration (``Fusion.migrate_rows``, RLHFuse's): once no prompt waits and at most that many
rows are still decoding, the engine hands their KV pages and decode state over to a tail engine
on ``Fusion.migrate_replicas`` of the generation mesh's data-parallel replicas, chosen among
those the scoring meshes use least (``tail_migration``), and they finish there. Scoring calls
dispatched after that no longer queue behind the tail on the other devices (where devices run
concurrently); the samples are the same, since the KV moves unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from jax.sharding import Mesh

from jrlhf.decode.engine import DecodeEngine, FinishedRow, GenerationResult, Migration
from jrlhf.envs import episode_meta
from jrlhf.meshes.batch import batch_sharding
from jrlhf.meshes.mesh import replica_submesh
from jrlhf.meshes.rules import Rules, axis_size, logical_to_spec
from jrlhf.ppo.scoring import PendingScores, Scorer


def fusion_score_rows(requested: int, rows: int, meshes: Sequence[tuple[Mesh, Rules]]) -> int:
    """Rows per fused scoring call: ``requested`` (0: a quarter of the iteration's ``rows``),
    at most ``rows``, rounded up to a multiple of every scoring mesh's batch shards."""
    n = requested or max(1, rows // 4)
    n = max(1, min(n, rows))
    shards = 1
    for mesh, rules in meshes:
        spec = batch_sharding(mesh, rules, 2).spec
        shards = np.lcm(shards, axis_size(mesh, spec[0] if spec else None))
    return int(-(-n // shards) * shards)


def tail_migration(
    engine: DecodeEngine,
    rows: int,
    replicas: int,
    avoid: Iterable = (),
    transfer: Callable[[Any, Any], Any] | None = None,
) -> Migration:
    """The migration of a fused rollout's last ``rows`` sequences onto ``replicas`` of
    ``engine``'s data-parallel replicas: those holding the fewest ``avoid`` devices (the
    scoring meshes'), so scoring there need not wait for the tail. One line of error when the
    generation mesh has no more replicas than that."""
    mesh = engine.mesh
    # With the generation mesh over several processes every process still drives the tail's
    # loop (a call on a mesh without its devices does nothing there, and host reads reach every
    # process: to_host); the hand-over moves rows onto the tail's devices within the mesh (the
    # resharder's stack path).
    data = logical_to_spec(("slots",), mesh, engine.rules)[0]
    data = () if data is None else (data,) if isinstance(data, str) else tuple(data)
    total = axis_size(mesh, data or None)
    if replicas >= total:
        raise ValueError(
            f"Fusion.migrate_replicas {replicas} must be fewer than the generation mesh's "
            f"{total} data-parallel replicas ({dict(mesh.shape)}): nothing would be freed"
        )
    tail_mesh = replica_submesh(mesh, data, replicas, frozenset(avoid))
    tail = engine.tail(tail_mesh, rows)
    if transfer is None:
        return Migration(tail, rows)
    return Migration(tail, rows, transfer)


class FusedScoring:
    """The ``on_finished`` callback of one fused rollout: accumulates finished rows, scores
    them ``score_rows`` at a time, and assembles the scored batch in request order.

    ``prompts``/``meta`` are per prompt (a row's prompt is ``prompts[row.prompt_index]``).
    ``stats`` (after :meth:`finish`): scoring calls, and those (and their rows) dispatched while
    rows were still decoding.
    """

    def __init__(
        self,
        scorer: Scorer,
        score_rows: int,
        prompts: Sequence[Sequence[int]],
        meta: Sequence[Mapping[str, Any]] | None = None,
        episodes_of: Callable[[Sequence[int]], Mapping[str, np.ndarray]] | None = None,
    ):
        self.scorer, self.score_rows = scorer, score_rows
        self.prompts, self.meta = prompts, meta
        # Multi-turn: the records of finished rows' episodes (final once a row has finished).
        self.episodes_of = episodes_of
        self.pending: list[FinishedRow] = []
        self.chunks: list[tuple[np.ndarray, PendingScores]] = []
        self.calls = 0  # on_finished calls so far
        self.dispatched_at: list[int] = []  # the call each chunk was dispatched in
        self.stats: dict[str, int] = {}

    def __call__(self, rows: list[FinishedRow]) -> None:
        self.calls += 1
        self.pending.extend(rows)
        while len(self.pending) >= self.score_rows:
            self._dispatch(self.pending[: self.score_rows])
            del self.pending[: self.score_rows]

    def _dispatch(self, rows: list[FinishedRow]) -> None:
        prompts = [self.prompts[r.prompt_index] for r in rows]
        meta = None if self.meta is None else [self.meta[r.prompt_index] for r in rows]
        episodes = None
        if self.episodes_of is not None:
            episodes = self.episodes_of([r.index for r in rows])
            meta = [
                {**(m or {}), **episode_meta(episodes, i)}
                for i, m in enumerate(meta or [{}] * len(rows))
            ]
        policy = [r.policy_mask for r in rows] if rows[0].policy_mask is not None else None
        pending = self.scorer.dispatch(
            prompts,
            [r.completion_ids for r in rows],
            [r.raw_logprobs for r in rows],
            meta=meta,
            pad_to=self.score_rows,
            policy_masks=policy,
            episodes=episodes,
        )
        self.chunks.append((np.array([r.index for r in rows]), pending))
        self.dispatched_at.append(self.calls)

    def finish(self, result: GenerationResult) -> dict[str, np.ndarray]:
        """Score what is left and return the packed, scored arrays of every row in request
        order (what :meth:`Scorer.__call__` returns for the whole batch)."""
        # Chunks dispatched before the engine's last call came while rows were still decoding.
        early = [i for (i, _), c in zip(self.chunks, self.dispatched_at) if c < self.calls]
        if self.pending:
            self._dispatch(self.pending)
            self.pending = []
        total = len(result.completion_ids)
        out: dict[str, np.ndarray] = {}
        for index, pending in self.chunks:
            arrays = self.scorer.collect(pending)
            for k, v in arrays.items():
                if k not in out:
                    out[k] = np.zeros((total, *v.shape[1:]), v.dtype)
                out[k][index] = v
        self.stats = {
            "fusion/chunks": len(self.chunks),
            "fusion/early_chunks": len(early),
            "fusion/early_rows": sum(len(i) for i in early),
        }
        return out
