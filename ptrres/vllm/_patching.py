"""patch(), unpatch() and register(): what the plugin replaces in vLLM, path
by path, each all or nothing, restored exactly, and when.

vLLM has three paths the plugin patches, each on its own (``_state.PATHS``):
the offloading handler's ``__init__`` and ``transfer_async``
(``ptrres.vllm._handler``), with ``pointer_utils``' functions where the
installed vLLM has that module (``ptrres._pointer_utils``); the simple
offload path's ``build_params`` and ``copy_blocks`` (``ptrres.vllm._simple``);
and the NIXL connector's workers (``ptrres.vllm._nixl``). A path is patched
when vLLM imports its modules, and its patch imports only its own modules:
a process that offloads never imports the NIXL connector for ptrres, and a
path that cannot be patched (a module that does not import, a name or
signature not its release's) is left as vLLM has it while the others are
patched. Whether the installed vLLM is a tested release with the names and
signatures the patches rely on is ``ptrres.vllm._release``'s to say;
register()'s wait for vLLM's imports is ``ptrres.vllm._hook``'s.

Importing this module imports neither vLLM nor numba nor any kernel, nor the
paths' modules: patching a path does, that path's.
"""

from __future__ import annotations

import functools
import os
import sys
import warnings
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from . import _state
from ._hook import PatchOnImport
from ._release import (
    NIXL_BASE_MODULE,
    PATH_TRIGGERS,
    POINTER_UTILS_MODULE,
    find_handler,
    find_nixl_path,
    find_simple_path,
    optional_module,
    parameter_names,
    release_series,
    signature_refusal,
)
from ._state import HANDLER, NIXL, PATHS, SIMPLE, Replacement, logger, reporter


class VllmPatchWarning(UserWarning):
    """patch() left a path of vLLM as it was: an untested version, or a path
    whose names or signatures are not its release's."""


# The warnings patch() has already issued, so each warns once.
_warned: set[str] = set()


def patch() -> list[str]:
    """Make vLLM's offloading and NIXL workers build their descriptors with ptrres.

    Patches each of vLLM's paths on its own: the offloading handler
    (``SingleDirectionOffloadingHandler.__init__``, vLLM's then
    ``ptrres.warmup()`` and the handler's ptrres plan, and
    ``transfer_async``; where the installed vLLM has ``pointer_utils``, its
    ``resolve_device_pointers`` and ``iter_pointer_groups``), the simple
    offload path (``build_params`` and ``copy_blocks``, in ``cuda_mem_ops``
    and in the two backends that import them by name), and the NIXL
    connector (unless PTRRES_VLLM_NIXL=0). Within a path everything is
    replaced or nothing: a path whose module does not import, or where an
    attribute is missing or has another signature than its release's, is
    left as it was with a VllmPatchWarning naming the path and why (once per
    reason), and the other paths are patched. On a vLLM release not in
    SUPPORTED_VLLM nothing is replaced. Calling it again changes nothing on
    the paths patched already. It imports each path's vLLM modules, but no
    kernel (and not numba).

    Returns:
        The qualified names of the attributes now replaced, path by path
        (empty when vLLM was left alone).
    """
    with _state.lock:
        PatchOnImport.remove()
        for path in PATHS:
            if path == NIXL and not _state.nixl_requested():
                continue
            patch_path(path)
        return patched_names()


def patch_path(path: str) -> list[str]:
    """Patch one of vLLM's paths (``_state.PATHS``), all or nothing, importing
    that path's modules alone; or leave it as vLLM has it, with a
    VllmPatchWarning naming the path and why.

    Returns:
        The qualified names of the path's attributes now replaced (empty when
        it was left alone).
    """
    with _state.lock:
        if path in _state.applied:
            return [r.qualified_name for r in _state.applied[path]]
        series, refusal = release_series()
        if series is not None:
            replacements, refusal = plan_path(path, series)
        if refusal is not None:
            _state.refused[path] = refusal
            # An untested release leaves every path alone: one warning.
            _warn_once(refusal, None if series is None else path)
            return []
        done: list[Replacement] = []
        try:
            for r in replacements:
                setattr(r.owner, r.name, r.replacement)
                done.append(r)
        except Exception as error:  # an attribute that cannot be set: undo all
            for r in reversed(done):
                setattr(r.owner, r.name, r.original)
            reason = f"{replacements[len(done)].qualified_name}: {error!r}"
            _state.refused[path] = reason
            _warn_once(reason, path)
            return []
        _state.refused.pop(path, None)
        _state.applied[path] = replacements
        return [r.qualified_name for r in replacements]


def patched_names() -> list[str]:
    """The qualified names of every attribute replaced now, path by path."""
    return [r.qualified_name for path in PATHS for r in _state.applied.get(path, ())]


