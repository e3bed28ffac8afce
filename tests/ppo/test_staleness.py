"""Asynchronous RL with bounded staleness (Asynchrony.max_staleness, jrlhf.ppo.staleness): the
schedule, per-token versions, the bound, identity with the synchronous loop at 0, exact resume.

Everything here runs on one process, where nothing overlaps: the schedule and its numbers are
the same as with separate generation and training processes (tests/e2e/test_multiprocess.py)."""

import dataclasses
import json
import shutil
from pathlib import Path

import gin
import jax
import numpy as np
import pytest
from run_helpers import SMALL, assert_rows_close, metric_rows, ppo_bindings

from jrlhf import checkpoint
from jrlhf.cli import train
from jrlhf.config import Asynchrony, ConfigError, Fusion, Memory, RLConfig, SampleFilters
from jrlhf.ppo import samples, staleness
from jrlhf.ppo.schedules import BoundedStaleness
from jrlhf.ppo.trainer import RLTrainer


def test_schedule_generates_each_batch_with_weights_at_most_k_versions_old():
    # batch i is generated at the start of iteration max(i - k, 0), with that version's weights
    for k in (0, 1, 3):
        made_at = {}
        for it in range(6):
            for j in staleness.batches_ahead(it, k, iterations=6):
                made_at.setdefault(j, it)
        assert sorted(made_at) == list(range(6))  # every batch once, none past the end
        for j, it in made_at.items():
            assert it == staleness.generation_version(j, k) == max(j - k, 0)
            assert 0 <= j - it <= k


def test_per_token_staleness_metrics_and_bound():
    # two samples; sample 0's tokens come from versions 3, 3, 4 (continued across an update)
    versions = staleness.versions_bt([np.array([3, 3, 4]), np.array([5])], width=4)
    mask = np.array([[1, 1, 1, 0], [1, 0, 0, 0]], np.float32)
    m = staleness.staleness_metrics(versions, mask, current=5)
    assert m == {"staleness/mean": (2 + 2 + 1 + 0) / 4, "staleness/max": 2.0}
    staleness.check_staleness(versions, mask, current=5, max_staleness=2)
    with pytest.raises(staleness.StalenessError, match="2 versions old.*max_staleness=1"):
        staleness.check_staleness(versions, mask, current=5, max_staleness=1)
    with pytest.raises(staleness.StalenessError, match="-1 versions old"):  # from the future
        staleness.check_staleness(versions, mask, current=4, max_staleness=3)


def _batch(**kwargs) -> staleness.GeneratedBatch:
    rng = np.random.default_rng(0)
    kwargs = {"meta": [{"answer": 1}, {"answer": 2}], **kwargs}
    return staleness.GeneratedBatch(
        index=3,
        prompts=[[1, 2], [3]],
        prompt_index=np.array([0, 0, 1, 1]),
        completions=[[4, 5], [6], [7, 8, 9], []],
        raw_logprobs=[rng.normal(size=n).astype(np.float32) for n in (2, 1, 3, 0)],
        token_versions=[np.array(v) for v in ([2, 2], [2], [1, 2, 2], [])],
        **kwargs,
    )


def _assert_same_batch(back: staleness.GeneratedBatch, g: staleness.GeneratedBatch) -> None:
    assert back.index == 3 and back.prompts == g.prompts and back.meta == g.meta
    assert back.completions == g.completions and back.sample_prompts == [[1, 2]] * 2 + [[3]] * 2
    for a, b in zip(back.raw_logprobs, g.raw_logprobs):
        assert a.dtype == np.float32 and np.array_equal(a, b)
    for a, b in zip(back.token_versions, g.token_versions):
        assert np.array_equal(a, b)
    assert back.finished == g.finished and back.passes == g.passes
    assert np.array_equal(back.prompt_index, g.prompt_index)


def test_generated_batch_survives_json_exactly():
    g = _batch()
    _assert_same_batch(staleness.GeneratedBatch.from_json(json.loads(json.dumps(g.to_json()))), g)


