"""PointerTable: a KV-cache layout flattened once, resolved many times."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from . import _canonical, _kernels
from ._errors import (
    BlockIdError,
    DevicePointerError,
    InputTypeError,
    OffloadedIdError,
    SpecError,
)
from ._layout import (
    DEVICE_POINTERS_FIELDS,
    ID_DTYPES,
    PTRS_SIZES,
    SPEC_FIELDS,
    SRC_DST_SIZES,
    RefRow,
    as_block_ids,
    as_block_indices,
    as_group_sizes,
    as_int,
    as_list,
    attributes,
    block_id_error,
    descriptor_array,
    missing_attributes,
    num_chunks,
    offloaded_rows,
    out_arrays,
    overlap_error,
    read_layout,
)
from ._layout import (
    INT64 as _INT64,
)
from ._offloaded import OffloadedLayout
from ._types import DevicePointers, StridedTransferPlan, TransferPlan

Buffers = tuple[npt.NDArray[Any], ...]
_LIST_OR_TUPLE = (list, tuple)


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
        # Arrays of group sizes (and block indices) by their tuples.
        self._group_arrays: dict[
            tuple[tuple[int, ...], ...], npt.NDArray[np.int64]
        ] = {}
        # The offloaded layout last planned with, and its per-ref table: one
        # tuple, read and assigned whole (atomic under the GIL), never in parts.
        self._offloaded: tuple[OffloadedLayout, npt.NDArray[np.int64]] | None = None
        # The refs' mappings (SPEC 10), and the kernel tables of the layout
        # last planned with canonically or strided (read and assigned whole).
        self._ref_mappings = _canonical.read_ref_mappings(kv_caches)
        self._canonical: _canonical.PlanTables | None = None

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
        block_ids = _block_ids(raw_ids)
        n_ops, _, group_sizes, block_indices = self._check_groups(
            raw_sizes, raw_indices, len(block_ids)
        )
        ptrs, sizes = out_arrays(out, n_ops, PTRS_SIZES)
        status = _kernels.resolve_kernel(
            self.ref_table,
            self.group_ref_start,
            block_ids,
            self._group_array(group_sizes),
            ptrs,
            sizes,
        )
        if status < 0:
            if status == _kernels.OVERLAPPING_BUFFERS:
                raise overlap_error("out[0] (ptrs), out[1] (sizes) and block_ids")
            ptrs[:] = 0
            sizes[:] = 0
            bad = self._bad_block_id(block_ids, group_sizes)
            assert bad is not None, "the kernel reported an id that is in range"
            raise self._block_id_error(bad)
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

        With a canonical layout (SPEC 10), each kept block adds one descriptor
        per fragment of its ref's mapping, ordered group -> ref -> kept block
        -> fragment: exactly vLLM 0.33's ``_fill_canonical_ops``. Stores keep
        only the blocks whose canonical page id (chunk * bpc + sub-block) is
        this rank's; loads keep every block.

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
                then uint64 views of them. With a canonical layout, ops are
                fragments: each block of a group makes as many as its refs'
                runs hold, and out= must hold that many for every block, as
                vLLM sizes its buffers (an upper bound: stores then drop the
                blocks other ranks write).
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
        block_ids = _block_ids(raw_ids)
        n_ops, num_bytes, group_sizes, block_indices = self._check_groups(
            raw_sizes, raw_indices, len(block_ids)
        )
        return self._plan(
            block_ids,
            group_sizes,
            block_indices,
            n_ops,
            num_bytes,
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
        raw_ptrs, raw_sizes, raw_counts, raw_ref_counts, raw_indices = attributes(
            device_ptrs, DEVICE_POINTERS_FIELDS, "device_ptrs"
        )
        ref_counts = tuple(
            as_int(n, "group_data_ref_counts[{}]", g)
            for g, n in enumerate(as_list(raw_ref_counts, "group_data_ref_counts"))
        )
        if ref_counts != self.group_data_ref_counts:
            raise SpecError(
                f"device_ptrs has refs per group {ref_counts}, but this table has "
                f"{self.group_data_ref_counts}"
            )
        group_sizes_in = tuple(as_list(raw_counts, "group_block_counts"))
        n_block_ids = sum(
            as_int(n, "group_block_counts[{}]", g) for g, n in enumerate(group_sizes_in)
        )
        n_ops, num_bytes, group_sizes, block_indices = self._check_groups(
            group_sizes_in, tuple(as_list(raw_indices, "block_indices")), n_block_ids
        )
        ptrs = descriptor_array(raw_ptrs, "device_ptrs.ptrs")
        sizes = descriptor_array(raw_sizes, "device_ptrs.sizes")
        if not len(ptrs) == len(sizes) == n_ops:
            raise SpecError(
                f"device_ptrs has {len(ptrs)} ptrs and {len(sizes)} sizes, but its "
                f"groups make {n_ops} ops"
            )
        # A group without refs has no pointers to bound its size, only its
        # share of the offloaded ids: a size they cannot cover fails here,
        # before an id is allocated for each of its blocks.
        self._offloaded_refs(offloaded)  # an OffloadedLayout that fits
        chunk_ids = _block_ids(offloaded_ids, "offloaded_ids")
        unbounded = sum(n for n, r in zip(group_sizes, ref_counts) if not r)
        if unbounded > len(chunk_ids) * offloaded.blocks_per_chunk:
            count_error = _chunk_count_error(
                chunk_ids, group_sizes, block_indices, offloaded.blocks_per_chunk
            )
            if count_error is not None:  # always: they span more chunks
                raise count_error
        block_ids = np.empty(n_block_ids, np.int64)
        group_size_array = self._group_array(group_sizes)
        bad_op = _kernels.block_ids_from_pointers(
            self.ref_table,
            self.group_ref_start,
            group_size_array,
            ptrs,
            sizes,
            block_ids,
        )
        if bad_op >= 0:
            raise self._pointer_error(int(bad_op), ptrs, group_sizes)
        return self._plan(
            block_ids,
            group_sizes,
            block_indices,
            n_ops,
            num_bytes,
            offloaded,
            chunk_ids,
            store=store,
            out=out,
            coalesce=coalesce,
            max_run_bytes=max_run_bytes,
        )

    def plan_strided_transfer(
        self,
        device_spec: Any,
        offloaded: OffloadedLayout,
        offloaded_ids: Any,
        *,
        store: bool,
        out: Buffers | None = None,
    ) -> StridedTransferPlan:
        """2-D copy descriptors of a store or a load (SPEC 10).

        One descriptor per (kept block, ref, run), ordered as plan_transfer()'s
        fragments: ``height`` rows of ``width`` bytes (num_fragments rows of
        fragment_size bytes), rows ``src_pitch`` and ``dst_pitch`` apart
        (local_stride and canonical_stride, swapped on a load). Expanded row
        by row (``expand()``) it is exactly plan_transfer()'s plan. A direct
        layout gives one single-row descriptor per (block, ref). Runs with no
        fragments give no descriptor.

        Args:
            device_spec, offloaded, offloaded_ids, store: as for
                plan_transfer().
            out: optional ``(src, dst, width, height, src_pitch, dst_pitch)``
                buffers, 1-D int64 or uint64, at least (blocks x runs of
                their group's refs) long: the count before stores drop the
                blocks other ranks write.

        Raises:
            the errors of plan_transfer().
        """
        return _canonical.plan_strided(
            self, device_spec, offloaded, offloaded_ids, store, out
        )

    def _plan(
        self,
        block_ids: npt.NDArray[Any],
        group_sizes: tuple[int, ...],
        block_indices: tuple[int, ...],
        n_ops: int,
        num_bytes: int,
        offloaded: OffloadedLayout,
        offloaded_ids: Any,
        *,
        store: bool,
        out: Buffers | None,
        coalesce: bool,
        max_run_bytes: int | None,
    ) -> TransferPlan:
        """Check the offloaded side and run the plan kernel."""
        if type(store) is not bool:
            raise InputTypeError(f"store must be True or False, got {store!r}")
        if type(coalesce) is not bool:
            raise InputTypeError(f"coalesce must be True or False, got {coalesce!r}")
        max_run = max_run_arg(max_run_bytes)
        if isinstance(offloaded, OffloadedLayout) and offloaded.canonical:
            return _canonical.plan(
                self, block_ids, group_sizes, block_indices, offloaded,
                offloaded_ids, store, out, coalesce, max_run,
            )  # fmt: skip
        cached = self._offloaded
        if cached is not None and cached[0] is offloaded:
            offloaded_refs = cached[1]
        else:
            offloaded_refs = self._offloaded_refs(offloaded)
        if block_ids.dtype is not _INT64:
            block_ids = block_ids.astype(np.int64)
        chunk_ids = _block_ids(offloaded_ids, "offloaded_ids")
        if chunk_ids.dtype is not _INT64:
            chunk_ids = chunk_ids.astype(np.int64)
        src, dst, sizes = out_arrays(out, n_ops, SRC_DST_SIZES)
        written = _kernels.plan_kernel(
            self.ref_table,
            self.group_ref_start,
            offloaded_refs,
            block_ids,
            self._group_array(group_sizes, block_indices),
            chunk_ids,
            offloaded.blocks_per_chunk,
            store,
            coalesce,
            max_run,
            src,
            dst,
            sizes,
        )
        if written < 0:
            if written == _kernels.OVERLAPPING_BUFFERS:
                raise overlap_error("out's src, dst and sizes, and the ids")
            src[:] = 0
            dst[:] = 0
            sizes[:] = 0
            raise self._plan_error(
                block_ids, group_sizes, block_indices, chunk_ids, offloaded
            )
        if written < n_ops:
            src, dst, sizes = src[:written], dst[:written], sizes[:written]
        return TransferPlan(src, dst, sizes, num_bytes)

    def _offloaded_refs(self, offloaded: OffloadedLayout) -> npt.NDArray[np.int64]:
        """The offloaded tensor of each ref (OFF_* columns), checked and cached."""
        cached = self._offloaded
        if cached is not None and cached[0] is offloaded:
            return cached[1]
        if not isinstance(offloaded, OffloadedLayout):
            raise InputTypeError(
                f"offloaded must be an OffloadedLayout, got {type(offloaded).__name__}"
            )
        if offloaded.canonical:  # its pages are checked against the mappings
            return _canonical.plan_tables(self, offloaded).offloaded_refs
        rows = offloaded_rows(
            [list(g) for g in self._groups], list(offloaded.geometries)
        )
        table = np.array(rows, dtype=np.int64).reshape(len(rows), _kernels.OFF_COLUMNS)
        self._offloaded = (offloaded, table)
        return table

    def _group_array(self, *rows: tuple[int, ...]) -> npt.NDArray[np.int64]:
        """Checked per-group ints as the int64 array a kernel takes, memoised.

        Transfers repeat their group sizes (one block per step, say), and
        building a small array costs a third of a microsecond. Kernels never
        write these arrays, so threads may share them.
        """
        array = self._group_arrays.get(rows)
        if array is None:
            if len(self._group_arrays) >= 256:
                self._group_arrays.clear()
            array = np.array(rows[0] if len(rows) == 1 else rows, dtype=np.int64)
            self._group_arrays[rows] = array
        return array

    def _check_groups(
        self, group_sizes: Any, block_indices: Any, n_block_ids: int
    ) -> tuple[int, int, tuple[int, ...], tuple[int, ...]]:
        """Check a spec's group sizes and block indices against the layout.

        Returns:
            The number of ops, the bytes they copy, and the group sizes and
            block indices as tuples of Python ints.

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
                    sizes_tuple = tuple(group_sizes)
                    return n_ops, num_bytes, sizes_tuple, tuple(block_indices)
        sizes = tuple(
            as_group_sizes(group_sizes, self.num_groups, n_block_ids).tolist()
        )
        indices = as_block_indices(block_indices, self.num_groups)
        n_ops = sum(n * r for n, r in zip(sizes, self.group_data_ref_counts))
        num_bytes = sum(n * b for n, b in zip(sizes, self.group_page_bytes))
        return n_ops, num_bytes, sizes, indices

    def _bad_block_id(
        self, block_ids: npt.NDArray[Any], group_sizes: tuple[int, ...]
    ) -> tuple[int, int, int, int] | None:
        """The first out-of-range (group, ref, position, block id), in op order."""
        return _first_out_of_range(
            block_ids,
            group_sizes,
            [[ref.num_blocks for ref in group] for group in self._groups],
        )

    def _block_id_error(self, bad: tuple[int, int, int, int]) -> BlockIdError:
        """The error for the block id that _bad_block_id found."""
        group, d, position, value = bad
        return block_id_error(group, position, value, d, self._groups[group][d])

    def _plan_error(
        self,
        block_ids: npt.NDArray[Any],
        group_sizes: tuple[int, ...],
        block_indices: tuple[int, ...],
        chunk_ids: npt.NDArray[np.int64],
        offloaded: OffloadedLayout,
    ) -> BlockIdError | OffloadedIdError:
        """The error of a failed plan, checked in the reference's order."""
        bad = self._bad_block_id(block_ids, group_sizes)
        if bad is not None:
            return self._block_id_error(bad)
        count_error = _chunk_count_error(
            chunk_ids, group_sizes, block_indices, offloaded.blocks_per_chunk
        )
        if count_error is not None:
            return count_error
        chunks_per_group = [
            num_chunks(n, i, offloaded.blocks_per_chunk)
            for n, i in zip(group_sizes, block_indices)
        ]
        off_limits = [
            [offloaded.geometries[ref.tensor_idx].num_chunks for ref in group]
            for group in self._groups
        ]
        bad = _first_out_of_range(chunk_ids, tuple(chunks_per_group), off_limits)
        assert bad is not None, "the kernel reported ids that are in range"
        group, d, position, value = bad
        tensor_idx = self._groups[group][d].tensor_idx
        return OffloadedIdError(
            f"group {group}, position {position}: offloaded id {value} is out of "
            f"range for ref {d}, whose offloaded tensor {tensor_idx} has "
            f"{off_limits[group][d]} chunks",
            group=group,
            position=position,
            value=value,
        )

    def _pointer_error(
        self, op: int, ptrs: npt.NDArray[np.uint64], group_sizes: tuple[int, ...]
    ) -> DevicePointerError:
        """The error for device pointer ``op``, which is not a block of its ref."""
        value = int(ptrs[op])
        group = 0
        while op >= group_sizes[group] * self.group_data_ref_counts[group]:
            op -= group_sizes[group] * self.group_data_ref_counts[group]
            group += 1
        d, position = divmod(op, group_sizes[group])
        ref = self._groups[group][d]
        return DevicePointerError(
            f"group {group}, position {position}: device pointer 0x{value:x} "
            f"with its size is not a block of ref {d} (tensor "
            f"{ref.tensor_idx} at 0x{ref.base_ptr:x}, row stride "
            f"{ref.row_stride_bytes} B, {ref.num_blocks} blocks, page "
            f"{ref.page_size_bytes} B), or not the same block as ref 0's",
            group=group,
            position=position,
            value=value,
        )


def _chunk_count_error(
    chunk_ids: npt.NDArray[Any],
    group_sizes: tuple[int, ...],
    block_indices: tuple[int, ...],
    blocks_per_chunk: int,
) -> OffloadedIdError | None:
    """The error for offloaded ids that are not as many as the groups' chunks."""
    chunks_per_group = [
        num_chunks(n, i, blocks_per_chunk) for n, i in zip(group_sizes, block_indices)
    ]
    if len(chunk_ids) == sum(chunks_per_group):
        return None
    return OffloadedIdError(
        f"there are {len(chunk_ids)} offloaded ids, but the groups span "
        f"{chunks_per_group} chunks (blocks_per_chunk={blocks_per_chunk}): "
        f"{sum(chunks_per_group)} in all"
    )


def max_run_arg(max_run_bytes: Any) -> int:
    """max_run_bytes (None or an int >= 1), checked, as the kernels take it.

    The kernels take an int64 and read it as uint64: a cap of 2**63 or more
    goes as its two's complement, and 2**64 - 1 or more means no cap (NO_CAP).
    """
    if max_run_bytes is None:
        return _kernels.NO_CAP
    cap = as_int(max_run_bytes, "max_run_bytes")
    if cap < 1:
        raise SpecError(f"max_run_bytes must be >= 1, got {cap}")
    if cap >= 2**64 - 1:
        return _kernels.NO_CAP
    return cap if cap < 2**63 else cap - 2**64


def _block_ids(block_ids: Any, what: str = "block_ids") -> npt.NDArray[Any]:
    """Block ids as the kernels take them; arrays that already fit pass as is."""
    if (
        type(block_ids) is np.ndarray
        and block_ids.dtype in ID_DTYPES
        and block_ids.ndim == 1
        and block_ids.flags.carray  # contiguous, aligned and writable
    ):
        return block_ids
    return as_block_ids(block_ids, what)


def _first_out_of_range(
    ids: npt.NDArray[Any], group_sizes: tuple[int, ...], limits: list[list[int]]
) -> tuple[int, int, int, int] | None:
    """The first (group, ref, position, id) with an id outside [0, limit).

    ``ids`` are consumed group by group (group_sizes[g] each) and checked
    against limits[g][d] for each ref d, in op order.
    """
    first = 0
    for group, (n, group_limits) in enumerate(zip(group_sizes, limits)):
        group_ids = ids[first : first + n]
        for d, limit in enumerate(group_limits):
            bad = np.flatnonzero((group_ids < 0) | (group_ids >= limit))
            if len(bad):
                position = int(bad[0])
                return group, d, position, int(group_ids[position])
        first += n
    return None