@dataclass(frozen=True)
class PathState:
    """Where one of vLLM's paths stands in this process."""

    path: str
    # "patched"; "waiting" (for vLLM to import one of its triggers); "left
    # alone" (it could not be patched); "off" (a switch leaves it alone);
    # "unpatched" (neither register() nor patch() has run since unpatch()).
    status: str
    # The attributes replaced, the triggers waited for, why it was left
    # alone, or the switch.
    detail: tuple[str, ...]


def path_states() -> list[PathState]:
    """Where each of vLLM's paths stands in this process, in PATHS order."""
    with _state.lock:
        waiting = PatchOnImport.waiting_paths()
        states = []
        for path in PATHS:
            if path in _state.applied:
                status, detail = (
                    "patched",
                    tuple(r.qualified_name for r in _state.applied[path]),
                )
            elif path in _state.refused:
                status, detail = "left alone", (_state.refused[path],)
            elif path in waiting:
                status, detail = "waiting", waiting[path]
            elif (switch := _state.switched_off(path)) is not None:
                status, detail = "off", (switch,)
            else:
                status, detail = "unpatched", ()
            states.append(PathState(path, status, detail))
        return states


def unpatch() -> None:
    """Restore vLLM's own attributes on every patched path (the very objects
    patch() replaced), and cancel the patches register() left for vLLM's
    imports.

    Handlers, params and workers keep the ptrres state they built, but
    ignore it once unpatched; those built from then on are vLLM's alone.
    """
    with _state.lock:
        PatchOnImport.remove()
        for replacements in reversed(list(_state.applied.values())):
            for r in reversed(replacements):
                setattr(r.owner, r.name, r.original)
        _state.applied.clear()
        _state.refused.clear()


def register() -> None:
    """The ``vllm.general_plugins`` entry point: each path patched when vLLM
    imports it, unless PTRRES_VLLM=0.

    vLLM calls it in every process, possibly many times, many of which never
    offload (the API server): it imports no vLLM module and compiles
    nothing. A path whose triggers (PATH_TRIGGERS) vLLM has imported already
    is patched at once; the others right after vLLM first imports one of
    theirs (PTRRES_VLLM_NIXL=0: never the NIXL connector). Each path is
    patched once, with one INFO line naming what was replaced; register()
    never raises. The kernels are made ready when vLLM builds its first
    handler, params or NIXL worker.
    """
    try:
        if os.environ.get("PTRRES_VLLM", "1").strip().lower() in _state.OFF_VALUES:
            logger.debug("ptrres: PTRRES_VLLM=0, leaving vLLM as it is")
            return
        with _state.lock:
            waiting = PatchOnImport.waiting_paths()
            paths = [
                path
                for path in PATHS
                if _state.switched_off(path) is None
                and path not in _state.applied
                and path not in _state.refused
                and path not in waiting
            ]
            if paths and "vllm" in sys.modules:
                # An untested release leaves every path alone, now.
                _, refusal = release_series()
                if refusal is not None:
                    for path in paths:
                        _state.refused[path] = refusal
                    _warn_once(refusal, None)
                    return
            imported = [
                path
                for path in paths
                if any(name in sys.modules for name in PATH_TRIGGERS[path])
            ]
            for path in imported:
                _patch_and_report(path)
            PatchOnImport.install(
                {p: PATH_TRIGGERS[p] for p in paths if p not in imported},
                _patch_and_report,
            )
    except Exception:  # a plugin must never take vLLM down
        logger.warning("ptrres: could not patch vLLM; it runs unchanged", exc_info=True)


def _patch_and_report(path: str) -> None:
    """patch_path(), and its INFO line."""
    patched = patch_path(path)
    if patched:
        coalescing = path != NIXL and _state.coalesce_requested()
        reporter().info(
            "ptrres %s checks vLLM %s's %s: patched %s%s; kernels are made "
            "ready at engine start-up",
            _ptrres_version(),
            getattr(sys.modules.get("vllm"), "__version__", "?"),
            path,
            ", ".join(patched),
            " (coalescing on)" if coalescing else "",
        )


def _ptrres_version() -> str:
    from .. import __version__

    return __version__


def _warn_once(reason: str, path: str | None) -> None:
    """Say (once) that ``path`` was left as vLLM has it, or every path (None)."""
    what = "vLLM" if path is None else f"vLLM's {path}"
    message = f"ptrres.vllm left {what} unpatched: {reason}"
    if message in _warned:
        return
    _warned.add(message)
    warnings.warn(message, VllmPatchWarning, stacklevel=4)


# --- what to replace ---------------------------------------------------------


