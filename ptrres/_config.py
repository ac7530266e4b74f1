"""How ptrres compiles its kernels: the one place that says so.

Kernels are compiled lazily: importing ptrres compiles nothing. Each kernel
declares the signatures it is ever called with (the wrappers convert input to
exactly those dtypes); ``warmup()`` compiles them, or loads them from Numba's
on-disk cache, and then closes the kernel to new specialisations, so that a
wrong dtype fails loudly instead of compiling in the middle of a serving step.

Numba is used through its documented user API only (``numba.njit`` and its
documented options, explicit signatures, ``numba.config``, the dispatcher's
public methods): ptrres runs beside whatever Numba its users' engine pins,
and Numba's internals change in minor releases.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import numba

F = TypeVar("F", bound=Callable[..., Any])

JIT_OPTIONS: dict[str, Any] = {
    # Compiled code is written next to the module (or to Numba's user-wide
    # cache when that is read-only) and loaded by later processes. Where no
    # place is writable, kernels are compiled uncached: see _jit().
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
    # Kernels are called from Python only: no C-callable wrapper to compile.
    "no_cfunc_wrapper": True,
    # fastmath stays off: it buys nothing for integer and pointer code.
}

# Every kernel, with the signatures it is called with, for warmup().
KERNELS: list[tuple[Any, tuple[str, ...]]] = []


def kernel(*signatures: str) -> Callable[[F], F]:
    """Compile a function with JIT_OPTIONS, lazily, for the given signatures."""

    def decorate(function: F) -> F:
        dispatcher = _jit(function, JIT_OPTIONS)
        KERNELS.append((dispatcher, signatures))
        return dispatcher

    return decorate


def argument_types(signature: str) -> tuple[Any, ...]:
    """The argument types of a declared signature, as Numba types a call's.

    ``dispatcher.compile()`` is given these, never the string: Numba keys its
    on-disk cache by the signature exactly as compile() receives it, and a
    call that compiles on first use passes its arguments' types. Compiled from
    the string, the same code would get a second cache entry, which a process
    that first calls the kernel never finds (and the other way round).

    Signatures name Numba scalar types and C-contiguous arrays of them
    (``int64``, ``uint64[::1]``, ``int64[:, ::1]``); anything else raises.
    """
    parameters = re.fullmatch(r"\s*\w+\s*\((.*)\)\s*", signature)
    if parameters is None:
        raise ValueError(f"not a kernel signature: {signature!r}")
    types = []
    for argument in _ARGUMENT.finditer(parameters.group(1)):
        scalar = getattr(numba.types, argument["scalar"])
        dims = argument["dims"]
        if dims is None:
            types.append(scalar)
            continue
        steps = [dim.replace(" ", "") for dim in dims.split(",")]
        if steps[-1] != "::1" or any(step != ":" for step in steps[:-1]):
            raise ValueError(f"not a C-contiguous array: {argument[0]!r}")
        spec = (slice(None),) * (len(steps) - 1) + (slice(None, None, 1),)
        types.append(scalar[spec if len(spec) > 1 else spec[0]])
    return tuple(types)


# One argument of a signature: a scalar type, or an array of one.
_ARGUMENT = re.compile(r"(?P<scalar>\w+)(?:\[(?P<dims>[^\]]*)\])?")


def inline_helper(function: F) -> F:
    """Compile a function called only from kernels, into the kernels.

    It is compiled for the types its callers pass and linked into them, so it
    needs no signatures of its own and warmup() does not list it. It gets no
    wrapper for calls from Python or C, and no cache entry of its own (its
    callers' entries hold its code): with them, each helper cost about twice
    the compile time. (Numba's IR-level ``inline="always"`` was tried: no
    faster kernels, and more compile time.)
    """
    options = dict(JIT_OPTIONS, cache=False, no_cpython_wrapper=True)
    return numba.njit(**options)(function)  # type: ignore[no-any-return]


# Why Numba cannot cache kernels in this process (None while it can).
cache_refused: str | None = None


def _jit(function: F, options: dict[str, Any]) -> F:
    """numba.njit(**options), uncached when Numba has nowhere to cache.

    With cache=True, Numba looks for a writable cache directory when a function
    is decorated (at import): NUMBA_CACHE_DIR, the package's __pycache__, then
    the user-wide cache (~/.cache/numba). When none is writable (a read-only
    install run by a user without a writable home, say) it raises, and ptrres
    would not import. Then every kernel is compiled uncached, in each process,
    and one warning says why.
    """
    global cache_refused
    if cache_refused is None:
        try:
            return numba.njit(**options)(function)  # type: ignore[no-any-return]
        except RuntimeError as exc:  # "cannot cache function ...: no locator"
            cache_refused = str(exc)
            warnings.warn(
                f"ptrres: Numba cannot cache compiled kernels ({exc}); they are "
                "compiled in each process instead, at warmup() or first use. "
                "Set NUMBA_CACHE_DIR to a writable directory to cache them.",
                stacklevel=3,  # the kernel's definition
            )
    uncached = numba.njit(**dict(options, cache=False))
    return uncached(function)  # type: ignore[no-any-return]
