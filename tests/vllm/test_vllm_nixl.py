"""ptrres.vllm on vLLM's NIXL connector (0.30 to 0.34): every block id that
``NixlBaseConnectorWorker._compute_desc_ids`` turns into a descriptor index,
checked on both sides of a prefill/decode transfer.

Three levels, each against the installed release's own code:

- ``_compute_desc_ids`` of 0.30 to 0.33 (0.34's, which takes region pairs,
  is test_vllm_nixl_pairs.py's), under hypothesis, on a worker holding only the
  attributes the release's method reads (DESC_IDS_ATTRIBUTES, and nothing
  else is read: StrictWorker): on ids in range the patched method returns
  vLLM's array, element for element and dtype (compiled, and checked then
  vLLM's own); on a bad id, vLLM's shape made of REFUSED_INDEX and one
  WARNING line naming it; where vLLM raises, the same exception. What each
  group's ids index comes from ``spans()``, this file's reading of vLLM's
  branches, itself checked against vLLM's output on every example;
- ``ptrres.vllm.patch()``: the connector's four methods replaced and
  restored (0.34: ``_nixl_pairs.nixl_replacements_034``'s), or left alone,
  all or nothing with the other paths, where the code they depend on is not
  a tested release's (its fingerprint);
- a request through vLLM's own ``_read_blocks`` (pull, READ) and
  ``_xfer_blocks`` (push, WRITE) with real NIXL agents on host memory
  (nixl_worker): unpatched, a group's id past its region moves another
  layer's block and completes; an id of 2**31 raises outside vLLM's
  ``try`` (0.30 to 0.33: numpy's int32) or fails the request (0.34's int64,
  which NIXL refuses), and one of 2**32 + 1 moves block 1 on 0.34 (NIXL
  casts its int64 indices to C ints); patched, the request fails the way
  vLLM fails a transfer it cannot set up, with no byte moved, and the next
  request moves the right bytes.
"""

from __future__ import annotations

import inspect
import logging
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from nixl_worker import (
    NUM_BLOCKS,
    PAIRS,
    PREFILL,
    RELEASE,
    Engine,
    Records,
    StrictWorker,
    Transfer,
    base_worker,
    captured,
    engines,
    misses,
    outcome,
    pull,
    pull_worker,
    push,
    push_worker,
    read,
    strict_worker,
    wait_done,
    write,
)
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    CircularBufferSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from vllm_harness import cuda_mem_ops, worker

import ptrres.vllm as plugin
from ptrres.vllm import _nixl, _patching, _release, _state, _warmup
from ptrres.vllm._nixl import REFUSED_INDEX

Base = base_worker.NixlBaseConnectorWorker
Pull = pull_worker.NixlPullConnectorWorker
Push = push_worker.NixlPushConnectorWorker
Handler = worker.SingleDirectionOffloadingHandler

# vLLM's own methods, as the release ships them (collected unpatched).
VLLM_METHODS = {
    (Base, "__init__"): vars(Base)["__init__"],
    (Base, "_compute_desc_ids"): vars(Base)["_compute_desc_ids"],
    (Pull, "_read_blocks"): vars(Pull)["_read_blocks"],
    (Push, "_xfer_blocks"): vars(Push)["_xfer_blocks"],
}
VLLM_COMPUTE_DESC_IDS = VLLM_METHODS[Base, "_compute_desc_ids"]
NIXL_PATCHES = [f"{owner.__name__}.{name}" for owner, name in VLLM_METHODS]

# What NixlBaseConnectorWorker._compute_desc_ids reads of its worker, in
# each release (a release that reads another fails StrictWorker loudly):
# 0.31 added layer-name routing.
_DESC_IDS_ATTRIBUTES_030 = (
    "_has_mamba",
    "_conv_decomp",
    "_ssm_region_indices",
    "block_len_per_layer",
    "num_regions",
    "region_group_ids",
    "_uses_region_group_mapping",
    "_group_spec_types",
    "_scratch_region_indices",
    "_ple_group_index",
)
_DESC_IDS_ATTRIBUTES_031 = (*_DESC_IDS_ATTRIBUTES_030, "_transfer_layer_group_ids")
DESC_IDS_ATTRIBUTES: dict[str, tuple[str, ...]] = {
    "0.30": _DESC_IDS_ATTRIBUTES_030,
    "0.31": _DESC_IDS_ATTRIBUTES_031,
    "0.32": _DESC_IDS_ATTRIBUTES_031,
    "0.33": _DESC_IDS_ATTRIBUTES_031,
}
# What the patched method may try and find missing: on 0.30, the routing
# 0.31 added (read with a default; a 0.30 worker has none).
PATCH_PROBES: dict[str, set[str]] = {
    "0.30": {"_transfer_layer_group_ids"},
    "0.31": set(),
    "0.32": set(),
    "0.33": set(),
}
ROUTING = "_transfer_layer_group_ids" in DESC_IDS_ATTRIBUTES.get(RELEASE, ())
# The tests of 0.30-0.33's _compute_desc_ids (region groups, routing, Mamba's
# scratch regions); 0.34's pairs regions: test_vllm_nixl_pairs.py.
before_pairs = pytest.mark.skipif(
    PAIRS, reason="0.34's _compute_desc_ids takes region pairs: test_vllm_nixl_pairs"
)

# The form of ptrres.vllm's NIXL patch this release gets (its PathCode in
# ptrres.vllm._release, or _nixl_pairs.NIXL_034_CODE).
VARIANT = "0.34" if PAIRS else "0.30"


