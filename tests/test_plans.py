"""Transfer plans and coalescing against the reference, and byte round trips."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import hypothesis.strategies as st
import numpy as np
import pytest
from conftest import (
    data_ptr,
    dtype_of,
    itemsize,
    layouts,
    random_tensor,
    row_bytes,
    row_stride,
    tensor_bytes,
    zero,
    zeros,
)
from hypothesis import given

import ptrres
from ptrres import reference


@dataclass
class PlanCase:
    kv_caches: ptrres.CanonicalKVCaches
    offloaded_tensors: list[Any]  # torch tensors, or numpy arrays without torch
    blocks_per_chunk: int
    spec: ptrres.GPULoadStoreSpec
    offloaded_ids: np.ndarray

    @property
    def offloaded(self) -> ptrres.OffloadedLayout:
        return ptrres.OffloadedLayout(self.offloaded_tensors, self.blocks_per_chunk)

    @property
    def num_ops(self) -> int:
        return sum(
            n * len(refs)
            for n, refs in zip(self.spec.group_sizes, self.kv_caches.group_data_refs)
        )

    def reference_plan(self, store: bool) -> ptrres.TransferPlan:
        return reference.plan_transfer(
            self.spec,
            self.kv_caches,
            self.offloaded_tensors,
            self.blocks_per_chunk,
            self.offloaded_ids,
            store=store,
        )


def chunks_of(n: int, block_index: int, bpc: int) -> int:
    return 0 if n == 0 else -(-(n + block_index % bpc) // bpc)


@st.composite
def plan_cases(draw: Any, unique: bool = False) -> PlanCase:
    """A layout, offloaded tensors that fit it, and a valid transfer.

    With ``unique``, no two ops share a device row or an offloaded sub-block of
    the same tensor, so that a store or a load has one right answer per byte.
    """
    kv = draw(layouts())
    bpc = draw(st.integers(1, 8))
    offloaded = []
    for t in range(len(kv.tensors)):
        pages = [
            r.page_size_bytes
            for refs in kv.group_data_refs
            for r in refs
            if r.tensor_idx == t
        ]
        sub = max(pages, default=0) + draw(st.sampled_from([0, 0, 1, 5]))
        pad = draw(st.sampled_from([0, 0, 3]))
        dtype = draw(st.sampled_from([dtype_of("int8"), dtype_of("uint8")]))
        num_chunks = draw(st.integers(12 if unique else 1, 14))
        offloaded.append(random_tensor(num_chunks, bpc * sub, pad, dtype, 100 + t))
    ids: list[int] = []
    group_sizes, block_indices, chunk_ids = [], [], []
    used_blocks: set[tuple[int, int]] = set()
    used_chunks: set[int] = set()
    for refs in kv.group_data_refs:
        tensors = [r.tensor_idx for r in refs]
        limit = min((kv.tensors[t].tensor.shape[0] for t in tensors), default=20)
        candidates = [
            b for b in range(limit) if not any((t, b) in used_blocks for t in tensors)
        ]
        if unique:
            group_ids = draw(
                st.lists(st.sampled_from(candidates), unique=True, max_size=4)
                if candidates
                else st.just([])
            )
        else:
            group_ids = draw(st.lists(st.integers(0, limit - 1), max_size=6))
        used_blocks |= {(t, b) for t in tensors for b in group_ids}
        block_index = draw(st.integers(0, 20))
        chunk_limit = min((offloaded[t].shape[0] for t in tensors), default=20)
        n_chunks = chunks_of(len(group_ids), block_index, bpc)
        if unique:
            free = [c for c in range(chunk_limit) if c not in used_chunks]
            group_chunks = draw(st.permutations(free))[:n_chunks]
            if len(group_chunks) < n_chunks:
                group_ids, n_chunks, group_chunks = [], 0, []
            used_chunks |= set(group_chunks)
        else:
            group_chunks = draw(
                st.lists(
                    st.integers(0, chunk_limit - 1),
                    min_size=n_chunks,
                    max_size=n_chunks,
                )
            )
        ids += group_ids
        group_sizes.append(len(group_ids))
        block_indices.append(block_index)
        chunk_ids += group_chunks
    id_dtype = draw(st.sampled_from([np.int32, np.int64]))
    return PlanCase(
        kv,
        offloaded,
        bpc,
        ptrres.GPULoadStoreSpec(np.array(ids, id_dtype), group_sizes, block_indices),
        np.array(chunk_ids, draw(st.sampled_from([np.int32, np.int64]))),
    )


def assert_same_plan(
    actual: ptrres.TransferPlan, expected: ptrres.TransferPlan
) -> None:
    for name in ("src", "dst", "sizes"):
        array = getattr(actual, name)
        assert array.dtype == np.uint64, name
        np.testing.assert_array_equal(array, getattr(expected, name), err_msg=name)
    assert actual.num_bytes == expected.num_bytes


@given(plan_cases(), st.booleans(), st.sampled_from([None, np.int64, np.uint64]))
def test_plan_matches_reference(case: PlanCase, store: bool, out_dtype: Any) -> None:
    expected = case.reference_plan(store)
    table = ptrres.PointerTable(case.kv_caches)
    out = (
        None
        if out_dtype is None
        else tuple(np.full(case.num_ops + 2, 9, out_dtype) for _ in range(3))
    )
    plan = table.plan_transfer(
        case.spec, case.offloaded, case.offloaded_ids, store=store, out=out
    )
    assert_same_plan(plan, expected)
    if out is not None:
        for array, buffer in zip((plan.src, plan.dst, plan.sizes), out):
            assert array.ctypes.data == buffer.ctypes.data
            assert (buffer[case.num_ops :] == 9).all()


@given(plan_cases(), st.booleans(), st.sampled_from([None, 1, 7, 64, 200]))
def test_plan_with_coalescing_matches_reference_coalesce(
    case: PlanCase, store: bool, max_run_bytes: Any
) -> None:
    planned = case.reference_plan(store)
    expected = reference.coalesce(
        planned.src, planned.dst, planned.sizes, max_run_bytes=max_run_bytes
    )
    table = ptrres.PointerTable(case.kv_caches)
    plan = table.plan_transfer(
        case.spec,
        case.offloaded,
        case.offloaded_ids,
        store=store,
        coalesce=True,
        max_run_bytes=max_run_bytes,
    )
    assert_same_plan(plan, expected)
    standalone = ptrres.coalesce(
        planned.src, planned.dst, planned.sizes, max_run_bytes=max_run_bytes
    )
    assert_same_plan(standalone, expected)


@given(plan_cases(), st.booleans(), st.booleans())
def test_plan_from_device_pointers_is_the_same_plan(
    case: PlanCase, store: bool, merge: bool
) -> None:
    table = ptrres.PointerTable(case.kv_caches)
    device_ptrs = ptrres.resolve_device_pointers(case.spec, case.kv_caches)
    offloaded = case.offloaded
    direct = table.plan_transfer(
        case.spec, offloaded, case.offloaded_ids, store=store, coalesce=merge
    )
    two_step = table.plan_from_device_pointers(
        device_ptrs, offloaded, case.offloaded_ids, store=store, coalesce=merge
    )
    assert_same_plan(two_step, direct)


def copy(plan: ptrres.TransferPlan) -> None:
    for src, dst, size in zip(
        plan.src.tolist(), plan.dst.tolist(), plan.sizes.tolist()
    ):
        ctypes.memmove(dst, src, size)


@given(plan_cases(unique=True), st.booleans())
def test_store_then_load_round_trip(case: PlanCase, merge: bool) -> None:
    """Every copied byte lands where SPEC says, and nothing else is written."""
    kv = case.kv_caches
    bpc = case.blocks_per_chunk
    for offloaded in case.offloaded_tensors:
        zero(offloaded)
    offloaded_before = [tensor_bytes(t) for t in case.offloaded_tensors]
    table = ptrres.PointerTable(kv)
    layout = case.offloaded
    store = table.plan_transfer(
        case.spec, layout, case.offloaded_ids, store=True, coalesce=merge
    )
    copy(store)

    # Where each op's page must be: (tensor, block, chunk, sub-block, page).
    expected = []
    first_id = first_chunk = 0
    for n, index, refs in zip(
        case.spec.group_sizes, case.spec.block_indices, kv.group_data_refs
    ):
        skip = index % bpc
        for ref in refs:
            for k in range(n):
                j = skip + k
                block = int(case.spec.block_ids[first_id + k])
                chunk = int(case.offloaded_ids[first_chunk + j // bpc])
                expected.append(
                    (ref.tensor_idx, block, chunk, j % bpc, ref.page_size_bytes)
                )
        first_id += n
        first_chunk += chunks_of(n, index, bpc)

    written = [bytearray(b) for b in offloaded_before]
    for t, block, chunk, sub_block, page in expected:
        off = case.offloaded_tensors[t]
        sub = off.shape[1] * itemsize(off) // bpc
        start = chunk * row_stride(off) + sub_block * sub
        written[t][start : start + page] = row_bytes(kv.tensors[t].tensor, block)[:page]
    assert [tensor_bytes(t) for t in case.offloaded_tensors] == [
        bytes(b) for b in written
    ]

    # Load into zeroed device tensors: each op's page comes back, nothing else.
    for entry in kv.tensors:
        zero(entry.tensor)
    table = ptrres.PointerTable(kv)
    copy(
        table.plan_transfer(
            case.spec, layout, case.offloaded_ids, store=False, coalesce=merge
        )
    )
    device_written = [bytearray(len(tensor_bytes(e.tensor))) for e in kv.tensors]
    for t, block, chunk, sub_block, page in expected:
        off = case.offloaded_tensors[t]
        sub = off.shape[1] * itemsize(off) // bpc
        src = chunk * row_stride(off) + sub_block * sub
        dev = kv.tensors[t].tensor
        start = block * row_stride(dev)
        device_written[t][start : start + page] = written[t][src : src + page]
    assert [tensor_bytes(e.tensor) for e in kv.tensors] == [
        bytes(b) for b in device_written
    ]


@st.composite
def descriptors(draw: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Descriptors with runs that continue on one side, both, or neither."""
    n = draw(st.integers(0, 40))
    src, dst, sizes = [], [], []
    s, d = draw(st.integers(2**20, 2**40)), draw(st.integers(2**20, 2**40))
    for _ in range(n):
        size = draw(st.sampled_from([0, 1, 8, 16, 64]))
        src.append(s)
        dst.append(d)
        sizes.append(size)
        s += size + draw(st.sampled_from([0, 0, 0, 8]))
        d += size + draw(st.sampled_from([0, 0, 0, 8, -64]))
    dtype = draw(st.sampled_from([np.int64, np.uint64]))
    return np.array(src, dtype), np.array(dst, dtype), np.array(sizes, dtype)


