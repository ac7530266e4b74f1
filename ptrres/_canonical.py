"""Canonical and strided plans (SPEC 10): the kernel run, and its errors.

PointerTable checks the spec and builds (or finds cached) the layout's
kernel tables (_mappings.PlanTables); plan() and plan_strided() size the
outputs, run the canonical kernel on them and turn a failure into its error.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from . import _kernels
from ._args import INT64, SRC_DST_SIZES, block_ids_arg, out_arrays
from ._diagnose import failed_plan_error
from ._geometry import Groups
from ._groups import GroupCounts
from ._mappings import PlanTables
from ._results import StridedTransferPlan, TransferPlan

# The out= buffers of a strided plan, in order.
STRIDED_BUFFERS = (
    *SRC_DST_SIZES[:2],
    "out[2] (width)",
    "out[3] (height)",
    "out[4] (src_pitch)",
    "out[5] (dst_pitch)",
)
# Stand-ins for the outputs a flat plan does not write.
_NO_ROWS = np.empty(0, np.uint64)

IntTable = npt.NDArray[np.int64]


def plan(
    ref_table: IntTable,
    group_ref_start: IntTable,
    tables: PlanTables,
    groups: IntTable,
    block_ids: npt.NDArray[Any],
    counts: GroupCounts,
    offloaded_ids: Any,
    store: bool,
    out: Any,
    coalesce: bool,
    max_run: int,
    ref_rows: Groups,
) -> TransferPlan:
    """The flat plan of a canonical layout (PointerTable.plan_transfer).

    Args:
        ref_table, group_ref_start: the table's.
        tables: the layout's kernel tables.
        groups: the (2, n_groups) group sizes and block indices of counts.
        max_run: max_run_bytes as the kernels take it (max_run_arg).
        ref_rows: the table's refs, group by group, for error messages.
        block_ids, offloaded_ids, store, out, coalesce: as plan_transfer().
    """
    n_ops = 0
    for n, fragments in zip(counts.group_sizes, tables.group_fragments):
        n_ops += n * fragments
    src, dst, sizes = out_arrays(out, n_ops, SRC_DST_SIZES)
    outputs = (src, dst, sizes, _NO_ROWS, _NO_ROWS, _NO_ROWS)
    written, num_bytes, block_ids, chunk_ids = _fill(
        (ref_table, group_ref_start, groups), tables, (False, coalesce, max_run),
        block_ids, offloaded_ids, store, outputs,
    )  # fmt: skip
    if written < 0:
        raise failed_plan_error(
            written, (src, dst, sizes), "out's src, dst and sizes, and the ids",
            ref_rows, block_ids, counts.group_sizes, counts.block_indices,
            chunk_ids, tables.offloaded,
        )  # fmt: skip
    if written < n_ops:
        src, dst, sizes = src[:written], dst[:written], sizes[:written]
    return TransferPlan(src, dst, sizes, num_bytes)


def plan_strided(
    ref_table: IntTable,
    group_ref_start: IntTable,
    tables: PlanTables,
    groups: IntTable,
    block_ids: npt.NDArray[Any],
    counts: GroupCounts,
    offloaded_ids: Any,
    store: bool,
    out: Any,
    ref_rows: Groups,
) -> StridedTransferPlan:
    """One 2-D descriptor per (kept block, ref, run), for
    PointerTable.plan_strided_transfer; the arguments are plan()'s."""
    n_ops = 0
    for n, runs in zip(counts.group_sizes, tables.group_runs):
        n_ops += n * runs
    outputs = tuple(out_arrays(out, n_ops, STRIDED_BUFFERS))
    written, num_bytes, block_ids, chunk_ids = _fill(
        (ref_table, group_ref_start, groups), tables, (True, False, _kernels.NO_CAP),
        block_ids, offloaded_ids, store, outputs,
    )  # fmt: skip
    if written < 0:
        raise failed_plan_error(
            written, outputs, "out's six buffers, and the ids", ref_rows,
            block_ids, counts.group_sizes, counts.block_indices, chunk_ids,
            tables.offloaded,
        )  # fmt: skip
    src, dst, width, height, src_pitch, dst_pitch = (o[:written] for o in outputs)
    return StridedTransferPlan(src, dst, width, height, src_pitch, dst_pitch, num_bytes)


def _fill(
    device: tuple[IntTable, IntTable, IntTable],
    tables: PlanTables,
    kind: tuple[bool, bool, int],
    block_ids: npt.NDArray[Any],
    offloaded_ids: Any,
    store: bool,
    outputs: tuple[npt.NDArray[np.uint64], ...],
) -> tuple[int, int, npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Run the kernel; return its status or count, the bytes, and the ids.

    device: (ref_table, group_ref_start, groups), as plan() takes them.
    kind: (strided, coalesce, max_run_bytes or NO_CAP): a strided plan or a
    flat one, merged or not.
    """
    ref_table, group_ref_start, groups = device
    strided, merge, max_run = kind
    if block_ids.dtype is not INT64:
        block_ids = block_ids.astype(np.int64)
    chunk_ids = block_ids_arg(offloaded_ids, "offloaded_ids")
    if chunk_ids.dtype is not INT64:
        chunk_ids = chunk_ids.astype(np.int64)
    # Room for the chunk, sub-block and kept index of each block of a group:
    # sized by all the ids, as in _plan.run_plan.
    scratch = np.empty((3, len(block_ids)), np.int64)
    totals = np.zeros(1, np.int64)
    ref_items, items = (
        (tables.run_refs, tables.runs)
        if strided
        else (tables.fragment_refs, tables.fragments)
    )
    written = _kernels.canonical_plan_kernel(
        ref_table,
        group_ref_start,
        tables.offloaded_refs,
        ref_items,
        items,
        block_ids,
        groups,
        chunk_ids,
        tables.offloaded.blocks_per_chunk,
        store,
        strided,
        merge,
        max_run,
        scratch,
        outputs[0],
        outputs[1],
        outputs[2],
        outputs[3],
        outputs[4],
        outputs[5],
        totals,
    )
    return int(written), int(totals[0]), block_ids, chunk_ids
