"""Numbers from a peer are untrusted input (issue 40, item 4): a fuzz of
PeerLayout.from_nixl_metadata, of PeerLayout itself, and of the peer plans
built on what they return (plan_peer_transfer, ptrres.nixl's peer_xfer_descs,
prepped_rows, prepped_pair and prepped_indices, with and without heads=).

Each case starts from a handshake that describes a peer this table pairs
with (vLLM's NixlAgentMetadata fields, as tests/test_heads.handshake), a
head slice or none, and remote ids that fit; then up to three hostile
changes: a field's entry or the whole field replaced by a hostile value
(negative, zero, huge, past int64 and uint64, floats, NaN, bools, numpy
scalars, strings, None, containers), a list made shorter or longer, a field
deleted, or geometry that overlaps, passes 2**63 or 2**64, or holds pages
wider than their stride; hostile remote ids (out of range, of other dtypes,
shapes and lengths) and hostile head slices. Only a PtrresError may come
out, never another exception or a hang, and what comes out is checked:
each peer ref is a region the handshake declared; every descriptor of a
plan lies inside this table's tensors on the local side and inside one
declared region on the remote side; prepared rows stay inside their regions
and indices inside their ref's rows.

test_the_fuzz_counts prints the cases and the errors by kind (pytest -s, or
captured, in pytest's output). The push path's fuzz is tests/test_push.py's.
"""

from __future__ import annotations

import itertools
import math
import operator
import signal
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import ptrres
import ptrres.nixl