def byte_mapping(
    src: np.ndarray, dst: np.ndarray, sizes: np.ndarray
) -> list[tuple[int, int]]:
    return [
        (int(s) + i, int(d) + i)
        for s, d, z in zip(src, dst, sizes)
        for i in range(int(z))
    ]


@given(descriptors(), st.sampled_from([None, 1, 16, 40, 64, 1000]))
def test_coalesce_keeps_the_byte_mapping_and_the_cap(
    descs: Any, max_run_bytes: Any
) -> None:
    merged = ptrres.coalesce(*descs, max_run_bytes=max_run_bytes)
    assert_same_plan(merged, reference.coalesce(*descs, max_run_bytes=max_run_bytes))
    assert byte_mapping(merged.src, merged.dst, merged.sizes) == byte_mapping(*descs)
    assert merged.num_bytes == int(descs[2].astype(np.uint64).sum())
    if max_run_bytes is not None:
        # A run over the cap is a descriptor that was over it on its own.
        assert all(
            z <= max_run_bytes or z in descs[2].tolist() for z in merged.sizes.tolist()
        )
    # Nothing mergeable is left (without a cap).
    if max_run_bytes is None and len(merged.sizes) > 1:
        again = ptrres.coalesce(merged.src, merged.dst, merged.sizes)
        assert len(again.sizes) == len(merged.sizes)


