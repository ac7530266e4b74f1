"""ptrres.vllm on vLLM 0.34's NIXL connector, which pairs regions by layer
name: ``NixlBaseConnectorWorker._compute_desc_ids(block_ids, dst_num_blocks,
block_size_ratio, physical_blocks_per_logical, pairs=(regions, keys),
region_num_blocks, ssm_regions)`` patched (``ptrres.vllm._nixl_pairs``)
against vLLM's own, on a worker holding only the attributes vLLM's method
reads (PAIRS_ATTRIBUTES; StrictWorker lets nothing else be read).

- Under hypothesis, by kind (one group; hybrid, with regions several groups
  share; region-mapped reads; the local side's block-size ratio; Mamba
  models' SSM and PLE groups; pairs drawn raw, negative and duplicate
  entries included): the pairs are vLLM's own ``_pair_regions`` of the
  worker's layers and a peer's ``NixlAgentMetadata`` whose regions come in
  another order (raw pairs apart); the calls are the pull's and the push's,
  remote and local side. On ids in range the patched method returns vLLM's
  array, element for element and dtype (int64 attention, int32 Mamba, empty
  included); on a bad id, vLLM's shape and dtype made of REFUSED_INDEX and
  one WARNING line naming it; where vLLM raises whatever the ids, the same
  exception. Which region each id indexes, and its count, comes from
  ``spans()``, this file's reading of vLLM's branches, checked against
  vLLM's output on every example;
- the counts ``spans()`` bounds ids by are those of the descriptor lists
  vLLM's own builders prepare (``_build_fa_local``, ``_build_mamba_local``):
  each span's descriptors are its region's blocks, in order, and no more;
- examples at each boundary, and what vLLM does there: ids of 2**31 and
  2**32 + 5, SSM ids against ``dst_num_blocks // physical_blocks_per_logical``,
  int32 wrapping, regions whose indices pass int32.

Before 0.34 the whole module is left out (those releases take region groups:
test_vllm_nixl.py).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given
from hypothesis import strategies as st
from nixl_worker import (
    PAIRS,
    base_worker,
    captured,
    metadata,
    misses,
    outcome,
    strict_worker,
)
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from ptrres.vllm import _nixl, _nixl_pairs
from ptrres.vllm._nixl import REFUSED_INDEX

if not PAIRS:
    pytest.skip(
        "vLLM before 0.34 takes region groups: test_vllm_nixl.py",
        allow_module_level=True,
    )

Base = base_worker.NixlBaseConnectorWorker
VLLM_COMPUTE_DESC_IDS = vars(Base)["_compute_desc_ids"]
# What 0.34's _compute_desc_ids reads of its worker (checked below: every
# one of them, and no other).
PAIRS_ATTRIBUTES = (
    "_has_mamba",
    "_conv_decomp",
    "_ssm_region_indices",
    "block_len_per_layer",
    "num_regions",
    "_group_spec_types",
    "_ple_group_index",
)
# How many times the patched method below called vLLM's own.
vllm_calls = [0]


def counted_vllm_compute_desc_ids(worker: Any, *args: Any, **kwargs: Any) -> Any:
    vllm_calls[0] += 1
    return VLLM_COMPUTE_DESC_IDS(worker, *args, **kwargs)


# The patched method, as nixl_replacements_034 makes it (vLLM's own counted).
PATCHED = _nixl_pairs.patched_compute_desc_ids(
    base_worker, counted_vllm_compute_desc_ids, lambda: True
)

BLOCK_LEN = 64  # bytes per block of every region
STRIDE = BLOCK_LEN  # bytes between two blocks of a region
CONV_SIZE, SSM_SIZE = 48, 16  # a Mamba page: conv state, then SSM state


class ConvDecomp(NamedTuple):
    """What 0.34 reads of vLLM's MambaConvSplitInfo."""

    local_conv_offsets: list[tuple[int, int]]


@dataclass(frozen=True)
class Model:
    """A worker's regions (each its layers), its groups, its Mamba state."""

    # Region r's layers, and each layer's group (as (layer, group)).
    region_layers: tuple[tuple[str, ...], ...]
    layer_groups: tuple[tuple[str, int], ...]
    group_spec_types: tuple[type, ...]
    # 0: none registered yet; vLLM then counts block_len_per_layer.
    num_regions: int
    has_mamba: bool = False
    # (byte offset, bytes) of each conv sub-projection; None: no _conv_decomp.
    conv_offsets: tuple[tuple[int, int], ...] | None = None
    ssm_region_indices: tuple[int, ...] = ()
    ple_group_index: int | None = None
    ple_region_index: int | None = None

    @property
    def regions(self) -> int:
        return len(self.region_layers)

    def attributes(self) -> dict[str, Any]:
        """As a 0.34 worker holds them (lists, as vLLM keeps them)."""
        return {
            "_has_mamba": self.has_mamba,
            "_conv_decomp": (
                None
                if self.conv_offsets is None
                else ConvDecomp(list(self.conv_offsets))
            ),
            "_ssm_region_indices": list(self.ssm_region_indices),
            "block_len_per_layer": [BLOCK_LEN] * self.regions,
            "num_regions": self.num_regions,
            "_group_spec_types": list(self.group_spec_types),
            "_ple_group_index": self.ple_group_index,
        }


