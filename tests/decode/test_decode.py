"""Paged-KV decode engine: parity with transformers and the trainer, meshes, batching, pages."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrlhf.decode import DecodeEngine, EngineConfig, PageAllocator, SamplingParams
from jrlhf.meshes import make_mesh
from jrlhf.models.config import tiny_config
from jrlhf.models.hf import load_hf
from jrlhf.models.logprobs import token_logprobs
from jrlhf.models.model_def import ModelDef
from tests.hf_fixtures import hf_checkpoint

ENGINE = EngineConfig(
    num_slots=4,
    page_size=4,
    max_prompt_len=24,
    max_new_tokens=10,
    chunk_steps=4,
    max_prefill_rows=4,
)
PROMPT_LENS = (3, 11, 17, 5, 1, 8, 14)  # 7 prompts > 4 slots: slots are refilled


def _prompts(lens=PROMPT_LENS, vocab=128, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=n).tolist() for n in lens]


@functools.cache
def _hf(kind: str, mesh_text: str = "data=1,tensor=1"):
    mesh = make_mesh(mesh_text)
    model_def, params = load_hf(hf_checkpoint(kind), mesh, "dp_tp")
    return model_def, params, mesh


@functools.cache
def _engine(kind: str, mesh_text: str = "data=1,tensor=1"):
    model_def, params, mesh = _hf(kind, mesh_text)
    return DecodeEngine(model_def, mesh, "dp_tp", ENGINE), params


def _hf_greedy(kind, prompts, max_new, eos):
    import torch
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(hf_checkpoint(kind), dtype=torch.float32)
    out = []
    with torch.no_grad():
        for p in prompts:
            g = model.eval().generate(
                torch.tensor([p]),
                do_sample=False,
                max_new_tokens=max_new,
                eos_token_id=list(eos),
                pad_token_id=0,
            )
            out.append(g[0, len(p) :].tolist())
    return out


@pytest.mark.parametrize("kind", ["llama3", "qwen2", "qwen3", "gemma2", "gemma3"])
def test_greedy_matches_transformers_with_refills_and_stops(kind):
    engine, params = _engine(kind)
    prompts = _prompts()
    first = _hf_greedy(kind, prompts, ENGINE.max_new_tokens, eos=(2,))
    # Random models rarely say EOS; add a token they do emit as a stop id so sequences end early
    # at different steps, slots free up unevenly and the stop itself is compared.
    stop = first[0][3]
    want = _hf_greedy(kind, prompts, ENGINE.max_new_tokens, eos=(2, stop))
    got = engine.generate(params, prompts, SamplingParams(greedy=True, stop_ids=(2, stop)))
    assert got.completion_ids == want
    assert any(len(c) < ENGINE.max_new_tokens for c in want)  # a stop really happened
    assert got.stats["prefill_calls"] >= 2  # freed slots were refilled from the queue
    np.testing.assert_array_equal(got.lengths, [len(c) for c in want])
    if kind not in ("llama3", "qwen2"):  # theirs: test_raw_logprobs_equal_trainer_forward
        lps = _trainer_logprobs(engine.model_def, params, prompts, got.completion_ids)
        for got_lp, want_lp in zip(got.raw_logprobs, lps):
            np.testing.assert_allclose(got_lp, want_lp, atol=1e-5, rtol=0)


def _trainer_logprobs(model_def, params, prompts_rep, completions):
    """The trainer's view: one right-padded forward pass over prompt + completion."""
    total = max(len(p) + len(c) for p, c in zip(prompts_rep, completions))
    n = len(completions)
    tokens = np.zeros((n, total), np.int32)
    segments = np.zeros((n, total), np.int32)
    for i, (p, c) in enumerate(zip(prompts_rep, completions)):
        seq = p + c
        tokens[i, : len(seq)] = seq
        segments[i, : len(seq)] = 1
    positions = np.broadcast_to(np.arange(total, dtype=np.int32), (n, total))
    logits = jax.jit(model_def.apply)(params, tokens, positions, segments)
    lp = np.asarray(token_logprobs(logits[:, :-1], tokens[:, 1:]))
    return [
        lp[i, len(p) - 1 : len(p) - 1 + len(c)]
        for i, (p, c) in enumerate(zip(prompts_rep, completions))
    ]


