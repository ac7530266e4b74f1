"""coalesce: merge descriptors that continue each other on both sides (SPEC 6)."""

from __future__ import annotations

from typing import Any

import numpy as np

from .._errors import SpecError
from .._results import TransferPlan
from ._input import as_descriptors, as_int


def coalesce(
    src: Any, dst: Any, sizes: Any, *, max_run_bytes: int | None = None
) -> TransferPlan:
    """Merge descriptors that continue each other on both sides (SPEC 6).

    Without a cap, runs are found with one vectorised comparison; with one,
    each descriptor is placed greedily, in order, in plain Python. A merged
    size must fit in uint64: no cap means a cap of 2**64 - 1.
    """
    src = as_descriptors(src, "src")
    dst = as_descriptors(dst, "dst")
    sizes = as_descriptors(sizes, "sizes")
    if not len(src) == len(dst) == len(sizes):
        raise SpecError(
            f"src, dst and sizes have {len(src)}, {len(dst)} and {len(sizes)} entries"
        )
    num_bytes = int(sizes.sum(dtype=np.uint64))
    cap = None if max_run_bytes is None else as_int(max_run_bytes, "max_run_bytes")
    if cap is not None and cap < 1:
        raise SpecError(f"max_run_bytes must be >= 1, got {cap}")
    if cap is None and sizes.sum(dtype=np.float64) >= 2.0**62:
        cap = 2**64 - 1  # a run could wrap the vectorised sum: merge greedily
    if cap is not None:
        cap = min(cap, 2**64 - 1)
    if len(sizes) == 0:
        return TransferPlan(src.copy(), dst.copy(), sizes.copy(), num_bytes)
    # i + 1 continues i when both ends meet, without wrapping around 2**64.
    src_end = src[:-1] + sizes[:-1]
    dst_end = dst[:-1] + sizes[:-1]
    continues = (src_end == src[1:]) & (dst_end == dst[1:])
    continues &= (src_end >= sizes[:-1]) & (dst_end >= sizes[:-1])
    if cap is None:
        starts = np.flatnonzero(np.concatenate(([True], ~continues)))
        return TransferPlan(
            src[starts], dst[starts], np.add.reduceat(sizes, starts), num_bytes
        )
    out_src, out_dst, out_sizes = [int(src[0])], [int(dst[0])], [int(sizes[0])]
    for i in range(1, len(sizes)):
        size = int(sizes[i])
        if continues[i - 1] and out_sizes[-1] + size <= cap:
            out_sizes[-1] += size
        else:
            out_src.append(int(src[i]))
            out_dst.append(int(dst[i]))
            out_sizes.append(size)
    return TransferPlan(
        np.array(out_src, np.uint64),
        np.array(out_dst, np.uint64),
        np.array(out_sizes, np.uint64),
        num_bytes,
    )
