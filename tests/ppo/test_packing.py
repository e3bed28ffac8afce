"""Packed training (Memory.pack_samples) and chunked log-probs (Memory.logprob_chunk): samples
laid end to end in rows with segment ids, log-probs computed a chunk of positions at a time, give
the padded layout's log-probs, loss and update (to 1e-5), on one device and sharded with
micro-batches; the packing itself is checked against the samples it came from."""

import dataclasses

import chex
import numpy as np
import optax
import pytest

from jrlhf.config import ConfigError, Memory, RLConfig, load_config
from jrlhf.data.batch import fit_microbatches, microbatch_splits
from jrlhf.meshes import make_mesh
from jrlhf.meshes.batch import batch_shards
from jrlhf.models import ModelDef, tiny_config
from jrlhf.ppo import batch as rl_batch
from jrlhf.ppo.losses import actor_loss, critic_loss
from jrlhf.runtime.steps import init_train_state, make_train_step

# One optimizer object for the module: programs are shared by optimizer identity
# (jrlhf.shared_programs), so steps and states of equal models and meshes are
# traced and compiled once.
SGD = optax.sgd(0.5)

P, R = 6, 10


def padded_batch(b=8, seed=0, vocab=256):
    """The trainer's padded layout (data.batch.pack) for ragged prompts and responses, one
    response empty, with the per-token RL fields."""
    rng = np.random.default_rng(seed)
    prompt_lens = [1, 6, 3, 4, 2, 5, 6, 1][:b]
    response_lens = [10, 0, 3, 7, 1, 10, 5, 2][:b]
    prompts = [rng.integers(4, vocab, n).tolist() for n in prompt_lens]
    responses = [rng.integers(4, vocab, n).tolist() for n in response_lens]
    batch = rl_batch.pack(prompts, responses, P, R)
    del batch["last_index"]
    normal = lambda *s: rng.normal(size=s).astype(np.float32)  # noqa: E731
    old_lp = np.log(rng.uniform(0.001, 0.02, (b, R))).astype(np.float32)
    batch.update(
        old_logprobs=old_lp,
        advantages=normal(b, R),
        ref_logprobs=(old_lp + 0.3 * normal(b, R)).astype(np.float32),
        kl_coef=np.full((b,), 0.1, np.float32),
        old_values=normal(b, R),
        returns=normal(b, R),
    )
    return batch, prompts, responses


def test_pack_segments_keeps_every_sample_and_points_at_its_response():
    batch, prompts, responses = padded_batch()
    packed = rl_batch.pack_segments(batch, P, P + R)
    tokens, seg, pos = packed["tokens"], packed["segment_ids"], packed["positions"]
    assert tokens.shape[0] < batch["tokens"].shape[0]  # the padding is gone
    assert tokens.shape[1] == P + R
    seen = []
    for row in range(tokens.shape[0]):
        for s in range(1, seg[row].max(initial=0) + 1):
            cols = np.nonzero(seg[row] == s)[0]
            assert np.array_equal(cols, np.arange(cols[0], cols[-1] + 1))  # contiguous
            np.testing.assert_array_equal(pos[row, cols], np.arange(len(cols)))  # restart at 0
            seen.append(tokens[row, cols].tolist())
    assert sorted(seen) == sorted(p + r for p, r in zip(prompts, responses))
    flat = tokens.reshape(-1)
    for i, r in enumerate(responses):
        idx = packed["pack_index"][i, : len(r)]
        # The column predicting response token j holds the token before it; j itself is next.
        np.testing.assert_array_equal(flat[idx + 1], r)
        np.testing.assert_array_equal(flat[idx], (prompts[i] + r)[len(prompts[i]) - 1 : -1])
    for name in ("mask", "old_logprobs", "advantages", "response_tokens"):
        assert packed[name] is batch[name]  # response-aligned fields untouched


def test_pack_segments_groups_and_row_multiple():
    batch, _, _ = padded_batch()
    packed = rl_batch.pack_segments(batch, P, P + R, groups=2, row_multiple=2)
    rows = packed["tokens"].shape[0]
    assert rows % 4 == 0  # 2 groups x a multiple of 2 rows
    per_group = rows // 2
    # Each group's pack_index stays inside its own block of rows.
    assert packed["pack_index"].max() < per_group * (P + R)
    with pytest.raises(ValueError, match="row_len"):
        rl_batch.pack_segments(batch, P, 8)


@pytest.fixture(scope="module")
def lm_model():
    return ModelDef(tiny_config())


def test_packed_logprobs_equal_padded(lm_model):
    import jax

    batch, _, _ = padded_batch()
    packed = rl_batch.pack_segments(batch, P, P + R)
    params = jax.jit(lm_model.init)(jax.random.key(0))
    # one program per layout (op by op, every operation would compile a program of its own)
    logprobs = jax.jit(
        lambda params, b: rl_batch.response_logprobs(lm_model.bind(params), b, P, True)
    )
    keys = ("tokens", "positions", "segment_ids", "response_tokens")
    pad_lp, pad_ent = logprobs(params, {k: batch[k] for k in keys})
    pk_lp, pk_ent = logprobs(params, {k: packed[k] for k in (*keys, "pack_index")})
    mask = batch["mask"] > 0
    np.testing.assert_allclose(np.asarray(pk_lp)[mask], np.asarray(pad_lp)[mask], atol=1e-5)
    np.testing.assert_allclose(np.asarray(pk_ent)[mask], np.asarray(pad_ent)[mask], atol=1e-5)


