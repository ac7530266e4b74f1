"""Plans between this engine's KV caches and a peer's (SPEC 14, 15).

PointerTable.plan_peer_transfer comes here with its columns and a checked
spec. pair_peer() checks a PeerLayout against the table once per peer and
head slice (the same refs; the same page, or the same bytes per head) and
moves each ref's rows to the bytes it copies; plan_peer() runs the plan
kernel with the peer as the offloaded side, one block to a chunk, so that the
peer's id of block k is its "chunk" k, checked against the peer ref's own
count, and coalescing keeps to one allocation per side (SPEC 6).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from . import _kernels
from ._args import INT64, Buffers, block_ids_arg, out_arrays
from ._diagnose import failed_peer_plan_error
from ._errors import InputTypeError, LayoutError, SpecError
from ._geometry import Groups
from ._groups import GroupCounts
from ._heads import KV_LAYOUTS, SLICEABLE, HeadSlice, check_slice, slices_heads
from ._kernels.common import BASE_PTR, OFF_BASE_PTR, OFF_SUB_BYTES, PAGE_SIZE
from ._peer import PeerLayout
from ._plan import plan_scratch
from ._results import PeerTransferPlan

IntTable = npt.NDArray[np.int64]

# What the out= buffers of plan_peer_transfer are, in order (for out_arrays).
LOCAL_REMOTE_SIZES = ("out[0] (local)", "out[1] (remote)", "out[2] (sizes)")


class PeerPair(NamedTuple):
    """A peer layout checked against a table, for one head slice (or none):
    both sides' ref rows, each ref moved to the bytes it copies."""

    peer: PeerLayout
    heads: HeadSlice | None
    # The table's ref_table (a PointerTable's columns), each ref's base moved
    # to the slice and its page the slice's bytes.
    local_refs: IntTable
    # The peer's ref_table and its offloaded rows (one block to a chunk),
    # likewise.
    remote_refs: IntTable
    remote_offloaded: IntTable
    # Bytes one block of each group copies, over its refs.
    group_bytes: tuple[int, ...]

    def matches(self, peer: Any, heads: Any) -> bool:
        """Whether this pair is of that peer and head slice (a HeadSlice of
        the same ints: a tuple, or fields of other types, are checked anew)."""
        if peer is not self.peer or heads is self.heads:
            return peer is self.peer
        return (
            type(heads) is HeadSlice
            and all(type(value) is int for value in heads)
            and heads == self.heads
        )


def pair_peer(
    peer: Any,
    heads: Any,
    ref_table: IntTable,
    ref_rows: Groups,
    ref_counts: tuple[int, ...],
) -> PeerPair:
    """A peer layout that pairs with a table of these refs: the same refs per
    group and, per ref, the same page on both sides (SPEC 14) or, with a head
    slice, pages of the same bytes per head (SPEC 15)."""
    if not isinstance(peer, PeerLayout):
        raise InputTypeError(f"peer must be a PeerLayout, got {type(peer).__name__}")
    if heads is not None:
        heads = check_slice(heads)
        # First: a layout that cannot be sliced (LHBNC's regions are heads,
        # and would also differ in number) says so, and what would work.
        check_peer_layout(peer, heads)
    if peer.group_data_ref_counts != ref_counts:
        raise LayoutError(
            f"the peer has refs per group {peer.group_data_ref_counts}, but this "
            f"table has {ref_counts}"
        )
    slices = []
    # A slice's bytes by the pair of pages (the refs of a model share a few).
    ranges: dict[tuple[int, int], tuple[int, int, int]] = {}
    for group, (local_refs, peer_refs) in enumerate(zip(ref_rows, peer.groups)):
        for d, (local, remote) in enumerate(zip(local_refs, peer_refs)):
            local_page, remote_page = local.page_size_bytes, remote.page_size_bytes
            if heads is not None:
                pages = (local_page, remote_page)
                if pages not in ranges:
                    try:
                        ranges[pages] = heads.byte_range(local_page, remote_page)
                    except LayoutError as error:
                        raise LayoutError(f"group {group}, ref {d}: {error}") from None
                slices.append(ranges[pages])
            elif local_page != remote_page:
                raise LayoutError(
                    f"group {group}, ref {d}: the local page is {local_page} B but "
                    f"the peer's is {remote_page} B: a peer transfer copies the "
                    "same page on both sides (or a head slice of them: heads=)"
                )
    if heads is None or heads.whole_page:
        group_bytes = tuple(sum(r.page_size_bytes for r in refs) for refs in ref_rows)
        return PeerPair(
            peer, heads, ref_table, peer.ref_table, peer.offloaded_refs, group_bytes
        )
    local_offsets, remote_offsets, sizes = np.array(slices, np.int64).reshape(-1, 3).T
    sliced = np.split(sizes, np.cumsum(ref_counts)[:-1])
    return PeerPair(
        peer,
        heads,
        moved_refs(ref_table, local_offsets, sizes, BASE_PTR, PAGE_SIZE),
        moved_refs(peer.ref_table, remote_offsets, sizes, BASE_PTR, PAGE_SIZE),
        moved_refs(
            peer.offloaded_refs, remote_offsets, sizes, OFF_BASE_PTR, OFF_SUB_BYTES
        ),
        tuple(int(group.sum()) for group in sliced),
    )


