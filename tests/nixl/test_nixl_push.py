"""A push that crosses TP, moved by real NIXL agents over UCX (SPEC 15, issue
40), every byte checked by the head oracle.

The mirror of test_nixl_tp.py: each decode rank is a UCX agent in one of two
spawned processes (rank r in process r % 2), its pages random bytes; each
prefill rank is a UCX agent in this process, its pages its shard of its
engine's logical KV (tests/head_oracle.py). Every prefill rank asks
push_mapping() which decode ranks hold its heads and WRITEs each one
transfer: its slice of every page into that rank's slot, by peer plans
(plain and coalesced) through peer_xfer_descs, or prepared lists
(prepped_pair's rows, prepped_indices). The decode layout it plans against
is what the decode process sent: PeerLayout numbers, or a vLLM
NixlAgentMetadata's fields (PeerLayout.from_nixl_metadata). After the
transfers every decode rank's buffers must be what the oracle says (its
shard of the written blocks, every other page, the padding and the guard
zones as they were) and every prefill rank's buffers unchanged.

The cases are the representative ones of the grid test_push.py runs
without NIXL: a prefill page split over decode ranks, two prefill ranks
filling one decode page, a head written to each decode rank that replicates
it, prefill replicas that write nothing, whole pages, and MLA (the latent
page to every decode rank); one group and a hybrid of two; and a partial
prefix hit (uncached_suffix). Bad input raises before NIXL sees anything.
"""

from __future__ import annotations

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
    not, and per prefill rank the decode ranks it must write (SPEC 15,
    written out by hand)."""

    prefill_tp: int
    decode_tp: int
    num_kv_heads: int
    mla: bool
    targets: tuple[tuple[int, ...], ...]


CASES = {
    # The prefill rank's page in two: heads 0-1 to decode rank 0, 2-3 to 1.
    "1 to 2": Case(1, 2, 4, False, ((0, 1),)),
    # Two prefill ranks fill one decode page: rank 1's heads into slots 2-3.
    "2 to 1": Case(2, 1, 4, False, ((0,), (0,))),
    # 2 KV heads over decode TP 4: each head to both decode ranks that hold
    # it (SGLang #31295's shape, written the other way).
    "1 to 4, 2 heads": Case(1, 4, 2, False, ((0, 1, 2, 3),)),
    # Prefill replicas: ranks 0 and 1 hold head 0, 2 and 3 head 1; ranks 0
    # and 2 write, 1 and 3 write nothing (MoRIIO #47764 sent all of them to
    # decode rank 0).
    "4 to 1, 2 heads": Case(4, 1, 2, False, ((0,), (), (0,), ())),
    # One head per rank on both sides: whole pages, which runs merge.
    "2 to 4, 2 heads": Case(2, 4, 2, False, ((0, 1), (2, 3))),
    # MLA: the whole latent page to every decode rank.
    "1 to 2, MLA": Case(1, 2, 1, True, ((0, 1),)),
    "2 to 1, MLA": Case(2, 1, 1, True, ((0,), ())),
}
# Per layout, per group, per layer: the bytes of one head's token. Hybrid:
# two groups of other block counts (group 1's rows padded, its layers each
# in a buffer of their own).
LAYOUTS = {"one group": ((16, 8),), "hybrid": ((16, 8), (32, 8))}
PREFILL_BLOCKS = {"one group": (13,), "hybrid": (13, 17)}
DECODE_BLOCKS = {"one group": (10,), "hybrid": (10, 12)}
TOKENS = 4
MODES = ("plain", "coalesced", "prepared")

# A push's ids of group g, given the blocks of a prefill rank (n_local) and
# of a decode rank (n_remote) in that group: (prefill ids, decode ids).
Pattern = Callable[[int, int, int], tuple[list[int], list[int]]]
PATTERNS: list[Pattern] = [
    # A run up on both sides (coalesced whole pages merge), then the last
    # prefill block into decode block 0.
    lambda g, nl, nr: (
        [2 + g, 3 + g, 4 + g, 5 + g, nl - 1],
        [5 + g, 6 + g, 7 + g, 8 + g, 0],
    ),
    # A run down on both sides, then scattered ids, a prefill block twice.
    lambda g, nl, nr: ([nl - 2, nl - 3, 0, 1 + g, 0], [nr - 1, nr - 2, 5 + g, 3, 1]),
    # The first and last block of each ref.
    lambda g, nl, nr: ([0, nl - 1], [0, nr - 1]),
]

Ids = list[list[int]]


def transfers(layout: str) -> list[tuple[Ids, Ids]]:
    """Every pattern's ids, group by group: (prefill ids, decode ids)."""
    result = []
    for pattern in PATTERNS:
        pairs = [
            pattern(g, n_local, n_remote)
            for g, (n_local, n_remote) in enumerate(
                zip(PREFILL_BLOCKS[layout], DECODE_BLOCKS[layout])
            )
        ]
        result.append(([local for local, _ in pairs], [remote for _, remote in pairs]))
    return result


