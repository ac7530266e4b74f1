"""Runs both ways, one allocation per copy (SPEC 6).

Coalesced plans are the reference's coalescing of the plain plan, where a
run may ascend or descend, and never passes from one allocation into
another: checked on id streams made of ascending and descending runs,
repeats and gaps, on layouts whose tensors are separate allocations or views
of one buffer, and on two buffers that really lie next to each other.
"""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from conftest import as_tensor, data_ptr, itemsize, row_stride, with_torch, zeros
from hypothesis import example, given
from hypothesis import strategies as st

import ptrres
from ptrres import reference

FLAT = ("src", "dst", "sizes")


def assert_same(actual: Any, expected: Any) -> None:
    for name in FLAT:
        np.testing.assert_array_equal(
            getattr(actual, name), getattr(expected, name), err_msg=name
        )
    assert actual.num_bytes == expected.num_bytes


@st.composite
def paired_runs(draw: Any, limit: int, max_pieces: int = 5) -> tuple[list[int], ...]:
    """Device ids and offloaded ids, paired: ascending runs, descending runs
    (as eviction order hands them out), repeats and gaps, each run moving
    both sides the same way or not."""
    device: list[int] = []
    offloaded: list[int] = []
    for _ in range(draw(st.integers(1, max_pieces))):
        kind = draw(st.sampled_from(["up", "down", "down", "repeat", "mixed", "gap"]))
        length = draw(st.integers(1, 5))
        d0 = draw(st.integers(0, limit - 1))
        o0 = draw(st.integers(0, limit - 1))
        for k in range(length):
            if kind == "up":
                d, o = d0 + k, o0 + k
            elif kind == "down":
                d, o = d0 - k, o0 - k
            elif kind == "repeat":
                d, o = d0, o0
            elif kind == "mixed":  # the sides go opposite ways
                d, o = d0 + k, o0 - k
            else:
                d, o = d0 + 2 * k, o0 + k
            device.append(d % limit)
            offloaded.append(o % limit)
    return device, offloaded


@dataclass
class Layout:
    kv_caches: ptrres.CanonicalKVCaches
    offloaded_tensors: list[Any]  # torch tensors, or numpy arrays without torch
    # Per ref of the one group, in order: which allocation pair it copies
    # between (what reference.coalesce takes as allocations, per descriptor).
    ref_allocations: list[int]


def direct_layout(
    refs: list[int], n_blocks: int, page: int, pads: list[int], one_buffer: bool
) -> Layout:
    """A tensor per entry of ``pads``: n_blocks rows of ``page`` + pad bytes
    (offloaded: rows of the same, one block per chunk), each its own
    allocation or all views of one buffer laid back to back; one group whose
    refs are on tensors ``refs``, each copying ``page`` bytes a block (torch
    tensors, or numpy arrays of numpy's random bytes without torch)."""
    seed = len(pads) * 1000 + n_blocks
    if not with_torch():
        rng = np.random.default_rng(seed)

    def tensors() -> list[Any]:
        sizes = [n_blocks * (page + pad) for pad in pads]
        if not with_torch():
            if one_buffer:
                flat = rng.integers(0, 256, sum(sizes), np.uint8).view(np.int8)
                arrays = np.split(flat, np.cumsum(sizes)[:-1])
            else:
                arrays = [
                    rng.integers(0, 256, size, np.uint8).view(np.int8) for size in sizes
                ]
            return [
                array.reshape(n_blocks, page + pad)[:, :page]
                for array, pad in zip(arrays, pads)
            ]
        if one_buffer:
            buffer = torch.randint(
                0, 256, (sum(sizes),), dtype=torch.uint8, generator=generator
            ).view(torch.int8)
            pieces = list(torch.split(buffer, sizes))
        else:
            pieces = [
                torch.randint(
                    0, 256, (size,), dtype=torch.uint8, generator=generator
                ).view(torch.int8)
                for size in sizes
            ]
        return [
            piece.view(n_blocks, page + pad)[:, :page]
            for piece, pad in zip(pieces, pads)
        ]

    if with_torch():
        import torch

        generator = torch.Generator().manual_seed(seed)
    device = tensors()
    kv = ptrres.CanonicalKVCaches(
        [ptrres.CanonicalKVCacheTensor(t, row_stride(t)) for t in device],
        [[ptrres.CanonicalKVCacheRef(t, page) for t in refs]],
    )
    allocations = [0 if one_buffer else t for t in refs]
    return Layout(kv, tensors(), allocations)


