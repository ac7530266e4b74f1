"""The kernels made ready where vLLM builds its handlers and its simple
path's params (at engine start-up), and the line that says how.

Until a handler or params are built, the plugin imports no kernel (nor
numba): ``warmup()`` imports ``ptrres.warmup()`` when first called.
``describe_warmup()`` is also the first line of ``ptrres warmup``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import _state

if TYPE_CHECKING:
    from .._warmup import WarmupReport

# Whether a handler's warmup has been logged at INFO in this process.
_warmup_logged = False


def warmup(*, processes: int | None = None) -> WarmupReport:
    """ptrres.warmup(), imported when first called: until a handler or params
    are built, the plugin imports no kernel (nor numba)."""
    from .._warmup import warmup as make_ready

    return make_ready(processes=processes)


def warm_up_kernels() -> None:
    """ptrres.warmup(), logged at INFO the first time in this process.

    Every kernel is loaded from Numba's cache or compiled here, where vLLM
    builds its handlers and its simple path's params (at engine start-up), so
    that no transfer, in an engine step on every tensor-parallel rank, waits
    for one. Later calls cost next to nothing.
    """
    global _warmup_logged
    report = warmup()
    with _state.lock:
        first, _warmup_logged = not _warmup_logged, True
    (_state.reporter().info if first else _state.logger.debug)(
        "%s, before vLLM's first KV offload", describe_warmup(report)
    )


def describe_warmup(report: WarmupReport) -> str:
    """One line saying what warmup() did: how many signatures went which way."""
    counts = ", ".join(
        f"{report.count(how)} {how}"
        for how in ("loaded", "compiled", "ready", "interpreted")
        if report.count(how)
    )
    processes = f" in {report.processes} processes" if report.processes > 1 else ""
    return (
        f"ptrres warmup: {len(report.kernels)} kernel signatures ({counts}) "
        f"in {report.seconds:.2f} s{processes}"
    )