@dataclass(frozen=True)
class Call:
    """_compute_desc_ids' arguments after the worker."""

    block_ids: tuple[tuple[int, ...], ...]
    dst_num_blocks: int
    regions: tuple[int, ...]
    keys: tuple[int, ...]
    block_size_ratio: float | None = None
    physical_blocks_per_logical: int = 1
    region_num_blocks: tuple[int, ...] | None = None
    ssm_regions: tuple[int, ...] | None = None
    # A list per group, as vLLM passes them; or a tuple, which it takes too.
    group_type: type = list

    def kwargs(self, block_ids: Sequence[Sequence[int]] | None = None) -> Any:
        """The arguments as vLLM's pull and push workers pass them (by
        keyword), with these block ids (or the call's own)."""
        ids = self.block_ids if block_ids is None else block_ids
        return {
            "block_ids": [self.group_type(group) for group in ids],
            "dst_num_blocks": self.dst_num_blocks,
            "block_size_ratio": self.block_size_ratio,
            "physical_blocks_per_logical": self.physical_blocks_per_logical,
            "pairs": (list(self.regions), list(self.keys)),
            "region_num_blocks": (
                None if self.region_num_blocks is None else list(self.region_num_blocks)
            ),
            "ssm_regions": None if self.ssm_regions is None else list(self.ssm_regions),
        }

    def sane(self) -> Any:
        """The arguments with every id numpy's int64 refuses made 0: where
        vLLM fails on these, it fails whatever the ids."""
        return self.kwargs(
            [[v if -(2**63) <= v < 2**63 else 0 for v in g] for g in self.block_ids]
        )


class Span(NamedTuple):
    """One stretch of vLLM's output: block_ids[key]'s ids, each plus the
    first descriptor; the region (an SSM descriptor's, for SSM groups)
    holds ``blocks`` of them."""

    key: int
    region: int
    first: int
    blocks: int


def spans(model: Model, call: Call) -> list[Span] | None:
    """Where vLLM 0.34's _compute_desc_ids puts each key's ids, in the order
    of its output; None where it raises whatever the ids. Written from
    vLLM's two branches (all attention; Mamba), and checked against its
    output on every example (and its counts against vLLM's descriptor
    lists, below)."""
    per_layer = ssm_descs = 0
    if model.has_mamba:
        if model.conv_offsets is None:  # vLLM asserts
            return None
        per_layer = len(model.conv_offsets) + 1
        ssm_descs = len(model.ssm_region_indices or range(model.regions)) * per_layer
    ratio = call.block_size_ratio
    blocks = call.dst_num_blocks if ratio is None else int(call.dst_num_blocks * ratio)
    if call.region_num_blocks is None:
        counts = [blocks] * (model.num_regions or model.regions)
    else:
        counts = [
            c if ratio is None else int(c * ratio) for c in call.region_num_blocks
        ]
    firsts = [sum(counts[:r]) for r in range(max(len(counts), 1))]

    def region(key: int, r: int) -> Span | None:
        if not -len(firsts) <= r < len(firsts):
            return None
        r %= len(firsts)
        return Span(key, r, firsts[r], counts[r] if counts else 0)

    groups = len(call.block_ids)
    pairs = list(zip(call.regions, call.keys))
    found: list[Span] = []
    if not ssm_descs:
        for key in sorted(set(call.keys)):
            if not -groups <= key < groups:
                return None
            for r, k in pairs:
                if k == key:
                    span = region(key % groups, r)
                    if span is None:
                        return None
                    found.append(span)
        return found
    logical = call.dst_num_blocks // call.physical_blocks_per_logical
    ssm = call.ssm_regions
    if ssm is None:
        ssm = model.ssm_region_indices or tuple(range(model.regions))
    slots = {r: s for s, r in enumerate(ssm)}
    attention_descs = sum(counts)
    for g, ids in enumerate(call.block_ids):
        own = [r for r, k in pairs if k == g]
        if not ids or not own:
            continue
        if g >= len(model.group_spec_types):
            return None
        kind = model.group_spec_types[g]
        if issubclass(kind, (FullAttentionSpec, SlidingWindowSpec, MLAAttentionSpec)):
            for r in own:
                span = region(g, r)
                if span is None:
                    return None
                found.append(span)
        elif issubclass(kind, MambaSpec):
            if g == model.ple_group_index:
                descs = [(own[0], len(ssm) * per_layer)]
            elif any(r not in slots for r in own):
                return None
            else:
                descs = [
                    (r, slots[r] * per_layer + j) for r in own for j in range(per_layer)
                ]
            found += [
                Span(g, r, attention_descs + d * logical, logical) for r, d in descs
            ]
        else:  # vLLM raises "Unknown spec type"
            return None
    return found


def expected_ids(found: list[Span], block_ids: Sequence[Sequence[int]]) -> list[int]:
    """vLLM's output for ``found``: each span's ids plus its first descriptor."""
    return [span.first + v for span in found for v in block_ids[span.key]]


class Bad(NamedTuple):
    """An id outside its region: where it is, and the span it goes to."""

    key: int
    position: int
    value: int
    span: Span


