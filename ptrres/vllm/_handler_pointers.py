"""vLLM 0.34's offloading handler, with its descriptors built by ptrres:
``SingleDirectionOffloadingHandler.transfer_async(job_id, device_ptrs,
cpu_spec)`` and the ``CPUOffloadingWorker`` that builds its handlers.

vLLM 0.34's connector resolves each job (``pointer_utils``) and hands the
handler ``DevicePointers``; the handlers hold no GPU tensors. The patched
``CPUOffloadingWorker.__init__`` runs vLLM's own, makes the kernels ready,
and builds one table of its KV caches (the one the connector's resolve then
finds) and a plan per handler, each rehearsed. DevicePointers that ptrres
resolved with that table are planned from their checked ids, in one compiled
pass; others from their pointers, each checked. A bad id, pointer or CPU
chunk id fails that job as 0.34 fails a job whose copy failed (a failed
``Transfer``: the connector reports the store failed, or the load, and a
sync load raises there), with nothing copied, and the error (group,
position, value) in the log; the engine goes on.

What the two forms share (the plan, the buffers, the submission) is
``ptrres.vllm._handler``'s; this module imports no vLLM module and no kernel
until a worker's plans are built.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._errors import PtrresError
from . import _handler, _pointers, _state
from ._handler import (
    DECLINED,
    STATE_ATTRIBUTE,
    SUBMIT_ATTRIBUTES,
    HandlerPlan,
    first_blocks,
    keep_plan,
    max_copy_ops,
    plan_of,
    rehearse_plan,
    require,
    say_declined,
    submit,
    take_buffers,
)
from ._release import WORKER_MODULE
from ._state import HANDLER
from ._warmup import warm_up_kernels

if TYPE_CHECKING:
    from .._table import PointerTable

_HANDLER_034_ATTRIBUTES = (*SUBMIT_ATTRIBUTES, "cpu_tensors", "blocks_per_chunk")
# CPUOffloadingWorker's three handlers.
_WORKER_HANDLERS = ("_store_handler", "_load_handler", "_expedited_load_handler")


def patched_worker_init(vllm_init: Callable[..., None]) -> Callable[..., None]:
    """CPUOffloadingWorker's __init__ (0.34): vLLM's own, then the kernels,
    one table of its KV caches and a plan for each of its handlers."""

    @functools.wraps(vllm_init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        vllm_init(self, *args, **kwargs)
        if _state.patched(HANDLER):  # else unpatched since: vLLM's worker alone
            kv_caches = kwargs["kv_caches"] if "kv_caches" in kwargs else args[0]
            _attach_worker_plans(self, kv_caches)

    return __init__


def transfer_pointers(self: Any, job_id: int, device_ptrs: Any, cpu_spec: Any) -> bool:
    """vLLM 0.34's ``transfer_async``, its descriptors built by one ptrres plan.

    Same descriptors, num_bytes, buffers, streams and events as vLLM's. The
    device side comes from the ids ptrres resolved ``device_ptrs`` from
    (checked), or from their pointers, each checked against its tensor
    (DevicePointers resolved elsewhere); every CPU chunk id is checked. A
    refused job, or any ptrres error, fails the job with nothing copied
    (see the module's docstring).
    """
    if not _state.patched(HANDLER):
        return bool(_handler.vllm_transfer_async(self, job_id, device_ptrs, cpu_spec))
    refused = _pointers.refusal(device_ptrs)
    if refused is not None:
        return _fail(self, job_id, refused)
    plan = vars(self).get(STATE_ATTRIBUTE)
    if plan is None:
        # A handler built outside a patched worker: its plan takes the table
        # ptrres resolved these pointers with; without one, vLLM's transfer.
        table = _pointers.resolved_table(device_ptrs)
        plan = None if table is None else _attach_handler_plan(self, table)
    if plan is None or isinstance(plan, str):
        return bool(_handler.vllm_transfer_async(self, job_id, device_ptrs, cpu_spec))
    worker = sys.modules[WORKER_MODULE]
    num_copy_ops = max_copy_ops(self, getattr(device_ptrs, "group_block_counts", None))
    buffers = take_buffers(self, worker, num_copy_ops)
    resolved = _pointers.resolved_with(device_ptrs, plan.table)
    try:
        if resolved is not None:  # its ids, read and checked by the resolve
            descriptors = plan.table._transfer(
                resolved.block_ids,
                resolved.counts,
                plan.offloaded,
                cpu_spec.block_ids,
                self.gpu_to_cpu,
                plan.numpy_views(buffers),
                plan.coalesce,
                None,
            )
        else:
            descriptors = plan.table.plan_from_device_pointers(
                device_ptrs,
                plan.offloaded,
                cpu_spec.block_ids,
                store=self.gpu_to_cpu,
                out=plan.numpy_views(buffers),
                coalesce=plan.coalesce,
            )
    except PtrresError as error:
        self._buffer_pool.append(buffers)
        return _fail(self, job_id, error)
    except BaseException:
        self._buffer_pool.append(buffers)
        raise
    submit(self, worker, job_id, buffers, len(descriptors.src), descriptors.num_bytes)
    return True


def _attach_worker_plans(cpu_worker: Any, kv_caches: Any) -> None:
    """Make the kernels ready and give each of the worker's handlers its plan
    over one table of ``kv_caches`` (the one the connector's resolve finds:
    ptrres's table cache keeps it by the very object), rehearsed. Where
    ptrres cannot (a layout it refuses, a worker or handler of other
    attributes), the handlers keep vLLM's own transfers, with a warning."""
    handlers = [getattr(cpu_worker, name, None) for name in _WORKER_HANDLERS]
    try:
        missing = [n for n, h in zip(_WORKER_HANDLERS, handlers) if h is None]
        if missing:
            raise AttributeError(f"the worker has no {', '.join(missing)}")
        warm_up_kernels()
        from .._pointer_utils import table_for

        table = table_for(kv_caches)
        spec = first_blocks(handlers[0])
        _pointers.resolve_device_pointers(spec, kv_caches)  # resolve, rehearsed
    except Exception as error:
        say_declined(cpu_worker, error)
        for handler in handlers:
            if handler is not None:
                setattr(handler, STATE_ATTRIBUTE, DECLINED)
        return
    for handler in handlers:
        _attach_handler_plan(handler, table, rehearsal=spec)


def _attach_handler_plan(
    handler: Any, table: PointerTable, *, rehearsal: Any = None
) -> HandlerPlan | None:
    """Build a 0.34 handler's plan over ``table`` and keep it on the handler,
    after planning the spec ``rehearsal`` with it (when given)."""

    def build() -> HandlerPlan:
        require(handler, _HANDLER_034_ATTRIBUTES)
        plan = plan_of(handler, table, handler.cpu_tensors, handler.blocks_per_chunk)
        if rehearsal is not None:
            rehearse_plan(handler, plan, rehearsal)
        return plan

    return keep_plan(handler, build)


def _fail(self: Any, job_id: int, error: BaseException) -> bool:
    """Fail a job (0.34) as vLLM fails one whose copy failed: a failed
    Transfer, in order behind the transfers before it, nothing copied."""
    worker = sys.modules[WORKER_MODULE]
    _state.reporter().error(
        "ptrres: KV offload %s job %d failed, nothing copied: %s",
        "GPU->CPU" if self.gpu_to_cpu else "CPU->GPU",
        job_id,
        error,
    )
    # Empty buffers: a failed transfer's are never pooled again by vLLM.
    submit(self, worker, job_id, worker._new_descriptor_buffers(0), 0, 0, failed=True)
    return True
