"""Peer transfers (SPEC 14): another engine's KV caches, and plans between them.

A prefill engine and a decode engine each hold their own KV caches. The peer's
memory is in another process, known only by the numbers its handshake
carries: a PeerLayout holds them, ref by ref, group by group, as a
PointerTable holds this process's. PointerTable.plan_peer_transfer comes here
with its columns and a checked spec: plan_peer() runs the plan kernel with
the peer as the offloaded side, one block to a chunk, so that the peer's id
of block k is its "chunk" k, checked against the peer ref's own count, and
coalescing keeps to one allocation per side (SPEC 6).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from . import _kernels
from ._args import (
    INT64,
    Buffers,
    as_int,
    as_list,
    attributes,
    block_ids_arg,
    out_arrays,
)
from ._diagnose import failed_peer_plan_error
from ._errors import InputTypeError, LayoutError, SpecError
from ._geometry import ADDRESS_LIMIT, HOST, Groups
from ._groups import GroupCounts
from ._heads import HND, NHD, HeadSlice, check_slice
from ._kernels.common import (
    BASE_PTR,
    OFF_BASE_PTR,
    OFF_COLUMNS,
    OFF_SUB_BYTES,
    PAGE_SIZE,
    REF_COLUMNS,
)
from ._plan import plan_scratch
from ._results import PeerTransferPlan

IntTable = npt.NDArray[np.int64]

# What the out= buffers of plan_peer_transfer are, in order (for out_arrays).
LOCAL_REMOTE_SIZES = ("out[0] (local)", "out[1] (remote)", "out[2] (sizes)")


class PeerRef(NamedTuple):
    """One ref of a peer engine's KV caches, by the numbers a handshake
    carries (vLLM's ``NixlAgentMetadata``: ``kv_caches_base_addr``,
    ``block_strides``, ``block_lens``, ``num_blocks``)."""

    # Address of the ref's tensor (block 0) in the peer's process.
    base_ptr: int
    # Bytes between two of its blocks.
    row_stride_bytes: int
    # Bytes the ref copies per block: the same as the local ref's page.
    page_size_bytes: int
    # Its blocks: a remote id must be 0 <= id < num_blocks.
    num_blocks: int
    # HOST (-1) for host memory, else the peer's CUDA device index (NIXL's
    # devId of its VRAM); None where unknown.
    device: int | None = HOST
    # Refs of one value are views of one allocation of the peer, so that a
    # merged copy may pass from one into another; None: an allocation of its
    # own (the safe answer: NIXL refuses a descriptor that spans two
    # registrations).
    allocation: int | None = None


class PeerLayout:
    """A peer engine's KV caches: for each group, its refs (PeerRef), in the
    order of this engine's ``group_data_refs`` (SPEC 14).

    Like a PointerTable it holds plain integers, checked once: each ref's
    fields are integers, none negative, its page within its row stride and
    its last block below 2**63. A plan between a table and a peer layout
    checks that both have the same refs per group and the same page per ref,
    then every local id against its own ref's tensor and every remote id
    against the peer ref's ``num_blocks``.

    Args:
        group_refs: per group, its refs: PeerRefs, tuples of their fields, or
            objects with their attribute names.
        kv_layout: the peer's page layout where known, ``"HND"`` or
            ``"NHD"`` (SPEC 15): a plan that slices heads out of NHD pages is
            refused. None: unknown (the caller's word, as with tp_mapping's).
    """

    def __init__(self, group_refs: Any, *, kv_layout: str | None = None) -> None:
        if kv_layout is not None and not (
            isinstance(kv_layout, str) and kv_layout in (HND, NHD)
        ):
            raise InputTypeError(
                f"kv_layout must be 'HND', 'NHD' or None, got {kv_layout!r}"
            )
        self.kv_layout = kv_layout
        groups = [
            tuple(
                _peer_ref(ref, g, d)
                for d, ref in enumerate(as_list(refs, f"group_refs[{g}]"))
            )
            for g, refs in enumerate(as_list(group_refs, "group_refs"))
        ]
        self.groups: tuple[tuple[PeerRef, ...], ...] = tuple(groups)
        self.group_data_ref_counts: tuple[int, ...] = tuple(len(g) for g in groups)
        refs = [ref for group in groups for ref in group]
        # The refs of group g are rows group_ref_start[g]:group_ref_start[g + 1].
        self.group_ref_start = np.cumsum(
            (0, *self.group_data_ref_counts), dtype=np.int64
        )
        allocations = _allocation_ids(refs)
        # A PointerTable's columns (BASE_PTR..., TENSOR_IDX the ref's row),
        # for kernels that read a ref table (resolve, indices).
        self.ref_table = np.array(
            [
                (r.base_ptr, r.row_stride_bytes, r.page_size_bytes, r.num_blocks, i, a)
                for i, (r, a) in enumerate(zip(refs, allocations))
            ],
            dtype=np.int64,
        ).reshape(len(refs), REF_COLUMNS)
        # The peer as the offloaded side of the plan kernel, one block to a
        # chunk: the remote id is the chunk (OFF_BASE_PTR...).
        self.offloaded_refs = np.array(
            [
                (r.base_ptr, r.row_stride_bytes, r.page_size_bytes, r.num_blocks, a)
                for r, a in zip(refs, allocations)
            ],
            dtype=np.int64,
        ).reshape(len(refs), OFF_COLUMNS)

    @classmethod
    def of(cls, table: Any) -> PeerLayout:
        """A table's own numbers, as its peer will know them: what this engine
        sends in its handshake (the peer then plans against it)."""
        devices = [geometry.device for geometry in table._tensors]
        return cls(
            [
                [
                    PeerRef(
                        ref.base_ptr,
                        ref.row_stride_bytes,
                        ref.page_size_bytes,
                        ref.num_blocks,
                        devices[ref.tensor_idx],
                        ref.allocation,
                    )
                    for ref in group
                ]
                for group in table._groups
            ]
        )

    @classmethod
    def from_nixl_metadata(cls, metadata: Any) -> PeerLayout:
        """The peer layout a vLLM NIXL handshake describes (vLLM 0.30 to 0.33's
        ``NixlAgentMetadata``, or any object with its fields), so that a
        connector plans against what it received.

        Read: ``kv_caches_base_addr``, ``block_lens`` and ``block_strides``
        (one region each: a ref), ``region_num_blocks`` (else ``num_blocks``
        for every region), ``region_group_ids`` (region r serves group
        ``region_group_ids[r]``, or every group where -1; None or one group
        id: one group), ``device_id`` and ``region_mem_types`` ("DRAM":
        host; without them, the regions are VRAM of ``device_id``), and
        ``kv_cache_layout``. Refused (LayoutError): Mamba state
        (``ssm_sizes``), context parallelism (``dcp_size``, ``pcp_size`` over
        1) and packed regions (``packed_member_layouts``), whose pages are not
        one block per row; fields of other lengths. Each region is its own
        registration (allocation None), as vLLM registers them.
        """
        groups, kv_layout = nixl_metadata_groups(metadata)
        return cls(groups, kv_layout=kv_layout)

    def __repr__(self) -> str:
        return (
            f"PeerLayout({len(self.groups)} groups, "
            f"refs per group {self.group_data_ref_counts})"
        )


# The memory a region of vLLM's handshake lies in (region_mem_types).
MEM_TYPES = ("DRAM", "VRAM")


def nixl_metadata_groups(metadata: Any) -> tuple[list[list[PeerRef]], str | None]:
    """A vLLM NixlAgentMetadata's regions as a PeerLayout's groups, and its
    page layout (PeerLayout.from_nixl_metadata)."""
    fields = ("kv_caches_base_addr", "block_lens", "block_strides", "num_blocks")
    bases, lens, strides, num_blocks = attributes(metadata, fields, "metadata")
    bases, lens, strides = (
        as_list(value, f"metadata.{name}")
        for value, name in zip((bases, lens, strides), fields)
    )
    dcp, pcp = (getattr(metadata, name, 1) for name in ("dcp_size", "pcp_size"))
    what = {
        "ssm_sizes (Mamba state)": any(getattr(metadata, "ssm_sizes", None) or ()),
        f"dcp_size {dcp}": dcp != 1,
        f"pcp_size {pcp}": pcp != 1,
        "packed_member_layouts": bool(getattr(metadata, "packed_member_layouts", {})),
    }
    refused = [name for name, present in what.items() if present]
    if refused:
        raise LayoutError(
            f"the peer's handshake has {', '.join(refused)}: ptrres reads regions "
            "of one KV page per block only"
        )
    n = len(bases)
    counts, owners, mem_types = (
        as_list(getattr(metadata, name, None) or [default] * n, f"metadata.{name}")
        for name, default in (
            ("region_num_blocks", num_blocks),
            ("region_group_ids", 0),
            ("region_mem_types", "VRAM"),
        )
    )
    for name, values in (
        ("block_lens", lens),
        ("block_strides", strides),
        ("region_num_blocks", counts),
        ("region_group_ids", owners),
        ("region_mem_types", mem_types),
    ):
        if len(values) != n:
            raise LayoutError(
                f"the peer's handshake has {n} regions (kv_caches_base_addr) but "
                f"{len(values)} {name}"
            )
    unknown = [m for m in mem_types if not (isinstance(m, str) and m in MEM_TYPES)]
    if unknown:
        raise LayoutError(
            f"the peer's handshake has regions of memory {unknown[0]!r}: ptrres "
            "reads 'DRAM' and 'VRAM' regions"
        )
    owners = [as_int(g, "metadata.region_group_ids") for g in owners]
    if min(owners, default=0) < -1:
        raise LayoutError(
            f"the peer's handshake has region_group_ids {owners}: a region serves "
            "a group (>= 0) or every group (-1)"
        )
    device = as_int(getattr(metadata, "device_id", 0), "metadata.device_id")
    refs = [
        PeerRef(base, stride, page, blocks, HOST if mem == "DRAM" else device)
        for base, page, stride, blocks, mem in zip(
            bases, lens, strides, counts, mem_types
        )
    ]
    group_ids = sorted(set(owners) - {-1})
    if len(group_ids) <= 1:  # vLLM maps no groups to regions: one group
        groups = [refs]
    else:
        groups = [
            [ref for ref, owner in zip(refs, owners) if owner in (g, -1)]
            for g in range(group_ids[-1] + 1)
        ]
    layout = getattr(metadata, "kv_cache_layout", None)
    return groups, layout if isinstance(layout, str) and layout in (HND, NHD) else None


def _peer_ref(entry: Any, group: int, d: int) -> PeerRef:
    """One ref of a peer, read and checked."""
    where = f"peer group {group}, ref {d}"
    if isinstance(entry, tuple):  # a PeerRef, or a tuple of its fields
        if not 4 <= len(entry) <= len(PeerRef._fields):
            raise InputTypeError(
                f"{where}: a tuple of the 4 to 6 fields {PeerRef._fields}, got "
                f"{len(entry)}"
            )
        defaults = (HOST, None)[len(entry) - 4 :]  # device, allocation
        values = PeerRef._make((*entry, *defaults))
    else:
        base_ptr, row_stride, page, blocks = attributes(
            entry, PeerRef._fields[:4], where
        )
        values = PeerRef(
            base_ptr,
            row_stride,
            page,
            blocks,
            getattr(entry, "device", HOST),
            getattr(entry, "allocation", None),
        )
    base, stride, page, blocks = (
        as_int(value, "{}: {}", where, name)
        for value, name in zip(values[:4], PeerRef._fields)
    )
    device = (
        None if values.device is None else as_int(values.device, "{}: device", where)
    )
    allocation = values.allocation
    if allocation is not None:
        allocation = as_int(allocation, "{}: allocation", where)
    if min(base, stride, page, blocks) < 0:
        raise LayoutError(
            f"{where}: base_ptr {base}, row_stride_bytes {stride}, page_size_bytes "
            f"{page} and num_blocks {blocks}: none may be negative"
        )
    if page > stride:
        raise LayoutError(
            f"{where}: page_size_bytes {page} is larger than the row stride "
            f"({stride} B)"
        )
    if blocks and base + (blocks - 1) * stride + page > ADDRESS_LIMIT:
        raise LayoutError(
            f"{where} at 0x{base:x} ({blocks} blocks, {stride} B apart) does not "
            "lie below 2**63, the addresses ptrres computes"
        )
    if device is not None and device < HOST:
        raise LayoutError(f"{where}: device {device} is neither HOST (-1) nor a GPU")
    return PeerRef(base, stride, page, blocks, device, allocation)


def _allocation_ids(refs: Sequence[PeerRef]) -> list[int]:
    """The kernels' allocation of each ref: equal given values share one
    (0, 1, ...), and each ref without one has its own (negative)."""
    given: dict[int, int] = {}
    ids = []
    for i, ref in enumerate(refs):
        if ref.allocation is None:
            ids.append(-1 - i)
        else:
            ids.append(given.setdefault(ref.allocation, len(given)))
    return ids


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
    if heads is not None:
        check_peer_layout(peer, heads)
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
    """Refuse a slice of some of the heads of a peer's NHD pages."""
    if not heads.whole_page and peer.kv_layout == NHD:
        raise LayoutError(
            f"the peer's pages are NHD: the {heads.num_heads} of {heads.remote_heads} "
            f"heads rank {heads.source_rank} gives are one fragment per token, not "
            "one byte range; head-slice HND pages (vLLM's kv_cache_layout 'HND')"
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
