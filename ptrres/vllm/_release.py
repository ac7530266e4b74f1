"""Which vLLM releases ``ptrres.vllm`` patches, which modules make up each of
vLLM's paths (and which of them, imported by vLLM, mean a process uses the
path), and whether the installed vLLM's handler, simple offload path
(``cuda_mem_ops``) and NIXL connector are the ones those releases have: every
name and signature a path's patch relies on, checked before anything of that
path is replaced.

Importing this module does not import vLLM: only release_series() and the
find_* functions do, each of its own path's modules alone.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from ._state import HANDLER, NIXL, SIMPLE

# The handler's constructor in each release this module was tested against
# (its patch releases included): 0.31 added host_memory_is_pinned, with which
# unpinned host memory also sends loads to ops.swap_blocks_batch. The patched
# handler reads the copy function vLLM chose, so it follows each release.
_INIT_PARAMETERS = [
    "self",
    "gpu_tensors",
    "cpu_tensors",
    "blocks_per_chunk",
    "layer_refs_per_group",
    "gpu_to_cpu",
    "canonical_layout",
]
_RELEASE_INIT_PARAMETERS: dict[str, list[str]] = {
    "0.30": _INIT_PARAMETERS,
    "0.31": [*_INIT_PARAMETERS, "host_memory_is_pinned"],
    "0.32": [*_INIT_PARAMETERS, "host_memory_is_pinned"],
    "0.33": [*_INIT_PARAMETERS, "host_memory_is_pinned"],
}
# vLLM releases whose handler this module was tested against, each with its
# patch releases (0.33 stands for 0.33.x).
SUPPORTED_VLLM: tuple[str, ...] = tuple(_RELEASE_INIT_PARAMETERS)
SUPPORTED_VERSION = re.compile(
    r"(" + "|".join(re.escape(release) for release in SUPPORTED_VLLM) + r")(\.|$)"
)
WORKER_MODULE = "vllm.v1.kv_offload.cpu.gpu_worker"
POINTER_UTILS_MODULE = "vllm.v1.kv_offload.pointer_utils"
HANDLER_CLASS = "SingleDirectionOffloadingHandler"
# vLLM's second CPU offloading path (SimpleCPUOffloadConnector): the module
# that builds and submits its descriptors, and the backends that import its
# build_params and copy_blocks by name. The three files are byte-identical in
# 0.30.0 to 0.33.0.
SIMPLE_MODULE = "vllm.v1.simple_kv_offload.cuda_mem_ops"
SIMPLE_BACKEND_MODULES = (
    "vllm.v1.simple_kv_offload.copy_backend",
    "vllm.v1.simple_kv_offload.disk_backend",
)
# vLLM's NIXL connector (prefill/decode disaggregation): the module that
# turns block ids into descriptor ids (NixlBaseConnectorWorker), and the pull
# (READ) and push (WRITE) workers that call it. Their signatures are the same
# in 0.30.0 to 0.33.0.
NIXL_PACKAGE = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"
NIXL_BASE_MODULE = f"{NIXL_PACKAGE}.base_worker"
NIXL_PULL_MODULE = f"{NIXL_PACKAGE}.pull_worker"
NIXL_PUSH_MODULE = f"{NIXL_PACKAGE}.push_worker"
# Each path's modules whose import by vLLM means this process may use the
# path: register() patches a path right after vLLM first imports one of its
# triggers (cuda_mem_ops alone does not count: vLLM also imports it for
# pin_tensor; base_worker alone neither: the pull and push workers, which
# vLLM's connector imports together, are what use it).
PATH_TRIGGERS: dict[str, tuple[str, ...]] = {
    HANDLER: (WORKER_MODULE,),
    SIMPLE: SIMPLE_BACKEND_MODULES,
    NIXL: (NIXL_PULL_MODULE, NIXL_PUSH_MODULE),
}
# Every vLLM module a path's patch imports or reads: its own, never another
# path's (pointer_utils where the installed vLLM has it).
PATH_MODULES: dict[str, tuple[str, ...]] = {
    HANDLER: (WORKER_MODULE, POINTER_UTILS_MODULE),
    SIMPLE: (SIMPLE_MODULE, *SIMPLE_BACKEND_MODULES),
    NIXL: (NIXL_BASE_MODULE, NIXL_PULL_MODULE, NIXL_PUSH_MODULE),
}


# vLLM names whose signatures the patched transfer_async relies on, the same
# in every tested release: the method it replaces, the fill it stands for, and
# the helpers it calls. (__init__'s is each release's own.)
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

# cuda_mem_ops's functions the patched path replaces or calls, with their
# parameters in every tested release, and the fields of the params it reads.
_SIMPLE_SIGNATURES: dict[str, list[str]] = {
    "build_params": ["src_caches", "dst_caches", "stream", "src_access_order"],
    "copy_blocks": ["src_block_ids", "dst_block_ids", "params"],
    "_resolve_max_batch_descriptors": [],
}
SIMPLE_PARAMS_FIELDS = (
    "src_bases",
    "dst_bases",
    "bpb",
    "num_layers",
    "attrs",
    "attrs_idx",
    "num_attrs",
    "fail_idx",
    "stream_handle",
)
# What the backends import from cuda_mem_ops by name.
SIMPLE_IMPORTED_NAMES = ("build_params", "copy_blocks")


def release_series() -> tuple[str, None] | tuple[None, str]:
    """The installed vLLM's tested release series ("0.33" for 0.33.1), or why
    there is none (vLLM missing, or not a tested release): (series, None) or
    (None, reason). It imports vLLM's top package only."""
    try:
        vllm = importlib.import_module("vllm")
    except ImportError as error:
        return None, f"vLLM cannot be imported ({error})"
    version = str(getattr(vllm, "__version__", "unknown"))
    tested = SUPPORTED_VERSION.match(version)
    if tested is None:
        return None, (
            f"vLLM {version} is not a tested version "
            f"({', '.join(f'{release}.x' for release in SUPPORTED_VLLM)})"
        )
    return tested.group(1), None


