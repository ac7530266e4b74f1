"""Bad input (SPEC section 7): a clear error, nothing lost, the next call works."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from conftest import (
    as_tensor,
    assert_same_pointers,
    data_ptr,
    dtype_of,
    random_tensor,
    with_torch,
    zeros,
)

import ptrres
from ptrres import reference

if with_torch():  # its tests are marked needs_torch
    import torch

RESOLVERS = {
    "table": lambda spec, kv: ptrres.PointerTable(kv).resolve(spec),
    "drop-in": ptrres.resolve_device_pointers,
    "reference": reference.resolve_device_pointers,
}


@pytest.fixture(params=list(RESOLVERS))
def resolve(request: pytest.FixtureRequest):
    return RESOLVERS[request.param]


@pytest.fixture
def kv() -> ptrres.CanonicalKVCaches:
    """Group 0: tensors 0 (10 blocks) and 1 (6 blocks); group 1: tensor 1."""
    tensors = [
        random_tensor(10, 16, 0, dtype_of("int8"), 0),
        random_tensor(6, 16, 0, dtype_of("int8"), 1),
    ]
    return ptrres.CanonicalKVCaches(
        [ptrres.CanonicalKVCacheTensor(t, 16) for t in tensors],
        [
            [ptrres.CanonicalKVCacheRef(0, 16), ptrres.CanonicalKVCacheRef(1, 16)],
            [ptrres.CanonicalKVCacheRef(1, 8)],
        ],
    )


def good_spec() -> ptrres.GPULoadStoreSpec:
    return ptrres.GPULoadStoreSpec(np.array([1, 2, 3]), [2, 1], [0, 0])


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_negative_block_id(resolve, kv, dtype) -> None:
    spec = ptrres.GPULoadStoreSpec(np.array([1, 2, -1], dtype), [2, 1], [0, 0])
    with pytest.raises(
        ptrres.BlockIdError, match=r"group 1, position 0.*block id -1"
    ) as info:
        resolve(spec, kv)
    assert (info.value.group, info.value.position, info.value.value) == (1, 0, -1)
    assert isinstance(info.value, ValueError)
    assert_same_pointers(
        resolve(good_spec(), kv), reference.resolve_device_pointers(good_spec(), kv)
    )


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_block_id_past_the_tensor(resolve, kv, dtype) -> None:
    # 7 fits tensor 0 (10 blocks) but not tensor 1 (6 blocks), ref 1 of group 0.
    spec = ptrres.GPULoadStoreSpec(np.array([3, 7, 0], dtype), [2, 1], [0, 0])
    with pytest.raises(
        ptrres.BlockIdError,
        match=r"group 0, position 1.*block id 7.*ref 1.*tensor 1 has 6 blocks",
    ) as info:
        resolve(spec, kv)
    assert (info.value.group, info.value.position, info.value.value) == (0, 1, 7)
    assert_same_pointers(
        resolve(good_spec(), kv), reference.resolve_device_pointers(good_spec(), kv)
    )


def test_block_id_error_clears_out_buffers_and_keeps_the_rest(kv) -> None:
    ptrs = np.full(8, 5, np.int64)
    sizes = np.full(8, 5, np.uint64)
    spec = ptrres.GPULoadStoreSpec(np.array([3, 70, 0]), [2, 1], [0, 0])
    block_ids_before = spec.block_ids.copy()
    table = ptrres.PointerTable(kv)
    with pytest.raises(ptrres.BlockIdError, match="block id 70"):
        table.resolve(spec, out=(ptrs, sizes))
    # No pointer computed from a bad id survives; entries past the ops are kept.
    assert ptrs.tolist() == [0] * 5 + [5] * 3
    assert sizes.tolist() == [0] * 5 + [5] * 3
    np.testing.assert_array_equal(spec.block_ids, block_ids_before)
    good = table.resolve(good_spec(), out=(ptrs, sizes))
    assert_same_pointers(good, reference.resolve_device_pointers(good_spec(), kv))


@pytest.mark.parametrize(
    ("group_sizes", "block_indices", "pattern"),
    [
        ([2, 2], [0, 0], "sum to 4 but there are 3 block ids"),
        ([4, -1], [0, 0], "group 1: group size -1 is negative"),
        ([3], [0], "group_sizes has 1 entries but the KV caches have 2 groups"),
        ([2, 1], [0], "block_indices has 1 entries but the KV caches have 2 groups"),
        ([2, 1, 0], [0, 0, 0], "group_sizes has 3 entries"),
        ([2, 1], [0, -3], "group 1: block index -3 is negative"),
    ],
)
def test_inconsistent_spec(resolve, kv, group_sizes, block_indices, pattern) -> None:
    spec = SimpleNamespace(
        block_ids=np.array([1, 2, 3]),
        group_sizes=group_sizes,
        block_indices=block_indices,
    )
    with pytest.raises(ptrres.SpecError, match=pattern):
        resolve(spec, kv)
    assert len(resolve(good_spec(), kv).ptrs) == 5


@pytest.mark.parametrize(
    ("group_sizes", "pattern"),
    [
        ([2.0, 1], "group_sizes must be integers"),
        ("21", "sequence of ints"),
        (None, "sequence of ints"),
    ],
)
def test_group_sizes_that_are_not_ints(resolve, kv, group_sizes, pattern) -> None:
    spec = SimpleNamespace(
        block_ids=np.array([1, 2, 3]), group_sizes=group_sizes, block_indices=[0, 0]
    )
    with pytest.raises(ptrres.InputTypeError, match=pattern):
        resolve(spec, kv)


@pytest.mark.parametrize(
    ("block_ids", "pattern"),
    [
        (np.array([1.0, 2.0, 3.0]), "block_ids must be integers, got dtype float64"),
        (np.array([[1, 2, 3]]), "block_ids must be 1-D, got a 2-D array of shape"),
        (np.array(3), "block_ids must be 1-D, got a 0-D array"),
        (["1", "2", "3"], "block_ids must be integers"),
        (
            np.array([1, 2, 3], dtype=object),
            "block_ids must be integers, got dtype object",
        ),
        (
            np.array([1, 2**63, 3], dtype=np.uint64),
            r"block_ids\[1\] = 9223372036854775808 does not fit",
        ),
        (None, "block_ids must be integers"),
    ],
)
def test_block_ids_that_are_not_a_1d_integer_array(
    resolve, kv, block_ids, pattern
) -> None:
    spec = SimpleNamespace(
        block_ids=block_ids, group_sizes=[2, 1], block_indices=[0, 0]
    )
    with pytest.raises(ptrres.InputTypeError, match=pattern) as info:
        resolve(spec, kv)
    assert isinstance(info.value, TypeError)


def test_other_integer_dtypes_and_strided_ids_are_accepted(resolve, kv) -> None:
    expected = reference.resolve_device_pointers(good_spec(), kv)
    for block_ids in (
        np.array([1, 2, 3], np.uint8),
        np.array([1, 9, 2, 9, 3])[::2],
        [1, 2, 3],
    ):
        spec = SimpleNamespace(
            block_ids=block_ids, group_sizes=(2, 1), block_indices=(0, 0)
        )
        assert_same_pointers(resolve(spec, kv), expected)


def test_tensor_idx_out_of_range(resolve, kv) -> None:
    kv.group_data_refs[1].append(ptrres.CanonicalKVCacheRef(2, 8))
    with pytest.raises(
        ptrres.LayoutError, match="group 1, ref 1: tensor_idx 2 is out of range"
    ):
        resolve(good_spec(), kv)
    kv.group_data_refs[1][1] = ptrres.CanonicalKVCacheRef(-1, 8)
    with pytest.raises(ptrres.LayoutError, match="tensor_idx -1 is out of range"):
        resolve(good_spec(), kv)


@pytest.mark.parametrize(
    ("page_size", "pattern"),
    [
        (-1, "page_size_bytes -1 is negative"),
        (17, "larger than the row stride \\(16 B\\)"),
        (1.5, "page_size_bytes must be an integer"),
    ],
)
def test_page_size_outside_the_row(resolve, kv, page_size, pattern) -> None:
    kv.group_data_refs[0][1] = ptrres.CanonicalKVCacheRef(1, page_size)
    with pytest.raises((ptrres.LayoutError, ptrres.InputTypeError), match=pattern):
        resolve(good_spec(), kv)


def test_page_wider_than_a_padded_row(resolve) -> None:
    """A page within the stride but past the row's elements would leave the tensor."""
    tensor = random_tensor(4, 8, 4, dtype_of("int8"), 0)  # 8-byte rows, 12-byte stride
    kv = ptrres.CanonicalKVCaches(
        [ptrres.CanonicalKVCacheTensor(tensor, 12)],
        [[ptrres.CanonicalKVCacheRef(0, 10)]],
    )
    with pytest.raises(ptrres.LayoutError, match=r"larger than a row \(8 B\)"):
        resolve(ptrres.GPULoadStoreSpec([3]), kv)


