"""A push that crosses TP (SPEC 15, issue 40), without NIXL.

push_mapping() against the reference's head-by-head one and against
tp_mapping() turned round, over the whole grid (prefill and decode TP in
{1, 2, 4, 8}, 1 to 16 KV heads, every prefill rank, MLA or not). Then the
bytes, with the head oracle (tests/head_oracle.py, which shares nothing with
either mapping): every rank of both engines in host memory, built from one
logical KV per layer of a hybrid model (two groups, other block counts,
padded rows, guard zones); every prefill rank WRITEs each slice of its
push_mapping() to its decode rank (plain plans, coalesced plans, prepared
lists and indices, executed by ptrres.reference.execute_descriptors), and
then every decode rank's pages of the written blocks are its shard of the
prefill KV, every other byte as it was. A partial prefix hit
(uncached_suffix). Then every impossible input, and a fuzz of the push path
with hostile peer numbers: only ptrres's errors, no descriptor outside what
the peer declared, nothing that runs away. tests/nixl moves the same
slices with real NIXL agents.
"""

from __future__ import annotations

import math
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import hypothesis.strategies as st
import numpy as np
import numpy.typing as npt
import pytest
from head_oracle import expected_pages, logical_kv, rank_pages, shard
from hypothesis import example, given, settings

import ptrres
import ptrres.nixl
from ptrres import reference

TP_SIZES = (1, 2, 4, 8)
KV_HEADS = tuple(range(1, 17))
# MLA's mapping does not depend on the heads: two counts show it.
MLA_HEADS = (1, 3)
MODES = ("plain", "coalesced", "prepared")

Bytes = npt.NDArray[np.uint8]
IdArray = npt.NDArray[np.int64]


def grid() -> list[tuple[int, int, int, bool]]:
    """Every (prefill TP, decode TP, KV heads, MLA) of issue 34's grid."""
    return [
        (prefill_tp, decode_tp, heads, mla)
        for prefill_tp in TP_SIZES
        for decode_tp in TP_SIZES
        for mla in (False, True)
        for heads in (MLA_HEADS if mla else KV_HEADS)
    ]


def turned(heads: ptrres.HeadSlice, rank: int) -> ptrres.HeadSlice:
    """A read's slice as the write of it: the peer rank ``rank`` (the reader),
    local and remote swapped."""
    return ptrres.HeadSlice(
        rank,
        heads.remote_head,
        heads.local_head,
        heads.num_heads,
        heads.remote_heads,
        heads.local_heads,
    )


def reads_by_source(
    prefill_tp: int, decode_tp: int, heads: int, mla: bool, kv_layout: str
) -> dict[int, list[ptrres.HeadSlice]]:
    """Every decode rank's tp_mapping() slices, turned into writes and
    filed under the prefill rank they come from, in decode rank order."""
    writes: dict[int, list[ptrres.HeadSlice]] = {}
    for rank in range(decode_tp):
        mapping = ptrres.tp_mapping(
            rank, decode_tp, prefill_tp, heads, mla=mla, kv_layout=kv_layout
        )
        for s in mapping.slices:
            writes.setdefault(s.source_rank, []).append(turned(s, rank))
    return writes


# The mapping -----------------------------------------------------------------


def test_the_push_mapping_is_the_references_and_the_reads_turned_round() -> None:
    """On the whole grid, HND and NHD: push_mapping() is the reference's,
    each prefill rank's slices are exactly the decode ranks' reads from it
    turned round, and it refuses exactly where tp_mapping() does, with the
    same error."""
    checked = refused = 0
    for prefill_tp, decode_tp, heads, mla in grid():
        for kv_layout in ("HND", "NHD"):
            try:
                reads: dict[int, list[ptrres.HeadSlice]] | None = reads_by_source(
                    prefill_tp, decode_tp, heads, mla, kv_layout
                )
                read_error = ""
            except ptrres.LayoutError as error:
                reads, read_error = None, type(error).__name__
            for rank in range(prefill_tp):
                args = (rank, prefill_tp, decode_tp, heads)
                if reads is None:
                    # Refused as the reads are, by the reference too.
                    with pytest.raises(ptrres.LayoutError) as raised:
                        ptrres.push_mapping(*args, mla=mla, kv_layout=kv_layout)
                    assert type(raised.value).__name__ == read_error
                    with pytest.raises(ptrres.LayoutError):
                        reference.push_mapping(*args, mla=mla, kv_layout=kv_layout)
                    refused += 1
                    continue
                mapping = ptrres.push_mapping(*args, mla=mla, kv_layout=kv_layout)
                assert mapping == reference.push_mapping(
                    *args, mla=mla, kv_layout=kv_layout
                )
                assert list(mapping.slices) == reads.get(rank, []), (args, mla)
                assert mapping.target_ranks == tuple(sorted(mapping.target_ranks))
                for s in mapping.slices:
                    assert mapping.slice_of(s.source_rank) is s
                checked += 1
    # Every case of the grid, once per layout, is one or the other.
    assert checked + refused == 2 * sum(p for p, _, _, _ in grid())
    assert checked > 0
    assert refused > 0


