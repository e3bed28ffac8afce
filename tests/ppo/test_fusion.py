"""Inter-stage fusion (jrlhf.ppo.fusion): scoring finished rows while the tail generates gives the
same samples and the same scores as generating first and scoring after."""

import numpy as np
import pytest

from jrlhf.config import ConfigError, load_config
from jrlhf.decode import DecodeEngine, EngineConfig, SamplingParams
from jrlhf.meshes import make_mesh
from jrlhf.meshes.mesh import replica_submesh
from jrlhf.meshes.rules import get_rules
from jrlhf.models.config import tiny_config
from jrlhf.models.model_def import ModelDef
from jrlhf.placement import effective_plan, estimator
from jrlhf.placement.plan import CallPlacement, ExecutionPlan, strategy
from jrlhf.placement.profile import DeviceProfile
from jrlhf.placement.workload import Workload
from jrlhf.ppo import batch as rl_batch
from jrlhf.ppo.fusion import fusion_score_rows, tail_migration
from jrlhf.ppo.rollout import Rollout
from jrlhf.ppo.scoring import Scorer
from jrlhf.runtime.roles import make_infer
from jrlhf.tasks import LongTailTask

P, R = 11, 64


@pytest.fixture(scope="module")
def rollouts():
    """Random tiny actor, reference, reward model and critic on the long-tailed task's vocab;
    generation on data=4 x tensor=2, scoring on fsdp=4 x tensor=2 (8 fake devices). Random
    weights stop at a random step (eos about once in 40 tokens), so rows finish across many
    decode chunks."""
    task = LongTailTask()
    cfg = tiny_config(**task.model_overrides())
    gen_mesh, infer_mesh = make_mesh("data=4,tensor=2"), make_mesh("fsdp=4,tensor=2")
    rules = get_rules("fsdp_tp")

    def infer(head, seed, fn):
        model = ModelDef(cfg, head)
        params = model.init_sharded(infer_mesh, rules, seed)
        call = make_infer(model, infer_mesh, rules, fn)
        return lambda arrays: call(params, arrays)

    scorer = Scorer(
        P,
        R,
        task.pad_id,
        infer("lm", 1, lambda m, b: rl_batch.response_logprobs(m, b, P)),
        reward_model=infer("value", 2, rl_batch.sequence_scores),
        critic=infer("value", 3, lambda m, b: rl_batch.response_values(m, b, P)),
    )
    actor = ModelDef(cfg, "lm")
    params = actor.init_sharded(gen_mesh, "dp_tp", 0)
    engine = DecodeEngine(
        actor,
        gen_mesh,
        "dp_tp",
        EngineConfig(num_slots=32, page_size=8, max_prompt_len=P, max_new_tokens=R, chunk_steps=4),
    )
    rows = fusion_score_rows(6, 32, [(infer_mesh, rules)])
    plain = Rollout(engine, scorer, eos_id=task.eos_id)
    fused = Rollout(engine, scorer, eos_id=task.eos_id, fusion_rows=rows)
    sampling = SamplingParams(
        temperature=1.0, num_samples=2, seed=5, stop_ids=(task.eos_id,), max_new_tokens=R
    )
    prompts = task.prompts(16)
    # Migration: the last 12 decoding rows move to one replica (tensor=2) of the generation mesh.
    migrating = Rollout(engine, scorer, eos_id=task.eos_id, fusion_rows=rows)
    migrating.migration = tail_migration(engine, 12, 1, avoid=infer_mesh.devices.flat)
    out = plain(params, prompts, sampling), fused(params, prompts, sampling), fused, rows
    return (*out, migrating(params, prompts, sampling), migrating)


