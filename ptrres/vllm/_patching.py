"""patch(), unpatch() and register(): what the plugin replaces in vLLM, path
by path, each all or nothing, restored exactly, and when.

vLLM's paths (``_state.PATHS``) are patched each on its own: pointer_utils'
functions and the offloading connector's resolve (``ptrres.vllm._pointers``),
the offloading handler (``ptrres.vllm._handler``), the file worker
(``ptrres.vllm._file_worker``), the simple offload path
(``ptrres.vllm._simple``) and the NIXL connector (``ptrres.vllm._nixl``,
``_nixl_pairs``). A path is patched when vLLM imports its modules, and its
patch imports only its own modules: a process that offloads never imports
the NIXL connector for ptrres. A path is patched where its code is a tested
release's (``ptrres.vllm._release.match_path``: the fingerprint of the vLLM
code it depends on), in the form made for that release; a path whose code
is no tested release's is left as vLLM has it, with a warning naming it and
what differs, while the others are patched. register()'s wait for vLLM's
imports is ``ptrres.vllm._hook``'s.

Importing this module imports neither vLLM nor numba nor any kernel, nor the
paths' modules: patching a path does, that path's.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
import warnings
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from . import _state
from ._hook import PatchOnImport
from ._release import (
    CONNECTOR_MODULE,
    NIXL_BASE_MODULE,
    NIXL_PULL_MODULE,
    NIXL_PUSH_MODULE,
    PATH_MODULES,
    PATH_TRIGGERS,
    POINTER_UTILS_MODULE,
    SIMPLE_BACKEND_MODULES,
    SIMPLE_MODULE,
    WORKER_MODULE,
    match_path,
)
from ._state import (
    CONNECTOR,
    FILE_WORKER,
    HANDLER,
    NIXL,
    PATHS,
    POINTER_UTILS,
    SIMPLE,
    Replacement,
    logger,
    reporter,
)


class VllmPatchWarning(UserWarning):
    """patch() left a path of vLLM as it was: its code is no tested release's."""


# The warnings patch() has already issued, so each warns once.
_warned: set[str] = set()


def patch() -> list[str]:
    """Make vLLM's offloading and NIXL workers build their descriptors with ptrres.

    Patches each of vLLM's paths on its own (``_state.PATHS``) where the
    installed vLLM has it: pointer_utils' ``resolve_device_pointers`` and
    ``iter_pointer_groups`` (0.34 and later), the offloading connector's
    resolve (0.34), the offloading handler (``SingleDirectionOffloadingHandler``;
    on 0.34 with ``CPUOffloadingWorker.__init__``), the file worker (0.34),
    the simple offload path (``build_params`` and ``copy_blocks``, in
    ``cuda_mem_ops`` and in the two backends that import them by name), and
    the NIXL connector (unless PTRRES_VLLM_NIXL=0). A path is patched where
    its code is that of a release ptrres was tested against, whatever the
    version string says; within a path everything is replaced or nothing. A
    path whose code differs is left as it was with a VllmPatchWarning naming
    the path and what differs (once per reason), and the other paths are
    patched. Calling it again changes nothing on the paths patched already.
    It imports each path's vLLM modules, but no kernel (and not numba).

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
        it was left alone, or where this vLLM has no such path).
    """
    with _state.lock:
        if path in _state.applied:
            return [r.qualified_name for r in _state.applied[path]]
        found = match_path(path, _state.vllm_own)
        if found is None:
            _state.absent.add(path)
            return []
        if isinstance(found, str):
            _state.refused[path] = found
            _warn_once(found, path)
            return []
        replacements = plan_path(path, found.variant)
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
        _state.matches[path] = found
        return [r.qualified_name for r in replacements]


def patched_names() -> list[str]:
    """The qualified names of every attribute replaced now, path by path."""
    return [r.qualified_name for path in PATHS for r in _state.applied.get(path, ())]


@dataclass(frozen=True)
class PathState:
    """Where one of vLLM's paths stands in this process."""

    path: str
    # "patched"; "waiting" (for vLLM to import one of its triggers); "left
    # alone" (its code is no tested release's); "absent" (this vLLM has no
    # such path); "off" (a switch leaves it alone); "unpatched" (neither
    # register() nor patch() has run since unpatch()).
    status: str
    # The attributes replaced, the triggers waited for, why it was left
    # alone, or the switch.
    detail: tuple[str, ...]
    # Whose code a patched path has (a tested release's).
    match: _state.Match | None = None


