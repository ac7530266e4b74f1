"""The pages of the file worker's jobs (``ptrres.vllm._file_worker``): which
groups' pages make vLLM 0.34's file offsets something else than SPEC 11's.

vLLM 0.34's file worker gives ref d of a group the bytes
``[d * bsf * page(d), (d + 1) * bsf * page(d))`` of each file. Where a
group's pages are equal that is SPEC 11's ref-major layout, which ptrres
plans; where they differ, the ranges are either sparse (no two overlap:
vLLM's layout is sound, and its own code keeps it) or overlapping (ptrres
refuses the job, with an OverlappingPagesError). ``_file_worker``'s
docstring says why. The verdicts are computed once per table (or per shape
of DevicePointers, from their sizes) and checked per job against its
non-empty groups.

Importing this module imports neither vLLM nor numba.
"""

from __future__ import annotations

import functools
import itertools
import threading
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from .._errors import LayoutError
from ._state import reporter

if TYPE_CHECKING:
    from .._table import PointerTable


class OverlappingPagesError(LayoutError):
    """A group whose refs' pages differ so that vLLM 0.34's file offsets
    overlap: one ref's blocks would land on another's in every file.

    Attributes:
        group: the KV-cache group.
        refs: the two refs whose byte ranges overlap (the earlier first).
        pages: every ref's page of the group, in bytes.
    """

    def __init__(
        self, message: str, *, group: int, refs: tuple[int, int], pages: list[int]
    ) -> None:
        super().__init__(message)
        self.group = group
        self.refs = refs
        self.pages = pages


class SparsePages(NamedTuple):
    """A group whose refs' pages differ, where vLLM's file ranges do not
    overlap: vLLM's layout is sound there (only sparse), but not SPEC 11's."""

    group: int
    pages: tuple[int, ...]


# A group's verdict: None where its pages are equal (vLLM's offsets are SPEC
# 11's), else SparsePages or OverlappingPagesError.
Verdict = OverlappingPagesError | SparsePages | None


def group_verdict(group: int, pages: Sequence[int], bsf: int) -> Verdict:
    """Whether vLLM's offsets ``(d * bsf + s) * pages[d]`` are SPEC 11's
    (None), sound but sparse, or overlapping."""
    if len(set(pages)) <= 1:
        return None
    # Ref d spans [d * bsf * P[d], (d + 1) * bsf * P[d]): in order of start,
    # a range that starts before the furthest end so far overlaps that one's.
    spans = sorted(
        (d * bsf * page, (d + 1) * bsf * page, d)
        for d, page in enumerate(pages)
        if page
    )
    furthest = (-1, -1, -1)
    for span in spans:
        if span[0] < furthest[1]:
            return _overlap_error(group, pages, bsf, furthest, span)
        if span[1] > furthest[1]:
            furthest = span
    return SparsePages(group, tuple(pages))


def _overlap_error(
    group: int,
    pages: Sequence[int],
    bsf: int,
    first: tuple[int, int, int],
    second: tuple[int, int, int],
) -> OverlappingPagesError:
    start_a, _, a = first
    start_b, _, b = second
    slot = (start_b - start_a) // pages[a]
    slot_a = start_a + slot * pages[a]
    refs = tuple(sorted((a, b)))
    return OverlappingPagesError(
        f"group {group}: vLLM 0.34's file worker puts ref d's block in slot s at "
        f"byte (d * block_size_factor + s) * page(d) of the file, and this "
        f"group's refs have pages of different sizes ({_pages_text(pages)}), so "
        f"with block_size_factor {bsf} ref {b}'s slot 0 (bytes "
        f"{start_b}-{start_b + pages[b]}) overlaps ref {a}'s slot {slot} (bytes "
        f"{slot_a}-{slot_a + pages[a]}): its files would hold one layer's KV in "
        "another's place, for every engine reading them. ptrres fails the job; "
        "no file is written or read (docs/file-tier.md)",
        group=group,
        refs=(refs[0], refs[1]),
        pages=list(pages),
    )


def _pages_text(pages: Sequence[int]) -> str:
    """``ref 0: 200 B, ref 1: 100 B``, consecutive refs of one page together."""
    runs: list[tuple[int, int, int]] = []  # first ref, last ref, page
    for d, page in enumerate(pages):
        if runs and runs[-1][2] == page:
            runs[-1] = (runs[-1][0], d, page)
        else:
            runs.append((d, d, page))
    return ", ".join(
        f"ref {first}: {page} B" if first == last else f"refs {first}-{last}: {page} B"
        for first, last, page in runs
    )


