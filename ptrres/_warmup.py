"""warmup(): compile, or load from Numba's cache, every kernel up front.

Numba's compiler is single-threaded and holds a process-wide lock, so on an
empty cache warmup() compiles the missing kernels in several processes at
once, as PyTorch Inductor's compile workers do: this process compiles one
share, forks of it (or fresh interpreters, when it runs other threads) compile
the others into the on-disk cache, and this process then loads them from it.
With a warm cache (every later start) nothing is spawned.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import chain
from typing import Any

from . import _config
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
    # Processes that compiled kernels: 1 when this one did it alone (or had
    # nothing to compile), more when an empty cache was filled in parallel.
    processes: int = 1

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


def warmup(*, processes: int | None = None) -> WarmupReport:
    """Make every kernel ready, so that no later call compiles anything.

    Each kernel is compiled for every signature it is called with, or loaded
    from Numba's on-disk cache, then closed to new specialisations. A server
    calls this once at start-up; calling it again costs next to nothing.

    Args:
        processes: how many processes may compile kernels that are not in the
            cache: this one and up to ``processes - 1`` workers (forks of
            it, or fresh ``sys.executable`` interpreters when it runs other
            threads), which write them to the cache. The default
            is the number of CPUs this process may use; 1 compiles here only.
            Without a usable cache, everything compiles here.

    Returns:
        A WarmupReport saying, for each kernel signature, whether it was loaded
        from the cache, compiled, already ready, or interpreted (JIT disabled).
    """
    start = time.perf_counter()
    done = []
    with _lock:
        missing = _uncached()
        if missing or _config.cache_refused is not None:
            _load_registries()  # else everything loads, which needs none
        parallel = _compile_in_parallel(
            missing, _usable_cpus() if processes is None else processes
        )
        for dispatcher, signatures in KERNELS:
            name = getattr(dispatcher, "__name__", repr(dispatcher))
            for signature in signatures:
                how = _make_ready(dispatcher, signature)
                if (id(dispatcher), signature) in parallel:
                    how = "compiled"  # here or by a worker, for this warmup
                done.append(CompiledKernel(name, signature, how))
            if hasattr(dispatcher, "disable_compile"):
                dispatcher.disable_compile()
                _closed.add(id(dispatcher))
    processes_used = len(set(parallel.values())) or 1
    return WarmupReport(tuple(done), time.perf_counter() - start, processes_used)


def _uncached() -> list[tuple[Any, str]]:
    """The (kernel, signature) pairs that are neither ready nor cached."""
    return [
        (dispatcher, signature)
        for dispatcher, signatures in KERNELS
        if hasattr(dispatcher, "compile") and id(dispatcher) not in _closed
        for signature in signatures
        if not _cached(dispatcher, signature)
    ]


def _load_registries() -> None:
    """Load Numba's typing registries, then its target's, as its compiler
    does, before any kernel is compiled (and before any fork).

    A cached kernel's compile() looks in the cache first, which loads the
    target's registries first; the typing context then gets its templates in
    another order, in which ptrres's kernels type more slowly: the plan
    kernel compiled in 1.96 s instead of 1.84 s alone, and in 2.35-2.45 s
    instead of 1.85-1.90 s in warmup()'s forks.
    """
    for dispatcher, _ in KERNELS:
        if hasattr(dispatcher, "targetctx"):  # not with NUMBA_DISABLE_JIT=1
            dispatcher.typingctx.refresh()
            dispatcher.targetctx.refresh()
            return


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
    with _loads_without_refresh(dispatcher):
        dispatcher.compile(signature)
    if len(dispatcher.overloads) == known:
        return "ready"
    if sum(dispatcher.stats.cache_hits.values()) > hits:
        return "loaded"
    return "compiled"


@contextmanager
def _loads_without_refresh(dispatcher: Any) -> Iterator[None]:
    """Within this, a load from Numba's cache skips Numba's refresh.

    Numba refreshes its target context before each load: it imports and
    installs every typing and lowering registry, and starts its runtime, the
    first time 0.12 s of a 0.49 s warm start. Compiling needs them; loading
    a kernel's machine code, compiled without Numba's runtime (_config), and
    calling it do not. A signature not in the cache still compiles as usual,
    refresh included. Where Numba's cache differs, or kernels have Numba's
    runtime, nothing changes.
    """
    cache: Any = getattr(dispatcher, "_cache", None)
    load = getattr(cache, "_load_overload", None)
    guard = getattr(cache, "_guard_against_spurious_io_errors", None)
    if load is None or guard is None or _config.JIT_OPTIONS.get("_nrt", True):
        yield
        return

    def load_overload(signature: Any, target_context: Any) -> Any:
        with guard():  # as Numba's: an unreadable entry is a miss (None)
            return load(signature, target_context)

    cache.load_overload = load_overload  # this instance only, for now
    try:
        yield
    finally:
        del cache.load_overload


# A worker: compile the given (module, kernel, signature) triples, which
# Numba saves to its cache. Its stdout is unused; errors go to its stderr.
_WORKER = """
import importlib, json, sys
sys.path.insert(0, sys.argv[1])
for module, name, signature in json.loads(sys.argv[2]):
    getattr(importlib.import_module(module), name).compile(signature)
