"""Which regions vLLM's NIXL connector's descriptor ids index (0.30 to 0.33),
read off ``NixlBaseConnectorWorker._compute_desc_ids``' arguments and its
worker, branch for branch, and whether a transfer's block ids stay inside
them.

vLLM prepares one NIXL descriptor per block per region, region after region;
``_compute_desc_ids`` turns each group's block ids into indices into those
lists, region by region. desc_layout() says, as segments in the order of its
output, which regions each group's ids go to and how many blocks each holds:
an id must be 0 <= id < blocks. ``ptrres.vllm._nixl`` checks the ids
against them, and has the compiled kernel build the indices from them.
"""

from __future__ import annotations

import array
import itertools
from collections.abc import Sequence
from types import ModuleType
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

# vLLM's group id of a region that layers of several groups share.
SHARED_REGION = -1
# Releases before 0.31 have no layer-name routing.
_NO_ROUTING: tuple[int, ...] = ()


class Segment(NamedTuple):
    """Where one group's ids (or every group's) go: one region's descriptors."""

    group: int  # the group, or ALL_GROUPS: every group's ids, concatenated
    region: int
    first: int  # the region's first descriptor
    blocks: int  # its descriptors: an id must be 0 <= id < blocks


# Segment.group of a segment that takes every group's ids (desc_ids_kernel's
# ALL_GROUPS).
ALL_GROUPS = -1

# _compute_desc_ids' arguments, after the worker.
Arguments = tuple[
    Sequence[Any], int, "float | None", int, "Sequence[int] | None",
    "Sequence[int] | None", "bool | None",
]  # fmt: skip


class DescLayout(NamedTuple):
    """What _compute_desc_ids would do with a transfer's groups: the
    segments, in the order of its output, and whether the compiled kernel may
    build it (False: vLLM's Mamba branches, which it builds after the check)."""

    segments: tuple[Segment, ...]
    compiled: bool
    # Each group's (or ALL_GROUPS') fewest blocks over its segments: what its
    # ids must stay under (all_in_range).
    limits: tuple[tuple[int, int], ...]


def layout_of(segments: list[Segment], compiled: bool) -> DescLayout:
    """A DescLayout of these segments, with each group's limit."""
    limits: dict[int, int] = {}
    for segment in segments:
        limits[segment.group] = min(
            limits.get(segment.group, segment.blocks), segment.blocks
        )
    return DescLayout(tuple(segments), compiled, tuple(limits.items()))


def desc_layout(
    worker: Any, arguments: Arguments, base_worker: ModuleType
) -> DescLayout | None:
    """The regions each group's ids index, as vLLM's ``_compute_desc_ids``
    (0.30 to 0.33) computes them from its arguments, branch for branch; None
    where vLLM itself would fail (an assertion, an unknown spec): it then
    does, as it did."""
    (
        block_ids, dst_num_blocks, block_size_ratio, physical_blocks_per_logical,
        region_num_blocks, region_group_ids, uses_region_group_mapping,
    ) = arguments  # fmt: skip
    num_ssm_regions = 0
    if worker._has_mamba:
        if worker._conv_decomp is None:
            return None
        per_layer = len(worker._conv_decomp.local_conv_offsets) + 1
        num_ssm_regions = (
            len(worker._ssm_region_indices or worker.block_len_per_layer) * per_layer
        )
    num_blocks = dst_num_blocks
    if block_size_ratio is not None:
        num_blocks = int(num_blocks * block_size_ratio)
    routing = getattr(worker, "_transfer_layer_group_ids", None) or _NO_ROUTING
    num_regions = (
        len(routing)
        if routing
        else worker.num_regions or len(worker.block_len_per_layer)
    )
    if region_num_blocks is None:
        counts = [num_blocks] * num_regions
    elif block_size_ratio is not None:
        counts = [int(count * block_size_ratio) for count in region_num_blocks]
    else:
        counts = list(region_num_blocks)
    if counts and not routing:
        num_regions = len(counts)
    if len(counts) != num_regions or not num_regions:
        # vLLM asserts; or, with no region registered, adds offset 0 to every
        # id, each then an index into an empty list that NIXL refuses: vLLM's.
        return None
    firsts = np.cumsum([0, *counts[:-1]]).tolist()
    if routing:
        if max(routing, default=0) >= len(block_ids) or min(routing, default=0) < 0:
            return None
        return layout_of(
            [
                Segment(group, k, firsts[k], counts[k])
                for k, group in enumerate(routing)
            ],
            True,
        )
    if num_ssm_regions:
        logical_blocks = dst_num_blocks // physical_blocks_per_logical
        return _mamba_layout(
            worker, block_ids, num_blocks, logical_blocks, sum(counts),
            num_ssm_regions, base_worker,
        )  # fmt: skip
    if region_group_ids is None:
        region_group_ids = worker.region_group_ids
        if uses_region_group_mapping is None:
            uses_region_group_mapping = worker._uses_region_group_mapping
    if not region_group_ids and num_regions == 1:
        region_group_ids = [0]
    if len(region_group_ids) != num_regions:
        return None
    if uses_region_group_mapping is None:
        uses_region_group_mapping = len(set(region_group_ids)) > 1
    if not uses_region_group_mapping:
        if not len(block_ids):  # vLLM's concatenate of no group raises
            return None
        segments = [
            Segment(ALL_GROUPS, r, firsts[r], counts[r]) for r in range(num_regions)
        ]
        return layout_of(segments, True)
    segments = []
    for group, ids in enumerate(block_ids):
        if not len(ids):
            continue
        regions = [
            r
            for r, owner in enumerate(region_group_ids)
            if owner in (group, SHARED_REGION)
        ]
        if not regions:  # vLLM asserts there is one
            return None
        segments += [Segment(group, r, firsts[r], counts[r]) for r in regions]
    return layout_of(segments, True)