def test_fused_rollout_gives_the_same_samples_and_scores(rollouts):
    plain, fused, rollout, rows, _, _ = rollouts
    assert rows == 8  # 6 rounded up to the 4 batch shards of the scoring mesh
    lengths = plain.result.lengths
    assert lengths.min() < 16 and lengths.max() > 32  # rows finish in many different chunks
    # Scoring started while rows were still decoding, in several chunks.
    assert rollout.fusion_stats["fusion/early_chunks"] >= 1
    assert rollout.fusion_stats["fusion/chunks"] == 4
    # Same samples, bit for bit: the engine runs the same programs.
    assert fused.responses == plain.responses
    assert fused.prompts == plain.prompts
    for a, b in zip(fused.result.raw_logprobs, plain.result.raw_logprobs):
        np.testing.assert_array_equal(a, b)
    assert fused.arrays.keys() == plain.arrays.keys()
    for k in ("tokens", "positions", "segment_ids", "response_tokens", "mask", "old_logprobs"):
        np.testing.assert_array_equal(fused.arrays[k], plain.arrays[k], err_msg=k)
    # Scores: each row once in a call of 8 rows, once among all 32. XLA may tile a matmul over
    # the batch differently, which moves the last bits only (measured: 4.8e-7 on log-probs of
    # magnitude ~4, 3e-8 on rewards, critic values equal).
    for k in ("ref_logprobs", "old_values", "scores"):
        np.testing.assert_allclose(
            fused.arrays[k], plain.arrays[k], rtol=1e-6, atol=2e-6, err_msg=k
        )


def test_migrated_tail_gives_the_same_samples_and_scores(rollouts):
    """The last rows' KV pages and decode state move to a tail engine on 2 of the 8 devices and
    finish there: the same tokens, log-probs and scores as without migration."""
    plain, _, _, _, migrated, rollout = rollouts
    stats = rollout.fusion_stats
    assert 1 <= stats["fusion/migrated_rows"] <= 12
    assert stats["fusion/tail_decode_chunks"] >= 2  # the tail decoded several chunks there
    assert len(rollout.migration.engine.mesh.devices.flat) == 2
    assert migrated.responses == plain.responses
    for a, b in zip(migrated.result.raw_logprobs, plain.result.raw_logprobs):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    for k in ("tokens", "mask", "old_logprobs", "ref_logprobs", "old_values", "scores"):
        np.testing.assert_allclose(
            migrated.arrays[k], plain.arrays[k], rtol=1e-6, atol=2e-6, err_msg=k
        )


def test_replica_submesh_takes_the_replicas_least_in_use():
    mesh = make_mesh("data=4,tensor=2")
    devs = list(mesh.devices.flat)
    tail = replica_submesh(mesh, ("data",), 1, avoid=frozenset(devs[:6]))
    assert dict(tail.shape) == {"data": 1, "tensor": 2}
    assert list(tail.devices.flat) == devs[6:]  # the one replica no scoring mesh uses
    two = replica_submesh(mesh, ("data",), 2, avoid=frozenset(devs[2:4]))
    assert list(two.devices.flat) == devs[4:8]  # replicas 2 and 3: ties go to the later ones
    with pytest.raises(ValueError, match="cannot take 5 replicas"):
        replica_submesh(mesh, ("data",), 5)


def test_fusion_score_rows_default_and_rounding():
    mesh = make_mesh("fsdp=4,tensor=2")
    rules = get_rules("fsdp_tp")
    assert fusion_score_rows(0, 64, [(mesh, rules)]) == 16  # a quarter of the rows
    assert fusion_score_rows(5, 64, [(mesh, rules)]) == 8
    assert fusion_score_rows(100, 12, [(mesh, rules)]) == 12  # at most the rows
    assert fusion_score_rows(3, 64, []) == 3


def _pricing(placement: str, profile: str, lengths, score_rows=8):
    cfg = tiny_config(vocab_size=32000, hidden_size=2048, intermediate_size=5504, num_layers=8)
    w = Workload(
        actor=cfg, critic=cfg, reference=cfg, reward=cfg, prompts=len(lengths),
        samples_per_prompt=1, prompt_len=64, gen_len=512, epochs=1, minibatch_size=8,
    )  # fmt: skip
    plan, prof = strategy(placement, 8), DeviceProfile.load(profile)
    return estimator.fused_rollout_seconds(plan, w, prof, lengths, score_rows), w, plan, prof


