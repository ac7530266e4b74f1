"""vLLM 0.34's file worker: ``FSOffloadingWorker._submit_io``
(``vllm/v1/kv_offload/fs/worker.py``, vLLM PR #56076), its op lists built by
ptrres.

vLLM's ``_submit_io(device_ptrs, keys, is_store)`` walks
``iter_pointer_groups`` and makes one ``FileOp(device_ptr, size_bytes,
file_offset)`` per file, ref and block in Python, on the engine step's
thread: one file per non-empty group and chunk of ``block_size_factor``
blocks, named by the next offload key (``self._file_mapper``), the first
chunk starting at slot ``skip``, ref d's block in slot s at byte ``(d *
block_size_factor + s) * page(d)``. Then it records a ``torch.Event`` and
hands ``[(path, ops)]`` to the subclass's ``submit_io``. Nothing is checked.

Patched, the same files in the same order get the same FileOp values (of
vLLM's own class), the same total bytes, the same event and the same
``submit_io`` call, where the group's pages are equal (SPEC 11's ref-major
layout is then vLLM's). One compiled pass plans every op: from the checked
block ids where the DevicePointers are ptrres's (``_pointers.resolved_by``:
``PointerTable.plan_file_ops``), else from their pointers
(``ptrres.plan_file_ops``); what is left is making the FileOp objects, which
vLLM's subclasses take, and which cost most of the call.

A bad job never raises in the engine step: a refused DevicePointers (a bad
block id, ``_pointers.job_resolver``), keys that are not one per file, or any
other ptrres error fails that job the way 0.34 fails a job whose I/O failed.
``_submit_io`` returns one completion holding the error, ``submit_io`` is not
called (no file is written or read), ``get_finished`` reports the job with
``success=False`` and logs the error (group, position, value) through vLLM's
own ``logger.exception``, and ``wait`` raises it, as for any failed I/O; the
worker goes on with the next job.

Unequal pages in one group. vLLM allows one group's layers different pages
(a ``UniformTypeKVCacheSpecs`` group whose layers have different head
sizes). 0.34's offsets then give ref d the bytes
``[d * bsf * page(d), (d + 1) * bsf * page(d))`` of each file, and these
ranges can overlap: with pages of 200 B and 100 B and two blocks per file,
ref 1's slot 0 is bytes 200-300, inside ref 0's slot 1. Such a file holds
one layer's KV in another's place, for this engine and for every engine
that reads the tier. Where two ranges overlap, ptrres refuses the job
(OverlappingPagesError naming the group, the two refs, their slots' bytes
and the group's pages); nothing is written or read. Keeping vLLM's code
with a warning would write those files: files on a shared tier are read by
other engines, possibly unpatched ones that never see the warning, and a
load would hand the model another layer's bytes without any error. Writing
SPEC 11's layout instead would be sound for this engine but not for the
others: the FileMapper names a file the same either way, so an unpatched
engine would read ptrres's bytes at vLLM's offsets. Failing the job is what
vLLM does with a file it cannot write or read: the connector reports a
store failed (nothing is offloaded) and an async load in
``failed_recving`` (recomputed), and raises for a sync load. Where a
group's pages differ but no two of vLLM's ranges overlap (as where no ref's
pages are smaller than an earlier ref's), vLLM's layout is sound, only
sparse: those jobs keep vLLM's own ``_submit_io`` (said once per layout in
the log), so that every engine writes and reads the same bytes.

Which groups' pages are sparse or overlapping is ``_file_pages``'s to say.
``file_worker_replacements`` gives ``ptrres.vllm._patching`` what to replace
(and FILE_WORKER_CODE what it depends on); importing this module imports
neither vLLM nor numba.
"""

from __future__ import annotations

import functools
import importlib
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from .._errors import PtrresError, SpecError
from . import _pointers, _state
from ._file_pages import (
    Pages,
    check_verdicts,
    pointer_pages,
    said_sparse,
    table_pages,
)
from ._fingerprint import PathCode
from ._state import Replacement, reporter

if TYPE_CHECKING:
    from .._results import FilePlan

FS_WORKER_MODULE = "vllm.v1.kv_offload.fs.worker"
_POINTER_UTILS_MODULE = "vllm.v1.kv_offload.pointer_utils"
_BASE_MODULE = "vllm.v1.kv_offload.base"
_WORKER_CLASS = "FSOffloadingWorker"


def _in(module: str, *names: str) -> tuple[str, ...]:
    return tuple(f"{module}:{name}" for name in names)


