"""Which vLLM ``ptrres.vllm`` patches, path by path: the modules each of
vLLM's paths is made of (and those whose import by vLLM means a process uses
it), the vLLM code each form of a path's patch depends on, and whether the
installed vLLM's code on a path is that of a tested release.

A path is patched where its code is a tested release's, whatever the
version string says: the fingerprint of every function it replaces,
reproduces or reads (``_fingerprint``) equals the one recorded for a tested
release (``fingerprints.json``). A release ptrres was not tested against
gets each path whose code it kept, and leaves alone, with one warning that
names it and what differs, each path whose code changed.

Importing this module does not import vLLM: only ``installed_version()`` and
``match_path()`` do, the latter one path's modules alone.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from collections.abc import Callable
from typing import Any

from ._fingerprint import (
    MISSING,
    Fingerprint,
    PathCode,
    Recorded,
    differences,
    fingerprint,
    load_records,
)
from ._state import (
    CONNECTOR,
    FILE_WORKER,
    HANDLER,
    NIXL,
    POINTER_UTILS,
    SIMPLE,
    Match,
)

# The releases whose code ptrres.vllm was tested against (fingerprints.json
# holds the fingerprint of each path of each; tests/vllm checks the two agree).
SUPPORTED_VLLM: tuple[str, ...] = ("0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0")

# The offloading path (0.30 and later): the CPU handler; 0.34 and later also
# resolve each job in pointer_utils, from the connector's worker, and have a
# file worker.
BASE_MODULE = "vllm.v1.kv_offload.base"
POINTER_UTILS_MODULE = "vllm.v1.kv_offload.pointer_utils"
CONNECTOR_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker"
WORKER_MODULE = "vllm.v1.kv_offload.cpu.gpu_worker"
FS_WORKER_MODULE = "vllm.v1.kv_offload.fs.worker"
HANDLER_CLASS = "SingleDirectionOffloadingHandler"
# vLLM's second CPU offloading path (SimpleCPUOffloadConnector): the module
# that builds and submits its descriptors, and the backends that import its
# build_params and copy_blocks by name.
SIMPLE_MODULE = "vllm.v1.simple_kv_offload.cuda_mem_ops"
SIMPLE_BACKEND_MODULES = (
    "vllm.v1.simple_kv_offload.copy_backend",
    "vllm.v1.simple_kv_offload.disk_backend",
)
# vLLM's NIXL connector (prefill/decode disaggregation): the module that
# turns block ids into descriptor ids (NixlBaseConnectorWorker), and the pull
# (READ) and push (WRITE) workers that call it.
NIXL_PACKAGE = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"
NIXL_BASE_MODULE = f"{NIXL_PACKAGE}.base_worker"
NIXL_PULL_MODULE = f"{NIXL_PACKAGE}.pull_worker"
NIXL_PUSH_MODULE = f"{NIXL_PACKAGE}.push_worker"

# Each path's modules whose import by vLLM means this process may use the
# path: register() patches a path right after vLLM first imports one of its
# triggers (cuda_mem_ops alone does not count: vLLM also imports it for
# pin_tensor; base_worker alone neither: the pull and push workers, which
# vLLM's connector imports together, are what use it; pointer_utils counts,
# for whoever calls it).
PATH_TRIGGERS: dict[str, tuple[str, ...]] = {
    POINTER_UTILS: (POINTER_UTILS_MODULE,),
    CONNECTOR: (CONNECTOR_MODULE,),
    HANDLER: (WORKER_MODULE,),
    FILE_WORKER: (FS_WORKER_MODULE,),
    SIMPLE: SIMPLE_BACKEND_MODULES,
    NIXL: (NIXL_PULL_MODULE, NIXL_PUSH_MODULE),
}
# Every vLLM module a path's patch imports or reads: its own, and the ones
# they import (pointer_utils, which gpu_worker, fs.worker and the connector's
# worker import; vLLM's types in base).
PATH_MODULES: dict[str, tuple[str, ...]] = {
    POINTER_UTILS: (POINTER_UTILS_MODULE, BASE_MODULE),
    CONNECTOR: (CONNECTOR_MODULE, POINTER_UTILS_MODULE, BASE_MODULE),
    HANDLER: (WORKER_MODULE, POINTER_UTILS_MODULE, BASE_MODULE),
    FILE_WORKER: (FS_WORKER_MODULE, POINTER_UTILS_MODULE, BASE_MODULE),
    SIMPLE: (SIMPLE_MODULE, *SIMPLE_BACKEND_MODULES),
    NIXL: (NIXL_BASE_MODULE, NIXL_PULL_MODULE, NIXL_PUSH_MODULE),
}


def _in(module: str, *names: str) -> tuple[str, ...]:
    """Locators of ``names`` in ``module``."""
    return tuple(f"{module}:{name}" for name in names)


_H = f"{HANDLER_CLASS}."
# The fill and the helpers the handler's descriptors come from, in every
# release (0.30 has no canonical layout: those are "missing" there).
_HANDLER_FILL = _in(
    WORKER_MODULE,
    f"{_H}_fill_direct_ops",
    f"{_H}_fill_canonical_ops",
    f"{_H}_filter_writer_blocks",
    f"{_H}_estimate_max_copy_ops",
    "compute_sub_block_ptrs",
    "_canonical_page_ids",
    "_build_copy_plan",
)
# What the patched transfer_async submits and records as vLLM's does.
_HANDLER_READS = _in(
    WORKER_MODULE,
    f"{_H}get_finished",
    "Transfer",
    "_new_descriptor_buffers",
    "_select_swap_blocks_fn",
    "current_platform",
    "torch",
    "ops",
)
_KV_CACHES = _in(
    BASE_MODULE,
    "CanonicalKVCaches",
    "CanonicalKVCacheTensor",
    "CanonicalKVCacheRef",
    "CanonicalPageMapping",
    "CopyRun",
    "GPULoadStoreSpec",
)

# The vLLM code each form ("variant", named for the first release it was
# made for) of each path's patch depends on.
PATH_CODE: dict[str, dict[str, PathCode]] = {
    POINTER_UTILS: {
        "0.34": PathCode(
            replaces=_in(
                POINTER_UTILS_MODULE, "resolve_device_pointers", "iter_pointer_groups"
            ),
            reads=(
                *_in(BASE_MODULE, "DevicePointers", "DevicePointerGroupInfo"),
                *_KV_CACHES,
            ),
        ),
    },
    CONNECTOR: {
        "0.34": PathCode(
            replaces=_in(CONNECTOR_MODULE, "resolve_device_pointers"),
            reproduces=_in(POINTER_UTILS_MODULE, "resolve_device_pointers"),
            # What the connector does with a job's DevicePointers (hands them
            # to its worker) and with a failed job.
            reads=(
                *_in(
                    CONNECTOR_MODULE,
                    "OffloadingConnectorWorker._init_worker",
                    "OffloadingConnectorWorker.handle_preemptions",
                    "OffloadingConnectorWorker.start_kv_transfers",
                    "OffloadingConnectorWorker.get_finished",
                ),
                *_in(BASE_MODULE, "DevicePointers"),
                *_KV_CACHES,
            ),
        ),
    },
    HANDLER: {
        "0.30": PathCode(
            replaces=_in(WORKER_MODULE, f"{_H}__init__", f"{_H}transfer_async"),
            reproduces=_HANDLER_FILL,
            reads=_HANDLER_READS,
        ),
        "0.34": PathCode(
            replaces=_in(
                WORKER_MODULE,
                "CPUOffloadingWorker.__init__",
                f"{_H}transfer_async",
                "iter_pointer_groups",
            ),
            reproduces=(
                *_HANDLER_FILL,
                *_in(POINTER_UTILS_MODULE, "iter_pointer_groups"),
            ),
            reads=(
                *_HANDLER_READS,
                # The attributes it sets, and how the worker builds its
                # handlers and hands them DevicePointers.
                *_in(
                    WORKER_MODULE,
                    f"{_H}__init__",
                    "CPUOffloadingWorker.submit_store",
                    "CPUOffloadingWorker.submit_load",
                    "_clear_pending_device_error",
                ),
                *_in(BASE_MODULE, "DevicePointers"),
                *_KV_CACHES,
            ),
        ),
    },
    SIMPLE: {
        "0.30": PathCode(
            replaces=(
                *_in(SIMPLE_MODULE, "build_params", "copy_blocks"),
                *(
                    locator
                    for backend in SIMPLE_BACKEND_MODULES
                    for locator in _in(backend, "build_params", "copy_blocks")
                ),
            ),
            reproduces=_in(SIMPLE_MODULE, "_resolve_max_batch_descriptors"),
            reads=_in(
                SIMPLE_MODULE,
                "BatchMemcpyParams",
                "_batch_memcpy",
                "_max_batch_descriptors",
            ),
        ),
    },
    NIXL: {
        "0.30": PathCode(
            replaces=(
                *_in(
                    NIXL_BASE_MODULE,
                    "NixlBaseConnectorWorker.__init__",
                    "NixlBaseConnectorWorker._compute_desc_ids",
                ),
                *_in(NIXL_PULL_MODULE, "NixlPullConnectorWorker._read_blocks"),
                *_in(NIXL_PUSH_MODULE, "NixlPushConnectorWorker._xfer_blocks"),
            ),
            # The regions and spec types the check reads: set where the
            # worker registers its KV caches.
            reads=(
                *_in(
                    NIXL_BASE_MODULE,
                    "NixlBaseConnectorWorker.register_kv_caches",
                    "_is_attention_spec",
                    "_is_ssm_spec",
                    "CircularBufferSpec",
                ),
                # No worker computes its ids on its own.
                *_in(NIXL_PULL_MODULE, "NixlPullConnectorWorker._compute_desc_ids"),
                *_in(NIXL_PUSH_MODULE, "NixlPushConnectorWorker._compute_desc_ids"),
            ),
        ),
    },
}


def installed_version() -> str | None:
    """The installed vLLM's version (importing its top package), or None."""
    try:
        vllm = importlib.import_module("vllm")
    except ImportError:
        return None
    return str(getattr(vllm, "__version__", "unknown"))


