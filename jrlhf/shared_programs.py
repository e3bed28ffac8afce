"""Program factories whose results are shared between equal requests in one process.

jax.jit caches traces and executables per function object. A factory that builds a new jitted
closure on every call (a train step, an inference call, a loss) makes every trainer built again
in one process (evaluation after training, a resumed stage, the tests' many runs) trace, lower
and load its programs again. Factories decorated here return the same object for equal
arguments instead, so the jitted functions they build keep their caches. Arguments are compared
by value where they are values (configs, meshes, rule sets) and by identity where they are
functions, so two requests share only when they would build the same program.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable)


def shared_program(maxsize: int = 32) -> Callable[[F], F]:
    """Decorator: ``functools.lru_cache(maxsize)``, calling straight through when an argument
    is unhashable (a gin list, say), which then builds a fresh object as without it."""

    def decorate(factory: F) -> F:
        cached = functools.lru_cache(maxsize)(factory)

        @functools.wraps(factory)
        def build(*args, **kwargs):
            try:
                hash((args, tuple(kwargs.items())))
            except TypeError:
                return factory(*args, **kwargs)
            return cached(*args, **kwargs)

        build.cache_clear = cached.cache_clear
        return build

    return decorate
