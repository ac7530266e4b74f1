"""Transfer plans: every (src, dst, size) copy descriptor of a store or a load.

PointerTable checks the device side (a spec's groups, or resolved pointers:
read_device_pointers and block_ids_behind recover the ids behind them) and
the offloaded side, and comes here with plain arrays; run_plan() runs the
plan kernel and turns a failure into its error.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import numpy.typing as npt

from . import _kernels
from ._args import (
    DEVICE_POINTERS_FIELDS,
    INT64,
    SRC_DST_SIZES,
    Buffers,
    as_int,
    as_list,
    attributes,
    block_ids_arg,
    descriptor_array,
    out_arrays,
)
from ._diagnose import chunk_count_error, failed_plan_error, pointer_error
from ._errors import SpecError
from ._geometry import Groups
from ._groups import GroupCounts, check_groups
from ._offloaded import OffloadedLayout
from ._results import TransferPlan

IntTable = npt.NDArray[np.int64]

# Rows of the plan kernel's scratch: chunk and sub-block of each block of a
# group, then the group's runs (kernels.coalesce.find_runs).
SCRATCH_ROWS = 6
# Scratch of up to this many columns is kept, one per thread (threads share
# tables, and a kernel writes its scratch); larger is allocated per call,
# where the allocation costs little next to the plan.
KEPT_SCRATCH_COLUMNS = 4097
_kept = threading.local()


def plan_scratch(n_ids: int) -> npt.NDArray[np.int64]:
    """Scratch for plan_kernel, with more columns than any group has ids:
    this thread's kept one when it is large enough (np.empty costs a quarter
    of a microsecond, a fifth of a small plan's kernel)."""
    scratch: npt.NDArray[np.int64] | None = getattr(_kept, "scratch", None)
    if scratch is not None and n_ids < scratch.shape[1]:
        return scratch
    if n_ids < KEPT_SCRATCH_COLUMNS:
        # Kept at full size at once (200 KB): a thread allocates it once.
        scratch = np.empty((SCRATCH_ROWS, KEPT_SCRATCH_COLUMNS), np.int64)
        _kept.scratch = scratch
        return scratch
    return np.empty((SCRATCH_ROWS, n_ids + 1), np.int64)


def run_plan(
    ref_table: IntTable,
    group_ref_start: IntTable,
    offloaded_refs: IntTable,
    groups: IntTable,
    block_ids: npt.NDArray[Any],
    counts: GroupCounts,
    offloaded_ids: Any,
    offloaded: OffloadedLayout,
    store: bool,
    out: Buffers | None,
    coalesce: bool,
    max_run: int,
    ref_rows: Groups,
) -> TransferPlan:
    """Run the plan kernel on a checked layout and spec.

    Args:
        ref_table, group_ref_start: the table's (or a canonical layout's
            direct form, _mappings.DirectTables).
        offloaded_refs: the offloaded tensor of each ref (OFF_* columns).
        groups: the (2, n_groups) group sizes and block indices of counts.
        max_run: max_run_bytes as the kernels take it (max_run_arg).
        ref_rows: the table's refs, group by group, for error messages.
        block_ids, offloaded_ids, offloaded, store, out, coalesce: as
            PointerTable.plan_transfer().
    """
    n_ops, num_bytes, group_sizes, block_indices = counts
    if block_ids.dtype is not INT64:
        block_ids = block_ids.astype(np.int64)
    chunk_ids = block_ids_arg(offloaded_ids, "offloaded_ids")
    if chunk_ids.dtype is not INT64:
        chunk_ids = chunk_ids.astype(np.int64)
    src, dst, sizes = out_arrays(out, n_ops, SRC_DST_SIZES)
    # Sized by all the ids, as max() of the group sizes costs more than the
    # memory.
    scratch = plan_scratch(len(block_ids))
    written = _kernels.plan_kernel(
        ref_table,
        group_ref_start,
        offloaded_refs,
        block_ids,
        groups,
        chunk_ids,
        offloaded.blocks_per_chunk,
        store,
        coalesce,
        max_run,
        scratch,
        src,
        dst,
        sizes,
    )
    if written < 0:
        raise failed_plan_error(
            written, (src, dst, sizes), "out's src, dst and sizes, and the ids",
            ref_rows, block_ids, group_sizes, block_indices, chunk_ids, offloaded,
        )  # fmt: skip
    if written < n_ops:
        src, dst, sizes = src[:written], dst[:written], sizes[:written]
    return TransferPlan(src, dst, sizes, num_bytes)