@pytest.mark.parametrize(
    ("args", "mla", "targets", "slices"),
    [
        # Prefill TP 1 to decode TP 2, 4 heads: each decode rank its half.
        ((0, 1, 2, 4), False, (0, 1), [(0, 0, 0, 2, 4, 2), (1, 2, 0, 2, 4, 2)]),
        # Prefill TP 2 to decode TP 1: rank 1's two heads into slots 2-3.
        ((1, 2, 1, 4), False, (0,), [(0, 0, 2, 2, 2, 4)]),
        # Decode TP 4 over 2 heads (SGLang #31295's shape): each head to both
        # decode ranks that replicate it.
        ((0, 1, 4, 2), False, (0, 1, 2, 3), [(0, 0, 0, 1, 2, 1), (1, 0, 0, 1, 2, 1),
                                              (2, 1, 0, 1, 2, 1), (3, 1, 0, 1, 2, 1)]),
        # Prefill TP 4 over 2 heads: rank 1 holds rank 0's head, which rank 0
        # writes; rank 2 writes head 1 into slot 1.
        ((1, 4, 1, 2), False, (), []),
        ((2, 4, 1, 2), False, (0,), [(0, 0, 1, 1, 1, 2)]),
        # MLA: the whole page to every decode rank it is the source of.
        ((0, 2, 8, 1), True, (0, 1, 2, 3), [(d, 0, 0, 1, 1, 1) for d in range(4)]),
        ((3, 4, 2, 1), True, (), []),
        ((2, 4, 2, 1), True, (1,), [(1, 0, 0, 1, 1, 1)]),
    ],
)  # fmt: skip
def test_the_issues_cases_by_hand(
    args: tuple[int, int, int, int],
    mla: bool,
    targets: tuple[int, ...],
    slices: list[tuple[int, ...]],
) -> None:
    mapping = ptrres.push_mapping(*args, mla=mla)
    assert mapping.target_ranks == targets
    assert [tuple(s) for s in mapping.slices] == slices
    assert (mapping.tp_rank, mapping.tp_size) == args[:2]
    assert (mapping.peer_tp_size, mapping.num_kv_heads, mapping.mla) == (
        args[2],
        args[3],
        mla,
    )


def test_a_rank_that_writes_nothing_says_which_ranks_it_writes() -> None:
    mapping = ptrres.push_mapping(1, 4, 1, 2)
    with pytest.raises(ptrres.LayoutError, match=r"its target ranks are \[\]"):
        mapping.slice_of(0)
    with pytest.raises(ptrres.LayoutError, match=r"peer rank 2's heads.*\[0, 1\]"):
        ptrres.push_mapping(0, 1, 2, 4).slice_of(2)


# The bytes: every rank of both engines in host memory --------------------------

TOKENS = 2
GUARD = 16


@dataclass(frozen=True)
class GroupShape:
    """One KV-cache group of the model: its layers' bytes per head and token,
    each engine's blocks, and the ids of a push: prefill ids, decode ids."""

    head_bytes: tuple[int, ...]
    prefill_blocks: int
    decode_blocks: int
    # Bytes of padding after each row, on each engine.
    prefill_pad: int
    decode_pad: int
    # The layers views of one allocation (back to back, unpadded rows).
    shared: bool
    prefill_ids: tuple[int, ...]
    decode_ids: tuple[int, ...]


# A hybrid model: group 0 two layers in one allocation, group 1 one layer of
# padded rows; other block counts on the two engines and in the two groups.
# Ids: a run up on both sides, the last prefill block to decode block 0; a
# run down, a repeat of a prefill block into two decode blocks.
HYBRID = (
    GroupShape((4, 6), 7, 6, 0, 0, True, (0, 1, 2, 6), (3, 4, 5, 0)),
    GroupShape((8,), 5, 9, 3, 5, False, (4, 3, 0, 0), (8, 7, 1, 2)),
)


@dataclass
class RankMemory:
    """One rank's KV caches in host memory: its allocations, each between
    guard zones, and where each ref's rows lie."""

    buffers: list[Bytes] = field(default_factory=list)
    tensors: list[ptrres.CanonicalKVCacheTensor] = field(default_factory=list)
    refs: list[list[ptrres.CanonicalKVCacheRef]] = field(default_factory=list)
    # Per group, per layer: (buffer, first byte of block 0, row stride, page).
    places: list[list[tuple[int, int, int, int]]] = field(default_factory=list)

    def table(self) -> ptrres.PointerTable:
        return ptrres.PointerTable(ptrres.CanonicalKVCaches(self.tensors, self.refs))

    def rows(self, buffers: list[Bytes], g: int, d: int, blocks: int) -> Bytes:
        """Layer d of group g's pages in ``buffers`` (a view)."""
        b, start, stride, page = self.places[g][d]
        rows = buffers[b][start : start + blocks * stride].reshape(blocks, stride)
        return rows[:, :page]


def rank_memory(
    pages: list[list[Bytes]],
    shapes: tuple[GroupShape, ...],
    prefill: bool,
    rng: np.random.Generator,
) -> RankMemory:
    """A rank's caches: per group, per layer, these pages, rows padded,
    allocations (a layer's, or a group's shared one) of random bytes around
    them."""
    memory = RankMemory()
    for layers, shape in zip(pages, shapes):
        pad = (
            0 if shape.shared else (shape.prefill_pad if prefill else shape.decode_pad)
        )
        strides = [p.shape[1] + pad for p in layers]
        sizes = [len(p) * s for p, s in zip(layers, strides)]
        spans = [sizes] if shape.shared else [[size] for size in sizes]
        starts: list[int] = []
        first_buffer = len(memory.buffers)
        for span in spans:
            buffer = rng.integers(0, 256, GUARD + sum(span) + GUARD, dtype=np.uint8)
            starts += [GUARD + int(a) for a in np.cumsum([0, *span[:-1]])]
            memory.buffers.append(buffer)
        refs, places = [], []
        for d, (page, stride, start) in enumerate(zip(layers, strides, starts)):
            b = first_buffer if shape.shared else first_buffer + d
            blocks, width = page.shape
            places.append((b, start, stride, width))
            rows = memory.buffers[b][start : start + blocks * stride]
            rows = rows.reshape(blocks, stride)
            rows[:, :width] = page
            refs.append(ptrres.CanonicalKVCacheRef(len(memory.tensors), width))
            memory.tensors.append(
                ptrres.CanonicalKVCacheTensor(rows[:, :width], stride)
            )
        memory.refs.append(refs)
        memory.places.append(places)
    return memory


