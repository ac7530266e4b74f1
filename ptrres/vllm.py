"""ptrres inside vLLM's CPU offloading workers (0.30 to 0.33): a general plugin.

vLLM has two CPU offloading paths, and ``patch()`` takes both:

- ``OffloadingConnector``'s ``SingleDirectionOffloadingHandler``
  (``vllm/v1/kv_offload/cpu/gpu_worker.py``) builds its copy descriptors with
  a numpy pass per group, ref and side, unchecked. Its ``transfer_async``
  becomes one that builds the whole descriptor list with one ptrres plan,
  written straight into vLLM's own pooled pinned buffers, checking every id
  before anything is submitted. Its ``__init__`` is wrapped: once vLLM's own
  has run, every ptrres kernel is made ready (``ptrres.warmup()``: loaded from
  Numba's cache, or compiled) and the handler's PointerTable and
  OffloadedLayout are built, so that no transfer compiles or loads anything.
- ``SimpleCPUOffloadConnector`` (``vllm/v1/simple_kv_offload/``) submits its
  copies through ``cuda_mem_ops.copy_blocks``: its ``build_params`` and
  ``copy_blocks`` become ptrres's (``ptrres._vllm_simple``), everywhere vLLM
  looks them up, so that every id is checked and the descriptors are built
  by one kernel into reused buffers.

Where the installed vLLM has ``vllm.v1.kv_offload.pointer_utils``, its
``resolve_device_pointers`` and ``iter_pointer_groups`` become ptrres's.

vLLM calls ``register()`` in every process (API server, engine core, workers)
through the entry point ``ptrres = "ptrres.vllm:register"``; ``PTRRES_VLLM=0``
turns it off. ``register()`` costs next to nothing: it imports no vLLM module,
no numba and no kernel. It patches at once where vLLM's offloading modules
are already imported, else right after vLLM itself first imports one; the
kernels are made ready when the first handler or the first params are built.
Importing this module imports neither vLLM nor numba, and ``import ptrres``
never imports this module.

Which releases are tested, and the check that the installed vLLM's modules
are theirs, are in ``ptrres._vllm_release``; a handler's ptrres state is a
``ptrres._vllm_handler.HandlerPlan``.
"""

from __future__ import annotations

import functools
import importlib.abc
import logging
import os
import sys
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar

from ._vllm_release import (
    PATCH_TRIGGERS,
    POINTER_UTILS_MODULE,
    SUPPORTED_VLLM,
    WORKER_MODULE,
    find_handler,
    find_simple_path,
    optional_module,
    parameter_names,
    signature_refusal,
)

if TYPE_CHECKING:
    from ._vllm_handler import HandlerPlan
    from ._warmup import WarmupReport

__all__ = [
    "SUPPORTED_VLLM",
    "VllmPatchWarning",
    "is_patched",
    "patch",
    "register",
    "unpatch",
]

logger = logging.getLogger("ptrres.vllm")
# vLLM configures only its own "vllm" logger: where nobody handles ptrres's
# records (the usual case inside vLLM), register() reports through a child of
# it, so its line shows among vLLM's.
_VLLM_CHILD_LOGGER = "vllm.ptrres"

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
_OFF_VALUES = ("0", "false", "off", "no")


class VllmPatchWarning(UserWarning):
    """patch() left vLLM as it was: an untested version or an unexpected API."""


@dataclass(frozen=True)
class _Replacement:
    """One attribute patch() replaces: where it lives, vLLM's own, and ours."""

    owner: Any  # a class or a module
    name: str
    original: Any
    replacement: Any

    @property
    def qualified_name(self) -> str:
        owner = getattr(self.owner, "__qualname__", None) or self.owner.__name__
        return f"{owner}.{self.name}"


# What patch() replaced, in order; None when vLLM is not patched.
_applied: list[_Replacement] | None = None
_lock = threading.RLock()
# The reasons patch() has already warned about, so each warns once.
_warned: set[str] = set()
# vLLM's own transfer_async, kept past unpatch() for handlers whose transfers
# vLLM builds (and for a patched method someone held on to).
_vllm_transfer_async: Any = None
# Whether a handler's warmup has been logged at INFO in this process.
_warmup_logged = False


def is_patched() -> bool:
    """Whether patch() has replaced vLLM's attributes (and unpatch() has not)."""
    return _applied is not None


