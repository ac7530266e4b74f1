"""vLLM 0.34's NIXL connector: every block id of every (region, key) pair
that ``NixlBaseConnectorWorker._compute_desc_ids`` turns into an index,
checked on both sides.

0.34 pairs the two engines' regions by layer name when it adds a peer
(``_pair_regions``: one ``_RegionPairs`` per remote engine), and each
transfer's ids come from ``_compute_desc_ids(block_ids, dst_num_blocks,
block_size_ratio, physical_blocks_per_logical, pairs=(regions, keys),
region_num_blocks=None, ssm_regions=None)``: region ``regions[k]`` is read
at ``block_ids[keys[k]]``, where a key is a cache group (or a region, for
region-mapped reads). Region r's descriptors start at the running sum of
the regions' block counts (scaled by ``block_size_ratio`` on the local side
of a pull). Attention models' ids come out int64, key by key (sorted), pair
by pair; a Mamba model's come out group by group, an SSM group's after every
attention descriptor (``dst_num_blocks // physical_blocks_per_logical`` per
SSM descriptor), then ``astype(np.int32)``, which wraps. vLLM checks no id,
and NIXL 1.5's Python API casts int64 indices to C ints: an attention id of
2**32 + 5 on a region of 8 blocks reads block 5, and the transfer completes.

Patched, ``_compute_desc_ids`` reads the same arguments and worker
attributes as vLLM's, and lays out (pairs_layout) which region each pair
indexes, with its first descriptor and its block count, in the order of
vLLM's output: the segments of ``ptrres.vllm._nixl_regions``, built into
the output by one compiled kernel (desc_ids_kernel, as on 0.30-0.33), which
checks every id against its region's count. In range, the output is vLLM's,
element for element and dtype (int64, or int32 for Mamba models, empty
arrays included). A bad id, or an index vLLM would make that NIXL's int32
cannot hold, logs one line and gives an array of vLLM's shape and dtype made
of REFUSED_INDEX: ``make_prepped_xfer`` raises inside vLLM's own ``try``, and
the request fails the way vLLM fails a transfer it cannot set up, with no
byte moved (as on 0.30-0.33, ``ptrres.vllm._nixl``).

NIXL_034_CODE names the vLLM code this patch depends on, and
nixl_replacements_034() what it replaces; ``ptrres.vllm`` decides whether
and when. Importing this module imports no vLLM module and no kernel.
"""

from __future__ import annotations

import functools
import importlib
import itertools
import operator
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import numpy.typing as npt

from . import _nixl
from ._fingerprint import PathCode
from ._nixl_regions import (
    DescLayout,
    Segment,
    first_bad_id,
    flat_ids,
    layout_of,
)

if TYPE_CHECKING:
    from ._state import Replacement

NIXL_PACKAGE = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"
BASE_MODULE = f"{NIXL_PACKAGE}.base_worker"
PULL_MODULE = f"{NIXL_PACKAGE}.pull_worker"
PUSH_MODULE = f"{NIXL_PACKAGE}.push_worker"
_BASE = f"{BASE_MODULE}:NixlBaseConnectorWorker"
_PULL = f"{PULL_MODULE}:NixlPullConnectorWorker"
_PUSH = f"{PUSH_MODULE}:NixlPushConnectorWorker"