def first_bad(found: list[Span], block_ids: Sequence[Sequence[int]]) -> Bad | None:
    """The first id, in the order of vLLM's output, outside its region."""
    for span in found:
        for position, value in enumerate(block_ids[span.key]):
            if not 0 <= value < span.blocks:
                return Bad(span.key, position, value, span)
    return None


def bad_id_line(bad: Bad) -> str:
    """ptrres's WARNING line for a bad id, outside a transfer."""
    return (
        f"ptrres: NIXL transfer of request None: ? block id {bad.value!r} (engine "
        f"?, group {bad.key}, position {bad.position}) is out of range for region "
        f"{bad.span.region}, of {bad.span.blocks} blocks; the request fails in "
        "vLLM's transfer setup, and no block moves"
    )


# --- the pairs: vLLM's own _pair_regions ------------------------------------------


class Pairs(NamedTuple):
    """vLLM's _RegionPairs of a model with a peer of the same layers, whose
    regions come in ``peer_order``."""

    remote: tuple[int, ...]
    local: tuple[int, ...]
    group: tuple[int, ...]
    remote_ssm_regions: tuple[int, ...] | None


class _KVCacheConfig:
    """What _pair_regions reads of vLLM's KVCacheConfig."""

    def __init__(self, layer_groups: dict[str, int]) -> None:
        self.transfer_group_index_by_layer = layer_groups


def region_group(model: Model, layers: Sequence[str]) -> int:
    """A region's group, as vLLM registers it: its layers', or -1 (shared)."""
    groups = {dict(model.layer_groups)[layer] for layer in layers}
    return groups.pop() if len(groups) == 1 else -1


def pair(model: Model, peer_order: Sequence[int]) -> Pairs:
    """vLLM's own _pair_regions: this model's regions on a worker, and the
    same layers on a peer whose region i is this model's peer_order[i]."""
    bare = type("PairingWorker", (Base,), {"__del__": lambda self: None})
    worker: Any = object.__new__(bare)
    layer_groups = dict(model.layer_groups)
    for name, value in {
        "kv_cache_config": _KVCacheConfig(layer_groups),
        "pp_size": 1,
        "_packed_member_layouts": {},
        "block_len_per_layer": [BLOCK_LEN] * model.regions,
        "_region_is_mla": [False] * model.regions,
        "_has_mamba": model.has_mamba,
        "_ssm_region_indices": list(model.ssm_region_indices),
        "_ple_group_index": model.ple_group_index,
        "_group_spec_types": list(model.group_spec_types),
    }.items():
        setattr(worker, name, value)
    worker._set_region_layers([list(layers) for layers in model.region_layers])
    peer = [model.region_layers[r] for r in peer_order]
    meta = metadata.NixlAgentMetadata(
        engine_id="peer",
        agent_metadata=b"",
        kv_caches_base_addr=[(i + 1) << 32 for i in range(len(peer))],
        device_id=0,
        num_blocks=8,
        block_lens=[BLOCK_LEN] * len(peer),
        block_strides=[BLOCK_LEN] * len(peer),
        kv_cache_layout="LBHNC",
        block_size=16,
        ssm_sizes=(CONV_SIZE, SSM_SIZE),
        attn_backend_name="FLASH_ATTN",
        physical_blocks_per_logical_kv_block=1,
        region_num_blocks=[8] * len(peer),
        region_group_ids=[region_group(model, layers) for layers in peer],
        region_names=[layers[0] for layers in peer],
        region_mem_types=["DRAM"] * len(peer),
        region_members=[list(layers) for layers in peer],
        layer_group_ids=layer_groups,
    )
    found = worker._pair_regions(meta)
    ssm = found.remote_ssm_regions
    return Pairs(
        tuple(found.remote),
        tuple(found.local),
        tuple(found.group),
        None if ssm is None else tuple(ssm),
    )


# --- the strategies -----------------------------------------------------------------

ATTENTION_SPECS = (FullAttentionSpec, SlidingWindowSpec, MLAAttentionSpec)
KINDS = ("one group", "hybrid", "region-mapped", "ratio", "ssm", "raw")
# Ids at every boundary (besides each region's count and first descriptor):
# -1, past int32 (0.33's OverflowError; NIXL's cast of 0.34's int64), past
# uint32 (what NIXL's cast and 0.34's Mamba astype wrap to 5), past int64.
EDGE_IDS = (-1, 2**31 - 1, 2**31, 2**32 + 5, 2**63, -(2**31) - 1)


@st.composite
def attention_model(draw: st.DrawFn, groups: int) -> Model:
    """Regions of one or two layers each, every layer in one of ``groups``
    attention groups: a region of layers of several groups is shared."""
    regions = draw(st.integers(1, 5))
    region_layers = tuple(
        tuple(f"model.layers.{r}.attn{j}" for j in range(draw(st.integers(1, 2))))
        for r in range(regions)
    )
    layer_groups = tuple(
        (layer, draw(st.integers(0, groups - 1)))
        for layers in region_layers
        for layer in layers
    )
    return Model(
        region_layers=region_layers,
        layer_groups=layer_groups,
        group_spec_types=tuple(
            draw(st.sampled_from(ATTENTION_SPECS)) for _ in range(groups)
        ),
        num_regions=draw(st.sampled_from([regions] * 3 + [0])),
    )