def patch() -> list[str]:
    """Make vLLM's CPU offloading workers build their descriptors with ptrres.

    Replaces ``SingleDirectionOffloadingHandler.__init__`` (vLLM's, then
    ``ptrres.warmup()`` and the handler's ptrres plan) and ``transfer_async``;
    the simple offload path's ``build_params`` and ``copy_blocks``, in
    ``cuda_mem_ops`` and in the two backends that import them by name; and,
    where the installed vLLM has ``pointer_utils``, its
    ``resolve_device_pointers`` and ``iter_pointer_groups``. Everything is
    replaced, or nothing: on a vLLM release not in SUPPORTED_VLLM, or where an
    attribute is missing or has another signature than that release's, vLLM is
    left as it was and a VllmPatchWarning is issued (once per reason). Calling
    it again once patched changes nothing. It imports vLLM's offloading
    modules, but no kernel (and not numba).

    Returns:
        The qualified names of the attributes now replaced (empty when vLLM was
        left alone).
    """
    global _applied, _vllm_transfer_async
    with _lock:
        _PatchOnImport.remove()
        if _applied is not None:
            return [r.qualified_name for r in _applied]
        replacements, refusal = _plan_replacements()
        if refusal is not None:
            _warn_once(refusal)
            return []
        _vllm_transfer_async = replacements[1].original
        done: list[_Replacement] = []
        try:
            for r in replacements:
                setattr(r.owner, r.name, r.replacement)
                done.append(r)
        except Exception as error:  # an attribute that cannot be set: undo all
            for r in reversed(done):
                setattr(r.owner, r.name, r.original)
            _warn_once(f"{replacements[len(done)].qualified_name}: {error!r}")
            return []
        _applied = replacements
        return [r.qualified_name for r in replacements]


def unpatch() -> None:
    """Restore vLLM's own attributes (the very objects patch() replaced), and
    cancel a patch that register() left for vLLM's first import.

    Handlers and params keep the ptrres state they built, but ignore it once
    unpatched; those built from then on are vLLM's alone.
    """
    global _applied
    with _lock:
        _PatchOnImport.remove()
        if _applied is None:
            return
        for r in reversed(_applied):
            setattr(r.owner, r.name, r.original)
        _applied = None


def register() -> None:
    """The ``vllm.general_plugins`` entry point: patch() unless PTRRES_VLLM=0.

    vLLM calls it in every process, possibly many times, many of which never
    offload (the API server): it imports no vLLM module and compiles
    nothing. Where vLLM's offloading modules (PATCH_TRIGGERS) are imported
    already it patches at once, else right after vLLM first imports one of
    them. It patches once, logs one INFO line naming what it patched, and
    never raises; the kernels are made ready when the first handler or the
    first params are built.
    """
    try:
        if os.environ.get("PTRRES_VLLM", "1").strip().lower() in _OFF_VALUES:
            logger.debug("ptrres: PTRRES_VLLM=0, leaving vLLM as it is")
            return
        if is_patched():
            return
        if any(name in sys.modules for name in PATCH_TRIGGERS):
            _patch_and_report()
        else:
            _PatchOnImport.install()
    except Exception:  # a plugin must never take vLLM down
        logger.warning("ptrres: could not patch vLLM; it runs unchanged", exc_info=True)