@pytest.mark.parametrize("head", ["lm", "value"])
def test_packed_step_equals_padded_step(head, mesh_spec="data=2,fsdp=2", microbatches=2):
    """One update of the actor (or critic) loss on the packed minibatch gives the padded one's
    loss, metrics and parameters within 1e-5, sharded and in two micro-batches (each
    micro-batch's packed rows split over the data shards). The packed actor step also computes
    its log-probs 7 positions at a time (Memory.logprob_chunk, a chunk that divides nothing):
    packing and chunking together give the padded, all-at-once update. (Packed rows without
    chunks: the token-budget test below.)"""
    rl = RLConfig(entropy_coef=0.01, kl_in_loss=True, clip_eps=0.1)
    chunked = dataclasses.replace(rl, memory=Memory(logprob_chunk=7))
    if head == "lm":
        loss_fns = actor_loss(P, rl, kl_in_loss=True), actor_loss(P, chunked, kl_in_loss=True)
    else:
        loss_fns = critic_loss(P, rl), critic_loss(P, rl)
    model = ModelDef(tiny_config(), head=head)
    mesh = make_mesh(mesh_spec)
    batch, _, _ = padded_batch()
    packed = rl_batch.pack_segments(batch, P, P + R, groups=microbatches, row_multiple=2)
    results = []
    for b, loss_fn in zip((batch, packed), loss_fns):
        opt = SGD  # linear in the gradient: parameters comparable at 1e-5
        state = init_train_state(model, opt, mesh, "fsdp_tp", seed=0)
        step = make_train_step(model, opt, loss_fn, mesh, "fsdp_tp", microbatches=microbatches)
        state, metrics = step(state, b)
        results.append(({k: float(v) for k, v in metrics.items()}, state.params))
    (m_pad, p_pad), (m_pk, p_pk) = results
    assert m_pad.keys() == m_pk.keys()
    for k in m_pad:
        np.testing.assert_allclose(m_pk[k], m_pad[k], rtol=1e-5, atol=1e-6, err_msg=k)
    chex.assert_trees_all_close(p_pk, p_pad, rtol=1e-5, atol=1e-5)


def test_a_token_budget_gives_packed_short_samples_fewer_microbatches_and_the_same_update():
    """RoleConfig.microbatch_tokens (data.batch.fit_microbatches): at most 48 token columns per
    device and micro-batch over 2 data shards. The padded batch (8 rows of 16 columns) needs 2
    micro-batches (2 rows a device each), the packed one 1 (its 6 packed rows, 3 a device), the
    fewest that fit; every split is of whole rows per shard (and of whole pairs where asked).
    The update, with the split passed per call to a step built for one micro-batch, is the
    padded one-micro-batch update within 1e-5."""
    batch, _, _ = padded_batch()
    rows, row_len = batch["tokens"].shape
    mesh = make_mesh("data=2,tensor=2")
    shards, budget = batch_shards(mesh, "fsdp_tp"), 48
    assert shards == 2
    assert microbatch_splits(rows, shards) == [1, 2, 4]
    assert microbatch_splits(rows, 1, unit=2) == [1, 2, 4]
    assert microbatch_splits(6, 4) == []  # 6 rows never split over 4 shards
    m_pad, same = fit_microbatches(batch, budget, shards, P)
    assert (m_pad, same) == (2, batch)
    m_pk, packed = fit_microbatches(batch, budget, shards, P, pack=True)
    assert m_pk == 1 and packed["tokens"].shape == (6, row_len)
    assert fit_microbatches(batch, row_len, shards, P)[0] == 4  # the finest: a row a device
    assert fit_microbatches(batch, 1, shards, P)[0] == 4  # nothing fits: the finest too

    rl = RLConfig(entropy_coef=0.01, kl_in_loss=True, clip_eps=0.1)
    loss_fn = actor_loss(P, rl, kl_in_loss=True)
    model = ModelDef(tiny_config())
    results = []
    for b, m in ((batch, 1), (batch, m_pad), (packed, m_pk)):
        opt = SGD
        state = init_train_state(model, opt, mesh, "fsdp_tp", seed=0)
        step = make_train_step(model, opt, loss_fn, mesh, "fsdp_tp")
        state, metrics = step(state, b, m)
        results.append(({k: float(v) for k, v in metrics.items()}, state.params))
    (m_ref, p_ref), *others = results
    for m_got, p_got in others:
        for k in m_ref.keys() - {"weight"}:  # a split's weight is the micro-batches' weighted mean
            np.testing.assert_allclose(m_got[k], m_ref[k], rtol=1e-5, atol=1e-6, err_msg=k)
        chex.assert_trees_all_close(p_got, p_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "bindings,message",
    [
        (
            ["actor/RoleConfig.microbatch_tokens=512", "actor/RoleConfig.microbatches=2"],
            "actor/RoleConfig.microbatch_tokens: set either it or actor/RoleConfig.microbatches=2",
        ),
        (["critic/RoleConfig.microbatch_tokens=-1"], "critic/RoleConfig.microbatch_tokens: must"),
        (
            ["critic/RoleConfig.microbatch_tokens=3"],
            "critic/RoleConfig.microbatch_tokens: 3 is less than one row",
        ),
    ],
)
def test_bad_token_budgets_are_refused_in_one_line(bindings, message):
    with pytest.raises(ConfigError) as err:
        load_config([], bindings)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_chunked_logprobs_equal_whole(lm_model):
    """Memory.logprob_chunk: log-probs and entropies computed 7 positions at a time (a chunk
    that does not divide the positions) are the all-at-once values."""
    import jax

    batch, _, _ = padded_batch()
    module = lm_model.bind(lm_model.init(jax.random.key(1)))
    keys = ("tokens", "positions", "segment_ids", "response_tokens")
    whole = rl_batch.response_logprobs(module, {k: batch[k] for k in keys}, P, True)
    chunked = rl_batch.response_logprobs(module, {k: batch[k] for k in keys}, P, True, chunk=7)
    for a, b in zip(chunked, whole):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-5)