def expand(rows: ptrres.nixl.PreppedRows) -> tuple[IdArray, IdArray]:
    """A prepared list's descriptors: each strided row ``(base, page, devId,
    stride, count)`` as its ``count`` addresses, and their sizes."""
    addresses = [np.zeros(0, np.int64)]
    sizes = [np.zeros(0, np.int64)]
    for base, page, _, stride, count in rows.xfer_list.tolist():
        addresses.append(base + np.arange(count, dtype=np.int64) * stride)
        sizes.append(np.full(count, page, np.int64))
    return np.concatenate(addresses), np.concatenate(sizes)


def named(rows: ptrres.nixl.PreppedRows, indices: Any) -> tuple[IdArray, IdArray]:
    """The addresses and sizes of a prepared list's descriptors ``indices``
    (descriptor i of strided row r, ``(base, page, devId, stride, count)``,
    is ``base + (i - first(r)) * stride``), without expanding every row."""
    table = rows.xfer_list.astype(object)  # addresses may pass int64 at the end
    counts = np.asarray(rows.xfer_list[:, 4], np.int64)
    firsts = np.cumsum(counts) - counts
    row = np.searchsorted(firsts, np.asarray(indices, np.int64), side="right") - 1
    addresses = [
        int(table[r, 0]) + (int(i) - int(firsts[r])) * int(table[r, 3])
        for r, i in zip(row.tolist(), np.asarray(indices).tolist())
    ]
    return np.array(addresses, np.int64), rows.xfer_list[row, 1].astype(np.int64)


Descriptors = tuple[Any, Any, Any]


def push_descriptors(
    table: ptrres.PointerTable,
    peer: ptrres.PeerLayout,
    heads: ptrres.HeadSlice,
    spec: ptrres.GPULoadStoreSpec,
    remote_ids: Any,
    mode: str,
) -> Descriptors:
    """``(local, remote, sizes)`` of one WRITE of a slice: a plan's, plain or
    coalesced, or what prepped_pair's lists and prepped_indices' indices
    name, as NIXL's make_prepped_xfer reads them."""
    if mode != "prepared":
        plan = table.plan_peer_transfer(
            spec, peer, remote_ids, heads=heads, coalesce=mode == "coalesced"
        )
        assert plan.num_bytes == int(plan.sizes.sum())
        return plan.local, plan.remote, plan.sizes
    local_rows, remote_rows = ptrres.nixl.prepped_pair(table, peer, heads)
    local_addresses, local_sizes = expand(local_rows)
    remote_addresses, remote_sizes = expand(remote_rows)
    local_indices = ptrres.nixl.prepped_indices(table, spec)
    remote_indices = ptrres.nixl.prepped_indices(peer, remote_ids, spec.group_sizes)
    sizes = local_sizes[local_indices]
    np.testing.assert_array_equal(sizes, remote_sizes[remote_indices])
    return local_addresses[local_indices], remote_addresses[remote_indices], sizes


@dataclass
class Engines:
    """Both engines of one grid case in host memory: prefill ranks holding
    their shards of one logical KV per layer, decode ranks of random bytes,
    the prefill ranks' tables and the decode ranks' layouts as their
    handshakes say them (PeerLayout.of)."""

    prefill_tp: int
    decode_tp: int
    num_kv_heads: int
    mla: bool
    shapes: tuple[GroupShape, ...]
    logical: list[list[Bytes]]
    prefill: list[RankMemory]
    decode: list[RankMemory]
    tables: list[ptrres.PointerTable]
    peers: list[ptrres.PeerLayout]

    def decode_heads(self, rank: int) -> list[int]:
        return shard(rank, self.decode_tp, self.num_kv_heads, self.mla)

    @property
    def buffers(self) -> list[Bytes]:
        return [b for rank in (*self.prefill, *self.decode) for b in rank.buffers]

    def expected(
        self, prefill_ids: list[list[int]], decode_ids: list[list[int]]
    ) -> list[list[Bytes]]:
        """Every decode rank's allocations after prefill blocks
        ``prefill_ids`` were written into its ``decode_ids``, group by group
        (the oracle: its shard of those blocks; every other byte as now)."""
        expected = []
        for r, rank in enumerate(self.decode):
            heads = self.decode_heads(r)
            after = [b.copy() for b in rank.buffers]
            for g, shape in enumerate(self.shapes):
                for d in range(len(shape.head_bytes)):
                    rows = rank.rows(after, g, d, shape.decode_blocks)
                    rows[:] = expected_pages(
                        rows.copy(),
                        self.logical[g][d],
                        heads,
                        decode_ids[g],
                        prefill_ids[g],
                    )
            expected.append(after)
        return expected

    def page_bytes(self, rank: int) -> list[int]:
        """Bytes of one block of each group of decode rank ``rank``, over
        its layers."""
        return [sum(place[3] for place in group) for group in self.decode[rank].places]


def engines(
    prefill_tp: int,
    decode_tp: int,
    num_kv_heads: int,
    mla: bool,
    shapes: tuple[GroupShape, ...] = HYBRID,
    seed: int = 0,
) -> Engines:
    rng = np.random.default_rng(seed)
    logical = [
        [
            logical_kv(shape.prefill_blocks, num_kv_heads, TOKENS, b, seed + 10 * g + d)
            for d, b in enumerate(shape.head_bytes)
        ]
        for g, shape in enumerate(shapes)
    ]
    prefill = [
        rank_memory(
            [
                [
                    rank_pages(kv, shard(r, prefill_tp, num_kv_heads, mla))
                    for kv in layers
                ]
                for layers in logical
            ],
            shapes,
            True,
            rng,
        )
        for r in range(prefill_tp)
    ]
    decode = []
    for r in range(decode_tp):
        width = len(shard(r, decode_tp, num_kv_heads, mla)) * TOKENS
        pages = [
            [
                rng.integers(0, 256, (shape.decode_blocks, width * b), dtype=np.uint8)
                for b in shape.head_bytes
            ]
            for shape in shapes
        ]
        decode.append(rank_memory(pages, shapes, False, rng))
    return Engines(
        prefill_tp, decode_tp, num_kv_heads, mla, shapes, logical, prefill, decode,
        [rank.table() for rank in prefill],
        [ptrres.PeerLayout.of(rank.table()) for rank in decode],
    )  # fmt: skip


