"""ptrres inside vLLM 0.33's CPU offloading worker: a vLLM general plugin.

vLLM 0.33 builds its copy descriptors in ``SingleDirectionOffloadingHandler``
(``vllm/v1/kv_offload/cpu/gpu_worker.py``): a numpy pass per group, ref and
side, unchecked. ``patch()`` replaces that handler's ``transfer_async`` with one
that builds the whole descriptor list with one ptrres plan, written straight
into vLLM's own pooled pinned buffers, checking every id before anything is
submitted. Where the installed vLLM has ``vllm.v1.kv_offload.pointer_utils``,
its ``resolve_device_pointers`` and ``iter_pointer_groups`` become ptrres's.

vLLM calls ``register()`` in every process (API server, engine core, workers)
through the entry point ``ptrres = "ptrres.vllm:register"``; ``PTRRES_VLLM=0``
turns it off. Importing this module does not import vLLM: only ``patch()``
does, and ``import ptrres`` never imports this module.

This module uses only ptrres's public API.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
import os
import re
import sys
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from . import (
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    OffloadedLayout,
    PointerTable,
    iter_pointer_groups,
    resolve_device_pointers,
)

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

# vLLM releases whose handler this module was tested against.
SUPPORTED_VLLM = "0.33.x"
_SUPPORTED_VERSION = re.compile(r"0\.33(\.|$)")
WORKER_MODULE = "vllm.v1.kv_offload.cpu.gpu_worker"
POINTER_UTILS_MODULE = "vllm.v1.kv_offload.pointer_utils"
HANDLER_CLASS = "SingleDirectionOffloadingHandler"
# Where a handler keeps its ptrres state (built on its first transfer).
_STATE_ATTRIBUTE = "_ptrres_plan"
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


def is_patched() -> bool:
    """Whether patch() has replaced vLLM's attributes (and unpatch() has not)."""
    return _applied is not None


def patch() -> list[str]:
    """Make vLLM 0.33's CPU offloading worker build its descriptors with ptrres.

    Replaces ``SingleDirectionOffloadingHandler.transfer_async`` and, where the
    installed vLLM has ``pointer_utils``, its ``resolve_device_pointers`` and
    ``iter_pointer_groups``. Everything is replaced, or nothing: on a vLLM
    other than 0.33.x, or where an attribute is missing or has another
    signature, vLLM is left as it was and a VllmPatchWarning is issued (once
    per reason). Calling it again once patched changes nothing.

    Returns:
        The qualified names of the attributes now replaced (empty when vLLM was
        left alone).
    """
    global _applied, _vllm_transfer_async
    with _lock:
        if _applied is not None:
            return [r.qualified_name for r in _applied]
        replacements, refusal = _plan_replacements()
        if refusal is not None:
            _warn_once(refusal)
            return []
        _vllm_transfer_async = replacements[0].original
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
    """Restore vLLM's own attributes (the very objects patch() replaced).

    Handlers keep the ptrres state they built, but ignore it once unpatched.
    """
    global _applied
    with _lock:
        if _applied is None:
            return
        for r in reversed(_applied):
            setattr(r.owner, r.name, r.original)
        _applied = None


def register() -> None:
    """The ``vllm.general_plugins`` entry point: patch() unless PTRRES_VLLM=0.

    vLLM calls it in every process, possibly many times: it patches once, logs
    one INFO line naming what it patched, and never raises.
    """
    try:
        if os.environ.get("PTRRES_VLLM", "1").strip().lower() in _OFF_VALUES:
            logger.debug("ptrres: PTRRES_VLLM=0, leaving vLLM as it is")
            return
        if is_patched():
            return
        patched = patch()
        if patched:
            reporter = (
                logger
                if logger.hasHandlers()
                else logging.getLogger(_VLLM_CHILD_LOGGER)
            )
            reporter.info(
                "ptrres %s builds vLLM's KV offload descriptors: patched %s%s",
                _ptrres_version(),
                ", ".join(patched),
                " (coalescing on)" if _coalesce_requested() else "",
            )
    except Exception:  # a plugin must never take vLLM down
        logger.warning("ptrres: could not patch vLLM; it runs unchanged", exc_info=True)


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