NIXL_034_CODE = PathCode(
    replaces=(
        f"{_BASE}.__init__",
        f"{_BASE}._compute_desc_ids",
        f"{_PULL}._read_blocks",
        f"{_PUSH}._xfer_blocks",
    ),
    reproduces=(f"{_BASE}._compute_desc_ids",),
    reads=(
        # What a pair means: remote[k] indexes the peer's paired regions, in
        # its order (the only ones its descriptor list holds); local[k] and
        # group[k]; the peer's SSM regions in the order of its SSM descriptors.
        f"{BASE_MODULE}:_RegionPairs",
        f"{_BASE}._pair_regions",
        f"{_BASE}._pair_ssm_regions",
        f"{_BASE}._select_remote_regions",
        # The descriptor lists the ids index: region r's blocks (scaled on the
        # local side) after the regions before it, then the SSM descriptors of
        # logical blocks, the PLE one last; and the block counts the two calls
        # are given (dst_num_blocks, dst_region_num_blocks).
        f"{_BASE}.register_kv_caches",
        f"{_BASE}.register_local_xfer_handler",
        f"{_BASE}.add_remote_agent",
        f"{_BASE}._build_fa_local",
        f"{_BASE}._build_fa_remote",
        f"{_BASE}._build_mamba_local",
        f"{_BASE}._build_mamba_remote",
        f"{_BASE}._block_strided_descs",
        f"{_BASE}._pack_strided_descs",
        # Called through base_worker, as vLLM's method calls them.
        f"{BASE_MODULE}:_is_attention_spec",
        f"{BASE_MODULE}:_is_ssm_spec",
        # _conv_decomp: its local_conv_offsets count the SSM descriptors.
        "vllm.distributed.kv_transfer.kv_connector.v1.ssm_conv_transfer_utils"
        ":MambaConvSplitInfo",
        # A refused index fails the request inside _read_blocks' and
        # _xfer_blocks' try, and only the request.
        f"{_PULL}._read_blocks_mixed",
        f"{_PULL}._read_blocks_for_req",
        f"{_PUSH}._xfer_blocks_for_req",
        f"{_BASE}._log_failure",
        f"{_BASE}._handle_failed_transfer",
        # The workers are built through the wrapped __init__.
        f"{_PULL}.__init__",
        f"{_PUSH}.__init__",
        # Must stay missing: an override would bypass the checked method.
        f"{_PULL}._compute_desc_ids",
        f"{_PUSH}._compute_desc_ids",
    ),
)


def nixl_replacements_034(
    active: Callable[[], bool], prepare: Callable[[], None]
) -> list[Replacement]:
    """Every attribute to replace on vLLM 0.34's NIXL connector: the worker's
    __init__ (vLLM's, then ``prepare()`` and the index kernel called once),
    its _compute_desc_ids (every id checked), and the pull and push workers'
    _read_blocks and _xfer_blocks (vLLM's, the transfer named for the log).

    Args:
        active: whether the path is patched now; a worker built while it was
            runs vLLM's own once it is not.
        prepare: makes the kernels ready (loaded from Numba's cache, or
            compiled), where vLLM builds its worker.

    Returns:
        The replacements, each with vLLM's original from its class's own
        ``vars()``. It imports vLLM's three NIXL worker modules (and raises
        what their import raises); whether they are the code this patch was
        tested against (NIXL_034_CODE) is the caller's to check.
    """
    from ._state import Replacement

    base_worker = importlib.import_module(BASE_MODULE)
    base = base_worker.NixlBaseConnectorWorker
    pull = importlib.import_module(PULL_MODULE).NixlPullConnectorWorker
    push = importlib.import_module(PUSH_MODULE).NixlPushConnectorWorker
    original = vars(base)["_compute_desc_ids"]
    init = vars(base)["__init__"]
    replacements = [
        Replacement(base, "__init__", init, _nixl.patched_init(init, prepare)),
        Replacement(
            base,
            "_compute_desc_ids",
            original,
            patched_compute_desc_ids(base_worker, original, active),
        ),
    ]
    for owner, name in ((pull, "_read_blocks"), (push, "_xfer_blocks")):
        method = vars(owner)[name]
        replacements.append(
            Replacement(owner, name, method, _nixl.wrap_transfer(method))
        )
    return replacements