@st.composite
def long_descriptor_lists(draw: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Hundreds of descriptors: stretches that merge whole, stretches where
    nothing merges, runs across coalesce's 64-descriptor spans, and now and
    then a run that ends at 2**64, or one that would span 2**64 bytes."""
    src: list[int] = []
    dst: list[int] = []
    sizes: list[int] = []
    s, d = draw(st.integers(0, 2**40)), draw(st.integers(0, 2**40))
    for _ in range(draw(st.integers(1, 8))):
        kind = draw(st.sampled_from(["run", "singles", "wrap", "halves"]))
        length = draw(st.sampled_from([1, 2, 7, 63, 64, 65, 130]))
        size = draw(st.sampled_from([1, 8, 4096]))
        if kind == "wrap":  # a run whose last descriptor ends at 2**64
            s = 2**64 - length * size
        if kind == "halves":  # two halves of 2**64 bytes: too many to merge
            s, d, length, size = 0, 0, 2, 2**63
        for k in range(length):
            src.append(s)
            dst.append(d)
            sizes.append(size)
            gap = 0 if kind != "singles" or k == length - 1 else size
            s, d = (s + size + gap) % 2**64, (d + size + gap) % 2**64
        s, d = draw(st.integers(0, 2**40)), d + draw(st.sampled_from([0, 0, 64]))
    return tuple(np.array(a, np.uint64) for a in (src, dst, sizes))  # type: ignore[return-value]


@given(
    long_descriptor_lists(),
    st.sampled_from([None, 8, 4096, 2**20]),
    st.booleans(),
)
def test_coalesce_of_long_lists_is_the_reference(
    descs: Any, max_run_bytes: Any, in_place: bool
) -> None:
    """Every way coalesce() treats a span of 64 descriptors, in place or not."""
    expected = reference.coalesce(*descs, max_run_bytes=max_run_bytes)
    out = tuple(a.copy() for a in descs) if in_place else None
    inputs = out if out is not None else descs
    merged = ptrres.coalesce(*inputs, max_run_bytes=max_run_bytes, out=out)
    assert_same_plan(merged, expected)


def test_coalesce_in_place_and_into_out_buffers() -> None:
    src = np.array([100, 108, 116, 500], np.int64)
    dst = np.array([0, 8, 16, 24], np.int64)
    sizes = np.array([8, 8, 8, 8], np.int64)
    merged = ptrres.coalesce(src, dst, sizes, out=(src, dst, sizes))
    assert merged.src.tolist() == [100, 500]
    assert merged.dst.tolist() == [0, 24]
    assert merged.sizes.tolist() == [24, 8]
    assert merged.src.ctypes.data == src.ctypes.data
    assert merged.num_bytes == 32


def contiguous_layout(
    n_tensors: int, num_blocks: int, row: int
) -> tuple[ptrres.CanonicalKVCaches, Any]:
    """Tensors carved from one buffer with gaps, so no two are adjacent."""
    storage = zeros(n_tensors, num_blocks + 1, row)
    tensors = [storage[t, :num_blocks] for t in range(n_tensors)]
    kv = ptrres.CanonicalKVCaches(
        [ptrres.CanonicalKVCacheTensor(t, row) for t in tensors],
        [[ptrres.CanonicalKVCacheRef(t, row) for t in range(n_tensors)]],
    )
    return kv, storage


@pytest.mark.parametrize("store", [True, False])
def test_contiguous_transfer_collapses_to_one_descriptor_per_ref(store: bool) -> None:
    kv, _ = contiguous_layout(n_tensors=3, num_blocks=64, row=32)
    offloaded = ptrres.OffloadedLayout([zeros(8 + 1, 4 * 32)[:8] for _ in range(3)], 4)
    spec = ptrres.GPULoadStoreSpec(np.arange(8, 24), [16], [0])
    table = ptrres.PointerTable(kv)
    plan = table.plan_transfer(
        spec, offloaded, np.array([2, 3, 4, 5]), store=store, coalesce=True
    )
    assert plan.sizes.tolist() == [16 * 32] * 3
    assert plan.num_bytes == 3 * 16 * 32
    capped = table.plan_transfer(
        spec,
        offloaded,
        np.array([2, 3, 4, 5]),
        store=store,
        coalesce=True,
        max_run_bytes=4 * 32,
    )
    assert capped.sizes.tolist() == [4 * 32] * 12
    # A skip shifts the offloaded side; chunks out of order break the runs.
    shifted = ptrres.GPULoadStoreSpec(np.arange(8, 24), [16], [1])
    plan = table.plan_transfer(
        shifted, offloaded, np.array([2, 3, 4, 5, 6]), store=store, coalesce=True
    )
    assert plan.sizes.tolist() == [16 * 32] * 3
    shuffled = table.plan_transfer(
        spec, offloaded, np.array([5, 4, 3, 2]), store=store, coalesce=True
    )
    assert shuffled.sizes.tolist() == [4 * 32] * 12


@pytest.mark.parametrize(
    ("max_run_bytes", "expected_sizes"),
    [(None, [96]), (100, [96]), (64, [64, 32]), (48, [32, 32, 32]), (16, [32, 32, 32])],
)
@pytest.mark.parametrize("store", [True, False])
def test_runs_merge_across_refs_and_groups(
    store: bool, max_run_bytes: Any, expected_sizes: list[int]
) -> None:
    """Layers interleaved on both sides: one block's pages of three layers, two
    of them in group 0 and one in group 1, are adjacent and become one copy."""
    device = zeros(16, 3, 32)
    host = zeros(8, 3, 32)  # blocks_per_chunk 1
    kv = ptrres.CanonicalKVCaches(
        [ptrres.CanonicalKVCacheTensor(device[:, i], 96) for i in range(3)],
        [
            [ptrres.CanonicalKVCacheRef(0, 32), ptrres.CanonicalKVCacheRef(1, 32)],
            [ptrres.CanonicalKVCacheRef(2, 32)],
        ],
    )
    host_tensors = [host[:, i] for i in range(3)]
    spec = ptrres.GPULoadStoreSpec([5, 5], [1, 1], [0, 0])
    plan = merged_like_reference(
        kv, (host_tensors, 1), spec, np.array([3, 3]), store, max_run_bytes
    )
    assert plan.sizes.tolist() == expected_sizes
    device_side = plan.src if store else plan.dst
    assert int(device_side[0]) == data_ptr(device[5])


@pytest.mark.parametrize(
    ("max_run_bytes", "expected_pages"),
    [(None, [6]), (3 * 32, [3, 3]), (4 * 32, [4, 2]), (5 * 32, [5, 1]), (32, [1] * 6)],
)
@pytest.mark.parametrize("store", [True, False])
def test_capped_run_rest_continues_into_next_ref(
    store: bool, max_run_bytes: Any, expected_pages: list[int]
) -> None:
    """Three refs whose two pages each follow the ref before on both sides:
    under a cap, a ref's run splits into the part that grows the last copy and
    the rest, and the next ref's run must continue that rest."""
    page = 32
    device = zeros(3, 2, page)  # ref, block, page
    host = zeros(2, 3, 2 * page)  # chunk, ref, sub-blocks
    kv = ptrres.CanonicalKVCaches(
        [ptrres.CanonicalKVCacheTensor(device[i], page) for i in range(3)],
        [[ptrres.CanonicalKVCacheRef(i, page) for i in range(3)]],
    )
    host_tensors = [host[:, i] for i in range(3)]
    spec = ptrres.GPULoadStoreSpec([0, 1], [2], [0])
    plan = merged_like_reference(
        kv, (host_tensors, 2), spec, np.array([1]), store, max_run_bytes
    )
    assert plan.sizes.tolist() == [n * page for n in expected_pages]


def merged_like_reference(
    kv: Any, offloaded: Any, spec: Any, ids: Any, store: bool, max_run_bytes: Any
) -> Any:
    """A coalesced plan, checked against the reference's plan coalesced.

    offloaded: (the offloaded tensors, blocks_per_chunk).
    """
    host_tensors, bpc = offloaded
    plan = ptrres.PointerTable(kv).plan_transfer(
        spec,
        ptrres.OffloadedLayout(host_tensors, bpc),
        ids,
        store=store,
        coalesce=True,
        max_run_bytes=max_run_bytes,
    )
    unmerged = reference.plan_transfer(spec, kv, host_tensors, bpc, ids, store=store)
    assert_same_plan(
        plan,
        reference.coalesce(
            unmerged.src, unmerged.dst, unmerged.sizes, max_run_bytes=max_run_bytes
        ),
    )
    return plan


def test_worked_example_store_and_load() -> None:
    """SPEC 5 by hand: bpc 2, skip 1, three blocks over two chunks."""
    device = random_tensor(10, 16, 0, dtype_of("int8"), 0)
    host = zeros(4, 32)
    kv = ptrres.CanonicalKVCaches(
        [ptrres.CanonicalKVCacheTensor(device, 16)],
        [[ptrres.CanonicalKVCacheRef(0, 12)]],
    )
    offloaded = ptrres.OffloadedLayout([host], 2)
    spec = ptrres.GPULoadStoreSpec([7, 2, 5], [3], [3])
    plan = ptrres.PointerTable(kv).plan_transfer(spec, offloaded, [3, 0], store=True)
    d, h = data_ptr(device), data_ptr(host)
    assert plan.src.tolist() == [d + 7 * 16, d + 2 * 16, d + 5 * 16]
    assert plan.dst.tolist() == [h + 3 * 32 + 16, h + 0 * 32, h + 0 * 32 + 16]
    assert plan.sizes.tolist() == [12, 12, 12]
    assert plan.num_bytes == 36
    load = ptrres.PointerTable(kv).plan_transfer(spec, offloaded, [3, 0], store=False)
    assert (load.src.tolist(), load.dst.tolist()) == (
        plan.dst.tolist(),
        plan.src.tolist(),
    )


@pytest.mark.parametrize("bpc", [np.int32(2), np.int64(2), np.uint64(2)])
def test_blocks_per_chunk_as_a_numpy_integer(bpc: Any) -> None:
    """int64 ids // a numpy uint64 is float64 in numpy: neither side may trip."""
    device = random_tensor(10, 16, 0, dtype_of("int8"), 0)
    host = zeros(4, 32)
    kv = ptrres.CanonicalKVCaches(
        [ptrres.CanonicalKVCacheTensor(device, 16)],
        [[ptrres.CanonicalKVCacheRef(0, 12)]],
    )
    spec = ptrres.GPULoadStoreSpec(np.array([7, 2, 5]), [3], [3])
    expected = reference.plan_transfer(spec, kv, [host], 2, [3, 0], store=True)
    plan = ptrres.PointerTable(kv).plan_transfer(
        spec, ptrres.OffloadedLayout([host], bpc), [3, 0], store=True
    )
    assert_same_plan(plan, expected)
    assert_same_plan(
        reference.plan_transfer(spec, kv, [host], bpc, [3, 0], store=True), expected
    )


# Bad input -----------------------------------------------------------------


@pytest.fixture
def setup() -> tuple[
    ptrres.PointerTable, ptrres.OffloadedLayout, ptrres.GPULoadStoreSpec
]:
    tensors = [random_tensor(10, 16, 0, dtype_of("int8"), t) for t in range(2)]
    kv = ptrres.CanonicalKVCaches(
        [ptrres.CanonicalKVCacheTensor(t, 16) for t in tensors],
        [[ptrres.CanonicalKVCacheRef(0, 16)], [ptrres.CanonicalKVCacheRef(1, 8)]],
    )
    offloaded = ptrres.OffloadedLayout([zeros(5, 64), zeros(3, 32)], 4)
    spec = ptrres.GPULoadStoreSpec([1, 2, 3, 4, 5], [3, 2], [0, 3])
    return ptrres.PointerTable(kv), offloaded, spec


GOOD_IDS = np.array([4, 0, 2])  # group 0: 1 chunk; group 1: skip 3 -> 2 chunks


def test_offloaded_id_out_of_range(setup) -> None:
    table, offloaded, spec = setup
    ptrs = np.full(5, 7, np.int64)
    outs = (ptrs, np.zeros(5, np.int64), np.zeros(5, np.int64))
    with pytest.raises(
        ptrres.OffloadedIdError,
        match="group 1, position 1: offloaded id 3 is out of range for ref 0, "
        "whose offloaded tensor 1 has 3 chunks",
    ) as info:
        table.plan_transfer(spec, offloaded, [4, 0, 3], store=True, out=outs)
    assert (info.value.group, info.value.position, info.value.value) == (1, 1, 3)
    assert ptrs.tolist() == [0] * 5
    with pytest.raises(
        ptrres.OffloadedIdError, match="group 0, position 0: offloaded id -1"
    ):
        table.plan_transfer(spec, offloaded, [-1, 0, 2], store=False)
    assert len(table.plan_transfer(spec, offloaded, GOOD_IDS, store=True).sizes) == 5


@pytest.mark.parametrize("ids", [[4, 0], [4, 0, 2, 1], []])
def test_wrong_number_of_offloaded_ids(setup, ids) -> None:
    table, offloaded, spec = setup
    with pytest.raises(
        ptrres.OffloadedIdError,
        match=rf"there are {len(ids)} offloaded ids, but the groups span "
        r"\[1, 2\] chunks",
    ):
        table.plan_transfer(spec, offloaded, ids, store=True)


def test_device_id_out_of_range_in_a_plan(setup) -> None:
    table, offloaded, _ = setup
    spec = ptrres.GPULoadStoreSpec([1, 2, 3, 4, 10], [3, 2], [0, 3])
    with pytest.raises(
        ptrres.BlockIdError, match="group 1, position 1: block id 10"
    ) as info:
        table.plan_transfer(spec, offloaded, GOOD_IDS, store=True, coalesce=True)
    assert (info.value.group, info.value.position, info.value.value) == (1, 1, 10)


@pytest.mark.parametrize(
    ("tensors", "bpc", "pattern"),
    [
        (
            [
                zeros(5, 62),
                zeros(3, 32),
            ],
            4,
            r"offloaded tensors\[0\]: a row of 62 B does not split into 4 sub-blocks",
        ),
        (
            [
                zeros(5, 32),
                zeros(3, 32),
            ],
            4,
            r"group 0, ref 0: a page of 16 B does not fit in a sub-block of "
            r"offloaded tensors\[0\] \(8 B\)",
        ),
        (
            [zeros(5, 64)],
            4,
            "group 1, ref 0: tensor 1 has no offloaded tensor",
        ),
    ],
)
def test_offloaded_tensors_that_do_not_fit(setup, tensors, bpc, pattern) -> None:
    table, _, spec = setup
    with pytest.raises(ptrres.LayoutError, match=pattern):
        table.plan_transfer(
            spec, ptrres.OffloadedLayout(tensors, bpc), GOOD_IDS, store=True
        )
    kv = ptrres.CanonicalKVCaches(
        [
            ptrres.CanonicalKVCacheTensor(
                random_tensor(10, 16, 0, dtype_of("int8"), t), 16
            )
            for t in range(2)
        ],
        [[ptrres.CanonicalKVCacheRef(0, 16)], [ptrres.CanonicalKVCacheRef(1, 8)]],
    )
    with pytest.raises(ptrres.LayoutError, match=pattern):
        reference.plan_transfer(spec, kv, tensors, bpc, GOOD_IDS, store=True)


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"store": 1}, ptrres.InputTypeError, "store must be True or False"),
        (
            {"store": True, "coalesce": "yes"},
            ptrres.InputTypeError,
            "coalesce must be True or False",
        ),
        (
            {"store": True, "max_run_bytes": 0},
            ptrres.SpecError,
            "max_run_bytes must be >= 1",
        ),
        (
            {"store": True, "max_run_bytes": 2.5},
            ptrres.InputTypeError,
            "max_run_bytes must be an integer",
        ),
        (
            {
                "store": True,
                "out": (np.zeros(5, np.int64),) * 2 + (np.zeros(4, np.int64),),
            },
            ptrres.OutBufferError,
            r"out\[2\] \(sizes\) holds 4 entries",
        ),
    ],
)
def test_bad_plan_arguments(setup, kwargs, error, pattern) -> None:
    table, offloaded, spec = setup
    with pytest.raises(error, match=pattern):
        table.plan_transfer(spec, offloaded, GOOD_IDS, **kwargs)
    with pytest.raises(
        ptrres.InputTypeError, match="offloaded must be an OffloadedLayout"
    ):
        table.plan_transfer(spec, [zeros(5, 64, dtype="float32")], GOOD_IDS, store=True)
    # Empty rows split into any number of sub-blocks, but not one past int64.
    empty_rows = [zeros(5, 0)]
    with pytest.raises(
        ptrres.LayoutError, match="and < 2\\*\\*63, got 18446744073709551616"
    ):
        ptrres.OffloadedLayout(empty_rows, 2**64)
    assert ptrres.OffloadedLayout(empty_rows, 2**63 - 1).blocks_per_chunk == 2**63 - 1
    with pytest.raises(ptrres.LayoutError, match="blocks_per_chunk must be >= 1"):
        ptrres.OffloadedLayout([zeros(5, 64, dtype="float32")], 0)


