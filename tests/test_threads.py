"""One PointerTable shared by threads gives every thread the reference's answers.

The kernels run without the GIL, so calls of different threads really overlap
(another thread progresses while a kernel runs); the table's one piece of
state, the offloaded layout it last planned with, is replaced by whichever
thread planned last.
"""

from __future__ import annotations

import itertools
import random
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from conftest import JIT_DISABLED, dtype_of, random_tensor, row_stride, zeros

import ptrres
from ptrres import reference

N_THREADS = 8
CALLS_PER_THREAD = 40 if JIT_DISABLED else 1500


def longest_stall(call: Callable[[], Any]) -> float:
    """The longest time, as a share of call()'s, that another thread made no
    progress while call() ran in this thread.

    The other thread sleeps a tenth of a millisecond at a time, and notes the
    time each time it wakes; waking, it needs the GIL. A kernel that holds
    the GIL stalls it for the whole kernel; one that releases it stalls it
    for the Python around the kernel only (a free core is not needed: the
    thread mostly sleeps).
    """
    stamps: list[float] = []
    stop = threading.Event()

    def tick() -> None:
        while not stop.is_set():
            time.sleep(1e-4)
            stamps.append(time.perf_counter())

    ticker = threading.Thread(target=tick)
    ticker.start()
    try:
        while not stamps:  # the ticker is running
            time.sleep(1e-3)
        start = time.perf_counter()
        call()
        end = time.perf_counter()
    finally:
        stop.set()
        ticker.join()
    seen = [start, *(t for t in stamps if start < t < end), end]
    return max(b - a for a, b in itertools.pairwise(seen)) / (end - start)


def long_calls() -> dict[str, Callable[[], Any]]:
    """A call of each public function that runs one kernel for tens of ms."""
    rng = np.random.default_rng(0)
    n_ids, n_refs, n_blocks = 500_000, 8, 1000
    tensor = zeros(n_blocks, 16)
    kv = ptrres.CanonicalKVCaches(
        [ptrres.CanonicalKVCacheTensor(tensor, 16)],
        [[ptrres.CanonicalKVCacheRef(0, 16)] * n_refs],
    )
    table = ptrres.PointerTable(kv)
    offloaded = ptrres.OffloadedLayout([zeros(n_blocks, 16)], 1)
    spec = ptrres.GPULoadStoreSpec(rng.integers(0, n_blocks, n_ids), [n_ids], [0])
    chunk_ids = rng.integers(0, n_blocks, n_ids)
    out3 = (
        np.zeros(n_ids * n_refs, np.uint64),
        np.zeros(n_ids * n_refs, np.uint64),
        np.zeros(n_ids * n_refs, np.uint64),
    )
    out = out3
    device_ptrs = table.resolve(spec)

    descriptors = table.plan_transfer(spec, offloaded, chunk_ids, store=True)
    return {
        "resolve": lambda: table.resolve(spec, out=out[:2]),
        "plan_transfer": lambda: table.plan_transfer(
            spec, offloaded, chunk_ids, store=True, out=out
        ),
        "plan_from_device_pointers": lambda: table.plan_from_device_pointers(
            device_ptrs, offloaded, chunk_ids, store=False, out=out
        ),
        "coalesce": lambda: ptrres.coalesce(
            descriptors.src, descriptors.dst, descriptors.sizes, out=out3
        ),
    }


@pytest.fixture
def rare_switching() -> Iterator[None]:
    """Make the interpreter hand the GIL over only when it is let go."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.5)
    yield
    sys.setswitchinterval(interval)


@pytest.mark.skipif(JIT_DISABLED, reason="no compiled kernels without the JIT")
@pytest.mark.usefixtures("rare_switching")
@pytest.mark.parametrize(
    "name", ["resolve", "plan_transfer", "plan_from_device_pointers", "coalesce"]
)
def test_kernels_let_other_threads_run(name: str) -> None:
    """Another thread progresses while a kernel runs (it released the GIL).

    On a busy machine the other thread may not be scheduled in time: the
    best of ten tries counts. A kernel holding the GIL fails every try
    (it stalls the other thread for 88-100% of the call).
    """
    call = long_calls()[name]
    call()  # compiled, and memory touched
    stalls = []
    for _ in range(10):
        stalls.append(longest_stall(call))
        if stalls[-1] < 0.5:
            return
    pytest.fail(f"{name}: another thread stalled for {stalls} of the call")


@pytest.fixture
def fast_switching() -> Iterator[None]:
    """Switch threads as often as CPython allows, to make races likely."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(interval)


