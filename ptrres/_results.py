"""What ptrres returns, with vLLM's names and fields.

DevicePointers is what vLLM's ``resolve_device_pointers`` returns and its
``iter_pointer_groups`` walks; TransferPlan holds the arrays a batched copy
takes (``cuMemcpyBatchAsync``, or vLLM's ``_swap_blocks_batch``), SPEC 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import numpy.typing as npt


@dataclass(eq=False)
class DevicePointers:
    """Resolved device pointers: one (ptr, size) per group, ref and block.

    Returned by resolve() and resolve_device_pointers(); read by
    iter_pointer_groups() and plan_from_device_pointers(), and by an engine
    pairing them with offloaded pointers for its batched copy.
    """

    # Pointer of each copy op, ordered group -> ref -> block (uint64): the
    # device side of the copy (its src on a store, its dst on a load).
    ptrs: npt.NDArray[np.uint64]
    # Bytes of each copy op, the ref's page_size_bytes (uint64): the copy's
    # sizes.
    sizes: npt.NDArray[np.uint64]
    # Blocks of each group (the spec's group_sizes), empty groups included;
    # iter_pointer_groups reads it as each group's group_size.
    group_block_counts: tuple[int, ...]
    # Refs of each group; iter_pointer_groups reads it as n_data_refs.
    group_data_ref_counts: tuple[int, ...]
    # Index inside the request of each group's first block (the spec's);
    # iter_pointer_groups turns it into skip and n_chunks.
    block_indices: tuple[int, ...]


@dataclass(eq=False)
class TransferPlan:
    """Copy descriptors of one transfer: copy sizes[i] bytes from src[i] to dst[i].

    Returned by plan_transfer(), plan_from_device_pointers() and coalesce();
    its three arrays are the arguments of one batched copy call.
    """

    # Source pointer of each descriptor (uint64): the copy's srcs.
    src: npt.NDArray[np.uint64]
    # Destination pointer of each descriptor (uint64): the copy's dsts.
    dst: npt.NDArray[np.uint64]
    # Bytes of each descriptor (uint64): the copy's sizes.
    sizes: npt.NDArray[np.uint64]
    # Bytes the whole transfer copies: the sum of sizes (for an engine's
    # transfer statistics).
    num_bytes: int


class DevicePointerGroupInfo(NamedTuple):
    """Where one non-empty group sits in DevicePointers and in offloaded chunks.

    Yielded by iter_pointer_groups(), as vLLM's is: an engine's offloading
    handler reads it to pair each group's device pointers with its chunks.
    """

    # Index of the group in the KV caches' group_data_refs.
    group_idx: int
    # Blocks of the group (> 0: empty groups are skipped).
    group_size: int
    # Refs of the group: the group's ops are n_data_refs * group_size.
    n_data_refs: int
    # Offset of the group's first block inside its first offloaded chunk.
    skip: int
    # Offloaded chunks the group spans: how many offloaded ids it takes.
    n_chunks: int
    # Index in DevicePointers.ptrs of the group's first op.
    dev_ptr_offset: int