def test_device_pointers_that_are_not_blocks(setup) -> None:
    table, offloaded, spec = setup
    device_ptrs = table.resolve(spec)
    for op, delta, field in [(4, 1, "ptrs"), (1, 16 * 20, "ptrs"), (3, 1, "sizes")]:
        tampered = ptrres.DevicePointers(
            device_ptrs.ptrs.copy(),
            device_ptrs.sizes.copy(),
            *(
                device_ptrs.group_block_counts,
                device_ptrs.group_data_ref_counts,
                device_ptrs.block_indices,
            ),
        )
        getattr(tampered, field)[op] += delta
        group, position = (0, op) if op < 3 else (1, op - 3)
        with pytest.raises(
            ptrres.DevicePointerError,
            match=f"group {group}, position {position}: device pointer",
        ) as info:
            table.plan_from_device_pointers(tampered, offloaded, GOOD_IDS, store=True)
        assert info.value.group == group
    # Regrouped pointers: group 0 now claims group 1's pointers, of tensor 1.
    regrouped = ptrres.DevicePointers(
        device_ptrs.ptrs, device_ptrs.sizes, (5, 0), (1, 1), (0, 0)
    )
    with pytest.raises(ptrres.DevicePointerError, match="group 0, position 3"):
        table.plan_from_device_pointers(regrouped, offloaded, GOOD_IDS, store=True)
    short = ptrres.DevicePointers(
        device_ptrs.ptrs[:4], device_ptrs.sizes[:4], (3, 2), (1, 1), (0, 3)
    )
    with pytest.raises(
        ptrres.SpecError, match="4 ptrs and 4 sizes, but its groups make 5 ops"
    ):
        table.plan_from_device_pointers(short, offloaded, GOOD_IDS, store=True)
    wrong_refs = ptrres.DevicePointers(
        device_ptrs.ptrs, device_ptrs.sizes, (3, 2), (2, 1), (0, 3)
    )
    with pytest.raises(ptrres.SpecError, match=r"refs per group \(2, 1\)"):
        table.plan_from_device_pointers(wrong_refs, offloaded, GOOD_IDS, store=True)