def test_tensors_that_are_not_tensors(resolve, kv) -> None:
    kv.tensors[1] = ptrres.CanonicalKVCacheTensor([[1, 2]], 16)
    with pytest.raises(
        ptrres.InputTypeError,
        match=r"tensors\[1\].tensor must be a torch tensor or a numpy array, got list",
    ):
        resolve(good_spec(), kv)
    # A 0-d torch tensor (int64, as torch.tensor(3)), or numpy array.
    kv.tensors[1] = ptrres.CanonicalKVCacheTensor(as_tensor(np.array(3)), 16)
    with pytest.raises(ptrres.LayoutError, match=r"tensors\[1\].tensor is 0-d"):
        resolve(good_spec(), kv)


@pytest.mark.parametrize(
    ("buffer", "error", "pattern"),
    [
        (
            np.zeros(4, np.int64),
            ptrres.OutBufferError,
            r"out\[0\] \(ptrs\) holds 4 entries but this transfer has 5 ops",
        ),
        (
            np.zeros(5, np.int32),
            ptrres.InputTypeError,
            "must be int64 or uint64, got int32",
        ),
        (
            np.zeros(5, np.float64),
            ptrres.InputTypeError,
            "must be int64 or uint64, got float64",
        ),
        (
            np.zeros((5, 1), np.int64),
            ptrres.InputTypeError,
            r"must be 1-D, got shape \(5, 1\)",
        ),
        (np.zeros(10, np.int64)[::2], ptrres.OutBufferError, "is not contiguous"),
        pytest.param(
            torch.zeros(5, dtype=torch.int64) if with_torch() else None,
            ptrres.InputTypeError,
            r"pass tensor.numpy\(\)",
            marks=pytest.mark.needs_torch,
        ),
    ],
)
def test_bad_out_buffers(kv, buffer, error, pattern) -> None:
    table = ptrres.PointerTable(kv)
    with pytest.raises(error, match=pattern):
        table.resolve(good_spec(), out=(buffer, np.zeros(5, np.int64)))
    assert (
        len(
            table.resolve(
                good_spec(), out=(np.zeros(5, np.int64), np.zeros(5, np.uint64))
            ).ptrs
        )
        == 5
    )


