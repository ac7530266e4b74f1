"""Canonical mappings (SPEC 10): read, checked, and flattened into the
kernel's tables.

A table reads its refs' mappings when it is built (read_ref_mappings). The
first plan against a canonical OffloadedLayout checks them and flattens them
into int64 tables (every ref's fragments, every ref's runs): canonical_tables.
The table caches them with the layout, as the direct plan caches its
offloaded table, so that later plans only coerce their ids and run one
kernel, with no Python loop over runs or fragments. The tables also say
which refs may ever merge (may_merge), and give layouts of one fragment per
ref a direct form, whose merged plans plan_kernel fills. A direct layout has
tables too (direct_tables), for its strided plans.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import pairwise
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from ._args import as_int, as_list, attributes
from ._errors import LayoutError
from ._geometry import Groups, RefRow, tensor_geometry
from ._kernels import canonical as ck
from ._kernels.common import BASE_PTR, OFF_BASE_PTR, OFF_COLUMNS, PAGE_SIZE
from ._offloaded import OffloadedLayout

MAPPING_FIELDS = (
    "canonical_page_size_bytes",
    "local_page_size_bytes",
    "runs",
    "num_writers",
    "writer_index",
)
RUN_FIELDS = (
    "local_offset",
    "canonical_offset",
    "fragment_size",
    "num_fragments",
    "local_stride",
    "canonical_stride",
)

IntTable = npt.NDArray[np.int64]


class RefMapping(NamedTuple):
    """A ref's mapping as the table read it, with the bytes its page may span."""

    # The ref's mapping object (vLLM's or ours), or None.
    mapping: Any
    # The ref's page must end within this many bytes of its row start.
    row_limit: int


class PlanTables(NamedTuple):
    """Everything the kernel needs about one (table, offloaded layout)."""

    offloaded: OffloadedLayout
    # (n_refs, OFF_COLUMNS): the offloaded tensor of each ref.
    offloaded_refs: IntTable
    # Per-ref item ranges and writers, and the items, (ITEM_COLUMNS, n_items):
    # fragments (flat plans).
    fragment_refs: IntTable
    fragments: IntTable
    # The same for runs (strided plans).
    run_refs: IntTable
    runs: IntTable
    # Fragments and runs one block of each group adds, over all its refs.
    group_fragments: tuple[int, ...]
    group_runs: tuple[int, ...]
    # When every ref has exactly one fragment: the layout as a direct one,
    # for plan_kernel (as_direct), else None.
    direct: DirectTables | None


class DirectTables(NamedTuple):
    """A canonical layout of one fragment per ref, as a direct layout: each
    ref's rows start at its fragment's offsets and its page is the fragment."""

    ref_table: IntTable
    offloaded_refs: IntTable
    # Whether every mapping has one writer (so that stores keep every block).
    one_writer: bool
    # Bytes one block of each group copies, over all its refs.
    group_bytes: tuple[int, ...]


def read_ref_mappings(kv_caches: Any) -> tuple[RefMapping, ...]:
    """Each ref's mapping (or None), in copy order, and its row's byte limit.

    Called once the table has read (and checked) the layout; the mappings are
    checked when a canonical layout first needs them.
    """
    tensors = as_list(kv_caches.tensors, "kv_caches.tensors")
    limits = []
    for t, entry in enumerate(tensors):
        geometry = tensor_geometry(entry.tensor, t)
        limits.append(min(geometry.row_stride_bytes, geometry.row_bytes))
    return tuple(
        RefMapping(getattr(ref, "mapping", None), limits[ref.tensor_idx])
        for refs in as_list(kv_caches.group_data_refs, "group_data_refs")
        for ref in as_list(refs, "group_data_refs[]")
    )


