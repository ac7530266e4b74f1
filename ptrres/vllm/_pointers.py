"""vLLM's ``pointer_utils`` (0.34 and later) as ptrres's, and what the
offloading connector's jobs get of it.

vLLM 0.34 resolves each offloading job's GPU blocks with
``pointer_utils.resolve_device_pointers`` (in the connector's worker,
``kv_connector/v1/offloading/worker.py``), then hands the ``DevicePointers``
to its offloading worker (the CPU handler, or a file worker), which walks
them with ``iter_pointer_groups``. Patched:

- ``pointer_utils.resolve_device_pointers`` and ``iter_pointer_groups`` are
  ptrres's (``resolve_device_pointers``, ``iter_pointer_groups`` here): the
  same results, of vLLM's own types, every id checked; a bad one raises, as
  ptrres's drop-in always has.
- The connector's own binding resolves a job (``job_resolver``), and
  nothing raises inside the engine step. A spec ptrres refuses gives a
  RefusedDevicePointers, whose every field raises the error that refused
  it; any other a DeferredDevicePointers, whose ``ptrs`` and ``sizes`` are
  resolved (and their ids checked) only when first read. ptrres's handler
  and file worker see a refusal first (``refusal()``), and plan a deferred
  job from its ids, checking each: a bad one fails that job the way vLLM
  fails a job whose copy failed, and the arrays are never made (one compiled
  pass from ids to buffers, where vLLM makes two numpy passes per ref). Any
  other worker gets the arrays when it reads them, or the error of a bad
  id. Never a pointer outside a tensor, and never a job that reports
  success with nothing copied.
- DevicePointers that ptrres resolved carry what they came from
  (``resolved_with()``: the table, the spec, its ids and groups as read and
  checked); any other DevicePointers (or one rebuilt, with
  ``dataclasses.replace``) is planned from its pointers, each checked where
  a table is known.

Importing this module imports neither vLLM nor numba: ptrres's resolver
(and its kernels) on the first call; vLLM's types from the module that
defines them, which vLLM has imported by then.
"""

from __future__ import annotations

import importlib
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

from .._errors import PtrresError
from ._state import reporter

if TYPE_CHECKING:
    import numpy.typing as npt

    from .._groups import GroupCounts
    from .._table import PointerTable

# Where vLLM 0.34 defines DevicePointers and DevicePointerGroupInfo.
BASE_MODULE = "vllm.v1.kv_offload.base"
# The attribute that ties a DevicePointers to what ptrres resolved it from:
# a Resolved.
_RESOLVED_BY = "_ptrres_resolved_by"


class Resolved(NamedTuple):
    """What ptrres resolved a DevicePointers from: its table, the spec, and
    the spec's block ids and groups as the table read and checked them."""

    table: PointerTable
    spec: Any
    block_ids: npt.NDArray[Any]
    counts: GroupCounts


class _VllmTypes:
    """vLLM's DevicePointers and DevicePointerGroupInfo, and the refusal
    subclass of the former, made once vLLM has defined them."""

    def __init__(self) -> None:
        base = importlib.import_module(BASE_MODULE)
        self.device_pointers: Any = base.DevicePointers
        self.group_info: Any = base.DevicePointerGroupInfo
        self.refused: Any = _refused_type(self.device_pointers)
        self.deferred: Any = _deferred_type(self.device_pointers)


_types: _VllmTypes | None = None
_types_lock = threading.Lock()


def vllm_types() -> _VllmTypes:
    """vLLM's types (read on first use, then kept)."""
    global _types
    if _types is None:
        with _types_lock:
            if _types is None:
                _types = _VllmTypes()
    return _types


def _refused_type(device_pointers: type) -> type:
    """A subclass of vLLM's DevicePointers whose fields raise its error."""

    def refused_field(name: str) -> property:
        def read(self: Any) -> Any:
            raise self.error

        read.__name__ = name
        return property(read, doc=f"Raises the error that refused the job ({name}).")

    def __init__(self: Any, error: BaseException) -> None:
        self.error = error

    def __repr__(self: Any) -> str:
        return f"RefusedDevicePointers({self.error})"

    fields = ("ptrs", "sizes", "group_block_counts", "group_data_ref_counts")
    namespace: dict[str, Any] = {
        "__doc__": (
            "The DevicePointers of a job whose blocks ptrres refused: every "
            "field raises the error (a ptrres ValueError naming the group, "
            "position and value), so that no worker copies anything for it."
        ),
        "__init__": __init__,
        "__repr__": __repr__,
        "__eq__": object.__eq__,
        "__hash__": object.__hash__,
        **{name: refused_field(name) for name in (*fields, "block_indices")},
    }
    return type("RefusedDevicePointers", (device_pointers,), namespace)