def test_read_only_out_buffer(kv) -> None:
    sizes = np.zeros(5, np.uint64)
    sizes.flags.writeable = False
    with pytest.raises(ptrres.OutBufferError, match=r"out\[1\] \(sizes\) is read-only"):
        ptrres.PointerTable(kv).resolve(good_spec(), out=(np.zeros(5, np.int64), sizes))


@pytest.mark.parametrize("blocks_per_chunk", [0, -2, 1.5, "4"])
def test_bad_blocks_per_chunk(kv, blocks_per_chunk) -> None:
    device_ptrs = ptrres.resolve_device_pointers(good_spec(), kv)
    for iterate in (ptrres.iter_pointer_groups, reference.iter_pointer_groups):
        with pytest.raises(
            (ptrres.SpecError, ptrres.InputTypeError), match="blocks_per_chunk"
        ):
            list(iterate(device_ptrs, blocks_per_chunk))


def test_every_error_is_a_ptrres_error_and_a_value_or_type_error() -> None:
    for name in ptrres.__all__:
        obj = getattr(ptrres, name)
        if (
            isinstance(obj, type)
            and issubclass(obj, Exception)
            and obj is not ptrres.PtrresError
        ):
            assert issubclass(obj, ptrres.PtrresError)
            assert issubclass(obj, (ValueError, TypeError))


# Found by tests/test_hostile.py -------------------------------------------


@pytest.mark.parametrize("missing", ["block_ids", "group_sizes", "block_indices"])
def test_spec_without_an_attribute(resolve, kv, missing) -> None:
    """Was AttributeError; a spec-like object lacking a field is a type error."""
    fields = {"block_ids": [1, 2, 3], "group_sizes": [2, 1], "block_indices": [0, 0]}
    del fields[missing]
    spec = SimpleNamespace(**fields)
    pattern = (
        f"device_spec must have the attributes .*; SimpleNamespace has no {missing}"
    )
    with pytest.raises(ptrres.InputTypeError, match=pattern):
        resolve(spec, kv)
    offloaded = ptrres.OffloadedLayout([np.zeros((4, 16), np.int8)] * 2, 1)
    with pytest.raises(ptrres.InputTypeError, match=pattern):
        ptrres.PointerTable(kv).plan_transfer(spec, offloaded, [0, 1, 2], store=True)


@pytest.mark.parametrize(
    ("kv_caches", "pattern"),
    [
        (
            SimpleNamespace(tensors=[]),
            "kv_caches must have the attributes tensors, group_data_refs; "
            "SimpleNamespace has no group_data_refs",
        ),
        (
            SimpleNamespace(tensors=None, group_data_refs=[]),
            "kv_caches.tensors must be a sequence, got NoneType",
        ),
        (
            SimpleNamespace(tensors=[], group_data_refs=3),
            "group_data_refs must be a sequence, got int",
        ),
        (
            SimpleNamespace(tensors=[], group_data_refs=["ab"]),
            r"group_data_refs\[0\] must be a sequence, got str",
        ),
        (
            SimpleNamespace(tensors=[], group_data_refs=[[SimpleNamespace()]]),
            "group 0, ref 0 must have the attributes tensor_idx, page_size_bytes",
        ),
    ],
)
def test_layouts_without_attributes_or_sequences(resolve, kv_caches, pattern) -> None:
    """Were AttributeError and TypeError from deep inside; now named."""
    with pytest.raises(ptrres.InputTypeError, match=pattern):
        resolve(good_spec(), kv_caches)