def _parameters(function: Any) -> list[tuple[str, Any]]:
    """A callable's parameter names and kinds (annotations do not matter)."""
    return [(p.name, p.kind) for p in inspect.signature(function).parameters.values()]


# vLLM 0.33 names whose signatures the patched transfer_async relies on: the
# method it replaces, the fill it stands for, and the helpers it calls.
_HANDLER_SIGNATURES: dict[str, list[str]] = {
    "transfer_async": ["self", "job_id", "src_spec", "dst_spec"],
    "_estimate_max_copy_ops": ["self", "group_sizes"],
    "_fill_direct_ops": [
        "self",
        "g_idx",
        "group_src",
        "group_dst",
        "group_size",
        "src_skip_count",
        "dst_skip_count",
        "all_src",
        "all_dst",
        "all_sizes",
        "op_idx",
    ],
    "get_finished": ["self"],
}
_WORKER_NAMES = ("_new_descriptor_buffers", "Transfer", "current_platform", "torch")


def _plan_replacements() -> tuple[list[_Replacement], str | None]:
    """Every attribute to replace, or the reason to replace none."""
    try:
        vllm = importlib.import_module("vllm")
    except ImportError as error:
        return [], f"vLLM cannot be imported ({error})"
    version = str(getattr(vllm, "__version__", "unknown"))
    if not _SUPPORTED_VERSION.match(version):
        return [], f"vLLM {version} is not a tested version ({SUPPORTED_VLLM})"
    try:
        worker = importlib.import_module(WORKER_MODULE)
    except ImportError as error:
        return [], f"{WORKER_MODULE} cannot be imported ({error})"
    handler = getattr(worker, HANDLER_CLASS, None)
    if not isinstance(handler, type):
        return [], f"{WORKER_MODULE}.{HANDLER_CLASS} is missing"
    for name, expected in _HANDLER_SIGNATURES.items():
        refusal = _signature_refusal(handler, name, expected)
        if refusal is not None:
            return [], refusal
    for name in _WORKER_NAMES:
        if not hasattr(worker, name):
            return [], f"{WORKER_MODULE}.{name} is missing"
    replacements = [
        _Replacement(
            handler, "transfer_async", vars(handler)["transfer_async"], transfer_async
        )
    ]
    pointer_utils = _optional_module(POINTER_UTILS_MODULE)
    if pointer_utils is not None:
        for ours in (resolve_device_pointers, iter_pointer_groups):
            name = ours.__name__
            refusal = _signature_refusal(pointer_utils, name, _names(ours))
            if refusal is not None:
                return [], refusal
            original = getattr(pointer_utils, name)
            replacements.append(_Replacement(pointer_utils, name, original, ours))
            # The worker may have imported it by name (`from ... import`).
            if getattr(worker, name, None) is original:
                replacements.append(_Replacement(worker, name, original, ours))
    return replacements, None


def _names(function: Callable[..., Any]) -> list[str]:
    return [name for name, _ in _parameters(function)]


def _signature_refusal(owner: Any, name: str, expected: list[str]) -> str | None:
    """Why ``owner.name`` cannot be replaced (None when it can)."""
    where = getattr(owner, "__qualname__", None) or owner.__name__
    # A class attribute must be the class's own, so that unpatch() restores it
    # to the same place; a module's is its own anyway.
    found = (
        vars(owner).get(name) if isinstance(owner, type) else getattr(owner, name, None)
    )
    if found is None or not callable(found):
        return f"{where}.{name} is missing"
    try:
        parameters = _parameters(found)
    except (TypeError, ValueError):
        return f"{where}.{name} has no readable signature"
    if [p for p, _ in parameters] != expected or any(
        kind not in (inspect.Parameter.POSITIONAL_OR_KEYWORD,) for _, kind in parameters
    ):
        return (
            f"{where}.{name} has the signature {inspect.signature(found)}, "
            f"not ({', '.join(expected)})"
        )
    return None


