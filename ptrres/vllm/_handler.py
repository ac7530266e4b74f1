"""vLLM's offloading handler path: ``OffloadingConnector``'s
``SingleDirectionOffloadingHandler`` (``vllm/v1/kv_offload/cpu/gpu_worker.py``),
with its descriptors built by ptrres.

vLLM builds them with a numpy pass per group, ref and side, unchecked.
Patched, one ptrres plan builds the whole descriptor list, written straight
into vLLM's own pooled pinned buffers, every id checked before anything is
submitted. Two forms, one per shape of vLLM's handler:

- 0.30 to 0.33: ``transfer_async(job_id, src_spec, dst_spec)`` takes GPU
  block ids. The patched ``__init__`` runs vLLM's own, then makes every
  ptrres kernel ready (``ptrres.warmup()``: loaded from Numba's cache, or
  compiled) and builds the handler's PointerTable and OffloadedLayout (its
  HandlerPlan), so that no transfer compiles or loads anything. A bad id
  raises from ``transfer_async`` before anything is submitted.
- 0.34: the connector resolves each job and hands the handler
  ``DevicePointers``: ``ptrres.vllm._handler_pointers``, on what this module
  shares (the plan, the buffers, the submission).

``ptrres.vllm._patching`` decides what to replace and when, and sets
``vllm_transfer_async``; this module reads only the handler's attributes and,
through ``sys.modules``, the worker module vLLM has already imported: it
imports no vLLM module itself, and no kernel (nor numba) until a handler's
plan is built.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence
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
# DECLINED when ptrres could not plan for it.
STATE_ATTRIBUTE = "_ptrres_plan"
DECLINED = "declined"
# What the patched transfer_async reads of a handler, which vLLM's __init__
# sets: in 0.30 to 0.33, and in 0.34.
SUBMIT_ATTRIBUTES = (
    "gpu_to_cpu",
    "layer_refs_per_group",
    "_canonical_copy_plans",
    "_swap_blocks_batch",
    "_buffer_pool",
    "_stream_pool",
    "_event_pool",
    "_transfers",
    "_transfer_events",
)
_HANDLER_ATTRIBUTES = (
    *SUBMIT_ATTRIBUTES,
    "src_tensors",
    "dst_tensors",
    "src_blocks_per_chunk",
    "dst_blocks_per_chunk",
)

# vLLM's own transfer_async, kept past unpatch() for handlers whose transfers
# vLLM builds (and for a patched method someone held on to). patch() sets it.
vllm_transfer_async: Any = None


@dataclass
class HandlerPlan:
    """What one handler needs for its ptrres plans, built once per handler."""

    # The device tensors and refs, flattened (0.34: shared by the worker's
    # handlers and the connector's resolve).
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


# --- vLLM 0.30 to 0.33: transfer_async(job_id, src_spec, dst_spec) ----------


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
    """vLLM's ``transfer_async`` (0.30 to 0.33), its descriptors built by
    one ptrres plan.

    Same descriptors, same num_bytes, same buffers, streams and events as
    vLLM's; but every GPU and CPU id is checked first: a bad one raises
    ptrres's BlockIdError or OffloadedIdError (ValueErrors) before anything is
    submitted, and the buffers go back to the pool.
    """
    state = vars(self).get(STATE_ATTRIBUTE)
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
    num_copy_ops = max_copy_ops(self, getattr(gpu_spec, "group_sizes", None))
    buffers = take_buffers(self, worker, num_copy_ops)
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
    submit(self, worker, job_id, buffers, len(descriptors.src), descriptors.num_bytes)
    return True


def _attach_plan(handler: Any, *, warm_up: bool = False) -> HandlerPlan | None:
    """Build a 0.30-0.33 handler's ptrres plan and keep it on the handler.

    With ``warm_up``, first make every kernel ready (warm_up_kernels). Where
    ptrres cannot plan for a handler (vLLM set other attributes than the
    tested releases do, a layout ptrres refuses, a kernel that does not
    compile), the handler keeps vLLM's own transfers, and a warning says why:
    a plugin never takes vLLM down.
    """

    def build() -> HandlerPlan:
        require(handler, _HANDLER_ATTRIBUTES)
        if warm_up:
            warm_up_kernels()
        built = _handler_plan(handler)
        if warm_up:
            rehearse(handler, built)
        return built

    return keep_plan(handler, build)


def _handler_plan(handler: Any) -> HandlerPlan:
    """A 0.30-0.33 handler's ptrres state: its table, its offloaded layout,
    coalescing.

    Direct and canonical layouts alike: with ``canonical_layout=True`` the CPU
    rows hold canonical pages and the refs carry their CanonicalPageMapping,
    which the table reads, so plan_transfer() gives vLLM's
    ``_fill_canonical_ops`` descriptors (writer rotation included).
    """
    from .. import CanonicalKVCaches, CanonicalKVCacheTensor, PointerTable

    if handler.gpu_to_cpu:
        device_tensors, cpu_tensors = handler.src_tensors, handler.dst_tensors
        blocks_per_chunk = handler.dst_blocks_per_chunk
    else:
        device_tensors, cpu_tensors = handler.dst_tensors, handler.src_tensors
        blocks_per_chunk = handler.src_blocks_per_chunk
    kv_caches = CanonicalKVCaches(
        [CanonicalKVCacheTensor(t, t.shape[1]) for t in device_tensors],
        handler.layer_refs_per_group,
    )
    return plan_of(handler, PointerTable(kv_caches), cpu_tensors, blocks_per_chunk)


def rehearse(handler: Any, plan: HandlerPlan) -> None:
    """Plan block 0 of each group, into scratch buffers, as a transfer would.

    The first call of a kernel with given argument types still costs Numba
    some typing in Python, and under numpy 2 its first look at an array
    imports numpy.ma (26 ms, measured): paid here, the first transfer takes
    the path of every later one. Block 0 and chunk 0 exist in every layout;
    the plan only computes pointers, into buffers of vLLM's own kind (int64,
    uint64 on XPU), and copies nothing.
    """
    spec = first_blocks(handler)
    rehearse_plan(handler, plan, spec)


# --- what both forms share (0.34's in _handler_pointers) --------------------


def take_buffers(handler: Any, worker: Any, num_copy_ops: int) -> tuple[Any, ...]:
    """A pooled buffer set, or a new one where the pool's is too small."""
    buffers = handler._buffer_pool.pop() if handler._buffer_pool else None
    if buffers is None or buffers[0].numel() < num_copy_ops:
        buffers = worker._new_descriptor_buffers(num_copy_ops)
    return tuple(buffers)


