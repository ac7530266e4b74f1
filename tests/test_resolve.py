"""The compiled resolver against the plain-numpy reference, on generated layouts."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import (
    Case,
    assert_same_pointers,
    cases,
    data_ptr,
    layouts,
    memory_bytes,
    random_tensor,
    row_bytes,
    specs_for,
)
from hypothesis import given
from hypothesis import strategies as st

import ptrres
from ptrres import reference


@given(cases())
def test_table_resolve_matches_reference(case: Case) -> None:
    expected = reference.resolve_device_pointers(case.spec, case.kv_caches)
    out = case.out()
    actual = ptrres.PointerTable(case.kv_caches).resolve(case.spec, out=out)
    assert_same_pointers(actual, expected)
    if out is not None:
        # The result is a view of the caller's buffers; entries past the ops
        # are left alone.
        for result, buffer in zip((actual.ptrs, actual.sizes), out):
            assert result.ctypes.data == buffer.ctypes.data
            assert (buffer[case.num_ops :] == 7).all()


@given(cases())
def test_resolve_device_pointers_matches_reference(case: Case) -> None:
    expected = reference.resolve_device_pointers(case.spec, case.kv_caches)
    actual = ptrres.resolve_device_pointers(case.spec, case.kv_caches)
    assert_same_pointers(actual, expected)
    # A second call reuses the cached table and gives the same answer.
    again = ptrres.resolve_device_pointers(case.spec, case.kv_caches)
    assert_same_pointers(again, expected)


@given(cases(), st.integers(1, 8))
def test_iter_pointer_groups_matches_reference(
    case: Case, blocks_per_chunk: int
) -> None:
    device_ptrs = ptrres.resolve_device_pointers(case.spec, case.kv_caches)
    actual = list(ptrres.iter_pointer_groups(device_ptrs, blocks_per_chunk))
    expected = list(reference.iter_pointer_groups(device_ptrs, blocks_per_chunk))
    assert actual == expected
    assert all(isinstance(info, ptrres.DevicePointerGroupInfo) for info in actual)
    # Non-empty groups only, and each group's ops are where dev_ptr_offset says.
    assert [info.group_idx for info in actual] == [
        g for g, n in enumerate(case.spec.group_sizes) if n
    ]
    for info in actual:
        end = info.dev_ptr_offset + info.group_size * info.n_data_refs
        assert end <= len(device_ptrs.ptrs)
        assert info.n_chunks * blocks_per_chunk >= info.group_size + info.skip
        assert (info.n_chunks - 1) * blocks_per_chunk < info.group_size + info.skip


@given(cases())
def test_every_pointer_reads_back_its_row(case: Case) -> None:
    """Through ctypes, each (ptr, size) holds the first size bytes of its row."""
    device_ptrs = ptrres.resolve_device_pointers(case.spec, case.kv_caches)
    op = 0
    first_id = 0
    for n, refs in zip(case.spec.group_sizes, case.kv_caches.group_data_refs):
        ids = case.spec.block_ids[first_id : first_id + n]
        for ref in refs:
            tensor = case.kv_caches.tensors[ref.tensor_idx].tensor
            for block in ids:
                ptr, size = int(device_ptrs.ptrs[op]), int(device_ptrs.sizes[op])
                assert size == ref.page_size_bytes
                assert ptr == data_ptr(tensor[int(block)])
                assert memory_bytes(ptr, size) == row_bytes(tensor, int(block))[:size]
                op += 1
        first_id += n
    assert op == len(device_ptrs.ptrs)


@pytest.mark.needs_torch
def test_padded_rows_of_every_dtype_read_back() -> None:
    """Rows narrower than their stride, in each dtype: a fixed, readable case."""
    import torch

    tensors = [
        random_tensor(6, 10, 6, dtype, seed)
        for seed, dtype in enumerate(
            [torch.int8, torch.bfloat16, torch.float16, torch.float32]
        )
    ]
    kv_caches = ptrres.CanonicalKVCaches(
        [
            ptrres.CanonicalKVCacheTensor(t, t.stride(0) * t.element_size())
            for t in tensors
        ],
        [
            [
                ptrres.CanonicalKVCacheRef(i, 10 * t.element_size())
                for i, t in enumerate(tensors)
            ]
        ],
    )
    spec = ptrres.GPULoadStoreSpec(np.array([5, 0, 3], np.int32))
    device_ptrs = ptrres.resolve_device_pointers(spec, kv_caches)
    assert len(device_ptrs.ptrs) == 12
    for op, (ptr, size) in enumerate(zip(device_ptrs.ptrs, device_ptrs.sizes)):
        tensor = tensors[op // 3]
        block = int(spec.block_ids[op % 3])
        assert int(ptr) - tensor.data_ptr() == block * 16 * tensor.element_size()
        assert memory_bytes(int(ptr), int(size)) == row_bytes(tensor, block)


@given(layouts(), st.data())
def test_int32_and_int64_ids_resolve_alike(
    kv_caches: ptrres.CanonicalKVCaches, data: st.DataObject
) -> None:
    spec = data.draw(specs_for(kv_caches))
    other = ptrres.GPULoadStoreSpec(
        spec.block_ids.astype(
            np.int64 if spec.block_ids.dtype == np.int32 else np.int32
        ),
        spec.group_sizes,
        spec.block_indices,
    )
    table = ptrres.PointerTable(kv_caches)
    assert_same_pointers(table.resolve(spec), table.resolve(other))


@pytest.mark.needs_torch  # data_ptr(): llama_like's torch tensors
def test_worked_example(llama_like: ptrres.CanonicalKVCaches) -> None:
    """One case written out by hand: offsets are block * row stride."""
    spec = ptrres.GPULoadStoreSpec(
        np.array([4, 1, 9]), group_sizes=[2, 1], block_indices=[0, 6]
    )
    device_ptrs = ptrres.resolve_device_pointers(spec, llama_like)
    bases = [entry.tensor.data_ptr() for entry in llama_like.tensors]
    expected = [
        bases[0] + 4 * 64, bases[0] + 1 * 64,
        bases[1] + 4 * 64, bases[1] + 1 * 64,
        bases[2] + 4 * 64, bases[2] + 1 * 64,
        bases[2] + 9 * 64,
        bases[3] + 9 * 64,
    ]  # fmt: skip
    assert device_ptrs.ptrs.tolist() == expected
    assert device_ptrs.sizes.tolist() == [64] * 6 + [48, 64]
    assert device_ptrs.group_block_counts == (2, 1)
    assert device_ptrs.group_data_ref_counts == (3, 2)
    assert device_ptrs.block_indices == (0, 6)
    infos = list(ptrres.iter_pointer_groups(device_ptrs, 4))
    assert infos == [
        ptrres.DevicePointerGroupInfo(0, 2, 3, skip=0, n_chunks=1, dev_ptr_offset=0),
        ptrres.DevicePointerGroupInfo(1, 1, 2, skip=2, n_chunks=1, dev_ptr_offset=6),
    ]


@pytest.mark.needs_torch
def test_empty_transfer_and_groups_without_refs() -> None:
    import torch

    tensor = random_tensor(4, 8, 0, torch.int8, 0)
    kv_caches = ptrres.CanonicalKVCaches(
        [ptrres.CanonicalKVCacheTensor(tensor, 8)],
        [[], [ptrres.CanonicalKVCacheRef(0, 8)], []],
    )
    empty = ptrres.resolve_device_pointers(
        ptrres.GPULoadStoreSpec(np.zeros(0, np.int64), [0, 0, 0], [0, 0, 0]), kv_caches
    )
    assert len(empty.ptrs) == 0
    assert empty.group_data_ref_counts == (0, 1, 0)
    # Ids of a group without refs produce no op and address nothing.
    spec = ptrres.GPULoadStoreSpec(np.array([2, 3, 1]), [2, 1, 0], [0, 0, 0])
    device_ptrs = ptrres.resolve_device_pointers(spec, kv_caches)
    assert device_ptrs.ptrs.tolist() == [tensor.data_ptr() + 8]
    assert [i.group_idx for i in ptrres.iter_pointer_groups(device_ptrs, 2)] == [0, 1]


@pytest.mark.needs_torch
def test_group_size_arrays_are_memoised_and_bounded() -> None:
    """A table keeps the arrays of recent group sizes, at most 256 of them."""
    import torch

    tensor = random_tensor(600, 8, 0, torch.int8, 0)
    kv_caches = ptrres.CanonicalKVCaches(
        [ptrres.CanonicalKVCacheTensor(tensor, 8)], [[ptrres.CanonicalKVCacheRef(0, 8)]]
    )
    table = ptrres.PointerTable(kv_caches)
    for n in range(1, 300):
        spec = ptrres.GPULoadStoreSpec(np.arange(n))
        device_ptrs = table.resolve(spec)
        assert device_ptrs.ptrs.tolist() == [tensor[b].data_ptr() for b in range(n)]
        assert len(table._group_arrays) <= 256
    again = table._group_arrays[((299,),)]
    table.resolve(ptrres.GPULoadStoreSpec(np.arange(299)))
    assert table._group_arrays[((299,),)] is again