def patched_compute_desc_ids(
    base_worker: Any,
    vllm_compute_desc_ids: Callable[..., Any],
    active: Callable[[], bool],
) -> Callable[..., Any]:
    """0.34's _compute_desc_ids, every id checked, showing vLLM's signature.

    Args:
        base_worker: vLLM's nixl/base_worker module (its _is_attention_spec
            and _is_ssm_spec).
        vllm_compute_desc_ids: vLLM's own, called where vLLM itself fails on
            the arguments (it then does, as it did), or while not ``active``.
        active: whether the path is patched now.
    """

    @functools.wraps(vllm_compute_desc_ids)
    def _compute_desc_ids(
        self: Any,
        block_ids: Any,
        dst_num_blocks: int,
        block_size_ratio: float | None,
        physical_blocks_per_logical: int,
        pairs: tuple[Sequence[int], Sequence[int]],
        region_num_blocks: Sequence[int] | None = None,
        ssm_regions: Sequence[int] | None = None,
    ) -> Any:
        """vLLM's _compute_desc_ids, every id checked (ptrres)."""
        arguments: PairsArguments = (
            block_ids, dst_num_blocks, block_size_ratio, physical_blocks_per_logical,
            pairs, region_num_blocks, ssm_regions,
        )  # fmt: skip
        _nixl._transfer.calls += 1
        if not active():
            return vllm_compute_desc_ids(self, *arguments)
        try:
            checked = checked_desc_ids(self, arguments, base_worker)
        except Exception:  # a plugin never takes vLLM down: vLLM's own, then
            _nixl.warn_once(
                "ptrres: could not check this NIXL transfer's block ids; vLLM "
                "builds its descriptor ids unchecked"
            )
            return vllm_compute_desc_ids(self, *arguments)
        if checked is None:
            return vllm_compute_desc_ids(self, *arguments)
        return checked

    return _compute_desc_ids


# _compute_desc_ids' arguments after the worker, in its order.
PairsArguments = tuple[
    Sequence[Any], int, "float | None", int, Any, "Sequence[int] | None",
    "Sequence[int] | None",
]  # fmt: skip

# The most an index may be, plus one, in vLLM's int64 (attention) and what
# NIXL's C int holds (vLLM's int32, and what NIXL casts int64 indices to).
_INT64_END = 2**63
_INT32_END = 2**31


class PairsLayout(NamedTuple):
    """Where _compute_desc_ids puts each pair's ids, in the order of its
    output: a DescLayout whose segment groups are keys (indices into
    block_ids), as desc_ids_kernel takes it; kept per worker."""

    layout: DescLayout
    # (n, SEGMENT_COLUMNS) int64: each segment's key, first descriptor and the
    # count its ids are checked against, that count cut where an index would
    # not fit NIXL's int32 (or be negative: a count below 0 counts as 0).
    segments: npt.NDArray[np.int64]
    # The layout with those cut counts, where any was cut (else None).
    cut: DescLayout | None
    # Each key's number of segments: the output holds as many of its ids.
    per_key: tuple[tuple[int, int], ...]
    # vLLM's output dtype: int64 (attention), int32 (a Mamba model's).
    dtype: type[np.signedinteger[Any]]


# Where a worker keeps its PairsLayouts, by their key.
_LAYOUTS_ATTRIBUTE = "_ptrres_pair_layouts"
_MAX_LAYOUTS = 64


def layout_key(worker: Any, arguments: PairsArguments) -> tuple[Any, ...]:
    """What a PairsLayout depends on: the arguments (sequences as tuples), and
    the worker's attributes vLLM's method reads for them."""
    block_ids, num_blocks, ratio, per_logical, pairs, counts, ssm = arguments
    key: tuple[Any, ...] = (
        num_blocks, ratio, per_logical, len(block_ids),
        tuple(pairs[0]), tuple(pairs[1]), len(pairs),
        None if counts is None else tuple(counts),
        None if ssm is None else tuple(ssm), worker._has_mamba,
    )  # fmt: skip
    if counts is None:
        key += (worker.num_regions, len(worker.block_len_per_layer))
    if worker._has_mamba:
        conv = worker._conv_decomp
        key += (
            None if conv is None else len(conv.local_conv_offsets),
            tuple(worker._ssm_region_indices or ()),
            len(worker.block_len_per_layer),
            tuple(worker._group_spec_types),
            worker._ple_group_index,
            # Which groups have ids: only those are read, on this branch.
            tuple(bool(len(ids)) for ids in block_ids),
        )
    return key