def _patch_and_report() -> None:
    """patch(), and its INFO line."""
    patched = patch()
    if patched:
        _reporter().info(
            "ptrres %s builds vLLM %s's KV offload descriptors: patched %s%s; "
            "kernels are made ready when the handlers and params are built",
            _ptrres_version(),
            getattr(sys.modules.get("vllm"), "__version__", "?"),
            ", ".join(patched),
            " (coalescing on)" if _coalesce_requested() else "",
        )


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches vLLM right after vLLM first imports a module of PATCH_TRIGGERS.

    An entry of ``sys.meta_path`` that finds nothing itself: it asks the
    finders after it for a trigger's spec, and wraps the spec's loader
    (_ThenPatch) so that patch() runs once the module has. patch() takes it
    out of ``sys.meta_path``, and so does unpatch().
    """

    installed: ClassVar[_PatchOnImport | None] = None
    # Triggers whose module is running now, in any thread: patch() waits for
    # the last, since it would find the others half-built.
    running: ClassVar[set[str]] = set()

    @classmethod
    def install(cls) -> None:
        with _lock:
            if cls.installed is None:
                cls.installed = cls()
                sys.meta_path.insert(0, cls.installed)

    @classmethod
    def remove(cls) -> None:
        with _lock:
            finder, cls.installed = cls.installed, None
            if finder is not None and finder in sys.meta_path:
                sys.meta_path.remove(finder)

    def find_spec(
        self, fullname: str, path: Any = None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname not in PATCH_TRIGGERS:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec: ModuleSpec | None = find(fullname, path, target)
            if spec is not None:
                if hasattr(spec.loader, "exec_module"):
                    spec.loader = _ThenPatch(spec.loader)
                return spec
        return None


class _ThenPatch(importlib.abc.Loader):
    """A trigger's loader: the module runs as its own loader runs it, then
    patch() does (once no other trigger is running)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        module: ModuleType | None = self.loader.create_module(spec)
        return module

    def exec_module(self, module: ModuleType) -> None:
        # The module keeps its own loader, as if nothing had come between.
        module.__loader__ = self.loader
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        name = module.__name__
        _PatchOnImport.running.add(name)
        try:
            self.loader.exec_module(module)
        finally:
            _PatchOnImport.running.discard(name)
        if _PatchOnImport.installed is not None and not _PatchOnImport.running:
            try:
                _patch_and_report()
            except Exception:  # a plugin must never take vLLM's import down
                logger.warning(
                    "ptrres: could not patch vLLM; it runs unchanged", exc_info=True
                )

    def __getattr__(self, name: str) -> Any:
        """What else the import system asks of the loader, its own answers."""
        if name == "loader":  # not set yet: no recursion
            raise AttributeError(name)
        return getattr(self.loader, name)


def _reporter() -> logging.Logger:
    """ptrres's logger, or vLLM's child logger where nothing handles ptrres's."""
    return logger if logger.hasHandlers() else logging.getLogger(_VLLM_CHILD_LOGGER)


def _ptrres_version() -> str:
    from . import __version__

    return __version__


def _warn_once(reason: str) -> None:
    if reason in _warned:
        return
    _warned.add(reason)
    warnings.warn(
        f"ptrres.vllm left vLLM unpatched: {reason}", VllmPatchWarning, stacklevel=3
    )


def _coalesce_requested() -> bool:
    return os.environ.get("PTRRES_VLLM_COALESCE", "0").strip() == "1"


# --- what to replace ---------------------------------------------------------


def _plan_replacements() -> tuple[list[_Replacement], str | None]:
    """Every attribute to replace, or the reason to replace none."""
    found = find_handler()
    if isinstance(found, str):
        return [], found
    worker, handler = found
    original_init = vars(handler)["__init__"]
    replacements = [
        _Replacement(handler, "__init__", original_init, _patched_init(original_init)),
        _Replacement(
            handler, "transfer_async", vars(handler)["transfer_async"], transfer_async
        ),
    ]
    pointer_utils = optional_module(POINTER_UTILS_MODULE)
    if pointer_utils is not None:
        from ._pointer_utils import iter_pointer_groups, resolve_device_pointers

        for ours in (resolve_device_pointers, iter_pointer_groups):
            name = ours.__name__
            refusal = signature_refusal(pointer_utils, name, parameter_names(ours))
            if refusal is not None:
                return [], refusal
            original = getattr(pointer_utils, name)
            replacements.append(_Replacement(pointer_utils, name, original, ours))
            # The worker may have imported it by name (`from ... import`).
            if getattr(worker, name, None) is original:
                replacements.append(_Replacement(worker, name, original, ours))
    simple = find_simple_path()
    if isinstance(simple, str):
        return [], simple
    replacements += _simple_replacements(*simple)
    return replacements, None


def _simple_replacements(
    mem_ops: ModuleType, backends: tuple[ModuleType, ...]
) -> list[_Replacement]:
    """build_params and copy_blocks of the simple offload path: in cuda_mem_ops,
    and in the backends, which imported them by name."""
    from . import _vllm_simple

    vllm_build_params, vllm_copy_blocks = mem_ops.build_params, mem_ops.copy_blocks
    build_params, copy_blocks = _vllm_simple.patched_functions(
        _vllm_simple.SimplePatch(
            mem_ops=mem_ops,
            vllm_build_params=vllm_build_params,
            vllm_copy_blocks=vllm_copy_blocks,
            active=is_patched,
            prepare=_warm_up_kernels,
            coalesce=_coalesce_requested,
            decline=_decline_params,
        )
    )
    return [
        _Replacement(owner, name, original, ours)
        for name, original, ours in (
            ("build_params", vllm_build_params, build_params),
            ("copy_blocks", vllm_copy_blocks, copy_blocks),
        )
        for owner in (mem_ops, *backends)
    ]