@pytest.mark.parametrize(
    ("arrays", "error", "pattern"),
    [
        (
            (np.zeros(3, np.int64), np.zeros(2, np.int64), np.zeros(3, np.int64)),
            ptrres.SpecError,
            "have 3, 2 and 3 entries",
        ),
        (
            (np.zeros(3, np.float64), np.zeros(3, np.int64), np.zeros(3, np.int64)),
            ptrres.InputTypeError,
            "src must be int64 or uint64",
        ),
        (
            ([1, 2], np.zeros(2, np.int64), np.zeros(2, np.int64)),
            ptrres.InputTypeError,
            "src must be a numpy array",
        ),
        (
            (np.zeros((3, 1), np.int64), np.zeros(3, np.int64), np.zeros(3, np.int64)),
            ptrres.InputTypeError,
            "src must be 1-D",
        ),
    ],
)
def test_bad_coalesce_input(arrays, error, pattern) -> None:
    with pytest.raises(error, match=pattern):
        ptrres.coalesce(*arrays)
    with pytest.raises(ptrres.SpecError, match="max_run_bytes must be >= 1"):
        ptrres.coalesce(
            np.zeros(1, np.int64),
            np.zeros(1, np.int64),
            np.ones(1, np.int64),
            max_run_bytes=-4,
        )