def cached_layout(
    worker: Any, arguments: PairsArguments, base_worker: Any
) -> PairsLayout | None:
    """The worker's PairsLayout of these arguments (made once); None where
    vLLM's own method fails on them (it then does, as it did)."""
    layouts = worker.__dict__.get(_LAYOUTS_ATTRIBUTE)
    if layouts is None:
        layouts = worker.__dict__[_LAYOUTS_ATTRIBUTE] = {}
    key = layout_key(worker, arguments)
    if key in layouts:
        found: PairsLayout | None = layouts[key]
        return found
    found = pairs_layout(worker, arguments, base_worker)
    if len(layouts) >= _MAX_LAYOUTS:
        layouts.clear()
    layouts[key] = found
    return found


def pairs_layout(
    worker: Any, arguments: PairsArguments, base_worker: Any
) -> PairsLayout | None:
    """The segments of vLLM 0.34's _compute_desc_ids output for these
    arguments, branch for branch; None where vLLM raises whatever the ids
    (an assertion, an index or key its own arrays lack, an unknown spec), or
    takes what it was not built for (a count or pair that is no integer)."""
    block_ids, dst_num_blocks, ratio, per_logical, pairs, counts, ssm = arguments
    ssm_per_layer = num_ssm_regions = 0
    if worker._has_mamba:
        if worker._conv_decomp is None:  # vLLM asserts
            return None
        ssm_per_layer = len(worker._conv_decomp.local_conv_offsets) + 1
        num_ssm_regions = (
            len(worker._ssm_region_indices or worker.block_len_per_layer)
            * ssm_per_layer
        )
    num_blocks = dst_num_blocks
    if ratio is not None:
        num_blocks = int(num_blocks * ratio)
    if counts is None:
        counts = [num_blocks] * (worker.num_regions or len(worker.block_len_per_layer))
    elif ratio is not None:
        counts = [int(count * ratio) for count in counts]
    region_counts = _integers(counts)
    if region_counts is None or len(pairs) != 2:
        return None
    regions, keys = _integers(pairs[0]), _integers(pairs[1])
    if regions is None or keys is None or len(regions) != len(keys):
        return None
    # vLLM's region offsets: np.cumsum([0, *counts[:-1]]), one entry at least.
    firsts = list(itertools.accumulate(region_counts[:-1], initial=0))
    segments: list[Segment] = []

    def region_segment(key: int, region: int) -> Segment | None:
        """Pair (region, key)'s segment: the region's first descriptor and
        count (a region past the counts, where there are none, counts 0)."""
        if not -len(firsts) <= region < len(firsts):  # numpy's IndexError
            return None
        region %= len(firsts)
        count = region_counts[region] if region_counts else 0
        return Segment(key, region, firsts[region], count)

    groups = len(block_ids)
    if num_ssm_regions == 0:  # vLLM's all-attention path
        for key in sorted(set(keys)):
            if not -groups <= key < groups:  # block_ids[key]: IndexError
                return None
            for region, pair_key in zip(regions, keys):
                if pair_key == key:
                    segment = region_segment(key % groups, region)
                    if segment is None:
                        return None
                    segments.append(segment)
        return _finish(segments, groups, np.int64)
    if not per_logical:  # vLLM's ZeroDivisionError
        return None
    logical_blocks = dst_num_blocks // per_logical
    if ssm is None:
        ssm = worker._ssm_region_indices or range(len(worker.block_len_per_layer))
    ssm_slot = {region: slot for slot, region in enumerate(ssm)}
    num_ssm_descs = len(ssm) * ssm_per_layer
    num_fa_descs = sum(region_counts)
    for group in range(groups):
        group_regions = [r for r, k in zip(regions, keys) if k == group]
        if not len(block_ids[group]) or not group_regions:
            continue
        if group >= len(worker._group_spec_types):  # vLLM's IndexError
            return None
        spec_type = worker._group_spec_types[group]
        if base_worker._is_attention_spec(spec_type):
            for region in group_regions:
                segment = region_segment(group, region)
                if segment is None:
                    return None
                segments.append(segment)
        elif base_worker._is_ssm_spec(spec_type):
            if group == worker._ple_group_index:
                ssm_descs = [(group_regions[0], num_ssm_descs)]
            elif any(region not in ssm_slot for region in group_regions):
                return None  # vLLM's KeyError
            else:
                ssm_descs = [
                    (region, ssm_slot[region] * ssm_per_layer + sub)
                    for region in group_regions
                    for sub in range(ssm_per_layer)
                ]
            segments += [
                Segment(
                    group, region, num_fa_descs + desc * logical_blocks, logical_blocks
                )
                for region, desc in ssm_descs
            ]
        else:  # vLLM raises "Unknown spec type"
            return None
    return _finish(segments, groups, np.int32)