def direct_tables(
    groups: Groups, offloaded: OffloadedLayout, offloaded_refs: IntTable
) -> PlanTables:
    """A direct layout as items: each ref one whole-page row, one writer.

    Args:
        offloaded_refs: the offloaded tensor of each ref, checked (OFF_*
            columns).
    """
    pages = [ref.page_size_bytes for group in groups for ref in group]
    n_refs = len(pages)
    items = np.zeros((n_refs, ck.ITEM_COLUMNS), np.int64)
    items[:, ck.WIDTH] = pages
    items[:, ck.HEIGHT] = 1
    items[:, ck.LOCAL_STRIDE] = pages
    items[:, ck.CANONICAL_STRIDE] = pages
    ref_items = np.zeros((n_refs, ck.REF_ITEM_COLUMNS), np.int64)
    ref_items[:, ck.FIRST_ITEM] = np.arange(n_refs)
    ref_items[:, ck.END_ITEM] = np.arange(1, n_refs + 1)
    ref_items[:, ck.NUM_WRITERS] = 1
    ref_items[:, ck.BLOCK_BYTES] = pages
    ref_items[:, ck.LOAD_MAY_MERGE] = ref_items[:, ck.STORE_MAY_MERGE] = 1
    counts = tuple(len(group) for group in groups)
    return PlanTables(
        offloaded,
        offloaded_refs,
        ref_items,
        _by_column(items),
        ref_items,
        _by_column(items),
        counts,
        counts,
        None,  # the plan kernel takes direct layouts as they are
    )


def canonical_tables(
    ref_table: IntTable,
    group_ref_start: IntTable,
    groups: Groups,
    ref_mappings: Sequence[RefMapping],
    offloaded: OffloadedLayout,
) -> PlanTables:
    """Check every ref's mapping against its row and sub-block; flatten them.

    Args:
        ref_table, group_ref_start: the table's (PointerTable.ref_table).
        groups: the table's refs, group by group.
        ref_mappings: read_ref_mappings() of the table's KV caches.
    """
    offloaded_rows = []
    fragment_refs, run_refs = [], []
    fragments: list[npt.NDArray[np.int64]] = []
    runs: list[tuple[int, ...]] = []
    n_fragments = 0
    group_fragments, group_runs = [], []
    mappings = iter(ref_mappings)
    for group, refs in enumerate(groups):
        fragments_before, runs_before = n_fragments, len(runs)
        for d, ref in enumerate(refs):
            mapping, row_limit = next(mappings)
            fields, ref_runs = _read_mapping(mapping, group, d)
            canonical_page, local_page, n_writers, writer = fields
            where = f"group {group}, ref {d} (tensor {ref.tensor_idx})"
            if local_page > row_limit:
                raise LayoutError(
                    f"{where}: the mapping's local page of {local_page} B is "
                    f"larger than a row of the tensor ({row_limit} B)"
                )
            offloaded_rows.append(_offloaded_row(offloaded, ref, canonical_page, where))
            first_run, first_fragment = len(runs), n_fragments
            block_bytes = 0
            for r, run in enumerate(ref_runs):
                _check_run(run, local_page, canonical_page, f"{where}, run {r}")
                size, count = run[2], run[3]
                if count == 0:
                    continue
                runs.append(run)
                fragments.append(_run_fragments(run))
                n_fragments += count
                block_bytes += size * count
            mergeable = [
                may_merge(
                    runs[first_run:], ref.row_stride_bytes, offloaded_rows[-1],
                    writers, offloaded.blocks_per_chunk,
                )
                for writers in (1, n_writers)  # a load keeps every block
            ]  # fmt: skip
            fragment_refs.append(
                (
                    first_fragment,
                    n_fragments,
                    n_writers,
                    writer,
                    block_bytes,
                    *mergeable,
                )
            )
            run_refs.append(
                (first_run, len(runs), n_writers, writer, block_bytes, True, True)
            )
        group_fragments.append(n_fragments - fragments_before)
        group_runs.append(len(runs) - runs_before)
    offloaded_refs = _int_table(offloaded_rows, OFF_COLUMNS)
    items = np.concatenate(fragments) if fragments else _int_table([], ck.ITEM_COLUMNS)
    return PlanTables(
        offloaded,
        offloaded_refs,
        _int_table(fragment_refs, ck.REF_ITEM_COLUMNS),
        _by_column(items),
        _int_table(run_refs, ck.REF_ITEM_COLUMNS),
        _by_column(_int_table(runs, ck.ITEM_COLUMNS)),
        tuple(group_fragments),
        tuple(group_runs),
        _as_direct(ref_table, group_ref_start, offloaded_refs, fragment_refs, items),
    )