@pytest.fixture(autouse=True)
def _unpatched(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every test starts and ends with vLLM as it ships (unpatched before
    monkeypatch restores what a test changed)."""
    monkeypatch.delenv("PTRRES_VLLM_NIXL", raising=False)
    plugin.unpatch()
    _patching._warned.clear()
    _nixl._warned.clear()
    yield
    plugin.unpatch()


# --- _compute_desc_ids: the worker, the oracle, the strategies ---------------------


class ConvDecomp(NamedTuple):
    """What _compute_desc_ids reads of vLLM's MambaConvSplitInfo."""

    local_conv_offsets: tuple[int, ...]


@dataclass(frozen=True)
class Model:
    """A worker's regions and groups: the attributes _compute_desc_ids reads."""

    block_len_per_layer: tuple[int, ...]
    num_regions: int
    region_group_ids: tuple[int, ...] = ()
    uses_region_group_mapping: bool = False
    routing: tuple[int, ...] = ()  # _transfer_layer_group_ids (0.31+)
    has_mamba: bool = False
    conv_offsets: tuple[int, ...] | None = None  # None: no _conv_decomp
    ssm_region_indices: tuple[int, ...] = ()
    group_spec_types: tuple[type, ...] = ()
    scratch_region_indices: tuple[int, ...] = ()
    ple_group_index: int | None = None

    def attributes(self) -> dict[str, Any]:
        """As the release's worker holds them (lists, as vLLM keeps them)."""
        values: dict[str, Any] = {
            "_has_mamba": self.has_mamba,
            "_conv_decomp": (
                None if self.conv_offsets is None else ConvDecomp(self.conv_offsets)
            ),
            "_ssm_region_indices": list(self.ssm_region_indices),
            "block_len_per_layer": list(self.block_len_per_layer),
            "num_regions": self.num_regions,
            "region_group_ids": list(self.region_group_ids),
            "_uses_region_group_mapping": self.uses_region_group_mapping,
            "_group_spec_types": list(self.group_spec_types),
            "_scratch_region_indices": list(self.scratch_region_indices),
            "_ple_group_index": self.ple_group_index,
            "_transfer_layer_group_ids": list(self.routing),
        }
        return {name: values[name] for name in DESC_IDS_ATTRIBUTES[RELEASE]}


@dataclass(frozen=True)
class Call:
    """_compute_desc_ids' arguments after the worker."""

    block_ids: tuple[tuple[int, ...], ...]
    dst_num_blocks: int
    block_size_ratio: float | None = None
    physical_blocks_per_logical: int = 1
    region_num_blocks: tuple[int, ...] | None = None
    region_group_ids: tuple[int, ...] | None = None
    uses_region_group_mapping: bool | None = None
    # A list per group, as vLLM passes them; or a tuple, which it takes too.
    group_type: type = list

    def arguments(self, block_ids: Sequence[Sequence[int]] | None = None) -> Any:
        """The arguments as vLLM passes them, with these block ids (or the
        call's own)."""
        ids = self.block_ids if block_ids is None else block_ids
        return (
            [self.group_type(group) for group in ids],
            self.dst_num_blocks,
            self.block_size_ratio,
            self.physical_blocks_per_logical,
            None if self.region_num_blocks is None else list(self.region_num_blocks),
            None if self.region_group_ids is None else list(self.region_group_ids),
            self.uses_region_group_mapping,
        )

    def sane(self) -> Any:
        """The arguments with every id numpy's int32 refuses made 0: where
        vLLM fails on these, it fails whatever the ids."""
        return self.arguments(
            [[v if -(2**31) <= v < 2**31 else 0 for v in g] for g in self.block_ids]
        )


# Span.group of a span that takes every group's ids, concatenated.
ALL = -1


class Span(NamedTuple):
    """One stretch of vLLM's output: a group's ids (or every group's), each
    plus its region's first descriptor; the region holds ``blocks`` blocks."""

    group: int
    region: int
    first: int
    blocks: int


def spans(model: Model, call: Call) -> list[Span] | None:
    """Where vLLM's _compute_desc_ids (0.30 to 0.33) puts each group's ids,
    in the order of its output; None where it raises. Written from vLLM's
    branches (layer routing; all attention, without and with region-group
    mapping; Mamba), and checked against its output on every example."""
    ssm_regions = 0
    if model.has_mamba:
        if model.conv_offsets is None:  # vLLM asserts a conv decomposition
            return None
        layers = len(model.ssm_region_indices or model.block_len_per_layer)
        ssm_regions = layers * (len(model.conv_offsets) + 1)
    ratio = call.block_size_ratio
    blocks = call.dst_num_blocks if ratio is None else int(call.dst_num_blocks * ratio)
    n = len(model.routing) or model.num_regions or len(model.block_len_per_layer)
    if call.region_num_blocks is None:
        counts = [blocks] * n
    else:
        counts = [
            c if ratio is None else int(c * ratio) for c in call.region_num_blocks
        ]
        if counts and not model.routing:
            n = len(counts)
    if len(counts) != n:
        return None
    firsts = [sum(counts[:r]) for r in range(n)]
    groups = len(call.block_ids)
    if model.routing:
        if any(g >= groups for g in model.routing):
            return None
        return [Span(g, k, firsts[k], counts[k]) for k, g in enumerate(model.routing)]
    if ssm_regions:
        return _mamba_spans(model, call, blocks, sum(counts), ssm_regions)
    owners = call.region_group_ids
    mapping = call.uses_region_group_mapping
    if owners is None:
        owners = model.region_group_ids
        if mapping is None:
            mapping = model.uses_region_group_mapping
    if not owners and n == 1:
        owners = (0,)
    if len(owners) != n:
        return None
    if mapping is None:
        mapping = len(set(owners)) > 1
    if not mapping:
        if not groups:
            return None
        return [Span(ALL, r, firsts[r], counts[r]) for r in range(n)]
    found = []
    for g, ids in enumerate(call.block_ids):
        regions = [r for r, owner in enumerate(owners) if owner in (g, -1)]
        if ids and not regions:
            return None
        found += [Span(g, r, firsts[r], counts[r]) for r in regions if ids]
    return found


def _mamba_spans(
    model: Model, call: Call, blocks: int, attention_descs: int, ssm_regions: int
) -> list[Span] | None:
    """vLLM's Mamba branch: an attention group's ids go to every region (a
    CircularBufferSpec's to its scratch regions), ``blocks`` apart; an SSM
    group's to every SSM region (the PLE group's to the one after them),
    after every attention descriptor, logical blocks apart."""
    logical = call.dst_num_blocks // call.physical_blocks_per_logical
    found = []
    for g in range(len(call.block_ids)):
        if g >= len(model.group_spec_types):
            return None
        kind = model.group_spec_types[g]
        if issubclass(kind, AttentionSpec):
            regions: Sequence[int] = (
                model.scratch_region_indices
                if kind is CircularBufferSpec
                else range(model.num_regions)
            )
            found += [Span(g, r, r * blocks, blocks) for r in regions]
        elif issubclass(kind, MambaSpec):
            ssm = [ssm_regions] if g == model.ple_group_index else range(ssm_regions)
            found += [Span(g, s, attention_descs + s * logical, logical) for s in ssm]
        else:  # vLLM raises "Unknown spec type"
            return None
    return found if call.block_ids else None


def expected_ids(found: list[Span], block_ids: Sequence[Sequence[int]]) -> list[int]:
    """vLLM's output for ``found``: each span's ids plus its first descriptor."""
    return [
        span.first + v
        for span in found
        for v in (
            [v for group in block_ids for v in group]
            if span.group == ALL
            else block_ids[span.group]
        )
    ]


class Bad(NamedTuple):
    """An id outside its region: where it is, and the span it goes to."""

    group: int
    position: int
    value: int
    span: Span


def first_bad(found: list[Span], block_ids: Sequence[Sequence[int]]) -> Bad | None:
    """The first id, in the order of vLLM's output, outside its region."""
    for span in found:
        members = (
            [(g, k, v) for g, ids in enumerate(block_ids) for k, v in enumerate(ids)]
            if span.group == ALL
            else [(span.group, k, v) for k, v in enumerate(block_ids[span.group])]
        )
        for group, position, value in members:
            if not 0 <= value < span.blocks:
                return Bad(group, position, value, span)
    return None


ATTENTION_SPECS = (FullAttentionSpec, SlidingWindowSpec, MLAAttentionSpec)
# Mamba models' group specs; KVCacheSpec (vLLM raises) now and then.
MAMBA_GROUP_SPECS = (
    *ATTENTION_SPECS * 2,
    *(CircularBufferSpec,) * 4,
    *(MambaSpec,) * 9,
    KVCacheSpec,
)
KINDS = ("one group", "hybrid", "mamba", *(["routing"] if ROUTING else []))


def region_groups(regions: int, groups: int) -> st.SearchStrategy[tuple[int, ...]]:
    """Each region's group: round robin, some shared (-1), now and then a
    group that has no ids (vLLM asserts when one with ids has no region)."""
    return st.tuples(
        *(
            st.sampled_from([r % groups] * 4 + [-1, -1, groups - 1, groups])
            for r in range(regions)
        )
    )


@st.composite
def models(draw: st.DrawFn, kind: str | None = None) -> Model:
    """One group; hybrid (per-group regions, shared ones: -1); layer-name
    routing (0.31+); a Mamba model (attention, scratch and SSM groups). Of
    ``kind``, or any."""
    if kind is None:
        kind = draw(st.sampled_from(KINDS))
    regions = draw(st.integers(1, 5))
    groups = 1 if kind == "one group" else draw(st.integers(1, 4))
    model = Model(
        block_len_per_layer=(64,) * regions,
        # 0: vLLM counts block_len_per_layer instead.
        num_regions=draw(st.sampled_from([regions, regions, 0])),
    )
    if kind == "one group":
        # (): vLLM's when one region (and an AssertionError when more).
        owners = draw(st.sampled_from([(0,) * regions] * 4 + [()]))
        return replace(model, region_group_ids=owners)
    owners = draw(region_groups(regions, groups))
    model = replace(
        model,
        region_group_ids=owners,
        uses_region_group_mapping=draw(st.booleans()) or len(set(owners)) > 1,
        group_spec_types=(FullAttentionSpec,) * groups,
    )
    if kind == "routing":
        layers = draw(st.lists(st.integers(0, groups - 1), min_size=1, max_size=5))
        return replace(model, routing=tuple(layers))
    if kind == "hybrid":
        return model
    region_subsets = st.lists(st.integers(0, regions - 1), unique=True).map(sorted)
    return replace(
        model,
        has_mamba=True,
        # Mamba2 and GDN: 3 conv sub-projections; Mamba1: 1.
        conv_offsets=draw(st.sampled_from([(0, 64, 96)] * 3 + [(0,), (), None])),
        ssm_region_indices=tuple(draw(region_subsets)),
        group_spec_types=tuple(
            draw(st.sampled_from(MAMBA_GROUP_SPECS)) for _ in range(groups)
        ),
        scratch_region_indices=tuple(draw(region_subsets)),
        ple_group_index=draw(st.none() | st.integers(0, groups - 1)),
    )


# Ids at every boundary (besides each region's count and first descriptor):
# one below the first block, past int32 (numpy's OverflowError in vLLM), past
# int64 (no id array takes it).
EDGE_IDS = (-1, 2**31 - 1, 2**31, 2**31 + 5, 2**63, -(2**31) - 1)


@st.composite
def calls(draw: st.DrawFn, model: Model) -> Call:
    """Arguments as vLLM's pull and push workers pass them, remote (no ratio)
    or local side, per group (or per region: a region-mapped read); ids in
    range of every region they index, and in half the calls one that is not:
    at a boundary (-1, a region's count, the next region's first block, past
    int32 or int64) or one past it."""
    n = len(model.routing) or model.num_regions or len(model.block_len_per_layer)
    groups = max(len(model.group_spec_types), 1)
    # Whose region groups: the worker's (None), the worker's passed (as the
    # local side does), the other engine's (the remote side), one a region.
    source = draw(
        st.sampled_from(
            ["worker", "worker", "passed", "other engine", "by region"]
            if not model.has_mamba
            else ["worker", "other engine"]
        )
    )
    owners = None
    mapping = draw(st.sampled_from([None, True, False]))
    if source == "passed":
        owners = model.region_group_ids
    elif source == "other engine":
        owners = draw(region_groups(n, groups))
    elif source == "by region":
        owners, mapping, groups = tuple(range(n)), n > 1, n
    call = Call(
        block_ids=tuple(() for _ in range(groups)),
        dst_num_blocks=draw(st.integers(1, 12)),
        block_size_ratio=draw(st.sampled_from([None, None, 1, 2, 0.5])),
        physical_blocks_per_logical=draw(st.sampled_from([1, 1, 2, 3])),
        region_num_blocks=draw(
            st.sampled_from(["none"] * 3 + ["per region"] * 6 + ["any"]).flatmap(
                lambda counts: {
                    "none": st.none(),
                    "per region": st.lists(
                        st.integers(0, 12), min_size=n, max_size=n
                    ).map(tuple),
                    "any": st.lists(st.integers(1, 12), max_size=6).map(tuple),
                }[counts]
            )
        ),
        region_group_ids=owners,
        uses_region_group_mapping=mapping,
        group_type=draw(st.sampled_from([list, list, list, tuple])),
    )
    sizes = [draw(st.integers(0, 3)) for _ in range(groups)]
    layout = spans(model, replace(call, block_ids=tuple((0,) * k for k in sizes)))
    found = layout or []
    edges = sorted(
        {*EDGE_IDS, *(s.blocks for s in found), *(s.first for s in found)}
        | {s.blocks - 1 for s in found}
        | {sum(s.blocks for s in found)}
    )
    block_ids = []
    for g, size in enumerate(sizes):
        limit = min(
            (s.blocks for s in found if s.group in (g, ALL)), default=NUM_BLOCKS
        )
        good = st.integers(0, limit - 1) if limit > 0 else st.sampled_from(edges)
        block_ids.append([draw(good) for _ in range(size)])
    # Half the calls: one id out of its region, at a boundary or one past it.
    placed = [(g, k) for g, size in enumerate(sizes) for k in range(size)]
    misplace = draw(st.booleans())
    if placed and misplace:
        g, k = draw(st.sampled_from(placed))
        limit = min((s.blocks for s in found if s.group in (g, ALL)), default=0)
        bad = [v for v in edges if not 0 <= v < limit] + [limit, limit + 1]
        block_ids[g][k] = draw(st.sampled_from(bad))
    return replace(call, block_ids=tuple(tuple(ids) for ids in block_ids))


@dataclass(frozen=True)
class Case:
    """A worker's regions, then calls; then maybe other regions (the same
    worker registered again), then calls."""

    steps: tuple[tuple[Model, tuple[Call, ...]], ...]


@st.composite
def cases(draw: st.DrawFn, kind: str) -> Case:
    """A worker of ``kind``, and now and then the same worker registered
    again, as any kind."""
    steps = []
    for step in range(draw(st.integers(1, 2))):
        model = draw(models(kind if step == 0 else None))
        steps.append(
            (model, tuple(draw(st.lists(calls(model), min_size=1, max_size=2))))
        )
    return Case(tuple(steps))


# The hybrid case: group 0's id 4 is region 1's block 0.
HYBRID = Model(
    block_len_per_layer=(64, 64),
    num_regions=2,
    region_group_ids=(0, 1),
    uses_region_group_mapping=True,
    group_spec_types=(FullAttentionSpec, SlidingWindowSpec),
)
ONE_GROUP = Model(
    block_len_per_layer=(64,) * 3, num_regions=3, region_group_ids=(0,) * 3
)
MAMBA = Model(
    block_len_per_layer=(64,) * 3,
    num_regions=3,
    has_mamba=True,
    conv_offsets=(0, 64, 96),
    ssm_region_indices=(1,),
    group_spec_types=(FullAttentionSpec, CircularBufferSpec, MambaSpec, MambaSpec),
    scratch_region_indices=(2,),
    ple_group_index=3,
)
ROUTED = replace(HYBRID, routing=(0, 1, 1))
EXAMPLES = [
    Case(((HYBRID, (Call(((0, 4), (2,)), 4, None, 1, (4, 4)),)),)),
    Case(((HYBRID, (Call(((3,), (4,)), 4, 1, 1, (4, 4), (0, 1), True),)),)),
    Case(((ONE_GROUP, (Call(((1, 2**31), (3,)), 4),)),)),
    Case(((ONE_GROUP, (Call(((-1,),), 4, None, 1, (4, 2, 4)),)),)),
    Case(((ONE_GROUP, (Call(((2**31 + 5,),), 4, 0.5),)),)),
    Case(((ONE_GROUP, (Call(((2**63,), (1,)), 4, 2),)),)),
    # The SSM group's ids count logical blocks: 8 // 2.
    Case(((MAMBA, (Call(((7,), (0,), (3, 4), (0,)), 8, None, 2),)),)),
    Case(((MAMBA, (Call(((0,), (8,), (0,), (0,)), 8, None, 2),)),)),
    # A region of -1 blocks (a peer's handshake): no id is in it (its
    # successor's first descriptor is 1 block before its own).
    Case(((HYBRID, (Call(((1,), (2,)), 4, None, 1, (-1, 4)),)),)),
    # No num_regions yet: vLLM counts block_len_per_layer.
    Case(((replace(HYBRID, num_regions=0), (Call(((3,), (2,)), 4),)),)),
    *([Case(((ROUTED, (Call(((1, 3), (2, 4)), 4, None, 1, (4, 4, 8)),)),))] * ROUTING),
]


# --- _compute_desc_ids: patched against vLLM's own ---------------------------------


# How many times the patched methods below called vLLM's own.
vllm_calls: list[int] = [0]


def counted_vllm_compute_desc_ids(worker: Any, *arguments: Any) -> Any:
    vllm_calls[0] += 1
    return VLLM_COMPUTE_DESC_IDS(worker, *arguments)


def patched_compute_desc_ids(compiled: bool) -> Callable[..., Any]:
    """The patched method, as patch() makes it, built by the kernel
    (compiled) or checked, then vLLM's own (counted in vllm_calls)."""
    compute_desc_ids, _ = _nixl.patched_functions(
        _nixl.NixlPatch(
            base_worker=base_worker,
            vllm_compute_desc_ids=counted_vllm_compute_desc_ids,
            active=lambda: True,
            compiled=compiled,
        )
    )
    return compute_desc_ids


PATCHED = {compiled: patched_compute_desc_ids(compiled) for compiled in (True, False)}


def check_call(worker: Any, model: Model, call: Call, compiled: bool) -> None:
    """One call of the patched method against vLLM's own on the same worker."""
    found = spans(model, call)
    vllm_sane = outcome(VLLM_COMPUTE_DESC_IDS, worker, *call.sane())
    assert not misses(worker), f"vLLM read more than {DESC_IDS_ATTRIBUTES[RELEASE]}"
    if found is None:  # vLLM fails here whatever the ids
        assert isinstance(vllm_sane, Exception), "spans() expects vLLM to raise"
    else:
        assert not isinstance(vllm_sane, Exception), f"vLLM raised {vllm_sane!r}"
        expected = np.array(expected_ids(found, call.sane()[0]), np.int64)
        if vllm_sane.dtype == np.int32:  # vLLM's Mamba branch: int32, wrapping
            expected = expected.astype(np.int32)
        assert vllm_sane.tolist() == expected.tolist()
    _nixl._warned.clear()
    vllm_calls[0] = 0
    with captured("ptrres.vllm") as log:
        ours = outcome(PATCHED[compiled], worker, *call.arguments())
    assert set(misses(worker)) <= PATCH_PROBES[RELEASE]
    misses(worker).clear()
    if isinstance(vllm_sane, Exception):
        vllms = outcome(VLLM_COMPUTE_DESC_IDS, worker, *call.arguments())
        assert isinstance(vllms, Exception)
        assert type(ours) is type(vllms), f"{ours!r} where vLLM raises {vllms!r}"
        return
    assert found is not None
    bad = first_bad(found, call.block_ids)
    if bad is None:
        vllms = outcome(VLLM_COMPUTE_DESC_IDS, worker, *call.arguments())
        assert not log.records
        if isinstance(vllms, Exception):
            # A Mamba group that indexes no region (no attention region, or
            # a scratch group without scratch regions), its ids past int32:
            # vLLM converts them all the same.
            assert type(ours) is type(vllms), f"{ours!r} where vLLM raises {vllms!r}"
            return
        assert not isinstance(ours, Exception), f"patched raised {ours!r}"
        assert ours.dtype == vllms.dtype
        assert ours.shape == vllms.shape
        np.testing.assert_array_equal(ours, vllms)
        # The kernel builds attention models' ids (vLLM, where an id of a
        # group no region takes is past int64); vLLM, Mamba models'.
        kernel = compiled and not model.has_mamba and fits_int64(call.block_ids)
        assert vllm_calls == [0 if kernel else 1]
        return
    assert not isinstance(ours, Exception), f"patched raised {ours!r}"
    assert ours.dtype == vllm_sane.dtype
    assert ours.shape == vllm_sane.shape
    assert (ours == REFUSED_INDEX).all()
    assert log.at(logging.WARNING) == [bad_id_line(bad)]
    assert len(log.records) == 1
    assert vllm_calls == [1]  # vLLM's shape and dtype, on ids it takes


def fits_int64(block_ids: Sequence[Sequence[int]]) -> bool:
    return all(-(2**63) <= v < 2**63 for ids in block_ids for v in ids)


def bad_id_line(
    bad: Bad, request: Any = None, side: str = "?", engine: str = "?"
) -> str:
    """ptrres's WARNING line for a bad id."""
    return (
        f"ptrres: NIXL transfer of request {request}: {side} block id {bad.value!r} "
        f"(engine {engine}, group {bad.group}, position {bad.position}) is out of "
        f"range for region {bad.span.region}, of {bad.span.blocks} blocks; the "
        "request fails in vLLM's transfer setup, and no block moves"
    )


def run_case(case: Case, compiled: bool) -> None:
    """Each step's calls on one worker, re-registered between steps."""
    worker = strict_worker(case.steps[0][0].attributes())
    for model, step_calls in case.steps:
        worker.__dict__.update(model.attributes())
        for call in step_calls:
            check_call(worker, model, call, compiled)


@before_pairs
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "checked"])
@pytest.mark.parametrize("kind", KINDS)
@given(data=st.data())
def test_the_patched_method_is_vllms_on_good_ids_and_refuses_bad_ones(
    kind: str, compiled: bool, data: st.DataObject
) -> None:
    run_case(data.draw(cases(kind)), compiled)


