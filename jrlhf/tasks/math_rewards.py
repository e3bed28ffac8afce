"""Verifiable math rewards: answer equivalence with HF's ``math-verify``, a format reward, and
weighted sums of rewards.

``math_verify`` extracts the response's final answer (``\\boxed{...}`` first, then a stated
answer, then the last number or expression: ``#### 42``, ``$5``, ``1,000``, ``\\dfrac{1}{2}``,
``50%``) and checks it against the record's reference answer for mathematical equivalence
(math-verify's parser to SymPy, numeric and symbolic comparison). The reference comes from the
prompt record's meta, the first present of:

- ``ground_truth``, or verl's ``reward_model: {"ground_truth": ...}``;
- ``answer``: GSM8K's worked answer ending ``#### 72`` counts for its text after ``####``; any
  other text (or a number) is the answer itself;
- ``solution``: MATH's worked solution, whose ``\\boxed{...}`` is the answer.

Bounded time: SymPy can take very long on an adversarial answer (``9^{9^{9^9}}``), in C code
that no signal interrupts, and a SIGALRM timeout that lands in one of JAX's garbage-collection
callbacks is swallowed. So the checks run in a worker process of their own
(:mod:`jrlhf.tasks.math_verifier`, started on first use in under half a second), under math-verify's
timeouts there (1 s to parse, 1 s a comparison), and each check has an outer deadline
(:data:`CHECK_DEADLINE_S`) past which the worker is killed and restarted. A response that times
out or does not parse scores 0, and the batch logs one warning counting them: the policy's
output never stops a run. A record without a reference is a data error
(:class:`~jrlhf.tasks.RewardError` naming the sample), and the start-up check reads every
prompt's meta for one of the keys above before any model is built.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import select
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from jrlhf.tasks import math_verifier

log = logging.getLogger(__name__)

# A check's outer bound: the worker's own timeouts (1 s to parse, 1 s for each of up to four
# comparisons) plus room for a loaded machine.
CHECK_DEADLINE_S = 15.0
START_DEADLINE_S = 120.0
# The meta keys a reference answer may come under (any one of them): see the module docstring.
REFERENCE_KEYS = ("ground_truth", "reward_model", "answer", "solution")


def reference_answer(meta: Mapping[str, Any]) -> str | None:
    """The reference answer of a prompt record's meta as text (None without one)."""
    truth = meta.get("ground_truth")
    if truth is None and isinstance(meta.get("reward_model"), Mapping):
        truth = meta["reward_model"].get("ground_truth")
    if truth is not None:
        return str(truth)
    answer = meta.get("answer")
    if answer is not None and not isinstance(answer, bool):
        text = str(answer)
        if "####" in text:  # GSM8K: the worked answer ends with "#### <number>"
            text = text.rsplit("####", 1)[1]
        return text.strip()
    if meta.get("solution") is not None:
        return str(meta["solution"])
    return None


class VerifierProcess:
    """The math-verify worker (jrlhf.tasks.math_verifier) and the deadline on each check."""

    def __init__(self, deadline_s: float = CHECK_DEADLINE_S):
        self.deadline_s = deadline_s
        self.proc: subprocess.Popen | None = None
        self._buf = b""
        self.restarts = 0

    def _start(self) -> None:
        env = dict(os.environ)
        # The worker imports nothing of jrlhf; it only needs this interpreter's packages.
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        self.proc = subprocess.Popen(
            [sys.executable, "-u", math_verifier.__file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            cwd=str(Path(math_verifier.__file__).parent),
        )
        self._buf = b""
        if self._read(START_DEADLINE_S) != "ready":
            self.close()
            raise RuntimeError("the math-verify worker did not start (is math-verify installed?)")

    def _read(self, timeout: float) -> Any:
        """The worker's next JSON line, or None when none came within ``timeout`` seconds."""
        end = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = end - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:  # the worker died
                return None
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def check(self, response: str, reference: str) -> tuple[float, bool]:
        """(score, timed_out) of one response; a check past the deadline kills the worker
        (restarted for the next) and scores 0."""
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        try:
            self.proc.stdin.write((json.dumps([response, reference]) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            self.close()
            return 0.0, True
        out = self._read(self.deadline_s)
        if out is None:
            self.close()
            self.restarts += 1
            return 0.0, True
        return float(out[0]), bool(out[1])

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            for f in (self.proc.stdin, self.proc.stdout):
                f.close()
            self.proc = None


_WORKER = VerifierProcess()
atexit.register(_WORKER.close)


def verify_answer(response: str, reference: str) -> tuple[float, bool]:
    """(score, timed_out): 1.0 when ``response``'s final answer is equivalent to
    ``reference`` (HF math-verify, in the worker process), else 0.0."""
    return _WORKER.check(response, reference)


def math_verify(batch) -> list[float]:
    """1.0 for a response whose final answer equals the record's reference answer
    mathematically (HF math-verify), else 0.0; see the module docstring."""
    references = []
    for i, meta in enumerate(batch.meta):
        reference = reference_answer(meta)
        if reference is None:
            raise ValueError(
                f"reward 'math_verify' needs a reference answer: give each prompt record one of "
                f"{', '.join(repr(k) for k in REFERENCE_KEYS)} (sample {i} has none)"
            )
        references.append(reference)
    scores, timed_out = [], 0
    for response, reference in zip(batch.responses, references):
        score, slow = verify_answer(response, reference)
        scores.append(score)
        timed_out += slow
    if timed_out:
        log.warning(
            "math_verify: %d of %d responses ran out of time and scored 0", timed_out, len(scores)
        )
    return scores


# Any one of these keys will do (jrlhf.pipeline.task_data checks every prompt before a run).
math_verify.required_meta = (REFERENCE_KEYS,)


# DeepSeek-R1 / open-r1's GRPO format: reasoning in <think> tags, then the answer in <answer>.
THINK_ANSWER_PATTERN = r"<think>\n.*?\n</think>\n<answer>\n.*?\n</answer>"
_BOXED = re.compile(r"\\boxed\s*\{")


def format_reward(pattern: str = "") -> Callable[[Any], list[float]]:
    """A reward of 1.0 for a response (stripped of surrounding whitespace) that matches
    ``pattern`` as a whole (``re.fullmatch``, ``.`` matching newlines), else 0.0; the default
    is :data:`THINK_ANSWER_PATTERN`. ``TaskConfig.format_pattern`` sets it for ``format``."""
    try:
        regex = re.compile(pattern or THINK_ANSWER_PATTERN, re.DOTALL)
    except re.error as e:
        raise ValueError(f"TaskConfig.format_pattern {pattern!r} is not a regex ({e})") from None

    def format(batch) -> list[float]:
        return [float(regex.fullmatch(r.strip()) is not None) for r in batch.responses]

    return format


def boxed_format(batch) -> list[float]:
    """1.0 for a response with exactly one ``\\boxed{...}`` final answer (the form math
    instruct recipes ask for: "put your final answer within \\boxed{}"), else 0.0."""
    return [float(len(_BOXED.findall(r)) == 1) for r in batch.responses]