def find_handler(series: str) -> tuple[ModuleType, type] | str:
    """vLLM's worker module and its handler class, or why neither can be
    patched (a name or signature not that of the release ``series``)."""
    try:
        worker = importlib.import_module(WORKER_MODULE)
    except ImportError as error:
        return f"{WORKER_MODULE} cannot be imported ({error})"
    handler = getattr(worker, HANDLER_CLASS, None)
    if not isinstance(handler, type):
        return f"{WORKER_MODULE}.{HANDLER_CLASS} is missing"
    signatures = {
        "__init__": _RELEASE_INIT_PARAMETERS[series],
        **_HANDLER_SIGNATURES,
    }
    for name, expected in signatures.items():
        refusal = signature_refusal(handler, name, expected)
        if refusal is not None:
            return refusal
    for name in _WORKER_NAMES:
        if not hasattr(worker, name):
            return f"{WORKER_MODULE}.{name} is missing"
    return worker, handler


def find_simple_path() -> tuple[ModuleType, tuple[ModuleType, ...]] | str:
    """vLLM's cuda_mem_ops and the backends that import from it, or why they
    cannot be patched (a module, name, signature or params field not the
    tested releases'). Call it after release_series(): it checks no version."""
    modules = []
    for name in (SIMPLE_MODULE, *SIMPLE_BACKEND_MODULES):
        try:
            modules.append(importlib.import_module(name))
        except ImportError as error:
            return f"{name} cannot be imported ({error})"
    mem_ops, *backends = modules
    for name, expected in _SIMPLE_SIGNATURES.items():
        refusal = signature_refusal(mem_ops, name, expected)
        if refusal is not None:
            return refusal
    if not hasattr(mem_ops, "_batch_memcpy"):
        return f"{SIMPLE_MODULE}._batch_memcpy is missing"
    fields = getattr(getattr(mem_ops, "BatchMemcpyParams", None), "_fields", None)
    if fields != SIMPLE_PARAMS_FIELDS:
        return (
            f"{SIMPLE_MODULE}.BatchMemcpyParams has the fields {fields}, "
            f"not {SIMPLE_PARAMS_FIELDS}"
        )
    for backend in backends:
        for name in SIMPLE_IMPORTED_NAMES:
            if getattr(backend, name, None) is not getattr(mem_ops, name):
                return f"{backend.__name__}.{name} is not {SIMPLE_MODULE}.{name}"
    return mem_ops, tuple(backends)


