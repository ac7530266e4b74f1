"""Canonical offloaded layouts and strided plans (SPEC 10) against the reference,
vLLM's own fill, and bytes moved through the plans' pointers."""

from __future__ import annotations

import ctypes
import functools
import importlib
import json
import types
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import numpy as np
import pytest
from conftest import as_tensor, dtype_of, random_tensor, row_stride, zeros
from hypothesis import assume, given

import ptrres
from ptrres import CanonicalPageMapping, CopyRun, reference
from ptrres import bench as _bench
from ptrres._cli import main


@dataclass
class CanonicalCase:
    kv_caches: ptrres.CanonicalKVCaches
    offloaded_tensors: list[Any]  # torch tensors, or numpy arrays without torch
    blocks_per_chunk: int
    spec: ptrres.GPULoadStoreSpec
    offloaded_ids: np.ndarray

    def offloaded(self, canonical: bool = True) -> ptrres.OffloadedLayout:
        return ptrres.OffloadedLayout(
            self.offloaded_tensors, self.blocks_per_chunk, canonical=canonical
        )

    def items_per_block(self, strided: bool) -> list[int]:
        """Fragments (or runs) one block of each group adds, before filtering."""
        return [
            sum(
                run.num_fragments if not strided else int(run.num_fragments > 0)
                for ref in refs
                for run in ref.mapping.runs
            )
            for refs in self.kv_caches.group_data_refs
        ]

    def max_ops(self, strided: bool = False) -> int:
        return sum(
            n * k for n, k in zip(self.spec.group_sizes, self.items_per_block(strided))
        )

    def reference_plan(self, store: bool) -> ptrres.TransferPlan:
        return reference.plan_canonical_transfer(
            self.spec,
            self.kv_caches,
            self.offloaded_tensors,
            self.blocks_per_chunk,
            self.offloaded_ids,
            store=store,
        )

    def reference_strided(
        self, store: bool, canonical: bool = True
    ) -> ptrres.StridedTransferPlan:
        return reference.plan_strided_transfer(
            self.spec,
            self.kv_caches,
            self.offloaded_tensors,
            self.blocks_per_chunk,
            self.offloaded_ids,
            store=store,
            canonical=canonical,
        )


@st.composite
def runs_within(draw: Any, local_page: int, canonical_page: int) -> CopyRun:
    """A run whose fragments lie in both pages; strides may exceed fragments."""
    size = draw(st.integers(0, 8))
    count = draw(st.integers(0, 4))
    local_stride = size + draw(st.sampled_from([0, 0, 1, 6]))
    canonical_stride = size + draw(st.sampled_from([0, 0, 2, 9]))
    local_span = (count - 1) * local_stride + size if count else 0
    canonical_span = (count - 1) * canonical_stride + size if count else 0
    if local_span > local_page or canonical_span > canonical_page:
        count, local_span, canonical_span = 0, 0, 0
    return CopyRun(
        local_offset=draw(st.integers(0, local_page - local_span)),
        canonical_offset=draw(st.integers(0, canonical_page - canonical_span)),
        fragment_size=size,
        num_fragments=count,
        local_stride=local_stride,
        canonical_stride=canonical_stride,
    )


@st.composite
def mappings(draw: Any, row_bytes: int) -> CanonicalPageMapping:
    local_page = draw(st.integers(0, row_bytes))
    canonical_page = draw(st.integers(0, 96))
    num_writers = draw(st.integers(1, 4))
    return CanonicalPageMapping(
        canonical_page_size_bytes=canonical_page,
        local_page_size_bytes=local_page,
        runs=tuple(draw(st.lists(runs_within(local_page, canonical_page), max_size=3))),
        num_writers=num_writers,
        writer_index=draw(st.integers(0, num_writers - 1)),
        parallelism_agnostic=draw(st.booleans()),
    )