def test_gemma_layers_scanned_per_layer_windows_and_soft_caps():
    """Under the scanned layer loop each layer's window is a switch on the traced layer index;
    soft-capped scores (Gemma 2) take a kernel that computes them (on a GPU the blocked one).
    Greedy tokens equal transformers', raw log-probs the trainer's forward pass."""
    prompts = _prompts()
    for kind in ("gemma2", "gemma3"):
        model_def, params, mesh = _hf(kind)
        config = dataclasses.replace(ENGINE, unroll_layers=False)
        engine = DecodeEngine(model_def, mesh, "dp_tp", config)
        if jax.default_backend() == "cpu":  # the C++ kernel soft-caps too
            assert engine.kernel_name == "native_cpu"
        want = _hf_greedy(kind, prompts, ENGINE.max_new_tokens, eos=(2,))
        got = engine.generate(params, prompts, SamplingParams(greedy=True, stop_ids=(2,)))
        assert got.completion_ids == want, kind
        lps = _trainer_logprobs(model_def, params, prompts, got.completion_ids)
        for got_lp, want_lp in zip(got.raw_logprobs, lps):
            np.testing.assert_allclose(got_lp, want_lp, atol=1e-5, rtol=0)


def test_raw_logprobs_equal_trainer_forward():
    engine, params = _engine("llama3")
    prompts = _prompts()
    sp = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, num_samples=2, seed=3)
    out = engine.generate(params, prompts, sp)
    assert len(out.completion_ids) == 2 * len(prompts)
    np.testing.assert_array_equal(out.prompt_index, np.repeat(np.arange(len(prompts)), 2))
    prompts_rep = [prompts[i] for i in out.prompt_index]
    want = _trainer_logprobs(engine.model_def, params, prompts_rep, out.completion_ids)
    for got_lp, want_lp in zip(out.raw_logprobs, want):
        np.testing.assert_allclose(got_lp, want_lp, atol=1e-5, rtol=0)
    # The sampling distribution is sharper (temperature < 1, filtered): its log-probs differ.
    slp = np.concatenate(out.sampling_logprobs)
    rlp = np.concatenate(out.raw_logprobs)
    assert np.all(slp <= 0) and np.all(np.isfinite(slp)) and not np.allclose(slp, rlp)
    # The two samples of a prompt are different draws.
    assert out.completion_ids[0] != out.completion_ids[1]


def test_identical_on_one_device_and_data_tensor_mesh():
    prompts = _prompts()
    # Same flags as the log-prob test, so the 1-device programs are already compiled.
    sp = SamplingParams(temperature=0.9, top_k=30, top_p=0.95, num_samples=2, seed=11)
    one, p1 = _engine("llama3")
    two, p2 = _engine("llama3", "data=2,tensor=2")
    assert two.num_shards == 2
    a = one.generate(p1, prompts, sp)
    b = two.generate(p2, prompts, sp)
    assert a.completion_ids == b.completion_ids
    for x, y in zip(a.raw_logprobs + a.sampling_logprobs, b.raw_logprobs + b.sampling_logprobs):
        np.testing.assert_allclose(x, y, atol=1e-5, rtol=0)
    # The pool really is split: pages over data, kv heads over tensor.
    spec = two.state.k_pages.sharding.spec
    assert spec[1] == "data" and spec[3] == "tensor"
    # Query heads over a tensor size larger than the KV heads (8 heads, 4 KV heads, tensor 8):
    # the KV heads are replicated over tensor and each shard attends with its own one.
    mesh = make_mesh("data=1,tensor=8")
    model_def, p8 = load_hf(hf_checkpoint("llama3"), mesh, "dp_tp_kv_replicated")
    wide = DecodeEngine(model_def, mesh, "dp_tp_kv_replicated", ENGINE)
    c = wide.generate(p8, prompts, sp)
    assert a.completion_ids == c.completion_ids
    for x, y in zip(a.raw_logprobs + a.sampling_logprobs, c.raw_logprobs + c.sampling_logprobs):
        np.testing.assert_allclose(x, y, atol=1e-5, rtol=0)
    assert p8["layers"]["attn"]["q_kernel"].sharding.spec[2] == "tensor"
    assert wide.state.k_pages.sharding.spec[3] is None
    with pytest.raises(ValueError, match="cannot be split over tensor size 8"):
        DecodeEngine(model_def, mesh, "dp_tp", ENGINE)