_W = f"{_WORKER_CLASS}."
# Everything of vLLM this path's patch depends on (ptrres.vllm._fingerprint).
FILE_WORKER_CODE = PathCode(
    replaces=_in(
        FS_WORKER_MODULE, f"{_W}_submit_io", f"{_W}__init__", "iter_pointer_groups"
    ),
    # The op lists are _submit_io's (replaced, above), over iter_pointer_groups'
    # chunks (cdiv); from a ptrres table, the pointers are resolve's.
    reproduces=(
        *_in(_POINTER_UTILS_MODULE, "iter_pointer_groups", "resolve_device_pointers"),
        "vllm.utils.math_utils:cdiv",
    ),
    reads=(
        # Built: vLLM's FileOp; called: the subclass's submit_io, with an
        # event made as vLLM makes it (the module's torch).
        *_in(FS_WORKER_MODULE, "FileOp", f"{_W}submit_io", "torch"),
        # How _submit_io is called and what becomes of its completions: a
        # failed one fails its job (get_finished logs it, wait raises it).
        *_in(
            FS_WORKER_MODULE,
            f"{_W}submit_store",
            f"{_W}submit_load",
            f"{_W}get_finished",
            f"{_W}wait",
            f"{_W}shutdown",
            "_Transfer",
            "FSLoadStoreSpec",
            "logger",
        ),
        # The pointers' fields, the groups' info, what a completion is.
        *_in(_BASE_MODULE, "DevicePointers", "DevicePointerGroupInfo", "IOCompletion"),
    ),
)


class FileWorkerPatch:
    """What the patched methods need: vLLM's module and originals, and
    ptrres.vllm's switches."""

    def __init__(
        self,
        module: Any,
        vllm_submit_io: Callable[..., tuple[list[Any], int]],
        active: Callable[[], bool],
        prepare: Callable[[], None],
    ) -> None:
        # vllm.v1.kv_offload.fs.worker: its FileOp and torch, read at each call.
        self.module = module
        self.vllm_submit_io = vllm_submit_io
        # Whether the path is patched now: else every worker is vLLM's.
        self.active = active
        # Makes every kernel ready (ptrres.warmup()).
        self.prepare = prepare
        # None until the kernels are ready (or could not be made so: the
        # error, and every job keeps vLLM's own code).
        self.ready: bool | BaseException | None = None
        self._ready_lock = threading.Lock()

    def make_ready(self) -> bool:
        """Make the kernels ready, once per process; False where they cannot
        be (said once: the file worker then keeps vLLM's code)."""
        with self._ready_lock:
            if self.ready is None:
                try:
                    self.prepare()
                    rehearse()
                    self.ready = True
                except Exception as error:  # a plugin never takes vLLM down
                    self.ready = error
                    reporter().warning(
                        "ptrres: vLLM's file worker keeps its own op building: "
                        "the kernels could not be made ready: %r",
                        error,
                    )
        return self.ready is True


def rehearse() -> None:
    """Plan one tiny job both ways, with vLLM's int32 ids, as a first job
    would: the first call of a kernel costs Numba's dispatch some typing
    (0.2 ms), paid here rather than in an engine step."""
    import numpy as np

    from .. import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
        GPULoadStoreSpec,
        PointerTable,
    )

    rows = np.zeros((1, 8), np.uint8)
    table = PointerTable(
        CanonicalKVCaches(
            [CanonicalKVCacheTensor(rows, 8)], [[CanonicalKVCacheRef(0, 8)]]
        )
    )
    spec = GPULoadStoreSpec(np.zeros(1, np.int32), [1], [0])
    table.plan_file_ops(spec, 1)
    (_from_pointers or _pointer_planner())(table.resolve(spec), 1)


def failed_job(error: BaseException) -> tuple[list[Any], int]:
    """What ``_submit_io`` returns for a job that fails before any I/O: one
    completion holding the error, and no bytes."""
    completion: Future[None] = Future()
    completion.set_exception(error)
    return [completion], 0


def plan_job(device_ptrs: Any, bsf: int) -> tuple[FilePlan, Pages]:
    """Every file's ops of a job, and what its pages ask.

    From the checked ids where ptrres resolved the pointers, else from the
    pointers.

    Raises:
        PtrresError: a spec or pointers ptrres refuses.
    """
    table = _pointers.resolved_table(device_ptrs)
    spec = None if table is None else _pointers.resolved_by(device_ptrs, table)
    if table is not None and spec is not None:
        return table.plan_file_ops(spec, bsf), table_pages(table, bsf)
    plan = (_from_pointers or _pointer_planner())(device_ptrs, bsf)
    return plan, pointer_pages(device_ptrs, bsf)


# ptrres.plan_file_ops, imported on the first plan from pointers (with the
# kernels, and numba): an import statement costs microseconds on every job.
_from_pointers: Callable[[Any, int], FilePlan] | None = None


def _pointer_planner() -> Callable[[Any, int], FilePlan]:
    global _from_pointers
    from .._files import plan_file_ops

    _from_pointers = plan_file_ops
    return plan_file_ops


