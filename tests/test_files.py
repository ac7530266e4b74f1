"""File-tier ops (SPEC 11): plan_file_ops against the reference, and its checks."""

from __future__ import annotations

import itertools
from typing import Any

import hypothesis.strategies as st
import numpy as np
import pytest
from conftest import layouts, specs_for
from hypothesis import given

import ptrres
from ptrres import reference

LAYOUTS = ["ref-major", "block-major"]


@st.composite
def device_pointers(draw: Any) -> ptrres.DevicePointers:
    """DevicePointers of up to 4 groups: empty groups, groups without refs,
    refs whose pages differ, pointers in runs (so that some ops continue on the
    device side) or anywhere."""
    ptrs: list[int] = []
    sizes: list[int] = []
    counts, ref_counts, indices = [], [], []
    for _ in range(draw(st.integers(0, 4))):
        n = draw(st.integers(0, 7))
        n_refs = draw(st.integers(0, 3))
        block_ids = draw(st.lists(st.integers(0, 20), min_size=n, max_size=n))
        if draw(st.booleans()):  # consecutive blocks: device contiguity
            start = draw(st.integers(0, 20))
            block_ids = list(range(start, start + n))
        for _ in range(n_refs):
            page = draw(st.sampled_from([0, 8, 16, 24, 64]))
            stride = page + draw(st.sampled_from([0, 0, 8]))
            base = draw(st.integers(1, 1 << 20)) << 12
            ptrs += [base + b * stride for b in block_ids]
            sizes += [page] * n
        counts.append(n)
        ref_counts.append(n_refs)
        indices.append(draw(st.integers(0, 20)))
    dtype = draw(st.sampled_from([np.uint64, np.int64]))
    return ptrres.DevicePointers(
        np.array(ptrs, dtype),
        np.array(sizes, dtype),
        tuple(counts),
        tuple(ref_counts),
        tuple(indices),
    )


caps = st.one_of(st.none(), st.integers(1, 200))


def assert_same_plan(actual: ptrres.FilePlan, expected: ptrres.FilePlan) -> None:
    for name in ("dev_ptrs", "file_offsets", "sizes"):
        assert getattr(actual, name).dtype == np.uint64
        np.testing.assert_array_equal(getattr(actual, name), getattr(expected, name))
    for name in ("file_starts", "file_groups", "file_bytes"):
        assert getattr(actual, name).dtype == np.int64
        np.testing.assert_array_equal(getattr(actual, name), getattr(expected, name))
    assert actual.num_bytes == expected.num_bytes
    assert isinstance(actual.num_bytes, int)


def file_ops(plan: ptrres.FilePlan, f: int) -> list[tuple[int, int, int]]:
    ops = slice(plan.file_starts[f], plan.file_starts[f + 1])
    return list(
        zip(
            plan.dev_ptrs[ops].tolist(),
            plan.file_offsets[ops].tolist(),
            plan.sizes[ops].tolist(),
        )
    )


@given(
    device_pointers(),
    st.integers(1, 8),
    st.sampled_from(LAYOUTS),
    st.booleans(),
    caps,
    st.sampled_from([None, np.int64, np.uint64]),
)
def test_plan_file_ops_matches_reference(
    device_ptrs: Any, bpc: int, layout: str, merge: bool, cap: Any, out_dtype: Any
) -> None:
    expected = reference.plan_file_ops(
        device_ptrs, bpc, layout=layout, coalesce=merge, max_run_bytes=cap
    )
    n = len(device_ptrs.ptrs)
    out = (
        None
        if out_dtype is None
        else tuple(np.full(n + 2, 7, out_dtype) for _ in "abc")
    )
    actual = ptrres.plan_file_ops(
        device_ptrs, bpc, layout=layout, coalesce=merge, max_run_bytes=cap, out=out
    )
    assert_same_plan(actual, expected)
    if out is not None:
        for buffer, array in zip(
            out, (actual.dev_ptrs, actual.file_offsets, actual.sizes)
        ):
            assert len(array) == 0 or np.shares_memory(buffer, array)