def test_engine_config_refuses_an_unknown_kernel_before_any_build():
    with pytest.raises(ValueError, match="EngineConfig.kernel 'flash' unknown"):
        EngineConfig(kernel="flash")


@functools.cache
def _tiny():
    model_def = ModelDef(tiny_config(vocab_size=64, eos_token_id=None))
    return model_def, jax.jit(model_def.init)(jax.random.key(0))


def test_seeds_determinism_and_no_recompiles():
    model_def, params = _tiny()
    cfg = EngineConfig(
        num_slots=4,
        page_size=4,
        max_prompt_len=16,
        max_new_tokens=8,
        chunk_steps=3,
        max_prefill_rows=4,
    )
    engine = DecodeEngine(model_def, None, "dp_tp", cfg)
    prompts = _prompts((5, 9, 2, 7, 12, 4), vocab=64)
    sp = SamplingParams(temperature=1.3, seed=5)
    a = engine.generate(params, prompts, sp)
    counts = engine.compile_counts()
    b = engine.generate(params, prompts, sp)
    assert a.completion_ids == b.completion_ids
    assert (
        engine.generate(params, prompts, SamplingParams(temperature=1.3, seed=6)).completion_ids
        != a.completion_ids
    )
    # Per-prompt seeds: a prompt's completion does not depend on what else is in the batch.
    seeds = (10, 20, 30, 40, 50, 60)
    full = engine.generate(params, prompts, SamplingParams(temperature=1.3, seeds=seeds))
    alone = engine.generate(params, prompts[3:4], SamplingParams(temperature=1.3, seeds=seeds[3:4]))
    assert alone.completion_ids[0] == full.completion_ids[3]
    # More prompts, other temperatures and stop ids: no new decode program, bounded prefills.
    many = _prompts((5, 9, 2, 7, 12, 4, 3, 8, 10, 6, 1), vocab=64)
    engine.generate(params, many, SamplingParams(temperature=0.5, seed=1, stop_ids=(7, 9)))
    after = engine.compile_counts()
    assert after["decode_chunk"] == counts["decode_chunk"] == 1
    assert after["insert"] <= 3 * 2  # row buckets {1, 2, 4} x length buckets {..8?, 16}


def test_small_pool_back_pressure_and_reuse():
    model_def, params = _tiny()
    prompts = _prompts((5, 9, 2, 7, 12, 4, 3), vocab=64)
    sp = SamplingParams(greedy=True)
    roomy = DecodeEngine(
        model_def,
        None,
        "dp_tp",
        EngineConfig(num_slots=4, page_size=4, max_prompt_len=16, max_new_tokens=8, chunk_steps=3),
    )
    # 5 pages: at most one or two sequences fit at once although there are 4 slots.
    tight = DecodeEngine(
        model_def,
        None,
        "dp_tp",
        EngineConfig(
            num_slots=4,
            page_size=4,
            num_pages=5,
            max_prompt_len=16,
            max_new_tokens=8,
            chunk_steps=3,
        ),
    )
    want = roomy.generate(params, prompts, sp)
    got = tight.generate(params, prompts, sp)
    assert got.completion_ids == want.completion_ids
    assert got.stats["peak_pages_used"] <= 5 < want.stats["peak_pages_used"]
    with pytest.raises(ValueError, match="pages"):
        tight.generate(params, [list(range(1, 17))], sp)  # 16 + 8 tokens never fit in 5 pages
    with pytest.raises(ValueError, match="max_prompt_len"):
        tight.generate(params, [list(range(1, 20))], sp)