def spec_of(local_ids: Ids) -> ptrres.GPULoadStoreSpec:
    """The prefill ids as a spec (int64: bad ids may pass int32)."""
    return ptrres.GPULoadStoreSpec(flat(local_ids), [len(g) for g in local_ids])


def flat(ids: Ids) -> np.ndarray[Any, np.dtype[np.int64]]:
    return np.array([block for group in ids for block in group], np.int64)


def prefill_agent(tp_size: int, rank: int) -> str:
    return f"prefill TP {tp_size} rank {rank}"


def decode_agent(tp_size: int, rank: int) -> str:
    return f"decode TP {tp_size} rank {rank}"


def case_key(case: str, layout: str) -> str:
    return f"{case}, {layout}"


class Engines:
    """Every case's ranks, for every layout: decode ranks in two processes
    (one UCX agent per decode TP size and rank, rank r in process r % 2),
    prefill ranks in this process (one UCX agent per prefill TP size and
    rank), each agent holding its rank's caches of every case it is in."""

    def __init__(self) -> None:
        self.models: dict[str, HeadModel] = {}
        per_process: list[dict[str, dict[str, RankDesign]]] = [{}, {}]
        prefill_designs: dict[str, dict[str, RankDesign]] = {}
        self.mirrors: dict[tuple[str, int], RankCaches] = {}
        for c, (name, case) in enumerate(CASES.items()):
            for m, (layout, head_bytes) in enumerate(LAYOUTS.items()):
                key = case_key(name, layout)
                model = HeadModel(
                    case.num_kv_heads, TOKENS, head_bytes, case.mla, 50 + 10 * c + m
                )
                self.models[key] = model
                for r in range(case.decode_tp):
                    design = RankDesign(
                        model, case.decode_tp, r, DECODE_BLOCKS[layout], 32,
                        3000 + 100 * c + 10 * m + r, "numpy", prefill=False,
                    )  # fmt: skip
                    agent = decode_agent(case.decode_tp, r)
                    per_process[r % 2].setdefault(agent, {})[key] = design
                    # This process's copy of the rank's caches: the same bytes.
                    self.mirrors[key, r] = RankCaches(design)
                for r in range(case.prefill_tp):
                    design = RankDesign(
                        model, case.prefill_tp, r, PREFILL_BLOCKS[layout], 16,
                        4000 + 100 * c + 10 * m + r, "torch", prefill=True,
                    )  # fmt: skip
                    agent = prefill_agent(case.prefill_tp, r)
                    prefill_designs.setdefault(agent, {})[key] = design
        self._children = [Child(serve_ranks, ranks) for ranks in per_process]
        self._owner = {
            agent: child
            for child, ranks in zip(self._children, per_process)
            for agent in ranks
        }
        self._registrations: list[ptrres.nixl.Registration] = []
        self.agents: dict[str, Any] = {}
        self.prefill: dict[tuple[str, int], RankCaches] = {}
        # Each prefill rank's bytes as seeded (reset), which a push keeps.
        self.seeded: dict[tuple[str, int], list[bytes]] = {}
        try:
            for agent_key, designs in prefill_designs.items():
                agent = self.agents[agent_key] = new_agent("prefill", "UCX")
                for key, design in designs.items():
                    caches = self.prefill[key, design.tp_rank] = RankCaches(design)
                    self._registrations.append(
                        ptrres.nixl.register(agent, caches.table)
                    )
            # What each decode agent sent: its metadata, and per case what a
            # handshake carries of its rank's caches.
            self.handshakes: dict[str, Any] = {}
            for child in self._children:
                self.handshakes.update(child.reply(START_TIMEOUT))
            self.names: dict[str, str] = {}
            for agent in self.agents.values():
                for decode, (metadata, _) in self.handshakes.items():
                    self.names[decode] = agent.add_remote_agent(metadata)
        except BaseException:
            self.close()
            raise

    def peer(
        self, name: str, layout: str, rank: int, handshake: str = "numbers"
    ) -> ptrres.PeerLayout:
        """Decode rank ``rank``'s layout as the prefill side knows it: from
        the PeerLayout numbers it sent (checked against this process's copy
        of its caches, but the addresses), or from the fields of a vLLM
        NixlAgentMetadata (``"vllm"``, its kv_cache_layout vLLM's name of
        HND pages)."""
        key = case_key(name, layout)
        agent = decode_agent(CASES[name].decode_tp, rank)
        metadata, cases = self.handshakes[agent]
        numbers, fields = cases[key]
        sent = [[ref[1:4] for ref in refs] for refs in numbers]
        mirror = self.mirrors[key, rank]
        assert sent == [[ref[1:] for ref in refs] for refs in mirror.ref_numbers]
        if handshake == "numbers":
            return ptrres.PeerLayout(numbers, kv_layout="HND")
        fields = {**fields, "kv_cache_layout": "LBHNC"}
        peer = ptrres.PeerLayout.from_nixl_metadata(
            SimpleNamespace(engine_id=agent, agent_metadata=metadata, **fields)
        )
        assert [[ref[:5] for ref in refs] for refs in peer.groups] == [
            [ref[:5] for ref in refs] for refs in numbers
        ]
        return peer

    def remote_name(self, name: str, rank: int) -> str:
        return self.names[decode_agent(CASES[name].decode_tp, rank)]

    def prefill_agent(self, name: str, rank: int) -> Any:
        return self.agents[prefill_agent(CASES[name].prefill_tp, rank)]

    def decode_bytes(self, name: str, layout: str, rank: int) -> list[bytes]:
        agent = decode_agent(CASES[name].decode_tp, rank)
        answer: list[bytes] = self._owner[agent].ask(
            "bytes", agent, case_key(name, layout)
        )
        return answer

    def reset(self, name: str, layout: str) -> dict[int, Caches]:
        """Every rank of a case back to its seeded bytes (the decode ranks
        checked against this process's copies); returns a copy of each
        decode rank's caches, for the oracle's expectations."""
        case, key = CASES[name], case_key(name, layout)
        for r in range(case.decode_tp):
            agent = decode_agent(case.decode_tp, r)
            self._owner[agent].ask("fill", agent, key)
        for r in range(case.prefill_tp):
            self.prefill[key, r].fill()
            self.seeded[key, r] = self.prefill[key, r].snapshot()
        expected = {r: self.mirrors[key, r].copy() for r in range(case.decode_tp)}
        self.check(name, layout, expected)
        return expected

    def check(self, name: str, layout: str, expected: dict[int, Caches]) -> None:
        """Every decode rank's buffers as expected, every prefill rank's as
        seeded, guard zones included."""
        case, key = CASES[name], case_key(name, layout)
        for r in range(case.decode_tp):
            assert_same_bytes(
                self.decode_bytes(name, layout, r),
                expected[r].snapshot(),
                f"{key}: decode rank {r}",
            )
        for r in range(case.prefill_tp):
            assert_same_bytes(
                self.prefill[key, r].snapshot(),
                self.seeded[key, r],
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
    """The decode processes and this process's prefill agents, for every
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
    expected: dict[int, Caches],
    prefill_ids: Ids,
    decode_ids: Ids,
) -> None:
    """The oracle's pages of every decode rank after the prefill engine's
    blocks ``prefill_ids`` were written into its ``decode_ids``, written into
    ``expected`` (every other byte as it was)."""
    key = case_key(name, layout)
    model = engines.models[key]
    for rank, caches in expected.items():
        design = engines.mirrors[key, rank].rank
        for t, g, d in design.refs():
            source = model.logical(g, d, PREFILL_BLOCKS[layout][g])
            rows = caches.rows(t)
            rows[:] = head_oracle.expected_pages(
                rows.copy(), source, design.heads, decode_ids[g], prefill_ids[g]
            )


class Prepared:
    """Prepared lists of one test: per (prefill rank, target rank), both
    sides' lists (prepped_pair's rows), released at the end."""

    def __init__(self) -> None:
        self.lists: dict[tuple[int, int], tuple[Any, Any]] = {}

    def pair(
        self,
        agent: Any,
        rank: int,
        table: ptrres.PointerTable,
        peer: ptrres.PeerLayout,
        remote_name: str,
        heads: HeadSlice,
    ) -> tuple[Any, Any]:
        key = (rank, heads.source_rank)
        if key not in self.lists:
            local_rows, remote_rows = ptrres.nixl.prepped_pair(table, peer, heads)
            self.lists[key] = (
                agent.prep_xfer_dlist("NIXL_INIT_AGENT", *local_rows),
                agent.prep_xfer_dlist(remote_name, *remote_rows),
            )
        return self.lists[key]

    def release(self) -> None:
        for local_list, remote_list in self.lists.values():
            local_list.release()
            remote_list.release()


def write_handle(
    engines: Engines,
    name: str,
    layout: str,
    rank: int,
    heads: HeadSlice,
    spec: ptrres.GPULoadStoreSpec,
    decode_ids: Any,
    mode: str,
    peer: ptrres.PeerLayout,
    prepared: Prepared,
) -> Any:
    """The handle of prefill rank ``rank``'s WRITE of ``heads`` to their
    decode rank: a plan's descriptors, or indices into prepared lists."""
    agent = engines.prefill_agent(name, rank)
    table = engines.prefill[case_key(name, layout), rank].table
    remote_name = engines.remote_name(name, heads.source_rank)
    if mode == "prepared":
        local_list, remote_list = prepared.pair(
            agent, rank, table, peer, remote_name, heads
        )
        return agent.make_prepped_xfer(
            "WRITE",
            local_list,
            ptrres.nixl.prepped_indices(table, spec),
            remote_list,
            ptrres.nixl.prepped_indices(peer, decode_ids, spec.group_sizes),
        )
    plan = table.plan_peer_transfer(
        spec, peer, decode_ids, heads=heads, coalesce=mode == "coalesced"
    )
    if mode == "coalesced":
        plain = table.plan_peer_transfer(spec, peer, decode_ids, heads=heads)
        assert plan.num_bytes == plain.num_bytes == int(plain.sizes.sum())
        if not heads.whole_page:
            # The slices of consecutive pages are not one piece: none merge.
            assert plan.sizes.tolist() == plain.sizes.tolist()
    descs = ptrres.nixl.peer_xfer_descs(plan, local=table, remote=peer)
    return descs.initialize_xfer(agent, "WRITE", remote_name)


