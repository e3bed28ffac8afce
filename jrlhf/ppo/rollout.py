"""The rollout: generate completions for prompts on the generation mesh, then score them.

One path for every caller: the trainer's iterations, its held-out evaluation, ``python -m
jrlhf.evaluate`` and ``python -m jrlhf.generate`` (generation only). The engine's shapes come
from the config in one place (``engine_config``), and the evaluation's sampling seed is fixed
here (``Rollout.evaluation_sampling``), so the in-run and the command-line held-out scores of one
checkpoint are the same numbers. With ``fusion_rows`` (Fusion.enabled) finished samples are
scored while generation goes on (jrlhf.ppo.fusion).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from jax.sharding import Mesh

from jrlhf.config import DECODE_LAYER_LOOPS, Config
from jrlhf.decode.engine import (
    DecodeEngine,
    EngineConfig,
    GenerationResult,
    Migration,
    round_slots,
)
from jrlhf.decode.sampling import SamplingParams
from jrlhf.envs import EnvSetup
from jrlhf.meshes.rules import Rules
from jrlhf.models.model_def import ModelDef, Params
from jrlhf.ppo.fusion import FusedScoring
from jrlhf.ppo.scoring import Scorer, sample_meta

# The (iteration, salt) the held-out evaluation draws its sampling seed from: no training
# iteration uses it, so evaluation samples differ from every rollout's.
EVAL_ITERATION, EVAL_SALT = 10**6, 99


def engine_config(cfg: Config, mesh: Mesh, rules: Rules | str) -> EngineConfig:
    """The decode engine's shapes for ``cfg``: slots for one iteration's rows (or
    DecodeConfig.num_slots), rounded up to the mesh's data shards."""
    P, R = cfg.task.max_prompt_len, cfg.task.max_response_len
    if T := cfg.rl.asynchrony.partial_rollout_tokens:
        # Continued samples come back as prompt + tokens so far: whole passes of T, or with an
        # environment's observations any length short of R.
        P += R - (1 if cfg.env.name else T)
    rows = cfg.rl.prompts_per_iteration * cfg.rl.samples_per_prompt
    slots = round_slots(cfg.decode.num_slots or rows, mesh, rules)
    return EngineConfig(
        num_slots=slots,
        page_size=cfg.decode.page_size,
        num_pages=cfg.decode.num_pages,
        max_prompt_len=P,
        max_new_tokens=R,
        chunk_steps=cfg.decode.chunk_steps,
        max_prefill_rows=min(slots, 64),
        min_prefill_len=min(16, P),
        unroll_layers=DECODE_LAYER_LOOPS[cfg.decode.layer_loop],
        max_observation_tokens=cfg.env.max_observation_tokens if cfg.env.name else 0,
        record_routes=cfg.decode.record_routes,
        pipeline_batches=cfg.decode.pipeline_batches,
    )


def padded_routes(routes: Sequence[np.ndarray], width: int) -> np.ndarray:
    """Per-completion recorded routes (tokens, layers, top_k) as one (B, width, layers, top_k)
    int32 array, -1 past each completion's end."""
    shape = routes[0].shape[1:] if routes else (0, 0)
    out = np.full((len(routes), width, *shape), -1, np.int32)
    for i, r in enumerate(routes):
        out[i, : len(r)] = r[:width]
    return out


@dataclasses.dataclass
class RolloutBatch:
    """One rollout: each sample's prompt and response, the engine's result, and the packed,
    scored arrays (jrlhf.ppo.batch layout plus old/ref log-probs, values and scores)."""

    prompts: list[Sequence[int]]
    responses: list[list[int]]
    result: GenerationResult
    arrays: dict[str, np.ndarray]