"""
# The longest a worker may take before its share is compiled here instead.
WORKER_TIMEOUT = 600.0


def _compile_in_parallel(
    missing: list[tuple[Any, str]], processes: int
) -> dict[tuple[int, str], int]:
    """Compile the ``missing`` kernels in ``processes`` processes at once.

    Workers compile into Numba's on-disk cache, from which the caller then
    loads what they compiled. Forks of this process (on Linux, when it runs
    no other Python thread) start at once, with ptrres and Numba imported,
    and take the signatures one at a time from a queue this process also
    takes from: however the guesses of their costs err, the processes end
    together. Else fresh interpreters each compile a fixed share (_shares),
    0.6 s later, since a fork would copy whatever locks other threads hold.
    A worker that cannot start or fails leaves its kernels uncached, and the
    caller compiles them itself: nothing is lost but time.

    Returns:
        For each (kernel id, signature) compiled in parallel, the process
        that compiled it: 0 for this one, 1 and up for workers. Empty when
        everything is left to the caller.
    """
    if processes < 2 or _config.cache_refused is not None:
        return {}
    if len(missing) < 2:
        return {}
    if can_fork():
        return _compile_in_forks(missing, processes)
    return _compile_in_interpreters(missing, processes)


def can_fork() -> bool:
    """Whether workers may be forks: on Linux, with no other Python thread.

    A fork copies whatever locks other threads hold, and a Python thread may
    hold one the worker needs (the compiler's, an import's). Native pools
    (numpy's BLAS threads start at import) idle on condition variables and
    hold none that a compiling worker takes.
    """
    return sys.platform == "linux" and threading.active_count() == 1


def _compile_in_forks(
    missing: list[tuple[Any, str]], processes: int
) -> dict[tuple[int, str], int]:
    """Compile ``missing`` here and in forks, each taking the next signature
    (costliest first) from one pipe until it is empty."""
    order = sorted(range(len(missing)), key=lambda i: -_cost(missing[i][0]))
    queue_out, queue_in = os.pipe()
    done_out, done_in = os.pipe()
    # One byte per signature: reads of one byte from a pipe never interleave.
    os.write(queue_in, bytes(order[:255]))
    os.close(queue_in)  # else no reader would ever see the queue end
    pids = []
    # Worker numbers go through the pipe as bytes, too.
    for worker in range(1, min(processes, len(missing), 256)):
        try:
            with warnings.catch_warnings():
                # Python 3.12 warns of any fork of a process with native
                # threads, such as numpy's BLAS pool (see can_fork).
                warnings.simplefilter("ignore", DeprecationWarning)
                pid = os.fork()
        except OSError:
            break
        if pid == 0:  # a worker: compile, and leave without cleaning up
            status = 1
            try:
                for i in _queued(queue_out):
                    missing[i][0].compile(missing[i][1])
                    os.write(done_in, bytes([i, worker]))
                status = 0
            finally:
                os._exit(status)
        pids.append(pid)
    os.close(done_in)
    compiled = {}
    try:
        for i in chain(_queued(queue_out), order[255:]):  # one at a time
            missing[i][0].compile(missing[i][1])
            compiled[id(missing[i][0]), missing[i][1]] = 0
    finally:  # even if a compile here fails: no worker is left behind
        os.close(queue_out)
        deadline = time.monotonic() + WORKER_TIMEOUT
        for pid in pids:
            while os.waitpid(pid, os.WNOHANG) == (0, 0):
                if time.monotonic() > deadline:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    break
                time.sleep(0.005)
        with os.fdopen(done_out, "rb") as done:
            report = done.read()
    for i, worker in zip(report[::2], report[1::2]):
        dispatcher, signature = missing[i]
        if _cached(dispatcher, signature):
            compiled[id(dispatcher), signature] = worker
    return compiled


def _queued(queue: int) -> Iterator[int]:
    """The indices read one at a time from a queue pipe, until it is empty."""
    while index := os.read(queue, 1):
        yield index[0]


def _compile_in_interpreters(
    missing: list[tuple[Any, str]], processes: int
) -> dict[tuple[int, str], int]:
    """Compile the first share here, the others in fresh interpreters."""
    shares = _shares(missing, processes)
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    workers = []
    for worker, share in enumerate(shares[1:], 1):
        triples = [(d.py_func.__module__, d.__name__, s) for d, s in share]
        try:
            if not sys.executable:
                raise OSError("no interpreter")
            process = subprocess.Popen(
                [sys.executable, "-c", _WORKER, package_parent, json.dumps(triples)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        except OSError:
            shares[0].extend(share)  # no worker: compiled here after all
            continue
        workers.append((worker, process, share))
    compiled = {}
    for dispatcher, signature in shares[0]:
        dispatcher.compile(signature)
        compiled[id(dispatcher), signature] = 0
    for worker, process, share in workers:
        try:
            process.wait(WORKER_TIMEOUT)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        for dispatcher, signature in share:
            if _cached(dispatcher, signature):
                compiled[id(dispatcher), signature] = worker
    return compiled


def _shares(
    missing: list[tuple[Any, str]], processes: int
) -> list[list[tuple[Any, str]]]:
    """Split the signatures to compile into shares of about equal cost.

    A signature's cost is taken as the bytecode compiled into it: its kernel's
    and that of every helper it calls, directly or not. Largest first, each
    goes to the cheapest share; the costliest share comes first, for this
    process, since a worker also pays for starting an interpreter.
    """
    shares: list[list[tuple[Any, str]]] = [
        [] for _ in range(min(processes, len(missing)))
    ]
    totals = [0] * len(shares)
    for dispatcher, signature in sorted(missing, key=lambda m: -_cost(m[0])):
        cheapest = totals.index(min(totals))
        shares[cheapest].append((dispatcher, signature))
        totals[cheapest] += _cost(dispatcher)
    return [share for _, share in sorted(zip(totals, shares), key=lambda t: -t[0])]


def _cost(dispatcher: Any) -> int:
    """A guess of what compiling a kernel costs: its bytecode, helpers in."""
    return _bytecode(dispatcher.py_func, set())


def _bytecode(function: Any, seen: set[int]) -> int:
    """Bytes of bytecode of a function and of the jitted helpers it calls."""
    if id(function) in seen:
        return 0
    seen.add(id(function))
    size = len(function.__code__.co_code)
    for name in function.__code__.co_names:
        helper = getattr(function.__globals__.get(name), "py_func", None)
        if helper is not None:
            size += _bytecode(helper, seen)
    return size


def _cached(dispatcher: Any, signature: str) -> bool:
    """Whether Numba's on-disk cache holds this signature of this kernel.

    It reads the kernel's cache index, as Numba does before loading: the key
    holds the signature, the machine and a hash of the kernel's bytecode.
    Where Numba's cache cannot be read that way, it answers True: the kernel
    is then made ready here, as without parallel compilation.
    """
    try:
        cache = dispatcher._cache
        key = cache._index_key(signature, dispatcher.targetctx.codegen())
        return key in cache._cache_file._load_index()
    except Exception:  # another Numba's internals: never worse than serial
        return True


def _usable_cpus() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1