def test_device_pointers_without_attributes_or_sequences(kv) -> None:
    device_ptrs = ptrres.resolve_device_pointers(good_spec(), kv)
    offloaded = ptrres.OffloadedLayout([np.zeros((4, 16), np.int8)] * 2, 1)
    table = ptrres.PointerTable(kv)
    for name in ("group_block_counts", "group_data_ref_counts", "block_indices"):
        fields = dict(vars(device_ptrs))
        del fields[name]
        for iterate in (ptrres.iter_pointer_groups, reference.iter_pointer_groups):
            with pytest.raises(ptrres.InputTypeError, match=f"has no {name}"):
                list(iterate(SimpleNamespace(**fields), 2))
            with pytest.raises(ptrres.InputTypeError, match=f"{name} must be a seq"):
                list(iterate(SimpleNamespace(**fields, **{name: None}), 2))
        with pytest.raises(ptrres.InputTypeError, match=f"has no {name}"):
            table.plan_from_device_pointers(
                SimpleNamespace(**fields), offloaded, [0, 1, 2], store=True
            )
    fields = dict(vars(device_ptrs))
    del fields["ptrs"]
    with pytest.raises(ptrres.InputTypeError, match="has no ptrs"):
        table.plan_from_device_pointers(
            SimpleNamespace(**fields), offloaded, [0, 1, 2], store=True
        )
    with pytest.raises(ptrres.InputTypeError, match="offloaded tensors must be a seq"):
        ptrres.OffloadedLayout(None, 1)


class OddTensor:
    """Answers the calls ptrres makes of a torch tensor, with given values."""

    def __init__(self, base_ptr: Any, stride0: Any, shape: Any) -> None:
        self.base_ptr, self.stride0, self.shape = base_ptr, stride0, shape

    def data_ptr(self) -> Any:
        return self.base_ptr

    def stride(self, dim: int) -> Any:
        return self.stride0

    def element_size(self) -> int:
        return 1


def one_tensor_layout(tensor: Any) -> ptrres.CanonicalKVCaches:
    return ptrres.CanonicalKVCaches(
        [ptrres.CanonicalKVCacheTensor(tensor, 8)], [[ptrres.CanonicalKVCacheRef(0, 8)]]
    )


@pytest.mark.parametrize(
    ("tensor", "error", "pattern"),
    [
        # Was OverflowError (ptrres) or a wrapped pointer (reference).
        (OddTensor(2**63, 8, (4, 8)), ptrres.LayoutError, "at 0x8000000000000000"),
        (OddTensor(-8, 8, (4, 8)), ptrres.LayoutError, "between 0 and 2\\*\\*63"),
        (OddTensor(2**62, 2**61, (4, 8)), ptrres.LayoutError, "4 rows of 8 B"),
        (OddTensor(4096, 2**64, (1, 8)), ptrres.LayoutError, "2\\*\\*63 - 1"),
        (OddTensor(4096, 8, (-4, 8)), ptrres.LayoutError, "none may be negative"),
        # Was int(3.5) == 3 blocks, silently.
        (OddTensor(4096, 8, (3.5, 8)), ptrres.InputTypeError, r"shape\[0\] must be"),
        # Were bare TypeErrors ('NoneType' object is not callable, no len()).
        (OddTensor(4096, 8, None), ptrres.InputTypeError, "reading its shape"),
        (SimpleNamespace(data_ptr=4096), ptrres.InputTypeError, "must be a torch"),
    ],
)
def test_tensors_with_odd_geometry(resolve, tensor, error, pattern) -> None:
    with pytest.raises(error, match=pattern):
        resolve(ptrres.GPULoadStoreSpec([0]), one_tensor_layout(tensor))


@pytest.mark.needs_torch
def test_tensor_without_storage(resolve) -> None:
    """Was RuntimeError (torch: "Cannot access data pointer of Tensor...")."""
    sparse = torch.zeros(4, 8).to_sparse()
    with pytest.raises(
        ptrres.InputTypeError, match=r"tensors\[0\].tensor: reading its shape.*Runtime"
    ) as info:
        resolve(ptrres.GPULoadStoreSpec([0]), one_tensor_layout(sparse))
    assert isinstance(info.value.__cause__, RuntimeError)
    with pytest.raises(ptrres.InputTypeError, match=r"offloaded tensors\[0\]: read"):
        ptrres.OffloadedLayout([sparse], 1)


def test_tensor_entry_without_a_tensor(resolve) -> None:
    kv = SimpleNamespace(tensors=[SimpleNamespace()], group_data_refs=[[]])
    with pytest.raises(
        ptrres.InputTypeError, match=r"kv_caches.tensors\[0\] must have the attrib"
    ):
        resolve(ptrres.GPULoadStoreSpec([], [0]), kv)


@pytest.mark.parametrize("container", [set, dict.fromkeys, iter])
def test_group_sizes_in_an_unordered_container(resolve, kv, container) -> None:
    """A set or dict of the right length passed the fast path, in any order."""
    spec = SimpleNamespace(
        block_ids=[1, 2, 3], group_sizes=container([2, 1]), block_indices=[0, 0]
    )
    with pytest.raises(ptrres.InputTypeError, match="group_sizes must be a sequence"):
        resolve(spec, kv)
    spec.group_sizes, spec.block_indices = [2, 1], container([0, 5])
    with pytest.raises(ptrres.InputTypeError, match="block_indices must be a sequence"):
        resolve(spec, kv)


