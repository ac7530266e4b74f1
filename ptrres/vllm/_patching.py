"""patch(), unpatch() and register(): what the plugin replaces in vLLM, all
or nothing, restored exactly, and when.

What to replace is each path's: the offloading handler's ``__init__`` and
``transfer_async`` (``ptrres.vllm._handler``), ``pointer_utils``' functions
where the installed vLLM has that module (``ptrres._pointer_utils``), and the
simple offload path's ``build_params`` and ``copy_blocks``
(``ptrres.vllm._simple``). Whether the installed vLLM is a tested release
with the names and signatures the patches rely on is ``ptrres.vllm._release``'s
to say; register()'s wait for vLLM's first offloading import is
``ptrres.vllm._hook``'s.

Importing this module imports neither vLLM nor numba nor any kernel, nor the
paths' modules: patch() does, when it plans what to replace.
"""

from __future__ import annotations

import os
import sys
import warnings
from types import ModuleType
from typing import Any

from . import _state
from ._hook import PatchOnImport
from ._release import (
    NIXL_BASE_MODULE,
    PATCH_TRIGGERS,
    POINTER_UTILS_MODULE,
    find_handler,
    find_nixl_path,
    find_simple_path,
    optional_module,
    parameter_names,
    signature_refusal,
)
from ._state import Replacement, is_patched, logger, reporter


class VllmPatchWarning(UserWarning):
    """patch() left vLLM as it was: an untested version or an unexpected API."""


# The reasons patch() has already warned about, so each warns once.
_warned: set[str] = set()


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
    with _state.lock:
        PatchOnImport.remove()
        if _state.applied is not None:
            return [r.qualified_name for r in _state.applied]
        replacements, refusal = plan_replacements()
        if refusal is not None:
            _warn_once(refusal)
            return []
        from . import _handler

        _handler.vllm_transfer_async = replacements[1].original
        done: list[Replacement] = []
        try:
            for r in replacements:
                setattr(r.owner, r.name, r.replacement)
                done.append(r)
        except Exception as error:  # an attribute that cannot be set: undo all
            for r in reversed(done):
                setattr(r.owner, r.name, r.original)
            _warn_once(f"{replacements[len(done)].qualified_name}: {error!r}")
            return []
        _state.applied = replacements
        return [r.qualified_name for r in replacements]


def unpatch() -> None:
    """Restore vLLM's own attributes (the very objects patch() replaced), and
    cancel a patch that register() left for vLLM's first import.

    Handlers and params keep the ptrres state they built, but ignore it once
    unpatched; those built from then on are vLLM's alone.
    """
    with _state.lock:
        PatchOnImport.remove()
        if _state.applied is None:
            return
        for r in reversed(_state.applied):
            setattr(r.owner, r.name, r.original)
        _state.applied = None


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
        if os.environ.get("PTRRES_VLLM", "1").strip().lower() in _state.OFF_VALUES:
            logger.debug("ptrres: PTRRES_VLLM=0, leaving vLLM as it is")
            return
        if is_patched():
            return
        if any(name in sys.modules for name in PATCH_TRIGGERS):
            _patch_and_report()
        else:
            PatchOnImport.install(PATCH_TRIGGERS, _patch_and_report)
    except Exception:  # a plugin must never take vLLM down
        logger.warning("ptrres: could not patch vLLM; it runs unchanged", exc_info=True)


def _patch_and_report() -> None:
    """patch(), and its INFO line."""
    patched = patch()
    if patched:
        reporter().info(
            "ptrres %s builds vLLM %s's KV offload descriptors: patched %s%s; "
            "kernels are made ready when the handlers and params are built",
            _ptrres_version(),
            getattr(sys.modules.get("vllm"), "__version__", "?"),
            ", ".join(patched),
            " (coalescing on)" if _state.coalesce_requested() else "",
        )


def _ptrres_version() -> str:
    from .. import __version__

    return __version__


def _warn_once(reason: str) -> None:
    if reason in _warned:
        return
    _warned.add(reason)
    warnings.warn(
        f"ptrres.vllm left vLLM unpatched: {reason}", VllmPatchWarning, stacklevel=3
    )


# --- what to replace ---------------------------------------------------------


def plan_replacements() -> tuple[list[Replacement], str | None]:
    """Every attribute to replace, or the reason to replace none.

    The paths' modules are imported here, not by register(), which needs
    none of them until vLLM imports its offloading modules.
    """
    from . import _handler

    found = find_handler()
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
    simple = find_simple_path()
    if isinstance(simple, str):
        return [], simple
    replacements += _simple_replacements(*simple)
    if _state.nixl_requested():
        nixl = find_nixl_path()
        if isinstance(nixl, str):
            return [], nixl
        replacements += _nixl_replacements(nixl)
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
            active=is_patched,
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
            active=is_patched,
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
