"""Partial rollouts (Asynchrony.partial_rollout_tokens, jrlhf.ppo.partial): samples generated a
few tokens per pass, continued across weight updates with their KV recomputed."""

import jax
import numpy as np
import pytest
from test_residency import TINY, build_trainer

from jrlhf.config import ConfigError, load_config
from jrlhf.decode import DecodeEngine, EngineConfig, SamplingParams
from jrlhf.models.config import tiny_config
from jrlhf.models.model_def import ModelDef
from jrlhf.ppo import partial
from jrlhf.ppo.staleness import GeneratedBatch


def _engine():
    model_def = ModelDef(tiny_config(vocab_size=64, eos_token_id=None))
    config = EngineConfig(
        num_slots=4,
        page_size=4,
        max_prompt_len=16,
        max_new_tokens=8,
        chunk_steps=3,
        max_prefill_rows=4,
    )
    return DecodeEngine(model_def, None, "dp_tp", config), model_def.init(jax.random.key(0))


def test_passes_under_the_same_weights_equal_one_greedy_decode():
    """Recomputing the KV of a continued sample is exact: two passes of 4 tokens under the same
    weights give the greedy decode of 8 tokens in one go (an independent engine call), the
    second pass starting from the prompt and the first pass's tokens re-prefilled."""
    engine, params = _engine()
    prompts = [[5, 9, 2], [7, 1, 3, 3, 8, 12, 4], [11]]
    sp = SamplingParams(greedy=True, stop_ids=(), max_new_tokens=8)
    whole = engine.generate(params, prompts, sp)
    batch = partial.start_batch(3, prompts, None, samples=1)
    calls = []

    def generate(contexts, s, turns):
        assert turns is None
        calls.append([list(c) for c in contexts])
        return engine.generate(params, contexts, s)

    first = partial.run_pass([batch], generate, sp, version=2, tokens=4, max_len=8, run_seed=0)
    assert first == {"rows": 3, "recomputed_tokens": 0} and not any(batch.finished)
    kept = [list(c) for c in batch.completions], [x.copy() for x in batch.raw_logprobs]
    second = partial.run_pass([batch], generate, sp, version=3, tokens=4, max_len=8, run_seed=0)
    assert second == {"rows": 3, "recomputed_tokens": 12}
    assert calls[1] == [p + c for p, c in zip(prompts, kept[0])]
    assert batch.complete and batch.passes == [2, 2, 2]
    assert batch.completions == whole.completion_ids
    for ours, theirs, earlier in zip(batch.raw_logprobs, whole.raw_logprobs, kept[1]):
        np.testing.assert_array_equal(ours[:4], earlier)  # earlier tokens kept bit for bit
        np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=0)
    assert all(v.tolist() == [2] * 4 + [3] * 4 for v in batch.token_versions)
    # an in-flight batch survives the checkpoint's JSON exactly
    again = GeneratedBatch.from_json(batch.to_json())
    assert again.finished == batch.finished and again.passes == batch.passes


def test_a_sample_ends_at_its_stop_id_and_is_not_continued():
    class Fake:
        """Pretends to decode: row 0 stops at once (its stop id), row 1 runs the full budget."""

        def __init__(self):
            self.seen = []

        def __call__(self, contexts, sp, turns):
            self.seen.append(len(contexts))
            out = [[9] if c[0] == 1 else [4] * sp.max_new_tokens for c in contexts]
            return type(
                "R",
                (),
                {
                    "prompt_index": list(range(len(contexts))),
                    "completion_ids": out,
                    "raw_logprobs": [np.full(len(o), -0.5, np.float32) for o in out],
                },
            )

    fake = Fake()
    batch = partial.start_batch(0, [[1, 2], [3]], None, samples=1)
    sp = SamplingParams(stop_ids=(9,), max_new_tokens=6)
    for version in range(3):
        partial.run_pass([batch], fake, sp, version=version, tokens=2, max_len=6, run_seed=0)
    assert fake.seen == [2, 1, 1]  # the ended sample is never decoded again
    assert batch.completions == [[9], [4] * 6] and batch.passes == [1, 3]
    assert batch.token_versions[1].tolist() == [0, 0, 1, 1, 2, 2]
    assert partial.continuation_metrics([batch]) == {
        "partial/continued_frac": 0.5,
        "partial/passes_max": 3.0,
    }


@pytest.mark.parametrize(
    "bindings, message",
    [
        (["Asynchrony.partial_rollout_tokens=4"], "needs Asynchrony.max_staleness >= 1"),
        (
            ["Asynchrony.partial_rollout_tokens=5", "Asynchrony.max_staleness=4"],
            "5 must divide TaskConfig.max_response_len 16",
        ),
        (
            ["Asynchrony.partial_rollout_tokens=4", "Asynchrony.max_staleness=2"],
            "times Asynchrony.max_staleness 2, reach it",
        ),
        (
            [
                "Asynchrony.partial_rollout_tokens=8",
                "Asynchrony.max_staleness=2",
                "Fusion.enabled=True",
                "Fusion.migrate_rows=4",
            ],
            "^Fusion.migrate_rows: .*nothing waits on a tail",
        ),
    ],
)
def test_bad_partial_settings_are_refused_in_one_line(bindings, message):
    with pytest.raises(ConfigError, match=message) as e:
        load_config([], [*TINY, *bindings])
    assert "\n" not in str(e.value)


def test_trainer_continues_samples_across_updates(tmp_path):
    """max_staleness=2, 8 of 16 tokens per pass: batches 0-2 start at iteration 0 (batch 0
    takes its second pass at once: the pipeline is filling), batch 3 at iteration 1, when
    batch 1 takes its second pass under the updated weights. Every trained token is at most 2
    versions old (the trainer checks it)."""
    bindings = ["Asynchrony.max_staleness=2", "Asynchrony.partial_rollout_tokens=8"]
    trainer, loader = build_trainer(tmp_path, *bindings, "RLConfig.iterations=4")

    def draw():
        batch = loader.next_batch()
        return [r.prompt_ids for r in batch], [r.meta for r in batch]

    first, second = (trainer.run_async_iteration(draw) for _ in range(2))
    assert first["staleness/max"] == 0 and first["partial/passes_max"] == 2
    # batch 1: first halves from version 0, the continued samples' second halves from 1
    assert second["staleness/max"] == 1 and 0 < second["staleness/mean"] < 1
    assert second["partial/continued_frac"] > 0 and second["partial/recomputed_tokens"] > 0
    assert [g.index for g in trainer.pending] == [2, 3]
    assert trainer.pending[0].complete and not trainer.pending[1].complete
    assert all(np.isfinite(v) for r in (first, second) for v in r.values())