def _run_fragments(run: tuple[int, ...]) -> IntTable:
    """A run's fragments as items (n_fragments, ITEM_COLUMNS): one row each."""
    offset, canonical, size, count, stride, canonical_stride = run
    rows = np.arange(count, dtype=np.int64)
    fragments = np.zeros((count, ck.ITEM_COLUMNS), np.int64)
    fragments[:, ck.LOCAL_OFFSET] = offset + rows * stride
    fragments[:, ck.CANONICAL_OFFSET] = canonical + rows * canonical_stride
    fragments[:, ck.WIDTH] = size
    fragments[:, ck.HEIGHT] = 1
    fragments[:, ck.LOCAL_STRIDE] = size
    fragments[:, ck.CANONICAL_STRIDE] = size
    return fragments


def _as_direct(
    ref_table: IntTable,
    group_ref_start: IntTable,
    offloaded_refs: IntTable,
    fragment_refs: list[tuple[int, ...]],
    items: IntTable,
) -> DirectTables | None:
    """The layout as a direct one, when every ref has exactly one fragment.

    Args:
        ref_table, group_ref_start: the table's (not changed).
        offloaded_refs: the canonical tables' (not changed).
        items: every ref's fragments, (n_fragments, ITEM_COLUMNS).
    """
    if any(ref[ck.END_ITEM] - ref[ck.FIRST_ITEM] != 1 for ref in fragment_refs):
        return None
    ref_table = ref_table.copy()
    ref_table[:, BASE_PTR] += items[:, ck.LOCAL_OFFSET]
    ref_table[:, PAGE_SIZE] = items[:, ck.WIDTH]
    offloaded_refs = offloaded_refs.copy()
    offloaded_refs[:, OFF_BASE_PTR] += items[:, ck.CANONICAL_OFFSET]
    starts = group_ref_start
    return DirectTables(
        ref_table,
        offloaded_refs,
        all(ref[ck.NUM_WRITERS] == 1 for ref in fragment_refs),
        tuple(
            int(items[starts[g] : starts[g + 1], ck.WIDTH].sum())
            for g in range(len(starts) - 1)
        ),
    )


def may_merge(
    runs: list[tuple[int, ...]],
    row_stride: int,
    offloaded_row: tuple[int, ...],
    num_writers: int,
    blocks_per_chunk: int,
) -> bool:
    """Whether two of a ref's fragments may ever continue each other on both
    sides, upwards or downwards, in a flat plan of any block ids (False only
    when proven never).

    Within a block, fragment i continues fragment i - 1 only where both its
    offsets do (or, downwards, where it ends where the other starts). Across
    two kept blocks, the first fragment continues the last when the device
    steps (row_stride apart, times an id difference) and the offloaded ones
    (row and sub-block steps) both span the gap between them: upwards, from
    the first fragment's start to the last's end; downwards, from the last's
    start to the first's end. The gap must be a multiple of row_stride, and
    of the offloaded steps' gcd. Pages a writer keeps (num_writers > 1) are
    num_writers canonical pages apart, a multiple of num_writers sub-blocks
    when rows hold exactly blocks_per_chunk of them.

    Args:
        runs: the ref's runs, as RUN_FIELDS tuples (count > 0).
        offloaded_row: the ref's offloaded tensor, as OffloadedGeometry.
    """
    fragments = [
        (offset + i * stride, canonical + i * canonical_stride, size)
        for offset, canonical, size, count, stride, canonical_stride in runs
        for i in range(count)
    ]
    if not fragments:
        return False
    for (local, canonical, size), (next_local, next_canonical, next_size) in pairwise(
        fragments
    ):
        if local + size == next_local and canonical + size == next_canonical:
            return True
        if next_size and (next_local + next_size, next_canonical + next_size) == (
            local,
            canonical,
        ):
            return True
    first_local, first_canonical, first_size = fragments[0]
    last_local, last_canonical, last_size = fragments[-1]
    off_row_stride, sub_bytes = offloaded_row[1], offloaded_row[2]
    offloaded_step = math.gcd(off_row_stride, sub_bytes)
    if num_writers > 1 and off_row_stride == blocks_per_chunk * sub_bytes:
        offloaded_step = num_writers * sub_bytes
    gaps = [  # (device, offloaded), upwards then downwards
        (
            last_local + last_size - first_local,
            last_canonical + last_size - first_canonical,
        ),
        (
            first_local + first_size - last_local,
            first_canonical + first_size - last_canonical,
        ),
    ]
    return any(
        (row_stride == 0 or device_gap % row_stride == 0)
        and (offloaded_step == 0 or offloaded_gap % offloaded_step == 0)
        for device_gap, offloaded_gap in gaps
    )