# Resolved pointers as read: ptrs, sizes, and the number of blocks behind them.
DevicePointerArrays = tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64], int]


def read_device_pointers(
    device_ptrs: Any, ref_counts: tuple[int, ...], page_bytes: tuple[int, ...]
) -> tuple[DevicePointerArrays, GroupCounts]:
    """Resolved pointers' arrays, and their groups checked against a layout
    of these refs per group and bytes per block (check_groups)."""
    raw_ptrs, raw_sizes, raw_counts, raw_ref_counts, raw_indices = attributes(
        device_ptrs, DEVICE_POINTERS_FIELDS, "device_ptrs"
    )
    their_ref_counts = tuple(
        as_int(n, "group_data_ref_counts[{}]", g)
        for g, n in enumerate(as_list(raw_ref_counts, "group_data_ref_counts"))
    )
    if their_ref_counts != ref_counts:
        raise SpecError(
            f"device_ptrs has refs per group {their_ref_counts}, but this table "
            f"has {ref_counts}"
        )
    group_sizes = tuple(as_list(raw_counts, "group_block_counts"))
    n_block_ids = sum(
        as_int(n, "group_block_counts[{}]", g) for g, n in enumerate(group_sizes)
    )
    counts = check_groups(
        group_sizes,
        tuple(as_list(raw_indices, "block_indices")),
        n_block_ids,
        ref_counts,
        page_bytes,
    )
    ptrs = descriptor_array(raw_ptrs, "device_ptrs.ptrs")
    sizes = descriptor_array(raw_sizes, "device_ptrs.sizes")
    if not len(ptrs) == len(sizes) == counts.n_ops:
        raise SpecError(
            f"device_ptrs has {len(ptrs)} ptrs and {len(sizes)} sizes, but its "
            f"groups make {counts.n_ops} ops"
        )
    return (ptrs, sizes, n_block_ids), counts


def block_ids_behind(
    ref_table: IntTable,
    group_ref_start: IntTable,
    group_sizes: IntTable,
    pointers: DevicePointerArrays,
    counts: GroupCounts,
    offloaded_ids: Any,
    blocks_per_chunk: int,
    ref_rows: Groups,
    ref_counts: tuple[int, ...],
) -> tuple[npt.NDArray[np.int64], npt.NDArray[Any]]:
    """The block ids behind resolved pointers, every pointer checked, and the
    offloaded ids checked against the groups' chunks.

    Args:
        ref_table, group_ref_start: the table's.
        group_sizes: counts' group sizes as an int64 array.
        pointers: read_device_pointers()'s ptrs, sizes and block count.
        ref_rows, ref_counts: the table's refs, group by group (for error
            messages), and how many each group has.

    Returns:
        The block ids, and the offloaded ids as block_ids_arg() makes them.
    """
    ptrs, sizes, n_block_ids = pointers
    # A group without refs has no pointers to bound its size, only its
    # share of the offloaded ids: a size they cannot cover fails here,
    # before an id is allocated for each of its blocks.
    chunk_ids = block_ids_arg(offloaded_ids, "offloaded_ids")
    unbounded = sum(n for n, r in zip(counts.group_sizes, ref_counts) if not r)
    if unbounded > len(chunk_ids) * blocks_per_chunk:
        count_error = chunk_count_error(
            chunk_ids, counts.group_sizes, counts.block_indices, blocks_per_chunk
        )
        if count_error is not None:  # always: they span more chunks
            raise count_error
    block_ids = np.empty(n_block_ids, np.int64)
    bad_op = _kernels.block_ids_from_pointers(
        ref_table, group_ref_start, group_sizes, ptrs, sizes, block_ids
    )
    if bad_op >= 0:
        raise pointer_error(ref_rows, int(bad_op), ptrs, counts.group_sizes)
    return block_ids, chunk_ids
