"""Drop-ins for vllm.v1.kv_offload.pointer_utils, with the same signatures.

resolve_device_pointers builds on PointerTable, keeping the tables of the last
few layouts; iter_pointer_groups (from _groups, where the file tier uses it
too) needs no table.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

from ._groups import iter_pointer_groups
from ._results import DevicePointers
from ._table import PointerTable

__all__ = [
    "clear_table_cache",
    "iter_pointer_groups",
    "resolve_device_pointers",
    "table_for",
]

# Tables built by resolve_device_pointers, keyed by id(kv_caches). An entry is
# (reference to kv_caches, its tensors list, its group_data_refs list, table).
# The reference is weak where the object allows it, so that a cached table
# never keeps a KV cache alive; it is checked on every hit, so a table is never
# used for another object that happens to get the same id.
_MAX_CACHED_TABLES = 8
_tables: dict[int, tuple[Any, Any, Any, PointerTable]] = {}
_tables_lock = threading.Lock()


def _strong_ref(obj: Any) -> Callable[[], Any]:
    """A stand-in for weakref.ref for objects that cannot be weakly referenced."""

    def ref() -> Any:
        return obj

    return ref


def table_for(kv_caches: Any) -> PointerTable:
    """The PointerTable of ``kv_caches``, built on first use and reused after."""
    entry = _tables.get(id(kv_caches))
    if (
        entry is not None
        and entry[0]() is kv_caches
        and entry[1] is kv_caches.tensors
        and entry[2] is kv_caches.group_data_refs
    ):
        return entry[3]
    table = PointerTable(kv_caches)
    key = id(kv_caches)
    try:
        owner: Callable[[], Any] = weakref.ref(kv_caches, lambda _: _forget(key))
    except TypeError:  # not weak-referenceable (a namedtuple, say)
        owner = _strong_ref(kv_caches)
    with _tables_lock:
        _tables.pop(key, None)
        while len(_tables) >= _MAX_CACHED_TABLES:
            del _tables[next(iter(_tables))]
        _tables[key] = (owner, kv_caches.tensors, kv_caches.group_data_refs, table)
    return table


def _forget(key: int) -> None:
    with _tables_lock:
        _tables.pop(key, None)


def clear_table_cache() -> None:
    """Drop every PointerTable that resolve_device_pointers has cached."""
    with _tables_lock:
        _tables.clear()


def resolve_device_pointers(device_spec: Any, kv_caches: Any) -> DevicePointers:
    """Convert logical block ids to device pointers, checking every id.

    A drop-in for vLLM's function of the same name: same arguments, same
    result, but every block id is checked against its tensor.

    The PointerTable of ``kv_caches`` is built on the first call and reused
    while the same object is passed again with the same ``tensors`` and
    ``group_data_refs`` lists (compared by identity). It is rebuilt when another
    object is passed or either attribute is rebound. Changes made in place (a
    list mutated, a tensor's storage re-allocated) are not seen: pass a new
    CanonicalKVCaches, or call ``clear_table_cache()``. The last eight
    layouts are kept; a cached table never keeps its KV cache alive when the
    object can be weakly referenced.

    Like vLLM's, it allocates fresh outputs on every call. For large
    transfers, ``PointerTable(kv_caches).resolve(spec, out=(ptrs, sizes))``
    into reused (pinned) buffers is several times faster: at 256K ops, most
    of this function's time is the first touch of newly allocated memory.

    Args:
        device_spec: a GPULoadStoreSpec or any object with ``block_ids``,
            ``group_sizes`` and ``block_indices``.
        kv_caches: a CanonicalKVCaches or any object with its attributes.

    Returns:
        DevicePointers with uint64 ptrs and sizes, ordered group -> ref -> block.
    """
    return table_for(kv_caches).resolve(device_spec)
