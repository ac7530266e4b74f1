"""A KV-cache layout flattened once: the columns a PointerTable plans from.

TableColumns reads a CanonicalKVCaches into parallel arrays (ref_table,
group_ref_start, refs and pages per group), checks each call's spec against
them (_groups.check_groups), and keeps the tables of the offloaded layout
last planned with. PointerTable (_table) is the facade that plans from them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from . import _kernels, _mappings, _peer_plan
from ._args import SPEC_FIELDS, block_ids_arg, missing_attributes
from ._errors import InputTypeError
from ._geometry import (
    MemoryRegion,
    RefRow,
    TensorGeometry,
    memory_regions,
    offloaded_rows,
    read_layout,
)
from ._groups import GroupArrays, GroupCounts, check_groups
from ._offloaded import OffloadedLayout


class TableColumns:
    """The tensors and refs of a CanonicalKVCaches, as parallel arrays, and
    the caches of the layouts last planned with (PointerTable's state)."""

    def __init__(self, kv_caches: Any) -> None:
        tensors, groups = read_layout(kv_caches)
        self._groups: tuple[tuple[RefRow, ...], ...] = tuple(map(tuple, groups))
        self._tensors: tuple[TensorGeometry, ...] = tuple(tensors)
        # The allocations the tensors lie in, one region each: what a transfer
        # engine registers (ptrres.nixl.register).
        self.memory_regions: tuple[MemoryRegion, ...] = memory_regions(tensors)
        rows = [row for group in groups for row in group]
        # One row per (group, ref) in copy order; columns are _kernels.BASE_PTR...
        self.ref_table = np.array(rows, dtype=np.int64).reshape(
            len(rows), _kernels.REF_COLUMNS
        )
        # Each ref's allocation (file-op kernels take it apart from the table).
        self._ref_allocations = np.ascontiguousarray(
            self.ref_table[:, _kernels.ALLOCATION]
        )
        # The refs of group g are rows group_ref_start[g]:group_ref_start[g + 1].
        self.group_ref_start = np.cumsum([0] + [len(g) for g in groups], dtype=np.int64)
        self.group_data_ref_counts: tuple[int, ...] = tuple(len(g) for g in groups)
        # Bytes one block of group g copies, over all its refs.
        self.group_page_bytes: tuple[int, ...] = tuple(
            sum(ref.page_size_bytes for ref in group) for group in groups
        )
        self.num_groups = len(groups)
        # The int64 arrays kernels take of the group sizes (and block
        # indices) of specs, by the tuples they hold (_groups.sizes_array).
        self._group_arrays: GroupArrays = {}
        # The offloaded layout last planned with, and its per-ref table: one
        # tuple, read and assigned whole (atomic under the GIL), never in parts.
        self._offloaded: tuple[OffloadedLayout, npt.NDArray[np.int64]] | None = None
        # The refs' mappings (SPEC 10), and the kernel tables of the layout
        # last planned with canonically or strided (read and assigned whole).
        self._ref_mappings = _mappings.read_ref_mappings(kv_caches)
        self._canonical: _mappings.PlanTables | None = None
        # The peer layouts and head slices last planned with, once checked
        # against this table, the latest first: a decode rank gathers from up
        # to PEER_PAIRS_KEPT source ranks in turn (read and assigned whole).
        self._peers: tuple[_peer_plan.PeerPair, ...] = ()
        # Peer plans take no offloaded chunks: every group's block index is 0.
        self._zero_indices = (0,) * self.num_groups

    def _read_spec(self, device_spec: Any) -> tuple[npt.NDArray[Any], GroupCounts]:
        """A spec's block ids, and its groups checked against this table."""
        try:
            raw_ids = device_spec.block_ids
            raw_sizes, raw_indices = device_spec.group_sizes, device_spec.block_indices
        except AttributeError:
            raise missing_attributes(device_spec, SPEC_FIELDS, "device_spec") from None
        block_ids = block_ids_arg(raw_ids)
        counts = check_groups(
            raw_sizes,
            raw_indices,
            len(block_ids),
            self.group_data_ref_counts,
            self.group_page_bytes,
        )
        return block_ids, counts

    def _plan_tables(self, offloaded: OffloadedLayout) -> _mappings.PlanTables:
        """The canonical kernel's tables of an offloaded layout, checked and
        cached (the one last planned with)."""
        cached = self._canonical
        if cached is not None and cached.offloaded is offloaded:
            return cached
        if not isinstance(offloaded, OffloadedLayout):
            raise InputTypeError(
                f"offloaded must be an OffloadedLayout, got {type(offloaded).__name__}"
            )
        if offloaded.canonical:
            tables = _mappings.canonical_tables(
                self.ref_table,
                self.group_ref_start,
                self._groups,
                self._ref_mappings,
                offloaded,
            )
        else:
            offloaded_refs = self._offloaded_refs(offloaded)
            tables = _mappings.direct_tables(self._groups, offloaded, offloaded_refs)
        self._canonical = tables
        return tables

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
            return self._plan_tables(offloaded).offloaded_refs
        rows = offloaded_rows(
            [list(g) for g in self._groups], list(offloaded.geometries)
        )
        table = np.array(rows, dtype=np.int64).reshape(len(rows), _kernels.OFF_COLUMNS)
        self._offloaded = (offloaded, table)
        return table
