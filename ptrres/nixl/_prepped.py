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
from .._heads import HeadSlice, check_slice
from .._kernels.common import BASE_PTR, NUM_BLOCKS, PAGE_SIZE, ROW_STRIDE
from .._peer import PeerLayout
from .._peer_plan import check_peer_layout, moved_refs, pair_peer
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
    layout: PointerTable | PeerLayout,
    *,
    heads: HeadSlice | None = None,
    memory: Memory | None = None,
) -> PreppedRows:
    """The strided rows of a table's or a peer layout's prepared list: one
    row per ref, ``(base, page, devId, stride, count)`` (SPEC 14).

    Args:
        heads: a slice of the KV heads (SPEC 15; ptrres.tp_mapping()): each
            row is then that slice of its pages, ``(base + offset, size,
            devId, stride, count)``, on this engine's side for a table and on
            the peer rank's for a peer layout. prepped_pair() makes both
            sides' lists and checks that they pair.
        memory: the rows' memory (default: memory_of(layout)).

    Raises:
        LayoutError: more descriptors than NIXL's int indices reach; a page
            that does not split into the slice's heads.
    """
    table = _ref_table(layout)
    if heads is not None:
        table = _sliced(table, heads, layout)
    return _rows(table, memory_of(layout) if memory is None else memory_of(memory))


def prepped_pair(
    table: PointerTable, peer: PeerLayout, heads: HeadSlice | None = None
) -> tuple[PreppedRows, PreppedRows]:
    """Both sides' prepared lists for transfers between a table and one peer
    layout (one peer rank): ``(local, remote)``, each as prepped_rows()
    makes it, checked to pair as plan_peer_transfer() checks them: the same
    refs per group, and each ref's rows of the same bytes on both sides (the
    same page, or with ``heads``, the slice of each side's page).

    With a TPMapping, one pair per source rank: ``prepped_pair(table,
    peers[s.source_rank], s) for s in mapping.slices``; the indices of
    prepped_indices() are the same for every pair.

    Raises:
        LayoutError: a peer that does not pair with the table (naming the
            group, the ref and the bytes).
        InputTypeError: a table or peer of the wrong type.
    """
    if not isinstance(table, PointerTable):
        raise InputTypeError(
            f"table must be a PointerTable, got {type(table).__name__}"
        )
    pair = pair_peer(
        peer, heads, table.ref_table, table._groups, table.group_data_ref_counts
    )
    return (
        _rows(pair.local_refs, memory_of(table)),
        _rows(pair.remote_refs, memory_of(peer)),
    )


def _rows(table: npt.NDArray[np.int64], memory: Memory) -> PreppedRows:
    counts = table[:, NUM_BLOCKS]
    _check_descriptors(counts)
    rows = np.empty((len(table), 5), np.uint64)
    rows[:, 0] = table[:, BASE_PTR]
    rows[:, 1] = table[:, PAGE_SIZE]
    rows[:, 2] = memory.dev_id
    rows[:, 3] = table[:, ROW_STRIDE]
    rows[:, 4] = counts
    return PreppedRows(rows, memory.mem_type)


def _check_descriptors(counts: npt.NDArray[np.int64]) -> None:
    """Refuse refs of more blocks than NIXL's int indices reach, summed
    exactly (a peer's counts may be near 2**63 each: numpy's sum wraps)."""
    total = sum(counts.tolist())
    if total > MAX_PREPPED_DESCRIPTORS:
        raise LayoutError(
            f"the refs hold {total} blocks: a prepared list of one descriptor per "
            f"block would pass NIXL's {MAX_PREPPED_DESCRIPTORS} indices"
        )


def _sliced(
    table: npt.NDArray[np.int64], heads: Any, layout: PointerTable | PeerLayout
) -> npt.NDArray[np.int64]:
    """A ref table's rows moved to one head slice of their pages (this
    engine's side for a table, the peer rank's for a peer layout)."""
    heads = check_slice(heads)
    if isinstance(layout, PeerLayout):
        check_peer_layout(layout, heads)
    local = isinstance(layout, PointerTable)
    slice_range = heads.local_range if local else heads.remote_range
    offsets, sizes = (
        np.array([slice_range(int(page)) for page in table[:, PAGE_SIZE]], np.int64)
        .reshape(len(table), 2)
        .T
    )
    return moved_refs(table, offsets, sizes, BASE_PTR, PAGE_SIZE)


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
        _check_descriptors(counts)
        table = ref_table.copy()
        table[:, BASE_PTR] = np.cumsum(counts) - counts
        _index_tables[layout] = table
    return table