# What may change between two transfers of one worker: a call's argument
# (or the two it leaves to the worker: None), or the worker's regions
# (registered again).
CHANGES = (
    "a group's ids",
    "mapping argument",
    "region groups argument",
    "the worker's region groups and mapping",
    "ratio",
    "region counts",
    "worker's mapping",
    "worker's region groups",
    "worker's num_regions",
    *(["worker's routing"] if ROUTING else []),
)


@st.composite
def histories(draw: st.DrawFn, kind: str) -> list[tuple[Model, Call]]:
    """A worker's regions and a call, then one change after another."""
    model = draw(models(kind))
    call = draw(calls(model))
    history = [(model, call)]
    for change in draw(st.lists(st.sampled_from(CHANGES), min_size=1, max_size=6)):
        groups = len(call.block_ids)
        n = len(model.routing) or model.num_regions or len(model.block_len_per_layer)
        if change == "a group's ids":
            g = draw(st.integers(0, groups - 1))
            ids = call.block_ids[g][:-1] if call.block_ids[g] else (0,)
            block_ids = (*call.block_ids[:g], ids, *call.block_ids[g + 1 :])
            call = replace(call, block_ids=block_ids)
        elif change == "mapping argument":
            mapping = draw(st.sampled_from([None, True, False]))
            call = replace(call, uses_region_group_mapping=mapping)
        elif change == "region groups argument":
            owners = draw(st.none() | region_groups(n, groups))
            call = replace(call, region_group_ids=owners)
        elif change == "the worker's region groups and mapping":
            call = replace(call, region_group_ids=None, uses_region_group_mapping=None)
        elif change == "ratio":
            ratio = draw(st.sampled_from([None, 1, 2, 0.5]))
            call = replace(call, block_size_ratio=ratio)
        elif change == "region counts":
            counts = st.lists(st.integers(0, 12), min_size=n, max_size=n).map(tuple)
            call = replace(call, region_num_blocks=draw(st.none() | counts))
        elif change == "worker's mapping":
            mapping = not model.uses_region_group_mapping
            model = replace(model, uses_region_group_mapping=mapping)
        elif change == "worker's region groups":
            owners = draw(region_groups(len(model.block_len_per_layer), groups))
            model = replace(model, region_group_ids=owners)
        elif change == "worker's num_regions":
            num_regions = draw(st.integers(0, len(model.block_len_per_layer) + 1))
            model = replace(model, num_regions=num_regions)
        else:
            layers = st.lists(st.integers(0, groups - 1), min_size=1, max_size=5)
            routing = () if model.routing else tuple(draw(layers))
            model = replace(model, routing=routing)
        history.append((model, call))
    return history


