"""Prefill and decode engines of different TP, moved by real NIXL agents over
UCX (SPEC 15, issue 34), every byte checked by the head oracle.

Each prefill rank is a UCX agent in one of two spawned processes (rank r in
process r % 2), its pages its shard of its engine's logical KV
(tests/head_oracle.py); each decode rank is a UCX agent in this process, its
pages other random bytes. A decode rank asks tp_mapping() which prefill
ranks hold its heads and READs from each one transfer, that rank's slice of
every page into its own slice: peer plans (plain and coalesced) through
peer_xfer_descs, or prepared lists (prepped_pair's rows, prepped_indices).
The peer layout it plans against is built from what the prefill process
sent: PeerLayout numbers, or a vLLM NixlAgentMetadata's fields
(PeerLayout.from_nixl_metadata). After the transfers every decode rank's
buffers must be what the oracle says (its shard of the moved blocks, every
other page, the padding and the guard zones as they were) and every prefill
rank's buffers unchanged.

Bad input (ids out of range on either side, a peer whose page is not the
right multiple, NHD pages with a head slice, TP sizes that cannot be) raises
ptrres's error before NIXL sees anything; the buffers stay as they were and
the agents move the right bytes right after.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import head_oracle
import numpy as np
import pytest
from nixl_harness import (
    START_TIMEOUT,
    Caches,
    Child,
    HeadModel,
    RankCaches,
    RankDesign,
    assert_same_bytes,
    new_agent,
    serve_ranks,
    wait_for_all,
)

import ptrres
import ptrres.nixl
from ptrres import HeadSlice


@dataclass(frozen=True)
class Case:
    """A prefill engine's TP, a decode engine's, the model's KV heads, MLA or
    not, and per decode rank the prefill ranks it must read from (SPEC 15,
    written out by hand)."""

    prefill_tp: int
    decode_tp: int
    num_kv_heads: int
    mla: bool
    sources: tuple[tuple[int, ...], ...]


CASES = {
    # The decode rank gathers: heads 0-1 from prefill rank 0, 2-3 from rank 1.
    "2 to 1": Case(2, 1, 4, False, ((0, 1),)),
    # Each decode rank reads its half of the one prefill rank's pages.
    "1 to 2": Case(1, 2, 4, False, ((0,), (0,))),
    # SGLang #31295: 2 KV heads over decode TP 4, each head on two decode
    # ranks, each reading one head of the two in the prefill page.
    "1 to 4, 2 heads": Case(1, 4, 2, False, ((0,),) * 4),
    # Replication on the prefill side: ranks 0 and 1 hold head 0, 2 and 3
    # head 1; the decode rank reads each head once (from ranks 0 and 2).
    "4 to 1, 2 heads": Case(4, 1, 2, False, ((0, 2),)),
    # One head per rank on both sides: whole pages, which runs merge.
    "2 to 4, 2 heads": Case(2, 4, 2, False, ((0,), (0,), (1,), (1,))),
    # MLA: the latent page is whole on every rank; one source rank.
    "2 to 1, MLA": Case(2, 1, 1, True, ((0,),)),
}
# Per layout, per group, per layer: the bytes of one head's token. Hybrid:
# two groups of other block counts (group 1's rows padded, its layers each
# in a buffer of their own).
LAYOUTS = {"one group": ((16, 8),), "hybrid": ((16, 8), (32, 8))}
PREFILL_BLOCKS = {"one group": (13,), "hybrid": (13, 17)}
DECODE_BLOCKS = {"one group": (10,), "hybrid": (10, 12)}
TOKENS = 4
MODES = ("plain", "coalesced", "prepared")

# A transfer's ids of group g, given the blocks of a decode rank (n_local)
# and of a prefill rank (n_remote) in that group: (local ids, remote ids).
Pattern = Callable[[int, int, int], tuple[list[int], list[int]]]
PATTERNS: list[Pattern] = [
    # A run up on both sides (coalesced whole pages merge), then the last
    # local block from the first remote one.
    lambda g, nl, nr: ([2 + g, 3 + g, 4 + g, 5 + g, nl - 1], [7 + g, 8, 9, 10, 0]),
    # A run down on both sides, then scattered ids.
    lambda g, nl, nr: ([nl - 2, nl - 3, 0, 1 + g], [nr - 1, nr - 2, 5 + g, 3]),
    # The first and last block of each ref: in group 0, layer 0's last page
    # and layer 1's first lie back to back on both sides.
    lambda g, nl, nr: ([0, nl - 1], [0, nr - 1]),
]

Ids = list[list[int]]


def transfers(layout: str) -> list[tuple[Ids, Ids]]:
    """Every pattern's ids, group by group: (local ids, remote ids)."""
    result = []
    for pattern in PATTERNS:
        pairs = [
            pattern(g, n_local, n_remote)
            for g, (n_local, n_remote) in enumerate(
                zip(DECODE_BLOCKS[layout], PREFILL_BLOCKS[layout])
            )
        ]
        result.append(([local for local, _ in pairs], [remote for _, remote in pairs]))
    return result