@functools.cache
def recorded() -> dict[str, dict[str, Recorded]]:
    """The tested releases' records, newest first (read once)."""
    return load_records()


# The forms of each path's patch, oldest first. The file worker's and the
# 0.34 NIXL connector's code lists live beside their patches.
VARIANTS: dict[str, tuple[str, ...]] = {
    POINTER_UTILS: ("0.34",),
    CONNECTOR: ("0.34",),
    HANDLER: ("0.30", "0.34"),
    FILE_WORKER: ("0.34",),
    SIMPLE: ("0.30",),
    NIXL: ("0.30", "0.34"),
}


def path_code(path: str, variant: str) -> PathCode:
    """The vLLM code ``variant`` of ``path``'s patch depends on."""
    if path == FILE_WORKER and variant == "0.34":
        from ._file_worker import FILE_WORKER_CODE

        return FILE_WORKER_CODE
    if path == NIXL and variant == "0.34":
        from ._nixl_pairs import NIXL_034_CODE

        return NIXL_034_CODE
    return PATH_CODE[path][variant]


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split(".") if part.isdigit())


def variant_for(path: str, release: str) -> str | None:
    """The form of ``path``'s patch made for ``release``: the newest made for
    it or an earlier release (None: the path came later)."""
    key = _version_key(release)
    fitting = [v for v in VARIANTS[path] if _version_key(v) <= key]
    return fitting[-1] if fitting else None