@before_pairs
@pytest.mark.parametrize("kind", KINDS)
@given(data=st.data())
def test_a_worker_keeps_no_stale_layout(kind: str, data: st.DataObject) -> None:
    """The patched method keeps each worker's layouts: one call after
    another on one worker, each changed in one thing, each vLLM's."""
    history = data.draw(histories(kind))
    worker = strict_worker(history[0][0].attributes())
    for model, call in history:
        worker.__dict__.update(model.attributes())
        check_call(worker, model, call, compiled=True)


# One worker registered again, or called with other arguments, in each thing
# its layout depends on (the call leaves the region groups and the mapping
# to the worker).
_CALL = Call(((1,), (2, 3)), 4)
HISTORIES = [
    [(HYBRID, _CALL), (replace(HYBRID, uses_region_group_mapping=False), _CALL)],
    [(HYBRID, _CALL), (replace(HYBRID, region_group_ids=(1, 0)), _CALL)],
    [(HYBRID, _CALL), (replace(HYBRID, num_regions=1), _CALL)],
    [
        (HYBRID, _CALL),
        (replace(HYBRID, block_len_per_layer=(64,), num_regions=0), _CALL),
    ],
    [(HYBRID, _CALL), (HYBRID, replace(_CALL, block_ids=((), (2, 3))))],
    [(HYBRID, _CALL), (HYBRID, replace(_CALL, block_size_ratio=0.5))],
    [(HYBRID, _CALL), (HYBRID, replace(_CALL, region_num_blocks=(4, 2)))],
    [(HYBRID, _CALL), (HYBRID, replace(_CALL, uses_region_group_mapping=False))],
    [
        (HYBRID, replace(_CALL, region_group_ids=(0, 1))),
        (HYBRID, replace(_CALL, region_group_ids=(1, 0))),
    ],
    [
        (replace(HYBRID, num_regions=0), _CALL),
        (replace(HYBRID, num_regions=0, block_len_per_layer=(64,)), _CALL),
    ],
    *([[(HYBRID, _CALL), (ROUTED, _CALL), (HYBRID, _CALL)]] * ROUTING),
]