def test_zero_byte_pages_and_a_run_joining_the_last_ref_under_a_cap() -> None:
    """Two corners of the fused merge, each against the reference's coalesce.

    Tensors carved from one buffer: tensor 1's first row follows tensor 0's
    last, on both sides, so ref 1's run of every block continues ref 0's.
    """
    device = zeros(2, 8, 32)
    host = zeros(2, 1, 8 * 32)  # one chunk of 8 blocks
    kv = ptrres.CanonicalKVCaches(
        [ptrres.CanonicalKVCacheTensor(device[t], 32) for t in range(2)],
        [[ptrres.CanonicalKVCacheRef(0, 32), ptrres.CanonicalKVCacheRef(1, 32)]],
    )
    host_tensors = [host[t] for t in range(2)]
    spec = ptrres.GPULoadStoreSpec(np.arange(8), [8], [0])
    table = ptrres.PointerTable(kv)
    offloaded = ptrres.OffloadedLayout(host_tensors, 8)
    unmerged = reference.plan_transfer(spec, kv, host_tensors, 8, [0], store=True)
    for cap, expected_sizes in (
        (None, [512]),
        (384, [384, 128]),
        (100, [96] * 5 + [32]),
        (16, [32] * 16),  # a page over the cap stays whole
    ):
        plan = table.plan_transfer(
            spec, offloaded, [0], store=True, coalesce=True, max_run_bytes=cap
        )
        assert plan.sizes.tolist() == expected_sizes
        assert_same_plan(
            plan,
            reference.coalesce(
                unmerged.src, unmerged.dst, unmerged.sizes, max_run_bytes=cap
            ),
        )

    # Pages of 0 bytes: the same block twice, into the same sub-block (bpc 1).
    kv = ptrres.CanonicalKVCaches(
        [ptrres.CanonicalKVCacheTensor(device[0], 32)],
        [[ptrres.CanonicalKVCacheRef(0, 0)]],
    )
    spec = ptrres.GPULoadStoreSpec([3, 3, 4], [3], [0])
    chunks = zeros(4, 32)
    unmerged = reference.plan_transfer(spec, kv, [chunks], 1, [2, 2, 3], store=False)
    plan = ptrres.PointerTable(kv).plan_transfer(
        spec, ptrres.OffloadedLayout([chunks], 1), [2, 2, 3], store=False, coalesce=True
    )
    assert plan.sizes.tolist() == [0, 0]
    assert_same_plan(
        plan, reference.coalesce(unmerged.src, unmerged.dst, unmerged.sizes)
    )