def spec_of(local_ids: Ids) -> ptrres.GPULoadStoreSpec:
    """The local ids as a spec (int64: bad ids may pass int32)."""
    return ptrres.GPULoadStoreSpec(flat(local_ids), [len(g) for g in local_ids])


def flat(ids: Ids) -> np.ndarray[Any, np.dtype[np.int64]]:
    """Ids of every group, one after another, as int64."""
    return np.array([block for group in ids for block in group], np.int64)


def prefill_agent(tp_size: int, rank: int) -> str:
    return f"prefill TP {tp_size} rank {rank}"


def decode_agent(tp_size: int, rank: int) -> str:
    return f"decode TP {tp_size} rank {rank}"


def case_key(case: str, layout: str) -> str:
    return f"{case}, {layout}"


class Engines:
    """Every case's ranks, for every layout: prefill ranks in two processes
    (one UCX agent per prefill TP size and rank, rank r in process r % 2),
    decode ranks in this process (one UCX agent per decode TP size and
    rank), each agent holding its rank's caches of every case it is in."""

    def __init__(self) -> None:
        self.models: dict[str, HeadModel] = {}
        per_process: list[dict[str, dict[str, RankDesign]]] = [{}, {}]
        decode_designs: dict[str, dict[str, RankDesign]] = {}
        self.mirrors: dict[tuple[str, int], RankCaches] = {}
        for c, (name, case) in enumerate(CASES.items()):
            for m, (layout, head_bytes) in enumerate(LAYOUTS.items()):
                key = case_key(name, layout)
                model = HeadModel(
                    case.num_kv_heads, TOKENS, head_bytes, case.mla, 10 * c + m
                )
                self.models[key] = model
                for r in range(case.prefill_tp):
                    design = RankDesign(
                        model, case.prefill_tp, r, PREFILL_BLOCKS[layout], 32,
                        1000 + 100 * c + 10 * m + r, "numpy", prefill=True,
                    )  # fmt: skip
                    agent = prefill_agent(case.prefill_tp, r)
                    per_process[r % 2].setdefault(agent, {})[key] = design
                    # This process's copy of the rank's caches: the same bytes.
                    self.mirrors[key, r] = RankCaches(design)
                for r in range(case.decode_tp):
                    design = RankDesign(
                        model, case.decode_tp, r, DECODE_BLOCKS[layout], 16,
                        2000 + 100 * c + 10 * m + r, "torch", prefill=False,
                    )  # fmt: skip
                    agent = decode_agent(case.decode_tp, r)
                    decode_designs.setdefault(agent, {})[key] = design
        self._children = [Child(serve_ranks, ranks) for ranks in per_process]
        self._owner = {
            agent: child
            for child, ranks in zip(self._children, per_process)
            for agent in ranks
        }
        self._registrations: list[ptrres.nixl.Registration] = []
        self.agents: dict[str, Any] = {}
        self.decode: dict[tuple[str, int], RankCaches] = {}
        try:
            for agent_key, designs in decode_designs.items():
                agent = self.agents[agent_key] = new_agent("decode", "UCX")
                for key, design in designs.items():
                    caches = self.decode[key, design.tp_rank] = RankCaches(design)
                    self._registrations.append(
                        ptrres.nixl.register(agent, caches.table)
                    )
            # What each prefill agent sent: its metadata, and per case what
            # a handshake carries of its rank's caches.
            self.handshakes: dict[str, Any] = {}
            for child in self._children:
                self.handshakes.update(child.reply(START_TIMEOUT))
            self.names: dict[str, str] = {}
            for agent in self.agents.values():
                for prefill, (metadata, _) in self.handshakes.items():
                    self.names[prefill] = agent.add_remote_agent(metadata)
        except BaseException:
            self.close()
            raise

    def numbers(self, name: str, layout: str, rank: int) -> Any:
        """The PeerLayout numbers prefill rank ``rank`` sent, checked against
        this process's copy of its caches (but the addresses)."""
        agent = prefill_agent(CASES[name].prefill_tp, rank)
        numbers, _ = self.handshakes[agent][1][case_key(name, layout)]
        mirror = self.mirrors[case_key(name, layout), rank]
        sent = [[ref[1:4] for ref in refs] for refs in numbers]
        assert sent == [[ref[1:] for ref in refs] for refs in mirror.ref_numbers]
        return numbers

    def peer(
        self, name: str, layout: str, rank: int, handshake: str = "numbers"
    ) -> ptrres.PeerLayout:
        """Prefill rank ``rank``'s layout as the decode side knows it: from
        the PeerLayout numbers it sent (``handshake="numbers"``, HND pages),
        or from the fields of a vLLM NixlAgentMetadata (``"vllm"``; ``"vllm
        NHD"``: the same, its kv_cache_layout NHD)."""
        numbers = self.numbers(name, layout, rank)
        if handshake == "numbers":
            return ptrres.PeerLayout(numbers, kv_layout="HND")
        agent = prefill_agent(CASES[name].prefill_tp, rank)
        metadata, cases = self.handshakes[agent]
        fields = dict(cases[case_key(name, layout)][1])
        if handshake == "vllm NHD":
            fields["kv_cache_layout"] = "NHD"
        # vLLM is not importable in every venv: an object of its field names.
        handshake_message = SimpleNamespace(
            engine_id=agent, agent_metadata=metadata, **fields
        )
        peer = ptrres.PeerLayout.from_nixl_metadata(handshake_message)
        # The same refs as the numbers say, each a registration of its own.
        assert [[ref[:5] for ref in refs] for refs in peer.groups] == [
            [ref[:5] for ref in refs] for refs in numbers
        ]
        return peer

    def remote_name(self, name: str, rank: int) -> str:
        return self.names[prefill_agent(CASES[name].prefill_tp, rank)]

    def decode_agent(self, name: str, rank: int) -> Any:
        return self.agents[decode_agent(CASES[name].decode_tp, rank)]

    def prefill_bytes(self, name: str, layout: str, rank: int) -> list[bytes]:
        agent = prefill_agent(CASES[name].prefill_tp, rank)
        answer: list[bytes] = self._owner[agent].ask(
            "bytes", agent, case_key(name, layout)
        )
        return answer

    def reset(self, name: str, layout: str) -> dict[int, Caches]:
        """Every rank of a case back to its seeded bytes (the prefill ranks
        checked against this process's copies); returns a copy of each
        decode rank's caches, for the oracle's expectations."""
        case, key = CASES[name], case_key(name, layout)
        for r in range(case.prefill_tp):
            agent = prefill_agent(case.prefill_tp, r)
            self._owner[agent].ask("fill", agent, key)
        expected = {}
        for r in range(case.decode_tp):
            self.decode[key, r].fill()
            expected[r] = self.decode[key, r].copy()
        self.check(name, layout, expected)
        return expected

    def check(self, name: str, layout: str, expected: dict[int, Caches]) -> None:
        """Every decode rank's buffers as expected, every prefill rank's as
        seeded, guard zones included."""
        case, key = CASES[name], case_key(name, layout)
        for r in range(case.decode_tp):
            assert_same_bytes(
                self.decode[key, r].snapshot(),
                expected[r].snapshot(),
                f"{key}: decode rank {r}",
            )
        for r in range(case.prefill_tp):
            assert_same_bytes(
                self.prefill_bytes(name, layout, r),
                self.mirrors[key, r].snapshot(),
                f"{key}: prefill rank {r}",
            )

    def close(self) -> None:
        for child in self._children:
            child.close()
        for registration in self._registrations:
            registration.deregister()
        for agent in self.agents.values():
            for remote in getattr(self, "names", {}).values():
                agent.remove_remote_agent(remote)


