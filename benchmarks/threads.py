"""Two threads resolving large transfers, against one thread doing the same work.

The kernels run without the GIL (JIT_OPTIONS["nogil"]), so two threads of a
serving process resolve at once. Each thread resolves its half of the calls
into its own pair of out= buffers, on one shared PointerTable; one thread
alone makes every call. The figure is throughput(2 threads) / throughput(1
thread), the median over interleaved rounds, for:

- ptrres as it is;
- the resolve kernel compiled to hold the GIL, to show what nogil buys;
- a control: a pure-arithmetic nogil loop that touches no memory, which says
  how many of the two cores the machine gave us meanwhile (shared machines).

Run: python benchmarks/threads.py [--quick] [--blocks 16384] [--preset NAME]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numba
import numpy as np

import ptrres
from ptrres import _kernels
from ptrres._config import JIT_OPTIONS
from ptrres.bench import PRESETS, make_spec


def run_threads(n_threads: int, calls: int, call: Callable[[int], object]) -> float:
    """Seconds for n_threads threads to make ``calls`` calls between them."""
    barrier = threading.Barrier(n_threads + 1)
    share = calls // n_threads

    def work(thread: int) -> None:
        barrier.wait()
        for _ in range(share):
            call(thread)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(n_threads)]
    for thread in threads:
        thread.start()
    barrier.wait()
    start = time.perf_counter()
    for thread in threads:
        thread.join()
    return time.perf_counter() - start


# The resolve kernel compiled to hold the GIL, for comparison.
GIL_HOLDING_RESOLVE = numba.njit(**dict(JIT_OPTIONS, nogil=False, cache=False))(
    _kernels.resolve_kernel.py_func
)


@contextmanager
def gil_held_resolve_kernel() -> Iterator[None]:
    """Make PointerTable.resolve call the GIL-holding kernel meanwhile."""
    original = _kernels.resolve_kernel
    _kernels.resolve_kernel = GIL_HOLDING_RESOLVE
    try:
        yield
    finally:
        _kernels.resolve_kernel = original


@numba.njit(nogil=True)
def spin(steps: int) -> int:
    """Arithmetic only: two threads of it run twice as fast on two free cores."""
    state = 0
    for _ in range(steps):
        state = (state * 1103515245 + 12345) & 0xFFFFFFFF
    return state


def calibrated_calls(call: Callable[[int], object], seconds: float) -> int:
    """An even number of calls that takes about ``seconds`` in one thread."""
    call(0)
    start = time.perf_counter()
    call(0)
    elapsed = time.perf_counter() - start
    return max(2, 2 * round(seconds / elapsed / 2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--blocks", type=int, default=16384)
    parser.add_argument("--preset", default="llama-3.1-8b-split")
    args = parser.parse_args()
    ptrres.warmup()
    rounds, seconds = (3, 0.1) if args.quick else (11, 0.25)

    preset = PRESETS[args.preset]
    table = ptrres.PointerTable(preset.kv_caches())
    spec = make_spec(preset, args.blocks)
    n_ops = args.blocks * preset.num_refs
    # One (ptrs, sizes) pair per thread.
    buffers = [(np.empty(n_ops, np.int64), np.empty(n_ops, np.int64)) for _ in "ab"]

    def resolve(thread: int) -> object:
        return table.resolve(spec, out=buffers[thread])

    with gil_held_resolve_kernel():
        resolve(0)  # compile the GIL-holding variant now
        calls = calibrated_calls(resolve, seconds)
    spin_steps = 1_000_000
    spin_calls = calibrated_calls(lambda _: spin(spin_steps), seconds)
    print(
        f"{args.preset}: {args.blocks} blocks x {preset.num_refs} refs = {n_ops} "
        f"ops per call, {calls} calls per measure, {rounds} interleaved rounds"
    )

    ratios: dict[str, list[float]] = {"ptrres": [], "GIL held": [], "control": []}
    for _ in range(rounds):
        for label, ratio in ratios.items():
            if label == "control":
                call: Callable[[int], object] = lambda _: spin(spin_steps)  # noqa: E731
                n = spin_calls
            else:
                call, n = resolve, calls
            if label == "GIL held":
                with gil_held_resolve_kernel():
                    ratio.append(run_threads(1, n, call) / run_threads(2, n, call))
            else:
                ratio.append(run_threads(1, n, call) / run_threads(2, n, call))
    print("throughput of 2 threads / 1 thread (median, min-max):")
    for label, values in ratios.items():
        print(
            f"  {label:<9} {statistics.median(values):5.2f}"
            f"  ({min(values):.2f}-{max(values):.2f})"
        )


if __name__ == "__main__":
    main()