@pytest.mark.parametrize(
    "extra", [{}, {"finished": [True, False, True, False], "passes": [1, 2, 1, 3]}, {"meta": None}]
)
def test_generated_batch_survives_the_data_plane_exactly(extra):
    """A batch packed into the one byte array the sample channel moves between processes, and
    the header the control plane carries: unpacked, every field is equal, and the header's size
    does not grow with the batch."""
    g = _batch(**extra)
    header, data = samples.pack_batch(g)
    assert data.dtype == np.uint8 and data.ndim == 1 and header["bytes"] == data.size
    _assert_same_batch(samples.unpack_batch(json.loads(json.dumps(header)), data.copy()), g)
    big = staleness.GeneratedBatch(
        index=3,
        prompts=[[1] * 50] * 64,
        meta=None if "meta" in extra else [{"answer": i} for i in range(64)],
        prompt_index=np.repeat(np.arange(64), 8),
        completions=[[2] * 300] * 512,
        raw_logprobs=[np.zeros(300, np.float32)] * 512,
        token_versions=[np.zeros(300, np.int64)] * 512,
        finished=None if "finished" not in extra else [True] * 512,
        passes=None if "passes" not in extra else [1] * 512,
    )
    big_header, big_data = samples.pack_batch(big)
    assert big_data.size > 100 * data.size
    # only its numbers' digits grow: 512 samples x 300 tokens against 4 samples x 3 tokens
    assert len(json.dumps(big_header)) < min(2 * len(json.dumps(header)), 1024)


def test_config_checks():
    with pytest.raises(ConfigError, match="^Asynchrony.max_staleness: must be >= 0"):
        RLConfig(asynchrony=Asynchrony(max_staleness=-1)).validate()
    # asynchrony composes with dynamic sampling and fusion (see the tests below)
    RLConfig(
        asynchrony=Asynchrony(max_staleness=2),
        filters=SampleFilters(dynamic_sampling=True),
        samples_per_prompt=2,
        fusion=Fusion(enabled=True),
    ).validate()


def test_schedule_at_zero_staleness_is_the_synchronous_loop(base_run, colocated_run, tmp_path):
    """The bounded-staleness iteration with k = 0 (each iteration generates its own batch with
    the newest weights) gives the synchronous loop's metrics bit for bit."""
    run_dir = tmp_path / "k0"
    original = RLTrainer.run_iteration

    def through_the_schedule(self, prompts, meta=None, refill=None):
        assert self.rl.asynchrony.max_staleness == 0
        drawn = [(prompts, meta)]
        return self.run_async_iteration(lambda: drawn.pop())

    RLTrainer.run_iteration = through_the_schedule
    try:
        args = ["--run-dir", str(run_dir), "--quiet", *ppo_bindings(base_run)]
        assert train.main(args) == 0
    finally:
        RLTrainer.run_iteration = original
    ours, theirs = metric_rows(run_dir), metric_rows(colocated_run)
    assert len(ours) == len(theirs) and ours[0].keys() == theirs[0].keys()
    for a, b in zip(ours, theirs):
        assert a == b


ASYNC = ["Asynchrony.max_staleness=1", "OffPolicy.correction='tis'"]


@pytest.fixture(scope="module")
def async_run(base_run, tmp_path_factory, monkeypatch_module):
    """Four PPO iterations with max_staleness=1 and truncated IS (checkpoints at 2 and 4),
    recording what each iteration trained on."""
    seen = []
    original = BoundedStaleness._train

    def recording(self, iteration, rounds, timer, before_sync=None):
        metrics = original(self, iteration, rounds, timer, before_sync)
        if len(rounds) > 1:  # a later test's dynamic sampling (this patch lasts the module)
            return metrics
        (gen,) = rounds  # one round a batch without dynamic sampling
        # KL to the reference of the policy that sampled (per-sequence sum of k1), as scored
        arrays = gen.arrays
        kl = (arrays["old_logprobs"] - arrays["ref_logprobs"]) * arrays["mask"]
        kl = float(np.mean(kl.sum(axis=1)))
        seen.append((iteration, gen.index, [v.copy() for v in gen.token_versions],
                     [len(c) for c in gen.completions], kl))  # fmt: skip
        return metrics

    monkeypatch_module.setattr(BoundedStaleness, "_train", recording)
    run_dir = tmp_path_factory.mktemp("async") / "run"
    args = ["--run-dir", str(run_dir), "--quiet", *ppo_bindings(base_run, *ASYNC)]
    assert train.main(args) == 0
    return run_dir, seen


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_async_run_trains_on_one_version_old_samples(async_run, colocated_run):
    run_dir, seen = async_run
    rows = metric_rows(run_dir)
    assert [r["step"] for r in rows[:4]] == [1, 2, 3, 4]
    # iteration i trains on batch i generated with version max(i - 1, 0): every token says so
    assert [(it, idx) for it, idx, *_ in seen] == [(i, i) for i in range(4)]
    for it, _, versions, lengths, _ in seen:
        assert [len(v) for v in versions] == lengths and sum(lengths) > 0
        assert all(np.all(v == max(it - 1, 0)) for v in versions)
    assert [r["staleness/max"] for r in rows[:4]] == [0, 1, 1, 1]
    assert [r["staleness/mean"] for r in rows[:4]] == [0, 1, 1, 1]
    assert all("offpolicy/is_clipfrac" in r or "offpolicy/mismatch_abs" in r for r in rows[:4])
    assert all(r["offpolicy/mismatch_abs"] > 1e-3 for r in rows[1:4])  # one update apart
    # the KL metric is the sampling policy's, not the proximal log-probs the correction
    # recomputed with the newer weights (nor is the adaptive KL controller fed those)
    for (*_, kl), r in zip(seen, rows[:4]):
        assert r["kl"] == pytest.approx(kl, rel=1e-5, abs=1e-6)
    # batch 0 is the synchronous run's batch 0; batch 1 comes from the older policy
    sync = metric_rows(colocated_run)
    assert rows[0]["reward"] == sync[0]["reward"]
    assert rows[1]["reward"] != sync[1]["reward"]


