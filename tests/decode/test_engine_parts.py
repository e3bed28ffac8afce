"""The decode engine's parts on their own (jrlhf.decode.state, programs, scheduler): the
migration programs as pure functions of a state, checked against numpy indexing; the programs
shared by equal engines; the scheduler's prefill buckets."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrlhf.decode import DecodeEngine, EngineConfig
from jrlhf.decode.programs import adopt, extract
from jrlhf.decode.scheduler import bucket
from jrlhf.decode.state import MOVED_ROWS, MOVED_ROWS2, init_state
from jrlhf.models.config import tiny_config
from jrlhf.models.model_def import ModelDef

CFG = tiny_config(vocab_size=64, num_layers=2)


def _random_state(config: EngineConfig, seed: int):
    """``init_state``'s tree with every leaf drawn at random in its own dtype."""
    rng = np.random.default_rng(seed)

    def draw(leaf):
        if leaf.dtype == bool:
            return rng.random(leaf.shape) < 0.5
        if np.issubdtype(leaf.dtype, np.floating):
            return rng.standard_normal(leaf.shape).astype(leaf.dtype)
        return rng.integers(0, 1000, leaf.shape).astype(leaf.dtype)

    return jax.tree.map(draw, jax.tree.map(np.asarray, init_state(config, CFG, 1)))


def test_extract_then_adopt_moves_the_rows_and_their_pages():
    src_cfg = EngineConfig(num_slots=4, page_size=2, max_prompt_len=4, max_new_tokens=4)
    dst_cfg = EngineConfig(num_slots=2, page_size=2, max_prompt_len=4, max_new_tokens=4)
    src = _random_state(src_cfg, 0)
    width, src_pool, dst_pool = src_cfg.max_pages_per_seq, 16, 8
    assert (width, src_cfg.total_pages, dst_cfg.total_pages) == (4, src_pool, dst_pool)
    # Two rows and a padding row (slot and pages out of range); row 1 owns only two pages.
    src_slots = np.array([2, 0, 4], np.int32)
    src_pages = np.array([[5, 1, 9, 12], [3, 7, src_pool, src_pool], [src_pool] * 4], np.int32)
    left, moved = jax.jit(extract)(jax.tree.map(jnp.asarray, src), src_slots, src_pages)
    left, moved = jax.tree.map(np.asarray, (left, moved))

    np.testing.assert_array_equal(left.active, src.active & (np.arange(4) % 2 == 1))
    np.testing.assert_array_equal(left.k_pages, src.k_pages)  # pages are freed on the host
    for i, slot in enumerate(src_slots):
        for name in MOVED_ROWS + MOVED_ROWS2:
            want = getattr(src, name)[slot] if slot < 4 else 0
            np.testing.assert_array_equal(moved[name][i], want, err_msg=name)
        for j, page in enumerate(src_pages[i]):
            want = src.k_pages[:, page] if page < src_pool else 0
            np.testing.assert_array_equal(moved["k"][:, i, j], want)

    dst = init_state(dst_cfg, CFG, 1)
    dst_slots = np.array([1, 0, 2], np.int32)  # the padding row lands nowhere
    dst_pages = np.array([[0, 6, 2, 4], [7, 1, dst_pool, dst_pool], [dst_pool] * 4], np.int32)
    got = jax.tree.map(np.asarray, jax.jit(adopt)(dst, moved, dst_slots, dst_pages))
    for i in range(2):
        for name in MOVED_ROWS + MOVED_ROWS2:
            np.testing.assert_array_equal(
                getattr(got, name)[dst_slots[i]], getattr(src, name)[src_slots[i]], err_msg=name
            )
        for j in range(width):
            if src_pages[i, j] < src_pool:
                for pool in ("k_pages", "v_pages"):
                    np.testing.assert_array_equal(
                        getattr(got, pool)[:, dst_pages[i, j]],
                        getattr(src, pool)[:, src_pages[i, j]],
                    )
    untouched = sorted(set(range(dst_pool)) - {0, 6, 2, 4, 7, 1})
    assert not got.k_pages[:, untouched].any()
    np.testing.assert_array_equal(got.page_table, dst.page_table)  # the host's table, not moved


def test_equal_engines_share_one_spec_and_programs_and_hold_their_own_state():
    config = EngineConfig(num_slots=2, page_size=4, max_prompt_len=8, max_new_tokens=3)
    a = DecodeEngine(ModelDef(CFG), None, "dp_tp", config)
    b = DecodeEngine(ModelDef(CFG), None, "dp_tp", config)
    assert a.spec is b.spec and a.programs is b.programs
    assert a.state is None and b.state is None
    other = DecodeEngine(ModelDef(CFG), None, "dp_tp", EngineConfig(num_slots=4, page_size=4))
    assert other.programs is not a.programs and other.config.num_slots == 4
    assert a.num_shards == 1 and a.config is config and a.model_def == ModelDef(CFG)


@pytest.mark.parametrize(("lo", "hi"), [(1, 8), (16, 64), (4, 4)])
def test_prefill_buckets_are_the_next_power_of_two_within_bounds(lo, hi):
    for n in range(0, 80):
        power = 1
        while power < n:
            power *= 2
        assert bucket(n, lo, hi) == min(hi, max(lo, power)), n