@pytest.mark.parametrize(
    "out",
    [3, (np.zeros(5, np.int64),), [np.zeros(5, np.int64)] * 4, None],
)
def test_out_that_is_not_one_buffer_per_output(kv, out) -> None:
    """Were IndexError (a short tuple) and TypeError (not subscriptable)."""
    table = ptrres.PointerTable(kv)
    if out is None:  # a pair where a plan needs three
        out = (np.zeros(5, np.int64), np.zeros(5, np.int64))
    else:
        with pytest.raises(ptrres.InputTypeError, match=r"out must hold 2 buffers"):
            table.resolve(good_spec(), out=out)
    offloaded = ptrres.OffloadedLayout([np.zeros((4, 16), np.int8)] * 2, 1)
    with pytest.raises(ptrres.InputTypeError, match=r"out must hold 3 buffers"):
        table.plan_transfer(good_spec(), offloaded, [0, 1, 2], store=True, out=out)
    descriptors = [np.zeros(5, np.int64)] * 3
    with pytest.raises(ptrres.InputTypeError, match=r"out must hold 3 buffers"):
        ptrres.coalesce(*descriptors, out=out)


def test_out_buffers_that_share_memory(kv) -> None:
    """ptrs written over sizes (or over the ids being read) gave wrong answers,
    and an AssertionError when the overwritten ids then looked out of range."""
    table = ptrres.PointerTable(kv)
    buffer = np.zeros(10, np.int64)
    with pytest.raises(ptrres.OutBufferError, match="share memory"):
        table.resolve(good_spec(), out=(buffer, buffer))
    with pytest.raises(ptrres.OutBufferError, match="share memory"):
        table.resolve(good_spec(), out=(buffer[:5], buffer[4:]))
    ids = np.array([1, 2, 3, 0, 0, 0], np.int64)
    spec = ptrres.GPULoadStoreSpec(ids[:3], [2, 1], [0, 0])
    with pytest.raises(ptrres.OutBufferError, match="block_ids share memory"):
        table.resolve(spec, out=(ids, np.zeros(5, np.int64)))
    assert ids.tolist() == [1, 2, 3, 0, 0, 0]  # nothing written
    assert_same_pointers(
        table.resolve(good_spec(), out=(buffer[:5], buffer[5:])),
        reference.resolve_device_pointers(good_spec(), kv),
    )
    offloaded = ptrres.OffloadedLayout([np.zeros((4, 16), np.int8)] * 2, 1)
    chunk_ids = np.array([0, 1, 2, 0, 0], np.int64)
    for out in (
        (buffer[:5], buffer[:5], np.zeros(5, np.int64)),
        (buffer[:5], buffer[5:], chunk_ids),
    ):
        with pytest.raises(ptrres.OutBufferError, match="share memory"):
            table.plan_transfer(spec, offloaded, chunk_ids[:3], store=True, out=out)
    src, dst = np.array([0, 8, 16, 0]), np.array([64, 72, 80, 0])
    sizes = np.full(4, 8)
    with pytest.raises(ptrres.OutBufferError, match="share memory"):
        ptrres.coalesce(src, dst, sizes, out=(dst, src, sizes))  # swapped
    with pytest.raises(ptrres.OutBufferError, match="share memory"):
        ptrres.coalesce(src[:3], dst[:3], sizes[:3], out=(src[1:], dst, sizes))
    assert src.tolist() == [0, 8, 16, 0]
    merged = ptrres.coalesce(src, dst, sizes, out=(src, dst, sizes))  # in place
    assert merged.src.tolist() == [0, 0]
    assert merged.sizes.tolist() == [24, 8]


def test_reference_with_extreme_numbers() -> None:
    """The reference wrapped a merged size past 2**64 (and raised OverflowError
    for a cap over it), and mixed a numpy blocks_per_chunk with huge counts."""
    half = 2**63
    src = np.array([0, half], np.uint64)
    dst = np.array([2**20, 2**20 + half], np.uint64)
    sizes = np.array([half, half], np.uint64)  # together 2**64: too much for one
    for cap in (None, 2**64, 2**70):
        expected = ptrres.coalesce(src, dst, sizes, max_run_bytes=cap)
        assert expected.sizes.tolist() == [half, half]
        merged = reference.coalesce(src, dst, sizes, max_run_bytes=cap)
        assert merged.sizes.tolist() == [half, half]
    device_ptrs = SimpleNamespace(
        group_block_counts=[2**62], group_data_ref_counts=[1], block_indices=[2**63 - 1]
    )
    bpc = np.int32(4)
    assert list(reference.iter_pointer_groups(device_ptrs, bpc)) == list(
        ptrres.iter_pointer_groups(device_ptrs, bpc)
    )


@pytest.mark.parametrize("block_id", [2**62, 2**63 - 1, -(2**63)])
def test_extreme_block_ids_are_refused_without_overflow(resolve, kv, block_id) -> None:
    """Without the JIT, the kernel's pointer for such an id overflowed int64
    (a RuntimeWarning, an error under this suite) before the id was refused."""
    spec = ptrres.GPULoadStoreSpec(np.array([1, block_id, 3]), [2, 1], [0, 0])
    with pytest.raises(ptrres.BlockIdError, match=f"block id {block_id}"):
        resolve(spec, kv)


