"""The data model, with vLLM's names and fields.

Every function of ptrres also accepts any object that has these attribute
names (vLLM's own classes among them): these classes are a convenience for
callers that do not have vLLM at hand, not a requirement.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt


class GPULoadStoreSpec:
    """The device blocks of one transfer, ordered by KV-cache group.

    Args:
        block_ids: GPU block ids of every group, concatenated: a 1-D integer
            array (vLLM has used int32 and int64; the dtype is kept) or a
            sequence of ints. Nothing is checked here: resolving checks it.
        group_sizes: how many of ``block_ids`` belong to each group (a group may
            have none). Defaults to a single group holding every id.
        block_indices: for each group, the index inside the request of its
            first block; it sets where the group starts inside an offloaded
            chunk. Defaults to 0 for every group.
    """

    __slots__ = ("block_ids", "block_indices", "group_sizes")

    def __init__(
        self,
        block_ids: npt.ArrayLike,
        group_sizes: Sequence[int] | None = None,
        block_indices: Sequence[int] | None = None,
    ) -> None:
        ids = np.asarray(block_ids)
        if ids.size == 0 and ids.dtype.kind == "f":
            ids = ids.astype(np.int64)  # numpy reads [] as float64
        self.block_ids: npt.NDArray[np.integer[Any]] = ids
        sizes = (len(ids),) if group_sizes is None else tuple(group_sizes)
        self.group_sizes: tuple[int, ...] = sizes
        self.block_indices: tuple[int, ...] = (
            (0,) * len(sizes) if block_indices is None else tuple(block_indices)
        )

    def __repr__(self) -> str:
        return (
            f"GPULoadStoreSpec(block_ids={self.block_ids!r}, "
            f"group_sizes={self.group_sizes!r}, block_indices={self.block_indices!r})"
        )


@dataclass(eq=False)
class CanonicalKVCacheTensor:
    """One device tensor of the KV cache, whose first dimension is num_blocks."""

    # A torch tensor (any device) or a numpy array. vLLM passes an int8 view
    # (num_blocks, page_bytes); ptrres reads the row stride in bytes, so any
    # dtype and any row stride at least as wide as the pages work.
    tensor: Any
    # The (possibly padded) page size. ptrres reads the geometry from the
    # tensor itself; this field is kept for compatibility with vLLM.
    page_size_bytes: int


@dataclass(eq=False)
class CanonicalKVCacheRef:
    """One layer (or layer group) of a KV-cache group."""

    # Index into CanonicalKVCaches.tensors of the tensor this ref lives in.
    tensor_idx: int
    # Bytes to copy per block: the un-padded page, starting at the row start.
    page_size_bytes: int
    # vLLM carries an optional mapping here; ptrres ignores it.
    mapping: Any = None


@dataclass(eq=False)
class CanonicalKVCaches:
    """The unique KV-cache tensors, and for each group the refs it copies."""

    tensors: list[CanonicalKVCacheTensor]
    # group_data_refs[g] lists the refs of group g, in copy order. Several refs
    # (of different groups) may share a tensor; a group may have no refs.
    group_data_refs: list[list[CanonicalKVCacheRef]] = field(default_factory=list)


@dataclass(eq=False)
class DevicePointers:
    """Resolved device pointers: one (ptr, size) per group, ref and block."""

    # Pointer of each copy op, ordered group -> ref -> block.
    ptrs: npt.NDArray[np.uint64]
    # Bytes of each copy op (the ref's page_size_bytes).
    sizes: npt.NDArray[np.uint64]
    # Blocks of each group (the spec's group_sizes), empty groups included.
    group_block_counts: tuple[int, ...]
    # Refs of each group.
    group_data_ref_counts: tuple[int, ...]
    # Index inside the request of each group's first block.
    block_indices: tuple[int, ...]


@dataclass(eq=False)
class TransferPlan:
    """Copy descriptors of one transfer: copy sizes[i] bytes from src[i] to dst[i]."""

    # Source pointer of each descriptor (uint64).
    src: npt.NDArray[np.uint64]
    # Destination pointer of each descriptor (uint64).
    dst: npt.NDArray[np.uint64]
    # Bytes of each descriptor (uint64).
    sizes: npt.NDArray[np.uint64]
    # Bytes the whole transfer copies: the sum of sizes.
    num_bytes: int


class DevicePointerGroupInfo(NamedTuple):
    """Where one non-empty group sits in DevicePointers and in offloaded chunks."""

    group_idx: int
    group_size: int
    n_data_refs: int
    # Offset of the group's first block inside its first offloaded chunk.
    skip: int
    # Offloaded chunks the group spans.
    n_chunks: int
    # Index in DevicePointers.ptrs of the group's first op.
    dev_ptr_offset: int


@dataclass(eq=False)
class FilePlan:
    """File-tier ops of one transfer (SPEC 11): one file per (group, chunk).

    Op i moves ``sizes[i]`` bytes between device pointer ``dev_ptrs[i]`` and
    byte ``file_offsets[i]`` of its file: a cuFile/kvikio ``pread``/``pwrite``
    (buffer, size, file offset), or one entry of ``cuFileBatchIOSubmit``.
    """

    # Device (or host) pointer of each op (uint64), ordered file -> ref -> block.
    dev_ptrs: npt.NDArray[np.uint64]
    # Byte offset of each op inside its file (uint64).
    file_offsets: npt.NDArray[np.uint64]
    # Bytes of each op (uint64): a page, or several when coalesced.
    sizes: npt.NDArray[np.uint64]
    # One entry per file plus one (int64): file f's ops are
    # file_starts[f]:file_starts[f + 1]. Files are numbered by (non-empty
    # group, chunk), the order of the offload keys.
    file_starts: npt.NDArray[np.int64]
    # KV-cache group of each file (int64).
    file_groups: npt.NDArray[np.int64]
    # Bytes of each file's full layout, bpc * sum of its group's pages (int64);
    # a partial chunk leaves some of them unwritten.
    file_bytes: npt.NDArray[np.int64]
    # Bytes the whole transfer moves: the sum of sizes.
    num_bytes: int

    @property
    def num_files(self) -> int:
        """The number of files (len(file_starts) - 1)."""
        return len(self.file_starts) - 1