def path_states() -> list[PathState]:
    """Where each of vLLM's paths stands in this process, in PATHS order."""
    with _state.lock:
        waiting = PatchOnImport.waiting_paths()
        states = []
        for path in PATHS:
            match = None
            if path in _state.applied:
                status = "patched"
                detail = tuple(r.qualified_name for r in _state.applied[path])
                match = _state.matches.get(path)
            elif path in _state.refused:
                status, detail = "left alone", (_state.refused[path],)
            elif path in _state.absent:
                status, detail = "absent", ()
            elif path in waiting:
                status, detail = "waiting", waiting[path]
            elif (switch := _state.switched_off(path)) is not None:
                status, detail = "off", (switch,)
            else:
                status, detail = "unpatched", ()
            states.append(PathState(path, status, detail, match))
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
                if isinstance(r.owner, ModuleType):
                    _restore_bindings(r)
        _state.applied.clear()
        _state.matches.clear()
        _state.refused.clear()
        _state.absent.clear()


def _restore_bindings(r: Replacement) -> None:
    """vLLM's own function back in every path module that imported ptrres's
    by name (``from pointer_utils import ...`` after pointer_utils was
    patched) and whose own path did not replace it (left alone, say)."""
    for modules in PATH_MODULES.values():
        for name in modules:
            module = sys.modules.get(name)
            if module is not None and vars(module).get(r.name) is r.replacement:
                setattr(module, r.name, r.original)


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
    worker, handler, params or NIXL worker.
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
                and path not in _state.absent
                and path not in waiting
            ]
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
        match = _state.matches[path]
        coalescing = path in (HANDLER, SIMPLE) and _state.coalesce_requested()
        reporter().info(
            "ptrres %s checks vLLM %s's %s: patched %s%s%s; kernels are made "
            "ready at engine start-up",
            _ptrres_version(),
            match.installed,
            path,
            ", ".join(patched),
            f" (untested release: its code here is {match.release}'s)"
            if match.by_fingerprint
            else "",
            " (coalescing on)" if coalescing else "",
        )


def _ptrres_version() -> str:
    from .. import __version__

    return __version__


def _warn_once(reason: str, path: str) -> None:
    """Say (once) that ``path`` was left as vLLM has it."""
    message = f"ptrres.vllm left vLLM's {path} unpatched: {reason}"
    if message in _warned:
        return
    _warned.add(message)
    warnings.warn(message, VllmPatchWarning, stacklevel=4)


# --- what to replace ---------------------------------------------------------


def plan_path(path: str, variant: str) -> list[Replacement]:
    """Every attribute to replace on ``path``, in the form of its patch made
    for the release ``variant`` (the installed vLLM's code on the path must
    be a tested release's of that variant: match_path()).

    The path's modules are imported here, not by register(), which needs
    none of them until vLLM imports them; and no other path's.
    """
    active = functools.partial(_state.patched, path)
    if path == POINTER_UTILS:
        return _pointer_utils_replacements()
    if path == CONNECTOR:
        return _connector_replacements()
    if path == HANDLER:
        if variant == "0.30":
            return _handler_replacements()
        return _worker_replacements()
    if path == FILE_WORKER:
        from ._file_worker import file_worker_replacements
        from ._warmup import warm_up_kernels

        return file_worker_replacements(active, warm_up_kernels)
    if path == SIMPLE:
        return _simple_replacements()
    if path == NIXL:
        if variant == "0.30":
            return _nixl_replacements()
        from ._nixl_pairs import nixl_replacements_034
        from ._warmup import warm_up_kernels

        return nixl_replacements_034(active, warm_up_kernels)
    raise ValueError(f"no such path: {path!r} (one of {', '.join(PATHS)})")


def binding(module: ModuleType, name: str, ours: Any) -> Replacement:
    """A module's name bound to ``ours``, where vLLM bound its own (or
    another path's patch ptrres's already): restored to vLLM's own."""
    return Replacement(module, name, _state.vllm_own(getattr(module, name)), ours)