def _int_table(rows: list[Any], columns: int) -> IntTable:
    return np.array(rows, dtype=np.int64).reshape(len(rows), columns)


def _by_column(items: IntTable) -> IntTable:
    """Items as the kernel takes them: one contiguous row per column."""
    return np.ascontiguousarray(items.T)


def _read_mapping(
    mapping: Any, group: int, d: int
) -> tuple[tuple[int, int, int, int], list[tuple[int, ...]]]:
    """A ref's mapping fields and runs as ints, checked on their own."""
    where = f"group {group}, ref {d}"
    if mapping is None:
        raise LayoutError(
            f"{where} has no mapping, but the offloaded layout is canonical: "
            "every ref needs one (vLLM's canonical_layout)"
        )
    raw = attributes(mapping, MAPPING_FIELDS, f"{where}: mapping")
    canonical_page, local_page, n_writers, writer = (
        as_int(raw[i], "{}: mapping.{}", where, MAPPING_FIELDS[i]) for i in (0, 1, 3, 4)
    )
    for name, value in (
        ("canonical_page_size_bytes", canonical_page),
        ("local_page_size_bytes", local_page),
    ):
        if value < 0:
            raise LayoutError(f"{where}: mapping.{name} is negative ({value})")
    if n_writers < 1:
        raise LayoutError(f"{where}: mapping.num_writers must be >= 1, got {n_writers}")
    if not 0 <= writer < n_writers:
        raise LayoutError(
            f"{where}: mapping.writer_index {writer} is outside [0, {n_writers}) "
            "(num_writers)"
        )
    runs = []
    for r, run in enumerate(as_list(raw[2], f"{where}: mapping.runs")):
        raw_run = attributes(run, RUN_FIELDS, f"{where}, run {r}")
        runs.append(
            tuple(
                as_int(value, "{}, run {}: {}", where, r, name)
                for value, name in zip(raw_run, RUN_FIELDS)
            )
        )
    return (canonical_page, local_page, n_writers, writer), runs


def _check_run(
    run: tuple[int, ...], local_page: int, canonical_page: int, where: str
) -> None:
    """A run's fields are not negative and its fragments lie inside both pages."""
    for name, value in zip(RUN_FIELDS, run):
        if value < 0:
            raise LayoutError(f"{where}: {name} is negative ({value})")
    offset, canonical, size, count, stride, canonical_stride = run
    if count == 0:
        return
    for side, start, step, page in (
        ("local", offset, stride, local_page),
        ("canonical", canonical, canonical_stride, canonical_page),
    ):
        end = start + (count - 1) * step + size
        if end > page:
            raise LayoutError(
                f"{where}: fragment {count - 1} ends at byte {end}, outside the "
                f"{side} page ({page} B)"
            )


def _offloaded_row(
    offloaded: OffloadedLayout, ref: RefRow, canonical_page: int, where: str
) -> tuple[int, ...]:
    """The offloaded tensor of a ref, whose sub-blocks must hold its canonical page."""
    if ref.tensor_idx >= len(offloaded.geometries):
        raise LayoutError(
            f"{where} has no offloaded tensor (there are {len(offloaded.geometries)})"
        )
    geometry = offloaded.geometries[ref.tensor_idx]
    if canonical_page > geometry.sub_bytes:
        raise LayoutError(
            f"{where}: its canonical page of {canonical_page} B is larger than a "
            f"sub-block of offloaded tensors[{ref.tensor_idx}] ({geometry.sub_bytes} "
            f"B: a row of {geometry.sub_bytes * offloaded.blocks_per_chunk} B "
            f"holds {offloaded.blocks_per_chunk} canonical pages)"
        )
    return tuple(geometry)