@st.composite
def mamba_model(draw: st.DrawFn) -> Model:
    """A hybrid Mamba model: attention groups and SSM groups, one layer a
    region; now and then an SSM group of one layer that is the PLE state."""
    groups = draw(st.integers(2, 4))
    specs = [FullAttentionSpec, MambaSpec] + [
        draw(st.sampled_from([*ATTENTION_SPECS, MambaSpec])) for _ in range(groups - 2)
    ]
    regions = draw(st.integers(2, 5))
    # The first regions one group each, the others any group's.
    layer_groups = [
        (
            f"model.layers.{r}.mixer",
            r if r < groups else draw(st.integers(0, groups - 1)),
        )
        for r in range(regions)
    ]
    ssm_groups = [g for g in range(groups) if specs[g] is MambaSpec]
    ple_group = None
    candidates = [
        g for g in ssm_groups if sum(group == g for _, group in layer_groups) == 1
    ]
    pick = draw(st.booleans())
    if candidates and pick:
        ple_group = draw(st.sampled_from(candidates))
    ple_region = next(
        (r for r, (_, g) in enumerate(layer_groups) if g == ple_group), None
    )
    ssm_regions = tuple(
        r
        for r, (_, g) in enumerate(layer_groups)
        if specs[g] is MambaSpec and r != ple_region
    )
    return Model(
        region_layers=tuple((layer,) for layer, _ in layer_groups),
        layer_groups=tuple(layer_groups),
        group_spec_types=tuple(specs),
        num_regions=draw(st.sampled_from([regions] * 3 + [0])),
        has_mamba=True,
        # Mamba2 and GDN: 3 conv sub-projections; Mamba1: 1.
        conv_offsets=draw(
            st.sampled_from([((0, 16), (16, 16), (32, 16))] * 3 + [((0, 48),)])
        ),
        ssm_region_indices=ssm_regions,
        ple_group_index=ple_group,
        ple_region_index=ple_region,
    )


@st.composite
def models(draw: st.DrawFn, kind: str) -> tuple[Model, Pairs]:
    """A model of ``kind`` and its pairs with a peer (vLLM's _pair_regions;
    raw: drawn, any entries)."""
    if kind == "ssm" or (kind == "raw" and draw(st.booleans())):
        model = draw(mamba_model())
    else:
        groups = 1 if kind == "one group" else draw(st.integers(1, 4))
        model = draw(attention_model(groups))
    if kind == "raw":
        n = model.regions
        length = draw(st.integers(0, 6))
        entries = st.lists(st.integers(-n - 1, n), min_size=length, max_size=length)
        keys = st.lists(
            st.integers(-len(model.group_spec_types) - 1, len(model.group_spec_types)),
            min_size=length,
            max_size=length,
        )
        ssm = st.none() | st.lists(st.integers(0, n), max_size=n, unique=True)
        regions = tuple(draw(entries))
        drawn_ssm = draw(ssm)
        pairs = Pairs(
            regions,
            regions,
            tuple(draw(keys)),
            None if drawn_ssm is None else tuple(drawn_ssm),
        )
        return model, pairs
    peer_order = draw(st.permutations(range(model.regions)))
    return model, pair(model, peer_order)


@st.composite
def calls(draw: st.DrawFn, model: Model, pairs: Pairs, kind: str) -> Call:
    """A call as vLLM's pull and push workers make it: the remote side (the
    peer's regions, no ratio), the local side (a ratio now and then), or a
    region-mapped read (ids per region); ids in range of every region they
    index, and in half the calls one that is not, at a boundary (-1, a
    region's count, the next region's first block, past int32, uint32 or
    int64) or one past it."""
    if kind == "region-mapped":
        side = "by region"
    elif kind == "ratio":
        side = "local"
    else:
        side = draw(st.sampled_from(["remote", "local"]))
    regions, keys, ssm = pairs.local, pairs.group, None
    if side == "remote":
        regions, ssm = pairs.remote, pairs.remote_ssm_regions
    elif side == "by region":
        keys = regions
    if kind == "raw":
        ssm = draw(st.sampled_from([None, pairs.remote_ssm_regions]))
    ratio = None
    if side != "remote":
        ratios = [None, 1, 2, 4, 0.5] if kind == "ratio" else [None, None, None, 2]
        ratio = draw(st.sampled_from(ratios))
    n = model.num_regions or model.regions
    call = Call(
        block_ids=(),
        dst_num_blocks=draw(st.integers(1, 12)),
        regions=regions,
        keys=keys,
        block_size_ratio=ratio,
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
        ssm_regions=ssm,
        group_type=draw(st.sampled_from([list, list, list, tuple])),
    )
    width = model.regions if side == "by region" else len(model.group_spec_types)
    sizes = [draw(st.integers(0, 3)) for _ in range(width)]
    found = spans(model, replace(call, block_ids=tuple((0,) * k for k in sizes))) or []
    edges = sorted(
        {*EDGE_IDS, *(s.blocks for s in found), *(s.first for s in found)}
        | {s.blocks - 1 for s in found}
        | {sum(s.blocks for s in found)}
    )
    block_ids = []
    for key, size in enumerate(sizes):
        limit = min((s.blocks for s in found if s.key == key), default=8)
        good = st.integers(0, limit - 1) if limit > 0 else st.sampled_from(edges)
        block_ids.append([draw(good) for _ in range(size)])
    placed = [(key, k) for key, size in enumerate(sizes) for k in range(size)]
    misplace = draw(st.booleans())
    if placed and misplace:
        key, k = draw(st.sampled_from(placed))
        limit = min((s.blocks for s in found if s.key == key), default=0)
        bad = [v for v in edges if not 0 <= v < limit] + [limit, limit + 1]
        block_ids[key][k] = draw(st.sampled_from(bad))
    return replace(call, block_ids=tuple(tuple(ids) for ids in block_ids))