def _pointer_utils_replacements() -> list[Replacement]:
    """pointer_utils' two functions, ptrres's (vLLM's own types returned)."""
    from . import _pointers

    pointer_utils = importlib.import_module(POINTER_UTILS_MODULE)
    return [
        binding(
            pointer_utils, "resolve_device_pointers", _pointers.resolve_device_pointers
        ),
        binding(pointer_utils, "iter_pointer_groups", _pointers.iter_pointer_groups),
    ]


def _connector_replacements() -> list[Replacement]:
    """The offloading connector's worker's resolve: a job's bad id refuses
    the job (the handler and file worker fail it) instead of raising."""
    from . import _pointers

    connector = importlib.import_module(CONNECTOR_MODULE)
    name = "resolve_device_pointers"
    vllm_resolve = _state.vllm_own(getattr(connector, name))
    return [
        Replacement(connector, name, vllm_resolve, _pointers.job_resolver(vllm_resolve))
    ]


def _handler_replacements() -> list[Replacement]:
    """The handler's __init__ and transfer_async (vLLM 0.30 to 0.33)."""
    from . import _handler

    worker = importlib.import_module(WORKER_MODULE)
    handler = worker.SingleDirectionOffloadingHandler
    original_init = vars(handler)["__init__"]
    original_transfer = vars(handler)["transfer_async"]
    # vLLM's own, for the handlers whose transfers vLLM builds.
    _handler.vllm_transfer_async = original_transfer
    return [
        Replacement(
            handler, "__init__", original_init, _handler.patched_init(original_init)
        ),
        Replacement(
            handler, "transfer_async", original_transfer, _handler.transfer_async
        ),
    ]


def _worker_replacements() -> list[Replacement]:
    """vLLM 0.34's CPU offloading: the worker's __init__ (vLLM's, then the
    kernels and one table for its three handlers), the handlers'
    transfer_async (from DevicePointers), and the module's
    iter_pointer_groups."""
    from . import _handler, _handler_pointers, _pointers

    worker = importlib.import_module(WORKER_MODULE)
    handler = worker.SingleDirectionOffloadingHandler
    cpu_worker = worker.CPUOffloadingWorker
    original_init = vars(cpu_worker)["__init__"]
    original_transfer = vars(handler)["transfer_async"]
    _handler.vllm_transfer_async = original_transfer
    return [
        Replacement(
            cpu_worker,
            "__init__",
            original_init,
            _handler_pointers.patched_worker_init(original_init),
        ),
        Replacement(
            handler,
            "transfer_async",
            original_transfer,
            _handler_pointers.transfer_pointers,
        ),
        binding(worker, "iter_pointer_groups", _pointers.iter_pointer_groups),
    ]


def _simple_replacements() -> list[Replacement]:
    """build_params and copy_blocks of the simple offload path: in cuda_mem_ops,
    and in the backends, which imported them by name."""
    from . import _simple
    from ._warmup import warm_up_kernels

    mem_ops = importlib.import_module(SIMPLE_MODULE)
    backends = [importlib.import_module(name) for name in SIMPLE_BACKEND_MODULES]
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


def _nixl_replacements() -> list[Replacement]:
    """The NIXL connector's worker (vLLM 0.30 to 0.33): its __init__ (vLLM's,
    then the kernels made ready), its _compute_desc_ids (every id checked),
    and the pull and push workers' _read_blocks and _xfer_blocks (vLLM's, the
    transfer named for the log)."""
    from . import _nixl
    from ._warmup import warm_up_kernels

    base_worker = importlib.import_module(NIXL_BASE_MODULE)
    base = base_worker.NixlBaseConnectorWorker
    original = vars(base)["_compute_desc_ids"]
    compute_desc_ids, wrap = _nixl.patched_functions(
        _nixl.NixlPatch(
            base_worker=base_worker,
            vllm_compute_desc_ids=original,
            active=functools.partial(_state.patched, NIXL),
        )
    )
    init = vars(base)["__init__"]
    replacements = [
        Replacement(base, "__init__", init, _nixl.patched_init(init, warm_up_kernels)),
        Replacement(base, "_compute_desc_ids", original, compute_desc_ids),
    ]
    for module_name, class_name, name in (
        (NIXL_PULL_MODULE, "NixlPullConnectorWorker", "_read_blocks"),
        (NIXL_PUSH_MODULE, "NixlPushConnectorWorker", "_xfer_blocks"),
    ):
        owner = getattr(importlib.import_module(module_name), class_name)
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