def push(
    engines: Engines,
    name: str,
    layout: str,
    mode: str,
    ids: list[tuple[Ids, Ids]],
    *,
    handshake: str = "numbers",
    request: Ids | None = None,
    tamper: Callable[[HeadSlice], HeadSlice] | None = None,
) -> None:
    """Each transfer's push, in a row, from a fresh start: every prefill rank
    of the case WRITEs each of its slices (one transfer a target rank, all
    posted before any is waited on), then every byte of every rank is
    checked. ``request``: the prefill engine's blocks of the request, of
    which the decode engine holds the front (a prefix hit): the ids written
    are its uncached_suffix() for the decode ids' group sizes. ``tamper``:
    change each slice before use (the check must then fail)."""
    case = CASES[name]
    expected = engines.reset(name, layout)
    peers = {r: engines.peer(name, layout, r, handshake) for r in range(case.decode_tp)}
    prepared = Prepared()
    try:
        for prefill_ids, decode_ids in ids:
            spec = spec_of(prefill_ids)
            if request is not None:
                spec = ptrres.uncached_suffix(
                    spec_of(request), [len(g) for g in decode_ids]
                )
                assert spec.block_ids.tolist() == flat(prefill_ids).tolist()
            handles = []
            for rank in range(case.prefill_tp):
                mapping = ptrres.push_mapping(
                    rank, case.prefill_tp, case.decode_tp, case.num_kv_heads,
                    mla=case.mla,
                )  # fmt: skip
                assert mapping.target_ranks == case.targets[rank]
                for heads in mapping.slices:
                    if tamper is not None:
                        heads = tamper(heads)
                    handle = write_handle(
                        engines, name, layout, rank, heads, spec, flat(decode_ids),
                        mode, peers[heads.source_rank], prepared,
                    )  # fmt: skip
                    handles.append((engines.prefill_agent(name, rank), handle))
            expect(engines, name, layout, expected, prefill_ids, decode_ids)
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
def test_every_decode_rank_receives_its_heads_from_the_writers(
    engines: Engines, name: str, layout: str, mode: str
) -> None:
    push(engines, name, layout, mode, transfers(layout))