@st.composite
def canonical_cases(draw: Any) -> CanonicalCase:
    """Random mappings, 1-4 writers, bpc 1-8, skips, empty groups, refs
    without fragments, padded rows, int32 and int64 ids."""
    tensors = []
    for t in range(draw(st.integers(1, 3))):
        tensor = random_tensor(
            num_blocks=draw(st.integers(1, 12)),
            row_elements=draw(st.integers(1, 64)),
            pad_elements=draw(st.sampled_from([0, 0, 3])),
            dtype=dtype_of("int8"),
            seed=t,
        )
        tensors.append(ptrres.CanonicalKVCacheTensor(tensor, row_stride(tensor)))
    groups = []
    for _ in range(draw(st.integers(1, 3))):
        refs = []
        for _ in range(draw(st.integers(0, 3))):
            t = draw(st.integers(0, len(tensors) - 1))
            mapping = draw(mappings(tensors[t].tensor.shape[1]))
            refs.append(
                ptrres.CanonicalKVCacheRef(t, mapping.local_page_size_bytes, mapping)
            )
        groups.append(refs)
    kv = ptrres.CanonicalKVCaches(tensors, groups)
    bpc = draw(st.integers(1, 8))
    offloaded = []
    for t in range(len(tensors)):
        pages = [
            r.mapping.canonical_page_size_bytes
            for refs in groups
            for r in refs
            if r.tensor_idx == t
        ]
        sub = max(pages, default=0) + draw(st.sampled_from([0, 0, 1, 5]))
        offloaded.append(
            random_tensor(
                draw(st.integers(1, 14)),
                bpc * sub,
                draw(st.sampled_from([0, 0, 3])),
                dtype_of("int8"),
                100 + t,
            )
        )
    ids: list[int] = []
    group_sizes, block_indices, chunk_ids = [], [], []
    for refs in groups:
        tensor_ids = [r.tensor_idx for r in refs]
        limit = min((tensors[t].tensor.shape[0] for t in tensor_ids), default=20)
        group_ids = draw(st.lists(st.integers(0, limit - 1), max_size=6))
        block_index = draw(st.integers(0, 20))
        n_chunks = (
            0 if not group_ids else -(-(len(group_ids) + block_index % bpc) // bpc)
        )
        chunk_limit = min((offloaded[t].shape[0] for t in tensor_ids), default=20)
        chunk_ids += draw(
            st.lists(
                st.integers(0, chunk_limit - 1), min_size=n_chunks, max_size=n_chunks
            )
        )
        ids += group_ids
        group_sizes.append(len(group_ids))
        block_indices.append(block_index)
    return CanonicalCase(
        kv,
        offloaded,
        bpc,
        ptrres.GPULoadStoreSpec(
            np.array(ids, draw(st.sampled_from([np.int32, np.int64]))),
            group_sizes,
            block_indices,
        ),
        np.array(chunk_ids, draw(st.sampled_from([np.int32, np.int64]))),
    )


def assert_same_plan(actual: Any, expected: Any, fields: tuple[str, ...]) -> None:
    for name in fields:
        array = getattr(actual, name)
        assert array.dtype == np.uint64, name
        np.testing.assert_array_equal(array, getattr(expected, name), err_msg=name)
    assert actual.num_bytes == expected.num_bytes


FLAT = ("src", "dst", "sizes")
STRIDED = ("src", "dst", "width", "height", "src_pitch", "dst_pitch")
OUT_DTYPES = [None, np.int64, np.uint64]


@given(canonical_cases(), st.booleans(), st.sampled_from(OUT_DTYPES))
def test_flat_plan_matches_reference(
    case: CanonicalCase, store: bool, out_dtype: Any
) -> None:
    expected = case.reference_plan(store)
    table = ptrres.PointerTable(case.kv_caches)
    n = case.max_ops()
    out = (
        None if out_dtype is None else tuple(np.full(n + 2, 9, out_dtype) for _ in FLAT)
    )
    plan = table.plan_transfer(
        case.spec, case.offloaded(), case.offloaded_ids, store=store, out=out
    )
    assert_same_plan(plan, expected, FLAT)
    if out is not None:
        for array, buffer in zip((plan.src, plan.dst, plan.sizes), out):
            assert array.ctypes.data == buffer.ctypes.data or not len(array)
            assert (buffer[len(array) :][n - len(array) :] == 9).all()
    if not store:  # loads keep every block
        assert len(plan.src) == n


@given(canonical_cases(), st.booleans(), st.sampled_from(OUT_DTYPES))
def test_strided_plan_matches_reference_and_expands_to_the_flat_plan(
    case: CanonicalCase, store: bool, out_dtype: Any
) -> None:
    expected = case.reference_strided(store)
    table = ptrres.PointerTable(case.kv_caches)
    n = case.max_ops(strided=True)
    out = (
        None
        if out_dtype is None
        else tuple(np.full(n + 1, 9, out_dtype) for _ in STRIDED)
    )
    plan = table.plan_strided_transfer(
        case.spec, case.offloaded(), case.offloaded_ids, store=store, out=out
    )
    assert_same_plan(plan, expected, STRIDED)
    flat = table.plan_transfer(
        case.spec, case.offloaded(), case.offloaded_ids, store=store
    )
    assert_same_plan(plan.expand(), flat, FLAT)
    if out is not None:
        for name, buffer in zip(STRIDED, out):
            assert (buffer[n:] == 9).all(), name


@given(canonical_cases(), st.booleans())
def test_direct_strided_plan_is_the_direct_plan_one_row_each(
    case: CanonicalCase, store: bool
) -> None:
    pages = {
        t: [r.page_size_bytes for g in case.kv_caches.group_data_refs for r in g
            if r.tensor_idx == t]
        for t in range(len(case.kv_caches.tensors))
    }  # fmt: skip
    bpc = case.blocks_per_chunk
    assume(
        all(
            max(p, default=0) <= case.offloaded_tensors[t].shape[1] // bpc
            for t, p in pages.items()
        )
    )
    table = ptrres.PointerTable(case.kv_caches)
    direct = case.offloaded(canonical=False)
    plan = table.plan_strided_transfer(
        case.spec, direct, case.offloaded_ids, store=store
    )
    assert_same_plan(plan, case.reference_strided(store, canonical=False), STRIDED)
    assert (plan.height == 1).all()
    flat = table.plan_transfer(case.spec, direct, case.offloaded_ids, store=store)
    assert_same_plan(plan.expand(), flat, FLAT)


@given(canonical_cases(), st.booleans(), st.sampled_from([None, 1, 7, 64]))
def test_coalesced_canonical_plan_is_the_coalesced_reference(
    case: CanonicalCase, store: bool, max_run_bytes: Any
) -> None:
    planned = case.reference_plan(store)
    expected = reference.coalesce(
        planned.src, planned.dst, planned.sizes, max_run_bytes=max_run_bytes
    )
    table = ptrres.PointerTable(case.kv_caches)
    plan = table.plan_transfer(
        case.spec,
        case.offloaded(),
        case.offloaded_ids,
        store=store,
        coalesce=True,
        max_run_bytes=max_run_bytes,
    )
    assert_same_plan(plan, expected, FLAT)


def coalesced_against_reference(
    kv: ptrres.CanonicalKVCaches,
    offloaded: list[Any],
    spec: ptrres.GPULoadStoreSpec,
    chunk_ids: np.ndarray,
    store: bool,
) -> tuple[ptrres.TransferPlan, ptrres.TransferPlan]:
    """(the coalesced flat plan, the reference's plan), checked equal once
    merged."""
    planned = reference.plan_canonical_transfer(
        spec, kv, offloaded, 1, chunk_ids, store=store
    )
    layout = ptrres.OffloadedLayout(offloaded, 1, canonical=True)
    plan = ptrres.PointerTable(kv).plan_transfer(
        spec, layout, chunk_ids, store=store, coalesce=True
    )
    merged = reference.coalesce(planned.src, planned.dst, planned.sizes)
    assert_same_plan(plan, merged, FLAT)
    return plan, planned


@pytest.mark.parametrize("store", [True, False])
@pytest.mark.parametrize("num_writers", [1, 3])
def test_coalesced_whole_page_layouts_keep_only_a_writers_pages(
    store: bool, num_writers: int
) -> None:
    """One whole-page fragment per ref (MLA): a coalesced plan merges while it
    fills, as a direct plan does, and a store still keeps only the writer's
    pages, which are num_writers apart and never merge."""
    page, num_blocks = 24, 12
    device = as_tensor(np.arange(num_blocks * page, dtype=np.int32).astype(np.uint8))
    mapping = CanonicalPageMapping(
        page,
        page,
        (CopyRun(0, 0, page, 1, page, page),),
        num_writers,
        1 % num_writers,
        False,
    )
    kv = ptrres.CanonicalKVCaches(
        [ptrres.CanonicalKVCacheTensor(device.reshape(num_blocks, page), page)],
        [[ptrres.CanonicalKVCacheRef(0, page, mapping)] * 2],
    )
    spec = ptrres.GPULoadStoreSpec(np.array([2, 3, 4, 5, 6, 7, 9, 10]), [8], [0])
    chunk_ids = np.arange(3, 11)
    offloaded = [zeros(16, page, dtype="uint8")]
    plan, planned = coalesced_against_reference(kv, offloaded, spec, chunk_ids, store)
    if store and num_writers > 1:
        assert len(plan.sizes) == len(planned.sizes) == 2 * 3  # pages 4, 7, 10
    else:
        assert len(plan.sizes) == 4  # two runs per ref: ids 2-7 and 9-10


@pytest.mark.parametrize("store", [True, False])
def test_coalesced_whole_page_plans_fail_as_plain_ones(store: bool) -> None:
    """Merged one-fragment plans run as direct plans: a bad id still gets the
    canonical plan's error, out= is zeroed, and the table keeps working."""
    page = 16
    mapping = CanonicalPageMapping(
        page, page, (CopyRun(0, 0, page, 1, page, page),), 1, 0, False
    )
    device = zeros(4, page, dtype="uint8")
    table = ptrres.PointerTable(rank_caches(device, mapping))
    offloaded = [zeros(3, page, dtype="uint8")]
    layout = ptrres.OffloadedLayout(offloaded, 1, canonical=True)
    errors: list[tuple[bool, Any, str]] = []
    for coalesce in (False, True):
        out = tuple(np.full(4, 5, np.int64) for _ in range(3))
        for spec, chunks in (([1, 4], [0, 1]), ([1, 2], [0, 3])):
            with pytest.raises(ptrres.PtrresError) as error:
                table.plan_transfer(
                    ptrres.GPULoadStoreSpec(spec), layout, chunks, store=store,
                    out=out, coalesce=coalesce,
                )  # fmt: skip
            errors.append((coalesce, type(error.value), str(error.value)))
            assert all((b[:2] == 0).all() and (b[2:] == 5).all() for b in out)
    assert errors[0][1] is ptrres.BlockIdError
    assert errors[1][1] is ptrres.OffloadedIdError
    assert [e[1:] for e in errors[:2]] == [e[1:] for e in errors[2:]]
    plan = table.plan_transfer(
        ptrres.GPULoadStoreSpec([1, 2]), layout, [0, 1], store=store, coalesce=True
    )
    assert len(plan.sizes) == 1
    assert plan.num_bytes == 2 * page


def test_a_ref_that_never_merges_may_still_continue_the_ref_before() -> None:
    """Ref 1's fragments never continue each other (merging skips them), but
    its first continues ref 0's last on both sides, and joins it."""
    row, sub = 32, 16
    device = zeros(4, row, dtype="uint8")
    ref_0 = CanonicalPageMapping(
        sub, row, (CopyRun(0, 0, 4, 2, 8, 4),), 1, 0, False
    )  # local 0 and 8 -> canonical 0 and 4
    ref_1 = CanonicalPageMapping(
        sub, row, (CopyRun(12, 8, 4, 2, 12, 4),), 1, 0, False
    )  # local 12 and 24 -> canonical 8 and 12
    kv = ptrres.CanonicalKVCaches(
        [ptrres.CanonicalKVCacheTensor(device, row)],
        [[ptrres.CanonicalKVCacheRef(0, row, m) for m in (ref_0, ref_1)]],
    )
    spec = ptrres.GPULoadStoreSpec(np.array([1]), [1], [0])
    offloaded = [zeros(4, sub, dtype="uint8")]
    plan, _ = coalesced_against_reference(kv, offloaded, spec, np.array([2]), True)
    assert plan.sizes.tolist() == [4, 8, 4]


@given(canonical_cases(), st.booleans(), st.booleans())
def test_canonical_plan_from_device_pointers_is_the_same_plan(
    case: CanonicalCase, store: bool, merge: bool
) -> None:
    table = ptrres.PointerTable(case.kv_caches)
    offloaded = case.offloaded()
    device_ptrs = table.resolve(case.spec)
    direct = table.plan_transfer(
        case.spec, offloaded, case.offloaded_ids, store=store, coalesce=merge
    )
    two_step = table.plan_from_device_pointers(
        device_ptrs, offloaded, case.offloaded_ids, store=store, coalesce=merge
    )
    assert_same_plan(two_step, direct, FLAT)


# --- vLLM's own classes and fill, as a second oracle -------------------------


def vllm_fill(case: CanonicalCase, store: bool, vllm_refs: list[list[Any]]) -> Any:
    """Run vLLM's _fill_canonical_ops as transfer_async does, on CPU: 0.33's
    from block ids, or 0.34's from the DevicePointers its pointer_utils
    resolves."""
    worker = importlib.import_module("vllm.v1.kv_offload.cpu.gpu_worker")
    if hasattr(worker, "iter_pointer_groups"):
        return vllm_fill_from_pointers(worker, case, store, vllm_refs)
    handler = worker.SingleDirectionOffloadingHandler
    bpc = case.blocks_per_chunk
    device = [t.tensor for t in case.kv_caches.tensors]
    fake = types.SimpleNamespace(
        gpu_to_cpu=store,
        layer_refs_per_group=vllm_refs,
        src_tensors=device if store else case.offloaded_tensors,
        dst_tensors=case.offloaded_tensors if store else device,
        src_blocks_per_chunk=1 if store else bpc,
        dst_blocks_per_chunk=bpc if store else 1,
        _canonical_copy_plans=[
            [worker._build_copy_plan(ref, store) for ref in refs] for refs in vllm_refs
        ],
        _scratch_bases_src=np.empty(0, np.uint64),
        _scratch_bases_dst=np.empty(0, np.uint64),
    )
    fake._filter_writer_blocks = functools.partial(handler._filter_writer_blocks, fake)
    n = case.max_ops()
    all_src, all_dst, all_sizes = (np.zeros(n, np.int64) for _ in range(3))
    block_ids = np.asarray(case.spec.block_ids).astype(np.int64)
    chunk_ids = case.offloaded_ids.astype(np.int64)
    op = num_bytes = first_id = first_chunk = 0
    for g, (size, index) in enumerate(
        zip(case.spec.group_sizes, case.spec.block_indices)
    ):
        if size == 0:
            continue
        skip = index % bpc
        n_chunks = -(-(size + skip) // bpc)
        ids = block_ids[first_id : first_id + size]
        chunks = chunk_ids[first_chunk : first_chunk + n_chunks]
        first_id += size
        first_chunk += n_chunks
        group_src, group_dst = (ids, chunks) if store else (chunks, ids)
        op, group_bytes = handler._fill_canonical_ops(
            fake, g, group_src, group_dst, size,
            0 if store else skip, skip if store else 0,
            all_src, all_dst, all_sizes, op,
        )  # fmt: skip
        num_bytes += group_bytes
    return all_src[:op], all_dst[:op], all_sizes[:op], num_bytes


def vllm_fill_from_pointers(
    worker: Any, case: CanonicalCase, store: bool, vllm_refs: list[list[Any]]
) -> Any:
    """vLLM 0.34's transfer_async fill: its own resolve_device_pointers and
    iter_pointer_groups, then _fill_canonical_ops per group."""
    pointer_utils = importlib.import_module("vllm.v1.kv_offload.pointer_utils")
    # vLLM's own, not ptrres's patched in: the oracle shares no code.
    assert pointer_utils.resolve_device_pointers.__module__ == pointer_utils.__name__
    handler = worker.SingleDirectionOffloadingHandler
    bpc = case.blocks_per_chunk
    kv = ptrres.CanonicalKVCaches(case.kv_caches.tensors, vllm_refs)
    device_ptrs = pointer_utils.resolve_device_pointers(case.spec, kv)
    fake = types.SimpleNamespace(
        gpu_to_cpu=store,
        layer_refs_per_group=vllm_refs,
        cpu_tensors=case.offloaded_tensors,
        blocks_per_chunk=bpc,
        _canonical_copy_plans=[
            [worker._build_copy_plan(ref, store) for ref in refs] for refs in vllm_refs
        ],
        _scratch_bases_cpu=np.empty(0, np.uint64),
    )
    fake._filter_writer_blocks = functools.partial(handler._filter_writer_blocks, fake)
    n = case.max_ops()
    all_src, all_dst, all_sizes = (np.zeros(n, np.int64) for _ in range(3))
    chunk_ids = case.offloaded_ids.astype(np.int64)
    op = num_bytes = first_chunk = 0
    for g in pointer_utils.iter_pointer_groups(device_ptrs, bpc):
        chunks = chunk_ids[first_chunk : first_chunk + g.n_chunks]
        first_chunk += g.n_chunks
        op, group_bytes = handler._fill_canonical_ops(
            fake, g.group_idx, device_ptrs, g.dev_ptr_offset, chunks,
            g.group_size, g.skip, all_src, all_dst, all_sizes, op,
        )  # fmt: skip
        num_bytes += group_bytes
    return all_src[:op], all_dst[:op], all_sizes[:op], num_bytes


@pytest.mark.needs_vllm
@given(canonical_cases(), st.booleans())
def test_plan_matches_vllms_own_fill_and_classes(
    case: CanonicalCase, store: bool
) -> None:
    base = importlib.import_module("vllm.v1.kv_offload.base")
    # vLLM asserts bpc divides the row (in elements of its int8 tensors).
    vllm_refs = [
        [
            base.CanonicalKVCacheRef(
                ref.tensor_idx,
                ref.page_size_bytes,
                base.CanonicalPageMapping(
                    ref.mapping.canonical_page_size_bytes,
                    ref.mapping.local_page_size_bytes,
                    tuple(
                        base.CopyRun(
                            r.local_offset,
                            r.canonical_offset,
                            r.fragment_size,
                            r.num_fragments,
                            r.local_stride,
                            r.canonical_stride,
                        )
                        for r in ref.mapping.runs
                    ),
                    ref.mapping.num_writers,
                    ref.mapping.writer_index,
                    ref.mapping.parallelism_agnostic,
                ),
            )
            for ref in refs
        ]
        for refs in case.kv_caches.group_data_refs
    ]
    src, dst, sizes, num_bytes = vllm_fill(case, store, vllm_refs)
    kv = ptrres.CanonicalKVCaches(case.kv_caches.tensors, vllm_refs)
    plan = ptrres.PointerTable(kv).plan_transfer(
        case.spec, case.offloaded(), case.offloaded_ids, store=store
    )
    np.testing.assert_array_equal(plan.src, src.view(np.uint64))
    np.testing.assert_array_equal(plan.dst, dst.view(np.uint64))
    np.testing.assert_array_equal(plan.sizes, sizes.view(np.uint64))
    assert plan.num_bytes == num_bytes
    for refs in vllm_refs:
        for ref in refs:
            for block in range(9):
                ours = replace(
                    CanonicalPageMapping(0, 0, (), 1, 0, False),
                    num_writers=ref.mapping.num_writers,
                    writer_index=ref.mapping.writer_index,
                )
                assert ours.is_writer(block) == ref.mapping.is_writer(block)


# --- bytes through pointers ---------------------------------------------------


def copy(plan: ptrres.TransferPlan) -> None:
    for src, dst, size in zip(
        plan.src.tolist(), plan.dst.tolist(), plan.sizes.tolist()
    ):
        ctypes.memmove(dst, src, size)


def nhd_mapping(
    rank: int, tp: int, heads: int, head_bytes: int, block_size: int
) -> Any:
    """vLLM's packed NHD mapping for rank ``rank`` of ``tp``: one run, a
    fragment per token, the rank's heads at their place in the token."""
    row = heads // tp * head_bytes
    return CanonicalPageMapping(
        canonical_page_size_bytes=block_size * tp * row,
        local_page_size_bytes=block_size * row,
        runs=(CopyRun(0, rank * row, row, block_size, row, tp * row),),
        num_writers=1,
        writer_index=0,
        parallelism_agnostic=True,
    )


def rank_caches(tensor: Any, mapping: Any) -> ptrres.CanonicalKVCaches:
    return ptrres.CanonicalKVCaches(
        [ptrres.CanonicalKVCacheTensor(tensor, tensor.shape[1])],
        [[ptrres.CanonicalKVCacheRef(0, mapping.local_page_size_bytes, mapping)]],
    )


@pytest.mark.needs_torch
def test_nhd_store_from_tp2_then_load_into_tp4_moves_exactly_each_shard() -> None:
    import torch

    heads, head_bytes, block_size, num_blocks, bpc = 8, 8, 16, 10, 2
    generator = torch.Generator().manual_seed(0)
    # TP=1 pages: (block, token, head, K and V bytes of the head).
    full = torch.randint(
        0, 256, (num_blocks, block_size, heads, head_bytes), dtype=torch.uint8,
        generator=generator,
    )  # fmt: skip
    canonical = torch.zeros(
        (4, bpc * block_size * heads * head_bytes), dtype=torch.uint8
    )
    layout = ptrres.OffloadedLayout([canonical], bpc, canonical=True)
    blocks = [7, 2, 5]  # request positions 1..3: chunk 3 (sub 1), chunk 0 (0, 1)
    spec = ptrres.GPULoadStoreSpec(np.array(blocks, np.int32), [3], [1])
    chunks = np.array([3, 0])
    for rank in range(2):
        shard = full[:, :, rank * 4 : rank * 4 + 4].reshape(num_blocks, -1).clone()
        mapping = nhd_mapping(rank, 2, heads, head_bytes, block_size)
        plan = ptrres.PointerTable(rank_caches(shard, mapping)).plan_transfer(
            spec, layout, chunks, store=True
        )
        assert len(plan.src) == 3 * block_size
        copy(plan)
    pages = canonical.view(4 * bpc, -1)  # canonical page id -> bytes
    for k, page_id in enumerate([3 * bpc + 1, 0 * bpc + 0, 0 * bpc + 1]):
        assert torch.equal(pages[page_id], full[blocks[k]].reshape(-1))
    untouched = set(range(4 * bpc)) - {7, 0, 1}
    assert all(not pages[p].any() for p in untouched)

    targets = [4, 0, 9]
    load_spec = ptrres.GPULoadStoreSpec(targets, [3], [1])
    for rank in range(4):
        shard = torch.zeros(
            (num_blocks, block_size * 2 * head_bytes), dtype=torch.uint8
        )
        mapping = nhd_mapping(rank, 4, heads, head_bytes, block_size)
        table = ptrres.PointerTable(rank_caches(shard, mapping))
        copy(table.plan_transfer(load_spec, layout, chunks, store=False))
        strided = table.plan_strided_transfer(load_spec, layout, chunks, store=False)
        assert len(strided.src) == 3
        assert (strided.height == block_size).all()
        expected = torch.zeros_like(shard)
        for block, target in zip(blocks, targets):
            expected[target] = full[block, :, rank * 2 : rank * 2 + 2].reshape(-1)
        assert torch.equal(shard, expected)


@pytest.mark.needs_torch
def test_mla_writer_rotation_writes_each_canonical_page_once() -> None:
    import torch

    tp, page, bpc, num_blocks = 4, 24, 4, 12
    canonical = torch.zeros((5, bpc * page), dtype=torch.uint8)
    layout = ptrres.OffloadedLayout([canonical], bpc, canonical=True)
    spec = ptrres.GPULoadStoreSpec(np.arange(1, 11), [10], [3])  # skip 3: 4 chunks
    chunks = np.array([2, 4, 0, 3])
    written: list[int] = []
    for rank in range(tp):
        # Replicated bytes, marked by rank to see who wrote each page.
        device = torch.full((num_blocks, page), rank + 1, dtype=torch.uint8)
        mapping = CanonicalPageMapping(
            page, page, (CopyRun(0, 0, page, 1, page, page),), tp, rank, False
        )
        plan = ptrres.PointerTable(rank_caches(device, mapping)).plan_transfer(
            spec, layout, chunks, store=True
        )
        written += plan.dst.tolist()
        copy(plan)
    # Every page of the transfer is written once, by the rank its id picks.
    base = canonical.data_ptr()
    page_ids = sorted((ptr - base) // page for ptr in written)
    expected_ids = sorted(
        (chunks[(3 + k) // bpc] * bpc + (3 + k) % bpc) for k in range(10)
    )
    assert page_ids == expected_ids
    pages = canonical.view(-1, page)
    for page_id in expected_ids:
        assert (pages[page_id] == page_id % tp + 1).all()


# --- bad mappings ----------------------------------------------------------


def one_ref_layout(mapping: Any, row: int = 64, sub: int = 64) -> Any:
    device = np.zeros((4, row), np.int8)
    kv = ptrres.CanonicalKVCaches(
        [ptrres.CanonicalKVCacheTensor(device, row)],
        [[], [ptrres.CanonicalKVCacheRef(0, 16, mapping)]],
    )
    layout = ptrres.OffloadedLayout(
        [np.zeros((4, 2 * sub), np.int8)], 2, canonical=True
    )
    return ptrres.PointerTable(kv), layout


GOOD = CanonicalPageMapping(64, 32, (CopyRun(0, 0, 8, 4, 8, 16),), 2, 1, False)
BAD_MAPPINGS = {
    "outside the local page": (
        replace(GOOD, runs=(GOOD.runs[0], CopyRun(8, 0, 8, 4, 8, 8))),
        "group 1, ref 0 (tensor 0), run 1: fragment 3 ends at byte 40, outside "
        "the local page (32 B)",
    ),
    "local page outside the row": (
        replace(GOOD, local_page_size_bytes=65),
        "group 1, ref 0 (tensor 0): the mapping's local page of 65 B is larger",
    ),
    "outside the canonical page": (
        replace(GOOD, runs=(CopyRun(0, 21, 8, 4, 8, 12),)),
        "run 0: fragment 3 ends at byte 65, outside the canonical page",
    ),
    "canonical page larger than a sub-block": (
        replace(GOOD, canonical_page_size_bytes=65),
        "group 1, ref 0 (tensor 0): its canonical page of 65 B is larger than a "
        "sub-block of offloaded tensors[0] (64 B",
    ),
    "negative run field": (
        replace(GOOD, runs=(CopyRun(0, 0, 8, 1, -8, 0),)),
        "group 1, ref 0 (tensor 0), run 0: local_stride is negative (-8)",
    ),
    "negative page": (
        replace(GOOD, canonical_page_size_bytes=-1),
        "group 1, ref 0: mapping.canonical_page_size_bytes is negative (-1)",
    ),
    "no writers": (
        replace(GOOD, num_writers=0, writer_index=0),
        "group 1, ref 0: mapping.num_writers must be >= 1, got 0",
    ),
    "writer index outside": (
        replace(GOOD, writer_index=2),
        "group 1, ref 0: mapping.writer_index 2 is outside [0, 2)",
    ),
    "no mapping": (
        None,
        "group 1, ref 0 has no mapping, but the offloaded layout is canonical",
    ),
}


@pytest.mark.parametrize("name", BAD_MAPPINGS)
def test_each_bad_mapping_is_named(name: str) -> None:
    mapping, message = BAD_MAPPINGS[name]
    table, layout = one_ref_layout(mapping)
    spec = ptrres.GPULoadStoreSpec([1, 2], [0, 2], [0, 1])
    with pytest.raises(ptrres.LayoutError) as error:
        table.plan_transfer(spec, layout, [0, 1], store=True)
    assert message in str(error.value)
    with pytest.raises(ptrres.LayoutError):
        table.plan_strided_transfer(spec, layout, [0, 1], store=False)
    with pytest.raises(ptrres.LayoutError):
        table.plan_from_device_pointers(table.resolve(spec), layout, [0, 1], store=True)
    kv = ptrres.CanonicalKVCaches(
        [ptrres.CanonicalKVCacheTensor(np.zeros((4, 64), np.int8), 64)],
        [[], [ptrres.CanonicalKVCacheRef(0, 16, mapping)]],
    )
    with pytest.raises(ptrres.LayoutError):
        reference.plan_canonical_transfer(
            spec, kv, [np.zeros((4, 128), np.int8)], 2, [0, 1], store=True
        )
    # The table keeps working with a good layout and a good mapping.
    good, layout = one_ref_layout(GOOD)
    assert len(good.plan_transfer(spec, layout, [0, 1], store=False).src) == 8


ONE_BLOCK = ptrres.GPULoadStoreSpec([1], [0, 1], [0, 0])


def test_mapping_fields_must_be_integers() -> None:
    table, layout = one_ref_layout(replace(GOOD, num_writers=2.0))  # type: ignore[arg-type]
    with pytest.raises(ptrres.InputTypeError, match=r"mapping\.num_writers"):
        table.plan_transfer(ONE_BLOCK, layout, [0], store=True)
    table, layout = one_ref_layout(replace(GOOD, runs=(object(),)))  # type: ignore[arg-type]
    with pytest.raises(ptrres.InputTypeError, match="run 0 must have"):
        table.plan_transfer(ONE_BLOCK, layout, [0], store=True)


def test_bad_ids_raise_the_errors_of_direct_plans_and_write_nothing() -> None:
    table, layout = one_ref_layout(GOOD)
    out = tuple(np.full(16, 5, np.int64) for _ in range(3))
    with pytest.raises(ptrres.BlockIdError) as error:
        table.plan_transfer(
            ptrres.GPULoadStoreSpec([1, 4], [0, 2], [0, 0]), layout, [0], store=True,
            out=out,
        )  # fmt: skip
    assert (error.value.group, error.value.position, error.value.value) == (1, 1, 4)
    # As for direct plans: the op entries zeroed (8: 2 blocks x 4 fragments).
    assert all((buffer[:8] == 0).all() and (buffer[8:] == 5).all() for buffer in out)
    with pytest.raises(ptrres.OffloadedIdError, match="offloaded id 4"):
        table.plan_strided_transfer(
            ptrres.GPULoadStoreSpec([1, 2], [0, 2], [0, 0]), layout, [4], store=True
        )
    with pytest.raises(ptrres.OffloadedIdError, match="there are 2 offloaded ids"):
        table.plan_transfer(
            ptrres.GPULoadStoreSpec([1, 2], [0, 2], [0, 0]), layout, [0, 1], store=True
        )
    ids = np.zeros(64, np.int64)
    with pytest.raises(ptrres.OutBufferError, match="share memory"):
        table.plan_transfer(
            ptrres.GPULoadStoreSpec([1, 2], [0, 2], [0, 0]), layout, ids[:1],
            store=True, out=(ids[0:16], ids[16:32], ids[32:48]),
        )  # fmt: skip
    with pytest.raises(ptrres.OutBufferError, match="holds 1 entries"):
        table.plan_strided_transfer(
            ptrres.GPULoadStoreSpec([1, 2], [0, 2], [0, 0]), layout, [0], store=True,
            out=tuple(np.zeros(1, np.uint64) for _ in range(6)),
        )  # fmt: skip
    with pytest.raises(ptrres.InputTypeError, match="out must hold 6 buffers"):
        table.plan_strided_transfer(
            ptrres.GPULoadStoreSpec([1], [0, 1], [0, 0]), layout, [0], store=True,
            out=out,
        )  # fmt: skip


def test_canonical_must_be_a_bool() -> None:
    with pytest.raises(ptrres.InputTypeError, match="canonical must be True or False"):
        ptrres.OffloadedLayout([np.zeros((4, 16), np.int8)], 1, canonical=1)  # type: ignore[arg-type]
    assert "canonical=True" in repr(
        ptrres.OffloadedLayout([np.zeros((4, 16), np.int8)], 1, canonical=True)
    )


# --- the benchmark's presets, its vLLM-shaped peer, and the command ----------


@pytest.mark.parametrize("name", list(_bench.CANONICAL_PRESETS))
@pytest.mark.parametrize("block_index", [0, 3])
def test_bench_peer_is_the_reference_on_each_preset(
    name: str, block_index: int
) -> None:
    preset = _bench.CANONICAL_PRESETS[name]
    kv = preset.kv_caches(num_blocks=64)
    spec = _bench.make_spec(
        _bench._ONE_GROUP, 11, num_blocks=64, block_index=block_index
    )
    tensors = preset.offloaded_tensors(4, num_chunks=16)
    ids = _bench.make_offloaded_ids(spec, 4, num_chunks=16)
    for store in (True, False):
        expected = reference.plan_canonical_transfer(
            spec, kv, tensors, 4, ids, store=store
        )
        out = tuple(np.zeros(11 * preset.num_layers * preset.run[3], np.int64)
                    for _ in range(3))  # fmt: skip
        n = _bench.vllm_style_canonical_plan(
            spec, kv, _bench.vllm_canonical_copy_plans(kv, store), tensors, 4, ids,
            store, out,
        )  # fmt: skip
        assert n == len(expected.src)
        assert out[0][:n].view(np.uint64).tolist() == expected.src.tolist()
        assert out[1][:n].view(np.uint64).tolist() == expected.dst.tolist()
        assert out[2][:n].view(np.uint64).tolist() == expected.sizes.tolist()
        plan = ptrres.PointerTable(kv).plan_transfer(
            spec, ptrres.OffloadedLayout(tensors, 4, canonical=True), ids, store=store
        )
        assert_same_plan(plan, expected, FLAT)


def test_bench_canonical_end_to_end(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bench.json"
    status = main(
        ["bench", "--quick", "--operation", "canonical", "--blocks", "8,2",
         "--json", str(out)]
    )  # fmt: skip
    assert status == 0
    printed = capsys.readouterr().out
    assert "llama-3.1-70b-tp4-nhd" in printed
    assert "deepseek-v3-mla-tp8" in printed
    rows = json.loads((tmp_path / "bench-canonical.json").read_text())["results"]
    assert [(r["preset"], r["blocks_per_group"]) for r in rows] == [
        (p, b) for p in _bench.CANONICAL_PRESETS for b in (2, 8)
    ]
    for row in rows:
        n = row["blocks_per_group"]
        if row["preset"] == "llama-3.1-70b-tp4-nhd":  # a load: every block
            assert row["descriptors"] == n * 80 * 16
            assert row["strided_descriptors"] == n * 80
        else:  # a store by rank 3 of 8: the blocks whose page id is 3 mod 8
            assert row["descriptors"] == row["strided_descriptors"] < n * 61
        assert row["flat_speedup"] == pytest.approx(
            row["peer_seconds"] / row["flat_seconds"]
        )
        assert (row["fill_seconds"] is not None) == (n == 8)
    # With another operation, both tables are printed.
    status = main(
        ["bench", "--quick", "--operation", "canonical", "--operation", "resolve",
         "--preset", "deepseek-v3-mla-tp8", "--preset", "qwen2.5-7b", "--blocks", "1"]
    )  # fmt: skip
    assert status == 0
    printed = capsys.readouterr().out
    assert "deepseek-v3-mla-tp8" in printed
    assert "qwen2.5-7b" in printed
    assert "llama-3.1-70b-tp4-nhd" not in printed


@given(canonical_cases(), st.booleans(), st.booleans(), st.integers(-3, 20), st.data())
def test_a_bad_id_fails_as_in_the_reference_and_the_table_keeps_working(
    case: CanonicalCase, store: bool, chunk: bool, value: int, data: Any
) -> None:
    ids = case.offloaded_ids if chunk else np.asarray(case.spec.block_ids)
    assume(len(ids))
    ids = ids.copy()
    ids[data.draw(st.integers(0, len(ids) - 1))] = value
    if chunk:
        bad = replace(case, offloaded_ids=ids)
    else:
        spec = ptrres.GPULoadStoreSpec(
            ids, case.spec.group_sizes, case.spec.block_indices
        )
        bad = replace(case, spec=spec)
    table = ptrres.PointerTable(case.kv_caches)
    try:
        expected: Any = bad.reference_plan(store)
    except (ptrres.BlockIdError, ptrres.OffloadedIdError) as error:
        expected = type(error)
    for plan_strided in (False, True):
        plan = table.plan_strided_transfer if plan_strided else table.plan_transfer
        if isinstance(expected, type):
            with pytest.raises(expected):
                plan(bad.spec, bad.offloaded(), bad.offloaded_ids, store=store)
        else:
            result: Any = plan(
                bad.spec, bad.offloaded(), bad.offloaded_ids, store=store
            )
            flat = result.expand() if plan_strided else result
            assert_same_plan(flat, expected, FLAT)
    good = table.plan_transfer(
        case.spec, case.offloaded(), case.offloaded_ids, store=store
    )
    assert_same_plan(good, case.reference_plan(store), FLAT)