def build_calls() -> list[tuple[Callable[..., Any], Any]]:
    """(call, expected) pairs over one table; expected is an array tuple or an error.

    Each call takes the thread's out= buffers (or None) and returns arrays.
    """
    tensors = [random_tensor(40, 16, t % 2, dtype_of("int8"), t) for t in range(3)]
    kv = ptrres.CanonicalKVCaches(
        [ptrres.CanonicalKVCacheTensor(t, row_stride(t)) for t in tensors],
        [
            [ptrres.CanonicalKVCacheRef(0, 16), ptrres.CanonicalKVCacheRef(1, 16)],
            [ptrres.CanonicalKVCacheRef(2, 8)],
        ],
    )
    table = ptrres.PointerTable(kv)
    offloaded = {
        bpc: [zeros(64, bpc * 16 + pad) for _ in range(3)]
        for bpc, pad in ((1, 0), (2, 0), (4, 8))
    }
    layouts = {bpc: ptrres.OffloadedLayout(t, bpc) for bpc, t in offloaded.items()}
    rng = np.random.default_rng(0)
    calls: list[tuple[Callable[..., Any], Any]] = []
    for _ in range(12):
        sizes = [int(rng.integers(0, 30)), int(rng.integers(0, 30))]
        start = int(rng.integers(0, 10))
        ids = np.concatenate(
            [start + np.arange(sizes[0]), rng.integers(0, 40, sizes[1])]
        ).astype([np.int32, np.int64][int(rng.integers(2))])
        spec = ptrres.GPULoadStoreSpec(ids, sizes, [int(rng.integers(0, 9)), 3])
        expected = reference.resolve_device_pointers(spec, kv)
        calls.append(
            (
                lambda out, spec=spec: astuple(table.resolve(spec, out=pair(out)), 2),
                (expected.ptrs, expected.sizes),
            )
        )
        for bpc, layout in layouts.items():
            n_chunks = sum(
                -(-(n + i % bpc) // bpc) if n else 0
                for n, i in zip(spec.group_sizes, spec.block_indices)
            )
            chunk_ids = rng.permutation(64)[:n_chunks]
            for store in (True, False):
                plan = reference.plan_transfer(
                    spec, kv, offloaded[bpc], bpc, chunk_ids, store=store
                )
                merged = reference.coalesce(plan.src, plan.dst, plan.sizes)

                def run_plan(
                    out: Any, merge: bool, spec: Any = spec, layout: Any = layout,
                    chunk_ids: Any = chunk_ids, store: bool = store,
                ) -> tuple[np.ndarray, ...]:  # fmt: skip
                    result = table.plan_transfer(
                        spec, layout, chunk_ids, store=store, coalesce=merge, out=out
                    )
                    return astuple(result, 3)

                calls.append(
                    (
                        lambda out, run_plan=run_plan: run_plan(out, False),
                        (plan.src, plan.dst, plan.sizes),
                    )
                )
                calls.append(
                    (
                        lambda out, run_plan=run_plan: run_plan(out, True),
                        (merged.src, merged.dst, merged.sizes),
                    )
                )
    # A call that fails in the kernel: it must not disturb the other threads.
    bad = ptrres.GPULoadStoreSpec([3, 40], [1, 1], [0, 0])
    calls.append((lambda out: table.resolve(bad, out=pair(out)), ptrres.BlockIdError))
    return calls


def pair(out: Any) -> Any:
    """The (ptrs, sizes) buffers of resolve() among a thread's three."""
    return None if out is None else out[:2]


def astuple(result: Any, n: int) -> tuple[np.ndarray, ...]:
    fields = ("ptrs", "sizes") if n == 2 else ("src", "dst", "sizes")
    return tuple(getattr(result, name).copy() for name in fields)


@pytest.mark.usefixtures("fast_switching")
def test_threads_sharing_a_table_get_the_reference_answers() -> None:
    calls = build_calls()
    barrier = threading.Barrier(N_THREADS)
    failures: list[str] = []
    done = [0] * N_THREADS

    def worker(thread: int) -> None:
        rng = random.Random(thread)
        out = tuple(np.zeros(4 * 30 * 3, np.int64) for _ in range(3))
        barrier.wait()
        for _ in range(CALLS_PER_THREAD):
            index = rng.randrange(len(calls))
            call, expected = calls[index]
            buffers = out if rng.random() < 0.5 else None
            try:
                if isinstance(expected, type):
                    with pytest.raises(expected):
                        call(buffers)
                else:
                    actual = call(buffers)
                    assert len(actual) == len(expected)
                    for a, e in zip(actual, expected):
                        np.testing.assert_array_equal(a, e)
            except BaseException as exc:  # collected, reported by the main thread
                failures.append(f"thread {thread}, call {index}: {exc!r}")
            done[thread] += 1

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(N_THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    assert done == [CALLS_PER_THREAD] * N_THREADS


def test_plan_scratch_is_kept_per_thread_and_fits_the_ids() -> None:
    """The plan kernel writes its scratch: each thread keeps its own, and ids
    past the kept size get a fresh one that fits them."""
    from ptrres._plan import KEPT_SCRATCH_COLUMNS, plan_scratch

    mine = plan_scratch(10)
    assert plan_scratch(20) is mine
    assert mine.shape[1] > 20
    big = plan_scratch(KEPT_SCRATCH_COLUMNS + 5)
    assert big is not mine
    assert big.shape[1] > KEPT_SCRATCH_COLUMNS + 5
    assert plan_scratch(KEPT_SCRATCH_COLUMNS - 1) is mine
    theirs: list[np.ndarray] = []
    thread = threading.Thread(target=lambda: theirs.append(plan_scratch(10)))
    thread.start()
    thread.join()
    assert theirs[0] is not mine
    assert not np.shares_memory(theirs[0], mine)