def _optional_module(name: str) -> ModuleType | None:
    """The module ``name`` if it is installed (or already imported), else None."""
    module = sys.modules.get(name)
    if module is not None:
        return module
    try:
        if importlib.util.find_spec(name) is None:
            return None
        return importlib.import_module(name)
    except (ImportError, ValueError):
        return None


# --- the patched handler -----------------------------------------------------


@dataclass
class _HandlerPlan:
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


# A handler whose transfers vLLM itself builds (a canonical layout, for now).
_VLLM_BUILDS = "vllm"


def _handler_plan(handler: Any) -> _HandlerPlan | str:
    """The handler's ptrres state, or _VLLM_BUILDS where vLLM keeps its own path.

    Decided once per handler, on its first transfer.
    """
    if handler.gpu_to_cpu:
        device_tensors, cpu_tensors = handler.src_tensors, handler.dst_tensors
        blocks_per_chunk = handler.dst_blocks_per_chunk
    else:
        device_tensors, cpu_tensors = handler.dst_tensors, handler.src_tensors
        blocks_per_chunk = handler.src_blocks_per_chunk
    offloaded = _offloaded_layout(
        cpu_tensors,
        blocks_per_chunk,
        canonical=handler._canonical_copy_plans is not None,
    )
    if offloaded is None:
        return _VLLM_BUILDS
    kv_caches = CanonicalKVCaches(
        [CanonicalKVCacheTensor(t, t.shape[1]) for t in device_tensors],
        handler.layer_refs_per_group,
    )
    worker = sys.modules[WORKER_MODULE]
    return _HandlerPlan(
        table=PointerTable(kv_caches),
        offloaded=offloaded,
        coalesce=_coalesce_requested()
        and handler._swap_blocks_batch is worker.ops.swap_blocks_batch,
    )


def _offloaded_layout(
    cpu_tensors: Any, blocks_per_chunk: int, *, canonical: bool
) -> OffloadedLayout | None:
    """The ptrres view of the handler's CPU tensors (None: vLLM builds).

    The one place canonical layouts plug in: with canonical offloaded layouts
    in ptrres this returns ``OffloadedLayout(cpu_tensors, blocks_per_chunk,
    canonical=True)`` and transfer_async's plan_transfer call stays as it is
    (the refs already carry their CanonicalPageMapping).
    """
    if canonical:
        return None
    return OffloadedLayout(cpu_tensors, blocks_per_chunk)


def transfer_async(self: Any, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
    """vLLM's ``transfer_async``, its descriptors built by one ptrres plan.

    Same descriptors, same num_bytes, same buffers, streams and events as
    vLLM's; but every GPU and CPU id is checked first: a bad one raises
    ptrres's BlockIdError or OffloadedIdError (ValueErrors) before anything is
    submitted, and the buffers go back to the pool.
    """
    plan = vars(self).get(_STATE_ATTRIBUTE)
    if plan is None:
        plan = _handler_plan(self)
        setattr(self, _STATE_ATTRIBUTE, plan)
    if plan is _VLLM_BUILDS or _applied is None:
        return bool(_vllm_transfer_async(self, job_id, src_spec, dst_spec))
    assert isinstance(plan, _HandlerPlan)
    worker = sys.modules[WORKER_MODULE]
    if self.gpu_to_cpu:
        gpu_spec, offloaded_ids = src_spec, dst_spec.block_ids
    else:
        gpu_spec, offloaded_ids = dst_spec, src_spec.block_ids
    num_copy_ops = _max_copy_ops(self, gpu_spec)

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


def _max_copy_ops(handler: Any, gpu_spec: Any) -> int:
    """Descriptors the transfer needs at most, to size its buffers.

    Malformed group sizes give 0 here; plan_transfer then says what is wrong
    with them (it checks the spec before the buffers).
    """
    try:
        return max(int(handler._estimate_max_copy_ops(gpu_spec.group_sizes)), 0)
    except (TypeError, ValueError, AttributeError):
        return 0
