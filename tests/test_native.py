"""Native CPU kernels: the few-row panel matmul against NumPy, its fallback, and its refusals."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrlhf.native import matmul as native_matmul
from jrlhf.native.matmul import LANES, from_panels, panel_matmul, to_panels


@pytest.mark.parametrize(
    "rows,k,panels",
    [(1, 7, 1), (5, 33, 2), (8, 64, 3), (13, 96, 4), (16, 128, 5), (27, 40, 7), (3, 1, 1)],
)
def test_panel_matmul_matches_numpy(rows, k, panels):
    """Every row-block tail (the kernel takes rows 8 at a time) and panel-block tail (3 panels
    at a time) against a float64 product, in the kernel and in its XLA fallback; leading axes
    of x are kept."""
    rng = np.random.default_rng(rows * 100 + k)
    n = panels * LANES
    x = rng.standard_normal((rows, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    packed = to_panels(jnp.asarray(w))
    assert packed.shape == (panels, k, LANES)
    np.testing.assert_array_equal(np.asarray(from_panels(packed)), w)
    want = x.astype(np.float64) @ w.astype(np.float64)
    if jax.default_backend() == "cpu":
        assert native_matmul.available(), native_matmul.unavailable_reason()
    got = np.asarray(jax.jit(panel_matmul)(jnp.asarray(x), packed))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    batched = jax.jit(panel_matmul)(jnp.asarray(x).reshape(1, rows, k), packed)
    assert batched.shape == (1, rows, n)
    np.testing.assert_array_equal(np.asarray(batched)[0], got)


def test_panel_matmul_falls_back_to_xla_and_refuses_bad_shapes(monkeypatch):
    """Without the kernel the same product runs in XLA; shapes that do not agree, and weights
    whose outputs do not fill whole panels, are refused in one line."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((4, 24)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((24, 32)), jnp.float32)
    native = np.asarray(panel_matmul(x, to_panels(w)))
    monkeypatch.setattr(native_matmul, "_registered", lambda: "no C++ compiler found")
    assert not native_matmul.available()
    np.testing.assert_allclose(np.asarray(panel_matmul(x, to_panels(w))), native, rtol=1e-5)
    with pytest.raises(ValueError, match="panel matmul of x \\(4, 23\\)"):
        panel_matmul(x[:, :23], to_panels(w))
    with pytest.raises(ValueError, match="30 output columns does not pack into panels of 16"):
        to_panels(w[:, :30])