@dataclass
class Coverage:
    """What the oracle test checked, for the summary."""

    cases: set[tuple[int, int, int, bool]] = field(default_factory=set)
    transfers: int = 0
    bytes_moved: int = 0
    bytes_checked: int = 0


def push_all(
    made: Engines,
    prefill_ids: list[list[int]],
    decode_ids: list[list[int]],
    mode: str,
    coverage: Coverage,
    tamper: Callable[[ptrres.HeadSlice], ptrres.HeadSlice] | None = None,
    meant_ids: list[list[int]] | None = None,
) -> None:
    """Every prefill rank WRITEs every slice of its push_mapping(), then
    every byte of every rank is checked against the oracle (which expects
    the prefill blocks ``meant_ids``, by default those written)."""
    spec = ptrres.GPULoadStoreSpec(
        np.array([i for ids in prefill_ids for i in ids], np.int64),
        [len(ids) for ids in prefill_ids],
    )
    remote_ids = np.array([i for ids in decode_ids for i in ids], np.int64)
    before = [b.copy() for b in made.buffers]
    expected = made.expected(meant_ids or prefill_ids, decode_ids)
    written = [0] * made.decode_tp
    for p, table in enumerate(made.tables):
        mapping = ptrres.push_mapping(
            p, made.prefill_tp, made.decode_tp, made.num_kv_heads, mla=made.mla
        )
        for heads in mapping.slices:
            if tamper is not None:
                heads = tamper(heads)
            local, remote, sizes = push_descriptors(
                table, made.peers[heads.source_rank], heads, spec, remote_ids, mode
            )
            # A WRITE: this rank's bytes into the peer rank's.
            reference.execute_descriptors(local, remote, sizes, within=made.buffers)
            written[heads.source_rank] += int(np.sum(sizes))
            coverage.transfers += 1
    n_prefill = sum(len(rank.buffers) for rank in made.prefill)
    for buffer, saved in zip(made.buffers[:n_prefill], before[:n_prefill]):
        np.testing.assert_array_equal(buffer, saved, err_msg=f"{mode}: prefill side")
    for r, (rank, after) in enumerate(zip(made.decode, expected)):
        for b, (buffer, want) in enumerate(zip(rank.buffers, after)):
            np.testing.assert_array_equal(
                buffer, want, err_msg=f"{mode}: decode rank {r}, allocation {b}"
            )
    for r in range(made.decode_tp):
        # Each byte of the rank's written blocks once: no head twice.
        need = sum(len(ids) * b for ids, b in zip(decode_ids, made.page_bytes(r)))
        assert written[r] == need, f"{mode}: decode rank {r} written {written[r]} B"
    coverage.bytes_moved += sum(written)
    coverage.bytes_checked += sum(b.nbytes for b in made.buffers)
    for buffer, saved in zip(made.buffers, before):
        buffer[:] = saved


COVERAGE = Coverage()


@pytest.mark.parametrize("prefill_tp", TP_SIZES)
def test_every_decode_rank_ends_with_its_shard_after_every_prefill_rank_writes(
    prefill_tp: int,
) -> None:
    """THE push oracle, on the whole grid: every prefill rank WRITEs each of
    its slices (plain plans, coalesced plans, prepared lists), and then every
    decode rank's pages of the written blocks are its shard of the prefill
    KV, each byte written once, every other byte as it was."""
    prefill_ids = [list(shape.prefill_ids) for shape in HYBRID]
    decode_ids = [list(shape.decode_ids) for shape in HYBRID]
    for case in grid():
        if case[0] != prefill_tp:
            continue
        try:
            ptrres.push_mapping(0, *case[:3], mla=case[3])
        except ptrres.LayoutError:
            continue
        made = engines(*case, seed=sum(case))
        for mode in MODES:
            push_all(made, prefill_ids, decode_ids, mode, COVERAGE)
        COVERAGE.cases.add(case)


