"""One vLLM handler's ptrres state, and the two things the patched handler
asks of it besides a plan: how many descriptors a transfer needs at most, and
a rehearsal that makes the first transfer take the path of every later one.

``ptrres.vllm`` builds and keeps the state; this module reads only the
handler's attributes and, through ``sys.modules``, the worker module vLLM has
already imported: it imports no vLLM module itself.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import GPULoadStoreSpec, OffloadedLayout, PointerTable
from ._vllm_release import WORKER_MODULE


@dataclass
class HandlerPlan:
    """What one handler needs for its ptrres plans, built once per handler."""

    # The handler's device tensors and refs, flattened.
    table: PointerTable
    # Its CPU tensors, in chunks of blocks_per_chunk device blocks.
    offloaded: OffloadedLayout
    # Merge descriptors that continue each other (PTRRES_VLLM_COALESCE=1, and
    # only where vLLM submits them with cuMemcpyBatchAsync).
    coalesce: bool
    # The buffer set used last and its numpy views: a handler with one
    # transfer in flight takes the same set from its pool every time.
    last_buffers: tuple[tuple[Any, ...], tuple[Any, ...]] | None = None

    def numpy_views(self, buffers: tuple[Any, ...]) -> tuple[Any, ...]:
        """The numpy arrays over a pooled (src, dst, sizes) tensor set."""
        last = self.last_buffers
        if (
            last is not None
            and last[0][0] is buffers[0]
            and last[0][1] is buffers[1]
            and last[0][2] is buffers[2]
        ):
            return last[1]
        views = tuple(t.numpy() for t in buffers)
        self.last_buffers = (tuple(buffers), views)
        return views


def rehearse(handler: Any, plan: HandlerPlan) -> None:
    """Plan block 0 of each group, into scratch buffers, as a transfer would.

    The first call of a kernel with given argument types still costs Numba
    some typing in Python, and under numpy 2 its first look at an array
    imports numpy.ma (26 ms, measured): paid here, the first transfer takes
    the path of every later one. Block 0 and chunk 0 exist in every layout;
    the plan only computes pointers, into buffers of vLLM's own kind (int64,
    uint64 on XPU), and copies nothing.
    """
    num_groups = len(handler.layer_refs_per_group)
    # int32 ids, as vLLM's specs hold them; one chunk per (non-empty) group.
    block_ids = np.zeros(num_groups, np.int32)
    spec = GPULoadStoreSpec(block_ids, [1] * num_groups, [0] * num_groups)
    num_copy_ops = max(max_copy_ops(handler, spec), 1)
    buffers = sys.modules[WORKER_MODULE]._new_descriptor_buffers(num_copy_ops)
    plan.table.plan_transfer(
        spec,
        plan.offloaded,
        block_ids.copy(),
        store=handler.gpu_to_cpu,
        out=tuple(t.numpy() for t in buffers),
        coalesce=plan.coalesce,
    )


def max_copy_ops(handler: Any, gpu_spec: Any) -> int:
    """Descriptors the transfer needs at most, to size its buffers.

    Malformed group sizes give 0 here; plan_transfer then says what is wrong
    with them (it checks the spec before the buffers).
    """
    try:
        return max(int(handler._estimate_max_copy_ops(gpu_spec.group_sizes)), 0)
    except (TypeError, ValueError, AttributeError):
        return 0