def test_a_vllm_handshake_moves_the_bytes(engines: Engines) -> None:
    """The decode layout from vLLM's NixlAgentMetadata fields of each decode
    rank (PeerLayout.from_nixl_metadata), in every mode, on the hybrid
    layout, for a split, a gather and replicas."""
    for name in ("1 to 2", "2 to 1", "1 to 4, 2 heads"):
        for mode in MODES:
            push(engines, name, "hybrid", mode, transfers("hybrid"), handshake="vllm")


def test_a_write_into_the_wrong_slot_is_caught(engines: Engines) -> None:
    """The oracle's check fails where both prefill ranks write into the first
    head slot of the decode page (MoRIIO #47764's kind of bug): the check
    can fail."""

    def first_slot(heads: HeadSlice) -> HeadSlice:
        return heads._replace(remote_head=0)

    with pytest.raises(AssertionError, match="decode rank 0: buffer 0 differs"):
        push(engines, "2 to 1", "one group", "plain", transfers("one group"),
             tamper=first_slot)  # fmt: skip


# A request's blocks on the prefill engine, per group of the hybrid layout,
# and the decode engine's ids of the part it has not cached (the last 3 of
# group 0's 6 blocks, the last 1 of group 1's 4).
REQUEST = [[0, 1, 2, 7, 8, 9], [16, 3, 2, 11]]
UNCACHED = [[5, 6, 0], [2]]