def test_page_allocator_frees_and_reuses_pages():
    alloc = PageAllocator(
        num_shards=2, pages_per_shard=4, slots_per_shard=2, page_size=4, max_pages_per_seq=4
    )
    assert alloc.can_admit(0, 12) and alloc.can_admit(2, 16)
    alloc.admit(0, 12)  # reserves 3 of shard 0's 4 pages
    assert not alloc.can_admit(1, 8) and alloc.can_admit(1, 4) and alloc.can_admit(2, 16)
    alloc.grow(0, 5)
    assert alloc.table[0, :3].tolist() == [0, 1, 4] and alloc.used == 2
    np.testing.assert_array_equal(alloc.global_rows(0)[:2], [0, 1])
    alloc.admit(3, 8)
    alloc.grow(3, 8)
    np.testing.assert_array_equal(alloc.global_rows(3)[:2], [4, 5])  # shard 1's pages
    alloc.release(0)
    assert alloc.used == 2 and alloc.can_admit(1, 16) and alloc.table[0, 0] == 4
    alloc.admit(1, 16)
    alloc.grow(1, 16)
    assert sorted(alloc.table[1].tolist()) == [0, 1, 2, 3] and alloc.peak_used == 6


def test_sampling_filters():
    from jrlhf.decode.sampling import filter_logits

    logits = jnp.log(jnp.array([[0.5, 0.25, 0.15, 0.1]]))
    keep = lambda **kw: np.isfinite(np.asarray(filter_logits(logits, **kw)))[0].tolist()  # noqa: E731
    assert keep(temperature=1.0, top_k=2, top_p=1.0) == [True, True, False, False]
    assert keep(temperature=1.0, top_k=0, top_p=0.7) == [True, True, False, False]
    assert keep(temperature=1.0, top_k=0, top_p=0.5) == [True, False, False, False]
    assert keep(temperature=1.0, top_k=0, top_p=1.0) == [True] * 4
    with pytest.raises(ValueError):
        SamplingParams(temperature=0.0)


def test_first_argmax_and_sampling_match_jax():
    """The sampler's argmax is jnp.argmax (first maximum; a NaN wins), and its Gumbel-max draw
    is jax.random.categorical's: the same tokens for the same keys."""
    from jrlhf.decode.sampling import first_argmax, sample_tokens

    rng = np.random.default_rng(0)
    x = rng.integers(0, 5, size=(64, 33)).astype(np.float32)  # many ties
    x[3, [7, 20]] = np.nan
    x[4] = -np.inf
    np.testing.assert_array_equal(np.asarray(first_argmax(jnp.asarray(x))), np.argmax(x, -1))
    # Rows of 8197, where XLA:CPU's max can drop a NaN: the first NaN still wins, after the
    # maximum or after an infinity too
    long = rng.standard_normal((6, 8197)).astype(np.float32)
    long[0, 8000] = np.nan
    long[1, [10, 100]] = np.nan
    long[2, 50], long[2, 60] = np.inf, np.nan
    long[3] = -np.inf
    long[4, 4096] = 40.0
    for fn in (first_argmax, jax.jit(first_argmax)):
        np.testing.assert_array_equal(np.asarray(fn(jnp.asarray(long))), np.argmax(long, -1))
    logits = jnp.asarray(3 * rng.standard_normal((32, 300)), jnp.float32)
    keys = jax.random.key_data(jax.random.split(jax.random.key(1), 32))
    tokens, _, raw = sample_tokens(
        logits, keys, jnp.float32(0.7), jnp.int32(0), jnp.float32(1.0), greedy=False, filtered=False
    )
    want = jax.vmap(lambda k, row: jax.random.categorical(k, row))(keys, logits / 0.7)
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(want))
    assert tokens.dtype == jnp.int32
    np.testing.assert_allclose(
        raw, jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, None], -1)[:, 0], atol=1e-5
    )


def test_page_allocator_shared_prefix_pages():
    alloc = PageAllocator(
        num_shards=2, pages_per_shard=6, slots_per_shard=2, page_size=4, max_pages_per_seq=4
    )
    alloc.admit(0, 14)  # 4 pages reserved
    alloc.grow(0, 10)  # 3 pages: 2 full prompt pages + the partial one
    assert not alloc.can_admit(1, 14) and alloc.can_admit(1, 14, shared=2)
    alloc.admit(1, 14, share_from=0, shared=2)
    alloc.grow(1, 10)  # only its own partial page is taken
    assert alloc.table[1, :2].tolist() == alloc.table[0, :2].tolist()
    assert alloc.table[1, 2] not in alloc.table[0, :3].tolist()
    assert alloc.used == 4 and alloc.available(0) == 0
    with pytest.raises(RuntimeError, match="share"):
        alloc.admit(2, 14, share_from=0, shared=2)  # slot 2 is on the other shard
    alloc.release(0)  # the shared pages stay with slot 1
    assert alloc.used == 3 and alloc.available(0) == 2  # only its partial page returned
    alloc.release(1)
    assert alloc.used == 0 and alloc.available(0) == 6 and alloc.peak_used == 4


