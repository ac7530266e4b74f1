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
from ._files import plan_file_ops
from ._offloaded import OffloadedLayout
from ._pointer_utils import (
    clear_table_cache,
    iter_pointer_groups,
    resolve_device_pointers,
)
from ._posix import read_files, write_files
from ._results import (
    DevicePointerGroupInfo,
    DevicePointers,
    FilePlan,
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
    "InputTypeError",
    "LayoutError",
    "OffloadedIdError",
    "OffloadedLayout",
    "OutBufferError",
    "PointerTable",
    "PtrresError",
    "SpecError",
    "StridedTransferPlan",
    "TransferPlan",
    "WarmupReport",
    "clear_table_cache",
    "coalesce",
    "iter_pointer_groups",
    "plan_file_ops",
    "read_files",
    "resolve_device_pointers",
    "warmup",
    "write_files",
]
