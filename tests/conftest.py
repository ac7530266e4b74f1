"""Shared strategies and helpers: small KV-cache layouts built from torch tensors."""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import Any

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings

import ptrres

# CI's profile, and the default: derandomized (seeded by each test's own
# code, and no example database), so that every run draws the same examples.
# A rare draw then cannot fail one run in several and block a landing; what
# CI finds, a rerun finds again. Hunting is the long profile's job: random
# draws, new ones every run, and failures kept in .hypothesis/ and replayed
# first on the next run. What it finds becomes an @example of its test.
settings.register_profile(
    "ci",
    max_examples=60,
    derandomize=True,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "long",
    max_examples=100_000,
    deadline=None,
    print_blob=True,
    suppress_health_check=list(HealthCheck),
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

JIT_DISABLED = os.environ.get("NUMBA_DISABLE_JIT", "0") not in ("", "0")

DTYPES = [torch.int8, torch.bfloat16, torch.float16, torch.float32]


@dataclass
class Case:
    """A layout, a spec that is valid for it, and the out= buffers to use."""

    kv_caches: ptrres.CanonicalKVCaches
    spec: ptrres.GPULoadStoreSpec
    out_dtype: Any  # None (allocate), np.int64 or np.uint64
    out_extra: int  # entries beyond the op count in the out buffers

    @property
    def num_ops(self) -> int:
        return sum(
            n * len(refs)
            for n, refs in zip(self.spec.group_sizes, self.kv_caches.group_data_refs)
        )

    def out(self) -> tuple[np.ndarray, np.ndarray] | None:
        if self.out_dtype is None:
            return None
        n = self.num_ops + self.out_extra
        return np.full(n, 7, self.out_dtype), np.full(n, 7, self.out_dtype)


def random_tensor(
    num_blocks: int, row_elements: int, pad_elements: int, dtype: torch.dtype, seed: int
) -> torch.Tensor:
    """A (num_blocks, row_elements) tensor of random bytes, rows padded by pad."""
    generator = torch.Generator().manual_seed(seed)
    full = torch.randint(
        0,
        256,
        (num_blocks, (row_elements + pad_elements) * dtype.itemsize),
        dtype=torch.uint8,
        generator=generator,
    ).view(dtype)
    return full[:, :row_elements]


@st.composite
def layouts(draw: Any, max_groups: int = 4, max_tensors: int = 4) -> Any:
    """A CanonicalKVCaches: shared tensors, empty groups, padded rows, any dtype."""
    n_tensors = draw(st.integers(1, max_tensors))
    tensors = []
    for t in range(n_tensors):
        dtype = draw(st.sampled_from(DTYPES))
        tensor = random_tensor(
            num_blocks=draw(st.integers(1, 12)),
            row_elements=draw(st.integers(1, 16)),
            pad_elements=draw(st.sampled_from([0, 0, 1, 3])),
            dtype=dtype,
            seed=t,
        )
        tensors.append(
            ptrres.CanonicalKVCacheTensor(tensor, tensor.stride(0) * dtype.itemsize)
        )
    group_data_refs = []
    for _ in range(draw(st.integers(1, max_groups))):
        refs = []
        for _ in range(draw(st.integers(0, 4))):
            tensor_idx = draw(st.integers(0, n_tensors - 1))
            tensor = tensors[tensor_idx].tensor
            row_bytes = tensor.shape[1] * tensor.element_size()
            page = draw(st.integers(0, row_bytes))
            refs.append(ptrres.CanonicalKVCacheRef(tensor_idx, page))
        group_data_refs.append(refs)
    return ptrres.CanonicalKVCaches(tensors, group_data_refs)


@st.composite
def specs_for(draw: Any, kv_caches: ptrres.CanonicalKVCaches) -> Any:
    """A spec whose every id is valid for every ref of its group."""
    ids: list[int] = []
    group_sizes = []
    for refs in kv_caches.group_data_refs:
        limit = min(
            (kv_caches.tensors[r.tensor_idx].tensor.shape[0] for r in refs),
            default=50,
        )
        group_ids = draw(st.lists(st.integers(0, limit - 1), max_size=6))
        ids += group_ids
        group_sizes.append(len(group_ids))
    block_indices = [draw(st.integers(0, 20)) for _ in group_sizes]
    dtype = draw(st.sampled_from([np.int32, np.int64]))
    return ptrres.GPULoadStoreSpec(
        np.array(ids, dtype=dtype), group_sizes, block_indices
    )


@st.composite
def cases(draw: Any) -> Case:
    kv_caches = draw(layouts())
    return Case(
        kv_caches=kv_caches,
        spec=draw(specs_for(kv_caches)),
        out_dtype=draw(st.sampled_from([None, np.int64, np.uint64])),
        out_extra=draw(st.integers(0, 3)),
    )


def assert_same_pointers(actual: Any, expected: Any) -> None:
    """Two DevicePointers hold the same ops and the same group metadata."""
    assert actual.ptrs.dtype == np.uint64
    assert actual.sizes.dtype == np.uint64
    np.testing.assert_array_equal(actual.ptrs, expected.ptrs)
    np.testing.assert_array_equal(actual.sizes, expected.sizes)
    assert actual.group_block_counts == tuple(expected.group_block_counts)
    assert actual.group_data_ref_counts == tuple(expected.group_data_ref_counts)
    assert actual.block_indices == tuple(expected.block_indices)


def memory_bytes(ptr: int, size: int) -> bytes:
    """The bytes at a raw CPU pointer."""
    return ctypes.string_at(ptr, size)


def row_bytes(tensor: torch.Tensor, block: int) -> bytes:
    """The bytes of one row (block) of a tensor, read through torch."""
    return tensor[block].contiguous().view(torch.uint8).numpy().tobytes()


@pytest.fixture
def llama_like() -> ptrres.CanonicalKVCaches:
    """Two groups over four bf16 tensors of 10 blocks; group 1 shares tensor 2."""
    tensors = [
        ptrres.CanonicalKVCacheTensor(random_tensor(10, 32, 0, torch.bfloat16, t), 64)
        for t in range(4)
    ]
    return ptrres.CanonicalKVCaches(
        tensors,
        [
            [ptrres.CanonicalKVCacheRef(t, 64) for t in range(3)],
            [ptrres.CanonicalKVCacheRef(2, 48), ptrres.CanonicalKVCacheRef(3, 64)],
        ],
    )