# --- the patched method against vLLM's own ------------------------------------------


def check_call(worker: Any, model: Model, call: Call) -> None:
    """One call of the patched method against vLLM's own on the same worker."""
    found = spans(model, call)
    vllm_sane = outcome(VLLM_COMPUTE_DESC_IDS, worker, **call.sane())
    assert not misses(worker), f"vLLM read more than {PAIRS_ATTRIBUTES}"
    if found is None:  # vLLM fails here whatever the ids
        assert isinstance(vllm_sane, Exception), "spans() expects vLLM to raise"
    else:
        assert not isinstance(vllm_sane, Exception), f"vLLM raised {vllm_sane!r}"
        expected = np.array(expected_ids(found, call.sane()["block_ids"]), np.int64)
        # int32 from vLLM's Mamba branch (wrapping), int64 from the other.
        mamba = model.has_mamba and bool(model.ssm_region_indices or model.regions)
        assert vllm_sane.dtype == (np.int32 if mamba else np.int64)
        assert vllm_sane.tolist() == expected.astype(vllm_sane.dtype).tolist()
    _nixl._warned.clear()
    vllm_calls[0] = 0
    with captured("ptrres.vllm") as log:
        ours = outcome(PATCHED, worker, **call.kwargs())
    assert not misses(worker)
    if isinstance(vllm_sane, Exception):
        vllms = outcome(VLLM_COMPUTE_DESC_IDS, worker, **call.kwargs())
        assert isinstance(vllms, Exception)
        assert type(ours) is type(vllms), f"{ours!r} where vLLM raises {vllms!r}"
        assert not log.records
        return
    assert found is not None
    assert not isinstance(ours, Exception), f"patched raised {ours!r}"
    assert vllm_calls == [0]  # built by the kernel, vLLM's own never called
    bad = first_bad(found, call.block_ids)
    if bad is None:
        assert not log.records
        vllms = outcome(VLLM_COMPUTE_DESC_IDS, worker, **call.kwargs())
        if isinstance(vllms, Exception):
            # An id past int64 in a group no pair reads, which vLLM's Mamba
            # branch converts all the same (OverflowError): ours builds the
            # ids it reads.
            assert isinstance(vllms, OverflowError)
            np.testing.assert_array_equal(ours, vllm_sane)
            assert ours.dtype == vllm_sane.dtype
            return
        assert ours.dtype == vllms.dtype
        assert ours.shape == vllms.shape
        np.testing.assert_array_equal(ours, vllms)
        return
    assert ours.dtype == vllm_sane.dtype
    assert ours.shape == vllm_sane.shape
    assert (ours == REFUSED_INDEX).all()
    assert log.at(logging.WARNING) == [bad_id_line(bad)]
    assert len(log.records) == 1


def checked_worker(model: Model) -> Any:
    return strict_worker(model.attributes())


@pytest.mark.parametrize("kind", KINDS)
@given(data=st.data())
def test_the_patched_method_is_vllms_on_good_ids_and_refuses_bad_ones(
    kind: str, data: st.DataObject
) -> None:
    model, pairs = data.draw(models(kind))
    worker = checked_worker(model)
    for call in data.draw(st.lists(calls(model, pairs, kind), min_size=1, max_size=3)):
        check_call(worker, model, call)


# What may change between two transfers of one worker.
CHANGES = ("ids", "ratio", "counts", "per logical", "ssm regions", "registered again")


@given(data=st.data())
def test_a_worker_keeps_no_stale_layout(data: st.DataObject) -> None:
    """The patched method keeps each worker's layouts: one call after
    another on one worker, each changed in one thing, each vLLM's."""
    kind = data.draw(st.sampled_from(KINDS))
    model, pairs = data.draw(models(kind))
    worker = checked_worker(model)
    call = data.draw(calls(model, pairs, kind))
    check_call(worker, model, call)
    for change in data.draw(st.lists(st.sampled_from(CHANGES), min_size=1, max_size=5)):
        if change == "registered again":
            kind = data.draw(st.sampled_from(KINDS))
            model, pairs = data.draw(models(kind))
            worker.__dict__.update(model.attributes())
        other = data.draw(calls(model, pairs, kind))
        if change == "ids":
            call = replace(call, block_ids=other.block_ids)
        elif change == "ratio":
            call = replace(call, block_size_ratio=other.block_size_ratio)
        elif change == "counts":
            call = replace(call, region_num_blocks=other.region_num_blocks)
        elif change == "per logical":
            per_logical = other.physical_blocks_per_logical
            call = replace(call, physical_blocks_per_logical=per_logical)
        elif change == "ssm regions":
            call = replace(call, ssm_regions=other.ssm_regions)
        else:
            call = other
        check_call(worker, model, call)


