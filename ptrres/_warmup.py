"""warmup(): compile, or load from Numba's cache, every kernel up front.

Numba's compiler is single-threaded and holds a process-wide lock, so on an
empty cache warmup() compiles the missing kernels in several processes at
once, as PyTorch Inductor's compile workers do: this process and forks of it
(or fresh interpreters, when it runs other threads) take the kernels one at a
time from one queue and compile them into Numba's on-disk cache; this process
then loads what the others compiled. With a warm cache (every later start)
nothing is spawned.

Processes that share one cache and start together (tensor-parallel ranks)
compile each kernel once: a lock file per kernel beside Numba's cache entry
says who is compiling it, and the others wait for it, then load it.

Only Numba's public API is used: a dispatcher's ``compile()``, ``overloads``,
``stats`` (its cache directory, hits and misses) and ``disable_compile()``.
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
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from itertools import chain
from typing import Any

# Every kernel registers itself in KERNELS when its module is imported:
# importing the package registers them all (resolve, plan, coalesce,
# canonical, files and copy_blocks), which `import ptrres` no longer does.
from . import _config, _kernels  # noqa: F401
from ._config import KERNELS, argument_types

try:
    import fcntl
except ImportError:  # pragma: no cover - not on POSIX: no lock files
    fcntl = None  # type: ignore[assignment]


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
    # Where Numba caches the kernels; None when it cannot cache them (they
    # are then compiled in every process) or runs without the JIT.
    cache_dir: str | None = None

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
        pending = [
            index
            for index, (dispatcher, _) in enumerate(KERNELS)
            if hasattr(dispatcher, "compile") and index not in _closed
        ]
        before = {index: _counts(index) for index in pending}
        workers = _usable_cpus() if processes is None else processes
        compiled = _fill_cache(pending, workers)
        for index, (dispatcher, signatures) in enumerate(KERNELS):
            name = getattr(dispatcher, "__name__", repr(dispatcher))
            # A kernel another process is compiling: wait for it, then load it.
            # One already closed is ready: no lock file to open.
            lock = _kernel_lock(dispatcher, wait=True) if index in before else None
            with lock or nullcontext():
                hows = [_make_ready(index, s, before.get(index)) for s in signatures]
            for signature, how in zip(signatures, hows):
                if index in compiled:
                    how = "compiled"  # here or by a worker, for this warmup
                done.append(CompiledKernel(name, signature, how))
            if hasattr(dispatcher, "disable_compile"):
                dispatcher.disable_compile()
                _closed.add(index)
    processes_used = len(set(compiled.values())) or 1
    seconds = time.perf_counter() - start
    return WarmupReport(tuple(done), seconds, processes_used, cache_dir())


def cache_dir() -> str | None:
    """The directory Numba caches ptrres's kernels in, or None if it cannot."""
    if _config.cache_refused is not None or not KERNELS:
        return None
    stats = getattr(KERNELS[0][0], "stats", None)  # None without the JIT
    return getattr(stats, "cache_path", None)


# Kernels that warmup() has closed to new specialisations (indices in KERNELS).
_closed: set[int] = set()
_lock = threading.Lock()


def _counts(index: int) -> tuple[dict[Any, int], dict[Any, int]]:
    """A kernel's cache hits and misses so far, by argument types."""
    stats = KERNELS[index][0].stats
    return dict(stats.cache_hits), dict(stats.cache_misses)


def _make_ready(
    index: int, signature: str, before: tuple[dict[Any, int], dict[Any, int]] | None
) -> str:
    """Compile or load one signature of a kernel; say which it was since
    ``before``: its _counts() when this warmup began (None: it was closed),
    which this brings up to date."""
    dispatcher = KERNELS[index][0]
    if not hasattr(dispatcher, "compile"):  # NUMBA_DISABLE_JIT=1: plain Python
        return "interpreted"
    if before is None:
        return "ready"
    # Numba counts hits and misses by the signature as compile() was given
    # it: the argument types, as a call that compiles on first use gives them.
    key = argument_types(signature)
    dispatcher.compile(key)  # loads, or compiles, unless it is in memory
    hits, misses = _counts(index)
    how = "ready"
    if hits.get(key, 0) > before[0].get(key, 0):
        how = "loaded"  # now, or by _fill_cache in this warmup
    elif misses.get(key, 0) > before[1].get(key, 0):
        how = "compiled"
    before[0][key] = hits.get(key, 0)
    before[1][key] = misses.get(key, 0)
    return how