def per_descriptor(ref_allocations: list[int], n_blocks: int) -> np.ndarray:
    """The allocation of each descriptor of a one-group plan (ref -> block)."""
    return np.repeat(np.array(ref_allocations, np.int64), n_blocks)


@given(
    st.lists(st.sampled_from([0, 0, 0, 8]), min_size=1, max_size=3),
    st.lists(st.integers(0, 2), min_size=1, max_size=4),
    st.sampled_from([2, 3, 12]),
    st.booleans(),
    st.booleans(),
    st.sampled_from([None, 16, 40, 64]),
    st.data(),
)
@example(
    pads=[0], ref_tensors=[0], n_blocks=12, one_buffer=False, store=True,
    max_run_bytes=None, data=None,
)  # fmt: skip
def test_coalesced_plan_is_the_reference_both_ways(
    pads: list[int],
    ref_tensors: list[int],
    n_blocks: int,
    one_buffer: bool,
    store: bool,
    max_run_bytes: int | None,
    data: Any,
) -> None:
    """Refs on tensors whose pages fill their rows or not (padding), in any
    order, on separate allocations or on one buffer back to back, where
    runs pass from the last block of one tensor into the first of the next
    (or downwards, from the first into the last of the one before)."""
    page = 8
    if data is None:  # vLLM PR #56110's eviction order: GPU 40, 39, 38 -> 12, 11, 10
        device, offloaded = [10, 9, 8], [6, 5, 4]
    else:
        device, offloaded = data.draw(paired_runs(n_blocks))
    refs = [t % len(pads) for t in ref_tensors]
    layout = direct_layout(refs, n_blocks, page, pads, one_buffer)
    spec = ptrres.GPULoadStoreSpec(np.array(device, np.int64), [len(device)], [0])
    chunks = np.array(offloaded, np.int64)
    planned = reference.plan_transfer(
        spec, layout.kv_caches, layout.offloaded_tensors, 1, chunks, store=store
    )
    expected = reference.coalesce(
        planned.src,
        planned.dst,
        planned.sizes,
        max_run_bytes=max_run_bytes,
        allocations=per_descriptor(layout.ref_allocations, len(device)),
    )
    table = ptrres.PointerTable(layout.kv_caches)
    offloaded_layout = ptrres.OffloadedLayout(layout.offloaded_tensors, 1)
    plan = table.plan_transfer(
        spec, offloaded_layout, chunks, store=store, coalesce=True,
        max_run_bytes=max_run_bytes,
    )  # fmt: skip
    assert_same(plan, expected)
    # The same through coalesce(), told the allocations.
    standalone = ptrres.coalesce(
        planned.src,
        planned.dst,
        planned.sizes,
        max_run_bytes=max_run_bytes,
        allocations=per_descriptor(layout.ref_allocations, len(device)),
    )
    assert_same(standalone, expected)
    # And through the canonical kernel: whole-page mappings, one writer.
    mapping = ptrres.CanonicalPageMapping(
        page, page, (ptrres.CopyRun(0, 0, page, 1, page, page),), 1, 0, True
    )  # (the offloaded rows hold canonical pages of page + pad bytes)
    canonical = ptrres.CanonicalKVCaches(
        layout.kv_caches.tensors,
        [[ptrres.CanonicalKVCacheRef(t, page, mapping) for t in refs]],
    )
    canonical_layout = ptrres.OffloadedLayout(
        layout.offloaded_tensors, 1, canonical=True
    )
    flat = ptrres.PointerTable(canonical).plan_transfer(
        spec, canonical_layout, chunks, store=store, coalesce=True,
        max_run_bytes=max_run_bytes,
    )  # fmt: skip
    assert_same(flat, expected)