@pytest.fixture(scope="module")
def engines() -> Iterator[Engines]:
    """The prefill processes and this process's decode agents, for every
    test of this module, stopped at its end."""
    made = Engines()
    try:
        yield made
    finally:
        made.close()


def expect(
    engines: Engines,
    name: str,
    layout: str,
    rank: int,
    expected: Caches,
    local_ids: Ids,
    remote_ids: Ids,
) -> None:
    """The oracle's pages of decode rank ``rank`` after it received the
    prefill engine's blocks ``remote_ids`` into its ``local_ids``, written
    into ``expected`` (every other byte as it was)."""
    key = case_key(name, layout)
    design = engines.decode[key, rank].rank
    model = engines.models[key]
    for t, g, d in design.refs():
        source = model.logical(g, d, PREFILL_BLOCKS[layout][g])
        rows = expected.rows(t)
        rows[:] = head_oracle.expected_pages(
            rows.copy(), source, design.heads, local_ids[g], remote_ids[g]
        )


class Prepared:
    """Prepared lists of one test: per (decode rank, source rank), both
    sides' lists (prepped_pair's rows), released at the end."""

    def __init__(self) -> None:
        self.lists: dict[tuple[int, int], tuple[Any, Any]] = {}
        self._agents: list[Any] = []

    def pair(
        self,
        agent: Any,
        rank: int,
        caches: RankCaches,
        peer: ptrres.PeerLayout,
        remote_name: str,
        heads: HeadSlice,
    ) -> tuple[Any, Any]:
        key = (rank, heads.source_rank)
        if key not in self.lists:
            local_rows, remote_rows = ptrres.nixl.prepped_pair(
                caches.table, peer, heads
            )
            # Each side's rows are its slice of every page, a strided row
            # per ref (SPEC 15): the oracle's pages say where.
            refs = [ref for group in caches.ref_numbers for ref in group]
            peer_refs = [ref for group in peer.groups for ref in group]
            for rows, ref, peer_ref in zip(
                zip(local_rows.xfer_list.tolist(), remote_rows.xfer_list.tolist()),
                refs,
                peer_refs,
            ):
                head = ref[2] // heads.local_heads
                local_row = (ref[0] + heads.local_head * head, heads.num_heads * head)
                remote_row = (
                    peer_ref.base_ptr + heads.remote_head * head,
                    heads.num_heads * head,
                )
                assert tuple(rows[0][:2]) == local_row
                assert tuple(rows[1][:2]) == remote_row
                assert (rows[0][3:], rows[1][3:]) == (
                    [ref[1], ref[3]],
                    [peer_ref.row_stride_bytes, peer_ref.num_blocks],
                )
            self.lists[key] = (
                agent.prep_xfer_dlist("NIXL_INIT_AGENT", *local_rows),
                agent.prep_xfer_dlist(remote_name, *remote_rows),
            )
        return self.lists[key]

    def release(self) -> None:
        for local_list, remote_list in self.lists.values():
            local_list.release()
            remote_list.release()