def _mamba_layout(
    worker: Any,
    block_ids: Sequence[Any],
    num_blocks: int,
    logical_blocks: int,
    num_fa_descs: int,
    num_ssm_regions: int,
    base_worker: ModuleType,
) -> DescLayout | None:
    """vLLM's Mamba branches: an attention group's ids index each of its
    regions' ``num_blocks`` descriptors (every region, or the scratch ones),
    an SSM group's each SSM region's ``logical_blocks`` (after every
    attention descriptor). Checked here; built by vLLM."""
    if len(worker._group_spec_types) < len(block_ids):  # vLLM's IndexError
        return None
    segments = []
    for group in range(len(block_ids)):
        kind = worker._group_spec_types[group]
        if base_worker._is_attention_spec(kind):
            scratch = getattr(base_worker, "CircularBufferSpec", None)
            regions = (
                list(worker._scratch_region_indices)
                if kind is scratch
                else list(range(worker.num_regions))
            )
            segments += [Segment(group, r, r * num_blocks, num_blocks) for r in regions]
        elif base_worker._is_ssm_spec(kind):
            regions = (
                [num_ssm_regions]
                if group == worker._ple_group_index
                else list(range(num_ssm_regions))
            )
            segments += [
                Segment(group, r, num_fa_descs + r * logical_blocks, logical_blocks)
                for r in regions
            ]
        else:  # vLLM raises "Unknown spec type"
            return None
    return layout_of(segments, False)


class FlatIds(NamedTuple):
    """Every group's ids as one int64 array, where each group starts (one
    entry more than groups), and each group's count."""

    ids: npt.NDArray[np.int64]
    starts: npt.NDArray[np.int64]
    lengths: list[int]


def flat_ids(block_ids: Sequence[Any]) -> FlatIds | None:
    """Every group's ids as one int64 array; None for an id that is no int64
    (it is out of every region: the slow check finds it)."""
    flat = array.array("q")
    starts = [0]
    try:
        for group in block_ids:
            # A list's length is known up front: array("q", list) converts it
            # at twice the speed of extend() (14 ns an id against 28), as fast
            # as numpy; extend() from another "q" array is one memcpy. (Not
            # for anything else: array("q", bytes) would reinterpret bytes.)
            flat.extend(array.array("q", group) if type(group) is list else group)
            starts.append(len(flat))
    except (TypeError, OverflowError):
        return None
    lengths = [b - a for a, b in itertools.pairwise(starts)]
    return FlatIds(np.frombuffer(flat, np.int64), np.array(starts, np.int64), lengths)


class BadId(NamedTuple):
    """The first id outside its region."""

    group: int
    position: int
    value: int
    segment: Segment