def test_descending_ids_merge_into_one_copy_from_the_lowest_block() -> None:
    """GPU blocks 40, 39, 38 to CPU blocks 12, 11, 10: one copy of 38-40 to
    10-12 per layer, where the plain plan has three."""
    page = 64
    device = [zeros(48, page) for _ in range(2)]
    cpu = [zeros(16, page) for _ in range(2)]
    kv = ptrres.CanonicalKVCaches(
        [ptrres.CanonicalKVCacheTensor(t, page) for t in device],
        [[ptrres.CanonicalKVCacheRef(i, page) for i in range(2)]],
    )
    spec = ptrres.GPULoadStoreSpec(np.array([40, 39, 38], np.int32))
    plan = ptrres.PointerTable(kv).plan_transfer(
        spec, ptrres.OffloadedLayout(cpu, 1), np.array([12, 11, 10]), store=True,
        coalesce=True,
    )  # fmt: skip
    assert plan.src.tolist() == [data_ptr(t) + 38 * page for t in device]
    assert plan.dst.tolist() == [data_ptr(t) + 10 * page for t in cpu]
    assert plan.sizes.tolist() == [3 * page, 3 * page]
    # A load mirrors it; a direction change, a gap or a repeat ends a run.
    load = ptrres.PointerTable(kv).plan_transfer(
        spec, ptrres.OffloadedLayout(cpu, 1), np.array([12, 11, 10]), store=False,
        coalesce=True,
    )  # fmt: skip
    assert load.src.tolist() == plan.dst.tolist()
    assert load.dst.tolist() == plan.src.tolist()
    for ids, chunk_ids, copies in [
        ([40, 39, 38, 39, 40], [12, 11, 10, 11, 12], [3, 2]),  # down, then up
        ([40, 39, 38, 37], [12, 11, 9, 8], [2, 2]),  # a gap on one side
        ([40, 40, 39], [12, 12, 11], [1, 2]),  # a repeat
        ([40, 39, 38], [10, 11, 12], [1, 1, 1]),  # the sides go opposite ways
    ]:
        spec = ptrres.GPULoadStoreSpec(np.array(ids, np.int64))
        plan = ptrres.PointerTable(kv).plan_transfer(
            spec, ptrres.OffloadedLayout(cpu, 1), np.array(chunk_ids), store=True,
            coalesce=True,
        )  # fmt: skip
        assert (plan.sizes // page).tolist() == copies * 2, ids


def test_max_run_bytes_caps_descending_runs() -> None:
    src = np.array([800, 700, 600, 500, 400], np.uint64)
    dst = np.array([150, 50, -50 % 2**64, 0, 0], np.uint64)
    dst[:] = [500, 400, 300, 200, 100]
    sizes = np.full(5, 100, np.uint64)
    merged = ptrres.coalesce(src, dst, sizes, max_run_bytes=250)
    assert merged.src.tolist() == [700, 500, 400]
    assert merged.dst.tolist() == [400, 200, 100]
    assert merged.sizes.tolist() == [200, 200, 100]
    assert_same(merged, reference.coalesce(src, dst, sizes, max_run_bytes=250))


@given(
    st.lists(st.integers(0, 3), min_size=0, max_size=140),
    st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50)), min_size=0, max_size=8),
    st.sampled_from([None, 8, 24, 100]),
)
def test_coalesce_with_allocations_is_the_reference(
    allocation_steps: list[int], pieces: list[tuple[int, int]], cap: int | None
) -> None:
    """Long lists (more than coalesce's spans of 64) of runs both ways, cut
    into allocations."""
    src: list[int] = []
    dst: list[int] = []
    for start, other in pieces:
        way = 1 if (start + other) % 2 else -1
        for k in range(len(allocation_steps) // max(len(pieces), 1) + 1):
            src.append(8 * (100 + start + way * k))
            dst.append(8 * (100 + other + way * k))
    n = len(src)
    allocations = np.cumsum(
        [allocation_steps[k % len(allocation_steps)] == 0 for k in range(n)]
        if allocation_steps
        else np.zeros(n, bool),
        dtype=np.int64,
    )
    arrays = (
        np.array(src, np.uint64),
        np.array(dst, np.uint64),
        np.full(n, 8, np.uint64),
    )
    for given_allocations in (None, allocations):
        expected = reference.coalesce(
            *arrays, max_run_bytes=cap, allocations=given_allocations
        )
        merged = ptrres.coalesce(
            *arrays, max_run_bytes=cap, allocations=given_allocations
        )
        assert_same(merged, expected)
        in_place = tuple(a.copy() for a in arrays)
        merged = ptrres.coalesce(
            *in_place, max_run_bytes=cap, allocations=given_allocations, out=in_place
        )
        assert_same(merged, expected)


def test_allocations_must_be_one_integer_per_descriptor() -> None:
    ops = (np.zeros(3, np.uint64),) * 3
    for module in (ptrres, reference):
        with pytest.raises(ptrres.SpecError, match="allocations has 2 entries"):
            module.coalesce(*ops, allocations=[0, 1])
        with pytest.raises(ptrres.InputTypeError, match="allocations must be"):
            module.coalesce(*ops, allocations=[0.0, 1.0, 2.0])


# Two allocations that really lie next to each other in memory.
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
    ctypes.c_long,
]  # fmt: skip
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FIXED = 0x10


