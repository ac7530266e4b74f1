"""warmup(): compile, or load from Numba's cache, every kernel up front."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from ._config import KERNELS


@dataclass(frozen=True)
class CompiledKernel:
    """What warmup() did for one signature of one kernel."""

    kernel: str
    signature: str
    # "loaded" from Numba's on-disk cache, "compiled" now, "ready" (already in
    # memory), or "interpreted" when NUMBA_DISABLE_JIT is set.
    how: str


@dataclass(frozen=True)
class WarmupReport:
    """The kernels warmup() made ready, and how long it took."""

    kernels: tuple[CompiledKernel, ...]
    seconds: float

    def count(self, how: str) -> int:
        """Signatures that were made ready this way ("loaded", "compiled"...)."""
        return sum(1 for k in self.kernels if k.how == how)

    def __str__(self) -> str:
        counts = ", ".join(
            f"{self.count(how)} {how}"
            for how in ("loaded", "compiled", "ready", "interpreted")
            if self.count(how)
        )
        return (
            f"ptrres warmup: {len(self.kernels)} kernel signatures ({counts}) "
            f"in {self.seconds:.3f} s"
        )


def warmup() -> WarmupReport:
    """Make every kernel ready, so that no later call compiles anything.

    Each kernel is compiled for every signature it is called with, or loaded
    from Numba's on-disk cache, then closed to new specialisations. A server
    calls this once at start-up; calling it again costs next to nothing.

    Returns:
        A WarmupReport saying, for each kernel signature, whether it was loaded
        from the cache, compiled, already ready, or interpreted (JIT disabled).
    """
    start = time.perf_counter()
    done = []
    with _lock:
        for dispatcher, signatures in KERNELS:
            name = getattr(dispatcher, "__name__", repr(dispatcher))
            for signature in signatures:
                how = _make_ready(dispatcher, signature)
                done.append(CompiledKernel(name, signature, how))
            if hasattr(dispatcher, "disable_compile"):
                dispatcher.disable_compile()
                _closed.add(id(dispatcher))
    return WarmupReport(tuple(done), time.perf_counter() - start)


# Kernels that warmup() has closed to new specialisations (by id).
_closed: set[int] = set()
_lock = threading.Lock()


def _make_ready(dispatcher: Any, signature: str) -> str:
    """Compile or load one signature of a kernel; say which it was."""
    if not hasattr(dispatcher, "compile"):  # NUMBA_DISABLE_JIT=1: plain Python
        return "interpreted"
    if id(dispatcher) in _closed:
        return "ready"
    known = len(dispatcher.overloads)
    hits = sum(dispatcher.stats.cache_hits.values())
    dispatcher.compile(signature)
    if len(dispatcher.overloads) == known:
        return "ready"
    if sum(dispatcher.stats.cache_hits.values()) > hits:
        return "loaded"
    return "compiled"