def _integers(values: Any) -> list[int] | None:
    """``values`` as Python ints, or None where one is no integer (numpy
    would convert a float, or raise)."""
    try:
        return [operator.index(value) for value in values]
    except TypeError:
        return None


def _finish(
    segments: list[Segment], groups: int, dtype: type[np.signedinteger[Any]]
) -> PairsLayout:
    """The PairsLayout of these segments: the kernel's array, each count cut
    where an index would leave what NIXL's int32 holds (vLLM's int64 indices
    are cast to it, its int32 ones wrapped), and each key's segments."""
    end = _INT32_END
    cut = [
        segment._replace(
            blocks=max(0, min(segment.blocks, end - segment.first))
            if 0 <= segment.first < end
            else 0
        )
        for segment in segments
    ]
    per_key = [0] * groups
    for segment in segments:
        per_key[segment.group] += 1
    array = np.array(
        [(s.group, s.first if 0 <= s.first < end else 0, s.blocks) for s in cut],
        np.int64,
    ).reshape(len(cut), 3)
    return PairsLayout(
        layout_of(segments, True),
        array,
        None if cut == segments else layout_of(cut, True),
        tuple((key, n) for key, n in enumerate(per_key) if n),
        dtype,
    )


def checked_desc_ids(
    worker: Any, arguments: PairsArguments, base_worker: Any
) -> npt.NDArray[Any] | None:
    """_compute_desc_ids' output, vLLM's for ids in range (None: vLLM's own,
    called by the caller, which fails on these arguments); for a bad id,
    after one log line, an array of vLLM's shape and dtype made of
    REFUSED_INDEX."""
    from .. import _kernels

    found = cached_layout(worker, arguments, base_worker)
    if found is None:  # vLLM fails on these arguments itself: let it
        return None
    block_ids = arguments[0]
    flat = flat_ids(block_ids)
    if flat is not None:
        desc_ids = np.empty(_size(found, flat.lengths), np.int64)
        if (
            _kernels.desc_ids_kernel(flat.ids, flat.starts, found.segments, desc_ids)
            >= 0
        ):
            return desc_ids if found.dtype is np.int64 else desc_ids.astype(np.int32)
    bad = first_bad_id(block_ids, found.layout)
    if bad is None and found.cut is not None:
        bad = first_bad_id(block_ids, found.cut)
        if bad is not None:
            _nixl.log_unaddressable(worker, bad, found.layout.segments)
    elif bad is not None:
        _nixl.log_bad_id(worker, bad)
    size = _size(found, [len(ids) for ids in block_ids])
    if bad is not None:
        return np.full(size, _nixl.REFUSED_INDEX, found.dtype)
    # Every id the call reads is an integer in its region; one it does not
    # read (a group no pair reads), or one of another type (3.0), kept them
    # from one int64 array: the ids it reads, as Python ints.
    read = {key for key, _ in found.per_key}
    flat = flat_ids(
        [
            [int(v) for v in ids] if key in read else []
            for key, ids in enumerate(block_ids)
        ]
    )
    assert flat is not None
    desc_ids = np.empty(size, np.int64)
    written = _kernels.desc_ids_kernel(flat.ids, flat.starts, found.segments, desc_ids)
    assert written == size, "the kernel refused ids first_bad_id accepts"
    return desc_ids if found.dtype is np.int64 else desc_ids.astype(np.int32)


def _size(found: PairsLayout, lengths: Sequence[int]) -> int:
    """The output's length: each key's ids, once per segment of the key."""
    return sum(n * lengths[key] for key, n in found.per_key)
