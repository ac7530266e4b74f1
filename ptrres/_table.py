"""PointerTable: a KV-cache layout flattened once, resolved many times."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from . import _kernels, _plan
from ._args import (
    PTRS_SIZES,
    SPEC_FIELDS,
    as_block_indices,
    as_group_sizes,
    block_ids_arg,
    missing_attributes,
    out_arrays,
)
from ._diagnose import overlap_error, resolve_error
from ._errors import InputTypeError
from ._geometry import RefRow, offloaded_rows, read_layout
from ._offloaded import OffloadedLayout
from ._results import DevicePointers, TransferPlan

Buffers = tuple[npt.NDArray[Any], ...]
_LIST_OR_TUPLE = (list, tuple)


class GroupCounts(NamedTuple):
    """A spec's groups, checked against a table (PointerTable._check_groups)."""

    # Copy ops: each group's size times its refs, summed.
    n_ops: int
    # Bytes they copy.
    num_bytes: int
    # The spec's group sizes and block indices, as tuples of Python ints.
    group_sizes: tuple[int, ...]
    block_indices: tuple[int, ...]


# GroupCounts(...) without the Python frame of its __new__: a fifth of a
# microsecond less on every resolve and plan.
_new_tuple = tuple.__new__


class PointerTable:
    """The tensors and refs of a CanonicalKVCaches, as parallel arrays.

    Building the table reads every tensor's data pointer and row stride once and
    checks the layout (tensor_idx in range, every page within its tensor's
    rows). The table holds plain integers, not the tensors: it must not outlive
    the tensors' memory, and a re-allocated tensor needs a new table. A table
    may be shared by threads: its methods only read it, but for the cache of
    the offloaded layout last planned with, which is read and replaced as one
    (layout, its ref table) tuple, so no thread pairs a layout with another's.

    Args:
        kv_caches: a CanonicalKVCaches, or any object with ``tensors`` (each with
            ``.tensor``) and ``group_data_refs`` (each ref with ``tensor_idx``
            and ``page_size_bytes``).
    """

    def __init__(self, kv_caches: Any) -> None:
        groups = read_layout(kv_caches)
        self._groups: tuple[tuple[RefRow, ...], ...] = tuple(map(tuple, groups))
        rows = [row for group in groups for row in group]
        # One row per (group, ref) in copy order; columns are _kernels.BASE_PTR...
        self.ref_table = np.array(rows, dtype=np.int64).reshape(
            len(rows), _kernels.REF_COLUMNS
        )
        # The refs of group g are rows group_ref_start[g]:group_ref_start[g + 1].
        self.group_ref_start = np.cumsum([0] + [len(g) for g in groups], dtype=np.int64)
        self.group_data_ref_counts: tuple[int, ...] = tuple(len(g) for g in groups)
        # Bytes one block of group g copies, over all its refs.
        self.group_page_bytes: tuple[int, ...] = tuple(
            sum(ref.page_size_bytes for ref in group) for group in groups
        )
        self.num_groups = len(groups)
        # The int64 arrays kernels take, by the tuples they hold: (group
        # sizes,) or (group sizes, block indices). See _group_sizes_array.
        self._group_arrays: dict[
            tuple[tuple[int, ...], ...], npt.NDArray[np.int64]
        ] = {}
        # The offloaded layout last planned with, and its per-ref table: one
        # tuple, read and assigned whole (atomic under the GIL), never in parts.
        self._offloaded: tuple[OffloadedLayout, npt.NDArray[np.int64]] | None = None

    def __repr__(self) -> str:
        return (
            f"PointerTable({self.num_groups} groups, "
            f"refs per group {self.group_data_ref_counts})"
        )

    def resolve(
        self, device_spec: Any, *, out: Buffers | None = None
    ) -> DevicePointers:
        """Resolve a spec's block ids to device pointers, checking every id.

        Args:
            device_spec: a GPULoadStoreSpec or any object with ``block_ids``,
                ``group_sizes`` and ``block_indices``.
            out: optional ``(ptrs, sizes)`` buffers, 1-D int64 or uint64, at
                least as long as the number of ops (numpy views of pinned
                torch tensors, say), apart from each other and from the ids.
                The result's arrays are then uint64 views of them, and nothing
                is allocated.

        Returns:
            DevicePointers with uint64 ``ptrs`` and ``sizes``, ordered group ->
            ref -> block.

        Raises:
            BlockIdError: a block id is outside its tensor (out's first
                entries are then zeroed).
            SpecError, InputTypeError, OutBufferError: malformed input.
        """
        try:
            raw_ids = device_spec.block_ids
            raw_sizes, raw_indices = device_spec.group_sizes, device_spec.block_indices
        except AttributeError:
            raise missing_attributes(device_spec, SPEC_FIELDS, "device_spec") from None
        block_ids = block_ids_arg(raw_ids)
        n_ops, _, group_sizes, block_indices = self._check_groups(
            raw_sizes, raw_indices, len(block_ids)
        )
        ptrs, sizes = out_arrays(out, n_ops, PTRS_SIZES)
        status = _kernels.resolve_kernel(
            self.ref_table,
            self.group_ref_start,
            block_ids,
            self._group_sizes_array(group_sizes),
            ptrs,
            sizes,
        )
        if status < 0:
            if status == _kernels.OVERLAPPING_BUFFERS:
                raise overlap_error("out[0] (ptrs), out[1] (sizes) and block_ids")
            ptrs[:] = 0
            sizes[:] = 0
            raise resolve_error(self._groups, block_ids, group_sizes)
        # Positional: keywords would cost a fifth of a microsecond.
        return DevicePointers(
            ptrs, sizes, group_sizes, self.group_data_ref_counts, block_indices
        )

    def plan_transfer(
        self,
        device_spec: Any,
        offloaded: OffloadedLayout,
        offloaded_ids: Any,
        *,
        store: bool,
        out: Buffers | None = None,
        coalesce: bool = False,
        max_run_bytes: int | None = None,
    ) -> TransferPlan:
        """Every copy descriptor of a store or a load, in one pass (SPEC 5).

        Descriptors are ordered as in resolve(): group -> ref -> block. Device
        block k of group g (ref d, tensor t) pairs with sub-block ``j % bpc``
        of chunk ``offloaded_ids_of_g[j // bpc]``, where ``j = skip(g) + k``.

        Args:
            device_spec: the device blocks, as for resolve().
            offloaded: the offloaded tensors, aligned with the device tensors.
            offloaded_ids: chunk ids, consumed group by group: each non-empty
                group takes the next n_chunks(g) ids.
            store: True for device -> offloaded (src is the device side),
                False for offloaded -> device.
            out: optional ``(src, dst, sizes)`` buffers, 1-D int64 or uint64,
                at least as long as the number of ops (before coalescing),
                apart from each other and from the ids. The plan's arrays are
                then uint64 views of them.
            coalesce: merge descriptors that continue each other on both sides
                in the same pass, as coalesce() does.
            max_run_bytes: the largest merged descriptor, when coalescing.

        Returns:
            A TransferPlan (src, dst, sizes, num_bytes).

        Raises:
            BlockIdError, OffloadedIdError: an id out of range, or the wrong
                number of offloaded ids (out's first entries are then zeroed).
            SpecError, LayoutError, InputTypeError, OutBufferError: malformed
                input.
        """
        try:
            raw_ids = device_spec.block_ids
            raw_sizes, raw_indices = device_spec.group_sizes, device_spec.block_indices
        except AttributeError:
            raise missing_attributes(device_spec, SPEC_FIELDS, "device_spec") from None
        block_ids = block_ids_arg(raw_ids)
        return _plan.run_plan(
            self,
            block_ids,
            self._check_groups(raw_sizes, raw_indices, len(block_ids)),
            offloaded,
            offloaded_ids,
            store=store,
            out=out,
            coalesce=coalesce,
            max_run_bytes=max_run_bytes,
        )

    def plan_from_device_pointers(
        self,
        device_ptrs: Any,
        offloaded: OffloadedLayout,
        offloaded_ids: Any,
        *,
        store: bool,
        out: Buffers | None = None,
        coalesce: bool = False,
        max_run_bytes: int | None = None,
    ) -> TransferPlan:
        """The plan of plan_transfer(), from already resolved device pointers.

        This is vLLM's two-step flow (resolve, then walk the groups with
        iter_pointer_groups) for callers that have resolved already. Every
        pointer is checked: it must be a block of its ref's tensor, the same
        block for every ref of its group, with the ref's page as its size.

        Args:
            device_ptrs: DevicePointers of this table's layout (any object with
                its fields).
            offloaded, offloaded_ids, store, out, coalesce, max_run_bytes: as
                for plan_transfer().

        Raises:
            DevicePointerError: a pointer that is not a block of its tensor.
            the errors of plan_transfer().
        """
        return _plan.plan_from_device_pointers(
            self,
            device_ptrs,
            offloaded,
            offloaded_ids,
            store=store,
            out=out,
            coalesce=coalesce,
            max_run_bytes=max_run_bytes,
        )

    def _offloaded_refs(self, offloaded: OffloadedLayout) -> npt.NDArray[np.int64]:
        """The offloaded tensor of each ref (OFF_* columns), checked and cached."""
        cached = self._offloaded
        if cached is not None and cached[0] is offloaded:
            return cached[1]
        if not isinstance(offloaded, OffloadedLayout):
            raise InputTypeError(
                f"offloaded must be an OffloadedLayout, got {type(offloaded).__name__}"
            )
        rows = offloaded_rows(
            [list(g) for g in self._groups], list(offloaded.geometries)
        )
        table = np.array(rows, dtype=np.int64).reshape(len(rows), _kernels.OFF_COLUMNS)
        self._offloaded = (offloaded, table)
        return table

    def _group_sizes_array(self, group_sizes: tuple[int, ...]) -> npt.NDArray[np.int64]:
        """Checked group sizes as the 1-D int64 array a kernel takes, memoised.

        Transfers repeat their group sizes (one block per step, say), and
        building a small array costs a third of a microsecond. Kernels never
        write these arrays, so threads may share them.
        """
        key = (group_sizes,)
        array = self._group_arrays.get(key)
        if array is None:
            array = np.array(group_sizes, dtype=np.int64)
            self._memoise(key, array)
        return array

    def _groups_array(
        self, group_sizes: tuple[int, ...], block_indices: tuple[int, ...]
    ) -> npt.NDArray[np.int64]:
        """The (2, n_groups) int64 array of group sizes, then block indices,
        that plan_kernel takes; memoised as _group_sizes_array."""
        key = (group_sizes, block_indices)
        array = self._group_arrays.get(key)
        if array is None:
            array = np.array(key, dtype=np.int64)
            self._memoise(key, array)
        return array

    def _memoise(
        self, key: tuple[tuple[int, ...], ...], array: npt.NDArray[np.int64]
    ) -> None:
        """Keep a group array, and at most 256 of them."""
        if len(self._group_arrays) >= 256:
            self._group_arrays.clear()
        self._group_arrays[key] = array

    def _check_groups(
        self, group_sizes: Any, block_indices: Any, n_block_ids: int
    ) -> GroupCounts:
        """Check a spec's group sizes and block indices against the layout.

        The common case (lists or tuples of Python ints, as vLLM passes) is
        checked in a plain loop; anything else goes through the thorough
        checks, which also produce the error messages. (A set or a dict would
        pass the loop, in no meaningful order: the thorough checks refuse it.)
        """
        if (
            type(group_sizes) in _LIST_OR_TUPLE
            and type(block_indices) in _LIST_OR_TUPLE
            and len(group_sizes) == len(block_indices) == self.num_groups
        ):
            n_ops = n_ids = num_bytes = 0
            for size, refs, page_bytes, index in zip(
                group_sizes,
                self.group_data_ref_counts,
                self.group_page_bytes,
                block_indices,
            ):
                if type(size) is not int or type(index) is not int:
                    break
                if size < 0 or index >> 63:  # index < 0 or >= 2**63
                    break
                n_ids += size
                n_ops += size * refs
                num_bytes += size * page_bytes
            else:
                if n_ids == n_block_ids:
                    counts = (
                        n_ops,
                        num_bytes,
                        tuple(group_sizes),
                        tuple(block_indices),
                    )
                    result: GroupCounts = _new_tuple(GroupCounts, counts)
                    return result
        sizes = tuple(
            as_group_sizes(group_sizes, self.num_groups, n_block_ids).tolist()
        )
        indices = as_block_indices(block_indices, self.num_groups)
        n_ops = sum(n * r for n, r in zip(sizes, self.group_data_ref_counts))
        num_bytes = sum(n * b for n, b in zip(sizes, self.group_page_bytes))
        return GroupCounts(n_ops, num_bytes, sizes, indices)