def submit(
    handler: Any,
    worker: Any,
    job_id: int,
    buffers: tuple[Any, ...],
    num_ops: int,
    num_bytes: int,
    *,
    failed: bool = False,
) -> None:
    """Submit the first ``num_ops`` descriptors of ``buffers`` as vLLM does:
    a pooled stream that waits for the compute stream and for the previous
    transfer, timed by two pooled events; and record the Transfer. A failed
    job submits nothing, and its Transfer says it failed."""
    batch_src, batch_dst, batch_sizes = buffers
    platform = worker.current_platform
    stream = handler._stream_pool.pop() if handler._stream_pool else platform.Stream()
    start_event = (
        handler._event_pool.pop()
        if handler._event_pool
        else worker.torch.Event(enable_timing=True)
    )
    end_event = (
        handler._event_pool.pop()
        if handler._event_pool
        else worker.torch.Event(enable_timing=True)
    )
    stream.wait_stream(platform.current_stream())
    if handler._transfers:
        stream.wait_event(handler._transfers[-1].end_event)
    with platform.stream(stream):
        start_event.record(stream)
        if num_ops:
            # Loads read host memory no GPU stream writes: any source order.
            handler._swap_blocks_batch(
                batch_src[:num_ops],
                batch_dst[:num_ops],
                batch_sizes[:num_ops],
                is_src_access_order_any=not handler.gpu_to_cpu,
            )
        end_event.record(stream)
    handler._transfer_events[job_id] = end_event
    # Only 0.34's Transfer has ``failed``; only 0.34's jobs fail here.
    extra = {"failed": True} if failed else {}
    handler._transfers.append(
        worker.Transfer(
            job_id=job_id,
            stream=stream,
            start_event=start_event,
            end_event=end_event,
            num_bytes=num_bytes,
            batch_src=batch_src,
            batch_dst=batch_dst,
            batch_sizes=batch_sizes,
            **extra,
        )
    )