def file_op_lists(
    plan: FilePlan, paths: list[str], file_op: Callable[..., Any], page: int | None
) -> list[tuple[str, list[Any]]]:
    """``[(path, [FileOp, ...])]``, one entry per file of the plan: every op
    made by one ``map`` over Python ints, then sliced per file. ``page``: the
    size of every op, where they share one."""
    sizes = plan.sizes.tolist() if page is None else [page] * len(plan.sizes)
    ops = list(map(file_op, plan.dev_ptrs.tolist(), sizes, plan.file_offsets.tolist()))
    if len(paths) == 1:
        return [(paths[0], ops)]
    starts = plan.file_starts.tolist()
    return [(path, ops[a:b]) for path, a, b in zip(paths, starts, starts[1:])]


def patched_methods(
    patch: FileWorkerPatch, vllm_init: Callable[..., None]
) -> tuple[Callable[..., None], Callable[..., Any]]:
    """The patched ``FSOffloadingWorker.__init__`` and ``_submit_io``."""

    @functools.wraps(vllm_init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        """vLLM's own; then the kernels made ready, at engine start-up."""
        vllm_init(self, *args, **kwargs)
        if patch.active():
            patch.make_ready()

    module = patch.module
    vllm_submit_io = patch.vllm_submit_io
    active = patch.active

    @functools.wraps(vllm_submit_io)
    def _submit_io(
        self: Any, device_ptrs: Any, keys: Any, is_store: bool
    ) -> tuple[list[Any], int]:
        """vLLM's ``_submit_io``, its op lists planned by ptrres; a job ptrres
        refuses fails (one completion holding the error), nothing raised."""
        if not active() or not (patch.ready is True or patch.make_ready()):
            return vllm_submit_io(self, device_ptrs, keys, is_store)
        refused = _pointers.refusal(device_ptrs)
        if refused is not None:
            return failed_job(refused)
        bsf = self._block_size_factor
        try:
            plan, pages = plan_job(device_ptrs, bsf)
            if len(keys) != plan.num_files:
                raise SpecError(
                    f"the job has {len(keys)} offload keys, but its blocks fill "
                    f"{plan.num_files} files (one per chunk of {bsf} blocks of "
                    "each non-empty group): each file takes one key"
                )
            sparse = None
            if pages.verdicts is not None:
                sparse = check_verdicts(pages.verdicts, device_ptrs.group_block_counts)
        except PtrresError as error:
            return failed_job(error)
        if sparse is not None:  # vLLM's layout, sound here: vLLM's own code
            said_sparse(sparse)
            return vllm_submit_io(self, device_ptrs, keys, is_store)
        paths = list(map(self._file_mapper.get_file_name, keys))
        file_ops = file_op_lists(plan, paths, module.FileOp, pages.page)
        ready_event = module.torch.Event()
        ready_event.record()
        completions = self.submit_io(file_ops, is_store, ready_event)
        return completions, plan.num_bytes

    return __init__, _submit_io


def file_worker_replacements(
    active: Callable[[], bool], prepare: Callable[[], None]
) -> list[Replacement]:
    """What the file worker's path replaces in ``vllm.v1.kv_offload.fs.worker``
    (imported here): ``FSOffloadingWorker.__init__`` (vLLM's, then
    ``prepare()``), ``FSOffloadingWorker._submit_io`` and the module's
    ``iter_pointer_groups`` binding (ptrres's, ``_pointers``).

    Args:
        active: whether the path is patched now; a worker uses vLLM's own
            code whenever it is not.
        prepare: makes every kernel ready (ptrres.warmup()). Called when a
            worker is built (vLLM builds its file worker at engine start-up,
            before its first job), else on a worker's first job (one built
            before the patch, or a subclass that skips our ``__init__``).
    """
    module = importlib.import_module(FS_WORKER_MODULE)
    worker = getattr(module, _WORKER_CLASS)
    vllm_init = vars(worker)["__init__"]
    vllm_submit_io = vars(worker)["_submit_io"]
    patch = FileWorkerPatch(module, vllm_submit_io, active, prepare)
    init, submit_io = patched_methods(patch, vllm_init)
    binding = module.iter_pointer_groups
    return [
        Replacement(worker, "__init__", vllm_init, init),
        Replacement(worker, "_submit_io", vllm_submit_io, submit_io),
        Replacement(
            module,
            "iter_pointer_groups",
            _vllm_own(binding),
            _pointers.iter_pointer_groups,
        ),
    ]


def _vllm_own(obj: Any) -> Any:
    """vLLM's object where ``obj`` is a replacement another path made (the
    module imported pointer_utils' function after it was patched)."""
    for replacements in _state.applied.values():
        for r in replacements:
            if r.replacement is obj:
                return r.original
    return obj