@before_pairs
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "checked"])
@pytest.mark.parametrize("history", HISTORIES)
def test_a_worker_registered_again_gets_its_new_layout(
    history: list[tuple[Model, Call]], compiled: bool
) -> None:
    worker = strict_worker(history[0][0].attributes())
    for model, call in history:
        worker.__dict__.update(model.attributes())
        check_call(worker, model, call, compiled)


@before_pairs
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "checked"])
@pytest.mark.parametrize("case", EXAMPLES)
def test_each_branch_at_its_boundaries(case: Case, compiled: bool) -> None:
    """The issue's hybrid case, ids of 2**31 and more, -1, a float ratio, the
    SSM groups' logical blocks, layer-name routing (0.31+)."""
    run_case(case, compiled)


@before_pairs
def test_the_worker_attributes_are_the_releases_own() -> None:
    """Over one call of each branch, vLLM's method reads every attribute of
    DESC_IDS_ATTRIBUTES (and, StrictWorker says, no other)."""
    reads: set[str] = set()
    for case in EXAMPLES:
        for model, step_calls in case.steps:
            worker = strict_worker(model.attributes())
            for call in step_calls:
                assert spans(model, call) is not None
                VLLM_COMPUTE_DESC_IDS(worker, *call.sane())
            assert not misses(worker)
            reads |= worker.__dict__["__reads__"]
    assert reads == set(DESC_IDS_ATTRIBUTES[RELEASE])
    assert (RELEASE != "0.30") == ROUTING


