"""coalesce: merge descriptors that continue each other on both sides (SPEC 6)."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise
from typing import Any

import numpy as np

from .._errors import InputTypeError, SpecError
from .._results import TransferPlan
from ._input import as_descriptors, as_int

# A descriptor: (src, dst, size).
Op = tuple[int, int, int]


def coalesce(
    src: Any,
    dst: Any,
    sizes: Any,
    *,
    max_run_bytes: int | None = None,
    allocations: Any = None,
) -> TransferPlan:
    """Merge descriptors that continue each other on both sides (SPEC 6).

    A run ascends (each descriptor starts where the one before ends, on both
    sides) or descends (each ends where the one before starts); merged, it is
    one descriptor from its lowest addresses. Where no run descends, no run
    is capped and no run could wrap, runs are found with one vectorised
    comparison; otherwise each descriptor is placed greedily, in order, in
    plain Python (merged_runs). A merged size must fit in uint64: no cap
    means a cap of 2**64 - 1.

    Args:
        allocations: one integer per descriptor: no run joins descriptors of
            different values.
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
    same = _same_allocation(allocations, len(sizes))
    if len(sizes) == 0:
        return TransferPlan(src.copy(), dst.copy(), sizes.copy(), num_bytes)
    # i + 1 continues i upwards when both ends meet, without wrapping around
    # 2**64; downwards when it ends where i starts.
    src_end = src[:-1] + sizes[:-1]
    dst_end = dst[:-1] + sizes[:-1]
    ascends = (src_end == src[1:]) & (dst_end == dst[1:])
    ascends &= (src_end >= sizes[:-1]) & (dst_end >= sizes[:-1])
    descends = (src[1:] < src[:-1]) & (src[:-1] - src[1:] == sizes[1:])
    descends &= (dst[1:] < dst[:-1]) & (dst[:-1] - dst[1:] == sizes[1:])
    wraps = sizes.sum(dtype=np.float64) >= 2.0**62  # a vectorised sum could wrap
    if cap is None and not wraps and not (descends & same).any():
        starts = np.flatnonzero(np.concatenate(([True], ~(ascends & same))))
        return TransferPlan(
            src[starts], dst[starts], np.add.reduceat(sizes, starts), num_bytes
        )
    ops = list(zip(src.tolist(), dst.tolist(), sizes.tolist()))
    breaks = [0, *(np.flatnonzero(~same) + 1).tolist(), len(ops)]
    limit = 2**64 - 1 if cap is None else min(cap, 2**64 - 1)
    merged = [op for a, b in pairwise(breaks) for op in merged_runs(ops[a:b], limit)]
    columns = np.array(merged, dtype=np.uint64).reshape(len(merged), 3)
    return TransferPlan(
        columns[:, 0].copy(), columns[:, 1].copy(), columns[:, 2].copy(), num_bytes
    )


def merged_runs(ops: Sequence[Op], cap: int) -> list[Op]:
    """Merge a list of descriptors greedily, in order (SPEC 6).

    Each descriptor joins the run before it when it starts where the run ends
    on both sides (an ascending run) or ends where the run starts on both
    sides (a descending one, and a descriptor of a byte or more), the run
    keeps its direction (a run of one takes the first that comes), and the
    merged size stays within ``cap``. Otherwise it starts the next run.
    """
    merged: list[Op] = []
    direction = ""  # of the last run: "", "up" or "down"
    for a, b, size in ops:
        if merged:
            run_a, run_b, run_size = merged[-1]
            fits = run_size + size <= cap
            if (
                fits
                and direction != "down"
                and (a, b) == (run_a + run_size, run_b + run_size)
            ):
                merged[-1] = (run_a, run_b, run_size + size)
                direction = "up"
                continue
            if (
                fits
                and direction != "up"
                and size > 0
                and (a + size, b + size) == (run_a, run_b)
            ):
                merged[-1] = (a, b, run_size + size)
                direction = "down"
                continue
        merged.append((a, b, size))
        direction = ""
    return merged


def _same_allocation(allocations: Any, n: int) -> np.ndarray:
    """For each i < n - 1: whether descriptors i and i + 1 may join a run."""
    if allocations is None:
        return np.ones(max(n - 1, 0), dtype=bool)
    values = np.asarray(allocations)
    if values.ndim != 1 or (values.size and values.dtype.kind not in "iu"):
        raise InputTypeError(
            "allocations must be a 1-D integer array, got "
            f"{values.ndim}-D {values.dtype}"
        )
    if len(values) != n:
        raise SpecError(f"allocations has {len(values)} entries for {n} descriptors")
    same: np.ndarray = values[1:] == values[:-1]
    return same
