"""Paged decode attention kernels against a dense reference built from the model's attention."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrlhf.decode.kernels import (
    paged_attention_blocked,
    paged_attention_reference,
    select_kernel,
)
from jrlhf.decode.kernels.blocked import pages_per_block
from jrlhf.models.attention import attention_mask, masked_attention
from jrlhf.native import build as native_build
from jrlhf.native import paged_attention as native_cpu

L, P, PS, K, D, H = 2, 12, 16, 2, 32, 4

# The compiled C++ kernel runs on XLA:CPU only (on a GPU machine these cases are the GPU's own).
_NATIVE = pytest.param(
    "native_cpu",
    marks=pytest.mark.skipif(jax.default_backend() != "cpu", reason="native kernel is CPU-only"),
)


def _case(seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    k_pool = jax.random.normal(ks[0], (L, P, PS, K, D))
    v_pool = jax.random.normal(ks[1], (L, P, PS, K, D))
    q = jax.random.normal(ks[2], (3, H, D))
    table = jnp.array([[3, 5, 7, 0], [1, 2, 12, 12], [11, 10, 9, 8]], jnp.int32)  # 12: unused
    lengths = jnp.array([20, 5, 64], jnp.int32)
    return q, k_pool, v_pool, table, lengths


def _dense(q, k_pool, v_pool, layer, table, lengths, window, softcap=0.0):
    """The model's masked_attention over each sequence's pages laid out contiguously."""
    outs = []
    for b in range(q.shape[0]):
        n = int(lengths[b])
        pages = [int(p) for p in table[b][: -(-n // PS)]]
        k = jnp.concatenate([k_pool[layer, p] for p in pages])[:n][None]
        v = jnp.concatenate([v_pool[layer, p] for p in pages])[:n][None]
        pos = jnp.arange(n)[None]
        mask = attention_mask(pos[:, -1:], pos, jnp.ones((1, 1)), jnp.ones((1, n)), window)
        outs.append(masked_attention(q[b][None, None], k, v, mask, softcap)[0, 0])
    return jnp.stack(outs)


@pytest.mark.parametrize("window", [0, 7])
@pytest.mark.parametrize("kernel", ["reference", "blocked", _NATIVE, "pallas_interpret"])
def test_paged_kernels_match_dense_attention(kernel, window):
    q, k_pool, v_pool, table, lengths = _case()
    _, fn = select_kernel(kernel)
    got = fn(q, k_pool, v_pool, jnp.int32(1), table, lengths, window)
    want = _dense(q, k_pool, v_pool, 1, table, lengths, window)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=0)


@pytest.mark.parametrize("window", [0, 7])
def test_soft_capped_scores_take_a_kernel_that_computes_them(window):
    """Gemma 2's soft-capped attention scores: the reference, blocked and C++ kernels compute
    them, matching the model's attention; "auto" takes the blocked kernel where it would take the
    Pallas one (which has no soft-capping), and naming the Pallas one is refused in one line."""
    q, k_pool, v_pool, table, lengths = _case(3)
    q = q * 4.0  # scores large enough for the cap to bite
    want = _dense(q, k_pool, v_pool, 1, table, lengths, window, softcap=2.0)
    plain = _dense(q, k_pool, v_pool, 1, table, lengths, window)
    assert np.abs(np.asarray(want - plain)).max() > 1e-2
    names = ["auto", "reference", "blocked"]
    if jax.default_backend() == "cpu" and native_cpu.available():
        names.append("native_cpu")
    for name in names:
        resolved, fn = select_kernel(name, 16, D, softcap=2.0)
        if name == "auto":
            assert resolved == {"gpu": "blocked", "cpu": "native_cpu"}.get(
                jax.default_backend(), "blocked"
            )
        got = fn(q, k_pool, v_pool, jnp.int32(1), table, lengths, window)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=0)
    for name in ("pallas", "pallas_interpret"):
        with pytest.raises(ValueError, match=f"'{name}' cannot soft-cap attention scores"):
            select_kernel(name, 16, D, softcap=2.0)


@pytest.mark.parametrize("kernel", ["reference", "blocked", _NATIVE, "pallas_interpret"])
def test_idle_rows_attend_over_nothing_and_leave_others_exact(kernel):
    """An idle decode slot: every table entry out of range (the pool has P pages) and length 0,
    as the engine passes it. The kernel must not read through those ids, must stay finite, and
    must not disturb the other rows."""
    q, k_pool, v_pool, table, lengths = _case(1)
    table = table.at[1].set(P + 3)
    lengths = lengths.at[1].set(0)
    _, fn = select_kernel(kernel)
    got = np.asarray(fn(q, k_pool, v_pool, jnp.int32(0), table, lengths, 0))
    assert np.isfinite(got).all()
    live = np.array([0, 2])
    want = _dense(q[live], k_pool, v_pool, 0, table[live], lengths[live], 0)
    np.testing.assert_allclose(got[live], np.asarray(want), atol=2e-5, rtol=0)


def test_auto_selects_the_backends_kernel():
    """GPU: Pallas; CPU: the native kernel, which must build here (a machine of CI's kind has a
    C++ compiler: a broken build fails this test instead of silently falling back)."""
    name, _ = select_kernel("auto")
    if jax.default_backend() == "cpu":
        assert native_cpu.available(), native_cpu.unavailable_reason()
    want = {"gpu": "pallas", "cpu": "native_cpu"}.get(jax.default_backend(), "blocked")
    assert name == want
    with pytest.raises(ValueError, match="unknown"):
        select_kernel("flash")


def test_native_kernel_unavailable_falls_back_or_says_why(monkeypatch):
    """Where the native kernel cannot be built, "auto" takes the blocked kernel and an explicit
    "native_cpu" is refused in one line that says why."""
    if jax.default_backend() != "cpu":
        with pytest.raises(ValueError, match="runs on CPU"):
            select_kernel("native_cpu")
        return
    monkeypatch.setattr(native_cpu, "_registered", lambda: "no C++ compiler found")
    assert select_kernel("auto")[0] == "blocked"
    with pytest.raises(ValueError, match="'native_cpu': no C\\+\\+ compiler found"):
        select_kernel("native_cpu")


_CPU_ONLY = pytest.mark.skipif(jax.default_backend() != "cpu", reason="native kernel is CPU-only")


@_CPU_ONLY
@pytest.mark.parametrize("head_dim", [32, 33, 96, 128, 256])
@pytest.mark.parametrize("q_dtype,pool_dtype", [("float32", "bfloat16"), ("bfloat16", "float32")])
def test_native_kernel_head_dims_and_mixed_dtypes(head_dim, q_dtype, pool_dtype):
    """Every head size the kernel compiles a fixed-size loop for (and one it does not), with
    queries and pools in different dtypes, against the reference on the same values; a batch
    larger than the threads (10 rows), one idle."""
    q, k_pool, v_pool, table, lengths = _pages_case(7, 16, jnp.dtype(pool_dtype), head_dim)
    q = jnp.concatenate([q, q[::-1], q[:2]]).astype(q_dtype)
    table = jnp.concatenate([table, table[::-1], table[:2]])
    lengths = jnp.concatenate([lengths, lengths[::-1], jnp.array([0, 9], jnp.int32)])
    got = native_cpu.paged_attention_native(q, k_pool, v_pool, jnp.int32(1), table, lengths, 5)
    f32 = [a.astype(jnp.float32) for a in (q, k_pool, v_pool)]
    want = paged_attention_reference(*f32, jnp.int32(1), table, lengths, 5)
    tol = 2e-5 if q_dtype == "float32" else 2.0**-8 * float(jnp.abs(want).max())
    np.testing.assert_allclose(np.asarray(got[:8], np.float32), want[:8], atol=tol, rtol=0)
    np.testing.assert_allclose(np.asarray(got[9], np.float32), want[9], atol=tol, rtol=0)
    assert not np.asarray(got[8], np.float32).any()  # the idle row: zeros


@_CPU_ONLY
def test_native_kernel_edges_follow_the_reference():
    """Where the engine never goes, the kernel still agrees with the reference: a window over a
    length past the table's capacity, a negative layer (counted from the end), and vmap. (A
    window wholly past the table attends over nothing: zeros, where the reference averages
    masked keys.)"""
    q, k_pool, v_pool, table, lengths = _case(4)
    past = jnp.array([70, 66, 68], jnp.int32)  # the table holds 4 pages of 16: 64 positions
    cases = ((past, 7, 1), (past + 10, 20, 1), (lengths, 0, -1), (lengths, 5, -2))
    for lens, window, layer in cases:
        got = native_cpu.paged_attention_native(
            q, k_pool, v_pool, jnp.int32(layer), table, lens, window
        )
        want = paged_attention_reference(q, k_pool, v_pool, jnp.int32(layer), table, lens, window)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=0)
    batched = jax.vmap(
        lambda qq: native_cpu.paged_attention_native(qq, k_pool, v_pool, 1, table, lengths)
    )(jnp.stack([q, 2 * q]))
    for i, scale in enumerate((1, 2)):
        want = paged_attention_reference(scale * q, k_pool, v_pool, jnp.int32(1), table, lengths)
        np.testing.assert_allclose(np.asarray(batched[i]), np.asarray(want), atol=2e-5, rtol=0)


@_CPU_ONLY
def test_native_kernel_refuses_shapes_that_do_not_agree():
    """Shapes the kernel cannot read (query heads that KV heads do not divide) are an error
    raised by the call, not a read out of bounds; dtypes it does not take (float16) run the
    blocked kernel."""
    q, k_pool, v_pool, table, lengths = _case()
    half = [a.astype(jnp.float16) for a in (q, k_pool, v_pool)]
    got = native_cpu.paged_attention_native(*half, jnp.int32(1), table, lengths)
    want = paged_attention_blocked(*half, jnp.int32(1), table, lengths)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    bad = (
        (q[:, :3], k_pool, v_pool),  # query heads the KV heads do not divide
        (q, k_pool, v_pool[:1, :1, :1]),  # a V pool smaller than the K pool
        (q, k_pool[:0], v_pool[:0]),  # pools without layers
    )
    for qq, kk, vv in bad:
        with pytest.raises(Exception, match="shapes do not agree"):
            native_cpu.paged_attention_native(
                qq, kk, vv, jnp.int32(0), table, lengths
            ).block_until_ready()


def test_native_kernel_builds_once_and_names_a_failed_build(monkeypatch, tmp_path):
    """The build is cached by its inputs (a second build compiles nothing), lands whole (no
    temporary file left beside it), and a build that cannot run or fails raises BuildError
    naming the cause."""
    monkeypatch.setenv("JRLHF_CACHE_DIR", str(tmp_path))
    path = native_cpu.build()
    assert path.parent == tmp_path / "kernels" and path.exists()
    stamp = path.stat().st_mtime_ns
    assert native_cpu.build() == path and path.stat().st_mtime_ns == stamp
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]
    with monkeypatch.context() as m:
        m.setattr(native_build.shutil, "which", lambda name: None)
        with pytest.raises(native_build.BuildError, match="no C\\+\\+ compiler found"):
            native_cpu.build()
    monkeypatch.setattr(native_build, "compiler", lambda: ["/bin/false"])
    with pytest.raises(
        native_build.BuildError, match=r"^false failed on paged_attention_cpu.cc \(exit 1\)"
    ):
        native_cpu.build()
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]
    # readable by every user a shared cache may serve (mkstemp's file is private)
    assert path.stat().st_mode & 0o444 == 0o444
    # $CXX may carry arguments (ccache g++, g++ -m64)
    monkeypatch.undo()
    monkeypatch.setenv("CXX", "g++ -m64")
    if native_build.shutil.which("g++"):
        assert native_build.compiler()[1:] == ["-m64"]


@pytest.mark.parametrize("block_pages", [None, 1, 3, 4])
@pytest.mark.parametrize("window", [0, 7])
def test_blocked_kernel_block_sizes_short_batches_and_empty(block_pages, window):
    """Any block size (dividing the table width or not) matches the reference, also when every
    length is short (later blocks skipped); with every length 0 it reads nothing, stays finite."""
    q, k_pool, v_pool, table, lengths = _case(2)
    for lens in (lengths, jnp.array([3, 1, 16], jnp.int32)):
        got = paged_attention_blocked(
            q, k_pool, v_pool, jnp.int32(1), table, lens, window, block_pages
        )
        want = paged_attention_reference(q, k_pool, v_pool, jnp.int32(1), table, lens, window)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=0)
    zero = jnp.zeros((3,), jnp.int32)
    got = paged_attention_blocked(q, k_pool, v_pool, jnp.int32(0), table, zero, window)
    assert np.isfinite(np.asarray(got)).all()


def test_blocked_kernel_blocks_follow_the_backend():
    """CPU blocks stay cache-sized (32 positions); accelerators take 128-position blocks, which
    decoded 1.4-1.6x faster than 32 on an H200 (docs/gpu.md, run 20); both clip to the table."""
    assert pages_per_block(16, 24, backend="cpu") == 2
    assert pages_per_block(8, 24, backend="cpu") == 4
    assert pages_per_block(16, 24, backend="gpu") == pages_per_block(16, 24, backend="tpu") == 8
    assert pages_per_block(16, 5, backend="tpu") == 5
    assert pages_per_block(256, 24, backend="cpu") == 1
    assert pages_per_block(16, 24) == pages_per_block(16, 24, backend=jax.default_backend())


_GPU_ONLY = pytest.mark.skipif(
    jax.default_backend() != "gpu", reason="compiled Pallas kernel needs a GPU"
)


@_GPU_ONLY
@pytest.mark.parametrize("window", [0, 7])
def test_compiled_pallas_kernel_matches_reference_on_gpu(window):
    """float32 pools: IEEE dots, not Triton's TF32 default (which was 3e-4 off)."""
    q, k_pool, v_pool, table, lengths = _case()
    _, fn = select_kernel("pallas")
    got = fn(q, k_pool, v_pool, jnp.int32(1), table, lengths, window)
    want = paged_attention_reference(q, k_pool, v_pool, jnp.int32(1), table, lengths, window)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=0)