class Pages(NamedTuple):
    """What a job's pages ask of its op lists."""

    # Each group's verdict, or None where every group's pages are equal.
    verdicts: list[Verdict] | None
    # The one page of every ref of the layout, where there is one: each op's
    # size is then one shared int (cheaper than an int per op).
    page: int | None = None


# A table's Pages, per bsf.
_table_pages: weakref.WeakKeyDictionary[Any, dict[int, Pages]] = (
    weakref.WeakKeyDictionary()
)
_pages_lock = threading.Lock()


# The table, bsf and Pages of the last job: one worker's jobs share them, and
# a WeakKeyDictionary lookup makes a weak reference every time. (A table
# holds integers, not tensors: keeping the last one costs nothing.)
_last_pages: tuple[Any, int, Pages] | None = None


def table_pages(table: PointerTable, bsf: int) -> Pages:
    """A table's Pages (computed once per table and bsf)."""
    global _last_pages
    last = _last_pages
    if last is not None and last[0] is table and last[1] == bsf:
        return last[2]
    by_bsf = _table_pages.get(table)
    if by_bsf is not None:
        found = by_bsf.get(bsf)
        if found is not None:
            _last_pages = (table, bsf, found)
            return found
    from .._kernels.common import PAGE_SIZE

    pages = table.ref_table[:, PAGE_SIZE].tolist()
    starts = table.group_ref_start.tolist()
    verdicts: list[Verdict] = [
        group_verdict(g, pages[first:end], bsf)
        for g, (first, end) in enumerate(itertools.pairwise(starts))
    ]
    found = Pages(
        verdicts if any(v is not None for v in verdicts) else None,
        pages[0] if len(set(pages)) == 1 else None,
    )
    with _pages_lock:
        _table_pages.setdefault(table, {})[bsf] = found
    _last_pages = (table, bsf, found)
    return found


# Where each ref's first op lies, per shape of DevicePointers (their
# (group_block_counts, group_data_ref_counts)): the positions, and each
# non-empty group's (index, first ref, end) among them. Jobs repeat shapes.
_RefStarts = tuple[Any, list[tuple[int, int, int]]]
_ref_starts: dict[tuple[Any, Any], _RefStarts] = {}
_MAX_SHAPES = 256


def pointer_pages(device_ptrs: Any, bsf: int) -> Pages:
    """A job's Pages, read from its pointers' sizes (each ref's first op),
    once ptrres has planned them (its counts and sizes checked)."""
    import numpy as np

    key = (
        tuple(device_ptrs.group_block_counts),
        tuple(device_ptrs.group_data_ref_counts),
    )
    starts = _ref_starts.get(key)
    if starts is None:
        positions: list[int] = []
        groups = []
        op = 0
        for g, (n, refs) in enumerate(zip(*key)):
            if n and refs:
                groups.append((g, len(positions), len(positions) + refs))
                positions += range(op, op + n * refs, n)
            op += n * refs
        starts = (np.array(positions, np.intp), groups)
        if len(_ref_starts) >= _MAX_SHAPES:
            _ref_starts.clear()
        _ref_starts[key] = starts
    positions_array, groups = starts
    pages = np.asarray(device_ptrs.sizes)[positions_array].tolist()
    if len(set(pages)) <= 1:
        return Pages(None, pages[0] if pages else None)
    verdicts: list[Verdict] = [None] * len(key[0])
    for g, first, end in groups:
        verdicts[g] = group_verdict(g, pages[first:end], bsf)
    return Pages(verdicts if any(v is not None for v in verdicts) else None)


@functools.cache
def said_sparse(sparse: SparsePages) -> None:
    """Say once per layout that its jobs keep vLLM's own op building."""
    reporter().info(
        "ptrres: group %d's refs have pages of different sizes (%s) whose "
        "ranges in vLLM's file layout do not overlap: its file jobs keep vLLM's "
        "own _submit_io, so that every engine reads the same bytes",
        sparse.group,
        _pages_text(sparse.pages),
    )


def check_verdicts(
    verdicts: list[Verdict], group_block_counts: Sequence[int]
) -> SparsePages | None:
    """The first sparse group of a job, or None.

    Raises:
        OverlappingPagesError: a group of the job whose vLLM offsets overlap.
    """
    sparse = None
    for verdict, n in zip(verdicts, group_block_counts):
        if not n or verdict is None:
            continue
        if isinstance(verdict, OverlappingPagesError):
            raise verdict
        if sparse is None:
            sparse = verdict
    return sparse
