"""Different TP on prefill and decode (SPEC 15): which KV heads a rank holds,
which ranks of the peer engine hold them, and where in each page.

Rank ``r`` of an engine at TP size ``T``, for a model of ``H`` KV heads, holds
heads ``[r * H / T, (r + 1) * H / T)`` when ``T <= H``; when ``T > H`` it holds
the one head ``r * H // T``, which ``T / H`` consecutive ranks share (GQA
replication). Its pages hold its heads outermost (HND: vLLM's ``LBHNC``), so a
run of heads is one byte range of every page. MLA's latent pages have no heads
to split: every rank holds the whole page.

tp_mapping() answers, for one rank of this engine (the one whose pages must end
up holding its heads: the decode rank that reads, or that a prefill rank
writes to), the peer ranks that hold its heads and one HeadSlice per peer
rank: the heads it fills of this rank's page and the heads it reads of the
peer rank's. No head is read twice, and every head of this rank is read once.
Only plain integers here: plan_peer_transfer and ptrres.nixl turn a slice into
bytes per ref (HeadSlice.byte_range).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from ._args import as_int
from ._errors import InputTypeError, LayoutError

# Where a page's heads lie: outermost (one byte range per run of heads) or
# innermost but for the channels (one fragment per token). vLLM takes these
# two as aliases of its LBHNC and LBNHC (VLLM_KV_CACHE_LAYOUT).
HND = "HND"
NHD = "NHD"

# The page layouts ptrres reads, by name: its own HND and NHD, and vLLM's
# KVCacheLayout members (vllm/v1/kv_cache_layout.py, the same in 0.30 to
# 0.34), each a physical order of the logical [L, B, H, N, C] (layer, block,
# head, token, content), which NixlAgentMetadata.kv_cache_layout names. The
# value is None where a run of a page's heads is one byte range of the page
# vLLM registers as a region (heads outermost in it), else why it is not.
KV_LAYOUTS: dict[str, str | None] = {
    HND: None,
    NHD: "heads inside each token: a run of heads is one fragment per token",
    # A region per layer, its page [H, N, C]: HND.
    "LBHNC": None,
    # A region per layer, its page [N, H, C]: NHD.
    "LBNHC": "heads inside each token (NHD): a run of heads is one fragment per token",
    # A layer is [H, B, N, C]: vLLM registers each head's plane of a layer
    # as a region of its own (a page is one head of one block), so a run of
    # heads is a choice of regions, not bytes of a page.
    "LHBNC": "heads outside blocks: each head of a layer is a region of its "
    "own, a page one head",
    # Block rows of every layer, [B, L, H, N, C]: a region per layer whose
    # page [H, N, C] is contiguous inside the row (stride the row): HND.
    "BLHNC": None,
    # Rows [B, L, N, H, C]: a layer's page is not contiguous, and vLLM
    # registers whole rows, every layer's tokens, as one page.
    "BLNHC": "heads inside each token of each layer (NHD), a whole block row "
    "of every layer a page",
    # Rows [B, H, L, N, C]: vLLM registers whole rows as one page, every
    # layer of each head, and any padding of the row with it; the handshake
    # does not say a row holds no padding, and vLLM does not head-split them.
    "BHLNC": "a whole block row of every layer a page, heads outside layers "
    "and the row's padding in it",
}
# The largest TP size or head count a mapping takes: a peer's handshake can
# say 2**62, and a mapping walks every rank and head.
MAX_TP_OR_HEADS = 2**16
# What a head slice needs, in errors that refuse one.
SLICEABLE = (
    "head-slice pages whose heads are outermost (vLLM's kv_cache_layout LBHNC "
    "or BLHNC, ptrres's 'HND'), or run both engines at the same TP (whole "
    "pages, any layout)"
)


def check_kv_layout(kv_layout: Any, what: str = "kv_layout") -> str:
    """A page layout's name, checked: one of KV_LAYOUTS.

    Raises:
        InputTypeError: anything else (another case, another type).
    """
    if not (isinstance(kv_layout, str) and kv_layout in KV_LAYOUTS):
        raise InputTypeError(
            f"{what} must be one of {', '.join(map(repr, KV_LAYOUTS))}, got "
            f"{kv_layout!r}"
        )
    return str(kv_layout)


def slices_heads(kv_layout: str | None) -> bool:
    """Whether a run of some of a page's heads is one byte range of it in
    pages of this layout (None: unknown, the caller's word that it is)."""
    return kv_layout is None or KV_LAYOUTS[kv_layout] is None


def rank_heads(tp_rank: int, tp_size: int, num_kv_heads: int) -> range:
    """The KV heads that rank ``tp_rank`` of an engine at TP ``tp_size``
    holds, in the order its pages hold them (SPEC 15).

    Raises:
        LayoutError: a rank outside its TP, a TP size or head count below 1,
            or heads that do not split over the TP size (naming the numbers,
            as tp_mapping does).
        InputTypeError: an argument that is not an integer.
    """
    tp_rank, tp_size, num_kv_heads = (
        as_int(value, name)
        for value, name in (
            (tp_rank, "tp_rank"),
            (tp_size, "tp_size"),
            (num_kv_heads, "num_kv_heads"),
        )
    )
    check_rank(tp_rank, tp_size, num_kv_heads)
    check_split(num_kv_heads, tp_size, "this engine")
    return _rank_heads(tp_rank, tp_size, num_kv_heads)


def check_rank(tp_rank: int, tp_size: int, num_kv_heads: int) -> None:
    """Refuse a TP size or head count below 1 (or above MAX_TP_OR_HEADS),
    or a rank outside its TP."""
    if not (1 <= tp_size <= MAX_TP_OR_HEADS and 1 <= num_kv_heads <= MAX_TP_OR_HEADS):
        raise LayoutError(
            f"tp_size {tp_size} and num_kv_heads {num_kv_heads} must each be from "
            f"1 to {MAX_TP_OR_HEADS}"
        )
    if not 0 <= tp_rank < tp_size:
        raise LayoutError(f"tp_rank {tp_rank} is not a rank of TP {tp_size}")


def check_split(num_kv_heads: int, tp_size: int, side: str) -> None:
    """Refuse heads that a TP size neither divides nor is divided by."""
    if max(tp_size, num_kv_heads) % min(tp_size, num_kv_heads):
        raise LayoutError(
            f"{num_kv_heads} KV heads do not split over TP {tp_size} ({side}): "
            "the TP size must divide the heads, or the heads the TP size"
        )


def _rank_heads(tp_rank: int, tp_size: int, num_kv_heads: int) -> range:
    """rank_heads() of checked numbers."""
    if tp_size <= num_kv_heads:
        per_rank = num_kv_heads // tp_size
        return range(tp_rank * per_rank, (tp_rank + 1) * per_rank)
    head = tp_rank * num_kv_heads // tp_size
    return range(head, head + 1)


class HeadSlice(NamedTuple):
    """What one peer rank gives this rank: ``num_heads`` heads, read at head
    slot ``remote_head`` of the peer rank's page, written at head slot
    ``local_head`` of this rank's page. A page of this rank holds
    ``local_heads`` heads, a page of the peer rank ``remote_heads``."""

    source_rank: int
    local_head: int
    remote_head: int
    num_heads: int
    local_heads: int
    remote_heads: int

    @property
    def whole_page(self) -> bool:
        """Whether the slice is every head of a page on both sides: a plain
        peer transfer, which any page layout allows."""
        return self.num_heads == self.local_heads == self.remote_heads

    def byte_range(self, local_page: int, remote_page: int) -> tuple[int, int, int]:
        """The slice in bytes, for a ref of pages ``local_page`` here and
        ``remote_page`` at the peer rank: ``(local_offset, remote_offset,
        size)``.

        Raises:
            LayoutError: a page that does not split into its heads, or a head
                of other bytes on the two sides.
        """
        local_offset, size = self.local_range(local_page)
        remote_offset, remote_size = self.remote_range(remote_page)
        if remote_size != size:
            head, remote_head = size // self.num_heads, remote_size // self.num_heads
            raise LayoutError(
                f"a head is {head} B in this rank's page ({local_page} B, "
                f"{self.local_heads} heads) but {remote_head} B in peer rank "
                f"{self.source_rank}'s ({remote_page} B, {self.remote_heads} heads): "
                f"its page must be {head * self.remote_heads} B"
            )
        return local_offset, remote_offset, size

    def local_range(self, page: int) -> tuple[int, int]:
        """``(offset, size)`` of the slice in a page of this rank."""
        heads = check_slice(self)
        head = _head_bytes(page, "this rank's", heads.local_heads)
        return heads.local_head * head, heads.num_heads * head

    def remote_range(self, page: int) -> tuple[int, int]:
        """``(offset, size)`` of the slice in a page of the peer rank."""
        heads = check_slice(self)
        head = _head_bytes(page, f"peer rank {heads.source_rank}'s", heads.remote_heads)
        return heads.remote_head * head, heads.num_heads * head


def check_slice(heads: Any) -> HeadSlice:
    """A HeadSlice with its fields checked (one may be made by hand): integers,
    at least one head, and its heads inside the pages of both sides, so that
    no copy of it addresses outside a page.

    Raises:
        InputTypeError: not a HeadSlice, or a field not an integer.
        LayoutError: a slice of no heads, or heads outside a page.
    """
    if not isinstance(heads, HeadSlice):
        raise InputTypeError(
            f"heads must be a HeadSlice (of ptrres.tp_mapping()) or None, got "
            f"{type(heads).__name__}"
        )
    checked = heads
    if not all(type(value) is int for value in heads):
        checked = HeadSlice._make(
            as_int(value, "heads.{}", name) for value, name in zip(heads, heads._fields)
        )
    if checked.source_rank < 0 or checked.num_heads < 1:
        raise LayoutError(
            f"{heads}: a slice is at least one head of a peer rank (>= 0)"
        )
    for side, first, held in (
        ("this rank's", checked.local_head, checked.local_heads),
        ("the peer rank's", checked.remote_head, checked.remote_heads),
    ):
        if first < 0 or first + checked.num_heads > held:
            raise LayoutError(
                f"{heads}: heads {first} to {first + checked.num_heads - 1} are "
                f"not heads of {side} page of {held} heads"
            )
    return checked


def _head_bytes(page: int, whose: str, heads: int) -> int:
    """Bytes of one head in a page of ``heads`` heads."""
    if page % heads:
        raise LayoutError(
            f"{whose} page of {page} B does not split into its {heads} heads"
        )
    return page // heads


@dataclass(frozen=True)
class TPMapping:
    """tp_mapping()'s answer: the peer ranks one rank reads its heads from.

    ``slices[i]`` is what peer rank ``source_ranks[i]`` gives; one transfer
    (one NIXL agent) per slice.
    """

    tp_rank: int
    tp_size: int
    peer_tp_size: int
    num_kv_heads: int
    mla: bool
    slices: tuple[HeadSlice, ...]

    @property
    def source_ranks(self) -> tuple[int, ...]:
        """The peer ranks this rank reads from, in the order of its heads."""
        return tuple(s.source_rank for s in self.slices)

    def slice_of(self, source_rank: int) -> HeadSlice:
        """The slice peer rank ``source_rank`` gives."""
        for s in self.slices:
            if s.source_rank == source_rank:
                return s
        raise LayoutError(
            f"peer rank {source_rank} holds none of rank {self.tp_rank}'s heads; "
            f"its source ranks are {list(self.source_ranks)}"
        )


def tp_mapping(
    tp_rank: int,
    tp_size: int,
    peer_tp_size: int,
    num_kv_heads: int,
    *,
    mla: bool = False,
    kv_layout: str = HND,
) -> TPMapping:
    """The peer ranks that hold this rank's KV heads, and the slice of pages
    each one gives (SPEC 15).

    Args:
        tp_rank: this rank, ``0 <= tp_rank < tp_size``.
        tp_size: this engine's tensor parallelism.
        peer_tp_size: the peer engine's; one of the two divides the other.
        num_kv_heads: the model's KV heads over all ranks; each TP size splits
            them evenly (``H % T == 0``) or replicates them (``T % H == 0``).
        mla: replicated latent pages (MLA): one source rank, the whole page.
        kv_layout: the pages' layout, the same on both sides: ``"HND"``
            (heads outermost) or ``"NHD"`` (heads inside each token), or a
            vLLM KVCacheLayout name (``"LBHNC"``, ``"LBNHC"``, ``"LHBNC"``,
            ``"BLHNC"``, ``"BLNHC"``, ``"BHLNC"``: a PeerLayout's
            ``kv_layout``). A slice of the heads is one byte range of HND,
            LBHNC and BLHNC pages only: other layouts are refused unless
            every slice is a whole page.

    Raises:
        LayoutError: a combination that cannot be, naming the numbers.
        InputTypeError: an argument of the wrong type.
    """
    tp_rank, tp_size, peer_tp_size, num_kv_heads, kv_layout = check_tp(
        tp_rank, tp_size, peer_tp_size, num_kv_heads, mla, kv_layout, "come from"
    )
    if mla:
        source = tp_rank * peer_tp_size // tp_size
        slices: tuple[HeadSlice, ...] = (HeadSlice(source, 0, 0, 1, 1, 1),)
    else:
        for side, size in (("this engine", tp_size), ("the peer", peer_tp_size)):
            check_split(num_kv_heads, size, side)
        slices = _head_slices(tp_rank, tp_size, peer_tp_size, num_kv_heads)
        if not slices_heads(kv_layout) and not all(s.whole_page for s in slices):
            raise LayoutError(
                f"{kv_layout} pages ({KV_LAYOUTS[kv_layout]}): rank {tp_rank} of "
                f"TP {tp_size} reads {slices[0].num_heads} of the "
                f"{slices[0].remote_heads} heads of a page of TP {peer_tp_size}, "
                f"which are not one byte range of it; {SLICEABLE}"
            )
    return TPMapping(tp_rank, tp_size, peer_tp_size, num_kv_heads, mla, slices)


def check_tp(
    tp_rank: Any,
    tp_size: Any,
    peer_tp_size: Any,
    num_kv_heads: Any,
    mla: Any,
    kv_layout: Any,
    flow: str,
) -> tuple[int, int, int, int, str]:
    """tp_mapping()'s and push_mapping()'s numbers, checked: integers, each
    size and the heads from 1 to MAX_TP_OR_HEADS (a peer's handshake can say
    2**62, and a mapping walks its ranks and heads), the rank one of its TP,
    TP sizes of which one divides the other; a layout's name. ``flow``
    says which way a rank's heads go ("come from", "go to"), for the error.

    Returns:
        The four numbers as ints, and the layout's name.
    """
    tp_rank, tp_size, peer_tp_size, num_kv_heads = (
        as_int(value, name)
        for value, name in (
            (tp_rank, "tp_rank"),
            (tp_size, "tp_size"),
            (peer_tp_size, "peer_tp_size"),
            (num_kv_heads, "num_kv_heads"),
        )
    )
    if type(mla) is not bool:
        raise InputTypeError(f"mla must be True or False, got {mla!r}")
    kv_layout = check_kv_layout(kv_layout)
    sizes = (tp_size, peer_tp_size, num_kv_heads)
    if not all(1 <= size <= MAX_TP_OR_HEADS for size in sizes):
        raise LayoutError(
            f"tp_size {tp_size}, peer_tp_size {peer_tp_size} and num_kv_heads "
            f"{num_kv_heads} must each be from 1 to {MAX_TP_OR_HEADS}"
        )
    if not 0 <= tp_rank < tp_size:
        raise LayoutError(f"tp_rank {tp_rank} is not a rank of TP {tp_size}")
    if max(tp_size, peer_tp_size) % min(tp_size, peer_tp_size):
        raise LayoutError(
            f"TP {tp_size} here and TP {peer_tp_size} at the peer: neither divides "
            f"the other, so a rank's heads do not {flow} whole ranks of the other"
        )
    return tp_rank, tp_size, peer_tp_size, num_kv_heads, kv_layout


def _head_slices(
    tp_rank: int, tp_size: int, peer_tp_size: int, num_kv_heads: int
) -> tuple[HeadSlice, ...]:
    """One slice per peer rank that gives this rank heads: the peer ranks
    whose heads overlap this rank's, each giving the heads no earlier one
    gave (so that of the ranks that share a head, the first reads it)."""
    local = _rank_heads(tp_rank, tp_size, num_kv_heads)
    if tp_size >= peer_tp_size:
        # This rank's heads lie in one peer rank's (several of this
        # engine's ranks read one peer rank).
        source = tp_rank * peer_tp_size // tp_size
        candidates = range(source, source + 1)
    else:
        # Several peer ranks' heads make up this rank's.
        per_rank = peer_tp_size // tp_size
        candidates = range(tp_rank * per_rank, (tp_rank + 1) * per_rank)
    slices = []
    next_head = local.start
    source = candidates.start
    while source < candidates.stop and next_head < local.stop:
        held = _rank_heads(source, peer_tp_size, num_kv_heads)
        first, stop = max(held.start, next_head), min(held.stop, local.stop)
        if first < stop:
            slices.append(
                HeadSlice(
                    source,
                    first - local.start,
                    first - held.start,
                    stop - first,
                    len(local),
                    len(held),
                )
            )
            next_head = stop
        # The next peer rank that holds a head not yet given (ranks that
        # replicate a head given already give nothing: skip them all).
        source = max(source + 1, _first_holder(next_head, peer_tp_size, num_kv_heads))
    assert next_head == local.stop, (tp_rank, tp_size, peer_tp_size, num_kv_heads)
    return tuple(slices)


def _first_holder(head: int, tp_size: int, num_kv_heads: int) -> int:
    """The first rank of TP ``tp_size`` that holds KV head ``head``."""
    if tp_size <= num_kv_heads:
        return head // (num_kv_heads // tp_size)
    return head * (tp_size // num_kv_heads)