def _bf16_case(seed):
    """bf16 pools and queries as the engine holds them for a bf16 model: 4 query heads per KV
    head, 64-wide heads, lengths spread over 1..100 on a shuffled page table."""
    rng = np.random.default_rng(seed)
    ks = jax.random.split(jax.random.key(seed), 3)
    shape = (2, 4 * 7, PS, 2, 64)
    k_pool = jax.random.normal(ks[0], shape).astype(jnp.bfloat16)
    v_pool = jax.random.normal(ks[1], shape).astype(jnp.bfloat16)
    q = jax.random.normal(ks[2], (4, 8, 64)).astype(jnp.bfloat16)
    table = jnp.asarray(rng.permutation(4 * 7).reshape(4, 7), jnp.int32)
    lengths = jnp.asarray(rng.integers(1, 7 * PS + 1, 4), jnp.int32)
    return q, k_pool, v_pool, table, lengths


@pytest.mark.parametrize(
    "kernel", ["blocked", _NATIVE, "pallas_interpret", pytest.param("pallas", marks=_GPU_ONLY)]
)
def test_bf16_pools_within_output_rounding(kernel):
    """On bf16 pools a kernel's only error is rounding its output to bf16: against attention
    computed in float32 (highest matmul precision) on the same values, it is as close as that
    rounding is (the Pallas kernel's bf16 products are exact, its softmax weights split in two
    bf16 halves; with only the high half this fails)."""
    q, k_pool, v_pool, table, lengths = _bf16_case(5)
    f32 = [a.astype(jnp.float32) for a in (q, k_pool, v_pool)]
    want = np.asarray(_dense(*f32, 1, table, lengths, 0), np.float64)
    _, fn = select_kernel(kernel)
    got = np.asarray(fn(q, k_pool, v_pool, jnp.int32(1), table, lengths, 0), np.float64)
    rounded = np.asarray(jnp.asarray(want, jnp.float32).astype(jnp.bfloat16), np.float64)
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    floor = np.linalg.norm(rounded - want) / np.linalg.norm(want)
    assert err <= 1.02 * floor, (err, floor)
    # and element by element at most one bf16 step from the correctly rounded value
    ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(want), 1e-30))) - 7)
    assert (np.abs(got - rounded) <= ulp * 1.0001).all()