def numpy_at(address: int, size: int) -> np.ndarray:
    """An int8 array over ``size`` bytes at ``address``, owning nothing."""
    return np.frombuffer(
        memoryview((ctypes.c_char * size).from_address(address)), np.int8
    )


@contextmanager
def adjacent_mappings(size: int) -> Iterator[tuple[int, int]]:
    """Two anonymous mappings of ``size`` bytes, the second right after the
    first: the second is mapped over the second half of a reservation."""
    protection = mmap.PROT_READ | mmap.PROT_WRITE
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    first = _libc.mmap(None, 2 * size, protection, flags, -1, 0)
    assert first not in (None, ctypes.c_void_p(-1).value)
    second = _libc.mmap(first + size, size, protection, flags | _MAP_FIXED, -1, 0)
    assert second == first + size
    try:
        yield first, second
    finally:
        _libc.munmap(first, 2 * size)


def test_no_copy_spans_two_adjacent_allocations() -> None:
    """Block 3 (the last) of a tensor in one mapping and block 0 of a tensor
    in the next mapping continue each other on both sides; the plan keeps
    them two copies. As views of one buffer, they merge."""
    page, n_blocks = 4096, 4
    size = page * n_blocks
    with (
        adjacent_mappings(size) as (dev0, dev1),
        adjacent_mappings(size) as (
            off0,
            off1,
        ),
    ):

        def tensor(address: int, blocks: int = n_blocks) -> Any:
            """torch.frombuffer's view of the memory, or numpy's without torch."""
            if not with_torch():
                return numpy_at(address, blocks * page).reshape(blocks, page)
            import torch

            buffer = (ctypes.c_char * (blocks * page)).from_address(address)
            return torch.frombuffer(buffer, dtype=torch.int8).view(blocks, page)

        device = [tensor(dev0), tensor(dev1)]
        cpu = [tensor(off0), tensor(off1)]
        rng = np.random.default_rng(0)
        for t in device + cpu:
            t[:] = as_tensor(rng.integers(-128, 127, t.shape, np.int8))
        # Group 0 copies block 3 of tensor 0, group 1 block 0 of tensor 1.
        refs = [
            [ptrres.CanonicalKVCacheRef(0, page)],
            [ptrres.CanonicalKVCacheRef(1, page)],
        ]
        spec = ptrres.GPULoadStoreSpec(np.array([3, 0]), [1, 1], [0, 0])
        chunks = np.array([3, 0])

        def plan(device: list[Any], cpu: list[Any]) -> Any:
            kv = ptrres.CanonicalKVCaches(
                [ptrres.CanonicalKVCacheTensor(t, page) for t in device], refs
            )
            return ptrres.PointerTable(kv).plan_transfer(
                spec, ptrres.OffloadedLayout(cpu, 1), chunks, store=True,
                coalesce=True,
            )  # fmt: skip

        separate = plan(device, cpu)
        assert separate.sizes.tolist() == [page, page]
        assert separate.src.tolist() == [dev0 + 3 * page, dev1]
        # Addresses alone would have merged them: coalesce() without allocations.
        assert ptrres.coalesce(
            separate.src, separate.dst, separate.sizes
        ).sizes.tolist() == [2 * page]
        # The same memory seen as views of one tensor on each side: one copy.
        joined_device = tensor(dev0, 2 * n_blocks)
        joined_cpu = tensor(off0, 2 * n_blocks)
        views = plan(
            [joined_device[:n_blocks], joined_device[n_blocks:]],
            [joined_cpu[:n_blocks], joined_cpu[n_blocks:]],
        )
        assert views.sizes.tolist() == [2 * page]
        assert views.src.tolist() == [dev0 + 3 * page]
        # numpy arrays: views of one ndarray merge, separate arrays do not.
        halves = numpy_at(dev0, 2 * size).reshape(2 * n_blocks, page)
        halves_cpu = numpy_at(off0, 2 * size).reshape(2 * n_blocks, page)
        merged = plan(
            [halves[:n_blocks], halves[n_blocks:]],
            [halves_cpu[:n_blocks], halves_cpu[n_blocks:]],
        )
        assert merged.sizes.tolist() == [2 * page]
        apart = plan(
            [numpy_at(a, size).reshape(n_blocks, page) for a in (dev0, dev1)],
            [numpy_at(a, size).reshape(n_blocks, page) for a in (off0, off1)],
        )
        assert apart.sizes.tolist() == [page, page]