@pytest.mark.parametrize(
    "ids",
    [
        [0, 9, 2, 14, 15],  # the only pair that continues ends the group
        [0, 1, 5, 11, 12, 13, 3, 15],  # runs of 2 and 3 between single blocks
        [0, 8, 3, 15],  # no pair continues: only the refs join
    ],
)
@pytest.mark.parametrize("cap", [None, 96, 95, 64, 32, 20])
@pytest.mark.parametrize("store", [True, False])
def test_runs_of_a_group_filled_once_per_run(
    ids: list[int], cap: Any, store: bool
) -> None:
    """Runs found once per group (as the fused merge fills them, one
    descriptor per run while the longest fits the cap, page by page when it
    does not) against the reference's coalesce of the plain plan.

    Tensors carved from one buffer, on both sides: ref 1's first block (0)
    continues ref 0's last (15). Caps 96 (the longest run, 3 pages, exactly),
    95 (just under it), 64 and 32 (one page) and 20 (under a page).
    """
    device = zeros(2, 16, 32)
    host = zeros(2, 16, 32)  # blocks_per_chunk 1
    kv = ptrres.CanonicalKVCaches(
        [ptrres.CanonicalKVCacheTensor(device[t], 32) for t in range(2)],
        [[ptrres.CanonicalKVCacheRef(0, 32), ptrres.CanonicalKVCacheRef(1, 32)]],
    )
    host_tensors = [host[t] for t in range(2)]
    spec = ptrres.GPULoadStoreSpec(np.array(ids), [len(ids)], [0])
    chunk_ids = np.array(ids)  # runs hold on both sides
    unmerged = reference.plan_transfer(
        spec, kv, host_tensors, 1, chunk_ids, store=store
    )
    expected = reference.coalesce(
        unmerged.src, unmerged.dst, unmerged.sizes, max_run_bytes=cap
    )
    plan = ptrres.PointerTable(kv).plan_transfer(
        spec,
        ptrres.OffloadedLayout(host_tensors, 1),
        chunk_ids,
        store=store,
        coalesce=True,
        max_run_bytes=cap,
    )
    assert_same_plan(plan, expected)
    if cap is None or cap >= 64:
        assert len(plan.sizes) < len(unmerged.sizes)  # something merged