def test_the_oracle_rejects_a_push_one_head_off() -> None:
    """The oracle has teeth: a prefill rank that writes into the other head
    slot of a decode page (MoRIIO #47764's kind of bug, every prefill rank
    into the same place), or only the first replica of a head, fails it."""
    made = engines(2, 1, 2, False)
    ids = [list(s.prefill_ids) for s in HYBRID], [list(s.decode_ids) for s in HYBRID]

    def same_slot(heads: ptrres.HeadSlice) -> ptrres.HeadSlice:
        return heads._replace(remote_head=0)

    with pytest.raises(AssertionError, match="decode rank 0"):
        push_all(made, *ids, "plain", Coverage(), tamper=same_slot)
    made = engines(1, 4, 2, False)

    def first_replica(heads: ptrres.HeadSlice) -> ptrres.HeadSlice:
        return heads._replace(source_rank=heads.source_rank // 2 * 2)

    with pytest.raises(AssertionError, match="decode rank 1"):
        push_all(made, *ids, "prepared", Coverage(), tamper=first_replica)


def test_summary(capsys: pytest.CaptureFixture[str]) -> None:
    """What the oracle covered (after the grid test; alone, the grid once
    more), printed in pytest's output."""
    if not COVERAGE.cases:
        for prefill_tp in TP_SIZES:
            test_every_decode_rank_ends_with_its_shard_after_every_prefill_rank_writes(
                prefill_tp
            )
    pairs = {(p, d) for p, d, _, _ in COVERAGE.cases}
    with capsys.disabled():
        print(
            f"\npush oracle (no NIXL): {len(COVERAGE.cases)} cases ({len(pairs)} TP "
            f"pairs, KV heads {min(KV_HEADS)}-{max(KV_HEADS)} and MLA), "
            f"{COVERAGE.transfers} transfers in {len(MODES)} modes, "
            f"{COVERAGE.bytes_moved} B written, {COVERAGE.bytes_checked} B checked"
        )
    assert len(pairs) == len(TP_SIZES) ** 2
    assert COVERAGE.bytes_moved > 0


# A partial prefix hit -----------------------------------------------------------


def test_a_partial_prefix_hit_writes_the_request_end_into_the_decode_blocks() -> None:
    """The decode engine holds the request's first blocks (a prefix-cache
    hit) and sends ids for the rest: uncached_suffix() pairs them with the
    end of the prefill engine's blocks, group by group, and the oracle finds
    each decode block holding the right prefill block's shard. Pairing them
    with the front (vLLM #48758's kind of failure) fails the oracle; the
    whole spec against fewer remote ids is refused."""
    made = engines(2, 4, 4, False)
    # The request's blocks on the prefill engine, per group; the decode
    # engine has cached the first 3 of group 0 and the first 1 of group 1.
    request = [[6, 5, 0, 1, 2, 3], [4, 0, 3]]
    decode_ids = [[4, 1, 0], [8, 2]]
    spec = ptrres.GPULoadStoreSpec(
        np.array([i for ids in request for i in ids], np.int32),
        [len(ids) for ids in request],
        [0, 0],
    )
    sizes = [len(ids) for ids in decode_ids]
    suffix = ptrres.uncached_suffix(spec, sizes)
    assert suffix.block_ids.tolist() == [1, 2, 3, 0, 3]
    assert suffix.block_ids.dtype == np.int32
    assert (suffix.group_sizes, suffix.block_indices) == ((3, 2), (3, 1))
    kept = reference.uncached_suffix(spec, sizes)
    assert kept.block_ids.tolist() == suffix.block_ids.tolist()
    assert (kept.group_sizes, kept.block_indices) == ((3, 2), (3, 1))
    kept_ids = [[1, 2, 3], [0, 3]]
    for mode in MODES:
        push_all(made, kept_ids, decode_ids, mode, Coverage())
    # The front of the request into the decode blocks: the wrong bytes.
    front = [ids[: len(d)] for ids, d in zip(request, decode_ids)]
    with pytest.raises(AssertionError, match="decode rank 0"):
        push_all(made, front, decode_ids, "plain", Coverage(), meant_ids=kept_ids)
    # The whole request against the decode engine's ids: refused.
    peer = made.peers[0]
    heads = ptrres.push_mapping(0, 2, 4, 4).slices[0]
    remote = np.array([i for ids in decode_ids for i in ids])
    with pytest.raises(ptrres.SpecError, match="5 remote ids but 9 local"):
        made.tables[0].plan_peer_transfer(spec, peer, remote, heads=heads)
    # Ids of another request's suffix, group by group: the right groups.
    plan = made.tables[0].plan_peer_transfer(suffix, peer, remote, heads=heads)
    assert len(plan.sizes) == 3 * 2 + 2 * 1


@pytest.mark.parametrize(
    ("sizes", "error", "pattern"),
    [
        ([7, 0], ptrres.SpecError, "group 0: the peer has 7 blocks .* this engine 6"),
        ([-1, 0], ptrres.SpecError, "group 0: the peer has -1 blocks"),
        ([3], ptrres.SpecError, "1 remote group sizes for the spec's 2 groups"),
        ([3, 1, 0], ptrres.SpecError, "3 remote group sizes"),
        (
            [3.0, 1],
            ptrres.InputTypeError,
            r"remote_group_sizes\[0\] must be an integer",
        ),
        ([3, math.nan], ptrres.InputTypeError, r"remote_group_sizes\[1\] must be"),
        ([3, 2**70], ptrres.SpecError, "group 1: the peer has 1180591620717411303424"),
        (3, ptrres.InputTypeError, "remote_group_sizes must be a sequence"),
        ("31", ptrres.InputTypeError, "remote_group_sizes must be a sequence"),
    ],
)
def test_a_suffix_the_spec_cannot_have_is_refused(
    sizes: Any, error: type[Exception], pattern: str
) -> None:
    spec = ptrres.GPULoadStoreSpec([6, 5, 0, 1, 2, 3, 4, 0, 3], [6, 3])
    with pytest.raises(error, match=pattern):
        ptrres.uncached_suffix(spec, sizes)


def test_a_suffix_of_nothing_or_everything() -> None:
    """No blocks left to write in a group (a full hit there), or none
    cached: the group's ids empty, or all of them; a spec of other types
    (numpy ints, a duck-typed object) reads as a GPULoadStoreSpec."""
    spec = ptrres.GPULoadStoreSpec(np.arange(9, dtype=np.int64), [6, 3], [2, 0])
    none = ptrres.uncached_suffix(spec, [0, np.int64(3)])
    assert none.block_ids.tolist() == [6, 7, 8]
    assert (none.group_sizes, none.block_indices) == ((0, 3), (8, 0))
    whole = ptrres.uncached_suffix(spec, (6, 3))
    assert whole.block_ids.tolist() == list(range(9))
    assert whole.block_indices == (2, 0)
    empty = ptrres.uncached_suffix(ptrres.GPULoadStoreSpec([], [0]), [0])
    assert (len(empty.block_ids), empty.group_sizes) == (0, (0,))

    class Spec:
        block_ids = (3, 4, 5)
        group_sizes = (3,)
        block_indices = (0,)

    assert ptrres.uncached_suffix(Spec(), [1]).block_ids.tolist() == [5]
    with pytest.raises(ptrres.InputTypeError, match="device_spec"):
        ptrres.uncached_suffix(object(), [1])
    with pytest.raises(ptrres.SpecError, match="do not add up"):
        ptrres.uncached_suffix(ptrres.GPULoadStoreSpec([1, 2], [3]), [1])


# Bad input ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "pattern"),
    [
        ((0, 3, 2, 4), {}, ptrres.LayoutError, "TP 3 here and TP 2 at the peer"),
        ((0, 2, 3, 6), {}, ptrres.LayoutError, "TP 2 here and TP 3 at the peer"),
        ((0, 2, 2, 3), {}, ptrres.LayoutError, "3 KV heads do not split over TP 2"),
        ((0, 2, 4, 6), {}, ptrres.LayoutError, r"6 KV heads .* TP 4 \(the peer\)"),
        ((0, 4, 2, 6), {}, ptrres.LayoutError, r"6 KV heads .* TP 4 \(this engine\)"),
        ((2, 2, 2, 4), {}, ptrres.LayoutError, "tp_rank 2 is not a rank of TP 2"),
        ((-1, 2, 2, 4), {}, ptrres.LayoutError, "tp_rank -1 is not a rank of TP 2"),
        ((0, 0, 2, 4), {}, ptrres.LayoutError, "tp_size 0, .* from 1 to 65536"),
        ((0, 2, -2, 4), {}, ptrres.LayoutError, "peer_tp_size -2 .* from 1 to 65536"),
        ((0, 2, 2, 0), {}, ptrres.LayoutError, "num_kv_heads 0 must each"),
        ((0, 1, 2**40, 2**40), {}, ptrres.LayoutError, "from 1 to 65536"),
        ((0, 1, 2**17, 4), {"mla": True}, ptrres.LayoutError, "from 1 to 65536"),
        ((0.0, 2, 2, 4), {}, ptrres.InputTypeError, "tp_rank must be an integer"),
        ((0, "2", 2, 4), {}, ptrres.InputTypeError, "tp_size must be an integer"),
        ((0, 2, True, 4), {}, ptrres.InputTypeError, "peer_tp_size must be an int"),
        ((0, 2, 2, None), {}, ptrres.InputTypeError, "num_kv_heads must be an int"),
        ((0, 2, 2, math.nan), {}, ptrres.InputTypeError, "num_kv_heads must be an"),
        ((0, 2, 2, 4), {"mla": 1}, ptrres.InputTypeError, "mla must be True or"),
        ((0, 2, 2, 4), {"kv_layout": "hnd"}, ptrres.InputTypeError, "kv_layout"),
        (
            (0, 1, 2, 4),
            {"kv_layout": "NHD"},
            ptrres.LayoutError,
            r"NHD pages \(heads inside each token.*\): a page",
        ),
        ((1, 4, 1, 2), {"kv_layout": "NHD"}, ptrres.LayoutError, "TP 1 2"),
    ],
)
def test_impossible_pushes_name_their_numbers(
    args: tuple[Any, ...], kwargs: dict[str, Any], error: type, pattern: str
) -> None:
    """Each impossible combination: ptrres's error naming the numbers, of
    the reference's class."""
    with pytest.raises(error, match=pattern):
        ptrres.push_mapping(*args, **kwargs)
    with pytest.raises(error):
        reference.push_mapping(*args, **kwargs)