class _Opaque:
    """A tensor-like object that exposes no storage (duck typing)."""

    def __init__(self, tensor: Any) -> None:  # torch's, or a numpy array
        self._tensor = tensor
        self.shape = tensor.shape

    def data_ptr(self) -> int:
        return data_ptr(self._tensor)

    def stride(self, dim: int) -> int:
        if isinstance(self._tensor, np.ndarray):
            return int(self._tensor.strides[dim]) // itemsize(self._tensor)
        return int(self._tensor.stride(dim))

    def element_size(self) -> int:
        return itemsize(self._tensor)


def test_tensors_that_expose_no_storage_never_merge_across_refs() -> None:
    """Objects with neither untyped_storage() nor a numpy base: each is taken
    as an allocation of its own, so runs stop at every ref's end, even where
    the memory is one buffer; refs of one such tensor still merge."""
    page, n_blocks = 16, 4
    buffer = zeros(2 * n_blocks, page)
    cpu_buffer = zeros(2 * n_blocks, page)
    device = [_Opaque(buffer[:n_blocks]), _Opaque(buffer[n_blocks:])]
    cpu = [_Opaque(cpu_buffer[:n_blocks]), _Opaque(cpu_buffer[n_blocks:])]
    refs = [
        [ptrres.CanonicalKVCacheRef(0, page)],
        [ptrres.CanonicalKVCacheRef(1, page)],
    ]
    kv = ptrres.CanonicalKVCaches(
        [ptrres.CanonicalKVCacheTensor(t, page) for t in device], refs
    )
    spec = ptrres.GPULoadStoreSpec(np.array([3, 0]), [1, 1], [0, 0])
    plan = ptrres.PointerTable(kv).plan_transfer(
        spec, ptrres.OffloadedLayout(cpu, 1), np.array([3, 0]), store=True,
        coalesce=True,
    )  # fmt: skip
    assert plan.sizes.tolist() == [page, page]
    # As torch views of one storage (numpy's of one array), the same copy is one.
    kv_views = ptrres.CanonicalKVCaches(
        [
            ptrres.CanonicalKVCacheTensor(t, page)
            for t in (buffer[:n_blocks], buffer[n_blocks:])
        ],
        refs,
    )
    plan = ptrres.PointerTable(kv_views).plan_transfer(
        spec, ptrres.OffloadedLayout([cpu_buffer[:n_blocks], cpu_buffer[n_blocks:]], 1),
        np.array([3, 0]), store=True, coalesce=True,
    )  # fmt: skip
    assert plan.sizes.tolist() == [2 * page]