def _resume_from_step_2(run_dir: Path, copy: Path, args) -> list:
    """Resume a copy of the finished run ``run_dir`` from its step-2 checkpoint (as a run stopped
    during iteration 3 would be: the step-2 checkpoint is the same either way); returns the
    checkpoint's pending batches. ``args(d)`` are the run's arguments for run directory d."""
    shutil.copytree(run_dir, copy)
    shutil.rmtree(copy / "checkpoints" / "4")
    assert checkpoint.latest_step_dir(copy).name == "2"
    pending = checkpoint.read_trainer_meta(copy / "checkpoints" / "2")["pending"]
    assert train.main([*args(copy), "--resume"]) == 0
    assert checkpoint.latest_step_dir(copy).name == "4"  # it ran iterations 3 and 4 again
    return pending


def test_async_run_resumes_exactly(async_run, base_run, tmp_path):
    """Resumed from the step-2 checkpoint, the run trains on the batch generated before it
    (saved with the checkpoint) and repeats the uninterrupted run's metrics exactly."""

    def args(run_dir):
        return ["--run-dir", str(run_dir), "--quiet", *ppo_bindings(base_run, *ASYNC)]

    resumed = tmp_path / "resumed"
    pending = _resume_from_step_2(async_run[0], resumed, args)
    assert [g["index"] for g in pending] == [2]  # batch 2, generated with version 1
    assert {v for g in pending for t in g["token_versions"] for v in t} == {1}
    ours, theirs = metric_rows(resumed), metric_rows(async_run[0])
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert a.keys() == b.keys()
        for k in a:
            np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-6, err_msg=k)


# GRPO with a verifiable reward that gives about half the prompts no signal, so DAPO's dynamic
# sampling needs more rounds than one.
DAPO = [
    "RunConfig.stages=('grpo',)",
    "TaskConfig.reward_fn='run_helpers:parity_reward'",
    "RLConfig.samples_per_prompt=4",
    "SampleFilters.dynamic_sampling=True",
    "SampleFilters.max_sampling_rounds=3",
    "RLConfig.iterations=4",
    "RLConfig.checkpoint_every=2",
    "RLConfig.kl_coef=0.0",
    *SMALL,
]


def dapo_args(base: Path, run_dir: Path, *extra: str) -> list[str]:
    inits = [f"{r}/RoleConfig.init='ckpt:{base}/sft'" for r in ("actor", "reference")]
    return ["--run-dir", str(run_dir), "--quiet", *inits, *DAPO, *extra]


def test_dynamic_sampling_at_zero_staleness_is_the_synchronous_loop(base_run, tmp_path):
    """Dynamic sampling through the bounded-staleness schedule at k = 0 (a batch's rounds
    scored as they are generated, more drawn while it is short) gives the synchronous loop's
    metrics and loader position exactly."""
    sync = tmp_path / "sync"
    assert train.main(dapo_args(base_run, sync)) == 0
    original = RLTrainer.run_iteration

    def through_the_schedule(self, prompts, meta=None, refill=None):
        drawn = [(prompts, meta)]
        return self.run_async_iteration(lambda: drawn.pop() if drawn else refill())

    RLTrainer.run_iteration = through_the_schedule
    try:
        assert train.main(dapo_args(base_run, tmp_path / "k0")) == 0
    finally:
        RLTrainer.run_iteration = original
    ours, theirs = metric_rows(tmp_path / "k0", "grpo"), metric_rows(sync, "grpo")
    assert max(r.get("sampling/rounds", 0) for r in theirs) >= 2  # more than one round ran
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert a == b
    meta = [checkpoint.read_trainer_meta(d) for d in (tmp_path / "k0", sync)]
    assert meta[0]["loader"] == meta[1]["loader"]


ASYNC_DAPO = [
    "Asynchrony.max_staleness=2",
    "Asynchrony.partial_rollout_tokens=6",
    "Fusion.enabled=True",
    "OffPolicy.correction='tis'",
]