def read_handle(
    engines: Engines,
    name: str,
    layout: str,
    rank: int,
    heads: HeadSlice,
    ids: tuple[Ids, Ids],
    mode: str,
    peer: ptrres.PeerLayout,
    prepared: Prepared,
    runs: bool,
) -> Any:
    """The handle of decode rank ``rank``'s READ of ``heads`` from their
    source rank: a plan's descriptors, or indices into prepared lists.
    ``runs``: the ids run on both sides, so that a coalesced plan of whole
    pages merges some."""
    agent = engines.decode_agent(name, rank)
    caches = engines.decode[case_key(name, layout), rank]
    table = caches.table
    remote_name = engines.remote_name(name, heads.source_rank)
    local_ids, remote_ids = ids
    spec = spec_of(local_ids)
    if mode == "prepared":
        local_list, remote_list = prepared.pair(
            agent, rank, caches, peer, remote_name, heads
        )
        return agent.make_prepped_xfer(
            "READ",
            local_list,
            ptrres.nixl.prepped_indices(table, spec),
            remote_list,
            ptrres.nixl.prepped_indices(peer, flat(remote_ids), spec.group_sizes),
        )
    plan = table.plan_peer_transfer(
        spec, peer, flat(remote_ids), heads=heads, coalesce=mode == "coalesced"
    )
    if mode == "plain":
        # One copy per id per ref (group, then ref, then id), of the slice's
        # heads of that layer.
        head_bytes = engines.models[case_key(name, layout)].head_bytes
        assert plan.sizes.tolist() == [
            heads.num_heads * TOKENS * layer
            for group, layers in zip(local_ids, head_bytes)
            for layer in layers
            for _ in group
        ]
    if mode == "coalesced":
        plain = table.plan_peer_transfer(spec, peer, flat(remote_ids), heads=heads)
        assert plan.num_bytes == plain.num_bytes == int(plain.sizes.sum())
        if not heads.whole_page:
            # The slices of consecutive pages are not one piece: none merge.
            assert plan.sizes.tolist() == plain.sizes.tolist()
        elif runs:
            assert len(plan.sizes) < len(plain.sizes)
    descs = ptrres.nixl.peer_xfer_descs(plan, local=table, remote=peer)
    return descs.initialize_xfer(agent, "READ", remote_name)