def test_file_ops_merge_across_refs_only_within_one_allocation() -> None:
    """Block-major files put ref 0 and ref 1 of a block side by side, as K
    and V lie side by side in a row of one tensor: their ops merge when the
    refs are views of that tensor, not when their tensors expose no storage
    (two allocations, as far as ptrres can tell). Pointers alone
    (ptrres.plan_file_ops) say nothing of allocations: they merge."""
    page = 64
    tensor = zeros(8, 2 * page)
    halves = [tensor[:, :page], tensor[:, page:]]
    spec = ptrres.GPULoadStoreSpec(np.array([5, 6], np.int64), [2], [0])
    refs = [[ptrres.CanonicalKVCacheRef(0, page), ptrres.CanonicalKVCacheRef(1, page)]]
    cases: list[tuple[list[Any], list[int]]] = [
        (halves, [2 * page] * 2),
        ([_Opaque(t) for t in halves], [page] * 4),
    ]
    for device, copies in cases:
        kv = ptrres.CanonicalKVCaches(
            [ptrres.CanonicalKVCacheTensor(t, 2 * page) for t in device], refs
        )
        table = ptrres.PointerTable(kv)
        ops = table.plan_file_ops(spec, 1, layout="block-major", coalesce=True)
        assert ops.sizes.tolist() == copies
        from_pointers = ptrres.plan_file_ops(
            table.resolve(spec), 1, layout="block-major", coalesce=True
        )
        assert from_pointers.sizes.tolist() == [2 * page] * 2


@pytest.mark.parametrize(
    "windows",
    [
        [(0, 4), (4, 4)],  # back to back: runs pass upwards from 0 into 1
        [(4, 4), (0, 4)],  # and downwards from 0 into 1
        [(2, 4), (0, 4)],  # overlapping views of one buffer
        [(0, 4), (2, 4)],
    ],
)
def test_runs_across_refs_of_one_buffer_every_short_stream(
    windows: list[tuple[int, int]],
) -> None:
    """Every id stream of up to three blocks (the offloaded chunks the same
    ids), two refs on windows of one buffer (rows ``start:start + n`` of it,
    the offloaded side alike), capped or not: the coalesced plan is the
    reference's coalescing of the plain plan, whichever way a run passes
    from one ref into the next."""
    page = 8
    rows = max(start + n for start, n in windows)
    device = as_tensor(np.arange(rows * page, dtype=np.int8).reshape(rows, page))
    cpu = zeros(rows, page)
    kv = ptrres.CanonicalKVCaches(
        [ptrres.CanonicalKVCacheTensor(device[a : a + n], page) for a, n in windows],
        [[ptrres.CanonicalKVCacheRef(0, page), ptrres.CanonicalKVCacheRef(1, page)]],
    )
    offloaded_tensors = [cpu[a : a + n] for a, n in windows]
    table = ptrres.PointerTable(kv)
    layout = ptrres.OffloadedLayout(offloaded_tensors, 1)
    limit = min(n for _, n in windows)
    streams: list[list[int]] = [[]] + [
        [int(i) for i in np.unravel_index(code, (limit,) * length)]
        for length in (1, 2, 3)
        for code in range(limit**length)
    ]
    for ids in streams:
        spec = ptrres.GPULoadStoreSpec(np.array(ids, np.int64), [len(ids)], [0])
        chunks = np.array(ids, np.int64)
        for store in (True, False):
            planned = reference.plan_transfer(
                spec, kv, offloaded_tensors, 1, chunks, store=store
            )
            for cap in (None, 2 * page, 3 * page):
                expected = reference.coalesce(
                    planned.src, planned.dst, planned.sizes, max_run_bytes=cap
                )
                plan = table.plan_transfer(
                    spec, layout, chunks, store=store, coalesce=True,
                    max_run_bytes=cap,
                )  # fmt: skip
                assert_same(plan, expected)