def check_peer_layout(peer: PeerLayout, heads: HeadSlice) -> None:
    """Refuse a slice of some of the heads of a peer's pages where they are
    not one byte range of a page (NHD pages, vLLM's LBNHC, LHBNC, BLNHC and
    BHLNC: KV_LAYOUTS says why for each)."""
    layout = peer.kv_layout
    if not heads.whole_page and not slices_heads(layout):
        raise LayoutError(
            f"the peer's pages are {layout} ({KV_LAYOUTS[str(layout)]}): the "
            f"{heads.num_heads} of {heads.remote_heads} heads rank "
            f"{heads.source_rank} gives are not one byte range of a page; "
            f"{SLICEABLE}"
        )


def moved_refs(
    refs: IntTable, offsets: IntTable, sizes: IntTable, base: int, page: int
) -> IntTable:
    """A copy of a kernel's ref rows, each ref's base moved by its offset and
    its page (column ``page``) the size given: the slice of every block."""
    moved: IntTable = refs.copy()
    moved[:, base] += offsets
    moved[:, page] = sizes
    return moved


def plan_peer(
    group_ref_start: IntTable,
    pair: PeerPair,
    groups: IntTable,
    block_ids: npt.NDArray[Any],
    counts: GroupCounts,
    remote_ids: Any,
    out: Buffers | None,
    coalesce: bool,
    max_run: int,
    ref_rows: Groups,
) -> PeerTransferPlan:
    """Run the plan kernel for a peer transfer, on a checked spec and peer.

    Args:
        group_ref_start: the table's.
        pair: pair_peer()'s.
        groups: the (2, n_groups) group sizes and zero block indices.
        max_run: max_run_bytes as the kernels take it (max_run_arg).
        ref_rows: the table's refs, group by group, for error messages.
        block_ids, counts, remote_ids, out, coalesce: as
            PointerTable.plan_peer_transfer().
    """
    n_ops, num_bytes, group_sizes, _ = counts
    if pair.heads is not None:
        num_bytes = sum(n * b for n, b in zip(group_sizes, pair.group_bytes))
    if block_ids.dtype is not INT64:
        block_ids = block_ids.astype(np.int64)
    remote = block_ids_arg(remote_ids, "remote_ids")
    if remote.dtype is not INT64:
        remote = remote.astype(np.int64)
    if len(remote) != len(block_ids):
        raise SpecError(
            f"there are {len(remote)} remote ids but {len(block_ids)} local block "
            "ids: each local block pairs with one remote block"
        )
    local_out, remote_out, sizes = out_arrays(out, n_ops, LOCAL_REMOTE_SIZES)
    written = _kernels.plan_kernel(
        pair.local_refs,
        group_ref_start,
        pair.remote_offloaded,
        block_ids,
        groups,
        remote,
        1,  # one block to a "chunk": the remote id
        True,  # the local side is the kernel's device side (src)
        coalesce,
        max_run,
        plan_scratch(len(block_ids)),
        local_out,
        remote_out,
        sizes,
    )
    if written < 0:
        raise failed_peer_plan_error(
            written, (local_out, remote_out, sizes), ref_rows, block_ids,
            group_sizes, remote, pair.peer.groups,
        )  # fmt: skip
    if written < n_ops:
        local_out, remote_out = local_out[:written], remote_out[:written]
        sizes = sizes[:written]
    return PeerTransferPlan(local_out, remote_out, sizes, num_bytes)