def _pages_case(seed, page_size, dtype, head_dim=64):
    """Pools of ``page_size``-token pages holding up to 100 positions a sequence, shuffled
    table, lengths 1..100 (one a whole number of pages), 4 query heads per KV head."""
    rng = np.random.default_rng(seed)
    per_seq = -(-100 // page_size)
    ks = jax.random.split(jax.random.key(seed), 3)
    shape = (2, 4 * per_seq, page_size, 2, head_dim)
    k_pool = jax.random.normal(ks[0], shape).astype(dtype)
    v_pool = jax.random.normal(ks[1], shape).astype(dtype)
    q = jax.random.normal(ks[2], (4, 8, head_dim)).astype(dtype)
    table = jnp.asarray(rng.permutation(4 * per_seq).reshape(4, per_seq), jnp.int32)
    lengths = jnp.asarray([1, 3 * page_size, 57, 100], jnp.int32)
    return q, k_pool, v_pool, table, lengths


@pytest.mark.parametrize("page_size,head_dim", [(4, 64), (8, 64), (32, 64), (16, 8)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    "kernel", ["blocked", _NATIVE, "pallas_interpret", pytest.param("pallas", marks=_GPU_ONLY)]
)
def test_page_sizes_and_head_dims_match_the_reference(kernel, dtype, page_size, head_dim):
    """Pages or heads narrower than Triton's smallest dot (16) take the Pallas kernel's vector
    path: the compiled bf16 dot on 8-token pages returned garbage on an H200 (docs/gpu.md, runs
    21-22)."""
    q, k_pool, v_pool, table, lengths = _pages_case(3, page_size, jnp.dtype(dtype), head_dim)
    f32 = [a.astype(jnp.float32) for a in (q, k_pool, v_pool)]
    with jax.default_matmul_precision("highest"):
        want = np.asarray(paged_attention_reference(*f32, jnp.int32(1), table, lengths))
    _, fn = select_kernel(kernel)
    got = np.asarray(fn(q, k_pool, v_pool, jnp.int32(1), table, lengths, 0), np.float32)
    # float32: rounding only; bf16: the output's rounding (8 mantissa bits) at most
    tol = 2e-5 if dtype == "float32" else 2.0**-8 * np.abs(want).max()
    np.testing.assert_allclose(got, want, atol=tol, rtol=0)


def test_pallas_kernel_takes_only_shapes_triton_can_tile(monkeypatch):
    """An explicit "pallas" refuses a page size or head_dim that is not a power of two before
    any compilation, naming the setting; "auto" on a GPU takes the blocked kernel for them."""
    with pytest.raises(ValueError, match="power-of-two page size.*got 24.*DecodeConfig.page_size"):
        select_kernel("pallas", page_size=24)
    with pytest.raises(ValueError, match="power-of-two head_dim.*got 80"):
        select_kernel("pallas", page_size=16, head_dim=80)
    assert select_kernel("pallas", page_size=8, head_dim=64)[0] == "pallas"
    assert select_kernel("pallas_interpret", page_size=24)[0] == "pallas_interpret"
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert select_kernel("auto", page_size=16, head_dim=128)[0] == "pallas"
    assert select_kernel("auto", page_size=24, head_dim=128)[0] == "blocked"
    assert select_kernel("auto", page_size=16, head_dim=80)[0] == "blocked"
