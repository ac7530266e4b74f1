"""A push that crosses TP (SPEC 15), head by head: which peer ranks each KV
head of a rank is written to, in code of its own.

The fast path (ptrres._push) intersects ranges of heads of the few peer
ranks a rank can reach; this one walks every rank of the peer engine, every
head that rank holds, asks which rank of this engine gives it that head (the
first of its source ranks that holds it, as a read takes it), and keeps the
heads this rank gives, grouped by peer rank. Where the peer engine
replicates a head, each of its ranks that holds it is walked, so every
replica is written.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._errors import InputTypeError, LayoutError, SpecError
from .._heads import HND, HeadSlice
from .._push import PushMapping
from .._types import GPULoadStoreSpec
from ._heads import heads_are_a_byte_range, read_numbers
from ._input import as_int


def holds(rank: int, tp_size: int, num_kv_heads: int, head: int) -> bool:
    """Whether rank ``rank`` of TP ``tp_size`` holds KV head ``head``: an
    even share of the heads each, or one head each, shared by consecutive
    ranks."""
    if tp_size <= num_kv_heads:
        share = num_kv_heads // tp_size
        return rank * share <= head < (rank + 1) * share
    return head == rank // (tp_size // num_kv_heads)


def sources(rank: int, tp_size: int, peer_tp_size: int) -> list[int]:
    """The ranks of the other engine (at ``peer_tp_size``) rank ``rank`` of
    an engine at ``tp_size`` reads from, in order: one where it has at least
    as many ranks, else the block of ranks that make up its heads."""
    if tp_size >= peer_tp_size:
        return [rank * peer_tp_size // tp_size]
    ratio = peer_tp_size // tp_size
    return [rank * ratio + i for i in range(ratio)]


def push_mapping(
    tp_rank: int,
    tp_size: int,
    peer_tp_size: int,
    num_kv_heads: int,
    *,
    mla: bool = False,
    kv_layout: str = HND,
) -> PushMapping:
    """The peer ranks rank ``tp_rank`` writes its heads to, one HeadSlice
    each (as ptrres.push_mapping)."""
    numbers = read_numbers(tp_rank, tp_size, peer_tp_size, num_kv_heads, mla, kv_layout)
    tp_rank, tp_size, peer_tp_size, num_kv_heads = numbers
    if mla:
        # One latent page, read whole from the first source rank.
        return PushMapping(
            *numbers,
            mla,
            tuple(
                HeadSlice(peer, 0, 0, 1, 1, 1)
                for peer in range(peer_tp_size)
                if sources(peer, peer_tp_size, tp_size)[0] == tp_rank
            ),
        )
    for size in (tp_size, peer_tp_size):
        if size % num_kv_heads and num_kv_heads % size:
            raise LayoutError(f"{num_kv_heads} KV heads over TP {size}")
    heads = range(num_kv_heads)
    mine = [h for h in heads if holds(tp_rank, tp_size, num_kv_heads, h)]
    slices: list[HeadSlice] = []
    for peer in range(peer_tp_size):
        theirs = [h for h in heads if holds(peer, peer_tp_size, num_kv_heads, h)]
        for slot, head in enumerate(theirs):
            giver = next(
                rank
                for rank in sources(peer, peer_tp_size, tp_size)
                if holds(rank, tp_size, num_kv_heads, head)
            )
            if giver != tp_rank:
                continue
            last = slices[-1] if slices else None
            if (
                last is not None
                and last.source_rank == peer
                and last.remote_head + last.num_heads == slot
                and last.local_head + last.num_heads == mine.index(head)
            ):
                slices[-1] = last._replace(num_heads=last.num_heads + 1)
            else:
                slices.append(
                    HeadSlice(peer, mine.index(head), slot, 1, len(mine), len(theirs))
                )
    # Pages of other head counts on the two sides: every push slices them.
    peer_heads = [h for h in heads if holds(0, peer_tp_size, num_kv_heads, h)]
    if not heads_are_a_byte_range(kv_layout) and len(mine) != len(peer_heads):
        raise LayoutError(f"{kv_layout} pages cannot be head-sliced: {numbers}")
    return PushMapping(*numbers, mla, tuple(slices))


def uncached_suffix(device_spec: Any, remote_group_sizes: Any) -> GPULoadStoreSpec:
    """Per group, the last ``remote_group_sizes[g]`` of the spec's ids (as
    ptrres.uncached_suffix), group by group in a plain loop."""
    ids = np.asarray(device_spec.block_ids)
    if ids.dtype.kind not in "iu":
        raise InputTypeError(f"block_ids must be integers, got dtype {ids.dtype}")
    sizes = [as_int(n, "group_sizes") for n in device_spec.group_sizes]
    firsts = [as_int(i, "block_indices") for i in device_spec.block_indices]
    remote = [as_int(n, "remote_group_sizes") for n in remote_group_sizes]
    if len(remote) != len(sizes) or len(firsts) != len(sizes):
        raise SpecError(f"{len(remote)} remote group sizes for {len(sizes)} groups")
    if any(n < 0 for n in sizes) or sum(sizes) != len(ids):
        raise SpecError(f"group sizes {sizes} for {len(ids)} ids")
    kept: list[int] = []
    start = 0
    for size, n in zip(sizes, remote):
        if not 0 <= n <= size:
            raise SpecError(f"{n} remote blocks of a group of {size}")
        group = ids[start : start + size].tolist()
        kept += group[size - n :]
        start += size
    return GPULoadStoreSpec(
        np.array(kept, dtype=ids.dtype),
        remote,
        [first + size - n for first, size, n in zip(firsts, sizes, remote)],
    )
