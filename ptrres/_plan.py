"""Transfer plans: every (src, dst, size) copy descriptor of a store or a load.

PointerTable.plan_transfer() and plan_from_device_pointers() check the device
side (the spec, or resolved pointers) and come here; run_plan() checks the
offloaded side, runs the plan kernel and turns a failure into its error.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from . import _canonical, _kernels
from ._args import (
    DEVICE_POINTERS_FIELDS,
    INT64,
    SRC_DST_SIZES,
    as_int,
    as_list,
    attributes,
    block_ids_arg,
    descriptor_array,
    max_run_arg,
    out_arrays,
)
from ._diagnose import (
    chunk_count_error,
    failed_plan_error,
    pointer_error,
)
from ._errors import InputTypeError, SpecError
from ._offloaded import OffloadedLayout
from ._results import TransferPlan

if TYPE_CHECKING:
    from ._table import GroupCounts, PointerTable

Buffers = tuple[npt.NDArray[Any], ...]

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
    table: PointerTable,
    block_ids: npt.NDArray[Any],
    counts: GroupCounts,
    offloaded: OffloadedLayout,
    offloaded_ids: Any,
    *,
    store: bool,
    out: Buffers | None,
    coalesce: bool,
    max_run_bytes: int | None,
) -> TransferPlan:
    """Check the offloaded side and run the plan kernel (PointerTable's
    plan_transfer() documents the arguments)."""
    if type(store) is not bool:
        raise InputTypeError(f"store must be True or False, got {store!r}")
    if type(coalesce) is not bool:
        raise InputTypeError(f"coalesce must be True or False, got {coalesce!r}")
    max_run = max_run_arg(max_run_bytes)
    n_ops, num_bytes, group_sizes, block_indices = counts
    ref_table = table.ref_table
    cached = table._offloaded  # inline: a method call costs on every plan
    if cached is not None and cached[0] is offloaded:
        offloaded_refs = cached[1]
    elif isinstance(offloaded, OffloadedLayout) and offloaded.canonical:
        # Never cached there: canonical layouts always come here.
        direct = _canonical.as_direct(table, offloaded, store) if coalesce else None
        if direct is None:
            return _canonical.plan(
                table, block_ids, counts, offloaded, offloaded_ids, store, out,
                coalesce, max_run,
            )  # fmt: skip
        ref_table, offloaded_refs = direct.ref_table, direct.offloaded_refs
        num_bytes = sum(n * b for n, b in zip(group_sizes, direct.group_bytes))
    else:
        offloaded_refs = table._offloaded_refs(offloaded)
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
        table.group_ref_start,
        offloaded_refs,
        block_ids,
        table._groups_array(group_sizes, block_indices),
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
            table._groups, block_ids, group_sizes, block_indices, chunk_ids,
            offloaded,
        )  # fmt: skip
    if written < n_ops:
        src, dst, sizes = src[:written], dst[:written], sizes[:written]
    return TransferPlan(src, dst, sizes, num_bytes)


def plan_from_device_pointers(
    table: PointerTable,
    device_ptrs: Any,
    offloaded: OffloadedLayout,
    offloaded_ids: Any,
    *,
    store: bool,
    out: Buffers | None,
    coalesce: bool,
    max_run_bytes: int | None,
) -> TransferPlan:
    """PointerTable.plan_from_device_pointers(): recover the block ids behind
    resolved pointers, checking every pointer, then plan as plan_transfer()."""
    raw_ptrs, raw_sizes, raw_counts, raw_ref_counts, raw_indices = attributes(
        device_ptrs, DEVICE_POINTERS_FIELDS, "device_ptrs"
    )
    ref_counts = tuple(
        as_int(n, "group_data_ref_counts[{}]", g)
        for g, n in enumerate(as_list(raw_ref_counts, "group_data_ref_counts"))
    )
    if ref_counts != table.group_data_ref_counts:
        raise SpecError(
            f"device_ptrs has refs per group {ref_counts}, but this table has "
            f"{table.group_data_ref_counts}"
        )
    group_sizes_in = tuple(as_list(raw_counts, "group_block_counts"))
    n_block_ids = sum(
        as_int(n, "group_block_counts[{}]", g) for g, n in enumerate(group_sizes_in)
    )
    counts = table._check_groups(
        group_sizes_in, tuple(as_list(raw_indices, "block_indices")), n_block_ids
    )
    group_sizes, block_indices = counts.group_sizes, counts.block_indices
    ptrs = descriptor_array(raw_ptrs, "device_ptrs.ptrs")
    sizes = descriptor_array(raw_sizes, "device_ptrs.sizes")
    if not len(ptrs) == len(sizes) == counts.n_ops:
        raise SpecError(
            f"device_ptrs has {len(ptrs)} ptrs and {len(sizes)} sizes, but its "
            f"groups make {counts.n_ops} ops"
        )
    # A group without refs has no pointers to bound its size, only its
    # share of the offloaded ids: a size they cannot cover fails here,
    # before an id is allocated for each of its blocks.
    table._offloaded_refs(offloaded)  # an OffloadedLayout that fits
    chunk_ids = block_ids_arg(offloaded_ids, "offloaded_ids")
    unbounded = sum(n for n, r in zip(group_sizes, ref_counts) if not r)
    if unbounded > len(chunk_ids) * offloaded.blocks_per_chunk:
        count_error = chunk_count_error(
            chunk_ids, group_sizes, block_indices, offloaded.blocks_per_chunk
        )
        if count_error is not None:  # always: they span more chunks
            raise count_error
    block_ids = np.empty(n_block_ids, np.int64)
    bad_op = _kernels.block_ids_from_pointers(
        table.ref_table,
        table.group_ref_start,
        table._group_sizes_array(group_sizes),
        ptrs,
        sizes,
        block_ids,
    )
    if bad_op >= 0:
        raise pointer_error(table._groups, int(bad_op), ptrs, group_sizes)
    return run_plan(
        table,
        block_ids,
        counts,
        offloaded,
        chunk_ids,
        store=store,
        out=out,
        coalesce=coalesce,
        max_run_bytes=max_run_bytes,
    )