def _decline_params(error: BaseException) -> None:
    """Say why copy_blocks params keep vLLM's own copies."""
    _reporter().warning(
        "ptrres: these copy_blocks params keep vLLM's own copies: %s",
        error,
        exc_info=not isinstance(error, (AttributeError, ValueError, TypeError)),
    )


# --- the patched handler -----------------------------------------------------


def _patched_init(vllm_init: Callable[..., None]) -> Callable[..., None]:
    """The handler's __init__: vLLM's own, then the kernels and the plan.

    It takes the arguments of the release's own __init__ (and shows its
    signature), so it follows every release's constructor.
    """

    @functools.wraps(vllm_init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        vllm_init(self, *args, **kwargs)
        if _applied is not None:  # else unpatched since: vLLM's handler alone
            _attach_plan(self, warm_up=True)

    return __init__


def _attach_plan(handler: Any, *, warm_up: bool = False) -> HandlerPlan | None:
    """Build the handler's ptrres plan and keep it on the handler.

    With ``warm_up``, first make every kernel ready (_warm_up_kernels). Where
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
            _warm_up_kernels()
        built = _handler_plan(handler)
        if warm_up:
            from ._vllm_handler import rehearse

            rehearse(handler, built)
        plan: HandlerPlan | str = built
    except Exception as error:
        _reporter().warning(
            "ptrres: this %s keeps vLLM's own transfers: %s",
            type(handler).__name__,
            error,
            exc_info=not isinstance(error, (AttributeError, ValueError, TypeError)),
        )
        plan = _DECLINED
    setattr(handler, _STATE_ATTRIBUTE, plan)
    return None if isinstance(plan, str) else plan


def warmup(*, processes: int | None = None) -> WarmupReport:
    """ptrres.warmup(), imported when first called: until a handler or params
    are built, the plugin imports no kernel (nor numba)."""
    from ._warmup import warmup as make_ready

    return make_ready(processes=processes)


def _warm_up_kernels() -> None:
    """ptrres.warmup(), logged at INFO the first time in this process.

    Every kernel is loaded from Numba's cache or compiled here, where vLLM
    builds its handlers and its simple path's params (at engine start-up), so
    that no transfer, in an engine step on every tensor-parallel rank, waits
    for one. Later calls cost next to nothing.
    """
    global _warmup_logged
    report = warmup()
    with _lock:
        first, _warmup_logged = not _warmup_logged, True
    (_reporter().info if first else logger.debug)(
        "%s, before vLLM's first KV offload", _describe_warmup(report)
    )


def _describe_warmup(report: WarmupReport) -> str:
    """One line saying what warmup() did: how many signatures went which way."""
    counts = ", ".join(
        f"{report.count(how)} {how}"
        for how in ("loaded", "compiled", "ready", "interpreted")
        if report.count(how)
    )
    processes = f" in {report.processes} processes" if report.processes > 1 else ""
    return (
        f"ptrres warmup: {len(report.kernels)} kernel signatures ({counts}) "
        f"in {report.seconds:.2f} s{processes}"
    )


def _handler_plan(handler: Any) -> HandlerPlan:
    """The handler's ptrres state: its table, its offloaded layout, coalescing.

    Direct and canonical layouts alike: with ``canonical_layout=True`` the CPU
    rows hold canonical pages and the refs carry their CanonicalPageMapping,
    which the table reads, so plan_transfer() gives vLLM's
    ``_fill_canonical_ops`` descriptors (writer rotation included).
    """
    from . import (
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
        OffloadedLayout,
        PointerTable,
    )
    from ._vllm_handler import HandlerPlan

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
        coalesce=_coalesce_requested()
        and handler._swap_blocks_batch is worker.ops.swap_blocks_batch,
    )


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
    if _applied is None or plan is None or isinstance(plan, str):
        return bool(_vllm_transfer_async(self, job_id, src_spec, dst_spec))
    from ._vllm_handler import max_copy_ops

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
