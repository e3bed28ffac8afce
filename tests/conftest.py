"""Test setup: 8 fake CPU devices and a persistent compilation cache, set before JAX is imported
anywhere."""

import fcntl
import gc
import os
import shutil
import sys
import tempfile
from contextlib import contextmanager
from importlib.metadata import version

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
# The test programs are tiny, so on CPU XLA spends far longer in LLVM's optimization passes than
# in running them: without those passes they compile about 4x faster and run somewhat slower, and
# the SFT + reward-model run of tests/e2e/test_trainer.py takes half as long end to end. Every
# program in a session (the trainer subprocesses inherit XLA_FLAGS too) is compiled the same way.
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
# XLA's older CPU fusion emitters compile these programs about twice as fast again (a PPO run of
# tests/e2e/test_trainer.py: 29 s -> 20 s). XLA aborts on a flag it does not know, so only on the
# jaxlib this was measured on; on another, check that the flag exists and widen the test.
_known = version("jaxlib").startswith("0.10.")
if _known and "xla_cpu_use_fusion_emitters" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_cpu_use_fusion_emitters=false"
# XLA:CPU splits a program's LLVM module into parts it code-generates on parallel threads; the
# two test workers already keep both cores busy, so the split only adds each part's fixed cost:
# one part took the suite's backend compiles from 288 to 245 worker-seconds (2,025 programs)
# and the suite from 7:21 to 6:48 on the 2-core machine.
if _known and "xla_cpu_parallel_codegen_split_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_cpu_parallel_codegen_split_count=1"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Compiling dominates the trainer tests on CPU, and many runs build the same programs: the
# placement runs share most of theirs with the colocated run, the killed and the resumed
# subprocess runs all of theirs. One XLA compilation cache for the session, inherited through the
# environment by the `python -m jrlhf.train` subprocesses, loads a program compiled before instead
# of compiling it again. A JAX_COMPILATION_CACHE_DIR set by the caller is used (and kept) instead.
# Counting compilations still works: JAX reports its backend-compile event (which
# jrlhf.reshard.backend_compile_count counts) for a program loaded from the cache too.
_SESSION_CACHE_DIR = None
if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    _SESSION_CACHE_DIR = tempfile.mkdtemp(prefix="jrlhf-tests-xla-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _SESSION_CACHE_DIR
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

# As every entry point does before JAX's backend starts: XLA:CPU's temporaries reuse freed memory
# instead of faulting in fresh pages at every call (jrlhf.devices.keep_host_memory).
from jrlhf.devices import keep_host_memory  # noqa: E402

keep_host_memory()

import gin  # noqa: E402
import jax  # noqa: E402 (after the XLA and cache environment above)
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(scope="session", autouse=True)
def _eight_devices():
    # On an accelerator (JAX_PLATFORMS=cuda, for the compiled-kernel tests) the devices are real.
    if jax.default_backend() == "cpu":
        assert jax.device_count() == 8, f"tests need 8 fake devices, got {jax.device_count()}"


@pytest.fixture(scope="module", autouse=True)
def _no_bindings_from_another_file():
    """Every test file starts without gin bindings: the config sections (``RLConfig()``, ...)
    read gin's global config, which a run or a config parse of an earlier file on the same
    pytest-xdist worker would otherwise leave for it, so results would depend on the files'
    order."""
    gin.clear_config()
    # What the earlier files left alive (compiled programs, JAX's caches, imported modules) mostly
    # stays alive: out of the collector's full passes, which otherwise rescan it all each time the
    # heap grows by a quarter. A full run on the 2-core machine: 57 worker-seconds in the
    # collector without this, 22 with it; 5:41 -> 5:27; peak memory per worker 5.7 -> 6.2 GB
    # (garbage frozen in cycles waits for the next unfreeze: a training stage's WarmFreeze
    # release unfreezes everything).
    gc.freeze()


@contextmanager
def _built_once(tmp_path_factory, name: str):
    """A run directory built once per test session, however many pytest-xdist workers ask for
    it: the first builds it under a lock (yielding the path to build at), the others wait and
    get it built (yielding None). Every test treats these runs as read-only."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the session's directory, shared by its workers
    run_dir, done = root / f"shared-{name}" / "run", root / f"shared-{name}.done"
    with open(root / f"shared-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if done.exists():
                yield None, run_dir
                return
            shutil.rmtree(run_dir.parent, ignore_errors=True)  # a worker's failed attempt
            run_dir.parent.mkdir(parents=True)
            yield run_dir, run_dir
            done.touch()
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def base_run(tmp_path_factory):
    """A short SFT + reward-model run whose outputs the RL tests start from. The reward model
    trains in micro-batches sized by tokens (RoleConfig.microbatch_tokens: 4 rows of 22 tokens
    a device, whole preference pairs), which must not change what it learns."""
    from run_helpers import SMALL

    from jrlhf.cli import train

    with _built_once(tmp_path_factory, "base") as (build, run_dir):
        if build:
            rc = train.main([
                "--run-dir", str(build), "--quiet",
                "RunConfig.stages=('sft', 'rm')", "SFTConfig.steps=60",
                "RewardModelConfig.steps=60", "reward/RoleConfig.microbatch_tokens=88", *SMALL,
            ])  # fmt: skip
            assert rc == 0
    return run_dir


@pytest.fixture(scope="session")
def colocated_run(base_run, tmp_path_factory):
    """Four PPO iterations from ``base_run`` (checkpoints at 2 and 4): the reference run."""
    from run_helpers import ppo_bindings

    from jrlhf.cli import train

    with _built_once(tmp_path_factory, "colocated") as (build, run_dir):
        if build:
            args = ["--run-dir", str(build), "--quiet", *ppo_bindings(base_run)]
            assert train.main(args) == 0
    return run_dir


@pytest.fixture
def freezers(monkeypatch) -> list:
    """Every WarmFreeze the code under test makes, recording what it froze and its release."""
    from jrlhf.pipeline import run
    from jrlhf.runtime import gc_freeze
    from jrlhf.runtime.gc_freeze import WarmFreeze

    made = []

    class Recording(WarmFreeze):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.froze, self.released = 0, False
            made.append(self)

        def step_done(self):
            super().step_done()
            self.froze = max(self.froze, self.frozen)

        def release(self):
            super().release()
            self.released = True

    monkeypatch.setattr(gc_freeze, "WarmFreeze", Recording)
    monkeypatch.setattr(run, "WarmFreeze", Recording)
    return made


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    if _SESSION_CACHE_DIR is not None:
        shutil.rmtree(_SESSION_CACHE_DIR, ignore_errors=True)
    # A pytest-xdist worker sent the controller its last report before unconfigure, and has
    # nothing left to write; tearing down its interpreter (JAX's backends, the thousands of
    # programs it compiled and their buffers) kept the controller waiting 10 s at the end of a
    # full run on the 2-core machine. Only workers end here: a run without xdist ends as usual.
    if hasattr(config, "workeroutput"):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(config.workeroutput.get("exitstatus", 0))


# Seconds each of the slowest test files took in a full run on the 2-core machine (2026-12-05,
# both workers busy; 5:38 in all). pytest-xdist hands out whole files (--dist loadfile) in
# collection order (--no-loadscope-reorder: by default it orders files by their number of
# tests, which put the slowest file, test_trainer.py, near the end, with one worker idle while
# it finished). Longest first is the classic rule for balancing jobs over workers; files not
# listed follow in their usual order. A stale figure only costs balance, never a test.
_SLOW_FILES = {
    "test_trainer.py": 74,
    "test_lora.py": 58,
    "test_decode.py": 51,
    "test_reliability.py": 32,
    "test_pipeline_stages.py": 31,
    "test_multiturn.py": 32,
    "test_pipelined_decode.py": 22,
    "test_staleness.py": 28,
    "test_residency.py": 28,
    "test_train_step.py": 25,
    "test_decode_kernels.py": 23,
    "test_recipe.py": 16,
    "test_bench_gpu.py": 12,
    "test_packing.py": 14,
    "test_native.py": 14,
    "test_distributed.py": 6,
    "test_ppo_math.py": 11,
    "test_models_hf.py": 11,
    "test_moe.py": 11,
    "test_plan_search.py": 10,
    "test_fusion.py": 10,
    "test_plan_estimator.py": 10,
}


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: -_SLOW_FILES.get(item.path.name, 0))  # stable: ties keep order