def test_numpy_ints_and_whole_nhd_pages_are_mappings() -> None:
    numbers = (np.int64(1), np.int32(2), np.uint8(4), np.int16(8))
    assert ptrres.push_mapping(*numbers) == ptrres.push_mapping(1, 2, 4, 8)
    # One head a rank on both sides: whole pages, which NHD allows.
    assert ptrres.push_mapping(1, 2, 4, 2, kv_layout="NHD") == ptrres.push_mapping(
        1, 2, 4, 2
    )


# The fuzz: hostile numbers from the peer ------------------------------------------

# Values a peer (or a bad handshake) may send for a number, by kind.
HOSTILE: dict[str, list[Any]] = {
    "negative": [-1, -2, -(2**31), -(2**63)],
    "zero": [0],
    "huge": [2**31, 2**32 + 5, 2**62, 2**63 - 1],
    "past int64": [2**63, 2**64, 2**64 + 3, -(2**63) - 1, 2**100],
    "float": [1.0, 2.5, math.inf, -math.inf, np.float64(4.0)],
    "NaN": [math.nan, np.float32(math.nan)],
    "wrong type": ["2", None, [2], (), b"\x02", True, object(), {"a": 1}, 2j],
}


def hostile(kind_log: list[str]) -> st.SearchStrategy[Any]:
    """One hostile value, its kind noted in ``kind_log``."""

    def noted(pair: tuple[str, Any]) -> Any:
        kind_log.append(pair[0])
        return pair[1]

    return st.sampled_from(
        [(kind, value) for kind, values in HOSTILE.items() for value in values]
    ).map(noted)


@dataclass(frozen=True)
class PushInput:
    """One push of a prefill rank, every number of it drawn: the TP sizes and
    heads, the decode rank's handshake numbers of each ref, its ids and its
    group sizes (a prefix hit), each either what an honest peer sends or
    hostile."""

    mapping_args: tuple[Any, ...]
    mla: Any
    kv_layout: Any
    peer_refs: list[list[tuple[Any, ...]]]
    remote_ids: Any
    remote_group_sizes: Any
    coalesce: bool
    target: int
    kinds: tuple[str, ...]


# The fuzz's local side: prefill rank 0 of TP 2 over 4 KV heads, two groups
# (two layers of 2 heads x 2 tokens x 8 B, one of 2 x 2 x 4 B).
FUZZ_HEADS, FUZZ_TP = 4, 2
FUZZ_PAGES = ((32, 32), (16,))
FUZZ_BLOCKS = 6
FUZZ_SPEC_IDS = ([0, 1, 2, 3, 4], [5, 3, 1])


# The numbers of a push the fuzz may make hostile, by name.
REF_FIELDS = ("base", "stride", "page", "blocks", "device")
FIELDS = (
    "tp_rank", "tp_size", "peer_tp_size", "num_kv_heads",
    *(f"ref {r} {name}" for r in range(3) for name in REF_FIELDS),
    "group 0 size", "group 1 size", "remote ids",
)  # fmt: skip