@given(device_pointers(), st.integers(1, 8), st.sampled_from(LAYOUTS))
def test_files_follow_the_spec_formula(device_ptrs: Any, bpc: int, layout: str) -> None:
    """SPEC 11 written out per block, independent of how the reference loops."""
    plan = ptrres.plan_file_ops(device_ptrs, bpc, layout=layout)
    f = 0
    first = 0
    for g, (n, n_refs, index) in enumerate(
        zip(
            device_ptrs.group_block_counts,
            device_ptrs.group_data_ref_counts,
            device_ptrs.block_indices,
        )
    ):
        if n == 0:
            continue
        skip = index % bpc
        pages = [int(device_ptrs.sizes[first + d * n]) for d in range(n_refs)]
        expected: dict[int, list[tuple[int, int, int]]] = {}
        for d in range(n_refs):
            for k in range(n):
                chunk, slot = divmod(skip + k, bpc)
                before = sum(pages[:d])
                offset = (
                    bpc * before + slot * pages[d]
                    if layout == "ref-major"
                    else slot * sum(pages) + before
                )
                ptr = int(device_ptrs.ptrs.view(np.uint64)[first + d * n + k])
                expected.setdefault(chunk, []).append((ptr, offset, pages[d]))
        n_chunks = -(-(n + skip) // bpc)
        for chunk in range(n_chunks):
            assert plan.file_groups[f] == g
            assert plan.file_bytes[f] == bpc * sum(pages)
            assert file_ops(plan, f) == expected.get(chunk, [])
            f += 1
        first += n * n_refs
    assert plan.num_files == f


@given(device_pointers(), st.integers(1, 8), st.sampled_from(LAYOUTS), caps)
def test_coalescing_keeps_each_files_byte_mapping(
    device_ptrs: Any, bpc: int, layout: str, cap: Any
) -> None:
    """Merged ops cover exactly the unmerged ops of the same file, in order,
    each on both sides, upwards or downwards; two ops of one ref stay apart
    only when one side breaks or the cap would be passed."""
    plain = ptrres.plan_file_ops(device_ptrs, bpc, layout=layout)
    merged = ptrres.plan_file_ops(
        device_ptrs, bpc, layout=layout, coalesce=True, max_run_bytes=cap
    )
    assert merged.num_files == plain.num_files
    np.testing.assert_array_equal(merged.file_bytes, plain.file_bytes)
    assert merged.num_bytes == plain.num_bytes
    for f in range(plain.num_files):
        # Zero-byte ops map no bytes: they may merge into any op they touch.
        unmerged = [op for op in file_ops(plain, f) if op[2]]
        runs = [op for op in file_ops(merged, f) if op[2]]
        i = 0
        for ptr, offset, size in runs:
            if cap is not None and size > cap:
                assert size == unmerged[i][2]  # a page over the cap, alone
            covered, ops = 0, []
            while covered < size:
                ops.append(unmerged[i])
                covered += unmerged[i][2]
                i += 1
            assert covered == size
            # Upwards from the run's start, or downwards from its end.
            ends = list(itertools.accumulate(z for _, _, z in ops))
            up = [ptr + end - z for end, (_, _, z) in zip(ends, ops)]
            down = [ptr + size - end for end in ends]
            assert [p for p, _, _ in ops] in (up, down)
            for p, o, _ in ops:
                assert p - ptr == o - offset  # the same shift on both sides
        assert i == len(unmerged)


@given(layouts(), st.data(), st.integers(1, 8), st.sampled_from(LAYOUTS), st.booleans())
def test_table_plan_is_resolve_then_plan(
    kv_caches: Any, data: Any, bpc: int, layout: str, merge: bool
) -> None:
    spec = data.draw(specs_for(kv_caches))
    table = ptrres.PointerTable(kv_caches)
    expected = reference.plan_file_ops(
        reference.resolve_device_pointers(spec, kv_caches),
        bpc,
        layout=layout,
        coalesce=merge,
    )
    assert_same_plan(
        table.plan_file_ops(spec, bpc, layout=layout, coalesce=merge), expected
    )


def worker_pointers(
    pages: list[int], block_ids: list[int], block_index: int
) -> ptrres.DevicePointers:
    """One group; ref d's blocks are rows of a tensor of rows of pages[d] bytes."""
    ptrs, sizes = [], []
    for d, page in enumerate(pages):
        base = (d + 1) << 24
        ptrs += [base + b * page for b in block_ids]
        sizes += [page] * len(block_ids)
    return ptrres.DevicePointers(
        np.array(ptrs, np.uint64),
        np.array(sizes, np.uint64),
        (len(block_ids),),
        (len(pages),),
        (block_index,),
    )


def test_partial_first_chunk_starts_at_its_slot() -> None:
    """PR #56076's first revision ignored block_indices: a group starting at
    block 6 of a 4-block chunk went to slots 0.. instead of 2.."""
    plan = ptrres.plan_file_ops(worker_pointers([16, 16], [5, 9, 2], 6), 4)
    assert plan.num_files == 2
    # File 0: slots 2 and 3 of each ref's region of 4 slots.
    assert plan.file_offsets[: plan.file_starts[1]].tolist() == [32, 48, 96, 112]
    # File 1: slot 0.
    assert plan.file_offsets[plan.file_starts[1] :].tolist() == [0, 64]


def test_device_only_contiguity_does_not_merge() -> None:
    """PR #56076's later revision merged ops contiguous on the device side
    only. Here ref 1's pages follow ref 0's on the device (one tensor, rows of
    both refs back to back), but in the ref-major file ref 1's slot 0 is at
    bpc * page, not right after ref 0's slot 0."""
    page = 32
    ptrs = np.array([0x10000, 0x10000 + page], np.uint64)
    device_ptrs = ptrres.DevicePointers(
        ptrs, np.full(2, page, np.uint64), (1,), (2,), (0,)
    )
    plan = ptrres.plan_file_ops(device_ptrs, 4, coalesce=True)
    assert plan.sizes.tolist() == [page, page]
    assert plan.file_offsets.tolist() == [0, 4 * page]
    # In block-major, both sides continue: one op.
    merged = ptrres.plan_file_ops(device_ptrs, 4, layout="block-major", coalesce=True)
    assert merged.sizes.tolist() == [2 * page]


def test_refs_with_different_pages_get_their_own_slot_sizes() -> None:
    """The PR took each ref's slot size from the first op; refs differ here."""
    plan = ptrres.plan_file_ops(worker_pointers([8, 24], [0, 1], 0), 2)
    assert plan.file_offsets.tolist() == [0, 8, 16, 40]
    assert plan.file_bytes.tolist() == [64]
    block_major = ptrres.plan_file_ops(
        worker_pointers([8, 24], [0, 1], 0), 2, layout="block-major"
    )
    assert block_major.file_offsets.tolist() == [0, 32, 8, 40]


def test_ref_major_with_equal_pages_is_the_prs_formula() -> None:
    page, bpc = 48, 4
    plan = ptrres.plan_file_ops(worker_pointers([page] * 3, [7, 1, 3, 4, 5], 1), bpc)
    for f in range(plan.num_files):
        ops = file_ops(plan, f)
        for i, (ptr, offset, _) in enumerate(ops):
            d = (ptr >> 24) - 1
            k = [7, 1, 3, 4, 5].index((ptr - ((d + 1) << 24)) // page)
            slot = (1 + k) % bpc
            assert offset == (d * bpc + slot) * page, (f, i)


# ---- bad input -------------------------------------------------------------


def good_pointers() -> ptrres.DevicePointers:
    return worker_pointers([16, 32], [1, 2, 3], 0)


@pytest.mark.parametrize(
    ("change", "kwargs", "error", "pattern"),
    [
        ({}, {"blocks_per_chunk": 0}, ptrres.SpecError, "blocks_per_chunk"),
        ({}, {"blocks_per_chunk": 2**63}, ptrres.SpecError, "blocks_per_chunk"),
        ({}, {"blocks_per_chunk": 2.0}, ptrres.InputTypeError, "blocks_per_chunk"),
        ({}, {"layout": "row-major"}, ptrres.SpecError, "layout"),
        ({}, {"layout": None}, ptrres.InputTypeError, "layout"),
        ({}, {"coalesce": 1}, ptrres.InputTypeError, "coalesce"),
        ({}, {"max_run_bytes": 0}, ptrres.SpecError, "max_run_bytes"),
        ({}, {"max_run_bytes": "4"}, ptrres.InputTypeError, "max_run_bytes"),
        (
            {"sizes": np.array([16, 16, 16, 32, 32, 33], np.uint64)},
            {},
            ptrres.SpecError,
            "group 0, ref 1, position 2: size 33",
        ),
        (
            {"sizes": np.array([2**61] * 3 + [32] * 3, np.uint64)},
            {"blocks_per_chunk": 4},
            ptrres.SpecError,
            "group 0: a file",
        ),
        ({"ptrs": np.zeros(5, np.uint64)}, {}, ptrres.SpecError, "5 ptrs"),
        ({"ptrs": [1, 2, 3, 4, 5, 6]}, {}, ptrres.InputTypeError, "numpy array"),
        (
            {"ptrs": np.zeros(6, np.float64)},
            {},
            ptrres.InputTypeError,
            "int64 or uint64",
        ),
        ({"group_block_counts": (3, 1)}, {}, ptrres.SpecError, "entries"),
        ({"group_block_counts": (-3,)}, {}, ptrres.SpecError, "group 0"),
        ({"group_data_ref_counts": ("2",)}, {}, ptrres.InputTypeError, "n_data_refs"),
        ({"block_indices": (-1,)}, {}, ptrres.SpecError, "block index"),
    ],
)
def test_bad_input(
    change: dict[str, Any], kwargs: dict[str, Any], error: Any, pattern: str
) -> None:
    device_ptrs = good_pointers()
    for name, value in change.items():
        setattr(device_ptrs, name, value)
    kwargs = {"blocks_per_chunk": 2, **kwargs}
    bpc = kwargs.pop("blocks_per_chunk")
    with pytest.raises(error, match=pattern):
        ptrres.plan_file_ops(device_ptrs, bpc, **kwargs)
    with pytest.raises(error):
        reference.plan_file_ops(device_ptrs, bpc, **kwargs)
    # The library keeps working.
    assert ptrres.plan_file_ops(good_pointers(), 2).num_files == 2


def test_not_device_pointers() -> None:
    with pytest.raises(ptrres.InputTypeError, match="device_ptrs must have"):
        ptrres.plan_file_ops(object(), 2)


def test_bad_out_buffers() -> None:
    device_ptrs = good_pointers()
    n = len(device_ptrs.ptrs)
    with pytest.raises(ptrres.OutBufferError, match=r"out\[1\] \(file_offsets\)"):
        ptrres.plan_file_ops(
            device_ptrs,
            2,
            out=(
                np.zeros(n, np.uint64),
                np.zeros(n - 1, np.uint64),
                np.zeros(n, np.uint64),
            ),
        )
    with pytest.raises(ptrres.InputTypeError, match="3 buffers"):
        ptrres.plan_file_ops(device_ptrs, 2, out=(np.zeros(n, np.uint64),) * 2)
    shared = np.zeros(n, np.uint64)
    with pytest.raises(ptrres.OutBufferError, match="share memory"):
        ptrres.plan_file_ops(
            device_ptrs, 2, out=(shared, np.zeros(n, np.uint64), shared)
        )
    with pytest.raises(ptrres.OutBufferError, match="share memory"):
        ptrres.plan_file_ops(
            device_ptrs,
            2,
            out=(device_ptrs.ptrs, np.zeros(n, np.uint64), np.zeros(n, np.uint64)),
        )


def test_table_plan_checks_block_ids(llama_like: Any) -> None:
    table = ptrres.PointerTable(llama_like)
    spec = ptrres.GPULoadStoreSpec(np.array([1, 2, 3, 10]), [2, 2], [0, 1])
    n = 2 * 3 + 2 * 2
    out = tuple(np.full(n, 7, np.uint64) for _ in "abc")
    with pytest.raises(
        ptrres.BlockIdError, match="group 1, position 1: block id 10"
    ) as exc:
        table.plan_file_ops(spec, 2, out=out)
    assert (exc.value.group, exc.value.position, exc.value.value) == (1, 1, 10)
    for buffer in out:
        assert (buffer == 7).all()  # nothing written
    with pytest.raises(ptrres.SpecError, match="sum to"):
        table.plan_file_ops(ptrres.GPULoadStoreSpec(np.array([1]), [2, 0], [0, 0]), 2)
    with pytest.raises(ptrres.InputTypeError, match="device_spec"):
        table.plan_file_ops(object(), 2)
    with pytest.raises(ptrres.SpecError, match="layout"):
        table.plan_file_ops(spec, 2, layout="x")
    ok = ptrres.GPULoadStoreSpec(np.array([1, 2, 3, 9], np.int32), [2, 2], [0, 1])
    assert_same_plan(
        table.plan_file_ops(ok, 2),
        reference.plan_file_ops(reference.resolve_device_pointers(ok, llama_like), 2),
    )
    ids = np.array([1, 2, 3, 9] + [0] * n, np.int64)
    with pytest.raises(ptrres.OutBufferError, match="share memory"):
        table.plan_file_ops(
            ptrres.GPULoadStoreSpec(ids[:4], [2, 2], [0, 1]),
            2,
            out=(ids.view(np.uint64), np.zeros(n, np.uint64), np.zeros(n, np.uint64)),
        )


def test_table_plan_file_too_large() -> None:
    tensor = np.zeros((4, 16), np.int8)
    kv = ptrres.CanonicalKVCaches(
        [ptrres.CanonicalKVCacheTensor(tensor, 16)],
        [[ptrres.CanonicalKVCacheRef(0, 16)] * 2],
    )
    spec = ptrres.GPULoadStoreSpec(np.array([0, 1]))
    with pytest.raises(ptrres.SpecError, match="group 0: a file"):
        ptrres.PointerTable(kv).plan_file_ops(spec, 2**62)


@pytest.mark.parametrize("preset", ["llama-3.1-8b", "hybrid-4x12"])
def test_bench_peer_builds_the_same_ops(preset: str) -> None:
    """The PR worker's op building that `ptrres bench --operation files` times
    builds exactly plan_file_ops' ops, file by file."""
    from ptrres.bench import PRESETS, bench_cell, make_spec, pr_worker_file_ops

    layout = PRESETS[preset]
    spec = make_spec(layout, 6, block_index=3)
    device_ptrs = ptrres.PointerTable(layout.kv_caches()).resolve(spec)
    plan = ptrres.plan_file_ops(device_ptrs, 4)
    assert [
        [(ptr, size, offset) for ptr, offset, size in file_ops(plan, f)]
        for f in range(plan.num_files)
    ] == pr_worker_file_ops(device_ptrs, 4)
    row = bench_cell(layout, "files", 2, seconds=0.01, with_fill=True)
    assert (row.operation, row.ops, row.descriptors) == (
        "files",
        2 * layout.num_refs,
        2 * layout.num_refs,
    )