class Rollout:
    """Generates with ``engine`` and scores with ``scorer`` (None: generation only, as in
    ``python -m jrlhf.generate``). ``cfg`` (a run's config) gives the sampling of iterations
    and of evaluation; without it, callers pass their own SamplingParams. ``env`` makes every
    sample an episode of several turns answered by an environment (jrlhf.envs)."""

    def __init__(
        self,
        engine: DecodeEngine,
        scorer: Scorer | None = None,
        cfg: Config | None = None,
        eos_id: int | Sequence[int] | None = None,
        fusion_rows: int = 0,
        migration: Migration | None = None,
        env: EnvSetup | None = None,
    ):
        # One end id or several (a checkpoint's generation_config.json list): any stops a sample.
        self.engine, self.scorer, self.cfg = engine, scorer, cfg
        self.eos_ids = (
            () if eos_id is None else (eos_id,) if isinstance(eos_id, int) else tuple(eos_id)
        )
        self.fusion_rows = fusion_rows
        self.migration = migration  # of fused rollouts' long tails (jrlhf.ppo.fusion)
        self.fusion_stats: dict[str, int] = {}  # of the last fused rollout
        self.env = env

    @classmethod
    def build(
        cls,
        model: ModelDef,
        mesh: Mesh,
        rules: Rules | str,
        scorer: Scorer | None,
        cfg: Config,
        eos_id: int | Sequence[int] | None,
        fusion_rows: int = 0,
        env: EnvSetup | None = None,
    ) -> Rollout:
        """A rollout whose engine runs ``model`` on ``mesh`` with the config's engine shapes;
        ``fusion_rows`` > 0 fuses scoring into generation in calls of that many rows."""
        engine = DecodeEngine(model, mesh, rules, engine_config(cfg, mesh, rules))
        return cls(engine, scorer, cfg, eos_id, fusion_rows, env=env)

    def sampling(
        self, iteration: int, *, num_samples: int | None = None, salt: int = 0, greedy: bool = False
    ) -> SamplingParams:
        """The sampling of ``iteration``: RLConfig's temperature/top-k/top-p and a seed that is a
        pure function of (run seed, iteration, salt), so a resumed run samples the same."""
        if self.cfg is None:
            raise ValueError("this rollout has no run config: pass SamplingParams to generate()")
        rl, seed = self.cfg.rl, self.cfg.run.seed
        return SamplingParams(
            greedy=greedy,
            temperature=rl.temperature,
            top_k=rl.top_k,
            top_p=rl.top_p,
            num_samples=num_samples or rl.samples_per_prompt,
            seed=int(np.random.default_rng([seed, iteration, salt]).integers(2**31)),
            stop_ids=self.eos_ids or None,
            max_new_tokens=self.cfg.task.max_response_len,
        )

    def evaluation_sampling(self, samples: int, greedy: bool = False) -> SamplingParams:
        """The held-out evaluation's sampling (the same in-run and from the command line)."""
        return self.sampling(EVAL_ITERATION, num_samples=samples, salt=EVAL_SALT, greedy=greedy)

    def generate(
        self,
        params: Params,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingParams,
        meta: Sequence[Mapping[str, Any]] | None = None,
        fused: FusedScoring | None = None,
        migration: Migration | None = None,
    ) -> tuple[list[Sequence[int]], GenerationResult]:
        """Completions for ``prompts`` (episodes with the run's environment, whose resets get
        ``meta``), scored as they finish by ``fused`` if given; returns each sample's prompt and
        the engine's result (with its episodes' records, ``episodes``)."""
        runner = turns = None
        if self.env is not None:
            episodes = len(prompts) * sampling.num_samples
            runner = self.env.runner(meta if meta is not None else [{}] * len(prompts), episodes)
            turns = self.env.turns(runner)
            if fused is not None:  # a finished row's episode is final: its record is known
                fused.episodes_of = runner.episode_arrays
        result = self.engine.generate(
            params, prompts, sampling, on_finished=fused, migration=migration, turns=turns
        )
        if runner is not None:
            result.episodes = runner.episode_arrays(range(len(result.prompt_index)))
        return [prompts[int(i)] for i in result.prompt_index], result

    def __call__(
        self,
        params: Params,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingParams,
        meta: Sequence[Mapping[str, Any]] | None = None,
        fuse: bool = True,
    ) -> RolloutBatch:
        """Generate, then score every sample (device calls dispatched before any is fetched;
        with fusion, unless ``fuse=False``, finished samples in chunks while generation goes
        on); ``meta`` (one per prompt) reaches the reward function with each of its samples."""
        if self.scorer is None:
            raise ValueError("this rollout has no scorer: use generate()")
        if self.fusion_rows and fuse:
            fused = FusedScoring(self.scorer, self.fusion_rows, prompts, meta)
            rep, result = self.generate(
                params, prompts, sampling, meta, fused=fused, migration=self.migration
            )
            arrays = fused.finish(result)
            self.fusion_stats = fused.stats
            for k in ("migrated_rows", "tail_decode_chunks"):
                self.fusion_stats[f"fusion/{k}"] = int(result.stats.get(k, 0))
        else:
            rep, result = self.generate(params, prompts, sampling, meta)
            rep_meta = sample_meta(meta, result.prompt_index, result.episodes)
            arrays = self.scorer(
                rep, result.completion_ids, result.raw_logprobs, rep_meta, result.policy_masks,
                result.episodes,
            )  # fmt: skip
        return RolloutBatch(rep, result.completion_ids, result, arrays)

    def evaluate(
        self,
        params: Params,
        prompts: Sequence[Sequence[int]],
        samples: int,
        greedy: bool = False,
        meta: Sequence[Mapping[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """Held-out summary: mean reward, KL to the reference, response length and the
        ground-truth score when the task knows it. Never fused: the held-out numbers stay
        exactly those ``python -m jrlhf.evaluate`` reports."""
        sampling = self.evaluation_sampling(samples, greedy)
        batch = self(params, prompts, sampling, meta=meta, fuse=False)
        return self.scorer.summarize(batch.arrays, batch.prompts, batch.responses)
