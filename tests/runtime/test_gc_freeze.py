"""jrlhf.runtime.gc_freeze: a stage freezes what its first step left for Python's collector and
unfreezes when it ends (RunConfig.gc_freeze)."""

import gc

import pytest
from run_helpers import SMALL

from jrlhf.cli import train
from jrlhf.runtime.gc_freeze import WarmFreeze, warm_freeze


@pytest.fixture(autouse=True)
def _nothing_frozen():
    """These tests count what a stage freezes: they start from a collector with nothing frozen
    (tests/conftest.py freezes what earlier files left, at each file's start)."""
    gc.unfreeze()


def test_the_first_step_freezes_and_release_unfreezes():
    assert gc.get_freeze_count() == 0
    freezer = WarmFreeze()
    kept = [[i] for i in range(1000)]  # objects the collector tracks, alive across the freeze

    def visited() -> int:  # how many of them a collection would traverse
        tracked = {id(x) for x in gc.get_objects()}
        return sum(id(x) in tracked for x in kept)

    assert visited() == len(kept)
    try:
        freezer.step_done()
        # Frozen objects can still be freed (by the runtime's other threads, after the tests
        # before this one in a worker), so the count may fall below what the freeze took.
        assert freezer.frozen >= len(kept) and 0 < gc.get_freeze_count() <= freezer.frozen
        assert visited() == 0
        count = gc.get_freeze_count()
        freezer.step_done()  # later steps freeze nothing more
        assert gc.get_freeze_count() <= count and visited() == 0
        freezer.release()
        assert freezer.frozen == 0 and gc.get_freeze_count() == 0
        assert visited() == len(kept)
        freezer.release()  # idempotent
    finally:
        gc.unfreeze()  # a failed check leaves no freeze behind for the next test


def test_disabled_or_failing_loops_leave_nothing_frozen():
    off = WarmFreeze(enabled=False)
    off.step_done()
    assert off.frozen == 0 and gc.get_freeze_count() == 0
    with pytest.raises(RuntimeError), warm_freeze() as freezer:
        freezer.step_done()
        assert gc.get_freeze_count() > 0
        raise RuntimeError("a step failed")
    assert gc.get_freeze_count() == 0


def test_a_supervised_stage_freezes_after_its_first_step(tmp_path, freezers):
    """(The RL loop: tests/e2e/test_trainer.py, a GRPO run with and one without.)"""
    args = [
        "--run-dir", str(tmp_path), "--quiet", "RunConfig.stages=('sft',)", "SFTConfig.steps=3",
        *SMALL,
    ]  # fmt: skip
    assert train.main(args) == 0
    (stage,) = freezers
    assert stage.froze > 0 and stage.released
    assert gc.get_freeze_count() == 0