def test_descriptors_at_the_top_of_the_address_space() -> None:
    """A run ending past 2**64 - 1 continues nothing; without the JIT, the
    check itself overflowed uint64 (a RuntimeWarning)."""
    top = 2**64 - 64
    src = np.array([top, 0, 2**63], np.uint64)
    dst = np.array([top, 0, 2**63 + 64], np.uint64)
    sizes = np.array([64, 64, 64], np.uint64)
    for merge in (ptrres.coalesce, reference.coalesce):
        merged = merge(src, dst, sizes)
        assert merged.sizes.tolist() == [64, 64, 64]


def test_group_sizes_that_wrap_around_2_to_the_64(resolve) -> None:
    """Sizes summed in uint64 wrapped to the number of ids: the kernel then
    read ids before the array's start, and failed an assert."""
    tensor = random_tensor(8, 16, 0, dtype_of("int8"), 0)
    kv = ptrres.CanonicalKVCaches(
        [ptrres.CanonicalKVCacheTensor(tensor, 16)],
        [[], [], [ptrres.CanonicalKVCacheRef(0, 16)]],
    )
    big = 2**63 - 1  # big + big + 4 == 2 (mod 2**64)
    spec = ptrres.GPULoadStoreSpec(np.array([1, 2]), [big, big, 4], [0, 0, 0])
    with pytest.raises(ptrres.SpecError, match="sum to 18446744073709551618 but"):
        resolve(spec, kv)
    # An array (not the tuple the type says): the slow path's own sum.
    spec.group_sizes = np.array([big, big, 4])  # type: ignore[assignment]
    with pytest.raises(ptrres.SpecError, match="but there are 2 block ids"):
        resolve(spec, kv)


def test_device_pointers_with_a_huge_group_without_refs() -> None:
    """A group without refs has no pointers to bound its size: one of 2**40
    blocks made plan_from_device_pointers allocate 8 TiB (MemoryError)."""
    tensor = random_tensor(8, 16, 0, dtype_of("int8"), 0)
    kv = ptrres.CanonicalKVCaches(
        [ptrres.CanonicalKVCacheTensor(tensor, 16)],
        [[], [ptrres.CanonicalKVCacheRef(0, 16)]],
    )
    table = ptrres.PointerTable(kv)
    offloaded = ptrres.OffloadedLayout([np.zeros((8, 16), np.int8)], 1)
    device_ptrs = table.resolve(ptrres.GPULoadStoreSpec([1, 5], [0, 2], [0, 0]))
    device_ptrs.group_block_counts = (2**40, 2)
    with pytest.raises(ptrres.OffloadedIdError, match=r"span \[1099511627776, 2\]"):
        table.plan_from_device_pointers(device_ptrs, offloaded, [3, 4], store=True)
    device_ptrs.group_block_counts = (3, 2)  # fine, with 3 + 2 chunk ids
    plan = table.plan_from_device_pointers(
        device_ptrs, offloaded, [0, 1, 2, 3, 4], store=True
    )
    assert plan.src.tolist() == [data_ptr(tensor[1]), data_ptr(tensor[5])]


def test_offloaded_layout_cannot_be_changed() -> None:
    """Setting blocks_per_chunk from 2 to 4 kept sub-blocks of half a row: the
    last sub-blocks of the last chunk lay past the offloaded tensor."""
    tensor = random_tensor(8, 16, 0, dtype_of("int8"), 0)
    kv = ptrres.CanonicalKVCaches(
        [ptrres.CanonicalKVCacheTensor(tensor, 16)],
        [[ptrres.CanonicalKVCacheRef(0, 8)]],
    )
    offloaded = ptrres.OffloadedLayout([np.zeros((4, 32), np.int8)], 2)
    with pytest.raises(AttributeError, match="OffloadedLayout is read-only"):
        offloaded.blocks_per_chunk = 4
    with pytest.raises(AttributeError, match="read-only"):
        del offloaded.geometries
    spec = ptrres.GPULoadStoreSpec([1, 2, 3, 4])
    plan = ptrres.PointerTable(kv).plan_transfer(spec, offloaded, [3, 2], store=True)
    base = offloaded.geometries[0].base_ptr
    assert (plan.dst - base).tolist() == [96, 112, 64, 80]


@pytest.mark.parametrize("cap", [2**63, 2**63 + 8, 2**64 - 2])
def test_caps_of_2_to_the_63_and_more_are_kept(cap) -> None:
    """Every cap of 2**63 or more meant no cap at all."""
    src = np.array([0, 64], np.uint64)
    dst = np.array([2**20, 2**20 + 64], np.uint64)
    sizes = np.array([64, cap - 63], np.uint64)  # together one byte over the cap
    for merge in (ptrres.coalesce, reference.coalesce):
        assert merge(src, dst, sizes, max_run_bytes=cap).sizes.tolist() == [
            64,
            cap - 63,
        ]
        assert merge(src, dst, sizes, max_run_bytes=cap + 1).sizes.tolist() == [cap + 1]


