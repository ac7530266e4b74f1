"""What every kernel shares: table columns, statuses, constants, small helpers.

Indices are unsigned wherever they are computed: Numba then adds no
negative-index wraparound, and the inner loops vectorise. A range check is
``uint64(id) >= limit``, which also rejects negative ids.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from .._config import inline_helper

# Columns of PointerTable.ref_table: one row per (group, ref), in copy order,
# in the order of the fields of _geometry.RefRow.
BASE_PTR = 0  # data pointer of the ref's tensor
ROW_STRIDE = 1  # bytes between two blocks of that tensor
PAGE_SIZE = 2  # bytes to copy per block (the ref's page_size_bytes)
NUM_BLOCKS = 3  # blocks in the tensor: valid ids are 0 <= id < NUM_BLOCKS
TENSOR_IDX = 4  # index of the tensor in CanonicalKVCaches.tensors
# The allocation the tensor is a view of: equal for views of one storage,
# and a run of merged descriptors never passes from one into another.
ALLOCATION = 5
REF_COLUMNS = 6

# Columns of the offloaded side of each ref (same rows as the ref table), in
# the order of the fields of _geometry.OffloadedGeometry.
OFF_BASE_PTR = 0  # data pointer of the offloaded tensor of the ref's tensor_idx
OFF_ROW_STRIDE = 1  # bytes between two chunks (rows) of it
OFF_SUB_BYTES = 2  # bytes of one sub-block: row bytes // blocks_per_chunk
OFF_NUM_CHUNKS = 3  # chunks (rows) it holds
OFF_ALLOCATION = 4  # the allocation it is a view of (as ALLOCATION)
OFF_COLUMNS = 5

# Negative statuses a kernel returns instead of a count. Every kernel returns
# int64 on every path, so that compiling lazily for the argument types infers
# exactly the declared signature.
BAD_BLOCK_ID = np.int64(-1)
BAD_OFFLOADED_ID = np.int64(-2)
# An output shares memory with another output or with an input: nothing is
# written, since the results would overwrite each other or the ids.
OVERLAPPING_BUFFERS = np.int64(-3)

# max_run_bytes when runs are not capped. Kernels take the cap as an int64
# (Numba types a Python int faster than a numpy scalar) and read it as uint64:
# -1 is then the largest cap there is.
NO_CAP = -1

# Unsigned constants: Numba types uint64 mixed with a plain int as float64.
ZERO = np.uint64(0)
ONE = np.uint64(1)

IntArray = npt.NDArray[Any]
UIntArray = npt.NDArray[np.uint64]

# The signature of a ref table and its group_ref_start, for @kernel.
TABLE = "int64[:, ::1], int64[::1]"


@inline_helper
def overlaps(a: IntArray, b: IntArray) -> bool:
    """Whether two arrays share a byte of memory; an empty one shares none.

    The one overlap check of every kernel: they test every pair of an output
    with another output or an input before writing anything. `&`, not `and`:
    one branch on the result.
    """
    a0, b0 = np.uint64(a.ctypes.data), np.uint64(b.ctypes.data)
    a1, b1 = a0 + np.uint64(a.nbytes), b0 + np.uint64(b.nbytes)
    return bool((a0 < a1) & (b0 < b1) & (a0 < b1) & (b0 < a1))


@inline_helper
def lesser(a: Any, b: Any) -> Any:
    """min(a, b) of two scalars of one type, as a helper: Numba compiles
    min() and max() as overloads of their own, each optimised and turned into
    machine code of its own at start-up, where a helper is only linked."""
    return a if a <= b else b


@inline_helper
def greater(a: Any, b: Any) -> Any:
    """max(a, b) of two scalars of one type (see lesser)."""
    return a if a >= b else b


@inline_helper
def chunk_slot(k: np.uint64, skip: np.uint64, blocks_per_chunk: np.uint64) -> Any:
    """Chunk (counted from the group's first) and sub-block of a group's block k.

    The group starts at sub-block ``skip = block_index % blocks_per_chunk`` of
    its first chunk (SPEC 5): block k is sub-block ``(skip + k) % bpc`` of the
    group's chunk ``(skip + k) // bpc``. The one place this is written.
    """
    position = skip + k
    return position // blocks_per_chunk, position % blocks_per_chunk


@inline_helper
def id_range(ids: IntArray) -> tuple[int, int]:
    """The smallest and the largest of a non-empty array of ids, as int64.

    A plain loop: it compiles much faster than ndarray.min() and max().
    """
    lowest = highest = np.int64(ids[0])
    for k in range(1, ids.shape[0]):
        block_id = np.int64(ids[k])
        lowest = lesser(lowest, block_id)
        highest = greater(highest, block_id)
    return lowest, highest


@inline_helper
def rows_of(tables: Any, ref: Any) -> Any:
    """Row ``ref`` of the ref table and of the offloaded refs, as tuples.

    Tuples of their columns (index them with BASE_PTR..., OFF_BASE_PTR...):
    plain values, where array views of the rows would cost reference counting
    for each ref of every call (several microseconds per merged plan).
    """
    ref_table, offloaded_refs = tables
    ref_row = (
        ref_table[ref, BASE_PTR],
        ref_table[ref, ROW_STRIDE],
        ref_table[ref, PAGE_SIZE],
        ref_table[ref, NUM_BLOCKS],
        ref_table[ref, TENSOR_IDX],
        ref_table[ref, ALLOCATION],
    )
    off_row = (
        offloaded_refs[ref, OFF_BASE_PTR],
        offloaded_refs[ref, OFF_ROW_STRIDE],
        offloaded_refs[ref, OFF_SUB_BYTES],
        offloaded_refs[ref, OFF_NUM_CHUNKS],
        offloaded_refs[ref, OFF_ALLOCATION],
    )
    return ref_row, off_row


# trailing_zeros(): 0x077CB531 is a de Bruijn sequence B(2, 5): multiplying
# it by 2**k (k < 32) puts a distinct 5-bit pattern in bits 27-31, and the
# table gives k back. The product stays below 2**58, so uint64 never wraps
# (numpy would warn where the kernels run without the JIT).
DE_BRUIJN_32 = np.uint64(0x077CB531)
DE_BRUIJN_32_POSITIONS = np.zeros(32, np.uint64)
for _bit in range(32):
    DE_BRUIJN_32_POSITIONS[((0x077CB531 << _bit) & 0xFFFFFFFF) >> 27] = _bit
LOW_HALF = np.uint64(2**32 - 1)


@inline_helper
def trailing_zeros(value: np.uint64) -> np.uint64:
    """The zero bits below the lowest set bit of a non-zero uint64.

    Branch-free: the lowest set bit 2**k, moved into the low half when k >= 32,
    then a de Bruijn multiply of 32-bit words (DE_BRUIJN_32).
    """
    lowest = value & (~value + ONE)  # 2**k; ~value < 2**64 - 1 as value != 0
    high_half = np.uint64(lowest > LOW_HALF) << np.uint64(5)  # 32 or 0
    word = lowest >> high_half
    pattern = ((word * DE_BRUIJN_32) & LOW_HALF) >> np.uint64(27)
    return high_half + DE_BRUIJN_32_POSITIONS[pattern]
