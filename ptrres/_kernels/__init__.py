"""The compiled kernels. They only compute into arrays they are given.

A kernel never sees a Python object and never raises. It returns how many
entries it wrote, or a negative status: BAD_BLOCK_ID or BAD_OFFLOADED_ID when
an id is out of range (the wrapper then finds the first bad id and raises an
error that names the group, the position and the value), OVERLAPPING_BUFFERS
when an output shares memory with another output or an input (checked before
anything is written). What a failed call wrote is never returned: the wrapper
zeroes it. Scratch space, too, is allocated by the wrapper and passed in.

One module per family: common (columns, statuses, shared helpers), resolve,
plan (with plan_runs: the runs of blocks it merges while it fills), coalesce
(runs of descriptors, run states), canonical (canonical and strided plans,
SPEC 10), files (the file tier, SPEC 11), copy_blocks (vLLM's simple CPU
offload path, SPEC 12) and nixl (NIXL's descriptor rows and prepared-list
indices, SPEC 14). The wrappers call the kernels through this package
(as ``_kernels.resolve_kernel``), so that a benchmark may swap one in.

Numba's on-disk cache of a kernel is invalidated by a change to the kernel's
own file only: after editing a helper in common.py, coalesce.py or
plan_runs.py, delete ``ptrres/_kernels/__pycache__`` (or touch the kernels'
files), or the cached kernels keep the old helper.
"""

from .canonical import canonical_plan_kernel
from .coalesce import coalesce_kernel
from .common import (
    ALLOCATION,
    BAD_BLOCK_ID,
    BAD_OFFLOADED_ID,
    NO_CAP,
    OFF_COLUMNS,
    OVERLAPPING_BUFFERS,
    REF_COLUMNS,
)
from .copy_blocks import (
    COPY_COLUMNS,
    SHORT_OUTPUTS,
    copy_block_runs_kernel,
    copy_blocks_kernel,
)
from .files import BAD_OP_SIZE, FILE_TOO_LARGE, plan_file_ops_kernel
from .nixl import desc_ids_kernel, descriptor_rows_kernel, prepped_indices_kernel
from .plan import plan_kernel
from .resolve import block_ids_from_pointers, resolve_kernel

__all__ = [
    "ALLOCATION",
    "BAD_BLOCK_ID",
    "BAD_OFFLOADED_ID",
    "BAD_OP_SIZE",
    "COPY_COLUMNS",
    "FILE_TOO_LARGE",
    "NO_CAP",
    "OFF_COLUMNS",
    "OVERLAPPING_BUFFERS",
    "REF_COLUMNS",
    "SHORT_OUTPUTS",
    "block_ids_from_pointers",
    "canonical_plan_kernel",
    "coalesce_kernel",
    "copy_block_runs_kernel",
    "copy_blocks_kernel",
    "desc_ids_kernel",
    "descriptor_rows_kernel",
    "plan_file_ops_kernel",
    "plan_kernel",
    "prepped_indices_kernel",
    "resolve_kernel",
]
