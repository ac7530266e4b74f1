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
sizes). 0.34's offsets then
give ref d the bytes ``[d * bsf * page(d), (d + 1) * bsf * page(d))`` of each
file, and these ranges can overlap: with pages of 200 B and 100 B and two
blocks per file, ref 1's slot 0 is bytes 200-300, inside ref 0's slot 1. Such a file holds
one layer's KV in another's place, for this engine and for every engine that
reads the tier. Where the ranges overlap, ptrres refuses the job
(OverlappingPagesError naming the group, the two refs, their slots' bytes
and the group's pages); nothing is written or read. Keeping vLLM's code with
a warning would write those files: files on a shared tier are read by other
engines, possibly unpatched ones that never see the warning, and a load
would hand the model another layer's bytes without any error. Writing SPEC
11's layout instead would be sound for this engine but not for the others:
the FileMapper names a file the same either way, so an unpatched engine
would read ptrres's bytes at vLLM's offsets. Failing the job is what vLLM
does with a file it cannot write or read: the connector reports a store
failed (nothing is offloaded) and an async load in ``failed_recving``
(recomputed), and raises for a sync load. Where a group's
pages differ but no two of vLLM's ranges overlap (as where no ref's pages
are smaller than an earlier ref's), vLLM's layout is sound, only sparse: those
jobs keep vLLM's own ``_submit_io`` (said once per layout in the log), so
that every engine writes and reads the same bytes.

``file_worker_replacements`` gives ``ptrres.vllm._patching`` what to replace
(and FILE_WORKER_CODE what it depends on); importing this module imports
neither vLLM nor numba.
"""

from __future__ import annotations

import functools
import importlib
import itertools
import threading
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, NamedTuple

from .._errors import LayoutError, PtrresError, SpecError
from . import _pointers, _state
from ._fingerprint import PathCode
from ._state import Replacement, reporter

if TYPE_CHECKING:
    from .._results import FilePlan
    from .._table import PointerTable

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


class OverlappingPagesError(LayoutError):
    """A group whose refs' pages differ so that vLLM 0.34's file offsets
    overlap: one ref's blocks would land on another's in every file.

    Attributes:
        group: the KV-cache group.
        refs: the two refs whose byte ranges overlap (the earlier first).
        pages: every ref's page of the group, in bytes.
    """

    def __init__(
        self, message: str, *, group: int, refs: tuple[int, int], pages: list[int]
    ) -> None:
        super().__init__(message)
        self.group = group
        self.refs = refs
        self.pages = pages


class SparsePages(NamedTuple):
    """A group whose refs' pages differ, where vLLM's file ranges do not
    overlap: vLLM's layout is sound there (only sparse), but not SPEC 11's."""

    group: int
    pages: tuple[int, ...]


# A group's verdict: None where its pages are equal (vLLM's offsets are SPEC
# 11's), else SparsePages or OverlappingPagesError.
Verdict = OverlappingPagesError | SparsePages | None


def group_verdict(group: int, pages: Sequence[int], bsf: int) -> Verdict:
    """Whether vLLM's offsets ``(d * bsf + s) * pages[d]`` are SPEC 11's
    (None), sound but sparse, or overlapping."""
    if len(set(pages)) <= 1:
        return None
    # Ref d spans [d * bsf * P[d], (d + 1) * bsf * P[d]): in order of start,
    # a range that starts before the furthest end so far overlaps that one's.
    spans = sorted(
        (d * bsf * page, (d + 1) * bsf * page, d)
        for d, page in enumerate(pages)
        if page
    )
    furthest = (-1, -1, -1)
    for span in spans:
        if span[0] < furthest[1]:
            return _overlap_error(group, pages, bsf, furthest, span)
        if span[1] > furthest[1]:
            furthest = span
    return SparsePages(group, tuple(pages))


def _overlap_error(
    group: int,
    pages: Sequence[int],
    bsf: int,
    first: tuple[int, int, int],
    second: tuple[int, int, int],
) -> OverlappingPagesError:
    start_a, _, a = first
    start_b, _, b = second
    slot = (start_b - start_a) // pages[a]
    slot_a = start_a + slot * pages[a]
    refs = tuple(sorted((a, b)))
    return OverlappingPagesError(
        f"group {group}: vLLM 0.34's file worker puts ref d's block in slot s at "
        f"byte (d * block_size_factor + s) * page(d) of the file, and this "
        f"group's refs have pages of different sizes ({_pages_text(pages)}), so "
        f"with block_size_factor {bsf} ref {b}'s slot 0 (bytes "
        f"{start_b}-{start_b + pages[b]}) overlaps ref {a}'s slot {slot} (bytes "
        f"{slot_a}-{slot_a + pages[a]}): its files would hold one layer's KV in "
        "another's place, for every engine reading them. ptrres fails the job; "
        "no file is written or read (docs/file-tier.md)",
        group=group,
        refs=(refs[0], refs[1]),
        pages=list(pages),
    )


def _pages_text(pages: Sequence[int]) -> str:
    """``ref 0: 200 B, ref 1: 100 B``, consecutive refs of one page together."""
    runs: list[tuple[int, int, int]] = []  # first ref, last ref, page
    for d, page in enumerate(pages):
        if runs and runs[-1][2] == page:
            runs[-1] = (runs[-1][0], d, page)
        else:
            runs.append((d, d, page))
    return ", ".join(
        f"ref {first}: {page} B" if first == last else f"refs {first}-{last}: {page} B"
        for first, last, page in runs
    )


class Pages(NamedTuple):
    """What a job's pages ask of its op lists."""

    # Each group's verdict, or None where every group's pages are equal.
    verdicts: list[Verdict] | None
    # The one page of every ref of the layout, where there is one: each op's
    # size is then one shared int (cheaper than an int per op).
    page: int | None = None


# A table's Pages, per bsf.
_table_pages: weakref.WeakKeyDictionary[Any, dict[int, Pages]] = (
    weakref.WeakKeyDictionary()
)
_pages_lock = threading.Lock()


# The table, bsf and Pages of the last job: one worker's jobs share them, and
# a WeakKeyDictionary lookup makes a weak reference every time. (A table
# holds integers, not tensors: keeping the last one costs nothing.)
_last_pages: tuple[Any, int, Pages] | None = None


def table_pages(table: PointerTable, bsf: int) -> Pages:
    """A table's Pages (computed once per table and bsf)."""
    global _last_pages
    last = _last_pages
    if last is not None and last[0] is table and last[1] == bsf:
        return last[2]
    by_bsf = _table_pages.get(table)
    if by_bsf is not None:
        found = by_bsf.get(bsf)
        if found is not None:
            _last_pages = (table, bsf, found)
            return found
    from .._kernels.common import PAGE_SIZE

    pages = table.ref_table[:, PAGE_SIZE].tolist()
    starts = table.group_ref_start.tolist()
    verdicts: list[Verdict] = [
        group_verdict(g, pages[first:end], bsf)
        for g, (first, end) in enumerate(itertools.pairwise(starts))
    ]
    found = Pages(
        verdicts if any(v is not None for v in verdicts) else None,
        pages[0] if len(set(pages)) == 1 else None,
    )
    with _pages_lock:
        _table_pages.setdefault(table, {})[bsf] = found
    _last_pages = (table, bsf, found)
    return found


# Where each ref's first op lies, per shape of DevicePointers (their
# (group_block_counts, group_data_ref_counts)): the positions, and each
# non-empty group's (index, first ref, end) among them. Jobs repeat shapes.
_RefStarts = tuple[Any, list[tuple[int, int, int]]]
_ref_starts: dict[tuple[Any, Any], _RefStarts] = {}
_MAX_SHAPES = 256


def pointer_pages(device_ptrs: Any, bsf: int) -> Pages:
    """A job's Pages, read from its pointers' sizes (each ref's first op),
    once ptrres has planned them (its counts and sizes checked)."""
    import numpy as np

    key = (
        tuple(device_ptrs.group_block_counts),
        tuple(device_ptrs.group_data_ref_counts),
    )
    starts = _ref_starts.get(key)
    if starts is None:
        positions: list[int] = []
        groups = []
        op = 0
        for g, (n, refs) in enumerate(zip(*key)):
            if n and refs:
                groups.append((g, len(positions), len(positions) + refs))
                positions += range(op, op + n * refs, n)
            op += n * refs
        starts = (np.array(positions, np.intp), groups)
        if len(_ref_starts) >= _MAX_SHAPES:
            _ref_starts.clear()
        _ref_starts[key] = starts
    positions_array, groups = starts
    pages = np.asarray(device_ptrs.sizes)[positions_array].tolist()
    if len(set(pages)) <= 1:
        return Pages(None, pages[0] if pages else None)
    verdicts: list[Verdict] = [None] * len(key[0])
    for g, first, end in groups:
        verdicts[g] = group_verdict(g, pages[first:end], bsf)
    return Pages(verdicts if any(v is not None for v in verdicts) else None)


@functools.cache
def _said_sparse(sparse: SparsePages) -> None:
    """Say once per layout that its jobs keep vLLM's own op building."""
    reporter().info(
        "ptrres: group %d's refs have pages of different sizes (%s) whose "
        "ranges in vLLM's file layout do not overlap: its file jobs keep vLLM's "
        "own _submit_io, so that every engine reads the same bytes",
        sparse.group,
        _pages_text(sparse.pages),
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
                sparse = _check_verdicts(pages.verdicts, device_ptrs.group_block_counts)
        except PtrresError as error:
            return failed_job(error)
        if sparse is not None:  # vLLM's layout, sound here: vLLM's own code
            _said_sparse(sparse)
            return vllm_submit_io(self, device_ptrs, keys, is_store)
        paths = list(map(self._file_mapper.get_file_name, keys))
        file_ops = file_op_lists(plan, paths, module.FileOp, pages.page)
        ready_event = module.torch.Event()
        ready_event.record()
        completions = self.submit_io(file_ops, is_store, ready_event)
        return completions, plan.num_bytes

    return __init__, _submit_io


def _check_verdicts(
    verdicts: list[Verdict], group_block_counts: Sequence[int]
) -> SparsePages | None:
    """The first sparse group of a job, or None.

    Raises:
        OverlappingPagesError: a group of the job whose vLLM offsets overlap.
    """
    sparse = None
    for verdict, n in zip(verdicts, group_block_counts):
        if not n or verdict is None:
            continue
        if isinstance(verdict, OverlappingPagesError):
            raise verdict
        if sparse is None:
            sparse = verdict
    return sparse


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