@pytest.mark.parametrize("index", [2**63, 2**64, 2**100])
def test_block_index_too_large_for_int64(resolve, kv, index) -> None:
    """The fast path took any Python int >= 0 as a block index, which a plan
    then could not convert (OverflowError); the reference refused it."""
    spec = ptrres.GPULoadStoreSpec([1, 2, 3], [2, 1], [0, index])
    with pytest.raises(ptrres.SpecError, match=f"block_indices holds {index}, which"):
        resolve(spec, kv)
    device_ptrs = ptrres.resolve_device_pointers(good_spec(), kv)
    device_ptrs.block_indices = (0, index)
    offloaded = ptrres.OffloadedLayout([np.zeros((4, 16), np.int8)] * 2, 1)
    with pytest.raises(ptrres.SpecError, match="which is too large"):
        ptrres.PointerTable(kv).plan_from_device_pointers(
            device_ptrs, offloaded, [0, 1, 2], store=True
        )


def test_reference_refuses_what_ptrres_refuses(kv) -> None:
    """Each bad input, through ptrres and through the reference: the same error."""
    fields: dict[str, Any] = vars(ptrres.resolve_device_pointers(good_spec(), kv))
    changes: list[tuple[dict[str, Any], str]] = [
        ({"block_indices": (0,)}, "have 2, 2 and 1 entries"),
        ({"group_block_counts": (2, -1)}, "group 1: "),
    ]
    for changed, pattern in changes:
        device_ptrs = SimpleNamespace(**{**fields, **changed})
        for iterate in (ptrres.iter_pointer_groups, reference.iter_pointer_groups):
            with pytest.raises(ptrres.SpecError, match=pattern):
                list(iterate(device_ptrs, 2))

    tensors = [np.zeros((4, 16), np.int8)] * 2
    table = ptrres.PointerTable(kv)
    cases: list[tuple[Any, Any, type[Exception], str]] = [
        ([0, 1, 2], 1, ptrres.InputTypeError, "store must be True or False"),
        ([0, 1], True, ptrres.OffloadedIdError, "there are 2 offloaded ids"),
        ([0, 4, 2], True, ptrres.OffloadedIdError, "position 1: offloaded id 4"),
    ]
    for ids, store, error, pattern in cases:
        with pytest.raises(error, match=pattern):
            table.plan_transfer(
                good_spec(), ptrres.OffloadedLayout(tensors, 1), ids, store=store
            )
        with pytest.raises(error, match=pattern):
            reference.plan_transfer(good_spec(), kv, tensors, 1, ids, store=store)

    uneven = (np.zeros(3, np.int64), np.zeros(2, np.int64), np.zeros(3, np.int64))
    for merge in (ptrres.coalesce, reference.coalesce):
        with pytest.raises(ptrres.SpecError, match=r"3, 2 and 3 entries|differ"):
            merge(*uneven)
        with pytest.raises(ptrres.SpecError, match="max_run_bytes must be >= 1"):
            merge(*[np.zeros(2, np.int64)] * 3, max_run_bytes=0)


def test_tensor_rows_that_run_backwards() -> None:
    backwards = np.zeros((4, 16), np.int8)[::-1]
    with pytest.raises(ptrres.LayoutError, match=r"negative row stride \(-16 B\)"):
        ptrres.PointerTable(one_tensor_layout(backwards))
    with pytest.raises(ptrres.LayoutError, match="negative row stride"):
        ptrres.OffloadedLayout([backwards], 1)


def test_offloaded_rows_that_overlap() -> None:
    """A device tensor's rows may overlap (pages are read); chunks may not."""
    overlapping = np.lib.stride_tricks.as_strided(
        np.zeros(64, np.int8), shape=(4, 16), strides=(8, 1)
    )
    with pytest.raises(ptrres.LayoutError, match=r"rows of 16 B overlap \(row st"):
        ptrres.OffloadedLayout([overlapping], 1)


SPEC_FIELDS = {"block_ids": [1, 2, 3], "group_sizes": [2, 1], "block_indices": [0, 0]}


@pytest.mark.parametrize(
    ("field", "value", "error", "pattern"),
    [
        ("block_ids", [1, [2], 3], ptrres.InputTypeError, "not an integer array"),
        ("group_sizes", [[2], [1, 0]], ptrres.InputTypeError, "sequence of ints:"),
        ("group_sizes", [[2], [1]], ptrres.InputTypeError, r"1-D, got shape \(2, 1\)"),
        ("group_sizes", np.array([2**63, 0], np.uint64), ptrres.SpecError, "too large"),
    ],
)
def test_spec_fields_numpy_reads_oddly(
    resolve, kv, field, value, error, pattern
) -> None:
    """Ragged, 2-D or too large: each field is named."""
    spec = SimpleNamespace(**{**SPEC_FIELDS, field: value})
    with pytest.raises(error, match=pattern):
        resolve(spec, kv)
    spec = SimpleNamespace(
        **{**SPEC_FIELDS, field: np.array(SPEC_FIELDS[field], np.uint8)}
    )
    assert len(resolve(spec, kv).ptrs) == 5  # any integer dtype does