def test_staleness_with_dynamic_sampling_fusion_and_partial_rollouts_resumes_exactly(
    base_run, tmp_path
):
    """max_staleness=2 with partial rollouts, fusion and dynamic sampling: a short batch takes
    more rounds of new prompts at later iterations (under newer weights, within the bound); the
    step-2 checkpoint holds every round in flight with its signal count, and samples caught
    mid-generation with their tokens, behaviour log-probs and versions so far; resumed from it,
    the run continues them, repeats the uninterrupted run's metrics and ends at the same loader
    position."""

    def args(run_dir):
        return dapo_args(base_run, run_dir, *ASYNC_DAPO)

    full = tmp_path / "full"
    assert train.main(args(full)) == 0
    rows = [r for r in metric_rows(full, "grpo") if "reward" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert max(r["sampling/rounds"] for r in rows) >= 2
    assert max(r["staleness/max"] for r in rows) <= 2
    for r in rows:  # every batch trains prompts_per_iteration groups
        assert r["sampling/groups_kept"] + r["sampling/groups_dropped"] == 16 * r["sampling/rounds"]
    resumed = tmp_path / "resumed"
    shutil.copytree(full, resumed)
    shutil.rmtree(resumed / "checkpoints" / "4")
    pending = checkpoint.read_trainer_meta(resumed / "checkpoints" / "2")["pending"]
    assert all("signal" in g for g in pending if all(g.get("finished", [True])))
    unfinished = [g for g in pending if not all(g.get("finished", [True]))]
    assert unfinished, [g["index"] for g in pending]  # samples caught mid-generation
    assert any(len(c) for g in unfinished for c in g["completions"])  # with tokens so far
    assert train.main([*args(resumed), "--resume"]) == 0
    assert_rows_close(metric_rows(resumed, "grpo"), metric_rows(full, "grpo"), rtol=1e-5, atol=1e-6)
    meta = [checkpoint.read_trainer_meta(d) for d in (resumed, full)]
    assert meta[0]["loader"] == meta[1]["loader"]


def test_fused_async_run_equals_the_unfused_one(async_run, base_run, tmp_path):
    """PPO at max_staleness=1 with fusion: each batch is scored by the fused rollout as its rows
    finish (one iteration before it trains), the critic's values are taken again when it trains;
    every metric equals the unfused run's to float rounding."""
    fused = tmp_path / "fused"
    bindings = ppo_bindings(base_run, *ASYNC, "Fusion.enabled=True")
    assert train.main(["--run-dir", str(fused), "--quiet", *bindings]) == 0
    rows = metric_rows(fused)
    assert all(r["fusion/chunks"] >= 1 for r in rows if "reward" in r)
    assert_rows_close(rows, metric_rows(async_run[0]), rtol=1e-4, atol=1e-5)


class _Device:
    def __init__(self, process_index: int):
        self.process_index = process_index


class _Mesh:
    def __init__(self, *processes: int):
        self.devices = np.array([_Device(p) for p in processes])


class _Role:
    def __init__(self, **meshes):
        self.meshes = meshes


def test_role_groups_and_their_refusals(monkeypatch):
    """Generation on processes of its own forms the generating group; refused in one line:
    a generating group without process 0, a dropped generation copy and tail migration (both
    would free nothing on devices no other call uses)."""
    from jrlhf.ppo.groups import role_groups

    gin.clear_config()  # RLConfig reads gin: no binding left by an earlier test's run applies
    monkeypatch.setattr(jax, "process_count", lambda: 4)
    roles = {
        "actor": _Role(generate=_Mesh(0, 1), train=_Mesh(2, 3)),
        "reference": _Role(infer=_Mesh(2, 3)),
    }
    rl = RLConfig(asynchrony=Asynchrony(max_staleness=2))
    groups = role_groups(rl, roles)
    assert (groups.generate, groups.train) == ({0, 1}, {2, 3})
    assert role_groups(RLConfig(asynchrony=Asynchrony(max_staleness=0)), roles) is None  # lockstep
    shared = {**roles, "reference": _Role(infer=_Mesh(1, 2))}
    assert role_groups(rl, shared) is None  # generation shares process 1: lockstep, warned
    for bad, roles_, why in (
        (
            rl,
            {"actor": _Role(generate=_Mesh(2, 3), train=_Mesh(0, 1)), "critic": _Role(i=_Mesh(1))},
            "include process 0",
        ),
        (
            dataclasses.replace(rl, memory=Memory(generation_copy="dropped")),
            roles,
            "frees nothing; keep it",
        ),
        (
            dataclasses.replace(rl, fusion=Fusion(enabled=True, migrate_rows=4)),
            roles,
            "frees nothing; set 0",
        ),
    ):
        with pytest.raises(ValueError, match=why):
            role_groups(bad, roles_)