@before_pairs
def test_the_strict_worker_lets_nothing_else_be_read() -> None:
    """A name not given is a miss, recorded, and vLLM's method fails on it."""
    worker = strict_worker(HYBRID.attributes())
    with pytest.raises(AttributeError):
        worker.kv_cache_config  # noqa: B018
    assert misses(worker) == ["kv_cache_config"]
    attributes = HYBRID.attributes()
    del attributes["region_group_ids"]
    worker = strict_worker(attributes)
    ids = outcome(VLLM_COMPUTE_DESC_IDS, worker, *_CALL.arguments())
    assert isinstance(ids, AttributeError)
    assert misses(worker) == ["region_group_ids"]


@before_pairs
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "checked"])
def test_zero_regions_are_vllms(compiled: bool) -> None:
    """A worker with no regions (none registered): vLLM adds offset 0 to
    every id, each an index into an empty list, which NIXL refuses; the
    patched method leaves it to vLLM rather than make up another answer."""
    model = Model(block_len_per_layer=(), num_regions=0)
    worker = strict_worker(model.attributes())
    call = Call(((1, 2),), 4)
    vllms = VLLM_COMPUTE_DESC_IDS(worker, *call.arguments())
    assert vllms.tolist() == [1, 2]
    ours = PATCHED[compiled](worker, *call.arguments())
    np.testing.assert_array_equal(ours, vllms)


@before_pairs
def test_a_worker_patched_then_unpatched_runs_vllms_own() -> None:
    """The patched method, kept past unpatch(), is vLLM's again."""
    plugin.patch()
    compute_desc_ids = vars(Base)["_compute_desc_ids"]
    worker = strict_worker(HYBRID.attributes())
    call = Call(((0, 4), (2,)), 4, None, 1, (4, 4))
    assert (compute_desc_ids(worker, *call.arguments()) == REFUSED_INDEX).all()
    plugin.unpatch()
    with captured("ptrres.vllm") as log:
        ids = compute_desc_ids(worker, *call.arguments())
    assert ids.tolist() == [0, 4, 6]  # group 0's 4 is region 1's block 0
    assert not log.records


# --- patch() and unpatch() ----------------------------------------------------------


@contextmanager
def nixl_patched() -> Iterator[list[str]]:
    """vLLM patched (ptrres.vllm.patch()) meanwhile, then unpatched."""
    try:
        yield plugin.patch()
    finally:
        plugin.unpatch()


def test_patch_replaces_the_connectors_methods_and_unpatch_restores_them() -> None:
    with nixl_patched() as patched:
        assert patched[-len(NIXL_PATCHES) :] == NIXL_PATCHES
        for (owner, name), original in VLLM_METHODS.items():
            ours = vars(owner)[name]
            assert ours is not original
            assert ours.__wrapped__ is original
            assert inspect.signature(ours) == inspect.signature(original)
    for (owner, name), original in VLLM_METHODS.items():
        assert vars(owner)[name] is original