def match_path(
    path: str, original: Callable[[Any], Any] | None = None
) -> Match | str | None:
    """Whose code the installed vLLM has on ``path``: a Match (a tested
    release's), why it is none (a str naming what differs), or None where
    this vLLM has no such path (nothing any form of its patch replaces).

    The installed release's own record is tried first, then every other,
    newest first; each variant's fingerprint is computed once.

    Args:
        original: maps ptrres's replacements back to vLLM's objects
            (``_state.vllm_own``), for paths patched already.
    """
    installed = installed_version()
    if installed is None:
        return "vLLM cannot be imported"
    broken = _import_failure(path)
    if broken is not None:
        return broken
    candidates = sorted(
        ((release, records[path]) for release, records in recorded().items()
         if path in records),
        key=lambda item: item[0] != installed,
    )  # fmt: skip
    found: dict[str, Fingerprint] = {}

    def fingerprint_of(variant: str) -> Fingerprint:
        if variant not in found:
            found[variant] = fingerprint(path_code(path, variant), original)
        return found[variant]

    for release, record in candidates:
        if fingerprint_of(record.variant) == dict(record.fingerprint):
            return Match(release, record.variant, installed)
    # Nothing any form of the patch replaces is here: the path came later.
    if all(
        fingerprint_of(variant)[locator] == MISSING
        for variant in VARIANTS[path]
        for locator in path_code(path, variant).replaces
    ):
        return None
    return _refusal(path, installed, candidates, found)


def _import_failure(path: str) -> str | None:
    """Why a vLLM module the path's code is in cannot be imported, where this
    vLLM has it (its own import fails: a dependency missing, say); None
    where every one imports or is not in this vLLM at all (that code is then
    "missing", and the path may be absent)."""
    modules = dict.fromkeys(
        locator.partition(":")[0]
        for variant in VARIANTS[path]
        for locator in path_code(path, variant).locators()
    )
    for module in modules:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as error:
            gone = error.name is not None and (
                module == error.name or module.startswith(f"{error.name}.")
            )
            if not gone:
                return f"{module} cannot be imported ({error!r})"
        except Exception as error:  # its own imports may fail in any way
            return f"{module} cannot be imported ({error!r})"
    return None


def _refusal(
    path: str,
    installed: str,
    candidates: list[tuple[str, Recorded]],
    found: dict[str, Fingerprint],
) -> str:
    """Why a path whose code is no tested release's is left alone: what
    differs from the closest tested release (the fewest differences)."""
    if not candidates:
        return f"no tested release has it (tested: {', '.join(SUPPORTED_VLLM)})"
    closest = min(
        candidates,
        key=lambda c: len(differences(found[c[1].variant], c[1].fingerprint)),
    )
    release, record = closest
    what = differences(found[record.variant], record.fingerprint)
    shown = "; ".join(what[:4]) + (
        f"; and {len(what) - 4} more" if len(what) > 4 else ""
    )
    tested = "a tested release" if installed in recorded() else "not a tested release"
    return (
        f"vLLM {installed} ({tested}) has other code here than every tested "
        f"release; closest, {release}: {shown}"
    )


def _exists(module: str) -> bool:
    """Whether vLLM has ``module`` (imported, or importable)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def optional_module(name: str) -> Any:
    """The module ``name`` if it is installed (or already imported), else None."""
    import sys

    module = sys.modules.get(name)
    if module is not None:
        return module
    if not _exists(name):
        return None
    try:
        return importlib.import_module(name)
    except ImportError:
        return None
