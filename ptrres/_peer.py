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
from ._heads import KV_LAYOUTS, check_kv_layout
from ._kernels.common import OFF_COLUMNS, REF_COLUMNS

IntTable = npt.NDArray[np.int64]

# The largest device a ref may be on: CUDA device indices are C ints.
MAX_DEVICE = 2**31 - 1


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
    fields are integers, none negative, its page within its row stride, its
    last block below 2**63 and its device a C int. A plan between a table
    and a peer layout checks that both have the same refs per group and the
    same page per ref, then every local id against its own ref's tensor and
    every remote id against the peer ref's ``num_blocks``.

    Args:
        group_refs: per group, its refs: PeerRefs, tuples of their fields, or
            objects with their attribute names.
        kv_layout: the peer's page layout where known (SPEC 15): ptrres's
            ``"HND"`` or ``"NHD"``, or the vLLM KVCacheLayout name its
            handshake sends (``"LBHNC"``, ``"LBNHC"``, ``"LHBNC"``,
            ``"BLHNC"``, ``"BLNHC"``, ``"BHLNC"``), kept as given. A plan
            that slices some of a page's heads is refused unless they are
            one byte range of it: HND, LBHNC and BLHNC pages. None: unknown
            (the caller's word that its pages are HND, as with tp_mapping's
            default).
    """

    def __init__(self, group_refs: Any, *, kv_layout: str | None = None) -> None:
        if kv_layout is not None:
            kv_layout = check_kv_layout(kv_layout, "kv_layout (or None)")
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
        """The peer layout a vLLM NIXL handshake describes (vLLM 0.30 to 0.34's
        ``NixlAgentMetadata``, or any object with its fields), so that a
        connector plans against what it received. Every number in it is the
        peer's word, checked before it is used: a malformed or hostile
        handshake raises a PtrresError (SPEC 15), nothing else.

        Read: ``kv_caches_base_addr``, ``block_lens`` and ``block_strides``
        (one region each: a ref), ``region_num_blocks`` (else ``num_blocks``
        for every region), ``region_group_ids`` (region r serves group
        ``region_group_ids[r]``, below the number of regions, or every group
        where -1; None or one group id: one group), ``device_id`` (a CUDA
        device index) and ``region_mem_types`` ("DRAM": host; without them,
        the regions are VRAM of ``device_id``), and ``kv_cache_layout``,
        which every handshake must carry (vLLM's always does): a vLLM
        KVCacheLayout name (``"LBHNC"``, ``"LBNHC"``, ``"LHBNC"``,
        ``"BLHNC"``, ``"BLNHC"``, ``"BHLNC"``) or ptrres's ``"HND"`` /
        ``"NHD"``, kept as the layout's ``kv_layout``; another string
        (``"nhd"``, ``""``) is a LayoutError, another type or none an
        InputTypeError. Refused (LayoutError): Mamba state (``ssm_sizes``),
        PLE conv state (``ple_block_len``), context parallelism
        (``dcp_size``, ``pcp_size`` over 1) and packed regions
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
# The fields of vLLM's NixlAgentMetadata that ptrres needs.
HANDSHAKE_FIELDS = (
    "kv_caches_base_addr",
    "block_lens",
    "block_strides",
    "num_blocks",
    "kv_cache_layout",
)


def nixl_metadata_groups(metadata: Any) -> tuple[list[list[PeerRef]], str]:
    """A vLLM NixlAgentMetadata's regions as a PeerLayout's groups, and its
    page layout (PeerLayout.from_nixl_metadata)."""
    bases, lens, strides, num_blocks, layout = attributes(
        metadata, HANDSHAKE_FIELDS, "metadata"
    )
    kv_layout = handshake_layout(layout)
    bases, lens, strides = (
        as_list(value, f"metadata.{name}")
        for value, name in zip((bases, lens, strides), HANDSHAKE_FIELDS)
    )
    num_blocks = as_int(num_blocks, "metadata.num_blocks")
    dcp, pcp = (
        as_int(getattr(metadata, name, 1), f"metadata.{name}")
        for name in ("dcp_size", "pcp_size")
    )
    ssm_sizes = getattr(metadata, "ssm_sizes", None)
    ssm_sizes = [
        as_int(size, "metadata.ssm_sizes")
        for size in (
            [] if ssm_sizes is None else as_list(ssm_sizes, "metadata.ssm_sizes")
        )
    ]
    what = {
        "ssm_sizes (Mamba state)": any(ssm_sizes),
        f"dcp_size {dcp}": dcp != 1,
        f"pcp_size {pcp}": pcp != 1,
        "packed_member_layouts": _has_entries(metadata, "packed_member_layouts"),
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
    counts = _region_field(metadata, "region_num_blocks", num_blocks, n)
    owners = _region_field(metadata, "region_group_ids", 0, n)
    mem_types = _region_field(metadata, "region_mem_types", "VRAM", n)
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
    group_of = [as_int(g, "metadata.region_group_ids") for g in owners]
    if group_of and not -1 <= min(group_of) <= max(group_of) < n:
        raise LayoutError(
            f"the peer's handshake has region_group_ids {group_of}: a region "
            f"serves one group, numbered below its {n} regions, or every group (-1)"
        )
    device = as_int(getattr(metadata, "device_id", 0), "metadata.device_id")
    if not 0 <= device <= MAX_DEVICE:
        raise LayoutError(
            f"the peer's handshake has device_id {device}: a CUDA device index, "
            f"0 to {MAX_DEVICE}"
        )
    refs = [
        PeerRef(base, stride, page, blocks, HOST if mem == "DRAM" else device)
        for base, page, stride, blocks, mem in zip(
            bases, lens, strides, counts, mem_types
        )
    ]
    group_ids = sorted(set(group_of) - {-1})
    if len(group_ids) <= 1:  # vLLM maps no groups to regions: one group
        groups = [refs]
    else:
        groups = [
            [ref for ref, owner in zip(refs, group_of) if owner in (g, -1)]
            for g in range(group_ids[-1] + 1)
        ]
    return groups, kv_layout


def handshake_layout(layout: Any) -> str:
    """A handshake's kv_cache_layout, checked: a name of KV_LAYOUTS."""
    if not isinstance(layout, str):
        raise InputTypeError(
            "metadata.kv_cache_layout must be a vLLM KVCacheLayout name (a str), "
            f"got {type(layout).__name__} {layout!r}"
        )
    if layout not in KV_LAYOUTS:
        raise LayoutError(
            f"the peer's handshake has kv_cache_layout {layout!r}: ptrres reads "
            f"vLLM's KVCacheLayout names and its own HND and NHD "
            f"({', '.join(KV_LAYOUTS)})"
        )
    return str(layout)


def _region_field(metadata: Any, name: str, default: Any, n: int) -> list[Any]:
    """A handshake's per-region field ``name`` as a list (``default`` for
    each of the ``n`` regions where it is None or missing)."""
    value = getattr(metadata, name, None)
    return [default] * n if value is None else as_list(value, f"metadata.{name}")


def _has_entries(metadata: Any, name: str) -> bool:
    """Whether a handshake's field ``name`` (a mapping or sequence, or None)
    holds anything."""
    value = getattr(metadata, name, None)
    if value is None:
        return False
    try:
        return len(value) > 0
    except TypeError:
        raise InputTypeError(
            f"metadata.{name} must be a mapping or a sequence, got "
            f"{type(value).__name__}"
        ) from None


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
    # Every field, and the end of the last block, below 2**63 (the kernels'
    # int64 columns), a ref of no blocks included.
    end = base + (blocks - 1) * stride + page if blocks else base
    if max(end, stride, page, blocks) > ADDRESS_LIMIT:
        raise LayoutError(
            f"{where} at 0x{base:x} ({blocks} blocks, {stride} B apart) does not "
            "lie below 2**63, the addresses ptrres computes"
        )
    if device is not None and not HOST <= device <= MAX_DEVICE:
        raise LayoutError(
            f"{where}: device {device} is neither HOST (-1) nor a GPU (0 to "
            f"{MAX_DEVICE})"
        )
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