@pytest.mark.parametrize("value", ["0", "false", "OFF"])
def test_ptrres_vllm_nixl_0_leaves_the_connector_alone(
    value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The other paths are patched; the NIXL connector is vLLM's."""
    handler = vars(Handler)["transfer_async"]
    build_params = cuda_mem_ops.build_params
    monkeypatch.setenv("PTRRES_VLLM_NIXL", value)
    patched = plugin.patch()
    assert "SingleDirectionOffloadingHandler.transfer_async" in patched
    assert not set(patched) & set(NIXL_PATCHES)
    assert vars(Handler)["transfer_async"] is not handler
    assert cuda_mem_ops.build_params is not build_params
    for (owner, name), original in VLLM_METHODS.items():
        assert vars(owner)[name] is original


def assert_left_alone(match: str) -> None:
    """patch() warns (once), naming the NIXL connector and why, and replaces
    nothing of it; the other paths are patched."""
    handler = vars(Handler)["transfer_async"]
    build_params = cuda_mem_ops.build_params
    with pytest.warns(
        plugin.VllmPatchWarning,
        match=f"^ptrres.vllm left vLLM's NIXL connector unpatched: .*{match}",
    ) as caught:
        patched = plugin.patch()
    assert len(caught) == 1
    assert not set(patched) & set(NIXL_PATCHES)
    assert not _state.patched(_state.NIXL)
    assert vars(Handler)["transfer_async"] is not handler
    assert cuda_mem_ops.build_params is not build_params


@pytest.mark.parametrize(("owner", "name"), list(VLLM_METHODS))
def test_a_changed_signature_leaves_the_connector_alone(
    owner: type, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = vars(owner)[name]

    @_with_signature(original, extra="out")
    def changed(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("never called")

    monkeypatch.setattr(owner, name, changed)
    module = owner.__module__.rpartition(".")[2]
    assert_left_alone(f"{module}.{owner.__name__}.{name} has other code")
    assert vars(owner)[name] is changed
    for (other, other_name), vllms in VLLM_METHODS.items():
        if (other, other_name) != (owner, name):
            assert vars(other)[other_name] is vllms


def _with_signature(
    function: Callable[..., Any], extra: str
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Give a stand-in ``function``'s signature with one parameter more."""

    def give(stand_in: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(function)
        parameters = [
            *signature.parameters.values(),
            inspect.Parameter(
                extra, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None
            ),
        ]
        stand_in.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
        return stand_in

    return give


def test_a_worker_with_its_own_compute_desc_ids_leaves_the_connector_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The pull worker's own would bypass the checked one."""
    monkeypatch.setattr(Pull, "_compute_desc_ids", VLLM_COMPUTE_DESC_IDS, raising=False)
    assert_left_alone("pull_worker.NixlPullConnectorWorker._compute_desc_ids is new")


# The names of base_worker's module the release's patch reads (0.30 to 0.33:
# the spec tests and CircularBufferSpec; 0.34: the spec tests, _RegionPairs).
BASE_NAMES = [
    locator.partition(":")[2]
    for locator in _release.path_code(_state.NIXL, VARIANT).reads
    if locator.startswith(f"{base_worker.__name__}:")
    and "." not in locator.partition(":")[2]
]


@pytest.mark.parametrize("name", BASE_NAMES)
def test_a_missing_name_of_base_worker_leaves_the_connector_alone(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delattr(base_worker, name)
    assert_left_alone(f"base_worker.{name} is missing")


def test_a_connector_module_that_does_not_import_leaves_the_connector_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, push_worker.__name__, None)
    assert_left_alone("push_worker.NixlPushConnectorWorker._xfer_blocks is missing")


def test_the_workers_init_is_vllms_then_the_kernels_made_ready(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's __init__ runs first, with its arguments; then the kernels are
    made ready; a failure there is logged, never raised. (A stand-in
    __init__ is no tested release's code, so the gate would leave the path
    alone: the path's replacements, as patch() makes them, are set here.)"""
    calls: list[tuple[Any, ...]] = []

    def __init__(
        self: Any, vllm_config: Any, engine_id: Any, kv_cache_config: Any
    ) -> None:
        calls.append(("vllm", vllm_config, engine_id, kv_cache_config))

    monkeypatch.setattr(Base, "__init__", __init__)

    def construct() -> None:
        with pytest.MonkeyPatch.context() as patching:
            for r in _patching.plan_path(_state.NIXL, VARIANT):
                patching.setattr(r.owner, r.name, r.replacement)
            assert vars(Base)["__init__"].__wrapped__ is __init__
            Base.__init__(object.__new__(StrictWorker), "config", "engine", "caches")

    monkeypatch.setattr(_warmup, "warm_up_kernels", lambda: calls.append(("ready",)))
    construct()
    assert calls == [("vllm", "config", "engine", "caches"), ("ready",)]

    def broken() -> None:
        raise RuntimeError("no compiler")

    monkeypatch.setattr(_warmup, "warm_up_kernels", broken)
    with captured("ptrres.vllm") as log:
        construct()
    assert log.at(logging.WARNING) == [
        "ptrres: could not make the kernels ready for vLLM's NIXL connector; "
        "they compile on its first transfer"
    ]


# --- a request through vLLM's own transfer methods, real NIXL agents --------------

# Group 0's blocks 1 and 2 and group 1's block 3 (decode), from group 0's
# blocks 0 and 3 and group 1's block 2 (prefill).
DECODE_IDS = [[1, 2], [3]]
PREFILL_IDS = [[0, 3], [2]]
# The case: group 0's id 4 on a region of 4 blocks is region 1's
# block 0, group 1's layer.
BAD_IDS = [[0, 4], [2]]


def moved(source: Engine, target: Engine, source_ids: Any, target_ids: Any) -> Any:
    """``target``'s bytes once the blocks of ``source_ids`` are copied onto
    those of ``target_ids`` (region r holds group r), all else unchanged."""
    expected = [region.copy() for region in target.regions]
    for group, (src, dst) in enumerate(zip(source_ids, target_ids)):
        for s, d in zip(src, dst):
            expected[group][d] = source.regions[group][s]
    return [region.tobytes() for region in expected]


@pytest.fixture
def nixl_engines() -> Iterator[tuple[Engine, Engine]]:
    with engines() as pair:
        yield pair


def test_unpatched_a_pull_reads_another_layers_block(
    nixl_engines: tuple[Engine, Engine],
) -> None:
    """vLLM as it ships: group 0's remote id 4 reads region 1's block 0 (a
    layer of group 1), and the READ completes."""
    decode, prefill = nixl_engines
    transfer = pull(decode, prefill)
    assert read(transfer, "req-bad", DECODE_IDS, BAD_IDS)
    wait_done(transfer, transfer.worker._recving_transfers, "req-bad")
    assert decode.block(0, 2) == prefill.block(1, 0)
    assert not transfer.worker._recv_failures


def test_unpatched_an_id_of_2_31_escapes_vllms_try_before_0_34(
    nixl_engines: tuple[Engine, Engine],
) -> None:
    """vLLM as it ships: 0.30 to 0.33 make int32 ids, and numpy's
    OverflowError leaves _read_blocks (and would fail the engine's step), the
    request not failed. 0.34's int64 ids reach NIXL, which casts them to C
    ints and refuses -2**31: the request fails in vLLM's try."""
    decode, prefill = nixl_engines
    transfer = pull(decode, prefill)
    if not PAIRS:
        with pytest.raises(OverflowError):
            read(transfer, "req-huge", DECODE_IDS, [[0, 2**31], [2]])
        assert not transfer.worker._recv_failures
        return
    with captured("vllm") as log:
        assert not read(transfer, "req-huge", DECODE_IDS, [[0, 2**31], [2]])
    assert transfer.worker._recv_failures == {"req-huge"}
    assert "NIXL_ERR_INVALID_PARAM" in str(log.records[-1].exc_info)


@pytest.mark.skipif(not PAIRS, reason="0.30 to 0.33 make int32 ids (OverflowError)")
def test_unpatched_0_34_an_id_past_int32_moves_another_block(
    nixl_engines: tuple[Engine, Engine],
) -> None:
    """vLLM 0.34 as it ships: its int64 ids go to NIXL, whose Python API casts
    them to C ints: remote id 2**32 + 1 reads block 1 (pull), and decode's
    id 2**32 + 1 is written as block 1 (push); both complete."""
    decode, prefill = nixl_engines
    transfer = pull(decode, prefill)
    assert read(transfer, "req-wrap", DECODE_IDS, [[0, 2**32 + 1], [2]])
    wait_done(transfer, transfer.worker._recving_transfers, "req-wrap")
    assert decode.block(0, 2) == prefill.block(0, 1)
    assert not transfer.worker._recv_failures
    transfer = push(prefill, decode)
    handle = write(transfer, "req-wrap", PREFILL_IDS, [[0, 2**32 + 1], [3]])
    assert handle is not None
    wait_done(transfer, {"req-wrap": [handle]}, "req-wrap")
    assert decode.block(0, 1) == prefill.block(0, 3)


class Failure(NamedTuple):
    """A bad id on one side of a request: group 0's second id."""

    side: str  # "remote" or "local"
    value: int

    def ids(self, side: str, ids: list[list[int]]) -> list[list[int]]:
        """``ids`` of ``side``, with the bad id where it goes."""
        if side != self.side:
            return ids
        return [[ids[0][0], self.value], *ids[1:]]


FAILURES = [
    Failure("remote", 4),
    Failure("remote", 2**31),
    Failure("remote", 2**32 + 1),  # 0.34 unpatched: block 1
    Failure("local", 4),
    Failure("local", -1),
    Failure("local", 2**32 + 2),
]


def assert_failed_cleanly(
    log: Records, transfer: Transfer, failure: Failure, request: str, message: str
) -> None:
    """vLLM's transfer_setup_failed ERROR, after ptrres's one WARNING line."""
    engine = (
        transfer.remote.engine_id
        if failure.side == "remote"
        else transfer.local.engine_id
    )
    bad = Bad(0, 1, failure.value, Span(0, 0, 0, NUM_BLOCKS))
    assert log.at(logging.WARNING) == [bad_id_line(bad, request, failure.side, engine)]
    errors = [r for r in log.records if r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert (
        errors[0]
        .getMessage()
        .startswith(
            f"NIXL transfer failure: transfer_setup_failed. {message} | Context: "
        )
    )
    assert errors[0].exc_info is not None
    assert "NIXL_ERR_INVALID_PARAM" in str(errors[0].exc_info[1])
    assert transfer.worker.xfer_stats.data["num_failed_transfers"] == [1]


def assert_named_only_in_a_transfer(transfer: Transfer) -> None:
    """Called outside _read_blocks and _xfer_blocks, the worker's
    _compute_desc_ids names no request, side or engine."""
    # 0.34: pair k reads region k at group k's ids.
    pairs = {"pairs": ([0, 1], [0, 1])} if PAIRS else {}
    with captured("ptrres.vllm") as log:
        transfer.worker._compute_desc_ids([[4], []], NUM_BLOCKS, None, 1, **pairs)
    bad = Bad(0, 0, 4, Span(0, 0, 0, NUM_BLOCKS))
    assert log.at(logging.WARNING) == [bad_id_line(bad)]


@pytest.mark.parametrize("failure", FAILURES, ids=lambda f: f"{f.side}-{f.value}")
def test_patched_a_bad_id_fails_the_pull_request(
    failure: Failure, nixl_engines: tuple[Engine, Engine]
) -> None:
    """_read_blocks returns False, the request is in _recv_failures (vLLM's
    failed_recving next), no byte of decode's caches moved; the next request
    moves the right bytes."""
    decode, prefill = nixl_engines
    plugin.patch()
    transfer = pull(decode, prefill)
    before = decode.snapshot()
    with captured("vllm", "ptrres.vllm") as log:
        posted = read(
            transfer,
            "req-bad",
            failure.ids("local", DECODE_IDS),
            failure.ids("remote", PREFILL_IDS),
        )
    assert posted is False
    assert transfer.worker._recv_failures == {"req-bad"}
    assert transfer.worker._recving_transfers["req-bad"] == []  # no handle held
    if RELEASE not in ("0.30", "0.31"):  # vLLM probes the engine's metadata next
        assert transfer.worker._failed_remote_engines == {PREFILL}
    assert_failed_cleanly(
        log,
        transfer,
        failure,
        "req-bad",
        "Deferring failure reporting until outstanding transfers finish",
    )
    prefill.agent.get_new_notifs()
    assert decode.snapshot() == before
    assert_named_only_in_a_transfer(transfer)
    assert read(transfer, "req-good", DECODE_IDS, PREFILL_IDS)
    wait_done(transfer, transfer.worker._recving_transfers, "req-good")
    assert decode.snapshot() == moved(prefill, decode, PREFILL_IDS, DECODE_IDS)


def test_unpatched_a_push_writes_into_another_layers_block(
    nixl_engines: tuple[Engine, Engine],
) -> None:
    """vLLM as it ships: decode's group-0 id 4 (the remote side of a push)
    is decode's region 1 block 0, which the WRITE overwrites."""
    decode, prefill = nixl_engines
    transfer = push(prefill, decode)
    handle = write(transfer, "req-bad", PREFILL_IDS, BAD_IDS)
    assert handle is not None
    wait_done(transfer, {"req-bad": [handle]}, "req-bad")
    assert decode.block(1, 0) == prefill.block(0, 3)


@pytest.mark.parametrize("failure", FAILURES, ids=lambda f: f"{f.side}-{f.value}")
def test_patched_a_bad_id_fails_the_push_request(
    failure: Failure, nixl_engines: tuple[Engine, Engine]
) -> None:
    """_xfer_blocks returns no handle, the request is in _send_failures
    (0.31+), no byte of decode's caches moved; the next request writes the
    right bytes."""
    decode, prefill = nixl_engines
    plugin.patch()
    transfer = push(prefill, decode)
    before = decode.snapshot()
    with captured("vllm", "ptrres.vllm") as log:
        handle = write(
            transfer,
            "req-bad",
            failure.ids("local", PREFILL_IDS),
            failure.ids("remote", DECODE_IDS),
        )
    assert handle is None
    if RELEASE != "0.30":
        assert transfer.worker._send_failures == {"req-bad"}
    assert_failed_cleanly(
        log,
        transfer,
        failure,
        "req-bad",
        "Push WRITE submission failed; releasing handle",
    )
    decode.agent.get_new_notifs()
    assert decode.snapshot() == before
    assert_named_only_in_a_transfer(transfer)
    handle = write(transfer, "req-good", PREFILL_IDS, DECODE_IDS)
    assert handle is not None
    wait_done(transfer, {"req-good": [handle]}, "req-good")
    assert decode.snapshot() == moved(prefill, decode, PREFILL_IDS, DECODE_IDS)