@pytest.mark.parametrize("mesh_text,slots", [("data=1,tensor=1", 16), ("data=2,tensor=1", 6)])
def test_shared_prefixes_same_samples_fewer_pages(mesh_text, slots):
    """A GRPO-style group run with shared prompt pages and prefills gives the tokens and log-probs
    of the run without sharing, from fewer pages and prefill rows; with fewer slots than samples
    on two data shards, groups split over prefill calls and shards and still match."""
    model_def = ModelDef(tiny_config(vocab_size=64, eos_token_id=None))
    mesh = make_mesh(mesh_text)
    params = model_def.init_sharded(mesh, "dp_tp", seed=0)
    # Page size 4: prompts ending mid-page (5, 13), on a page boundary (8) and inside page 0 (3).
    prompts = _prompts((5, 8, 3, 13), vocab=64)
    sp = SamplingParams(temperature=1.2, top_k=40, num_samples=4, seed=7, stop_ids=(5,))
    base = dict(num_slots=slots, page_size=4, max_prompt_len=16, max_new_tokens=8)
    base.update(chunk_steps=3, max_prefill_rows=16)
    plain, shared = (
        DecodeEngine(model_def, mesh, "dp_tp", EngineConfig(**base, share_prefixes=share)).generate(
            params, prompts, sp
        )
        for share in (False, True)
    )
    assert shared.completion_ids == plain.completion_ids
    assert len({tuple(c) for c in shared.completion_ids[:4]}) > 1  # real, distinct draws
    for a, b in zip(
        plain.raw_logprobs + plain.sampling_logprobs,
        shared.raw_logprobs + shared.sampling_logprobs,
    ):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
    assert plain.stats["prefill_rows"] == 16 and "shared_pages" not in plain.stats
    assert shared.stats["prefill_rows"] < 16 and shared.stats["shared_pages"] > 0
    assert shared.stats["pages_taken"] < plain.stats["pages_taken"]
    # With all 16 samples in at once, the peak drops too; with 6 slots, groups split over calls
    # and shards and the peak is set by a moment with little sharing.
    assert shared.stats["peak_pages_used"] <= plain.stats["peak_pages_used"] - (slots == 16)
    saved = plain.stats["pages_taken"] - shared.stats["pages_taken"]
    assert saved == shared.stats["shared_pages"]
    if slots == 16:
        # One row per prompt; the full prompt pages (1 + 2 + 0 + 3) are held once per group.
        assert shared.stats["prefill_rows"] == 4
        assert shared.stats["shared_pages"] == 3 * (1 + 2 + 0 + 3)


