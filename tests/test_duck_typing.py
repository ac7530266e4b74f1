"""The drop-ins take any objects with vLLM's attribute names, and cache safely."""

from __future__ import annotations

import gc
from collections import namedtuple
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
from conftest import assert_same_pointers, dtype_of, random_tensor

import ptrres
from ptrres import _pointer_utils, reference


# Stand-ins shaped like vLLM's own classes (vllm.v1.kv_offload), not ptrres'.
class VllmGPULoadStoreSpec:
    def __init__(
        self, block_ids: list[int], group_sizes: list[int], block_indices: list[int]
    ):
        self.block_ids = np.array(block_ids, dtype=np.int64)
        self.group_sizes = group_sizes
        self.block_indices = block_indices


@dataclass
class VllmTensor:
    tensor: Any  # torch's, or a numpy array without torch
    page_size_bytes: int


@dataclass
class VllmRef:
    tensor_idx: int
    page_size_bytes: int
    mapping: Any = None


@dataclass
class VllmKVCaches:
    tensors: list[VllmTensor]
    group_data_refs: list[list[VllmRef]]


def vllm_layout() -> VllmKVCaches:
    tensors = [
        VllmTensor(random_tensor(8, 32, 0, dtype_of("int8"), t), 32) for t in range(3)
    ]
    return VllmKVCaches(tensors, [[VllmRef(0, 32), VllmRef(1, 32)], [VllmRef(2, 16)]])


def test_vllm_shaped_objects() -> None:
    kv = vllm_layout()
    spec = VllmGPULoadStoreSpec([3, 1, 7, 0], [3, 1], [0, 5])
    expected = reference.resolve_device_pointers(spec, kv)
    assert_same_pointers(ptrres.resolve_device_pointers(spec, kv), expected)
    assert_same_pointers(ptrres.PointerTable(kv).resolve(spec), expected)
    device_ptrs = SimpleNamespace(
        group_block_counts=[3, 1], group_data_ref_counts=[2, 1], block_indices=[0, 5]
    )
    assert list(ptrres.iter_pointer_groups(device_ptrs, 4)) == [
        ptrres.DevicePointerGroupInfo(0, 3, 2, 0, 1, 0),
        ptrres.DevicePointerGroupInfo(1, 1, 1, 1, 1, 6),
    ]


def test_namespaces_tuples_and_numpy_arrays() -> None:
    """Plain namespaces, namedtuples (not weak-referenceable), numpy tensors."""
    arrays = [np.arange(80, dtype=np.float32).reshape(10, 8) + t for t in range(2)]
    Ref = namedtuple("Ref", "tensor_idx page_size_bytes")
    KV = namedtuple("KV", "tensors group_data_refs")
    kv = KV(
        tensors=[SimpleNamespace(tensor=a, page_size_bytes=32) for a in arrays],
        group_data_refs=[[Ref(1, 32), Ref(0, 16)]],
    )
    spec = SimpleNamespace(
        block_ids=np.array([9, 2], np.int32),
        group_sizes=np.array([2]),
        block_indices=(3,),
    )
    device_ptrs = ptrres.resolve_device_pointers(spec, kv)
    assert_same_pointers(device_ptrs, reference.resolve_device_pointers(spec, kv))
    assert device_ptrs.ptrs.tolist() == [
        arrays[1][9].ctypes.data, arrays[1][2].ctypes.data,
        arrays[0][9].ctypes.data, arrays[0][2].ctypes.data,
    ]  # fmt: skip
    assert device_ptrs.group_block_counts == (2,)
    assert all(type(n) is int for n in device_ptrs.group_block_counts)
    assert_same_pointers(ptrres.resolve_device_pointers(spec, kv), device_ptrs)


def test_table_cache_follows_the_kv_caches_object() -> None:
    ptrres.clear_table_cache()
    kv = vllm_layout()
    first = _pointer_utils.table_for(kv)
    assert _pointer_utils.table_for(kv) is first
    # Rebinding the tensors list rebuilds the table with the new pointers.
    kv.tensors = [
        VllmTensor(random_tensor(8, 32, 0, dtype_of("int8"), 9 + t), 32)
        for t in range(3)
    ]
    second = _pointer_utils.table_for(kv)
    assert second is not first
    spec = VllmGPULoadStoreSpec([1, 2, 3, 4], [3, 1], [0, 0])
    assert_same_pointers(
        ptrres.resolve_device_pointers(spec, kv),
        reference.resolve_device_pointers(spec, kv),
    )
    # An equal but distinct object gets its own table.
    other = VllmKVCaches(kv.tensors, kv.group_data_refs)
    assert _pointer_utils.table_for(other) is not second
    # A dead kv_caches leaves the cache, and never keeps its tensors alive.
    key = id(kv)
    del kv
    gc.collect()
    assert key not in _pointer_utils._tables


def test_table_cache_is_bounded() -> None:
    ptrres.clear_table_cache()
    layouts = [vllm_layout() for _ in range(20)]
    tables = [_pointer_utils.table_for(kv) for kv in layouts]
    assert len(_pointer_utils._tables) <= 8
    # The most recent layouts are still cached; an evicted one is rebuilt right.
    assert _pointer_utils.table_for(layouts[-1]) is tables[-1]
    spec = VllmGPULoadStoreSpec([1, 2, 3, 4], [3, 1], [0, 0])
    assert_same_pointers(
        ptrres.resolve_device_pointers(spec, layouts[0]),
        reference.resolve_device_pointers(spec, layouts[0]),
    )


def test_ptrres_types_look_like_vllms() -> None:
    spec = ptrres.GPULoadStoreSpec([4, 5, 6])
    assert spec.block_ids.dtype == np.int64
    assert (spec.group_sizes, spec.block_indices) == ((3,), (0,))
    assert ptrres.GPULoadStoreSpec(np.array([1], np.int32)).block_ids.dtype == np.int32
    assert ptrres.GPULoadStoreSpec([]).block_ids.dtype == np.int64
    assert "block_ids=array([4, 5, 6])" in repr(spec)
    assert ptrres.DevicePointerGroupInfo._fields == (
        "group_idx", "group_size", "n_data_refs", "skip", "n_chunks", "dev_ptr_offset",
    )  # fmt: skip
    assert ptrres.CanonicalKVCacheRef(0, 8).mapping is None
