"""How ptrres compiles its kernels: the one place that says so.

Kernels are compiled lazily: importing ptrres compiles nothing. Each kernel
declares the signatures it is ever called with (the wrappers convert input to
exactly those dtypes); ``warmup()`` compiles them, or loads them from Numba's
on-disk cache, and then closes the kernel to new specialisations, so that a
wrong dtype fails loudly instead of compiling in the middle of a serving step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import numba

F = TypeVar("F", bound=Callable[..., Any])

JIT_OPTIONS: dict[str, Any] = {
    # Compiled code is written next to the module (or to Numba's user-wide
    # cache when that is read-only) and loaded by later processes.
    "cache": True,
    # Kernels touch only the arrays they are given: callers' threads run
    # them concurrently.
    "nogil": True,
    # Indices are derived from sizes the wrappers have checked. NUMBA_BOUNDSCHECK=1
    # still turns checking on for debugging.
    "boundscheck": False,
    # No zero-division checks: every divisor is checked positive beforehand,
    # and Python's error model would add a branch to every `//` and `%`.
    "error_model": "numpy",
    # fastmath stays off: it buys nothing for integer and pointer code.
}

# Every kernel, with the signatures it is called with, for warmup().
KERNELS: list[tuple[Any, tuple[str, ...]]] = []


def kernel(*signatures: str) -> Callable[[F], F]:
    """Compile a function with JIT_OPTIONS, lazily, for the given signatures."""

    def decorate(function: F) -> F:
        dispatcher = numba.njit(**JIT_OPTIONS)(function)
        KERNELS.append((dispatcher, signatures))
        return dispatcher  # type: ignore[no-any-return]

    return decorate


def inline_helper(function: F) -> F:
    """Compile a function called only from kernels (compiled into its callers)."""
    # Inlined in Numba's IR: LLVM does not inline across Numba functions, and
    # a call in an inner loop costs more than the work it does.
    return numba.njit(**JIT_OPTIONS)(function)  # type: ignore[no-any-return]
