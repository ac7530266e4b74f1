"""What callers pass in, with vLLM's names and fields.

Every function of ptrres also accepts any object that has these attribute
names (vLLM's own classes among them): these classes are a convenience for
callers that do not have vLLM at hand, not a requirement.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

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