def _deferred_type(device_pointers: type) -> type:
    """A subclass of vLLM's DevicePointers whose ptrs and sizes are resolved
    when first read (then kept): a job ptrres's handler or file worker plans
    from its checked ids never needs them.

    Built from a Resolved (``deferred(resolved)``); built with the fields
    (``dataclasses.replace`` does), it is a plain DevicePointers of them.
    """

    def array(index: int, name: str) -> property:
        def read(self: Any) -> Any:
            arrays = self.__dict__.get("_ptrres_arrays")
            if arrays is None:
                resolved: Resolved = self.__dict__[_RESOLVED_BY]
                pointers = resolved.table._resolve(
                    resolved.block_ids, resolved.counts, None
                )
                arrays = self.__dict__["_ptrres_arrays"] = [
                    pointers.ptrs,
                    pointers.sizes,
                ]
            return arrays[index]

        def write(self: Any, value: Any) -> None:
            arrays = self.__dict__.setdefault("_ptrres_arrays", [None, None])
            arrays[index] = value

        read.__name__ = write.__name__ = name
        return property(
            read, write, doc=f"{name}, resolved when first read (a bad id raises)"
        )

    def deferred(cls: Any, resolved: Resolved) -> Any:
        pointers = cls.__new__(cls)
        state = pointers.__dict__
        state[_RESOLVED_BY] = resolved
        state["group_block_counts"] = resolved.counts.group_sizes
        state["group_data_ref_counts"] = resolved.table.group_data_ref_counts
        state["block_indices"] = resolved.counts.block_indices
        return pointers

    def __repr__(self: Any) -> str:
        """A job's pointers said without resolving them (a bad id would
        raise from repr, in a log line)."""
        arrays = self.__dict__.get("_ptrres_arrays")
        shown = "not resolved yet" if arrays is None else f"{len(arrays[0])} ptrs"
        return (
            f"DeferredDevicePointers({shown}, group_block_counts="
            f"{self.group_block_counts}, group_data_ref_counts="
            f"{self.group_data_ref_counts}, block_indices={self.block_indices})"
        )

    namespace: dict[str, Any] = {
        "__doc__": _deferred_type.__doc__,
        "__repr__": __repr__,
        "ptrs": array(0, "ptrs"),
        "sizes": array(1, "sizes"),
        "deferred": classmethod(deferred),
    }
    return type("DeferredDevicePointers", (device_pointers,), namespace)


def refusal(device_ptrs: Any) -> BaseException | None:
    """The error that refused a job's blocks, or None for usable pointers."""
    types = _types
    if types is not None and type(device_ptrs) is types.refused:
        error: BaseException = getattr(device_ptrs, "error")  # noqa: B009
        return error
    return None


def resolved_with(device_ptrs: Any, table: PointerTable) -> Resolved | None:
    """What ``table`` resolved ``device_ptrs`` from, or None where ptrres did
    not resolve them with that table (they were built elsewhere, or rebuilt:
    ``dataclasses.replace`` gives an object without it)."""
    resolved: Resolved | None = getattr(device_ptrs, _RESOLVED_BY, None)
    if resolved is not None and resolved.table is table:
        return resolved
    return None


def resolved_by(device_ptrs: Any, table: PointerTable) -> Any:
    """The spec ``table`` resolved ``device_ptrs`` from, or None (as
    resolved_with)."""
    resolved = resolved_with(device_ptrs, table)
    return None if resolved is None else resolved.spec


def resolved_table(device_ptrs: Any) -> PointerTable | None:
    """The table ptrres resolved ``device_ptrs`` with, if it did."""
    resolved: Resolved | None = getattr(device_ptrs, _RESOLVED_BY, None)
    return None if resolved is None else resolved.table


