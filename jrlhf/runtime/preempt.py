"""A test hook that stands in for a preempted job: exit abruptly, no cleanup, mid-iteration.

``JRLHF_DEBUG_EXIT_AT_ITERATION=i`` ends the process while RL iteration ``i`` (counted from 0)
runs (the training side while it trains, a generating group of its own right after it
generated); ``JRLHF_DEBUG_EXIT_PROCESS=p`` limits that to process ``p`` (default: every
process). ``JRLHF_DEBUG_EXIT_AT_STEP=stage:n`` ends it right after step ``n`` of a supervised
stage (sft, rm, dpo). Fault tests use them to check that a resume loses, repeats and duplicates
no sample or step.
"""

from __future__ import annotations

import os

import jax

EXIT_AT_ITERATION_ENV = "JRLHF_DEBUG_EXIT_AT_ITERATION"
EXIT_PROCESS_ENV = "JRLHF_DEBUG_EXIT_PROCESS"
EXIT_AT_STEP_ENV = "JRLHF_DEBUG_EXIT_AT_STEP"


def exit_if_asked(iteration: int) -> None:
    """Exit with status 137 (as SIGKILL would) if the environment names this iteration and
    this process."""
    me = str(jax.process_index())
    if os.environ.get(EXIT_AT_ITERATION_ENV) == str(iteration) and (
        os.environ.get(EXIT_PROCESS_ENV, me) == me
    ):
        os._exit(137)


def exit_at_step_if_asked(stage: str, step: int) -> None:
    """Exit with status 137 if the environment names step ``step`` of supervised stage
    ``stage``."""
    if os.environ.get(EXIT_AT_STEP_ENV) == f"{stage}:{step}":
        os._exit(137)
