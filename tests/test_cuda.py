"""On CUDA tensors the pointers are the device addresses of the rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import ptrres
from ptrres import reference

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"
)


@pytest.mark.parametrize("dtype", [torch.int8, torch.bfloat16])
def test_cuda_pointers_are_row_addresses(dtype: torch.dtype) -> None:
    tensors = [
        torch.randint(0, 100, (64, 256), device="cuda").to(dtype)[:, :200]
        for _ in range(3)
    ]
    page = 200 * tensors[0].element_size()
    Ref = ptrres.CanonicalKVCacheRef
    kv = ptrres.CanonicalKVCaches(
        [
            ptrres.CanonicalKVCacheTensor(t, t.stride(0) * t.element_size())
            for t in tensors
        ],
        [[Ref(0, page), Ref(1, page)], [Ref(2, page // 2)]],
    )
    spec = ptrres.GPULoadStoreSpec(np.array([63, 0, 17, 5], np.int32), [3, 1], [0, 2])
    device_ptrs = ptrres.resolve_device_pointers(spec, kv)
    expected = [tensors[t][b].data_ptr() for t in (0, 1) for b in (63, 0, 17)]
    expected.append(tensors[2][5].data_ptr())
    assert device_ptrs.ptrs.tolist() == expected
    np.testing.assert_array_equal(
        device_ptrs.ptrs, reference.resolve_device_pointers(spec, kv).ptrs
    )
    # Copy every op with the driver and compare with the rows torch reads.
    staging = torch.empty(page, dtype=torch.uint8, device="cuda")
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    for ptr, size, (t, b) in zip(
        device_ptrs.ptrs.tolist(),
        device_ptrs.sizes.tolist(),
        [(0, 63), (0, 0), (0, 17), (1, 63), (1, 0), (1, 17), (2, 5)],
    ):
        assert cudart.cudaMemcpy(staging.data_ptr(), ptr, size, 3) == 0  # D2D
        row = tensors[t][b].contiguous().view(torch.uint8)[:size]
        assert torch.equal(staging[:size], row)
    with pytest.raises(ptrres.BlockIdError, match="block id 64"):
        ptrres.resolve_device_pointers(
            ptrres.GPULoadStoreSpec([64, 0, 0, 0], [3, 1], [0, 0]), kv
        )
