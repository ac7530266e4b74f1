"""ptrres: KV-cache block ids to memory pointers and copy descriptors, compiled.

A checked, compiled drop-in for ``vllm.v1.kv_offload.pointer_utils``.

Importing ptrres imports none of its parts: each public name is imported on
first use (PEP 562), so that a process that only loads the vLLM plugin
(``ptrres.vllm``) imports neither numba nor the kernels.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._coalesce import coalesce
    from ._errors import (
        BlockIdError,
        DevicePointerError,
        InputTypeError,
        LayoutError,
        OffloadedIdError,
        OutBufferError,
        PtrresError,
        RemoteBlockIdError,
        SpecError,
    )
    from ._files import plan_file_ops
    from ._geometry import MemoryRegion
    from ._heads import HeadSlice, TPMapping, rank_heads, tp_mapping
    from ._offloaded import OffloadedLayout
    from ._peer import PeerLayout, PeerRef
    from ._pointer_utils import (
        clear_table_cache,
        iter_pointer_groups,
        resolve_device_pointers,
    )
    from ._posix import read_files, write_files
    from ._push import PushMapping, push_mapping, uncached_suffix
    from ._results import (
        DevicePointerGroupInfo,
        DevicePointers,
        FilePlan,
        PeerTransferPlan,
        StridedTransferPlan,
        TransferPlan,
    )
    from ._table import PointerTable
    from ._types import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
        CanonicalPageMapping,
        CopyRun,
        GPULoadStoreSpec,
    )
    from ._warmup import CompiledKernel, WarmupReport, warmup

__version__ = "0.1.0"

__all__ = [
    "BlockIdError",
    "CanonicalKVCacheRef",
    "CanonicalKVCacheTensor",
    "CanonicalKVCaches",
    "CanonicalPageMapping",
    "CompiledKernel",
    "CopyRun",
    "DevicePointerError",
    "DevicePointerGroupInfo",
    "DevicePointers",
    "FilePlan",
    "GPULoadStoreSpec",
    "HeadSlice",
    "InputTypeError",
    "LayoutError",
    "MemoryRegion",
    "OffloadedIdError",
    "OffloadedLayout",
    "OutBufferError",
    "PeerLayout",
    "PeerRef",
    "PeerTransferPlan",
    "PointerTable",
    "PtrresError",
    "PushMapping",
    "RemoteBlockIdError",
    "SpecError",
    "StridedTransferPlan",
    "TPMapping",
    "TransferPlan",
    "WarmupReport",
    "clear_table_cache",
    "coalesce",
    "iter_pointer_groups",
    "plan_file_ops",
    "push_mapping",
    "rank_heads",
    "read_files",
    "resolve_device_pointers",
    "tp_mapping",
    "uncached_suffix",
    "warmup",
    "write_files",
]

# Where each public name lives: `ptrres.X` imports its module on first use.
_MODULES: dict[str, tuple[str, ...]] = {
    "_coalesce": ("coalesce",),
    "_errors": (
        "BlockIdError",
        "DevicePointerError",
        "InputTypeError",
        "LayoutError",
        "OffloadedIdError",
        "OutBufferError",
        "PtrresError",
        "RemoteBlockIdError",
        "SpecError",
    ),
    "_files": ("plan_file_ops",),
    "_geometry": ("MemoryRegion",),
    "_heads": ("HeadSlice", "TPMapping", "rank_heads", "tp_mapping"),
    "_offloaded": ("OffloadedLayout",),
    "_peer": ("PeerLayout", "PeerRef"),
    "_pointer_utils": (
        "clear_table_cache",
        "iter_pointer_groups",
        "resolve_device_pointers",
    ),
    "_posix": ("read_files", "write_files"),
    "_push": ("PushMapping", "push_mapping", "uncached_suffix"),
    "_results": (
        "DevicePointerGroupInfo",
        "DevicePointers",
        "FilePlan",
        "PeerTransferPlan",
        "StridedTransferPlan",
        "TransferPlan",
    ),
    "_table": ("PointerTable",),
    "_types": (
        "CanonicalKVCacheRef",
        "CanonicalKVCaches",
        "CanonicalKVCacheTensor",
        "CanonicalPageMapping",
        "CopyRun",
        "GPULoadStoreSpec",
    ),
    "_warmup": ("CompiledKernel", "WarmupReport", "warmup"),
}
_MODULE_OF = {name: module for module, names in _MODULES.items() for name in names}


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use (then kept), or
    one of ptrres's modules (``ptrres._table``), as a full import gave."""
    module = _MODULE_OF.get(name)
    if module is not None:
        value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
        globals()[name] = value
        return value
    if (
        not name.startswith("__")
        and importlib.util.find_spec(f"{__name__}.{name}") is not None
    ):
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
