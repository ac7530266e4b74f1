"""ptrres: KV-cache block ids to memory pointers and copy descriptors, compiled.

A checked, compiled drop-in for ``vllm.v1.kv_offload.pointer_utils``.
"""

from ._coalesce import coalesce
from ._errors import (
    BlockIdError,
    DevicePointerError,
    InputTypeError,
    LayoutError,
    OffloadedIdError,
    OutBufferError,
    PtrresError,
    SpecError,
)
from ._offloaded import OffloadedLayout
from ._pointer_utils import (
    clear_table_cache,
    iter_pointer_groups,
    resolve_device_pointers,
)
from ._results import DevicePointerGroupInfo, DevicePointers, TransferPlan
from ._table import PointerTable
from ._types import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
)
from ._warmup import CompiledKernel, WarmupReport, warmup

__version__ = "0.1.0"

__all__ = [
    "BlockIdError",
    "CanonicalKVCacheRef",
    "CanonicalKVCacheTensor",
    "CanonicalKVCaches",
    "CompiledKernel",
    "DevicePointerError",
    "DevicePointerGroupInfo",
    "DevicePointers",
    "GPULoadStoreSpec",
    "InputTypeError",
    "LayoutError",
    "OffloadedIdError",
    "OffloadedLayout",
    "OutBufferError",
    "PointerTable",
    "PtrresError",
    "SpecError",
    "TransferPlan",
    "WarmupReport",
    "clear_table_cache",
    "coalesce",
    "iter_pointer_groups",
    "resolve_device_pointers",
    "warmup",
]