def test_fusion_pricing_overlaps_only_on_disjoint_concurrent_devices():
    """The estimator's fused rollout: scoring of early chunks hides behind the tail's decode
    only when scoring runs on other devices than generation and devices run concurrently."""
    tail = [8] * 28 + [64, 128, 256, 512]  # 28 rows done early, a long tail
    sep, w, plan, prof = _pricing("separate", "h100", tail)
    assert sep["overlap"] and sep["score_calls"] == 4
    # Three calls of 8 early rows run during the tail; only the last one (4 early rows and the
    # 4 tail rows, full only when generation ends) is paid after it.
    assert sep["fused_s"] == pytest.approx(sep["generate_s"] + sep["score_call_s"])
    assert sep["unfused_s"] == pytest.approx(sep["generate_s"] + sep["score_all_s"])
    assert sep["fused_s"] < sep["unfused_s"]
    # The generation part is the engine's time for the longest row (the estimator's own).
    longest = estimator.generate_seconds(
        Workload(**{**w.__dict__, "gen_len": 512}), plan["actor_generate"], prof
    )
    assert sep["generate_s"] == pytest.approx(longest)
    # Same devices (flatten), or a shared host (CPU): every call queues behind the decode.
    for placement, profile in (("flatten", "h100"), ("separate", "cpu")):
        p = _pricing(placement, profile, tail)[0]
        assert not p["overlap"]
        assert p["fused_s"] == pytest.approx(p["generate_s"] + 4 * p["score_call_s"])
    # Uniform lengths: nothing finishes early, so nothing can overlap.
    uniform = _pricing("separate", "h100", [512] * 32)[0]
    assert uniform["fused_s"] == pytest.approx(uniform["generate_s"] + 4 * uniform["score_call_s"])


def test_migration_pricing_frees_the_scoring_devices():
    """Generation on all 8 devices (4 replicas of tensor 2), scoring on devices 0-3: fused calls
    queue behind the decode until the tail moves to replica 3 (devices 6, 7), then run beside
    it; re-derived here from the estimator's own parts."""
    lengths = [8] * 28 + [64, 128, 256, 512]
    _, w, _, prof = _pricing("flatten", "h100", lengths)
    score = CallPlacement("fsdp=2,tensor=2@0:4", "fsdp_tp")
    plan = ExecutionPlan.of(
        "half-scoring",
        actor_generate=CallPlacement("data=4,tensor=2@0:8", "dp_tp"),
        reference_infer=score, reward_infer=score, critic_infer=score,
        actor_train=CallPlacement("fsdp=4,tensor=2@0:8", "fsdp_tp"),
        critic_train=CallPlacement("fsdp=4,tensor=2@0:8", "fsdp_tp"),
    )  # fmt: skip
    gen = plan["actor_generate"]
    assert estimator.tail_devices(gen, 1, frozenset(range(4))) == {6, 7}
    assert estimator.tail_devices(gen, 2, frozenset(range(4))) == {4, 5, 6, 7}
    plain = estimator.fused_rollout_seconds(plan, w, prof, lengths, 8)
    moved = estimator.fused_rollout_seconds(plan, w, prof, lengths, 8, migrate_rows=4)
    assert not plain["overlap"] and not plain["migrated"]
    assert plain["fused_s"] == pytest.approx(plain["generate_s"] + 4 * plain["score_call_s"])
    assert moved["migrated"] and moved["overlap_tail"] and moved["migrate_s"] > 0
    # The 4 tail rows move after the chunk where the 28th row ends (step 8); the 3 calls of
    # early rows are all dispatched by then, so they run beside the tail, and only the last
    # call (4 early + 4 tail rows) follows generation.
    call = moved["score_call_s"]
    assert moved["fused_s"] == pytest.approx(moved["generate_migrated_s"] + call)
    assert moved["fused_s"] < plain["fused_s"]
    # The tail: moved at the end of step 8, then 503 steps of 4 rows on devices 6 and 7.
    tail = CallPlacement("data=1,tensor=2@6,7", "dp_tp")

    def gen_s(workload, placement, n):
        return estimator.generate_seconds(
            Workload(**{**workload.__dict__, "gen_len": n}), placement, prof
        )

    g1, gn = gen_s(w, gen, 1), gen_s(w, gen, 512)
    w4 = Workload(**{**w.__dict__, "prompts": 4})
    t1, tn = gen_s(w4, tail, 1), gen_s(w4, tail, 512)
    end = g1 + (gn - g1) / 511 * 8 + moved["migrate_s"] + (tn - t1) / 511 * 503
    assert moved["generate_migrated_s"] == pytest.approx(end)
    # Scoring on every device (flatten): the tail cannot leave it; every call queues.
    fplan = _pricing("flatten", "h100", lengths)[2]
    fmoved = estimator.fused_rollout_seconds(fplan, w, prof, lengths, 8, migrate_rows=4)
    assert fmoved["migrated"] and not fmoved["overlap_tail"]
    fcall = fmoved["score_call_s"]
    assert fmoved["fused_s"] == pytest.approx(fmoved["generate_migrated_s"] + 4 * fcall)


