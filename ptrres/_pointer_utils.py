"""Drop-ins for vllm.v1.kv_offload.pointer_utils, with the same signatures."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from ._args import GROUP_FIELDS, as_int, as_list, attributes
from ._errors import SpecError
from ._geometry import num_chunks
from ._results import DevicePointerGroupInfo, DevicePointers
from ._table import PointerTable

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


def iter_pointer_groups(
    device_ptrs: Any, blocks_per_chunk: int
) -> Iterator[DevicePointerGroupInfo]:
    """Iterate non-empty groups with pre-computed chunk/skip metadata.

    A drop-in for vLLM's function of the same name. ``blocks_per_chunk`` is the
    number of device blocks in one offloaded chunk (>= 1).
    """
    blocks_per_chunk = as_int(blocks_per_chunk, "blocks_per_chunk")
    if blocks_per_chunk < 1:
        raise SpecError(f"blocks_per_chunk must be >= 1, got {blocks_per_chunk}")
    group_block_counts, group_data_ref_counts, block_indices = (
        tuple(as_list(values, name))
        for values, name in zip(
            attributes(device_ptrs, GROUP_FIELDS, "device_ptrs"), GROUP_FIELDS
        )
    )
    if not len(group_block_counts) == len(group_data_ref_counts) == len(block_indices):
        raise SpecError(
            "group_block_counts, group_data_ref_counts and block_indices have "
            f"{len(group_block_counts)}, {len(group_data_ref_counts)} and "
            f"{len(block_indices)} entries; they need one per group"
        )
    return _pointer_groups(
        group_block_counts, group_data_ref_counts, block_indices, blocks_per_chunk
    )


def _pointer_groups(
    group_block_counts: tuple[Any, ...],
    group_data_ref_counts: tuple[Any, ...],
    block_indices: tuple[Any, ...],
    blocks_per_chunk: int,
) -> Iterator[DevicePointerGroupInfo]:
    dev_ptr_offset = 0
    for group_idx, (group_size, n_data_refs, block_index) in enumerate(
        zip(group_block_counts, group_data_ref_counts, block_indices)
    ):
        group_size = as_int(group_size, f"group {group_idx}: group size")
        n_data_refs = as_int(n_data_refs, f"group {group_idx}: n_data_refs")
        block_index = as_int(block_index, f"group {group_idx}: block index")
        if group_size < 0 or n_data_refs < 0 or block_index < 0:
            raise SpecError(
                f"group {group_idx}: group size {group_size}, n_data_refs "
                f"{n_data_refs} and block index {block_index} must be >= 0"
            )
        if group_size == 0:
            continue
        yield DevicePointerGroupInfo(
            group_idx=group_idx,
            group_size=group_size,
            n_data_refs=n_data_refs,
            skip=block_index % blocks_per_chunk,
            n_chunks=num_chunks(group_size, block_index, blocks_per_chunk),
            dev_ptr_offset=dev_ptr_offset,
        )
        dev_ptr_offset += group_size * n_data_refs
