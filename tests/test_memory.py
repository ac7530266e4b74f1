"""Calls leave no allocation behind: neither a million resolves nor failed calls.

Each measure runs a warm-up batch (a tenth of its calls), then takes the
process's resident memory (RSS), the number of blocks Python's allocator holds
and, where it is on, what tracemalloc traces (numpy's array data included);
runs the calls; and takes them again. The slack allowed is a tenth of what a
leak of LEAK bytes per call would add (RSS: at least 1 MiB, its page and
arena granularity). test_the_measures_catch_a_small_leak shows that such a
leak fails the allocator's blocks and tracemalloc; RSS is the coarse measure
(small objects can fill free space the heap already holds, which RSS does not
see), kept for leaks outside Python's allocators. tracemalloc slows every
allocation about fivefold, so it watches a tenth of the million; RSS and the
allocator's blocks watch all of it.
"""

from __future__ import annotations

import gc
import os
import sys
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
from conftest import JIT_DISABLED, dtype_of, random_tensor

import ptrres

LEAK = 100  # bytes per call that every measure must catch
# Without the JIT each call runs the kernel in Python, some 20x slower.
CALLS = 20_000 if JIT_DISABLED else 1_000_000
TRACED_CALLS = CALLS // 10
FAILING_CALLS = 1_000 if JIT_DISABLED else 5_000


pytestmark = pytest.mark.skipif(
    not os.path.exists("/proc/self/statm"), reason="reads RSS from /proc (Linux)"
)


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@dataclass
class Growth:
    """What n calls added: RSS, allocator blocks, traced bytes (or None)."""

    calls: int
    rss: int
    blocks: int
    traced: int | None

    def excess(self) -> set[str]:
        """The measures that grew by more than a tenth of a LEAK-per-call leak."""
        leak = self.calls * LEAK
        over = set()
        if self.rss > max(1 << 20, leak // 10):
            over.add("rss")
        if self.blocks > self.calls // 10:  # a leak of LEAK bytes is >= 1 block
            over.add("blocks")
        if self.traced is not None and self.traced > leak // 10:
            over.add("traced")
        return over


def growth(call: Callable[[], object], calls: int, *, traced: bool) -> Growth:
    """Run ``call`` a tenth as many times, then measure what ``calls`` more add."""
    if traced:
        tracemalloc.start()
    try:
        for _ in range(max(calls // 10, 100)):
            call()
        gc.collect()
        rss, blocks = rss_bytes(), sys.getallocatedblocks()
        bytes_traced = tracemalloc.get_traced_memory()[0] if traced else 0
        for _ in range(calls):
            call()
        gc.collect()
        return Growth(
            calls,
            rss_bytes() - rss,
            sys.getallocatedblocks() - blocks,
            tracemalloc.get_traced_memory()[0] - bytes_traced if traced else None,
        )
    finally:
        if traced:
            tracemalloc.stop()


def failing(call: Callable[[], object], error: type[Exception]) -> Callable[[], None]:
    def expect_error() -> None:
        try:
            call()
        except error:
            return
        raise AssertionError(f"{call} did not raise {error.__name__}")

    return expect_error


Setup = tuple[ptrres.PointerTable, ptrres.OffloadedLayout]


@pytest.fixture(scope="module")
def setup() -> Setup:
    tensors = [random_tensor(16, 32, 0, dtype_of("int8"), t) for t in range(2)]
    kv = ptrres.CanonicalKVCaches(
        [ptrres.CanonicalKVCacheTensor(t, 32) for t in tensors],
        [[ptrres.CanonicalKVCacheRef(0, 32), ptrres.CanonicalKVCacheRef(1, 32)]],
    )
    offloaded = ptrres.OffloadedLayout([np.zeros((8, 64), np.int8)] * 2, 2)
    return ptrres.PointerTable(kv), offloaded


def small_resolve(table: ptrres.PointerTable) -> Callable[[], object]:
    spec = ptrres.GPULoadStoreSpec(np.array([3]), [1], [0])
    out = (np.empty(2, np.int64), np.empty(2, np.uint64))
    return lambda: table.resolve(spec, out=out)


def test_a_million_resolves_leave_nothing_behind(setup: Setup) -> None:
    table, _ = setup
    untraced = growth(small_resolve(table), CALLS, traced=False)
    print(untraced)
    assert untraced.excess() == set()
    traced = growth(small_resolve(table), TRACED_CALLS, traced=True)
    print(traced)
    assert traced.excess() == set()


def test_failed_calls_leave_nothing_behind(setup: Setup) -> None:
    table, offloaded = setup
    out = tuple(np.empty(4, np.int64) for _ in range(3))
    bad_block = ptrres.GPULoadStoreSpec(np.array([3, 16]), [2], [0])
    good = ptrres.GPULoadStoreSpec(np.array([3, 4]), [2], [0])
    bad_spec = ptrres.GPULoadStoreSpec(np.array([3, 4]), [3], [0])
    calls = {
        "block id": failing(
            lambda: table.resolve(bad_block, out=out[:2]), ptrres.BlockIdError
        ),
        "offloaded id": failing(
            lambda: table.plan_transfer(good, offloaded, [9], store=True, out=out),
            ptrres.OffloadedIdError,
        ),
        "spec": failing(lambda: table.resolve(bad_spec, out=out[:2]), ptrres.SpecError),
    }
    for kind, call in calls.items():
        measured = growth(call, FAILING_CALLS, traced=True)
        print(kind, measured)
        assert measured.excess() == set(), kind


def test_the_measures_catch_a_small_leak(setup: Setup) -> None:
    table, _ = setup
    leaked: list[bytes] = []
    resolve = small_resolve(table)

    def leaky() -> None:
        resolve()
        leaked.append(bytes(LEAK - sys.getsizeof(b"")))  # LEAK bytes in all

    # As many calls as the failed-call measures, then as the million's
    # (a tenth of it with the JIT, to save time: the slack scales with it).
    measured = growth(leaky, FAILING_CALLS, traced=True)
    assert {"blocks", "traced"} <= measured.excess(), measured
    leaked.clear()
    measured = growth(leaky, max(CALLS // 10, 20_000), traced=False)
    assert "blocks" in measured.excess(), measured
