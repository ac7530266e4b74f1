"""Different TP on prefill and decode (SPEC 15), head by head: which peer
rank gives each KV head of a rank, in code of its own.

The fast path (ptrres._heads) intersects ranges of heads; this one walks the
model's heads one at a time, asks which ranks hold each, and groups a rank's
heads by the peer rank that gives them.
"""

from __future__ import annotations

from .._errors import InputTypeError, LayoutError
from .._heads import HND, NHD, HeadSlice, TPMapping
from ._input import as_int

# vLLM's KVCacheLayout names (vllm/v1/kv_cache_layout.py): the physical order
# of the logical [L, B, H, N, C]; HND and NHD are vLLM's aliases of two.
VLLM_LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
ALIASES = {HND: "LBHNC", NHD: "LBNHC"}


def read_layout(kv_layout: object) -> str:
    """A layout's physical order, by its name (InputTypeError otherwise)."""
    if not isinstance(kv_layout, str) or (
        kv_layout not in VLLM_LAYOUTS and kv_layout not in ALIASES
    ):
        raise InputTypeError(f"kv_layout {kv_layout!r} is no layout's name")
    return ALIASES.get(kv_layout, kv_layout)


def heads_are_a_byte_range(kv_layout: str | None) -> bool:
    """Whether a run of heads is one byte range of a page: a page is one
    layer of one block (L and B outside H), its heads outside its tokens."""
    if kv_layout is None:
        return True
    order = read_layout(kv_layout)
    head = order.index("H")
    return order.index("L") < head and order.index("B") < head < order.index("N")


def rank_heads(tp_rank: int, tp_size: int, num_kv_heads: int) -> range:
    """The heads rank ``tp_rank`` holds, walked one by one (as
    ptrres.rank_heads)."""
    names = ("tp_rank", "tp_size", "num_kv_heads")
    tp_rank, tp_size, num_kv_heads = (
        as_int(value, name)
        for value, name in zip((tp_rank, tp_size, num_kv_heads), names)
    )
    if min(tp_size, num_kv_heads) < 1 or not 0 <= tp_rank < tp_size:
        raise LayoutError(f"no such rank or heads: {tp_rank, tp_size, num_kv_heads}")
    if tp_size % num_kv_heads and num_kv_heads % tp_size:
        raise LayoutError(f"{num_kv_heads} KV heads over TP {tp_size}")
    mine = [h for h in range(num_kv_heads) if holds(tp_rank, tp_size, num_kv_heads, h)]
    return range(mine[0], mine[-1] + 1)


def holds(rank: int, tp_size: int, num_kv_heads: int, head: int) -> bool:
    """Whether rank ``rank`` of TP ``tp_size`` holds KV head ``head``."""
    if tp_size <= num_kv_heads:
        return head * tp_size // num_kv_heads == rank
    return rank * num_kv_heads // tp_size == head


def read_numbers(
    tp_rank: object,
    tp_size: object,
    peer_tp_size: object,
    num_kv_heads: object,
    mla: object,
    kv_layout: object,
) -> tuple[int, int, int, int]:
    """A mapping's numbers as ints, checked (as ptrres's tp_mapping and
    push_mapping check them): a rank of its TP, sizes and heads from 1 to
    2**16 (a mapping walks every rank and head), TP sizes of which one
    divides the other, MLA a bool, the layout a name."""
    names = ("tp_rank", "tp_size", "peer_tp_size", "num_kv_heads")
    values = (tp_rank, tp_size, peer_tp_size, num_kv_heads)
    numbers = tuple(as_int(value, name) for value, name in zip(values, names))
    rank, size, peer_size, heads = numbers
    if type(mla) is not bool:
        raise InputTypeError(f"mla must be True or False, got {mla!r}")
    read_layout(kv_layout)
    if min(size, peer_size, heads) < 1 or not 0 <= rank < size:
        raise LayoutError(f"no such rank or heads: {numbers}")
    if max(size, peer_size, heads) > 2**16:
        raise LayoutError(f"TP sizes or heads past 2**16: {numbers}")
    if size % peer_size and peer_size % size:
        raise LayoutError(f"TP {size} and {peer_size} do not divide")
    return rank, size, peer_size, heads


def tp_mapping(
    tp_rank: int,
    tp_size: int,
    peer_tp_size: int,
    num_kv_heads: int,
    *,
    mla: bool = False,
    kv_layout: str = HND,
) -> TPMapping:
    """The peer ranks that give rank ``tp_rank`` its heads, one HeadSlice
    each (as ptrres.tp_mapping)."""
    numbers = read_numbers(tp_rank, tp_size, peer_tp_size, num_kv_heads, mla, kv_layout)
    tp_rank, tp_size, peer_tp_size, num_kv_heads = numbers
    if mla:
        source = tp_rank * peer_tp_size // tp_size
        return TPMapping(*numbers, mla, (HeadSlice(source, 0, 0, 1, 1, 1),))
    for size in (tp_size, peer_tp_size):
        if size % num_kv_heads and num_kv_heads % size:
            raise LayoutError(f"{num_kv_heads} KV heads over TP {size}")
    heads = range(num_kv_heads)
    mine = [h for h in heads if holds(tp_rank, tp_size, num_kv_heads, h)]
    if tp_size >= peer_tp_size:
        candidates = range(
            tp_rank * peer_tp_size // tp_size, 1 + tp_rank * peer_tp_size // tp_size
        )
    else:
        per_rank = peer_tp_size // tp_size
        candidates = range(tp_rank * per_rank, (tp_rank + 1) * per_rank)
    # The first candidate that holds each of my heads gives it.
    giver = {
        h: next(s for s in candidates if holds(s, peer_tp_size, num_kv_heads, h))
        for h in mine
    }
    slices: list[HeadSlice] = []
    for slot, h in enumerate(mine):
        source = giver[h]
        theirs = [x for x in heads if holds(source, peer_tp_size, num_kv_heads, x)]
        if slices and slices[-1].source_rank == source:
            slices[-1] = slices[-1]._replace(num_heads=slices[-1].num_heads + 1)
        else:
            slices.append(
                HeadSlice(source, slot, theirs.index(h), 1, len(mine), len(theirs))
            )
    if not heads_are_a_byte_range(kv_layout) and any(
        not s.num_heads == s.local_heads == s.remote_heads for s in slices
    ):
        raise LayoutError(f"{kv_layout} pages cannot be head-sliced: {numbers}")
    return TPMapping(*numbers, mla, tuple(slices))
