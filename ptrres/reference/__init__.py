"""Plain-numpy reference: what ptrres computes, written for clarity.

This package is the oracle of the test suite and the baseline of the
benchmarks. It follows vLLM's numpy resolver in shape (one vectorised
expression per group and ref), adds the checks of SPEC section 7, and reads
every tensor's geometry on every call, as vLLM does.

It shares nothing with the compiled path but the error classes and the result
types: it reads each tensor itself (data pointer, ``stride(0) *
element_size()``, rows) and checks its input in its own plain code, so that a
geometry or validation bug of the compiled path shows as a difference. Its
error messages are worded as the compiled path's (the tests check that they
agree).

One module per capability, each importing nothing of ptrres but its errors
and result types: _resolve (resolve_device_pointers, iter_pointer_groups),
_plans (plan_transfer), _coalesce, _files (plan_file_ops), _canonical
(plan_canonical_transfer, plan_strided_transfer), _peer (plan_peer_transfer
and prepped_indices: peer transfers, NIXL's prepared-list indices), _heads
(tp_mapping: different TP on the two sides, head by head), _push
(push_mapping, uncached_suffix: the writing side of different TP, head by
head), _execute
(execute, execute_descriptors: a plan applied to host memory, one memmove per
descriptor, in order) and _input, the input checks they share.
"""

from ._canonical import plan_canonical_transfer, plan_strided_transfer
from ._coalesce import coalesce
from ._execute import execute, execute_descriptors
from ._files import plan_file_ops
from ._heads import tp_mapping
from ._peer import plan_peer_transfer, prepped_indices
from ._plans import plan_transfer
from ._push import push_mapping, uncached_suffix
from ._resolve import iter_pointer_groups, resolve_device_pointers

__all__ = [
    "coalesce",
    "execute",
    "execute_descriptors",
    "iter_pointer_groups",
    "plan_canonical_transfer",
    "plan_file_ops",
    "plan_peer_transfer",
    "plan_strided_transfer",
    "plan_transfer",
    "prepped_indices",
    "push_mapping",
    "resolve_device_pointers",
    "tp_mapping",
    "uncached_suffix",
]