# Cases per fuzz: at least this many (more under HYPOTHESIS_PROFILE=long).
MAX_EXAMPLES = max(300, settings.default.max_examples if settings.default else 0)
FUZZ = settings(
    max_examples=MAX_EXAMPLES,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
# Cases per field of the one-field fuzz (14 fields).
FIELD_FUZZ = settings(FUZZ, max_examples=max(MAX_EXAMPLES // 3, 100))
# Seconds one case may take before it counts as a hang (a case is a few
# small plans: milliseconds).
HANG = 20.0
# The page layouts ptrres reads.
LAYOUTS = ("HND", "NHD", "LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
# Fields of vLLM's NixlAgentMetadata: one entry per region, or one value.
REGION_FIELDS = (
    "kv_caches_base_addr",
    "block_lens",
    "block_strides",
    "region_num_blocks",
    "region_group_ids",
    "region_mem_types",
)
SCALAR_FIELDS = (
    "num_blocks",
    "device_id",
    "kv_cache_layout",
    "dcp_size",
    "pcp_size",
    "ssm_sizes",
    "packed_member_layouts",
    "ple_block_len",
)
# (tp, peer TP, KV heads) that tp_mapping accepts, for sliced cases.
MAPPINGS = [
    (tp, peer_tp, heads)
    for tp in (1, 2, 4)
    for peer_tp in (1, 2, 4)
    for heads in (1, 2, 4, 8)
]

HOSTILE: list[Any] = [
    -1,
    0,
    1,
    2**31 - 1,
    2**31,
    2**32 + 5,
    2**62,
    2**63 - 1,
    2**63,
    2**64 - 1,
    2**64,
    2**65,
    -(2**63),
    -(2**64),
    10**30,
    1.0,
    0.5,
    math.nan,
    math.inf,
    -math.inf,
    True,
    False,
    np.int64(3),
    np.int64(-(2**63)),
    np.uint64(2**64 - 1),
    np.int8(-1),
    np.float64(2.0),
    np.float32(math.nan),
    np.bool_(True),
    "3",
    "",
    "DRAM",
    "LBHNC",
    "nhd",
    b"3",
    None,
    [],
    [1],
    [2**64],
    (0, 0),
    {},
    {"layer": (0, 64)},
    np.array([1, 2]),
    np.array([], np.float64),
    np.array(3),
    object(),
]


# Integers at the edges of what a kernel or NIXL holds (int32, uint32,
# int64, uint64 and past them), drawn often.
EDGES = [
    -(2**64),
    -(2**63) - 1,
    -(2**31),
    2**31 - 1,
    2**32,
    2**63 - 1,
    2**63,
    2**64 - 1,
    2**64,
    2**64 + 5,
    2**100,
]


def hostile() -> st.SearchStrategy[Any]:
    return st.one_of(
        st.sampled_from(EDGES),
        st.sampled_from(HOSTILE),
        st.integers(-(2**70), 2**70),
        st.integers(-3, 70),
        st.floats(allow_nan=True, allow_infinity=True),
    )


# What draws a value from a strategy: a composite's draw, or st.data()'s.
Draw = Callable[..., Any]
# Outcomes, by entry point: "ok" or the error's class name.
COUNTS: Counter[tuple[str, str]] = Counter()


@dataclass
class Case:
    """A table, the handshake of a peer it pairs with (then made hostile),
    ids and a head slice."""

    table: ptrres.PointerTable
    # The table's tensors (kept alive), each (address, nbytes).
    tensors: list[np.ndarray]
    handshake: SimpleNamespace
    spec: ptrres.GPULoadStoreSpec
    remote_ids: Any
    heads: Any
    coalesce: bool
    changes: list[str] = field(default_factory=list)


@st.composite
def cases(draw: st.DrawFn) -> Case:
    """A table and a peer that pair (sliced or not), ids that fit both."""
    head_bytes = draw(st.sampled_from([1, 2, 8]))
    heads: Any = None
    if draw(st.booleans()):
        tp, peer_tp, num_heads = draw(st.sampled_from(MAPPINGS))
        rank = draw(st.integers(0, tp - 1))
        heads = draw(
            st.sampled_from(ptrres.tp_mapping(rank, tp, peer_tp, num_heads).slices)
        )
        local_page = heads.local_heads * head_bytes
        remote_page = heads.remote_heads * head_bytes
    else:
        local_page = remote_page = draw(st.integers(1, 4)) * head_bytes
    refs_per_group = draw(st.lists(st.integers(1, 2), min_size=1, max_size=2))
    tensors = [
        np.zeros(
            (draw(st.integers(1, 5)), local_page + draw(st.integers(0, 3))), np.uint8
        )
        for _ in range(sum(refs_per_group))
    ]
    starts = np.cumsum([0, *refs_per_group]).tolist()
    table = ptrres.PointerTable(
        ptrres.CanonicalKVCaches(
            [ptrres.CanonicalKVCacheTensor(t, local_page) for t in tensors],
            [
                [ptrres.CanonicalKVCacheRef(i, local_page) for i in range(a, b)]
                for a, b in itertools.pairwise(starts)
            ],
        )
    )
    # The peer's regions, one per ref, group by group (some overlapping).
    bases: list[int] = []
    strides: list[int] = []
    counts: list[int] = []
    for _ in tensors:
        if draw(st.booleans()) and bases:
            bases.append(bases[-1] + draw(st.integers(0, 64)))
        else:
            bases.append(draw(st.integers(0, 2**44)) * 64)
        strides.append(remote_page + draw(st.integers(0, 3)))
        counts.append(draw(st.integers(1, 6)))
    handshake = SimpleNamespace(
        engine_id="prefill",
        agent_metadata=b"",
        kv_caches_base_addr=bases,
        device_id=0,
        num_blocks=max(counts),
        block_lens=[remote_page] * len(bases),
        block_strides=strides,
        kv_cache_layout=draw(st.sampled_from(LAYOUTS)),
        block_size=16,
        ssm_sizes=(0, 0),
        attn_backend_name="FLASH_ATTN",
        physical_blocks_per_logical_kv_block=1,
        region_num_blocks=counts,
        region_group_ids=[g for g, n in enumerate(refs_per_group) for _ in range(n)],
        region_names=None,
        region_mem_types=draw(
            st.sampled_from([["DRAM"] * len(bases), ["VRAM"] * len(bases), None])
        ),
        dcp_size=1,
        pcp_size=1,
        ple_block_len=None,
        region_members=[],
        packed_member_layouts={},
    )
    # Ids that fit both sides, group by group.
    local_ids: list[int] = []
    remote_ids: list[int] = []
    sizes = []
    for a, b in itertools.pairwise(starts):
        n = draw(st.integers(0, 4))
        local_limit = min(len(tensors[i]) for i in range(a, b))
        remote_limit = min(counts[a:b])
        local_ids += draw(
            st.lists(st.integers(0, local_limit - 1), min_size=n, max_size=n)
        )
        remote_ids += draw(
            st.lists(st.integers(0, remote_limit - 1), min_size=n, max_size=n)
        )
        sizes.append(n)
    case = Case(
        table,
        tensors,
        handshake,
        ptrres.GPULoadStoreSpec(np.array(local_ids, np.int64), sizes),
        np.array(remote_ids, np.int64),
        heads,
        draw(st.booleans()),
    )
    return case


@st.composite
def changed_cases(draw: st.DrawFn) -> Case:
    """A case, then up to three hostile changes of any kind."""
    case = draw(cases())
    for _ in range(draw(st.integers(0, 3))):
        change(draw, case)
    return case


def change(draw: Draw, case: Case) -> None:
    """One hostile change of the handshake, the remote ids or the slice."""
    message = case.handshake
    kind = draw(
        st.sampled_from(
            ["entry", "field", "length", "delete", "geometry", "ids", "heads"]
        )
    )
    label = kind
    if kind in ("entry", "length"):
        name = draw(st.sampled_from(REGION_FIELDS))
        label = f"{kind} {name}"
        values = getattr(message, name, None)
        if not isinstance(values, list):
            pass
        elif kind == "entry" and values:
            values = list(values)
            values[draw(st.integers(0, len(values) - 1))] = draw(hostile())
        elif draw(st.booleans()) and values:
            values = values[:-1]
        else:
            values = [*values, values[-1] if values else 0]
        setattr(message, name, values)
    elif kind in ("field", "delete"):
        name = draw(st.sampled_from(REGION_FIELDS + SCALAR_FIELDS))
        label = f"{kind} {name}"
        if kind == "field":
            setattr(message, name, draw(hostile()))
        elif hasattr(message, name):
            delattr(message, name)
    elif kind == "geometry":
        label = geometry(draw, case)
    elif kind == "ids":
        case.remote_ids = hostile_ids(draw, case.remote_ids)
    else:
        case.heads = hostile_heads(draw, case.heads)
    case.changes.append(label)


def geometry(draw: Draw, case: Case) -> str:
    """Regions that overflow, overlap, or hold pages wider than their rows."""
    message = case.handshake
    fields = [getattr(message, name, None) for name in REGION_FIELDS[:4]]
    if not all(isinstance(values, list) and values for values in fields):
        return "geometry (none)"
    bases, lens, strides, counts = (list(values or ()) for values in fields)
    # (an earlier change may have made the lists of other lengths)
    r = draw(st.integers(0, min(map(len, (bases, lens, strides, counts))) - 1))
    kind = draw(
        st.sampled_from(
            ["past 2**64", "past 2**63", "wide page", "overlap", "zero stride", "many"]
        )
    )
    if kind == "past 2**64":  # base + num_blocks * stride wraps a uint64
        counts[r] = 2**64 // max(1, as_int(strides[r])) + 1
    elif kind == "past 2**63":
        bases[r] = 2**63 - draw(st.integers(0, 4096))
    elif kind == "wide page":
        lens[r] = as_int(strides[r]) + draw(st.integers(1, 64))
    elif kind == "overlap":
        bases[r] = bases[draw(st.integers(0, r))]
    elif kind == "zero stride":  # every block at one address
        strides[r], lens[r] = 0, 0
        counts[r] = draw(st.sampled_from([1, 2**31, 2**62, 2**63 - 1]))
    else:  # 4 or more regions whose counts sum past 2**31 (and 2**64)
        extra = max(0, 4 - len(bases))
        for name in REGION_FIELDS[4:]:
            values = getattr(message, name, None)
            if isinstance(values, list) and values:
                setattr(message, name, values + values[-1:] * extra)
        count = draw(st.sampled_from([2**31, 2**62, 2**63 - 1]))
        n = len(bases) + extra
        bases = (bases + bases[-1:] * extra)[:n]
        counts, strides, lens = [count] * n, [0] * n, [0] * n
    for name, values in zip(REGION_FIELDS, (bases, lens, strides, counts)):
        setattr(message, name, values)
    return f"geometry {kind}"


def hostile_ids(draw: Draw, ids: Any) -> Any:
    """Remote ids out of range, or of another dtype, shape or length."""
    kind = draw(st.sampled_from(["entry", "dtype", "length", "value"]))
    values = np.asarray(ids).copy() if isinstance(ids, np.ndarray) else ids
    if kind == "entry" and isinstance(values, np.ndarray) and values.size:
        value = draw(st.sampled_from([-1, 6, 2**31, 2**62, 2**63 - 1, -(2**63)]))
        entries = values.ravel().tolist()
        entries[draw(st.integers(0, len(entries) - 1))] = value
        try:  # (an earlier change may have left ids no int64 holds)
            return np.array(entries)
        except OverflowError:
            return entries
    if kind == "dtype" and isinstance(values, np.ndarray):
        dtype = draw(
            st.sampled_from(
                [np.float64, np.uint64, np.int8, np.bool_, np.int32, object]
            )
        )
        return values.astype(dtype)
    if kind == "length" and isinstance(values, np.ndarray):
        return (
            np.concatenate([values, values[:1] + 1])
            if draw(st.booleans())
            else values[:-1]
        )
    return draw(st.one_of(hostile(), st.just(np.array([[0, 1]])), st.just([0, None])))


def hostile_heads(draw: Draw, heads: Any) -> Any:
    """A slice with a hostile field, another slice, or not a slice."""
    if isinstance(heads, ptrres.HeadSlice) and draw(st.booleans()):
        name = draw(st.sampled_from(ptrres.HeadSlice._fields))
        return heads._replace(**{name: draw(hostile())})
    return draw(
        st.one_of(
            st.just(None),
            st.just(ptrres.HeadSlice(0, 0, 0, 1, 1, 2)),
            st.just(ptrres.HeadSlice(0, 0, 0, 2**62, 2**62, 2**63)),
            st.just((0, 0, 0, 1, 1, 1)),
            hostile(),
        )
    )


# --- what comes out is checked ----------------------------------------------


class Hang(Exception):
    """A call that ran past HANG seconds."""


def _hang(signum: int, frame: Any) -> None:
    raise Hang(f"a call ran past {HANG} s")


def attempt(entry: str, call: Callable[[], Any]) -> Any:
    """``call()``'s result, or None where it raised a PtrresError (counted
    by kind); any other exception fails the test, and so does a call that
    runs past HANG seconds (interrupted by SIGALRM where there is one)."""
    alarm = hasattr(signal, "setitimer")
    if alarm:
        previous = signal.signal(signal.SIGALRM, _hang)
        signal.setitimer(signal.ITIMER_REAL, HANG)
    started = time.monotonic()
    try:
        result = call()
    except ptrres.PtrresError as error:
        COUNTS[entry, type(error).__name__] += 1
        result = None
    else:
        COUNTS[entry, "ok"] += 1
    finally:
        if alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    assert time.monotonic() - started < HANG, f"{entry} took over {HANG} s"
    return result


def as_int(value: Any) -> int:
    """An int of what may be one (a hostile value may not: then 0)."""
    try:
        return operator.index(value)
    except TypeError:
        return 0


Region = tuple[int, int, int, int]


def declared_regions(message: Any) -> list[Region]:
    """``(base, stride, page, blocks)`` of each region the handshake
    declares, as a PeerRef's first fields (read once it was accepted: every
    field is then integers)."""
    n = len(message.kv_caches_base_addr)
    counts = getattr(message, "region_num_blocks", None)
    if counts is None:
        counts = [message.num_blocks] * n
    return [
        (operator.index(b), operator.index(s), operator.index(p), operator.index(c))
        for b, p, s, c in zip(
            message.kv_caches_base_addr,
            message.block_lens,
            message.block_strides,
            counts,
        )
    ]


def span(base: int, stride: int, page: int, blocks: int) -> tuple[int, int]:
    """[start, end) of a region's pages."""
    return base, base + (blocks - 1) * stride + page if blocks else base


def inside(address: int, size: int, spans: list[tuple[int, int]]) -> bool:
    return any(a <= address and address + size <= b for a, b in spans)


def check_peer(peer: ptrres.PeerLayout, message: Any) -> None:
    """Each ref of the peer is a region the handshake declared, inside the
    addresses ptrres computes, and its kv_layout the one sent."""
    regions = declared_regions(message)
    for group in peer.groups:
        for ref in group:
            assert all(type(v) is int for v in ref[:4])
            assert ref[:4] in regions
            assert 0 <= ref.page_size_bytes <= ref.row_stride_bytes
            assert span(*ref[:4])[1] <= 2**63 - 1
            assert ref.device is not None
            assert -1 <= ref.device <= 2**31 - 1
    assert peer.kv_layout == message.kv_cache_layout
    assert peer.kv_layout in LAYOUTS


def local_spans(case: Case) -> list[tuple[int, int]]:
    return [(t.ctypes.data, t.ctypes.data + t.nbytes) for t in case.tensors]


def remote_spans(message: Any) -> list[tuple[int, int]]:
    return [span(*region) for region in declared_regions(message)]


def check_plan(plan: ptrres.PeerTransferPlan, case: Case) -> None:
    """Every descriptor inside this table's tensors and one declared peer
    region, no longer than a page."""
    local, remote, sizes = (
        getattr(plan, n).tolist() for n in ("local", "remote", "sizes")
    )
    assert len(local) == len(remote) == len(sizes)
    mine, theirs = local_spans(case), remote_spans(case.handshake)
    for address, other, size in zip(local, remote, sizes):
        assert inside(address, size, mine), (address, size)
        assert inside(other, size, theirs), (other, size)
    assert plan.num_bytes == sum(sizes)


def check_rows(rows: ptrres.nixl.PreppedRows, spans: list[tuple[int, int]]) -> None:
    """Each strided row's descriptors inside one of the spans, and no more
    of them than NIXL's int indices reach."""
    total = 0
    for base, page, _, stride, count in rows.xfer_list.tolist():
        if count:
            assert inside(base, (count - 1) * stride + page, spans), (base, count)
        total += count
    assert total <= 2**31 - 1


def check_indices(indices: Any, peer: ptrres.PeerLayout, case: Case) -> None:
    """Indices ref-major, each inside its own ref's rows."""
    counts = [ref.num_blocks for group in peer.groups for ref in group]
    firsts = np.cumsum([0, *counts]).tolist()
    assert indices.dtype == np.int32
    ids = np.asarray(case.remote_ids).tolist()
    position = 0
    ref = 0
    for g, group in enumerate(peer.groups):
        n = case.spec.group_sizes[g]
        start = sum(case.spec.group_sizes[:g])
        for _ in group:
            for k in range(n):
                index = int(indices[position])
                assert firsts[ref] <= index < firsts[ref + 1]
                assert index == firsts[ref] + ids[start + k]
                position += 1
            ref += 1
    assert position == len(indices)


# --- the fuzz ---------------------------------------------------------------


def run_case(case: Case) -> None:
    """from_nixl_metadata, then every peer plan on what it returns: only
    PtrresErrors, and every descriptor inside the regions declared."""
    peer = attempt(
        "from_nixl_metadata",
        lambda: ptrres.PeerLayout.from_nixl_metadata(case.handshake),
    )
    if peer is None:
        return
    check_peer(peer, case.handshake)
    plan = attempt(
        "plan_peer_transfer",
        lambda: case.table.plan_peer_transfer(
            case.spec, peer, case.remote_ids, heads=case.heads, coalesce=case.coalesce
        ),
    )
    if plan is not None:
        check_plan(plan, case)
        descs = attempt(
            "peer_xfer_descs",
            lambda: ptrres.nixl.peer_xfer_descs(plan, local=case.table, remote=peer),
        )
        if descs is not None:
            assert descs.remote[:, :2].tolist() == [
                [a, n] for a, n in zip(plan.remote.tolist(), plan.sizes.tolist())
            ]
            devices = set(descs.remote[:, 2].tolist())
            assert devices <= {ptrres.nixl.memory_of(peer).dev_id}
            assert all(0 <= d <= 2**31 - 1 for d in devices)
    rows = attempt(
        "prepped_rows", lambda: ptrres.nixl.prepped_rows(peer, heads=case.heads)
    )
    if rows is not None:
        check_rows(rows, remote_spans(case.handshake))
    pair = attempt(
        "prepped_pair", lambda: ptrres.nixl.prepped_pair(case.table, peer, case.heads)
    )
    if pair is not None:
        check_rows(pair[0], local_spans(case))
        check_rows(pair[1], remote_spans(case.handshake))
    indices = attempt(
        "prepped_indices",
        lambda: ptrres.nixl.prepped_indices(
            peer, case.remote_ids, case.spec.group_sizes
        ),
    )
    if indices is not None:
        check_indices(indices, peer, case)


@pytest.mark.parametrize("name", REGION_FIELDS + SCALAR_FIELDS)
@FIELD_FUZZ
@given(cases(), hostile(), st.integers(0, 3), st.booleans())
def test_one_hostile_field_raises_ptrres_errors_or_plans_inside_its_regions(
    name: str, case: Case, value: Any, entry: int, whole: bool
) -> None:
    """Each field of the handshake in turn, hostile: one of a region
    field's entries, or the whole field; planned on if it is read."""
    values = getattr(case.handshake, name)
    if isinstance(values, list) and not whole:
        values = list(values)
        values[entry % len(values)] = value
        setattr(case.handshake, name, values)
    else:
        setattr(case.handshake, name, value)
    run_case(case)


@FUZZ
@given(cases(), st.data())
def test_hostile_geometry_raises_ptrres_errors_or_plans_inside_its_regions(
    case: Case, data: st.DataObject
) -> None:
    """Regions past 2**63 or 2**64, pages wider than their stride,
    regions that overlap, of one address, or more blocks than NIXL's
    indices reach: refused, or every descriptor inside them."""
    case.changes.append(geometry(data.draw, case))
    run_case(case)


@FUZZ
@given(cases(), st.data())
def test_hostile_ids_and_heads_raise_ptrres_errors(
    case: Case, data: st.DataObject
) -> None:
    """Remote ids out of range or of another dtype, shape or length, and
    head slices of hostile fields, against a handshake that reads."""
    if data.draw(st.booleans()):
        case.remote_ids = hostile_ids(data.draw, case.remote_ids)
    if data.draw(st.booleans()):
        case.heads = hostile_heads(data.draw, case.heads)
    run_case(case)


@FUZZ
@given(changed_cases())
def test_a_hostile_handshake_raises_ptrres_errors_or_plans_inside_its_regions(
    case: Case,
) -> None:
    """Up to three hostile changes of any kind at once."""
    run_case(case)


@st.composite
def group_refs(draw: st.DrawFn) -> tuple[list[list[Any]], Any]:
    """A peer's refs (tuples of PeerRef's fields, or PeerRefs), one field
    or a group made hostile, and a kv_layout, hostile or not."""
    groups: list[list[Any]] = []
    for _ in range(draw(st.integers(0, 2))):
        refs: list[Any] = []
        for _ in range(draw(st.integers(0, 2))):
            page = draw(st.integers(0, 64))
            fields = [
                draw(st.integers(0, 2**40)),
                page + draw(st.integers(0, 8)),
                page,
                draw(st.integers(0, 8)),
                draw(st.sampled_from([-1, 0, 3])),
                draw(st.sampled_from([None, 0, 1])),
            ][: draw(st.integers(4, 6))]
            refs.append(tuple(fields))
        groups.append(refs)
    refs_at = [(g, d) for g, refs in enumerate(groups) for d in range(len(refs))]
    if draw(st.booleans()) and refs_at:
        g, d = draw(st.sampled_from(refs_at))
        fields = list(groups[g][d])
        fields[draw(st.integers(0, len(fields) - 1))] = draw(hostile())
        groups[g][d] = tuple(fields)
    elif draw(st.booleans()) and groups:
        groups[draw(st.integers(0, len(groups) - 1))] = draw(hostile())
    layout = draw(st.sampled_from([None, *LAYOUTS]))
    if draw(st.integers(0, 3)) == 0:
        layout = draw(hostile())
    return groups, layout


@FUZZ
@given(group_refs())
def test_a_hostile_peer_layout_raises_ptrres_errors_or_holds_plain_numbers(
    refs_and_layout: tuple[list[list[Any]], Any],
) -> None:
    """PeerLayout of hostile refs: a PtrresError, or refs of plain ints
    inside the addresses ptrres computes, whose prepared rows and indices
    stay inside them."""
    groups, layout = refs_and_layout
    peer = attempt("PeerLayout", lambda: ptrres.PeerLayout(groups, kv_layout=layout))
    if peer is None:
        return
    assert peer.kv_layout is None or peer.kv_layout in LAYOUTS
    spans = []
    for group in peer.groups:
        for ref in group:
            assert all(type(v) is int for v in ref[:4])
            assert 0 <= ref.page_size_bytes <= ref.row_stride_bytes
            assert span(*ref[:4])[1] <= 2**63 - 1
            spans.append(span(*ref[:4]))
    rows = attempt("prepped_rows", lambda: ptrres.nixl.prepped_rows(peer))
    if rows is not None:
        check_rows(rows, spans)
    ids = [0] * len(peer.groups)
    sizes = [1] * len(peer.groups)
    indices = attempt(
        "prepped_indices", lambda: ptrres.nixl.prepped_indices(peer, ids, sizes)
    )
    if indices is not None:
        firsts = np.cumsum([0, *(r.num_blocks for g in peer.groups for r in g)])
        assert indices.tolist() == firsts[:-1].tolist()


def test_the_fuzz_counts(capsys: pytest.CaptureFixture[str]) -> None:
    """The fuzz's cases and outcomes by entry point and kind (run here if
    the fuzz has not run in this session), printed; every entry point both
    planned and refused, and each refusal a PtrresError."""
    if not COUNTS:
        for name in REGION_FIELDS + SCALAR_FIELDS:
            test_one_hostile_field_raises_ptrres_errors_or_plans_inside_its_regions(
                name
            )
        test_hostile_geometry_raises_ptrres_errors_or_plans_inside_its_regions()
        test_hostile_ids_and_heads_raise_ptrres_errors()
        test_a_hostile_handshake_raises_ptrres_errors_or_plans_inside_its_regions()
        test_a_hostile_peer_layout_raises_ptrres_errors_or_holds_plain_numbers()
    entries = sorted({entry for entry, _ in COUNTS})
    kinds = sorted({kind for _, kind in COUNTS}, key=lambda k: (k != "ok", k))
    cases = {e: sum(n for (x, _), n in COUNTS.items() if x == e) for e in entries}
    width = max(map(len, entries))
    lines = [
        f"{'':<{width}}{'calls':>8}" + "".join(f"{k:>20}" for k in kinds),
        *(
            f"{e:<{width}}{cases[e]:>8}" + "".join(f"{COUNTS[e, k]:>20}" for k in kinds)
            for e in entries
        ),
    ]
    with capsys.disabled():
        print("\n" + "\n".join(lines))
    for kind in kinds:
        assert kind == "ok" or issubclass(getattr(ptrres, kind), ptrres.PtrresError)
    for entry in (
        "from_nixl_metadata",
        "plan_peer_transfer",
        "prepped_indices",
        "PeerLayout",
    ):
        assert COUNTS[entry, "ok"] > 0, entry
        assert sum(n for (e, k), n in COUNTS.items() if e == entry and k != "ok") > 0