def test_no_groups_at_all(resolve) -> None:
    kv = ptrres.CanonicalKVCaches([], [])
    spec = SimpleNamespace(
        block_ids=[], group_sizes=np.array([], int), block_indices=()
    )
    assert len(resolve(spec, kv).ptrs) == 0
    assert repr(ptrres.PointerTable(kv)) == "PointerTable(0 groups, refs per group ())"


def test_descriptors_that_are_not_contiguous_and_an_unaligned_out() -> None:
    strided = np.arange(8, dtype=np.int64)[::2] * 8  # 0, 16, 32, 48: gaps
    merged = ptrres.coalesce(strided, strided + 1000, np.full(4, 8))
    assert merged.sizes.tolist() == [8, 8, 8, 8]
    merged = ptrres.coalesce(strided, strided + 1000, np.full(8, 16)[::2])
    assert merged.sizes.tolist() == [64]
    unaligned = np.zeros(33, np.uint8)[1:].view(np.int64)
    with pytest.raises(ptrres.OutBufferError, match="not aligned to 8 bytes"):
        ptrres.coalesce(*[np.zeros(4, np.int64)] * 3, out=(unaligned,) * 3)
    layout = ptrres.OffloadedLayout([np.zeros((2, 8), np.int8)], 2)
    assert repr(layout) == "OffloadedLayout(1 tensors, blocks_per_chunk=2)"


def test_offloaded_entry_that_cannot_say_what_it_holds() -> None:
    class BrokenProxy:
        def __getattr__(self, name: str) -> Any:
            raise RuntimeError(f"broken proxy: {name}")

    with pytest.raises(ptrres.InputTypeError, match=r"offloaded tensors\[0\]: read"):
        ptrres.OffloadedLayout([BrokenProxy()], 1)


def test_inputs_that_take_the_long_way_but_are_fine(kv) -> None:
    """long long buffers (int64, but not numpy's int64 dtype object), offloaded
    tensors given as CanonicalKVCacheTensor, an empty group in a count error."""
    assert np.dtype(np.longlong) == np.int64
    out = (np.zeros(5, np.longlong), np.zeros(5, np.longlong))
    device_ptrs = ptrres.PointerTable(kv).resolve(good_spec(), out=out)
    assert device_ptrs.ptrs.tolist() == out[0].astype(np.uint64).tolist()
    tensor = np.zeros((4, 16), np.int8)
    wrapped = ptrres.OffloadedLayout([ptrres.CanonicalKVCacheTensor(tensor, 16)], 1)
    assert wrapped.geometries == ptrres.OffloadedLayout([tensor], 1).geometries
    spec = ptrres.GPULoadStoreSpec([1, 2], [2, 0], [0, 0])
    with pytest.raises(ptrres.OffloadedIdError, match=r"span \[2, 0\] chunks"):
        ptrres.PointerTable(kv).plan_transfer(
            spec, ptrres.OffloadedLayout([tensor] * 2, 1), [0], store=True
        )


def test_out_may_be_the_rows_of_one_2d_buffer(kv) -> None:
    """One pinned (2, n) tensor's numpy view serves as ptrs and sizes."""
    pinned = zeros(2, 8, dtype="int64")
    # resolve() takes the rows of a 2-D array, which its out type leaves out.
    rows: Any = pinned if isinstance(pinned, np.ndarray) else pinned.numpy()
    device_ptrs = ptrres.PointerTable(kv).resolve(good_spec(), out=rows)
    assert_same_pointers(
        device_ptrs, reference.resolve_device_pointers(good_spec(), kv)
    )
    assert pinned[0, :5].tolist() == device_ptrs.ptrs.tolist()
    assert pinned[1, :5].tolist() == device_ptrs.sizes.tolist()


def test_blocks_per_chunk_past_int64(kv) -> None:
    """With no offloaded rows to divide, any blocks_per_chunk passed, and the
    plan kernel could not take 2**63 (OverflowError); found by the long run."""
    for bpc in (2**63, 2**64):
        with pytest.raises(ptrres.LayoutError, match=r"< 2\*\*63, got"):
            ptrres.OffloadedLayout([], bpc)
        with pytest.raises(ptrres.LayoutError, match=r"< 2\*\*63, got"):
            reference.plan_transfer(good_spec(), kv, [], bpc, [], store=True)


def test_device_pointer_counts_that_are_arrays(kv) -> None:
    """Refs per group given as a 2-D array compared elementwise with the table's
    ints: numpy's 'truth value of an array is ambiguous' ValueError."""
    device_ptrs = ptrres.resolve_device_pointers(good_spec(), kv)
    offloaded = ptrres.OffloadedLayout([np.zeros((4, 16), np.int8)] * 2, 1)
    table = ptrres.PointerTable(kv)
    for name in ("group_data_ref_counts", "group_block_counts"):
        fields = {**vars(device_ptrs), name: np.zeros((2, 0), np.int32)}
        with pytest.raises(ptrres.InputTypeError, match=rf"{name}\[0\] must be an int"):
            table.plan_from_device_pointers(
                SimpleNamespace(**fields), offloaded, [0, 1, 2], store=True
            )