def keep_plan(handler: Any, build: Callable[[], HandlerPlan]) -> HandlerPlan | None:
    """Keep ``build()`` on the handler, or DECLINED (with a warning) where
    it fails: a plugin never takes vLLM down."""
    try:
        plan: HandlerPlan | str = build()
    except Exception as error:
        say_declined(handler, error)
        plan = DECLINED
    setattr(handler, STATE_ATTRIBUTE, plan)
    return None if isinstance(plan, str) else plan


def say_declined(owner: Any, error: BaseException) -> None:
    _state.reporter().warning(
        "ptrres: this %s keeps vLLM's own transfers: %s",
        type(owner).__name__,
        error,
        exc_info=not isinstance(error, (AttributeError, ValueError, TypeError)),
    )


def require(handler: Any, names: Sequence[str]) -> None:
    missing = [name for name in names if not hasattr(handler, name)]
    if missing:
        raise AttributeError(f"the handler has no {', '.join(missing)}")


def plan_of(
    handler: Any, table: PointerTable, cpu_tensors: Any, blocks_per_chunk: int
) -> HandlerPlan:
    """A handler's plan: ``table``, its CPU tensors' layout, coalescing."""
    from .. import OffloadedLayout

    worker = sys.modules[WORKER_MODULE]
    return HandlerPlan(
        table=table,
        offloaded=OffloadedLayout(
            cpu_tensors,
            blocks_per_chunk,
            canonical=handler._canonical_copy_plans is not None,
        ),
        coalesce=_state.coalesce_requested()
        and handler._swap_blocks_batch is worker.ops.swap_blocks_batch,
    )


def first_blocks(handler: Any) -> Any:
    """A spec of block 0 of each group (int32 ids, as vLLM's specs hold them)."""
    import numpy as np

    from .. import GPULoadStoreSpec

    num_groups = len(handler.layer_refs_per_group)
    return GPULoadStoreSpec(
        np.zeros(num_groups, np.int32), [1] * num_groups, [0] * num_groups
    )


def rehearse_plan(handler: Any, plan: HandlerPlan, spec: Any) -> None:
    """Plan ``spec`` (one chunk, chunk 0, per group) into scratch buffers."""
    num_copy_ops = max(max_copy_ops(handler, spec.group_sizes), 1)
    buffers = sys.modules[WORKER_MODULE]._new_descriptor_buffers(num_copy_ops)
    plan.table.plan_transfer(
        spec,
        plan.offloaded,
        spec.block_ids.copy(),
        store=handler.gpu_to_cpu,
        out=tuple(t.numpy() for t in buffers),
        coalesce=plan.coalesce,
    )


def max_copy_ops(handler: Any, group_sizes: Any) -> int:
    """Descriptors the transfer needs at most, to size its buffers.

    Malformed group sizes give 0 here; the plan then says what is wrong
    with them (it checks the spec before the buffers).
    """
    try:
        return max(int(handler._estimate_max_copy_ops(group_sizes)), 0)
    except (TypeError, ValueError, AttributeError):
        return 0