def plan_path(path: str, series: str) -> tuple[list[Replacement], str | None]:
    """Every attribute to replace on ``path`` of the release ``series``, or
    the reason to replace none of them.

    The path's modules are imported here, not by register(), which needs
    none of them until vLLM imports them; and no other path's.
    """
    if path == HANDLER:
        return _handler_replacements(series)
    if path == SIMPLE:
        simple = find_simple_path()
        if isinstance(simple, str):
            return [], simple
        return _simple_replacements(*simple), None
    if path == NIXL:
        nixl = find_nixl_path()
        if isinstance(nixl, str):
            return [], nixl
        return _nixl_replacements(nixl), None
    raise ValueError(f"no such path: {path!r} (one of {', '.join(PATHS)})")


def _handler_replacements(series: str) -> tuple[list[Replacement], str | None]:
    """The handler's __init__ and transfer_async; pointer_utils' functions
    where the installed vLLM has that module, and in the worker, where it
    imported them by name."""
    from . import _handler

    found = find_handler(series)
    if isinstance(found, str):
        return [], found
    worker, handler = found
    original_init = vars(handler)["__init__"]
    replacements = [
        Replacement(
            handler, "__init__", original_init, _handler.patched_init(original_init)
        ),
        Replacement(
            handler,
            "transfer_async",
            vars(handler)["transfer_async"],
            _handler.transfer_async,
        ),
    ]
    pointer_utils = optional_module(POINTER_UTILS_MODULE)
    if pointer_utils is not None:
        from .._pointer_utils import iter_pointer_groups, resolve_device_pointers

        for ours in (resolve_device_pointers, iter_pointer_groups):
            name = ours.__name__
            refusal = signature_refusal(pointer_utils, name, parameter_names(ours))
            if refusal is not None:
                return [], refusal
            original = getattr(pointer_utils, name)
            replacements.append(Replacement(pointer_utils, name, original, ours))
            # The worker may have imported it by name (`from ... import`).
            if getattr(worker, name, None) is original:
                replacements.append(Replacement(worker, name, original, ours))
    # vLLM's own, for the handlers whose transfers vLLM builds.
    _handler.vllm_transfer_async = replacements[1].original
    return replacements, None


def _simple_replacements(
    mem_ops: ModuleType, backends: tuple[ModuleType, ...]
) -> list[Replacement]:
    """build_params and copy_blocks of the simple offload path: in cuda_mem_ops,
    and in the backends, which imported them by name."""
    from . import _simple
    from ._warmup import warm_up_kernels

    vllm_build_params, vllm_copy_blocks = mem_ops.build_params, mem_ops.copy_blocks
    build_params, copy_blocks = _simple.patched_functions(
        _simple.SimplePatch(
            mem_ops=mem_ops,
            vllm_build_params=vllm_build_params,
            vllm_copy_blocks=vllm_copy_blocks,
            active=functools.partial(_state.patched, SIMPLE),
            prepare=warm_up_kernels,
            coalesce=_state.coalesce_requested,
            decline=_decline_params,
        )
    )
    return [
        Replacement(owner, name, original, ours)
        for name, original, ours in (
            ("build_params", vllm_build_params, build_params),
            ("copy_blocks", vllm_copy_blocks, copy_blocks),
        )
        for owner in (mem_ops, *backends)
    ]


def _nixl_replacements(found: dict[str, Any]) -> list[Replacement]:
    """The NIXL connector's worker: its __init__ (vLLM's, then the kernels
    made ready), its _compute_desc_ids (every id checked), and the pull and
    push workers' _read_blocks and _xfer_blocks (vLLM's, the transfer named
    for the log)."""
    from . import _nixl
    from ._warmup import warm_up_kernels

    base = found["NixlBaseConnectorWorker"]
    original = vars(base)["_compute_desc_ids"]
    compute_desc_ids, wrap = _nixl.patched_functions(
        _nixl.NixlPatch(
            base_worker=found[NIXL_BASE_MODULE],
            vllm_compute_desc_ids=original,
            active=functools.partial(_state.patched, NIXL),
        )
    )
    init = vars(base)["__init__"]
    replacements = [
        Replacement(base, "__init__", init, _nixl.patched_init(init, warm_up_kernels)),
        Replacement(base, "_compute_desc_ids", original, compute_desc_ids),
    ]
    for class_name, name in (
        ("NixlPullConnectorWorker", "_read_blocks"),
        ("NixlPushConnectorWorker", "_xfer_blocks"),
    ):
        owner = found[class_name]
        method = vars(owner)[name]
        replacements.append(Replacement(owner, name, method, wrap(method)))
    return replacements


def _decline_params(error: BaseException) -> None:
    """Say why copy_blocks params keep vLLM's own copies."""
    reporter().warning(
        "ptrres: these copy_blocks params keep vLLM's own copies: %s",
        error,
        exc_info=not isinstance(error, (AttributeError, ValueError, TypeError)),
    )