# --- vLLM's own descriptor lists: what spans() bounds ids by -------------------------


def strided_addresses(rows: npt.NDArray[np.uint64]) -> list[tuple[int, int]]:
    """Every descriptor of Nx5 strided rows (addr, len, dev, stride, count),
    numbered as NIXL numbers them: (address, length)."""
    return [
        (int(addr) + i * int(stride), int(length))
        for addr, length, _, stride, count in rows.tolist()
        for i in range(int(count))
    ]


def region_base(region: int) -> int:
    return (region + 1) << 32


def local_descriptors(
    model: Model, num_blocks: int, ratio: int, per_logical: int
) -> list[tuple[int, int]]:
    """The local descriptor list a 0.34 worker of ``model`` prepares
    (register_local_xfer_handler: vLLM's own _build_fa_local, then
    _build_mamba_local), every region BLOCK_LEN bytes a block, strided by
    STRIDE: (address, length) each."""
    bare = type("BuildingWorker", (Base,), {"__del__": lambda self: None})
    worker: Any = object.__new__(bare)
    for name, value in {
        **model.attributes(),
        "transfer_topo": object(),
        "device_id": 0,
        "block_stride_per_layer": [STRIDE] * model.regions,
        "region_num_blocks": [num_blocks] * model.regions,
        "_mamba_ssm_size": (CONV_SIZE, SSM_SIZE),
        "_logical_num_blocks": num_blocks // per_logical,
        "_physical_blocks_per_logical_kv_block": per_logical,
        "_ple_region_index": model.ple_region_index,
        "_ple_block_len": CONV_SIZE,
    }.items():
        setattr(worker, name, value)
    bases = [region_base(r) for r in range(model.regions)]
    rows = worker._build_fa_local(bases, ratio)
    if model.has_mamba:
        rows = np.concatenate([rows, worker._build_mamba_local(bases)])
    return strided_addresses(rows)