@pytest.mark.parametrize(
    "bindings, message",
    [
        (["Fusion.migrate_rows=4"], "Fusion.migrate_rows.*needs Fusion.enabled"),
        (["Fusion.enabled=True", "Fusion.migrate_rows=-1"], "Fusion.migrate_rows"),
        (["Fusion.enabled=True", "Fusion.migrate_replicas=0"], "Fusion.migrate_replicas"),
    ],
)
def test_migration_settings_refused_in_one_line(bindings, message):
    with pytest.raises(ConfigError, match=message) as err:
        load_config([], bindings)
    assert "\n" not in str(err.value)


def test_migration_needs_fewer_replicas_than_the_generation_mesh():
    engine = DecodeEngine(
        ModelDef(tiny_config(), "lm"), make_mesh("data=2,tensor=2"), "dp_tp",
        EngineConfig(num_slots=4, max_prompt_len=8, max_new_tokens=8),
    )  # fmt: skip
    with pytest.raises(ValueError, match="migrate_replicas 2 must be fewer than .* 2 data"):
        tail_migration(engine, 2, 2)
    assert dict(tail_migration(engine, 3, 1).engine.mesh.shape) == {"data": 1, "tensor": 2}


def test_migration_replicas_checked_against_the_plan_at_start_up():
    """Before any model is built: flatten on 8 devices generates on 4 replicas (data=4 x
    tensor=2), so the tail may take 1 to 3 of them."""
    fused = ["Fusion.enabled=True", "Fusion.migrate_rows=4"]
    plan = effective_plan(load_config([], [*fused, "Fusion.migrate_replicas=3"]), 8)
    assert len(estimator.tail_replicas(plan["actor_generate"])) == 4
    with pytest.raises(ValueError, match="migrate_replicas 4 must be fewer than the 4") as err:
        effective_plan(load_config([], [*fused, "Fusion.migrate_replicas=4"]), 8)
    assert "\n" not in str(err.value)


def test_scoring_takes_any_number_of_rows_on_any_mesh():
    """Rows that do not split over the scoring mesh's batch axes (6 on fsdp=4) are padded and
    the padding dropped: each row scores as it does among rows that split, chunked or not."""
    task = LongTailTask()
    cfg = tiny_config(**task.model_overrides())
    mesh, rules = make_mesh("fsdp=4,tensor=2"), get_rules("fsdp_tp")
    model = ModelDef(cfg, "value")
    params = model.init_sharded(mesh, rules, 3)

    def values(m, b):
        return rl_batch.response_values(m, b, P)

    responses = [list(range(1, i + 2)) for i in range(8)]
    arrays = rl_batch.pack(task.prompts(8), responses, P, R, task.pad_id)
    full = np.asarray(make_infer(model, mesh, rules, values)(params, arrays))
    six = {k: v[:6] for k, v in arrays.items()}
    for batch_size in (0, 4):
        part = np.asarray(make_infer(model, mesh, rules, values, batch_size)(params, six))
        assert part.shape == full[:6].shape
        np.testing.assert_allclose(part, full[:6], rtol=1e-5, atol=1e-6)
