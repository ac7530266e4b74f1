"""Kernels of vLLM's simple CPU offload path: ``copy_blocks``' descriptors.

vLLM's ``SimpleCPUOffloadConnector`` (``vllm/v1/simple_kv_offload/
cuda_mem_ops.py``) copies blocks between two lists of per-layer tensors with
one bytes-per-block ``bpb[l]`` per layer, equal on both sides. Block id pair k
of layer l is one descriptor, layer-major (SPEC 12):

    src = src_base[l] + src_ids[k] * bpb[l]
    dst = dst_base[l] + dst_ids[k] * bpb[l]
    size = bpb[l]

Every id is checked against its layer's tensors' block counts (SRC_BLOCKS,
DST_BLOCKS) in the pass that uses it. A kernel returns the number of
descriptors it wrote, BAD_BLOCK_ID (the wrapper then finds the first bad id),
OVERLAPPING_BUFFERS or SHORT_OUTPUTS (both checked before anything is
written).

Merged (copy_block_runs_kernel), the runs are decided by the id pairs alone,
the same for every layer: pair k + 1 continues an ascending run when both its
ids are one more than pair k's, a descending one when both are one less; a
run is one or the other, and a gap, a repeat, a mismatch between the sides or
a change of direction ends it (SPEC 6). A merged descriptor starts at the
run's lowest block on each side. Runs never leave their layer's tensors (one
allocation per copy).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._config import inline_helper, kernel
from .common import (
    BAD_BLOCK_ID,
    ONE,
    OVERLAPPING_BUFFERS,
    ZERO,
    IntArray,
    UIntArray,
    lesser,
    overlaps,
)

# Columns of a copy table: one row per layer, in vLLM's layer order.
SRC_BASE = 0  # data pointer of the layer's source tensor
DST_BASE = 1  # data pointer of its destination tensor
BLOCK_BYTES = 2  # bytes per block: stride(0) * element_size(), both sides
SRC_BLOCKS = 3  # blocks of the source tensor: valid ids are 0 <= id < this
DST_BLOCKS = 4  # blocks of the destination tensor
COPY_COLUMNS = 5

# Rows of the descriptors' output: three arrays of one allocation, as
# cuMemcpyBatchAsync takes them (each row's address is one argument).
SRC_ROW, DST_ROW, SIZE_ROW = 0, 1, 2

# An output shorter than the descriptors of the call (nothing is written).
SHORT_OUTPUTS = np.int64(-4)

# Rows of copy_block_runs_kernel's scratch table of runs.
RUN_SRC, RUN_DST, RUN_BLOCKS = 0, 1, 2

_TABLE = "int64[:, ::1]"
_IDS = "int64[::1]"
_OUT = "uint64[:, ::1]"


@inline_helper
def unusable(
    layers: IntArray, src_ids: IntArray, dst_ids: IntArray, out: UIntArray
) -> Any:
    """Why a call cannot write its descriptors into ``out``: 0 if it can,
    OVERLAPPING_BUFFERS (the output shares memory with the ids) or
    SHORT_OUTPUTS (fewer than 3 rows, or rows shorter than a descriptor per
    layer and id pair, or id lists of two lengths)."""
    if overlaps(out, src_ids) | overlaps(out, dst_ids):
        return OVERLAPPING_BUFFERS
    n = np.uint64(src_ids.shape[0])
    if (
        (dst_ids.shape[0] != src_ids.shape[0])
        | (out.shape[0] < 3)
        | (np.uint64(out.shape[1]) < n * np.uint64(layers.shape[0]))
    ):
        return SHORT_OUTPUTS
    return np.int64(0)


@kernel(f"int64({_TABLE}, {_IDS}, {_IDS}, {_OUT})")
def copy_blocks_kernel(
    layers: IntArray, src_ids: IntArray, dst_ids: IntArray, out: UIntArray
) -> int:
    """Fill one descriptor per layer and id pair, layer-major, as vLLM does.

    Args:
        layers: (num_layers, COPY_COLUMNS), one row per layer.
        src_ids, dst_ids: the block ids, as many on each side.
        out: (3, at least num_layers * len(ids)): rows SRC_ROW, DST_ROW and
            SIZE_ROW.

    Returns:
        The number of descriptors written, BAD_BLOCK_ID, OVERLAPPING_BUFFERS
        or SHORT_OUTPUTS.
    """
    status = unusable(layers, src_ids, dst_ids, out)
    if status != 0:
        return status
    n = np.uint64(src_ids.shape[0])
    op = ZERO
    for layer in range(layers.shape[0]):
        bpb = np.uint64(layers[layer, BLOCK_BYTES])
        # Range checks accumulate without a branch, so that the loops
        # vectorise; meanwhile a bad id counts as block 0, so that no product
        # overflows (nothing of a failed call is submitted).
        out_of_range = False
        base = np.uint64(layers[layer, SRC_BASE])
        limit = np.uint64(layers[layer, SRC_BLOCKS])
        for k in range(n):
            block_id = np.uint64(src_ids[k])
            bad = block_id >= limit
            out_of_range |= bad
            out[SRC_ROW, op + k] = base + (ZERO if bad else block_id) * bpb
        base = np.uint64(layers[layer, DST_BASE])
        limit = np.uint64(layers[layer, DST_BLOCKS])
        for k in range(n):
            block_id = np.uint64(dst_ids[k])
            bad = block_id >= limit
            out_of_range |= bad
            out[DST_ROW, op + k] = base + (ZERO if bad else block_id) * bpb
        if out_of_range:
            return BAD_BLOCK_ID
        for k in range(n):
            out[SIZE_ROW, op + k] = bpb
        op += n
    return np.int64(op)


@inline_helper
def find_runs(src_ids: IntArray, dst_ids: IntArray, max_blocks: Any, runs: Any) -> Any:
    """Split the id pairs into runs of at most ``max_blocks`` pairs; write
    each run's lowest src id, lowest dst id and length as a column of
    ``runs``; return how many there are (as uint64).

    A greedy walk, as coalesce() merges (SPEC 6): pair k + 1 joins the run
    ending at pair k when it steps the run's way on both sides (a run of one
    either way) and the run is shorter than max_blocks; else it starts a run.
    The ids are in range (checked before), so no difference overflows.
    """
    n = src_ids.shape[0]
    num_runs = 0
    k = 0
    while k < n:
        first_src = src_ids[k]
        first_dst = dst_ids[k]
        step = 0  # the run's way: 0 while it has one pair, else +1 or -1
        length = ONE
        while (k + 1 < n) & (length < max_blocks):
            src_step = src_ids[k + 1] - src_ids[k]
            if (
                (dst_ids[k + 1] - dst_ids[k] != src_step)
                | ((src_step != 1) & (src_step != -1))
                | ((step != 0) & (step != src_step))
            ):
                break
            step = src_step
            length += ONE
            k += 1
        # A descending run starts at its last pair's blocks.
        runs[RUN_SRC, num_runs] = src_ids[k] if step == -1 else first_src
        runs[RUN_DST, num_runs] = dst_ids[k] if step == -1 else first_dst
        runs[RUN_BLOCKS, num_runs] = np.int64(length)
        num_runs += 1
        k += 1
    return np.uint64(num_runs)


@kernel(f"int64({_TABLE}, {_IDS}, {_IDS}, int64, {_TABLE}, {_OUT})")
def copy_block_runs_kernel(
    layers: IntArray,
    src_ids: IntArray,
    dst_ids: IntArray,
    max_run_bytes: int,
    runs: IntArray,
    out: UIntArray,
) -> int:
    """copy_blocks_kernel's descriptors, runs of consecutive blocks merged.

    The runs are found once, from the ids, and each layer's descriptors are
    then additions over them. ``max_run_bytes`` (NO_CAP: none) caps a run at
    ``max_run_bytes // bpb`` blocks of a layer (a block larger than the cap
    stays as it is): layers whose cap comes to another number of blocks find
    their runs again.

    Args:
        max_run_bytes: the cap, or NO_CAP.
        runs: scratch, (3, at least len(ids)).
        others: as copy_blocks_kernel's.

    Returns:
        The number of descriptors written, BAD_BLOCK_ID, OVERLAPPING_BUFFERS
        or SHORT_OUTPUTS.
    """
    status = unusable(layers, src_ids, dst_ids, out)
    if status != 0:
        return status
    n = np.uint64(src_ids.shape[0])
    if overlaps(runs, src_ids) | overlaps(runs, dst_ids) | overlaps(runs, out):
        return OVERLAPPING_BUFFERS
    if (runs.shape[0] < 3) | (np.uint64(runs.shape[1]) < n):
        return SHORT_OUTPUTS
    # Every id first, against the fewest blocks of its side: the run search
    # takes differences of ids in range only.
    num_layers = layers.shape[0]
    if num_layers == 0:
        return np.int64(0)
    src_limit = np.uint64(layers[0, SRC_BLOCKS])
    dst_limit = np.uint64(layers[0, DST_BLOCKS])
    for layer in range(1, num_layers):
        src_limit = lesser(src_limit, np.uint64(layers[layer, SRC_BLOCKS]))
        dst_limit = lesser(dst_limit, np.uint64(layers[layer, DST_BLOCKS]))
    out_of_range = False
    for k in range(n):
        out_of_range |= (np.uint64(src_ids[k]) >= src_limit) | (
            np.uint64(dst_ids[k]) >= dst_limit
        )
    if out_of_range:
        return BAD_BLOCK_ID
    cap = np.uint64(np.int64(max_run_bytes))  # NO_CAP (-1) becomes 2**64 - 1
    num_runs = ZERO
    runs_of = ZERO  # the max_blocks the runs were found for (0: none yet)
    op = ZERO
    for layer in range(num_layers):
        bpb = np.uint64(layers[layer, BLOCK_BYTES])
        # Blocks per run: the cap's, at least one and at most all of them.
        max_blocks = n
        if bpb > ZERO:
            max_blocks = lesser(cap // bpb, n)
        if max_blocks < ONE:
            max_blocks = ONE
        if max_blocks != runs_of:
            num_runs = find_runs(src_ids, dst_ids, max_blocks, runs)
            runs_of = max_blocks
        base = np.uint64(layers[layer, SRC_BASE])
        for r in range(num_runs):
            out[SRC_ROW, op + r] = base + np.uint64(runs[RUN_SRC, r]) * bpb
        base = np.uint64(layers[layer, DST_BASE])
        for r in range(num_runs):
            out[DST_ROW, op + r] = base + np.uint64(runs[RUN_DST, r]) * bpb
        for r in range(num_runs):
            out[SIZE_ROW, op + r] = np.uint64(runs[RUN_BLOCKS, r]) * bpb
        op += num_runs
    return np.int64(op)