def test_auto_layer_loop_unrolls_where_the_copies_fit():
    """EngineConfig.unroll_layers=None: unrolled on CPU (the generate stats say so); elsewhere
    decided by ``layer_copies_fit`` against each device's free memory, which counts every
    device's own shards of the stacked layer weights."""
    from jrlhf.decode.engine import layer_copies_fit

    mesh = make_mesh("data=4,tensor=2")
    model = ModelDef(tiny_config())
    params = model.init_sharded(mesh, "dp_tp", seed=0)
    layers = params["layers"]
    # per device: every leaf's shard (the tensor axis splits some weights two ways)
    per_device = {}
    for leaf in jax.tree.leaves(layers):
        for shard in leaf.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    need = max(per_device.values())
    assert need < sum(x.nbytes for x in jax.tree.leaves(layers))  # sharded, not whole

    def stats(free):
        return lambda d: {"bytes_limit": 10 * need + free, "bytes_in_use": 10 * need}

    assert layer_copies_fit(layers, stats_of=stats(2 * need))
    assert not layer_copies_fit(layers, stats_of=stats(2 * need - 2))
    assert layer_copies_fit(layers, share=1.0, stats_of=stats(need))
    assert not layer_copies_fit(layers, stats_of=lambda d: None)  # no statistics: scan
    host = jax.tree.map(np.asarray, layers)
    assert not layer_copies_fit(host, stats_of=stats(2 * need))  # not placed yet: scan
    one = make_mesh("data=1,tensor=1")  # the engines on one device: compiles in a fraction
    params = model.init_sharded(one, "dp_tp", seed=0)
    engine = DecodeEngine(model, one, "dp_tp", EngineConfig(num_slots=2, max_new_tokens=2))
    out = engine.generate(params, [[1, 2, 3], [4, 5]], SamplingParams(greedy=True, stop_ids=()))
    assert out.stats["unrolled_layers"] == 1  # CPU
    scan = DecodeEngine(
        model, one, "dp_tp", EngineConfig(num_slots=2, max_new_tokens=2, unroll_layers=False)
    )
    again = scan.generate(params, [[1, 2, 3], [4, 5]], SamplingParams(greedy=True, stop_ids=()))
    assert again.stats["unrolled_layers"] == 0
    assert again.completion_ids == out.completion_ids


def test_every_weight_layout_decodes_the_same():
    """EngineConfig.weight_layout: the per-layer copies hold every projection kernel as stored
    (in_major), output-major (the LM head as (vocab, embed): a tied embedding itself, no copy) or
    packed into panels for the native matmul (the head too); layers and head run over any
    layout give the stacked model's logits within 1e-5. (The engine's parity tests against
    transformers and across meshes run the CPU defaults: panels on one device, out-major on
    more.)"""
    from jrlhf.kernels.panels import from_panels
    from jrlhf.models.transformer import PROJECTIONS, decode_weights

    cfg = tiny_config(eos_token_id=None, initializer_range=0.2)
    model = ModelDef(cfg)
    mesh = make_mesh("data=1,tensor=1")
    params = model.init_sharded(mesh, "dp_tp", seed=0)
    layer0 = jax.tree.map(lambda a: a[0], params["layers"])
    for layout in ("out_major", "panels"):
        weights = decode_weights(params, layout)
        assert weights.layout == layout and len(weights.layers) == cfg.num_layers
        for group in ("attn", "mlp"):
            for name, leaf in weights.layers[0][group].items():
                n_in = PROJECTIONS.get(name)
                want = np.asarray(layer0[group][name])
                got = np.asarray(leaf)
                if n_in is not None and layout == "out_major":
                    want = np.transpose(want, (*range(n_in, want.ndim), *range(n_in)))
                elif n_in is not None:
                    want = want.reshape(int(np.prod(want.shape[:n_in])), -1)
                    got = np.asarray(from_panels(leaf))
                np.testing.assert_array_equal(got, want)
    head = np.asarray(params["lm_head"])
    np.testing.assert_array_equal(np.asarray(decode_weights(params, "out_major").head), head.T)
    np.testing.assert_array_equal(
        np.asarray(from_panels(decode_weights(params, "panels").head)), head
    )
    assert decode_weights(params, "in_major").head is None
    tied = {k: v for k, v in params.items() if k != "lm_head"}  # a tied model's parameters
    assert decode_weights(tied, "out_major").head is tied["embedding"]
    with pytest.raises(ValueError, match="weight layout 'diagonal' unknown"):
        decode_weights(params, "diagonal")

    # The layers run over each copy give the stacked model's logits (the forward the engine's
    # decode steps take, with the full-sequence attend hook).
    from jrlhf.models.attention import dense_attend

    tokens = jnp.asarray(_prompts((9, 9), vocab=cfg.vocab_size))
    positions = jnp.broadcast_to(jnp.arange(9), tokens.shape)

    @jax.jit
    def logits(params, copies):
        bound = model.bind(params)
        if copies is None:
            return bound.logits(bound.hidden(tokens))
        attend = dense_attend(positions, jnp.ones_like(tokens))
        hidden, _ = bound.run_layers(bound.embed(tokens), positions, attend, None, copies)
        return bound.logits(hidden, copies)

    want = np.asarray(logits(params, None))
    for layout in ("in_major", "out_major", "panels"):
        got = logits(params, decode_weights(params, layout))
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, err_msg=layout)


