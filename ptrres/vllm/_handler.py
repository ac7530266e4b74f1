"""vLLM's offloading handler path: ``OffloadingConnector``'s
``SingleDirectionOffloadingHandler`` (``vllm/v1/kv_offload/cpu/gpu_worker.py``),
with its descriptors built by ptrres.

vLLM builds them with a numpy pass per group, ref and side, unchecked. The
patched ``transfer_async`` builds the whole descriptor list with one ptrres
plan, written straight into vLLM's own pooled pinned buffers, checking every
id before anything is submitted. The patched ``__init__`` runs vLLM's own,
then makes every ptrres kernel ready (``ptrres.warmup()``: loaded from
Numba's cache, or compiled) and builds the handler's PointerTable and
OffloadedLayout (its HandlerPlan), so that no transfer compiles or loads
anything.

``ptrres.vllm._patching`` decides what to replace and when, and sets
``vllm_transfer_async``; this module reads only the handler's attributes and,
through ``sys.modules``, the worker module vLLM has already imported: it
imports no vLLM module itself, and no kernel (nor numba) until a handler's
plan is built.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import _state
from ._release import WORKER_MODULE
from ._state import HANDLER
from ._warmup import warm_up_kernels

if TYPE_CHECKING:
    from .._offloaded import OffloadedLayout
    from .._table import PointerTable

# Where a handler keeps its ptrres state: a HandlerPlan, built by the patched
# __init__ (or on the first transfer of a handler built before patch()), or
# _DECLINED when ptrres could not plan for it.
_STATE_ATTRIBUTE = "_ptrres_plan"
_DECLINED = "declined"
# What the patched transfer_async reads of a handler, which vLLM's __init__ sets.
_HANDLER_ATTRIBUTES = (
    "gpu_to_cpu",
    "src_tensors",
    "dst_tensors",
    "src_blocks_per_chunk",
    "dst_blocks_per_chunk",
    "layer_refs_per_group",
    "_canonical_copy_plans",
    "_swap_blocks_batch",
    "_buffer_pool",
    "_stream_pool",
    "_event_pool",
    "_transfers",
    "_transfer_events",
)

# vLLM's own transfer_async, kept past unpatch() for handlers whose transfers
# vLLM builds (and for a patched method someone held on to). patch() sets it.
vllm_transfer_async: Any = None


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


def patched_init(vllm_init: Callable[..., None]) -> Callable[..., None]:
    """The handler's __init__: vLLM's own, then the kernels and the plan.

    It takes the arguments of the release's own __init__ (and shows its
    signature), so it follows every release's constructor.
    """

    @functools.wraps(vllm_init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        vllm_init(self, *args, **kwargs)
        if _state.patched(HANDLER):  # else unpatched since: vLLM's handler alone
            _attach_plan(self, warm_up=True)

    return __init__


def transfer_async(self: Any, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
    """vLLM's ``transfer_async``, its descriptors built by one ptrres plan.

    Same descriptors, same num_bytes, same buffers, streams and events as
    vLLM's; but every GPU and CPU id is checked first: a bad one raises
    ptrres's BlockIdError or OffloadedIdError (ValueErrors) before anything is
    submitted, and the buffers go back to the pool.
    """
    state = vars(self).get(_STATE_ATTRIBUTE)
    # A handler built before patch() gets its plan now (its kernels compile
    # on first use); one built by the patched __init__ has it already.
    plan = _attach_plan(self) if state is None else state
    if not _state.patched(HANDLER) or plan is None or isinstance(plan, str):
        return bool(vllm_transfer_async(self, job_id, src_spec, dst_spec))
    worker = sys.modules[WORKER_MODULE]
    if self.gpu_to_cpu:
        gpu_spec, offloaded_ids = src_spec, dst_spec.block_ids
    else:
        gpu_spec, offloaded_ids = dst_spec, src_spec.block_ids
    num_copy_ops = max_copy_ops(self, gpu_spec)

    # A pooled buffer set, or a new one where the pool's is too small.
    buffers = self._buffer_pool.pop() if self._buffer_pool else None
    if buffers is None or buffers[0].numel() < num_copy_ops:
        buffers = worker._new_descriptor_buffers(num_copy_ops)
    batch_src, batch_dst, batch_sizes = buffers
    try:
        descriptors = plan.table.plan_transfer(
            gpu_spec,
            plan.offloaded,
            offloaded_ids,
            store=self.gpu_to_cpu,
            out=plan.numpy_views(buffers),
            coalesce=plan.coalesce,
        )
    except BaseException:
        self._buffer_pool.append(buffers)
        raise
    # A canonical store keeps only the blocks this rank writes: fewer ops than
    # the buffers were sized for (vLLM's _estimate_max_copy_ops, an upper bound).
    num_ops = len(descriptors.src)
    src, dst, sizes = batch_src[:num_ops], batch_dst[:num_ops], batch_sizes[:num_ops]

    # From here on, as vLLM submits: a pooled stream that waits for the compute
    # stream and for the previous transfer, timed by two pooled events.
    platform = worker.current_platform
    stream = self._stream_pool.pop() if self._stream_pool else platform.Stream()
    start_event = (
        self._event_pool.pop()
        if self._event_pool
        else worker.torch.Event(enable_timing=True)
    )
    end_event = (
        self._event_pool.pop()
        if self._event_pool
        else worker.torch.Event(enable_timing=True)
    )
    stream.wait_stream(platform.current_stream())
    if self._transfers:
        stream.wait_event(self._transfers[-1].end_event)
    with platform.stream(stream):
        start_event.record(stream)
        if num_ops:
            # Loads read host memory no GPU stream writes: any source order.
            self._swap_blocks_batch(
                src, dst, sizes, is_src_access_order_any=not self.gpu_to_cpu
            )
        end_event.record(stream)
    self._transfer_events[job_id] = end_event
    self._transfers.append(
        worker.Transfer(
            job_id=job_id,
            stream=stream,
            start_event=start_event,
            end_event=end_event,
            num_bytes=descriptors.num_bytes,
            batch_src=batch_src,
            batch_dst=batch_dst,
            batch_sizes=batch_sizes,
        )
    )
    return True


def _attach_plan(handler: Any, *, warm_up: bool = False) -> HandlerPlan | None:
    """Build the handler's ptrres plan and keep it on the handler.

    With ``warm_up``, first make every kernel ready (warm_up_kernels). Where
    ptrres cannot plan for a handler (vLLM set other attributes than the
    tested releases do, a layout ptrres refuses, a kernel that does not
    compile), the handler keeps vLLM's own transfers, and a warning says why:
    a plugin never takes vLLM down.
    """
    try:
        missing = [name for name in _HANDLER_ATTRIBUTES if not hasattr(handler, name)]
        if missing:
            raise AttributeError(f"the handler has no {', '.join(missing)}")
        if warm_up:
            warm_up_kernels()
        built = _handler_plan(handler)
        if warm_up:
            rehearse(handler, built)
        plan: HandlerPlan | str = built
    except Exception as error:
        _state.reporter().warning(
            "ptrres: this %s keeps vLLM's own transfers: %s",
            type(handler).__name__,
            error,
            exc_info=not isinstance(error, (AttributeError, ValueError, TypeError)),
        )
        plan = _DECLINED
    setattr(handler, _STATE_ATTRIBUTE, plan)
    return None if isinstance(plan, str) else plan


def _handler_plan(handler: Any) -> HandlerPlan:
    """The handler's ptrres state: its table, its offloaded layout, coalescing.

    Direct and canonical layouts alike: with ``canonical_layout=True`` the CPU
    rows hold canonical pages and the refs carry their CanonicalPageMapping,
    which the table reads, so plan_transfer() gives vLLM's
    ``_fill_canonical_ops`` descriptors (writer rotation included).
    """
    from .. import (
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
        OffloadedLayout,
        PointerTable,
    )

    if handler.gpu_to_cpu:
        device_tensors, cpu_tensors = handler.src_tensors, handler.dst_tensors
        blocks_per_chunk = handler.dst_blocks_per_chunk
    else:
        device_tensors, cpu_tensors = handler.dst_tensors, handler.src_tensors
        blocks_per_chunk = handler.src_blocks_per_chunk
    offloaded = OffloadedLayout(
        cpu_tensors,
        blocks_per_chunk,
        canonical=handler._canonical_copy_plans is not None,
    )
    kv_caches = CanonicalKVCaches(
        [CanonicalKVCacheTensor(t, t.shape[1]) for t in device_tensors],
        handler.layer_refs_per_group,
    )
    worker = sys.modules[WORKER_MODULE]
    return HandlerPlan(
        table=PointerTable(kv_caches),
        offloaded=offloaded,
        coalesce=_state.coalesce_requested()
        and handler._swap_blocks_batch is worker.ops.swap_blocks_batch,
    )


def rehearse(handler: Any, plan: HandlerPlan) -> None:
    """Plan block 0 of each group, into scratch buffers, as a transfer would.

    The first call of a kernel with given argument types still costs Numba
    some typing in Python, and under numpy 2 its first look at an array
    imports numpy.ma (26 ms, measured): paid here, the first transfer takes
    the path of every later one. Block 0 and chunk 0 exist in every layout;
    the plan only computes pointers, into buffers of vLLM's own kind (int64,
    uint64 on XPU), and copies nothing.
    """
    import numpy as np

    from .. import GPULoadStoreSpec

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
