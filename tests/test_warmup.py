"""warmup() makes every kernel ready; afterwards no call compiles anything."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import JIT_DISABLED, random_tensor

import ptrres
from ptrres._config import KERNELS


def test_warmup_reports_every_kernel_signature() -> None:
    report = ptrres.warmup()
    expected = sum(len(signatures) for _, signatures in KERNELS)
    assert len(report.kernels) == expected >= 2
    hows = {k.how for k in report.kernels}
    if JIT_DISABLED:
        assert hows == {"interpreted"}
    else:
        assert hows <= {"loaded", "compiled", "ready"}
    again = ptrres.warmup()
    assert {k.how for k in again.kernels} == (
        {"interpreted"} if JIT_DISABLED else {"ready"}
    )
    assert "kernel signatures" in str(again)


@pytest.mark.skipif(JIT_DISABLED, reason="nothing is compiled without the JIT")
def test_no_compilation_after_warmup_whatever_the_dtypes() -> None:
    ptrres.warmup()
    before = {id(d): len(d.overloads) for d, _ in KERNELS}
    for dtype in (torch.int8, torch.bfloat16, torch.float16, torch.float32):
        tensor = random_tensor(8, 4, 1, dtype, 0)
        kv = ptrres.CanonicalKVCaches(
            [ptrres.CanonicalKVCacheTensor(tensor, 0)],
            [[ptrres.CanonicalKVCacheRef(0, 4 * dtype.itemsize)], []],
        )
        for id_dtype in (np.int32, np.int64, np.uint8, np.int16, np.uint64):
            spec = ptrres.GPULoadStoreSpec(np.array([1, 7], id_dtype), [2, 0], [0, 0])
            for out_dtype in (np.int64, np.uint64):
                out = (np.zeros(2, out_dtype), np.zeros(2, out_dtype))
                ptrres.PointerTable(kv).resolve(spec, out=out)
            ptrres.resolve_device_pointers(spec, kv)
    assert {id(d): len(d.overloads) for d, _ in KERNELS} == before
    # The kernels are closed: a dtype nobody converted fails loudly.
    from ptrres import _kernels

    with pytest.raises(TypeError):
        _kernels.resolve_kernel(
            np.zeros((1, 5), np.int64), np.zeros(2, np.int64), np.zeros(1, np.int16),
            np.ones(1, np.int64), np.zeros(1, np.uint64), np.zeros(1, np.uint64),
        )  # fmt: skip