def test_weight_layout_default_refusals_and_same_samples():
    """On CPU a float32 model on one device decodes over packed panels (where the host has the
    AVX-512 the kernel is written for), on more devices out-major; an explicit "panels" that
    cannot apply is refused in one line before anything compiles. Engines over each layout
    generate the same tokens, their log-probs within float rounding."""
    from jrlhf import kernels

    engine, params = _engine("llama3")
    if jax.default_backend() == "cpu":
        kernel = kernels.usable("few_row_matmul")
        fast = kernel is not None and kernel.queries["fast_here"]()
        assert engine.weight_layout() == ("panels" if fast else "out_major")
        two, _ = _engine("llama3", "data=2,tensor=2")
        assert two.weight_layout() == "out_major"
    model_def, _, _ = _hf("llama3", "data=2,tensor=2")
    with pytest.raises(ValueError, match="'panels': the few-row matmul runs on a one-device mesh"):
        DecodeEngine(model_def, make_mesh("data=2,tensor=2"), "dp_tp", _layout("panels"))
    bf16 = ModelDef(tiny_config(dtype="bfloat16"))
    with pytest.raises(ValueError, match="'panels': the few-row matmul multiplies float32"):
        DecodeEngine(bf16, make_mesh("data=1,tensor=1"), "dp_tp", _layout("panels"))
    with pytest.raises(ValueError, match="EngineConfig.weight_layout 'rows' unknown"):
        _layout("rows")

    prompts = _prompts()
    sp = SamplingParams(temperature=0.9, top_k=30, top_p=0.95, num_samples=2, seed=11)
    mesh = make_mesh("data=1,tensor=1")
    runs = {
        layout: DecodeEngine(engine.model_def, mesh, "dp_tp", _layout(layout)).generate(
            params, prompts, sp
        )
        for layout in ("in_major", "out_major", "panels")
    }
    base = runs["in_major"]
    for layout, got in runs.items():
        assert got.completion_ids == base.completion_ids, layout
        for x, y in zip(got.raw_logprobs, base.raw_logprobs):
            np.testing.assert_allclose(x, y, atol=1e-5, rtol=0, err_msg=layout)


def _layout(layout: str) -> EngineConfig:
    import dataclasses

    return dataclasses.replace(ENGINE, weight_layout=layout)


def test_fused_prefill_takes_the_causal_call(monkeypatch):
    """With fused attention the prefill's rows (prompts at columns 0..n-1, padding after) go
    through cuDNN's causal call, no bias (run through JAX's XLA implementation here): the first
    sampled tokens' log-probs are the einsum prefill's within bf16 rounding."""
    from jrlhf.models import attention

    monkeypatch.setattr(attention, "FUSED_IMPLEMENTATION", "xla")
    causal_calls = []
    dpa = jax.nn.dot_product_attention

    def spy(*args, **kwargs):
        causal_calls.append(kwargs.get("is_causal", False))
        return dpa(*args, **kwargs)

    monkeypatch.setattr(jax.nn, "dot_product_attention", spy)
    # weights large enough that what a query attends to moves the log-probs well past bf16 rounding
    cfg = tiny_config(vocab_size=64, eos_token_id=None, dtype="bfloat16", initializer_range=0.5)
    params = ModelDef(cfg).init(jax.random.key(0))
    engine_cfg = EngineConfig(num_slots=4, page_size=4, max_prompt_len=16, max_new_tokens=1)
    prompts = _prompts((5, 9, 2, 12), vocab=64)
    first = {}
    for impl in ("cudnn", "einsum"):
        engine = DecodeEngine(ModelDef(cfg.replace(attention=impl)), None, "dp_tp", engine_cfg)
        out = engine.generate(params, prompts, SamplingParams(greedy=True))
        first[impl] = np.asarray([lp[0] for lp in out.raw_logprobs])
    assert causal_calls and all(causal_calls)  # the cuDNN engine's layers, the causal call only
    np.testing.assert_allclose(first["cudnn"], first["einsum"], atol=0.02)