# The NIXL connector's methods the patch replaces or wraps: (module, class,
# method) and their parameters in every tested release.
_TRANSFER_PARAMETERS = [
    "self",
    "read_spec",
    "dst_engine_id",
    "request_id",
    "remote_request_id",
    "local_xfer_side_handle",
]
NIXL_METHODS: dict[tuple[str, str, str], list[str]] = {
    (NIXL_BASE_MODULE, "NixlBaseConnectorWorker", "__init__"): [
        "self",
        "vllm_config",
        "engine_id",
        "kv_cache_config",
    ],
    (NIXL_BASE_MODULE, "NixlBaseConnectorWorker", "_compute_desc_ids"): [
        "self",
        "block_ids",
        "dst_num_blocks",
        "block_size_ratio",
        "physical_blocks_per_logical",
        "region_num_blocks",
        "region_group_ids",
        "uses_region_group_mapping",
    ],
    (NIXL_PULL_MODULE, "NixlPullConnectorWorker", "_read_blocks"): [
        *_TRANSFER_PARAMETERS,
        "local_dram_handle",
        "remote_xfer_side_handle",
        "expected_consumers",
        "awaiting_kvs",
    ],
    (NIXL_PUSH_MODULE, "NixlPushConnectorWorker", "_xfer_blocks"): [
        *_TRANSFER_PARAMETERS,
        "remote_xfer_side_handle",
    ],
}
# What the patched _compute_desc_ids reads of base_worker (vLLM's own tests
# of a group's spec type).
NIXL_BASE_NAMES = ("_is_attention_spec", "_is_ssm_spec", "CircularBufferSpec")


def find_nixl_path() -> dict[str, Any] | str:
    """vLLM's NIXL connector: base_worker, and each class of NIXL_METHODS by
    name; or why it cannot be patched (a module that does not import, a name
    or signature not the tested releases', a subclass that overrides
    _compute_desc_ids). Call it after release_series(): it checks no version."""
    found: dict[str, Any] = {}
    for (module_name, class_name, method), expected in NIXL_METHODS.items():
        try:
            module = importlib.import_module(module_name)
        except Exception as error:  # its own imports may fail, not only ImportError
            return f"{module_name} cannot be imported ({error!r})"
        owner = getattr(module, class_name, None)
        if not isinstance(owner, type):
            return f"{module_name}.{class_name} is missing"
        refusal = signature_refusal(owner, method, expected)
        if refusal is not None:
            return refusal
        found[class_name] = owner
        found[module_name] = module
    base = found[NIXL_BASE_MODULE]
    for name in NIXL_BASE_NAMES:
        if not hasattr(base, name):
            return f"{NIXL_BASE_MODULE}.{name} is missing"
    for class_name in ("NixlPullConnectorWorker", "NixlPushConnectorWorker"):
        if "_compute_desc_ids" in vars(found[class_name]):
            return f"{class_name} has a _compute_desc_ids of its own"
    return found


def _parameters(function: Any) -> list[tuple[str, Any]]:
    """A callable's parameter names and kinds (annotations do not matter)."""
    return [(p.name, p.kind) for p in inspect.signature(function).parameters.values()]


def parameter_names(function: Callable[..., Any]) -> list[str]:
    return [name for name, _ in _parameters(function)]


def signature_refusal(owner: Any, name: str, expected: list[str]) -> str | None:
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


def optional_module(name: str) -> ModuleType | None:
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