@pytest.mark.parametrize("kind", ["one group", "hybrid", "ssm"])
@given(data=st.data())
def test_each_span_is_its_regions_blocks_in_vllms_own_descriptor_list(
    kind: str, data: st.DataObject
) -> None:
    """The local side of a pull, as vLLM calls it after register_kv_caches
    (its own region counts, its ratio to the peer's block size): each span's
    descriptors, first to first + blocks, are its region's blocks in order
    (block j of an attention region, split into ``ratio`` sub-blocks; SSM
    descriptor d's conv or SSM state of logical block j), and the spans
    stay inside the list."""
    model, pairs = data.draw(models(kind))
    model = replace(model, num_regions=model.regions)
    per_logical = data.draw(st.sampled_from([1, 2])) if model.has_mamba else 1
    num_blocks = data.draw(st.integers(1, 6)) * per_logical
    ratio = data.draw(st.sampled_from([1, 2, 4]))
    descriptors = local_descriptors(model, num_blocks, ratio, per_logical)
    call = Call(
        block_ids=tuple((0,) for _ in model.group_spec_types),
        dst_num_blocks=num_blocks,
        regions=pairs.local,
        keys=pairs.group,
        block_size_ratio=ratio,
        physical_blocks_per_logical=per_logical,
        region_num_blocks=(num_blocks,) * model.regions,
    )
    found = spans(model, call)
    assert found is not None
    assert found, "no pair read"
    sub_len = BLOCK_LEN // ratio
    assert model.conv_offsets is not None or not model.has_mamba
    ssm = model.ssm_region_indices or tuple(range(model.regions))
    parts = [*(model.conv_offsets or ()), (CONV_SIZE, SSM_SIZE)]
    for span in found:
        assert span.first + span.blocks <= len(descriptors)
        got = descriptors[span.first : span.first + span.blocks]
        kind_of = model.group_spec_types[span.key]
        if kind_of is not MambaSpec:
            base = region_base(span.region)
            want = [
                (base + (j // ratio) * STRIDE + (j % ratio) * sub_len, sub_len)
                for j in range(num_blocks * ratio)
            ]
        elif span.key == model.ple_group_index:
            assert model.ple_region_index is not None
            base = region_base(model.ple_region_index)
            want = [
                (base + j * STRIDE * per_logical, CONV_SIZE * per_logical)
                for j in range(num_blocks // per_logical)
            ]
        else:
            d = (span.first - num_blocks * ratio * model.regions) // span.blocks
            region, part = ssm[d // len(parts)], parts[d % len(parts)]
            assert region == span.region
            want = [
                (region_base(region) + part[0] + j * STRIDE * per_logical, part[1])
                for j in range(num_blocks // per_logical)
            ]
        assert got == want, span


# --- examples at each boundary ------------------------------------------------------


def one_group(regions: int) -> Model:
    layers = tuple((f"model.layers.{r}.attn",) for r in range(regions))
    return Model(
        region_layers=layers,
        layer_groups=tuple((layer[0], 0) for layer in layers),
        group_spec_types=(FullAttentionSpec,),
        num_regions=regions,
    )


HYBRID = Model(
    region_layers=(("model.layers.0.attn",), ("model.layers.1.attn",)),
    layer_groups=(("model.layers.0.attn", 0), ("model.layers.1.attn", 1)),
    group_spec_types=(FullAttentionSpec, SlidingWindowSpec),
    num_regions=2,
)
# Region 0: attention (group 0); regions 1 and 2: SSM (group 1); region 3:
# the PLE state (group 2).
MAMBA = Model(
    region_layers=tuple((f"model.layers.{r}.mixer",) for r in range(4)),
    layer_groups=tuple(
        (f"model.layers.{r}.mixer", g) for r, g in enumerate((0, 1, 1, 2))
    ),
    group_spec_types=(FullAttentionSpec, MambaSpec, MambaSpec),
    num_regions=4,
    has_mamba=True,
    conv_offsets=((0, 16), (16, 16), (32, 16)),
    ssm_region_indices=(1, 2),
    ple_group_index=2,
    ple_region_index=3,
)
EXAMPLES = [
    # The hybrid case: group 0's id 4 is region 1's block 0.
    (HYBRID, Call(((0, 4), (2,)), 4, (0, 1), (0, 1), None, 1, (4, 4))),
    # Past int32 (NIXL refuses what it casts 2**31 to) and past uint32
    # (2**32 + 5 is cast to 5, read silently).
    (one_group(2), Call(((1, 2**31),), 4, (0, 1), (0, 0))),
    (one_group(2), Call(((2**32 + 5, 1),), 8, (1, 0), (0, 0))),
    (one_group(1), Call(((-1,),), 4, (0,), (0,), 2)),
    (one_group(1), Call(((2**63,),), 4, (0,), (0,))),
    # A ratio: 4 blocks of the peer's size are 8 here, 0.5 are 2.
    (one_group(2), Call(((7, 8),), 4, (0, 1), (0, 0), 2)),
    (one_group(2), Call(((1, 2),), 4, (0, 1), (0, 0), 0.5)),
    # Region-mapped: each region's own ids.
    (HYBRID, Call(((3,), (4,)), 4, (0, 1), (0, 1), None, 1, (4, 4))),
    # SSM ids count logical blocks: 8 // 2, on every SSM descriptor.
    (MAMBA, Call(((7,), (3,), (0,)), 8, (0, 1, 2, 3), (0, 1, 1, 2), None, 2)),
    (MAMBA, Call(((7,), (4,), (0,)), 8, (0, 1, 2, 3), (0, 1, 1, 2), None, 2)),
    (MAMBA, Call(((7,), (2**32 + 1,), (0,)), 8, (0, 1, 2, 3), (0, 1, 1, 2), None, 2)),
    (MAMBA, Call(((0,), (0,), (4,)), 8, (0, 1, 2, 3), (0, 1, 1, 2), None, 2)),
    # The peer's SSM regions in its own order.
    (
        MAMBA,
        Call(((1,), (3,), (0,)), 8, (1, 2, 0, 3), (1, 1, 0, 2), None, 2, None, (2, 1)),
    ),
    # Empty: int64 for attention, int32 for Mamba.
    (HYBRID, Call(((), ()), 4, (0, 1), (0, 1))),
    (MAMBA, Call(((), (), ()), 8, (0, 1, 2, 3), (0, 1, 1, 2))),
    # No region registered yet: vLLM counts block_len_per_layer.
    (replace(HYBRID, num_regions=0), Call(((3,), (2,)), 4, (0, 1), (0, 1))),
    # A negative key is Python's: the last group.
    (HYBRID, Call(((1,), (2,)), 4, (0, 1), (-1, 0))),
]


@pytest.mark.parametrize(("model", "call"), EXAMPLES)
def test_each_branch_at_its_boundaries(model: Model, call: Call) -> None:
    check_call(checked_worker(model), model, call)


def test_the_worker_attributes_are_the_releases_own() -> None:
    """Over one call of each branch, vLLM's method reads every attribute of
    PAIRS_ATTRIBUTES (and, StrictWorker says, no other)."""
    reads: set[str] = set()
    for model, call in EXAMPLES:
        worker = checked_worker(model)
        VLLM_COMPUTE_DESC_IDS(worker, **call.sane())
        assert not misses(worker)
        reads |= worker.__dict__["__reads__"]
    assert reads == set(PAIRS_ATTRIBUTES)


def test_an_id_past_uint32_wraps_in_vllms_mamba_branch_and_is_refused() -> None:
    """vLLM's astype(np.int32) makes SSM id 2**32 + 1 the index of id 1."""
    model, call = EXAMPLES[10]
    worker = checked_worker(model)
    vllms = VLLM_COMPUTE_DESC_IDS(worker, **call.kwargs())
    good = VLLM_COMPUTE_DESC_IDS(
        worker, **replace(call, block_ids=((7,), (1,), (0,))).kwargs()
    )
    assert vllms.dtype == np.int32
    assert vllms.tolist() == good.tolist()
    assert (PATCHED(worker, **call.kwargs()) == REFUSED_INDEX).all()


def test_an_index_past_int32_is_refused_where_vllm_wraps() -> None:
    """Regions whose counts add up past 2**31 (a peer's handshake says so):
    vLLM's int32 Mamba indices wrap, and an attention index is cast by NIXL;
    ptrres refuses the id, naming the index."""
    huge = 2**30
    call = Call(
        ((1,), (1,), (0,)), huge, (0, 1, 2, 3), (0, 1, 1, 2), None, 1, (huge,) * 4
    )
    worker = checked_worker(MAMBA)
    vllms = VLLM_COMPUTE_DESC_IDS(worker, **call.kwargs())
    assert vllms.dtype == np.int32
    # SSM descriptor 0's block 1, 2**32 + 1, wrapped onto attention block 1.
    assert vllms[0] == vllms[1] == 1
    with captured("ptrres.vllm") as log:
        ours = PATCHED(worker, **call.kwargs())
    assert (ours == REFUSED_INDEX).all()
    assert ours.dtype == np.int32
    assert log.at(logging.WARNING) == [
        "ptrres: NIXL transfer of request None: ? block id 1 (engine ?, group 1, "
        f"position 0) would be descriptor {4 * huge + 1} of region 1, which NIXL's "
        "int32 indices cannot hold; the request fails in vLLM's transfer setup, "
        "and no block moves"
    ]


def test_ids_of_a_group_no_pair_reads_are_not_read() -> None:
    """An id past int64 in a group no pair reads: vLLM's attention branch
    never converts it; its Mamba branch does, and raises OverflowError
    outside vLLM's try; ptrres builds the ids the pairs read. Integer ids
    of another type (3.0) are vLLM's."""
    call = Call(((1,), (2**64,)), 4, (0, 1), (0, 0))
    worker = checked_worker(HYBRID)
    np.testing.assert_array_equal(
        PATCHED(worker, **call.kwargs()), VLLM_COMPUTE_DESC_IDS(worker, **call.kwargs())
    )
    call = Call(((1,), (2,), (0,), (2**64,)), 8, (0, 1, 2, 3), (0, 1, 1, 2))
    worker = checked_worker(MAMBA)
    with pytest.raises(OverflowError):
        VLLM_COMPUTE_DESC_IDS(worker, **call.kwargs())
    sane = replace(call, block_ids=(*call.block_ids[:3], ()))
    ours = PATCHED(worker, **call.kwargs())
    np.testing.assert_array_equal(ours, VLLM_COMPUTE_DESC_IDS(worker, **sane.kwargs()))
    kwargs = call.kwargs()
    kwargs["block_ids"] = [[1.0], [2.0], [0.0], []]
    vllms = VLLM_COMPUTE_DESC_IDS(worker, **kwargs)
    ours = PATCHED(worker, **kwargs)
    assert ours.dtype == vllms.dtype
    np.testing.assert_array_equal(ours, vllms)


def test_a_worker_patched_then_unpatched_runs_vllms_own() -> None:
    """The patched method, kept past the path's unpatching (``active``
    False), is vLLM's again."""
    active = [True]
    method = _nixl_pairs.patched_compute_desc_ids(
        base_worker, VLLM_COMPUTE_DESC_IDS, lambda: active[0]
    )
    model, call = EXAMPLES[0]
    worker = checked_worker(model)
    assert (method(worker, **call.kwargs()) == REFUSED_INDEX).all()
    active[0] = False
    with captured("ptrres.vllm") as log:
        ids = method(worker, **call.kwargs())
    assert ids.tolist() == [0, 4, 6]  # group 0's 4 is region 1's block 0
    assert not log.records


def test_a_check_that_fails_falls_back_to_vllms_own_once_warned(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A plugin never takes vLLM down: an error in the check is one WARNING,
    and vLLM builds the ids."""

    def broken(*args: Any) -> None:
        raise RuntimeError("broken")

    monkeypatch.setattr(_nixl_pairs, "cached_layout", broken)
    _nixl._warned.clear()
    model, call = EXAMPLES[0]
    worker = checked_worker(model)
    with captured("ptrres.vllm") as log:
        for _ in range(2):
            ids = PATCHED(worker, **call.kwargs())
            assert ids.tolist() == [0, 4, 6]
    assert log.at(logging.WARNING) == [
        "ptrres: could not check this NIXL transfer's block ids; vLLM builds its "
        "descriptor ids unchecked"
    ]


def test_nixl_034_code_names_code_that_is_there() -> None:
    """Every locator of NIXL_034_CODE is in the installed 0.34, but the
    overrides that must stay missing; what nixl_replacements_034 replaces is
    NIXL_034_CODE.replaces, and it keeps vLLM's signatures."""
    from ptrres.vllm._fingerprint import MISSING, find

    code = _nixl_pairs.NIXL_034_CODE
    missing = [locator for locator in code.locators() if find(locator) is MISSING]
    assert missing == [
        f"{_nixl_pairs.PULL_MODULE}:NixlPullConnectorWorker._compute_desc_ids",
        f"{_nixl_pairs.PUSH_MODULE}:NixlPushConnectorWorker._compute_desc_ids",
    ]
    replacements = _nixl_pairs.nixl_replacements_034(lambda: True, lambda: None)
    assert [
        f"{r.owner.__module__}:{r.owner.__qualname__}.{r.name}" for r in replacements
    ] == list(code.replaces)
    for r in replacements:
        assert r.original is vars(r.owner)[r.name]
        assert r.replacement.__wrapped__ is r.original