def move(
    engines: Engines,
    name: str,
    layout: str,
    mode: str,
    *,
    handshake: str = "numbers",
    tamper: Callable[[HeadSlice], HeadSlice] | None = None,
) -> None:
    """Every pattern's transfer, in a row, from a fresh start: every decode
    rank of the case READs each of its source ranks' slices (one transfer a
    source rank, all posted before any is waited on), then every byte of
    every rank is checked. ``tamper``: change each slice before use (the
    check must then fail)."""
    case = CASES[name]
    kv_layout = "NHD" if handshake.endswith("NHD") else "HND"
    expected = engines.reset(name, layout)
    peers = {
        r: engines.peer(name, layout, r, handshake) for r in range(case.prefill_tp)
    }
    prepared = Prepared()
    try:
        for p, ids in enumerate(transfers(layout)):
            handles = []
            for rank in range(case.decode_tp):
                mapping = ptrres.tp_mapping(
                    rank, case.decode_tp, case.prefill_tp, case.num_kv_heads,
                    mla=case.mla, kv_layout=kv_layout,
                )  # fmt: skip
                assert mapping.source_ranks == case.sources[rank]
                for heads in mapping.slices:
                    if tamper is not None:
                        heads = tamper(heads)
                    handle = read_handle(
                        engines, name, layout, rank, heads, ids, mode,
                        peers[heads.source_rank], prepared, runs=p < 2,
                    )  # fmt: skip
                    handles.append((engines.decode_agent(name, rank), handle))
                expect(engines, name, layout, rank, expected[rank], *ids)
            try:
                wait_for_all(handles)
            finally:
                for _, handle in handles:
                    handle.release()
            engines.check(name, layout, expected)
    finally:
        prepared.release()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", CASES)
def test_each_decode_rank_receives_its_heads(
    engines: Engines, name: str, layout: str, mode: str
) -> None:
    move(engines, name, layout, mode)


@pytest.mark.parametrize("name", CASES)
def test_a_vllm_handshake_moves_the_bytes(engines: Engines, name: str) -> None:
    """The peer layout from vLLM's NixlAgentMetadata fields of each prefill
    rank (PeerLayout.from_nixl_metadata), in every mode, on the hybrid
    layout."""
    for mode in MODES:
        move(engines, name, "hybrid", mode, handshake="vllm")


def test_a_wrong_head_offset_is_caught(engines: Engines) -> None:
    """The oracle's check fails where a decode rank reads the other head of
    the prefill page (SGLang #22145's kind of bug): the check can fail."""

    def other_head(heads: HeadSlice) -> HeadSlice:
        assert (heads.num_heads, heads.remote_heads) == (1, 2)
        return heads._replace(remote_head=1 - heads.remote_head)

    with pytest.raises(AssertionError, match="decode rank 0: buffer 0 differs"):
        move(engines, "1 to 4, 2 heads", "one group", "plain", tamper=other_head)


# --- bad input: ptrres's error, nothing posted, the agents still working --------

# The case the bad input is tried on: a decode rank gathering from two prefill
# ranks, each giving 2 of its 4 heads.
GATHER, HYBRID = "2 to 1", "hybrid"


def with_id(ids: Ids, g: int, position: int, value: int) -> Ids:
    """ids with group g's id at ``position`` replaced by ``value``."""
    changed = [list(group) for group in ids]
    changed[g][position] = value
    return changed