# The longest warmup() waits for another process to compile a kernel (or a
# worker to finish) before it compiles the kernel itself.
WORKER_TIMEOUT = 600.0
# How often a process waiting for another's compile looks at its lock.
_POLL_SECONDS = 0.005


@contextmanager
def _kernel_lock(dispatcher: Any, *, wait: bool) -> Iterator[bool]:
    """Hold the lock file of a kernel's cache entry; yield whether it is held.

    One lock per kernel, not per signature: Numba rewrites a kernel's whole
    cache index when it saves a signature, so two processes saving two
    signatures of one kernel at once could lose one. Where nothing can be
    locked (no cache, a read-only cache, not POSIX), it yields True: the
    kernel is then compiled as without a lock. ``wait`` gives up after
    WORKER_TIMEOUT and yields True: nothing is lost but time.
    """
    path = _lock_path(dispatcher)
    try:
        if path is None or fcntl is None:
            raise OSError("nothing to lock")
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:
        yield True
        return
    try:
        deadline = time.monotonic() + WORKER_TIMEOUT
        while True:
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not wait:
                    yield False
                    return
                if time.monotonic() > deadline:
                    break  # the holder hangs: compile it anyway
                time.sleep(_POLL_SECONDS)
        yield True
    finally:
        os.close(descriptor)  # which releases the lock


def _lock_path(dispatcher: Any) -> str | None:
    """The lock file of a kernel: in the cache directory, beside its entry."""
    stats = getattr(dispatcher, "stats", None)
    directory = getattr(stats, "cache_path", None)
    if directory is None or _config.cache_refused is not None:
        return None
    name = f"{dispatcher.py_func.__module__}.{dispatcher.__name__}"
    return os.path.join(directory, f"{name}.ptrres-lock")


def _fill_cache(pending: list[int], processes: int) -> dict[int, int]:
    """Compile the ``pending`` kernels not in the cache, in ``processes``
    processes at once: this one and workers (_start_workers).

    Every process takes the kernels one at a time, costliest first, from one
    queue (a pipe). It compiles a kernel if it gets its lock (a cached kernel
    then loads, which costs little); a kernel another process is compiling
    is left to it. A worker that cannot start or fails leaves its kernel to
    this process, which makes every kernel ready afterwards: nothing is lost
    but time.

    Returns:
        For each kernel index compiled here or by a worker, the process that
        compiled it: 0 for this one, 1 and up for workers.
    """
    if processes < 2 or _config.cache_refused is not None:
        return {}
    missing = [i for i in pending if not _probably_cached(KERNELS[i][0])]
    if len(missing) < 2:
        return {}
    order = sorted(missing, key=lambda i: -_cost(KERNELS[i][0]))
    queue_out, queue_in = os.pipe()
    done_out, done_in = os.pipe()
    # One byte per kernel: reads of one byte from a pipe never interleave.
    os.write(queue_in, bytes(order[:255]))
    os.close(queue_in)  # else no reader would ever see the queue end
    workers = _start_workers(min(processes, len(order), 256) - 1, queue_out, done_in)
    os.close(done_in)
    compiled = {}
    try:
        for index in chain(_queued(queue_out), order[255:]):
            if _compile_if_free(index):
                compiled[index] = 0
    finally:  # even if a compile here fails: no worker is left behind
        os.close(queue_out)
        _reap(workers)
        with os.fdopen(done_out, "rb") as done:
            report = done.read()
    for index, worker in zip(report[::2], report[1::2]):
        compiled[index] = worker
    return compiled


def _compile_if_free(index: int) -> bool:
    """Compile (or load) every signature of kernel ``index`` unless another
    process is compiling it; say whether this one compiled any."""
    dispatcher, signatures = KERNELS[index]
    misses: int = sum(dispatcher.stats.cache_misses.values())
    with _kernel_lock(dispatcher, wait=False) as held:
        if held:
            for signature in signatures:
                dispatcher.compile(argument_types(signature))
    return bool(sum(dispatcher.stats.cache_misses.values()) > misses)


