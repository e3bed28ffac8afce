"""The kernel registry (jrlhf.kernels): models/ and decode/ never import the CPU kernels; the
registry loads them on a CPU process's first lookup, and nothing of them on another backend."""

from __future__ import annotations

import subprocess
import sys

import jax
import pytest
from run_helpers import ROOT

from jrlhf import kernels

_PROBE = """
import sys
import jrlhf.decode, jrlhf.models, jrlhf.ppo, jrlhf.pipeline.run
from jrlhf import kernels
assert "jrlhf.native" not in sys.modules, "imported by a package"
for op in kernels.OPS:
    assert kernels.lookup(op, "gpu") is None and kernels.lookup(op, "tpu") is None
assert "jrlhf.native" not in sys.modules, "imported by a lookup on another backend"
assert {op for op in kernels.OPS if kernels.lookup(op, "cpu") is not None} == set(kernels.OPS)
assert "jrlhf.native" in sys.modules
print("ok")
"""


def test_the_cpu_kernels_load_only_on_a_cpu_lookup():
    """In a fresh interpreter: importing the packages that use kernels (models, decode, the RL
    loop, the pipeline) loads no native module; lookups for the GPU and TPU find nothing and
    still load none; the first lookup for the CPU loads them, and every operation has one."""
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_lookups_name_the_operation_and_the_backend():
    with pytest.raises(ValueError, match="unknown kernel operation 'matmul'"):
        kernels.lookup("matmul")
    with pytest.raises(ValueError, match="kernel for unknown operation 'conv'"):
        kernels.register("cpu", kernels.Kernel("conv", abs, lambda: True, lambda: None))
    assert kernels.usable("token_pick", "tpu") is None
    assert kernels.why_unusable("token_pick", "tpu") == "has no kernel on tpu"
    if jax.default_backend() == "cpu":
        assert kernels.usable("token_pick") is not None
        assert kernels.why_unusable("token_pick") is None
