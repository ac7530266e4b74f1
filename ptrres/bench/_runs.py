"""Runs in numpy: how many descriptors SPEC 6's merge leaves, and the runs
of a transfer's paired ids.

``count_coalesced`` counts a plan's descriptors once merged, ascending runs
only and both ways; ``run_lengths`` splits a transfer's (GPU block, CPU
sub-block) pairs into runs stepping +1 or -1 on both sides, and
``trace_run_lengths`` pools them over a trace. Plain numpy, independent of
the kernels: what a trace's ids would save, not how ptrres merges them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from ._trace_files import Trace


def _run_starts(
    src: npt.NDArray[Any],
    dst: npt.NDArray[Any],
    sizes: npt.NDArray[Any],
    *,
    descending: bool,
    breaks: npt.NDArray[np.intp] | None = None,
) -> tuple[npt.NDArray[np.bool_], npt.NDArray[np.int8]]:
    """Where the runs of SPEC 6's greedy merge start, and each step's direction.

    Returns ``starts`` (bool per element: it starts a run) and ``step``
    (int8 per element: +1 when it continues the element before upwards on
    both sides, -1 downwards, 0 otherwise). Descriptor i continues i - 1
    upwards when ``src[i-1] + sizes[i-1] == src[i]`` and the same on dst;
    downwards (only with ``descending``) when ``src[i] + sizes[i] ==
    src[i-1]`` and the same on dst. A run keeps one direction: a descriptor
    whose step differs from the step before starts a run, unless the one
    before started a run itself (a run of one takes either direction).
    Positions in ``breaks`` always start a run.
    """
    n = len(src)
    step = np.zeros(n, np.int8)
    starts = np.ones(n, dtype=bool)
    if n < 2:
        return starts, step
    up = (src[:-1] + sizes[:-1] == src[1:]) & (dst[:-1] + sizes[:-1] == dst[1:])
    step[1:][up] = 1
    if descending:
        down = (src[1:] + sizes[1:] == src[:-1]) & (dst[1:] + sizes[1:] == dst[:-1])
        step[1:][down & ~up] = -1
    if breaks is not None:
        step[breaks] = 0
    # i turns when it and i - 1 both continue, in different directions: i - 1
    # then ended a run, so i starts one, unless i - 1 started a run itself,
    # which happens exactly at every other turn of a chain of turns in a row.
    turn = np.zeros(n, dtype=bool)
    turn[2:] = (step[2:] != 0) & (step[1:-1] != 0) & (step[2:] != step[1:-1])
    index = np.arange(n)
    chain_start = np.maximum.accumulate(
        np.where(turn & ~np.concatenate(([False], turn[:-1])), index, 0)
    )
    starts = (step == 0) | (turn & ((index - chain_start) % 2 == 0))
    starts[0] = True
    return starts, step


class CoalescedCounts(NamedTuple):
    """Descriptors left after merging runs (SPEC 6)."""

    ascending: int  # merging ascending runs only
    descending: int  # merging runs in either direction, each run one way


def count_coalesced(
    src: npt.ArrayLike,
    dst: npt.ArrayLike,
    sizes: npt.ArrayLike,
    *,
    breaks: npt.ArrayLike | None = None,
) -> CoalescedCounts:
    """How many descriptors a plan has once merged, both rules, in numpy.

    Args:
        src, dst, sizes: the plan's descriptors (unsigned or signed integers).
        breaks: positions where a run may not continue from the descriptor
            before (where the plan passes into another allocation).
    """
    s, d, z = (np.asarray(a).astype(np.uint64, copy=False) for a in (src, dst, sizes))
    cuts = None if breaks is None else np.asarray(breaks, dtype=np.intp)
    up, _ = _run_starts(s, d, z, descending=False, breaks=cuts)
    both, _ = _run_starts(s, d, z, descending=True, breaks=cuts)
    return CoalescedCounts(int(up.sum()), int(both.sum()))


class RunLengths(NamedTuple):
    """Runs of a paired id sequence, merged as SPEC 6 merges descriptors."""

    ascending: npt.NDArray[np.int64]  # lengths of runs stepping +1 on both sides
    descending: npt.NDArray[np.int64]  # lengths of runs stepping -1 on both sides
    singles: int  # pairs that continue no run

    @property
    def runs(self) -> int:
        return len(self.ascending) + len(self.descending) + self.singles


def paired_positions(
    gpu_ids: npt.ArrayLike,
    cpu_ids: npt.ArrayLike,
    blocks_per_chunk: int = 1,
    block_index: int = 0,
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """GPU block k paired with its CPU sub-block, in GPU-block units.

    GPU block k sits in sub-block ``j % bpc`` of chunk ``cpu_ids[j // bpc]``,
    ``j = block_index % bpc + k`` (SPEC 5): its CPU position is
    ``chunk * bpc + j % bpc``.
    """
    gpu = np.asarray(gpu_ids, dtype=np.int64)
    cpu = np.asarray(cpu_ids, dtype=np.int64)
    j = block_index % blocks_per_chunk + np.arange(len(gpu))
    return gpu, cpu[j // blocks_per_chunk] * blocks_per_chunk + j % blocks_per_chunk


def run_lengths(
    gpu_ids: npt.ArrayLike,
    cpu_ids: npt.ArrayLike,
    blocks_per_chunk: int = 1,
    block_index: int = 0,
) -> RunLengths:
    """Runs of one transfer's (GPU block, CPU sub-block) pairs.

    Consecutive pairs continue an ascending run when both sides step +1, a
    descending one when both step -1; a run keeps one direction, greedily
    from the left (SPEC 6's rule with one-block descriptors, so the number of
    runs is the descriptor count of a one-ref layout whose page fills its
    row, merged both ways).
    """
    gpu, cpu = paired_positions(gpu_ids, cpu_ids, blocks_per_chunk, block_index)
    starts, step = _run_starts(gpu, cpu, np.ones(len(gpu), np.int64), descending=True)
    bounds = np.append(np.flatnonzero(starts), len(gpu))
    lengths = np.diff(bounds)
    # A run's direction is the step of its second element.
    direction = np.where(
        lengths > 1, step[np.minimum(bounds[:-1] + 1, len(gpu) - 1)], 0
    )
    return RunLengths(
        lengths[direction > 0].astype(np.int64),
        lengths[direction < 0].astype(np.int64),
        int((lengths == 1).sum()),
    )


def trace_run_lengths(
    trace: Trace, transfers: Sequence[int] | None = None
) -> RunLengths:
    """run_lengths() of every transfer of a trace (or those given), pooled."""
    parts = [
        run_lengths(t.gpu_ids, t.cpu_ids, trace.blocks_per_chunk, t.block_index)
        for t in (
            trace.transfers() if transfers is None else map(trace.transfer, transfers)
        )
    ]
    return RunLengths(
        np.concatenate([np.zeros(0, np.int64), *(p.ascending for p in parts)]),
        np.concatenate([np.zeros(0, np.int64), *(p.descending for p in parts)]),
        sum(p.singles for p in parts),
    )
