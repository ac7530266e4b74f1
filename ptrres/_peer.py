"""Peer transfers (SPEC 14): another engine's KV caches.

A prefill engine and a decode engine each hold their own KV caches. The peer's
memory is in another process, known only by the numbers its handshake
carries: a PeerLayout holds them, ref by ref, group by group, as a
PointerTable holds this process's, read from PeerRefs or from vLLM's
NixlAgentMetadata. _peer_plan pairs a peer with a table and plans between
them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from ._args import as_int, as_list, attributes
from ._errors import InputTypeError, LayoutError
from ._geometry import ADDRESS_LIMIT, HOST
from ._heads import HND, NHD
from ._kernels.common import OFF_COLUMNS, REF_COLUMNS

IntTable = npt.NDArray[np.int64]


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
        (``ssm_sizes``), PLE conv state (``ple_block_len``), context
        parallelism (``dcp_size``, ``pcp_size`` over 1) and packed regions
        (``packed_member_layouts``), whose pages are not one block per row;
        fields of other lengths. Each region is its own registration
        (allocation None), as vLLM registers them. A region's blocks are the
        kernel's (physical) blocks: where ``physical_blocks_per_logical_kv_block``
        is over 1, remote ids are physical ids, as vLLM expands them.
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
        "ple_block_len (PLE conv state)": getattr(metadata, "ple_block_len", None)
        is not None,
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
