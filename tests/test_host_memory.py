"""jrlhf.devices.keep_host_memory: XLA:CPU's temporaries reuse the memory freed by the
calls before instead of faulting in fresh pages at every call."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import pytest

from jrlhf import devices

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's allocations")


# A jitted program whose temporary (x.T, 64 MB) is larger than a thread arena's heap, called until
# three calls in a row fault in fewer than 1,000 pages (or 30 calls): prints the fault counts.
# Fresh memory at every call faults in all its pages (16,384 of 4 KB, every call, with glibc's
# defaults). Kept, the heap grows while it has no free block large enough (a call's temporary can
# be allocated before the previous call's is freed), then calls reuse what the ones before freed.
SETTLE = """
import json, resource
import jax, jax.numpy as jnp
x, v = jnp.ones((2048, 8192)), jnp.ones((2048, 4))
step = jax.jit(lambda x, v: ((x.T * 2) @ v).sum())
temp = step.lower(x, v).compile().memory_analysis().temp_size_in_bytes
assert temp >= 64 << 20, temp
faults, quiet = [], 0
while quiet < 3 and len(faults) < 30:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step(x, v).block_until_ready()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    quiet = quiet + 1 if faults[-1] < 1000 else 0
print(json.dumps(faults))
"""


def _settles(faults: list[int]) -> bool:
    return len(faults) >= 3 and all(f < 1000 for f in faults[-3:])


def test_temporaries_reuse_freed_memory(capsys):
    # conftest set the allocator up before JAX's backend started, as every entry point does.
    assert devices.keep_host_memory()
    exec(SETTLE, {})
    faults = json.loads(capsys.readouterr().out)
    assert _settles(faults), faults


def test_child_processes_keep_memory_from_their_first_instruction():
    """A child of a process that kept its memory (a test worker, a trainer subprocess) gets the
    settings as GLIBC_TUNABLES, applied before any thread of its own: here a bare Python that
    imports JAX (a thread) and never calls keep_host_memory. With allocator_defaults (the
    benchmarks' peers) it keeps glibc's defaults, and its calls keep faulting in fresh pages."""
    assert devices.keep_host_memory()
    tunables = os.environ["GLIBC_TUNABLES"].split(":")
    assert {f"{name}={value}" for name, value in devices.KEPT_TUNABLES} <= set(tunables)
    env = {k: v for k, v in os.environ.items() if k != devices.KEEP_HOST_MEMORY_ENV}
    runs = {}
    for name, child_env in (("kept", env), ("defaults", devices.allocator_defaults(env))):
        cmd = [sys.executable, "-c", SETTLE]
        out = subprocess.run(cmd, env=child_env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        runs[name] = json.loads(out.stdout.splitlines()[-1])
    assert _settles(runs["kept"]), runs
    # glibc's defaults: fresh pages (all 16,384) at nearly every call, never three calls in a row
    # without (so this test fails where the settings do not reach the child)
    assert len(runs["defaults"]) == 30 and not _settles(runs["defaults"]), runs


def test_allocator_defaults_restore_the_tunables_found(monkeypatch):
    monkeypatch.setattr(devices, "_kept", True)
    monkeypatch.setattr(devices, "_inherited_tunables", "glibc.malloc.check=3")
    ours = devices._with_tunables("glibc.malloc.check=3:glibc.malloc.arena_max=4")
    assert ours.split(":")[0] == "glibc.malloc.check=3" and "glibc.malloc.arena_max=4" not in ours
    env = devices.allocator_defaults({"GLIBC_TUNABLES": ours, "A": "1"})
    assert env == {"GLIBC_TUNABLES": "glibc.malloc.check=3", "A": "1"}
    monkeypatch.setattr(devices, "_inherited_tunables", "")
    assert devices.allocator_defaults({"GLIBC_TUNABLES": ours}) == {}
    # A child of a process that kept its memory finds the settings already exported: they are
    # not the user's own, and its peers still get glibc's defaults.
    monkeypatch.setattr(devices, "_kept", None)
    monkeypatch.setenv("GLIBC_TUNABLES", f"{ours}:glibc.malloc.perturb=0")
    assert devices.keep_host_memory()
    assert devices._inherited_tunables == "glibc.malloc.check=3:glibc.malloc.perturb=0"
    monkeypatch.setattr(devices, "_kept", False)  # nothing exported: nothing taken away
    assert devices.allocator_defaults({"GLIBC_TUNABLES": "x=1"}) == {"GLIBC_TUNABLES": "x=1"}


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