# ptrres's table cache (ptrres._pointer_utils.table_for), imported on the
# first job (with the kernels, and numba): an import statement costs a
# microsecond on every job.
_table_for: Callable[[Any], PointerTable] | None = None


def _import_table_for() -> Callable[[Any], PointerTable]:
    global _table_for
    from .._pointer_utils import table_for

    _table_for = table_for
    return table_for


def resolve_device_pointers(device_spec: Any, kv_caches: Any) -> Any:
    """vLLM's ``resolve_device_pointers``, ptrres's: every id checked.

    Returns vLLM's own DevicePointers, with the arrays and tuples ptrres's
    resolver gives (uint64 ptrs and sizes, ordered group -> ref -> block).

    Raises:
        BlockIdError, SpecError, InputTypeError: as ptrres.resolve_device_pointers.
    """
    table = (_table_for or _import_table_for())(kv_caches)
    return _vllm_pointers(table, device_spec)


def _vllm_pointers(table: PointerTable, device_spec: Any) -> Any:
    """``table.resolve(device_spec)`` as vLLM's DevicePointers, which carry
    what they were resolved from (a Resolved)."""
    block_ids, counts = table._read_spec(device_spec)
    resolved = table._resolve(block_ids, counts, None)
    result = (_types or vllm_types()).device_pointers(
        resolved.ptrs,
        resolved.sizes,
        resolved.group_block_counts,
        resolved.group_data_ref_counts,
        resolved.block_indices,
    )
    setattr(result, _RESOLVED_BY, Resolved(table, device_spec, block_ids, counts))
    return result


def iter_pointer_groups(device_ptrs: Any, blocks_per_chunk: int) -> Iterator[Any]:
    """vLLM's ``iter_pointer_groups``, ptrres's: the same groups, as vLLM's
    own DevicePointerGroupInfo."""
    from .._groups import iter_pointer_groups as ptrres_groups

    make = vllm_types().group_info._make
    for info in ptrres_groups(device_ptrs, blocks_per_chunk):
        yield make(info)


# The layouts (by id) whose table ptrres could not build: their jobs are
# resolved by vLLM's own code, said once. Each entry holds a weak reference
# (or the object, where it takes none), checked on every hit.
_declined: dict[int, Callable[[], Any]] = {}
_declined_lock = threading.Lock()


def job_resolver(vllm_resolve: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """The offloading connector's ``resolve_device_pointers``: nothing
    raises in the engine step. A spec ptrres refuses gives a
    RefusedDevicePointers (every field raises the error); any other gives a
    DeferredDevicePointers, whose ptrs and sizes are resolved when first
    read: ptrres's handler and file worker plan from its ids, checking every
    one (a bad one fails the job), and never read them; another worker
    reading them gets the arrays, or the error of a bad id. A layout ptrres
    cannot build a table for (it refuses pages that do not fit their rows)
    keeps vLLM's own resolver, with a warning."""

    def resolve_device_pointers(device_spec: Any, kv_caches: Any) -> Any:
        if _declined:
            declined = _declined.get(id(kv_caches))
            if declined is not None and declined() is kv_caches:
                return vllm_resolve(device_spec, kv_caches)
        try:
            table = (_table_for or _import_table_for())(kv_caches)
        except PtrresError as error:
            _decline(kv_caches, error)
            return vllm_resolve(device_spec, kv_caches)
        try:
            block_ids, counts = table._read_spec(device_spec)
        except PtrresError as error:
            return vllm_types().refused(error)
        return vllm_types().deferred.deferred(
            Resolved(table, device_spec, block_ids, counts)
        )

    resolve_device_pointers.__doc__ = job_resolver.__doc__
    resolve_device_pointers.__wrapped__ = vllm_resolve  # type: ignore[attr-defined]
    return resolve_device_pointers


def _decline(kv_caches: Any, error: BaseException) -> None:
    key = id(kv_caches)
    try:
        owner: Callable[[], Any] = weakref.ref(kv_caches, lambda _: _forget(key))
    except TypeError:  # not weak-referenceable

        def owner() -> Any:
            return kv_caches

    with _declined_lock:
        _declined[key] = owner
    reporter().warning(
        "ptrres: these KV caches keep vLLM's own (unchecked) pointer resolution: %s",
        error,
    )


def _forget(key: int) -> None:
    with _declined_lock:
        _declined.pop(key, None)
