"""NIXL's prepared lists of ptrres's layouts, and a transfer's indices into
them (SPEC 14): one strided row ``(base, page, devId, stride, count)`` per
ref, and int32 indices, ref-major, ``first index of the ref + block id``,
every id checked against its own ref's block count."""

from __future__ import annotations

import weakref
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from .. import _kernels
from .._args import block_ids_arg
from .._diagnose import overlap_error, remote_ids_error, resolve_error
from .._errors import InputTypeError, LayoutError, OutBufferError
from .._groups import check_groups
from .._kernels.common import BASE_PTR, NUM_BLOCKS, PAGE_SIZE, ROW_STRIDE
from .._peer import PeerLayout
from .._table import PointerTable
from ._memory import Memory, memory_of

# NIXL indices are C ints: a prepared list holds at most this many.
MAX_PREPPED_DESCRIPTORS = 2**31 - 1


class PreppedRows(NamedTuple):
    """A layout's prepared descriptor list: one strided row per ref.

    ``agent.prep_xfer_dlist(agent_name, *rows)`` prepares it (NIXL_INIT_AGENT
    for this process's table, the peer's name for a peer layout).
    """

    # (n_refs, 5) uint64: (base, page, devId, stride, count) of each ref, in
    # the table's order (group -> ref): ref r's block b is descriptor
    # first(r) + b, first(r) the sum of the counts before it.
    xfer_list: npt.NDArray[np.uint64]
    # NIXL's memory type of the rows.
    mem_type: str


def prepped_rows(
    layout: PointerTable | PeerLayout, *, memory: Memory | None = None
) -> PreppedRows:
    """The strided rows of a table's or a peer layout's prepared list: one
    row per ref, ``(base, page, devId, stride, count)`` (SPEC 14).

    Args:
        memory: the rows' memory (default: memory_of(layout)).

    Raises:
        LayoutError: more descriptors than NIXL's int indices reach.
    """
    table = _ref_table(layout)
    counts = table[:, NUM_BLOCKS]
    if int(counts.sum()) > MAX_PREPPED_DESCRIPTORS:
        raise LayoutError(
            f"the refs hold {int(counts.sum())} blocks: a prepared list of one "
            f"descriptor per block would pass NIXL's {MAX_PREPPED_DESCRIPTORS} "
            "indices"
        )
    memory = memory_of(layout) if memory is None else memory_of(memory)
    rows = np.empty((len(table), 5), np.uint64)
    rows[:, 0] = table[:, BASE_PTR]
    rows[:, 1] = table[:, PAGE_SIZE]
    rows[:, 2] = memory.dev_id
    rows[:, 3] = table[:, ROW_STRIDE]
    rows[:, 4] = counts
    return PreppedRows(rows, memory.mem_type)


def prepped_indices(
    layout: PointerTable | PeerLayout,
    block_ids: Any,
    group_sizes: Any = None,
    *,
    out: Any = None,
) -> npt.NDArray[np.int32]:
    """A transfer's indices into a layout's prepared list (prepped_rows):
    ref-major, for group g, ref d, block k, ``first(g, d) + block_ids[k]``,
    every id checked against its own ref's block count (SPEC 14).

    The local side's indices come from this engine's table and spec, the
    remote side's from the peer layout and the peer's ids (with the same
    group sizes): index i of one side goes with index i of the other
    (``make_prepped_xfer``).

    Args:
        layout: a PointerTable or a PeerLayout.
        block_ids: the ids, group by group; or a spec (a GPULoadStoreSpec,
            any object with ``block_ids`` and ``group_sizes``), whose ids
            and group sizes are taken.
        group_sizes: ids per group (default: the spec's, or one group of
            them all).
        out: an optional 1-D int32 buffer, at least as long as the indices;
            the result is then a view of it.

    Raises:
        BlockIdError: an id outside its ref (RemoteBlockIdError for a peer
            layout), with nothing of the indices returned.
        SpecError, InputTypeError, OutBufferError: malformed input.
    """
    table = _index_table(layout)
    if group_sizes is None and hasattr(block_ids, "group_sizes"):
        block_ids, group_sizes = block_ids.block_ids, block_ids.group_sizes
    ids = block_ids_arg(block_ids)
    ref_counts = layout.group_data_ref_counts
    sizes = (len(ids),) if group_sizes is None else group_sizes
    counts = check_groups(
        sizes, (0,) * len(ref_counts), len(ids), ref_counts, (0,) * len(ref_counts)
    )
    indices = _out_indices(out, counts.n_ops)
    status = _kernels.prepped_indices_kernel(
        table,
        layout.group_ref_start,
        ids,
        np.array(counts.group_sizes, np.int64),
        indices,
    )
    if status < 0:
        if status == _kernels.OVERLAPPING_BUFFERS:
            raise overlap_error("out (the indices) and block_ids")
        indices[:] = 0
        if isinstance(layout, PeerLayout):
            raise remote_ids_error(layout.groups, ids, counts.group_sizes)
        raise resolve_error(layout._groups, ids, counts.group_sizes)
    return indices


def _out_indices(out: Any, n: int) -> npt.NDArray[np.int32]:
    if out is None:
        return np.empty(n, np.int32)
    if not isinstance(out, np.ndarray) or out.dtype != np.int32 or out.ndim != 1:
        raise InputTypeError(
            f"out must be a 1-D int32 numpy array, got "
            f"{getattr(out, 'dtype', type(out).__name__)}"
        )
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise OutBufferError("out must be C-contiguous and writable")
    if len(out) < n:
        raise OutBufferError(f"out has {len(out)} entries; {n} indices are needed")
    return out[:n]


def _ref_table(layout: Any) -> npt.NDArray[np.int64]:
    if not isinstance(layout, (PointerTable, PeerLayout)):
        raise InputTypeError(
            "layout must be a PointerTable or a PeerLayout, got "
            f"{type(layout).__name__}"
        )
    table: npt.NDArray[np.int64] = layout.ref_table
    return table


# Each layout's index table: its ref table with every ref's first index in
# the prepared list in BASE_PTR (layouts are read-only once built).
_index_tables: weakref.WeakKeyDictionary[Any, npt.NDArray[np.int64]] = (
    weakref.WeakKeyDictionary()
)


def _index_table(layout: Any) -> npt.NDArray[np.int64]:
    """A layout's index table, made once (its type checked first: the cache
    takes weak references, which not every object allows)."""
    ref_table = _ref_table(layout)
    table = _index_tables.get(layout)
    if table is None:
        counts = ref_table[:, NUM_BLOCKS]
        if int(counts.sum()) > MAX_PREPPED_DESCRIPTORS:
            prepped_rows(layout)  # raises the LayoutError
        table = ref_table.copy()
        table[:, BASE_PTR] = np.cumsum(counts) - counts
        _index_tables[layout] = table
    return table
