"""A push that crosses TP (SPEC 15): a prefill rank WRITEs its KV heads into
the decode ranks that hold them.

tp_mapping() answers from the decode rank's side: the prefill ranks it reads
its heads from. push_mapping() is its inverse, from the prefill rank's side:
the decode ranks it writes, and per decode rank the HeadSlice of its own
pages that goes there and the head slot it lands at in theirs. Both name the
same copies: prefill rank p's slice for decode rank d is decode rank d's
slice from p, local and remote turned round. So every head of every decode
rank is written exactly once: where decode TP exceeds the KV heads, every
decode rank holding a replica of a head is written it; where prefill TP
exceeds them, the first prefill rank holding a head writes it and its
replicas write nothing (as the read takes it from the first). MLA: the
latent page goes whole to every decode rank, from one prefill rank each.

uncached_suffix() is a partial prefix-cache hit: the decode engine holds the
front of a request already and sends ids for the rest only, which pair with
the end of this engine's blocks of the request.

Only plain integers here: plan_peer_transfer(heads=) and ptrres.nixl
(prepped_pair) take a push slice as they take a read's, since a HeadSlice
says which heads of which side's page, never which way the bytes go.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ._args import SPEC_FIELDS, as_int, as_list, attributes, block_ids_arg
from ._errors import LayoutError, SpecError
from ._heads import (
    HND,
    KV_LAYOUTS,
    MAX_TP_OR_HEADS,
    SLICEABLE,
    HeadSlice,
    check_split,
    check_tp,
    rank_heads,
    slices_heads,
)
from ._types import GPULoadStoreSpec

__all__ = ["MAX_TP_OR_HEADS", "PushMapping", "push_mapping", "uncached_suffix"]


@dataclass(frozen=True)
class PushMapping:
    """push_mapping()'s answer: the peer ranks one rank writes its heads to.

    ``slices[i]`` is what goes to peer rank ``target_ranks[i]``: a HeadSlice
    whose local side is this rank's page and whose remote side is the peer
    rank's (its ``source_rank`` field is that peer rank: HeadSlice names a
    slice's peer rank so, whichever way the bytes go). One transfer (one
    WRITE to one agent) per slice; none at all for a rank whose heads an
    earlier rank holding the same ones writes.
    """

    tp_rank: int
    tp_size: int
    peer_tp_size: int
    num_kv_heads: int
    mla: bool
    slices: tuple[HeadSlice, ...]

    @property
    def target_ranks(self) -> tuple[int, ...]:
        """The peer ranks this rank writes to, in rank order."""
        return tuple(s.source_rank for s in self.slices)

    def slice_of(self, target_rank: int) -> HeadSlice:
        """The slice that goes to peer rank ``target_ranks``."""
        for s in self.slices:
            if s.source_rank == target_rank:
                return s
        raise LayoutError(
            f"rank {self.tp_rank} writes none of peer rank {target_rank}'s heads; "
            f"its target ranks are {list(self.target_ranks)}"
        )


def push_mapping(
    tp_rank: int,
    tp_size: int,
    peer_tp_size: int,
    num_kv_heads: int,
    *,
    mla: bool = False,
    kv_layout: str = HND,
) -> PushMapping:
    """The peer ranks this rank writes its KV heads to, and the slice of its
    pages each one gets (SPEC 15): tp_mapping() seen from the writing side.

    Args:
        tp_rank: this rank (the prefill rank that writes), ``0 <= tp_rank <
            tp_size``.
        tp_size: this engine's tensor parallelism.
        peer_tp_size: the peer engine's (the decode engine's); one of the two
            divides the other.
        num_kv_heads: the model's KV heads over all ranks; each TP size splits
            them evenly (``H % T == 0``) or replicates them (``T % H == 0``).
            TP sizes and heads are each at most 2**16 (MAX_TP_OR_HEADS).
        mla: replicated latent pages (MLA): the whole page to each peer rank
            whose one source rank this rank is.
        kv_layout: the pages' layout, the same on both sides, as for
            tp_mapping(): ``"HND"``, ``"NHD"`` or a vLLM KVCacheLayout name;
            pages whose heads are not outermost (NHD, LBNHC, ...) are
            refused unless the two engines' pages hold as many heads (every
            slice a whole page, on every rank).

    Raises:
        LayoutError: a combination that cannot be, naming the numbers.
        InputTypeError: an argument of the wrong type.
    """
    tp_rank, tp_size, peer_tp_size, num_kv_heads, kv_layout = check_tp(
        tp_rank, tp_size, peer_tp_size, num_kv_heads, mla, kv_layout, "go to"
    )
    if mla:
        slices = tuple(
            HeadSlice(target, 0, 0, 1, 1, 1)
            for target in _latent_targets(tp_rank, tp_size, peer_tp_size)
        )
    else:
        for side, size in (("this engine", tp_size), ("the peer", peer_tp_size)):
            check_split(num_kv_heads, size, side)
        # A page of either engine holds this many heads: of other counts,
        # the slices are of pages (any rank's, even one that writes none).
        held = len(rank_heads(0, tp_size, num_kv_heads))
        theirs = len(rank_heads(0, peer_tp_size, num_kv_heads))
        if not slices_heads(kv_layout) and held != theirs:
            raise LayoutError(
                f"{kv_layout} pages ({KV_LAYOUTS[kv_layout]}): a page of TP "
                f"{tp_size} holds {held} of the {num_kv_heads} KV heads and a page "
                f"of TP {peer_tp_size} {theirs}, so the ranks write slices of "
                f"pages, which are not one byte range of them; {SLICEABLE}"
            )
        slices = _push_slices(tp_rank, tp_size, peer_tp_size, num_kv_heads)
    return PushMapping(tp_rank, tp_size, peer_tp_size, num_kv_heads, mla, slices)


def _latent_targets(tp_rank: int, tp_size: int, peer_tp_size: int) -> range:
    """The peer ranks whose one source rank (``rank * tp_size //
    peer_tp_size``) this rank is, for replicated latent pages."""
    if peer_tp_size >= tp_size:
        per_rank = peer_tp_size // tp_size
        return range(tp_rank * per_rank, (tp_rank + 1) * per_rank)
    if tp_rank % (tp_size // peer_tp_size):
        return range(0)  # an earlier rank of the same latent page writes it
    target = tp_rank * peer_tp_size // tp_size
    return range(target, target + 1)


def _push_slices(
    tp_rank: int, tp_size: int, peer_tp_size: int, num_kv_heads: int
) -> tuple[HeadSlice, ...]:
    """One slice per peer rank this rank gives heads to, as that peer rank's
    tp_mapping() reads them: the peer ranks whose heads lie in this rank's
    (peer TP at least this TP), or the one peer rank whose heads hold this
    rank's, unless a rank before this one among that peer rank's sources
    holds the same head (replication: the first of them gives it)."""
    held = rank_heads(tp_rank, tp_size, num_kv_heads)
    if peer_tp_size >= tp_size:
        per_rank = peer_tp_size // tp_size
        targets = range(tp_rank * per_rank, (tp_rank + 1) * per_rank)
    else:
        target = tp_rank * peer_tp_size // tp_size
        first_source = target * (tp_size // peer_tp_size)
        if (
            tp_rank != first_source
            and tp_size > num_kv_heads
            and tp_rank % (tp_size // num_kv_heads)
        ):
            return ()  # the rank before this one holds the same head
        targets = range(target, target + 1)
    slices = []
    for target in targets:
        theirs = rank_heads(target, peer_tp_size, num_kv_heads)
        first, stop = max(held.start, theirs.start), min(held.stop, theirs.stop)
        slices.append(
            HeadSlice(
                target,
                first - held.start,
                first - theirs.start,
                stop - first,
                len(held),
                len(theirs),
            )
        )
    return tuple(slices)


def uncached_suffix(device_spec: Any, remote_group_sizes: Any) -> GPULoadStoreSpec:
    """This engine's blocks of a request that a peer with a partial
    prefix-cache hit still needs: per group, the last
    ``remote_group_sizes[g]`` of the spec's ids.

    A decode engine that holds the front of a request in its prefix cache
    allocates blocks for the rest only, and sends their ids, group by group.
    This engine's spec covers the whole request, so the peer's id k of group
    g pairs with this engine's id ``len(group) - n + k`` (n the peer's ids in
    the group): the front is cut, never the end. Pairing them with the front
    writes the request's first blocks into the slots of its last ones (vLLM
    #48758's kind of failure). Plan with the result:
    ``plan_peer_transfer(uncached_suffix(spec, sizes), peer, remote_ids)``;
    given the whole spec and fewer remote ids, a plan raises a SpecError.

    Args:
        device_spec: this engine's blocks of the request, as for
            plan_peer_transfer() (a GPULoadStoreSpec or any object with its
            fields).
        remote_group_sizes: the peer's ids per group, one count per group of
            the spec, each from 0 to the group's ids here.

    Returns:
        A GPULoadStoreSpec of the kept ids (of the spec's dtype), its group
        sizes ``remote_group_sizes``, each group's ``block_indices`` moved
        past the blocks cut.

    Raises:
        SpecError: another number of groups, a count below 0 or above the
            group's ids here, group sizes that are not the ids'.
        InputTypeError: malformed input.
    """
    raw_ids, raw_sizes, raw_indices = attributes(
        device_spec, SPEC_FIELDS, "device_spec"
    )
    ids = block_ids_arg(raw_ids)
    sizes = [
        as_int(n, "group_sizes[{}]", g)
        for g, n in enumerate(as_list(raw_sizes, "group_sizes"))
    ]
    indices = [
        as_int(i, "block_indices[{}]", g)
        for g, i in enumerate(as_list(raw_indices, "block_indices"))
    ]
    remote = [
        as_int(n, "remote_group_sizes[{}]", g)
        for g, n in enumerate(as_list(remote_group_sizes, "remote_group_sizes"))
    ]
    if min(sizes, default=0) < 0 or sum(sizes) != len(ids):
        raise SpecError(
            f"group sizes {sizes} do not add up to the {len(ids)} block ids"
        )
    if len(indices) != len(sizes):
        raise SpecError(
            f"{len(indices)} block_indices for {len(sizes)} groups: one per group"
        )
    if len(remote) != len(sizes):
        raise SpecError(
            f"{len(remote)} remote group sizes for the spec's {len(sizes)} groups: "
            "one per group"
        )
    for g, (n, size) in enumerate(zip(remote, sizes)):
        if not 0 <= n <= size:
            raise SpecError(
                f"group {g}: the peer has {n} blocks of the request but this "
                f"engine {size}: a prefix hit leaves the peer at most as many"
            )
    stops = np.cumsum(sizes, dtype=np.int64)
    kept = [ids[stop - n : stop] for n, stop in zip(remote, stops.tolist())]
    block_ids = kept[0] if len(kept) == 1 else np.concatenate(kept or [ids[:0]])
    return GPULoadStoreSpec(
        block_ids,
        tuple(remote),
        tuple(i + size - n for i, size, n in zip(indices, sizes, remote)),
    )
