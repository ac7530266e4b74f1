"""What ptrres returns, with vLLM's names and fields.

DevicePointers is what vLLM's ``resolve_device_pointers`` returns and its
``iter_pointer_groups`` walks; TransferPlan holds the arrays a batched copy
takes (``cuMemcpyBatchAsync``, or vLLM's ``_swap_blocks_batch``), SPEC 1;
StridedTransferPlan holds 2-D descriptors (``cudaMemcpy2DAsync``), SPEC 10.
FilePlan holds the (pointer, file offset, size) ops of the file tier, SPEC 11;
PeerTransferPlan the copies between two engines' KV caches, SPEC 14.
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


@dataclass(eq=False)
class StridedTransferPlan:
    """2-D copy descriptors of one transfer (SPEC 10).

    Returned by plan_strided_transfer(). Descriptor i copies ``height[i]``
    rows of ``width[i]`` bytes: row r from ``src[i] + r * src_pitch[i]`` to
    ``dst[i] + r * dst_pitch[i]``. Each descriptor is one
    ``cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, height)``, or
    one entry of ``cuMemcpy3DBatchAsync`` (a depth-1 copy). Every array is
    uint64; expand() gives the equivalent flat TransferPlan.
    """

    # Address of row 0 on the source side of each descriptor: the 2-D copy's
    # src (cudaMemcpy2DAsync) or srcPos/srcPtr of a cuMemcpy3DBatchAsync entry.
    src: npt.NDArray[np.uint64]
    # Address of row 0 on the destination side: the 2-D copy's dst.
    dst: npt.NDArray[np.uint64]
    # Bytes of each row (a CopyRun's fragment_size; the page for direct
    # plans): cudaMemcpy2DAsync's width, the 3-D entry's extent.width.
    width: npt.NDArray[np.uint64]
    # Rows of each descriptor (a CopyRun's num_fragments; 1 for direct
    # plans): cudaMemcpy2DAsync's height, the 3-D entry's extent.height.
    height: npt.NDArray[np.uint64]
    # Bytes between two source rows (local_stride on a store, else
    # canonical_stride; the width for direct plans): cudaMemcpy2DAsync's
    # spitch, the 3-D entry's source pitch.
    src_pitch: npt.NDArray[np.uint64]
    # Bytes between two destination rows: cudaMemcpy2DAsync's dpitch, the
    # 3-D entry's destination pitch.
    dst_pitch: npt.NDArray[np.uint64]
    # Bytes the whole transfer copies: the sum of width * height (for an
    # engine's transfer statistics).
    num_bytes: int

    def expand(self) -> TransferPlan:
        """The flat plan: every descriptor's rows, in order, one per row."""
        height = self.height.astype(np.int64)
        first = np.repeat(np.cumsum(height) - height, height)
        row = (np.arange(len(first), dtype=np.int64) - first).astype(np.uint64)
        src = np.repeat(self.src, height) + row * np.repeat(self.src_pitch, height)
        dst = np.repeat(self.dst, height) + row * np.repeat(self.dst_pitch, height)
        sizes = np.repeat(self.width, height)
        return TransferPlan(src, dst, sizes, self.num_bytes)


@dataclass(eq=False)
class PeerTransferPlan:
    """Copy descriptors between this engine's KV caches and a peer's (SPEC 14):
    descriptor i pairs ``sizes[i]`` bytes at ``local[i]`` with as many at
    ``remote[i]``, whichever way they move.

    Returned by PointerTable.plan_peer_transfer(); read by
    ptrres.nixl.peer_xfer_descs(), which makes NIXL's two descriptor lists of
    it: the local one of ``local`` (NIXL READs into it, WRITEs from it) and
    the remote one of ``remote``, row i of each going with row i of the other.
    """

    # This process's address of each descriptor (uint64): the local
    # descriptor's addr.
    local: npt.NDArray[np.uint64]
    # The peer's address of each descriptor (uint64), in its own process: the
    # remote descriptor's addr.
    remote: npt.NDArray[np.uint64]
    # Bytes of each descriptor (uint64): len on both sides.
    sizes: npt.NDArray[np.uint64]
    # Bytes the whole transfer moves: the sum of sizes (for an engine's
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


@dataclass(eq=False)
class FilePlan:
    """File-tier ops of one transfer (SPEC 11): one file per (group, chunk).

    Returned by plan_file_ops() and PointerTable.plan_file_ops(); read by
    write_files() and read_files(), and by a file-tier worker: op i moves
    ``sizes[i]`` bytes between device pointer ``dev_ptrs[i]`` and byte
    ``file_offsets[i]`` of its file, one ``cuFileBatchIOSubmit`` entry, one
    kvikio ``pread``/``pwrite`` or one pair of NIXL descriptors.
    """

    # Device (or host) pointer of each op (uint64), ordered file -> ref ->
    # block: cuFile's devPtr_base + devPtr_offset, kvikio's buffer + offset,
    # NIXL's memory-side addr.
    dev_ptrs: npt.NDArray[np.uint64]
    # Byte offset of each op inside its file (uint64): cuFile's file_offset,
    # kvikio's file_offset, NIXL's file-side addr.
    file_offsets: npt.NDArray[np.uint64]
    # Bytes of each op (uint64), a page or several when coalesced: cuFile's
    # size, kvikio's size, NIXL's len on both sides.
    sizes: npt.NDArray[np.uint64]
    # One entry per file plus one (int64): file f's ops are
    # file_starts[f]:file_starts[f + 1], all on that file's handle. Files are
    # numbered by (non-empty group, chunk), the order of the offload keys.
    file_starts: npt.NDArray[np.int64]
    # KV-cache group of each file (int64): which offload key names the file.
    file_groups: npt.NDArray[np.int64]
    # Bytes of each file's full layout, bpc * sum of its group's pages (int64):
    # what a worker may preallocate; a partial chunk leaves some unwritten.
    file_bytes: npt.NDArray[np.int64]
    # Bytes the whole transfer moves: the sum of sizes (for an engine's
    # transfer statistics).
    num_bytes: int

    @property
    def num_files(self) -> int:
        """The number of files (len(file_starts) - 1)."""
        return len(self.file_starts) - 1