def attempts(
    table: ptrres.PointerTable,
    peer: ptrres.PeerLayout,
    heads: HeadSlice,
    local_ids: Ids,
    remote_ids: Ids,
    *names: str,
) -> list[Callable[[], Any]]:
    """What turns a transfer's ids into NIXL's input, for one source rank,
    by name: its "plan", "coalesced plan", the "local indices" and "remote
    indices", and both sides' prepared lists ("prepared pair")."""
    spec, remote = spec_of(local_ids), flat(remote_ids)

    def plan(coalesce: bool) -> Any:
        return table.plan_peer_transfer(
            spec, peer, remote, heads=heads, coalesce=coalesce
        )

    calls: dict[str, Callable[[], Any]] = {
        "plan": lambda: plan(False),
        "coalesced plan": lambda: plan(True),
        "local indices": lambda: ptrres.nixl.prepped_indices(table, spec),
        "remote indices": lambda: ptrres.nixl.prepped_indices(
            peer, remote, spec.group_sizes
        ),
        "prepared pair": lambda: ptrres.nixl.prepped_pair(table, peer, heads),
    }
    return [calls[name] for name in names]


def test_ids_out_of_range_raise_before_nixl(engines: Engines) -> None:
    """A remote id at the peer ref's block count, a local id at the local
    ref's (and -1): the plans and the side's indices raise the id's error,
    nothing moves, and the agents move the right bytes right after."""
    expected = engines.reset(GATHER, HYBRID)
    table = engines.decode[case_key(GATHER, HYBRID), 0].table
    local_ids, remote_ids = transfers(HYBRID)[0]
    for heads in ptrres.tp_mapping(0, 1, 2, 4).slices:
        peer = engines.peer(GATHER, HYBRID, heads.source_rank)
        bad: list[tuple[type[ptrres.BlockIdError], Ids, Ids, tuple[int, int, int]]]
        bad = [
            (
                ptrres.RemoteBlockIdError,
                local_ids,
                with_id(remote_ids, 1, 2, PREFILL_BLOCKS[HYBRID][1]),
                (1, 2, PREFILL_BLOCKS[HYBRID][1]),
            ),
            (
                ptrres.BlockIdError,
                with_id(local_ids, 0, 4, DECODE_BLOCKS[HYBRID][0]),
                remote_ids,
                (0, 4, DECODE_BLOCKS[HYBRID][0]),
            ),
            (ptrres.BlockIdError, with_id(local_ids, 1, 0, -1), remote_ids, (1, 0, -1)),
        ]
        for error, local, remote, where in bad:
            # The plans, and the indices of the side the bad id is on.
            side = "remote" if error is ptrres.RemoteBlockIdError else "local"
            names = ("plan", "coalesced plan", f"{side} indices")
            for call in attempts(table, peer, heads, local, remote, *names):
                with pytest.raises(error) as raised:
                    call()
                assert type(raised.value) is error  # a local id is never "remote"
                found = (raised.value.group, raised.value.position, raised.value.value)
                assert found == where
    engines.check(GATHER, HYBRID, expected)  # nothing moved
    move(engines, GATHER, HYBRID, "prepared")
    move(engines, GATHER, HYBRID, "coalesced")


# What refuses a peer layout that does not pair with this rank's table.
REFUSING = ("plan", "coalesced plan", "prepared pair")


def with_page(numbers: Any, page_of: Callable[[int], int]) -> Any:
    """Peer numbers with group 0's ref 0 of another page (and a row stride
    that holds it)."""
    groups = [[list(ref) for ref in refs] for refs in numbers]
    ref = groups[0][0]
    ref[2] = page_of(ref[2])
    ref[1] = max(ref[1], ref[2])
    return [[tuple(ref) for ref in refs] for refs in groups]


