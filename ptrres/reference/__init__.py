"""Plain-numpy reference: what ptrres computes, written for clarity (a package
being split by capability; its modules are private)."""

from ._input import (
    coalesce,
    iter_pointer_groups,
    plan_canonical_transfer,
    plan_file_ops,
    plan_strided_transfer,
    plan_transfer,
    resolve_device_pointers,
)

__all__ = [
    "coalesce",
    "iter_pointer_groups",
    "plan_canonical_transfer",
    "plan_file_ops",
    "plan_strided_transfer",
    "plan_transfer",
    "resolve_device_pointers",
]