def first_bad_id(block_ids: Sequence[Any], layout: DescLayout) -> BadId | None:
    """The first id, segment by segment, outside its segment's region, in
    plain Python (any integers, or anything else)."""
    groups = list(block_ids)
    for segment in layout.segments:
        members = (
            [(g, k, v) for g, ids in enumerate(groups) for k, v in enumerate(ids)]
            if segment.group == ALL_GROUPS
            else [(segment.group, k, v) for k, v in enumerate(groups[segment.group])]
        )
        for group, position, value in members:
            if not in_range(value, segment.blocks):
                return BadId(group, position, value, segment)
    return None


def in_range(value: Any, count: int) -> bool:
    try:
        return 0 <= int(value) < count and int(value) == value
    except (TypeError, ValueError):
        return False


class CompiledLayout(NamedTuple):
    """A DescLayout as desc_ids_kernel takes it, kept per worker."""

    layout: DescLayout
    # (n, SEGMENT_COLUMNS) int64: each segment's group, first descriptor and
    # count.
    segments: npt.NDArray[np.int64]
    # Segments of every group's ids, and of each group's own.
    all_groups: int
    per_group: tuple[int, ...]


# Where a worker keeps its CompiledLayouts, by layout_key().
_LAYOUTS_ATTRIBUTE = "_ptrres_desc_layouts"
_MAX_LAYOUTS = 64


def layout_key(
    worker: Any, arguments: tuple[Any, ...], block_ids: Any
) -> tuple[Any, ...]:
    """What a DescLayout depends on: the arguments (per-region lists as
    tuples), the worker's regions, and which groups have ids."""
    counts, owners = arguments[4], arguments[5]
    return (
        arguments[1], arguments[2], arguments[3],
        None if counts is None else tuple(counts),
        None if owners is None else tuple(owners),
        arguments[6],
        tuple(bool(len(ids)) for ids in block_ids),
        worker.num_regions,
        len(worker.block_len_per_layer),
        tuple(getattr(worker, "_transfer_layer_group_ids", None) or _NO_ROUTING),
        None if owners is not None else tuple(worker.region_group_ids or ()),
        worker._uses_region_group_mapping,
    )  # fmt: skip


def compiled_layout(
    worker: Any, arguments: Arguments, base_worker: ModuleType
) -> CompiledLayout | DescLayout | None:
    """The worker's CompiledLayout of these arguments (made once), or, for
    vLLM's Mamba branches, the DescLayout (checked, not compiled); None where
    vLLM itself fails."""
    if worker._has_mamba:
        return desc_layout(worker, arguments, base_worker)
    layouts = worker.__dict__.get(_LAYOUTS_ATTRIBUTE)
    if layouts is None:
        layouts = worker.__dict__[_LAYOUTS_ATTRIBUTE] = {}
    key = layout_key(worker, arguments, arguments[0])
    found = layouts.get(key)
    if found is None:
        layout = desc_layout(worker, arguments, base_worker)
        if layout is None:
            return None
        # A count below 0 (a peer's handshake can say so) takes no id: the
        # kernel compares ids with the count as unsigned.
        segments = np.array(
            [(s.group, s.first, max(s.blocks, 0)) for s in layout.segments], np.int64
        ).reshape(len(layout.segments), 3)
        per_group = [0] * len(arguments[0])
        for segment in layout.segments:
            if segment.group != ALL_GROUPS:
                per_group[segment.group] += 1
        found = CompiledLayout(
            layout,
            segments,
            sum(s.group == ALL_GROUPS for s in layout.segments),
            tuple(per_group),
        )
        if len(layouts) >= _MAX_LAYOUTS:
            layouts.clear()
        layouts[key] = found
    result: CompiledLayout = found
    return result


def all_in_range(flat: FlatIds, layout: DescLayout) -> bool:
    """Whether every id is inside every region its group indexes: each
    group's smallest and largest against the fewest blocks of its regions."""
    ids, starts, _ = flat
    for group, limit in layout.limits:
        group_ids = (
            ids if group == ALL_GROUPS else ids[starts[group] : starts[group + 1]]
        )
        if len(group_ids) and (group_ids.min() < 0 or group_ids.max() >= limit):
            return False
    return True
