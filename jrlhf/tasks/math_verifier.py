"""The math-verify worker: one answer check per line of stdin, one verdict per line of stdout.

Run as a script (``python math_verifier.py``) by :mod:`jrlhf.tasks.math_rewards`, in a process
of its own: SymPy can hang on an adversarial answer in C code that no signal interrupts, and in
a process with JAX a SIGALRM timeout that lands in one of its garbage-collection callbacks is
swallowed, so the trainer bounds each check from outside and kills the worker when one runs
over. This file imports nothing of jrlhf (the worker starts in a few hundred milliseconds).

Protocol (JSON lines): the worker writes ``"ready"`` once math-verify is imported; then for each
request ``[response, reference]`` it writes ``[score, timed_out]``.
"""

from __future__ import annotations

import functools
import json
import logging
import sys
import time

# Inside the worker, math-verify's own SIGALRM timeouts (the main thread, no JAX) end most slow
# checks long before the trainer's outer deadline does.
PARSE_TIMEOUT_S = 1
VERIFY_TIMEOUT_S = 1


@functools.cache
def _verifier():
    import math_verify  # noqa: PLC0415 - SymPy's import is the worker's start-up, not its caller's
    from math_verify.errors import TimeoutException  # noqa: PLC0415

    # math-verify warns about every timeout with the whole text; the trainer counts them.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    # The response's final answer: \boxed{} before anything else; then "the answer is ..."
    # statements and the last expression.
    pred = (
        math_verify.LatexExtractionConfig(boxed_match_priority=0),
        math_verify.ExprExtractionConfig(),
    )
    gold = (math_verify.LatexExtractionConfig(), math_verify.ExprExtractionConfig())
    return math_verify, TimeoutException, pred, gold


@functools.lru_cache(maxsize=8192)
def _parsed_reference(text: str) -> tuple:
    """A reference parsed once (a prompt's samples share it)."""
    mv, _, _, gold = _verifier()
    if "\\boxed" not in text:
        # A bare answer ("\sqrt{2}", "x+1", "(1, 2)") is LaTeX only math-verify's anchors find:
        # boxed, it parses as the whole answer rather than as its last number.
        boxed = tuple(mv.parse(f"\\boxed{{{text}}}", gold, parsing_timeout=PARSE_TIMEOUT_S))
        if boxed:
            return boxed
    return tuple(mv.parse(text, gold, parsing_timeout=PARSE_TIMEOUT_S))


def verify_answer(response: str, reference: str) -> tuple[float, bool]:
    """(score, timed_out): 1.0 when ``response``'s final answer is equivalent to
    ``reference``, else 0.0; ``timed_out`` when parsing or comparing ran out of time."""
    mv, timeout_error, pred_config, _ = _verifier()
    gold = list(_parsed_reference(reference))
    if not gold:
        return 0.0, False
    try:
        pred = mv.parse(response, pred_config, parsing_timeout=PARSE_TIMEOUT_S, raise_on_error=True)
    except timeout_error:
        return 0.0, True
    except Exception:  # an answer the parser cannot read scores 0
        return 0.0, False
    if not pred:
        return 0.0, False
    start = time.perf_counter()
    ok = mv.verify(gold, pred, timeout_seconds=VERIFY_TIMEOUT_S)
    # verify() swallows its timeouts: a failed check that took a timeout's time timed out.
    slow = time.perf_counter() - start >= VERIFY_TIMEOUT_S
    return float(ok), bool(slow and not ok)


def main() -> None:
    _verifier()
    out = sys.stdout
    out.write('"ready"\n')
    out.flush()
    for line in sys.stdin:
        try:
            response, reference = json.loads(line)
            result = verify_answer(str(response), str(reference))
        except BaseException:  # a timeout out of place, or a malformed request: scores 0
            result = (0.0, True)
        out.write(json.dumps(result) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