def test_a_partial_prefix_hit_writes_the_end_of_the_request(
    engines: Engines,
) -> None:
    """The decode engine holds the front of the request: the prefill ranks
    write the end of its blocks (uncached_suffix) into the decode blocks,
    and the oracle finds each decode block holding the right prefill
    block's shard, in every mode, at a split and at a gather."""
    kept = [group[len(group) - len(d) :] for group, d in zip(REQUEST, UNCACHED)]
    for name in ("1 to 2", "2 to 1", "1 to 4, 2 heads"):
        for mode in MODES:
            push(engines, name, "hybrid", mode, [(kept, UNCACHED)], request=REQUEST)


def test_bad_input_raises_before_nixl(engines: Engines) -> None:
    """A decode id at the decode ref's block count, a prefill id past its
    ref, the whole request against the decode engine's fewer ids, a decode
    TP that does not fit: ptrres's error before anything is posted, nothing
    moves, and the agents write the right bytes right after."""
    name, layout = "1 to 2", "hybrid"
    expected = engines.reset(name, layout)
    table = engines.prefill[case_key(name, layout), 0].table
    prefill_ids, decode_ids = transfers(layout)[0]
    for heads in ptrres.push_mapping(0, 1, 2, 4).slices:
        peer = engines.peer(name, layout, heads.source_rank)
        bad_remote = [list(g) for g in decode_ids]
        bad_remote[1][2] = DECODE_BLOCKS[layout][1]
        with pytest.raises(ptrres.RemoteBlockIdError) as raised:
            table.plan_peer_transfer(
                spec_of(prefill_ids), peer, flat(bad_remote), heads=heads
            )
        assert (raised.value.group, raised.value.position) == (1, 2)
        with pytest.raises(ptrres.RemoteBlockIdError):
            ptrres.nixl.prepped_indices(peer, flat(bad_remote), [5, 5])
        bad_local = [list(g) for g in prefill_ids]
        bad_local[0][4] = PREFILL_BLOCKS[layout][0]
        with pytest.raises(ptrres.BlockIdError) as local_raised:
            table.plan_peer_transfer(
                spec_of(bad_local), peer, flat(decode_ids), heads=heads,
                coalesce=True,
            )  # fmt: skip
        assert type(local_raised.value) is ptrres.BlockIdError
        with pytest.raises(ptrres.SpecError, match="remote ids but"):
            table.plan_peer_transfer(
                spec_of(REQUEST), peer, flat(UNCACHED), heads=heads
            )
    with pytest.raises(ptrres.LayoutError, match="TP 2 here and TP 3 at the peer"):
        ptrres.push_mapping(0, 2, 3, 6)
    with pytest.raises(ptrres.LayoutError, match="from 1 to 65536"):
        ptrres.push_mapping(0, 1, 2**62, 2**62)
    engines.check(name, layout, expected)  # nothing moved
    push(engines, name, layout, "prepared", transfers(layout)[:1])