@st.composite
def push_inputs(draw: st.DrawFn) -> PushInput:
    """A push where at most two numbers are hostile, the rest honest (or
    honest numbers of another deployment: other heads, MLA, layouts)."""
    kinds: list[str] = []
    n_bad = draw(st.sampled_from([0, 1, 1, 2]))
    bad = set(draw(st.lists(st.sampled_from(FIELDS), min_size=n_bad, max_size=n_bad)))

    def number(name: str, honest: st.SearchStrategy[Any]) -> Any:
        return draw(hostile(kinds) if name in bad else honest)

    decode_tp = number("peer_tp_size", st.sampled_from([1, 2, 4, 8]))
    mapping_args = (
        number("tp_rank", st.sampled_from([0, 1])),
        number("tp_size", st.just(FUZZ_TP)),
        decode_tp,
        number("num_kv_heads", st.sampled_from([FUZZ_HEADS] * 8 + [2, 8, 1])),
    )
    mla = draw(st.sampled_from([False] * 12 + [True, None, 1]))
    kv_layout = draw(st.sampled_from(["HND"] * 12 + ["NHD", "LBHNC", None]))
    # The decode rank's pages: FUZZ_PAGES scaled to its heads (honest where
    # its TP is 1, 2, 4 or 8 over the 4 heads).
    tp = decode_tp if type(decode_tp) is int and decode_tp in (1, 2, 4, 8) else 2
    scale = max(1, FUZZ_HEADS // tp)
    peer_refs = []
    base, r = 1 << 30, 0
    device = draw(st.sampled_from([-1, -1, 0]))  # host memory, or GPU 0
    blocks = draw(st.integers(1, 9))
    for pages in FUZZ_PAGES:
        refs = []
        for page in pages:
            honest_page = page * scale // 2
            stride = honest_page + draw(st.sampled_from([0, 0, 8]))
            refs.append(
                (
                    number(f"ref {r} base", st.just(base)),
                    number(f"ref {r} stride", st.just(stride)),
                    number(f"ref {r} page", st.just(honest_page)),
                    number(f"ref {r} blocks", st.integers(blocks, blocks + 2)),
                    number(f"ref {r} device", st.just(device)),
                )
            )
            base, r = base + (1 << 20), r + 1
        peer_refs.append(refs)
    sizes = [
        number(f"group {g} size", st.integers(0, len(ids)))
        for g, ids in enumerate(FUZZ_SPEC_IDS)
    ]
    # The ids an honest peer sends for those sizes (the hostile ones bounded).
    kept = sum(
        min(n, len(ids))
        for n, ids in zip(sizes, FUZZ_SPEC_IDS)
        if type(n) is int and n >= 0
    )
    remote_ids: Any = draw(
        st.lists(st.integers(0, blocks - 1), min_size=kept, max_size=kept)
    )
    if "remote ids" in bad:
        remote_ids = draw(
            st.one_of(
                st.lists(
                    st.one_of(st.integers(0, blocks - 1), hostile(kinds)),
                    min_size=kept,
                    max_size=kept + 1,
                ),
                st.sampled_from(
                    [
                        np.full(kept, math.nan),
                        np.full(kept, 2**63, np.uint64),
                        np.full(kept, -1, np.int8),
                        np.full((kept, 1), 1, np.int64),
                        np.arange(kept, dtype=np.float32),
                        "0123"[:kept],
                        None,
                    ]
                ),
            )
        )
        kinds.append("remote ids")
    sizes_value: Any = draw(
        st.sampled_from([sizes] * 8 + [tuple(sizes), sizes[:1], [*sizes, 0]])
    )
    return PushInput(
        mapping_args,
        mla,
        kv_layout,
        peer_refs,
        remote_ids,
        sizes_value,
        draw(st.booleans()),
        draw(st.integers(0, 3)),
        tuple(kinds),
    )


class RanAway(Exception):
    """A call of the push path took longer than it may."""


@contextmanager
def bounded(seconds: float) -> Iterator[None]:
    """Raise RanAway in a call that takes more than ``seconds`` (a hang)."""

    def stop(signum: int, frame: Any) -> None:
        raise RanAway(f"more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@dataclass
class FuzzTable:
    """The prefill rank's caches of the fuzz (host memory), its table and
    its spec of a request."""

    buffers: list[Bytes]
    table: ptrres.PointerTable
    spec: ptrres.GPULoadStoreSpec


def fuzz_table() -> FuzzTable:
    buffers: list[Bytes] = []
    tensors: list[ptrres.CanonicalKVCacheTensor] = []
    refs: list[list[ptrres.CanonicalKVCacheRef]] = []
    for pages in FUZZ_PAGES:
        group = []
        for page in pages:
            buffer = np.zeros(FUZZ_BLOCKS * page, np.uint8)
            buffers.append(buffer)
            group.append(ptrres.CanonicalKVCacheRef(len(tensors), page))
            tensors.append(
                ptrres.CanonicalKVCacheTensor(buffer.reshape(FUZZ_BLOCKS, page), page)
            )
        refs.append(group)
    table = ptrres.PointerTable(ptrres.CanonicalKVCaches(tensors, refs))
    spec = ptrres.GPULoadStoreSpec(
        [i for ids in FUZZ_SPEC_IDS for i in ids], [len(ids) for ids in FUZZ_SPEC_IDS]
    )
    return FuzzTable(buffers, table, spec)


def inside(
    addresses: Any,
    sizes: Any,
    refs: list[tuple[int, int, int, int]],
    per_block: bool,
) -> bool:
    """Whether every descriptor lies inside one of the refs ``(base, stride,
    page, blocks)``: inside one block's page (``per_block``), or, where runs
    of whole pages merge, inside the ref's span from block 0 to the end of
    its last page."""
    for address, size in zip(
        np.asarray(addresses).tolist(), np.asarray(sizes).tolist()
    ):
        if not any(
            base <= address
            and address + size <= base + (blocks - 1) * stride + page
            and (
                not per_block
                or stride == 0
                or (
                    (address - base) // stride < blocks
                    and (address - base) % stride + size <= page
                )
            )
            for base, stride, page, blocks in refs
            if blocks > 0
        ):
            return False
    return True


def push_path(fuzz: FuzzTable, given_input: PushInput) -> int:
    """The push path of one prefill rank, on the drawn numbers: its mapping,
    the decode rank's layout from its handshake numbers, the suffix of a
    prefix hit, a plan and its NIXL rows, and prepared lists and indices.
    Returns the descriptors made, every one checked to lie inside what the
    decode rank declared (and this rank's caches)."""
    mapping = ptrres.push_mapping(
        *given_input.mapping_args, mla=given_input.mla, kv_layout=given_input.kv_layout
    )
    peer = ptrres.PeerLayout(given_input.peer_refs, kv_layout=given_input.kv_layout)
    suffix = ptrres.uncached_suffix(fuzz.spec, given_input.remote_group_sizes)
    if not mapping.slices:
        return 0
    heads = mapping.slices[given_input.target % len(mapping.slices)]
    plan = fuzz.table.plan_peer_transfer(
        suffix, peer, given_input.remote_ids, heads=heads, coalesce=given_input.coalesce
    )
    descs = ptrres.nixl.peer_xfer_descs(plan, local=fuzz.table, remote=peer)
    local_rows, remote_rows = ptrres.nixl.prepped_pair(fuzz.table, peer, heads)
    local_indices = ptrres.nixl.prepped_indices(fuzz.table, suffix)
    remote_indices = ptrres.nixl.prepped_indices(
        peer, given_input.remote_ids, suffix.group_sizes
    )
    declared = [
        (ref.base_ptr, ref.row_stride_bytes, ref.page_size_bytes, ref.num_blocks)
        for refs in peer.groups
        for ref in refs
    ]
    local_addresses, local_sizes = named(local_rows, local_indices)
    remote_addresses, remote_sizes = named(remote_rows, remote_indices)
    merged = given_input.coalesce
    assert inside(descs.remote[:, 0], descs.remote[:, 1], declared, not merged)
    assert inside(remote_addresses, remote_sizes, declared, True)
    # This rank's side: inside its own caches.
    reference.execute_descriptors(
        descs.local[:, 0], descs.local[:, 0], descs.local[:, 1], within=fuzz.buffers
    )
    reference.execute_descriptors(
        local_addresses, local_addresses, local_sizes, within=fuzz.buffers
    )
    return len(descs.local) + len(local_indices)


FUZZ_EXAMPLES = 1000


def test_the_push_path_takes_hostile_peer_numbers(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Hostile numbers from the peer (negative, zero, huge, past int64,
    floats, NaN, wrong types; TP sizes and heads that do not fit; ids and
    group sizes of a prefix hit) through the whole push path: only ptrres's
    errors come out, never another exception or a run-away call, and every
    descriptor of a push that is made lies inside what the decode rank
    declared. The counts, by outcome and by the kinds drawn, are printed."""
    fuzz = fuzz_table()
    outcomes: Counter[str] = Counter()
    by_kind: Counter[str] = Counter()

    @settings(max_examples=max(FUZZ_EXAMPLES, settings().max_examples))
    @given(push_inputs())
    @example(
        PushInput(
            (0, 2, 2**62, 2**62), False, "HND", [], [], [0, 0], False, 0, ("huge",)
        )
    )
    def run(given_input: PushInput) -> None:
        started = time.monotonic()
        try:
            with bounded(20.0):
                made = push_path(fuzz, given_input)
            outcome = "pushed" if made else "nothing to push"
        except ptrres.PtrresError as error:
            outcome = type(error).__name__
        assert time.monotonic() - started < 20.0
        outcomes[outcome] += 1
        refused = "pushed" if outcome == "pushed" else "refused"
        for kind in sorted(set(given_input.kinds)) or ["none"]:
            by_kind[f"{kind}, {refused}"] += 1

    run()
    with capsys.disabled():
        print(
            f"\npush fuzz: {sum(outcomes.values())} cases; by outcome "
            f"{dict(sorted(outcomes.items()))}; by hostile kind drawn "
            f"{dict(sorted(by_kind.items()))}"
        )
    assert outcomes["pushed"] > 0
    assert sum(outcomes.values()) - outcomes["pushed"] > 0


@pytest.mark.parametrize(
    ("layout", "slices"),
    [
        ("LBHNC", True),
        ("BLHNC", True),
        ("LBNHC", False),
        ("LHBNC", False),
        ("BLNHC", False),
        ("BHLNC", False),
    ],
)
def test_push_mapping_reads_vllms_layout_names_as_tp_mapping_does(
    layout: str, slices: bool
) -> None:
    """A PeerLayout's kv_layout (a vLLM KVCacheLayout name) goes to either
    mapping: both slice heads on the same layouts, and take whole pages on
    every one."""
    whole = ptrres.push_mapping(0, 2, 2, 4, kv_layout=layout)
    assert whole == ptrres.push_mapping(0, 2, 2, 4)
    assert reference.push_mapping(0, 2, 2, 4, kv_layout=layout) == whole
    if not slices:  # the reference refuses the same slices
        with pytest.raises(ptrres.LayoutError):
            reference.push_mapping(0, 1, 2, 4, kv_layout=layout)
    if slices:
        assert ptrres.push_mapping(0, 1, 2, 4, kv_layout=layout) == ptrres.push_mapping(
            0, 1, 2, 4
        )
        ptrres.tp_mapping(0, 2, 1, 4, kv_layout=layout)
    else:
        for mapping, args in (
            (ptrres.push_mapping, (0, 1, 2, 4)),
            (ptrres.tp_mapping, (0, 2, 1, 4)),
        ):
            with pytest.raises(ptrres.LayoutError, match=f"{layout} pages"):
                mapping(*args, kv_layout=layout)