@pytest.mark.parametrize("in_place", [True, False])
def test_coalesce_counts_the_bytes_of_runs_that_reach_2_to_the_64(
    in_place: bool,
) -> None:
    """num_bytes is the sum of the input sizes modulo 2**64, as numpy sums
    them, also when coalesce() writes over its input."""
    top = 2**64 - 1
    src = np.array([0, 2**63, 2**63 + 2**62, 5], np.uint64)
    dst = np.array([0, 2**63, 2**63 + 2**62, 7], np.uint64)
    sizes = np.array([2**63, 2**62, 2**62 - 1, top], np.uint64)
    expected = reference.coalesce(src, dst, sizes)
    out = (src, dst, sizes) if in_place else None
    merged = ptrres.coalesce(src, dst, sizes, out=out)
    assert_same_plan(merged, expected)
    assert merged.sizes.tolist() == [top, top]
    assert merged.num_bytes == (2 * top) % 2**64


def test_a_padded_ref_merges_only_its_first_page_into_the_last_ref() -> None:
    """Pages shorter than their rows never continue each other, but a ref's
    first page may still continue the previous ref's last descriptor.

    Tensors carved from one buffer so that tensor 1's row 0 starts where
    tensor 0's page of row 0 ends, on both sides.
    """
    device = zeros(16 + 8 * 32)
    host = zeros(16 + 2 * 16)
    tensors = [device[:256].reshape(8, 32), device[16:].reshape(8, 32)]
    host_tensors = [host[:32].reshape(2, 16), host[16:].reshape(2, 16)]
    kv = ptrres.CanonicalKVCaches(
        [ptrres.CanonicalKVCacheTensor(t, 32) for t in tensors],
        [[ptrres.CanonicalKVCacheRef(0, 16), ptrres.CanonicalKVCacheRef(1, 16)]],
    )
    table = ptrres.PointerTable(kv)
    offloaded = ptrres.OffloadedLayout(host_tensors, 1)
    for ids, expected_sizes in (([0], [32]), ([0, 3], [16, 16, 16, 16])):
        spec = ptrres.GPULoadStoreSpec(np.array(ids), [len(ids)], [0])
        chunks = list(range(len(ids)))
        for store in (True, False):
            unmerged = reference.plan_transfer(
                spec, kv, host_tensors, 1, chunks, store=store
            )
            for cap in (None, 16):
                plan = table.plan_transfer(
                    spec, offloaded, chunks, store=store, coalesce=True,
                    max_run_bytes=cap,
                )  # fmt: skip
                merged = reference.coalesce(
                    unmerged.src, unmerged.dst, unmerged.sizes, max_run_bytes=cap
                )
                assert_same_plan(plan, merged)
                if cap is None:
                    assert plan.sizes.tolist() == expected_sizes