def _probably_cached(dispatcher: Any) -> bool:
    """Whether Numba's cache seems to hold a kernel: its index file is there,
    and newer than the kernel's source.

    Numba names a function's index ``<module>.<function>-<line>.py<XY>.nbi``
    in its cache directory (``stats.cache_path``). This only decides whether
    to start workers: an index that lacks a signature (another CPU, say) has
    it compiled here, as without workers.
    """
    directory = dispatcher.stats.cache_path
    function = dispatcher.py_func
    module = function.__module__.rpartition(".")[2]
    prefix = f"{module}.{function.__qualname__}-"
    suffix = f".py{sys.version_info[0]}{sys.version_info[1]}.nbi"
    try:
        source = os.stat(function.__code__.co_filename).st_mtime
        with os.scandir(directory) as entries:
            return any(
                entry.name.startswith(prefix)
                and entry.name.endswith(suffix)
                and entry.stat().st_mtime >= source
                for entry in entries
            )
    except (OSError, TypeError):  # no cache directory yet, or none at all
        return False


def _serve(queue: int, done: int, worker: int) -> None:
    """A worker's work: compile queued kernels, report each (index, worker)."""
    for index in _queued(queue):
        if _compile_if_free(index):
            os.write(done, bytes([index, worker]))


def _queued(queue: int) -> Iterator[int]:
    """The indices read one at a time from a queue pipe, until it is empty."""
    while index := os.read(queue, 1):
        yield index[0]


def can_fork() -> bool:
    """Whether workers may be forks: on Linux, with no other Python thread.

    A fork copies whatever locks other threads hold, and a Python thread may
    hold one the worker needs (the compiler's, an import's). Native pools
    (numpy's BLAS threads start at import) idle on condition variables and
    hold none that a compiling worker takes.
    """
    return sys.platform == "linux" and threading.active_count() == 1


# An interpreter worker: import ptrres, check that its kernels are this
# process's, and serve the queue. Errors go to its stderr, which is dropped.
_WORKER = """
import json, sys
sys.path.insert(0, sys.argv[1])
from ptrres import _warmup
names = [dispatcher.__name__ for dispatcher, _ in _warmup.KERNELS]
if names == json.loads(sys.argv[2]):
    _warmup._serve(*map(int, sys.argv[3:6]))
"""


def _start_workers(count: int, queue: int, done: int) -> list[Any]:
    """Start up to ``count`` workers serving the queue: forks (os.fork()
    pids) where can_fork(), else fresh interpreters (Popen objects), which
    start about 0.6 s later. Those that cannot start are left out."""
    workers: list[Any] = []
    names = json.dumps([dispatcher.__name__ for dispatcher, _ in KERNELS])
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for worker in range(1, count + 1):
        try:
            if can_fork():
                with warnings.catch_warnings():
                    # Python 3.12 warns of any fork of a process with native
                    # threads, such as numpy's BLAS pool (see can_fork).
                    warnings.simplefilter("ignore", DeprecationWarning)
                    pid = os.fork()
                if pid == 0:  # a worker: compile, and leave without cleaning up
                    status = 1
                    try:
                        _serve(queue, done, worker)
                        status = 0
                    finally:
                        os._exit(status)
                workers.append(pid)
            elif os.name == "posix" and sys.executable:
                arguments = [package_parent, names, str(queue), str(done), str(worker)]
                workers.append(
                    subprocess.Popen(
                        [sys.executable, "-c", _WORKER, *arguments],
                        stdin=subprocess.DEVNULL,
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                        pass_fds=(queue, done),
                    )
                )
        except OSError:
            break
    return workers


def _reap(workers: list[Any]) -> None:
    """Wait for every worker to end, killing one that outlives WORKER_TIMEOUT."""
    deadline = time.monotonic() + WORKER_TIMEOUT
    for worker in workers:
        if isinstance(worker, subprocess.Popen):
            try:
                worker.wait(max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
            continue
        while os.waitpid(worker, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(worker, signal.SIGKILL)
                os.waitpid(worker, 0)
                break
            time.sleep(_POLL_SECONDS)


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


def _usable_cpus() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1
