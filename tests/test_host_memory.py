"""jrlhf.runtime.devices.keep_host_memory: XLA:CPU's temporaries reuse the memory freed by the
calls before instead of faulting in fresh pages at every call."""

from __future__ import annotations

import resource

import jax
import jax.numpy as jnp
import pytest

from jrlhf.runtime import devices

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's allocations")


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def test_temporaries_reuse_freed_memory():
    # conftest set the allocator up before JAX's backend started, as every entry point does.
    assert devices.keep_host_memory()
    x, v = jnp.ones((2048, 8192)), jnp.ones((2048, 4))
    step = jax.jit(lambda x, v: ((x.T * 2) @ v).sum())  # x.T is a 64 MB temporary
    temp = step.lower(x, v).compile().memory_analysis().temp_size_in_bytes
    assert temp >= 64 << 20, temp  # larger than a thread arena's heap: glibc would mmap it
    # Fresh memory at every call faults in all its pages (16,384 of 4 KB, every call, with
    # JRLHF_KEEP_HOST_MEMORY=0). Kept, the heap grows while it has no free block large enough
    # (a call's temporary can be allocated before the previous call's is freed), then calls
    # reuse what the ones before freed.
    faults, quiet = [], 0
    while quiet < 3 and len(faults) < 30:
        before = _minor_faults()
        step(x, v).block_until_ready()
        faults.append(_minor_faults() - before)
        quiet = quiet + 1 if faults[-1] < 1000 else 0
    assert quiet == 3, faults


@pytest.mark.parametrize("value", ["yes", "true", " 1"])
def test_bad_opt_out_value_is_one_line(monkeypatch, value):
    monkeypatch.setattr(devices, "_kept", None)
    monkeypatch.setenv(devices.KEEP_HOST_MEMORY_ENV, value)
    with pytest.raises(ValueError, match=f"^{devices.KEEP_HOST_MEMORY_ENV}=.*expected 0 or 1$"):
        devices.keep_host_memory()


def test_opt_out_and_accelerators_leave_the_allocator_alone(monkeypatch):
    monkeypatch.setattr(devices, "_kept", None)
    monkeypatch.setenv(devices.KEEP_HOST_MEMORY_ENV, "0")
    assert devices.keep_host_memory() is False
    monkeypatch.delenv(devices.KEEP_HOST_MEMORY_ENV)
    cases = [("cpu", True), ("cuda", False), ("cpu,cuda", False), ("tpu", False)]
    for platforms, cpu_only in cases:
        monkeypatch.setenv("JAX_PLATFORMS", platforms)
        assert devices._cpu_backend_only() is cpu_only, platforms