def test_a_peer_of_other_pages_is_refused(engines: Engines) -> None:
    """A prefill rank whose page is not 2 heads of this rank's head bytes (a
    page of 3 heads' bytes; a page that does not split into 2 heads), or a
    head slice left out: plans and prepared lists refuse it, naming the
    ref and the bytes; nothing moves; the agents keep working."""
    expected = engines.reset(GATHER, HYBRID)
    table = engines.decode[case_key(GATHER, HYBRID), 0].table
    heads = ptrres.tp_mapping(0, 1, 2, 4).slice_of(1)
    numbers = engines.numbers(GATHER, HYBRID, 1)
    # Layer 0: this rank's page 4 heads of 64 B; the prefill rank's 2 heads.
    assert (numbers[0][0][2], table.ref_table.shape[0]) == (128, 4)
    refusals = [
        (
            with_page(numbers, lambda page: page * 3 // 2),
            "group 0, ref 0: a head is 64 B in this rank's page (256 B, 4 heads) "
            "but 96 B in peer rank 1's (192 B, 2 heads): its page must be 128 B",
        ),
        (
            with_page(numbers, lambda page: page + 1),
            "group 0, ref 0: peer rank 1's page of 129 B does not split into its "
            "2 heads",
        ),
    ]
    local_ids, remote_ids = transfers(HYBRID)[0]
    for bad_numbers, message in refusals:
        peer = ptrres.PeerLayout(bad_numbers, kv_layout="HND")
        for call in attempts(table, peer, heads, local_ids, remote_ids, *REFUSING):
            with pytest.raises(ptrres.LayoutError, match=re.escape(message)):
                call()
    # The right peer without the head slice: not the same page on both sides.
    peer = engines.peer(GATHER, HYBRID, 1)
    message = "group 0, ref 0: the local page is 256 B but the peer's is 128 B"
    spec, remote = spec_of(local_ids), flat(remote_ids)
    with pytest.raises(ptrres.LayoutError, match=re.escape(message)):
        table.plan_peer_transfer(spec, peer, remote)
    with pytest.raises(ptrres.LayoutError, match=re.escape(message)):
        ptrres.nixl.prepped_pair(table, peer)
    engines.check(GATHER, HYBRID, expected)
    move(engines, GATHER, HYBRID, "plain")


def test_nhd_pages_are_not_head_sliced(engines: Engines) -> None:
    """NHD pages hold a rank's heads as one fragment per token: tp_mapping
    refuses to slice them, and so do plans and prepared lists of a peer
    whose pages are NHD (by PeerLayout's word or by vLLM's handshake).
    Whole pages are one piece in either layout: the 2 to 4 case's NHD peers
    move the bytes."""
    expected = engines.reset(GATHER, HYBRID)
    with pytest.raises(ptrres.LayoutError, match="NHD pages"):
        ptrres.tp_mapping(0, 1, 2, 4, kv_layout="NHD")
    table = engines.decode[case_key(GATHER, HYBRID), 0].table
    local_ids, remote_ids = transfers(HYBRID)[0]
    for heads in ptrres.tp_mapping(0, 1, 2, 4).slices:
        numbers = engines.numbers(GATHER, HYBRID, heads.source_rank)
        for peer in (
            ptrres.PeerLayout(numbers, kv_layout="NHD"),
            engines.peer(GATHER, HYBRID, heads.source_rank, "vllm NHD"),
        ):
            assert peer.kv_layout == "NHD"
            for call in attempts(table, peer, heads, local_ids, remote_ids, *REFUSING):
                with pytest.raises(ptrres.LayoutError, match="NHD"):
                    call()
    engines.check(GATHER, HYBRID, expected)
    whole = "2 to 4, 2 heads"
    for rank in range(4):
        assert ptrres.tp_mapping(rank, 4, 2, 2, kv_layout="NHD") == ptrres.tp_mapping(
            rank, 4, 2, 2
        )
    for mode in MODES:
        move(engines, whole, HYBRID, mode, handshake="vllm NHD")


IMPOSSIBLE = [
    # (tp_rank, tp_size, peer_tp_size, num_kv_heads), what the error says
    ((0, 3, 2, 4), "TP 3 here and TP 2 at the peer: neither divides the other"),
    ((0, 2, 3, 6), "TP 2 here and TP 3 at the peer: neither divides the other"),
    ((2, 2, 1, 4), "tp_rank 2 is not a rank of TP 2"),
    ((-1, 1, 2, 4), "tp_rank -1 is not a rank of TP 1"),
    ((0, 4, 1, 6), "6 KV heads do not split over TP 4 (this engine)"),
    ((0, 1, 2, 3), "3 KV heads do not split over TP 2 (the peer)"),
    ((0, 1, 2, 0), "num_kv_heads 0 must each be from 1 to 65536"),
]


def test_impossible_tp_sizes_raise_and_the_agents_keep_working(
    engines: Engines,
) -> None:
    """TP sizes that do not divide each other, a rank outside its TP, heads
    that do not split over a TP size: a LayoutError naming the numbers, no
    slice to plan with; the agents move the right bytes right after."""
    expected = engines.reset(GATHER, HYBRID)
    for args, message in IMPOSSIBLE:
        with pytest.raises(ptrres.LayoutError, match=re.escape(message)):
            ptrres.tp_mapping(*args)
    engines.check(GATHER, HYBRID, expected)
    move(engines, GATHER, HYBRID, "prepared")
