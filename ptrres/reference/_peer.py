"""Peer transfers (SPEC 14): plans between a local layout and a peer's, and
indices into NIXL's prepared lists, in plain numpy.

The peer is read here from its numbers (the refs of each group, each with
base_ptr, row_stride_bytes, page_size_bytes, num_blocks), in code of its
own; the local side is the reference's resolve_device_pointers.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from .._errors import (
    InputTypeError,
    LayoutError,
    RemoteBlockIdError,
    SpecError,
)
from .._heads import HeadSlice
from .._results import PeerTransferPlan
from ._input import as_ids, as_int, as_list, read_kv_caches, read_spec
from ._resolve import _block_id_error, resolve_device_pointers

PEER_FIELDS = ("base_ptr", "row_stride_bytes", "page_size_bytes", "num_blocks")


class PeerRef(NamedTuple):
    """One ref of the peer, as the reference reads it (bytes)."""

    base_ptr: int
    row_stride_bytes: int
    page_size_bytes: int
    num_blocks: int


def read_peer(group_refs: Any) -> list[list[PeerRef]]:
    """The peer's refs, group by group: tuples of at least their four fields,
    or objects with the fields' names; each checked."""
    groups = []
    for group, refs in enumerate(as_list(group_refs, "group_refs")):
        peer_refs = []
        for d, entry in enumerate(as_list(refs, f"group_refs[{group}]")):
            where = f"peer group {group}, ref {d}"
            if isinstance(entry, tuple):
                raw = entry[:4]
            else:
                missing = [name for name in PEER_FIELDS if not hasattr(entry, name)]
                if missing:
                    raise InputTypeError(
                        f"{where} must have the attributes {', '.join(PEER_FIELDS)}; "
                        f"{type(entry).__name__} has no {', '.join(missing)}"
                    )
                raw = tuple(getattr(entry, name) for name in PEER_FIELDS)
            ref = PeerRef(
                *(as_int(v, f"{where}: {n}") for v, n in zip(raw, PEER_FIELDS))
            )
            if min(ref) < 0:
                raise LayoutError(
                    f"{where}: base_ptr {ref.base_ptr}, row_stride_bytes "
                    f"{ref.row_stride_bytes}, page_size_bytes {ref.page_size_bytes} "
                    f"and num_blocks {ref.num_blocks}: none may be negative"
                )
            if ref.page_size_bytes > ref.row_stride_bytes:
                raise LayoutError(
                    f"{where}: page_size_bytes {ref.page_size_bytes} is larger "
                    f"than the row stride ({ref.row_stride_bytes} B)"
                )
            peer_refs.append(ref)
        groups.append(peer_refs)
    return groups


def plan_peer_transfer(
    device_spec: Any,
    kv_caches: Any,
    peer_group_refs: Any,
    remote_ids: Any,
    heads: HeadSlice | None = None,
) -> PeerTransferPlan:
    """Copies between this engine's blocks and a peer's (SPEC 14): for group
    g, ref d, block k, ``(local_base + local_id * local_stride, remote_base +
    remote_id * remote_stride, page)``, group -> ref -> block.

    The local side is resolve_device_pointers(); the remote side one
    vectorised expression per group and ref, each remote id checked against
    its peer ref. With ``heads`` (SPEC 15), each copy is the slice's heads:
    both pointers move to the slice's first head and the size is its heads.
    """
    layout = read_kv_caches(kv_caches)
    peer = read_peer(peer_group_refs)
    counts = tuple(len(refs) for refs in peer)
    if counts != tuple(len(refs) for refs in layout):
        raise LayoutError(
            f"the peer has refs per group {counts}, but this table has "
            f"{tuple(len(refs) for refs in layout)}"
        )
    # Per ref: (local offset, remote offset, size) of what it copies.
    copies: list[tuple[int, int, int]] = []
    for group, (local_refs, peer_refs) in enumerate(zip(layout, peer)):
        for d, (local_ref, peer_ref) in enumerate(zip(local_refs, peer_refs)):
            if heads is not None:
                copies.append(_head_bytes(heads, local_ref, peer_ref, group, d))
                continue
            copies.append((0, 0, local_ref.page_size_bytes))
            if local_ref.page_size_bytes != peer_ref.page_size_bytes:
                raise LayoutError(
                    f"group {group}, ref {d}: the local page is "
                    f"{local_ref.page_size_bytes} B but the peer's is "
                    f"{peer_ref.page_size_bytes} B: a peer transfer copies the "
                    "same page on both sides (or a head slice of them: heads=)"
                )
    device_ptrs = resolve_device_pointers(device_spec, kv_caches)
    remote = as_ids(remote_ids, "remote_ids")
    n_ids = sum(device_ptrs.group_block_counts)
    if len(remote) != n_ids:
        raise SpecError(
            f"there are {len(remote)} remote ids but {n_ids} local block ids: "
            "each local block pairs with one remote block"
        )
    local_ptrs = device_ptrs.ptrs.copy()
    remote_ptrs = np.empty(len(device_ptrs.ptrs), np.uint64)
    sizes = np.empty(len(device_ptrs.ptrs), np.uint64)
    op = first = ref_index = 0
    for group, (n, refs) in enumerate(zip(device_ptrs.group_block_counts, peer)):
        ids = remote[first : first + n]
        for d, ref in enumerate(refs):
            _check_remote(ids, ref, group, d)
            local_offset, remote_offset, size = copies[ref_index]
            local_ptrs[op : op + n] += np.uint64(local_offset)
            remote_ptrs[op : op + n] = np.uint64(
                ref.base_ptr + remote_offset
            ) + ids.astype(np.uint64) * np.uint64(ref.row_stride_bytes)
            sizes[op : op + n] = size
            op += n
            ref_index += 1
        first += n
    return PeerTransferPlan(
        local_ptrs, remote_ptrs, sizes, int(sizes.sum(dtype=np.uint64))
    )


def _head_bytes(
    heads: HeadSlice, local_ref: Any, peer_ref: PeerRef, group: int, d: int
) -> tuple[int, int, int]:
    """A head slice of one ref's pages, in bytes: (local offset, remote
    offset, size), the two sides' heads of the same bytes."""
    if not isinstance(heads, HeadSlice):
        raise InputTypeError(f"heads must be a HeadSlice, got {type(heads).__name__}")
    heads = HeadSlice(*(as_int(v, f"heads.{n}") for v, n in zip(heads, heads._fields)))
    if heads.num_heads < 1 or heads.source_rank < 0:
        raise LayoutError(f"{heads}: no heads, or no rank")
    if not (
        0 <= heads.local_head <= heads.local_heads - heads.num_heads
        and 0 <= heads.remote_head <= heads.remote_heads - heads.num_heads
    ):
        raise LayoutError(f"{heads}: heads outside a page")
    local_page, remote_page = local_ref.page_size_bytes, peer_ref.page_size_bytes
    if local_page % heads.local_heads or remote_page % heads.remote_heads:
        raise LayoutError(
            f"group {group}, ref {d}: pages of {local_page} B and {remote_page} B "
            f"do not split into {heads.local_heads} and {heads.remote_heads} heads"
        )
    head = local_page // heads.local_heads
    if remote_page // heads.remote_heads != head:
        raise LayoutError(
            f"group {group}, ref {d}: a head is {head} B here but "
            f"{remote_page // heads.remote_heads} B at the peer"
        )
    return heads.local_head * head, heads.remote_head * head, heads.num_heads * head


def _check_remote(ids: npt.NDArray[Any], ref: PeerRef, group: int, d: int) -> None:
    bad = np.flatnonzero((ids < 0) | (ids >= ref.num_blocks))
    if len(bad):
        position = int(bad[0])
        value = int(ids[position])
        raise RemoteBlockIdError(
            f"group {group}, position {position}: remote block id {value} is out "
            f"of range for ref {d}, whose peer tensor has {ref.num_blocks} blocks",
            group=group,
            position=position,
            value=value,
        )


def prepped_indices(
    layout: Any, block_ids: Any, group_sizes: Any = None
) -> npt.NDArray[np.int32]:
    """Indices into a prepared list of one strided row per ref (SPEC 14):
    for group g, ref d, block k, the blocks of every ref before (g, d) plus
    block_ids[k]; each id checked against its ref's blocks.

    Args:
        layout: a CanonicalKVCaches (this engine's side) or a peer's refs,
            group by group (the other side).
    """
    local = hasattr(layout, "group_data_refs")
    groups: list[list[Any]] = read_kv_caches(layout) if local else read_peer(layout)
    ids = as_ids(block_ids, "block_ids")
    sizes = (len(ids),) if group_sizes is None else group_sizes
    n_groups = len(groups)
    ids, sizes_array, _ = read_spec(_Spec(ids, sizes, (0,) * n_groups), n_groups)
    indices = []
    first_index = first = 0
    for group, (n, refs) in enumerate(zip(sizes_array.tolist(), groups)):
        group_ids = ids[first : first + n].astype(np.int64)
        for d, ref in enumerate(refs):
            if ((group_ids < 0) | (group_ids >= ref.num_blocks)).any():
                if local:
                    raise _block_id_error(group_ids, ref, group, d)
                _check_remote(group_ids, ref, group, d)
            indices.append(first_index + group_ids)
            first_index += ref.num_blocks
        first += n
    if not indices:
        return np.zeros(0, np.int32)
    return np.concatenate(indices).astype(np.int32)


class _Spec(NamedTuple):
    """Ids and group sizes, as read_spec reads a spec."""

    block_ids: Any
    group_sizes: Any
    block_indices: Any
