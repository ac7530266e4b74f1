"""vLLM's NIXL connector (prefill/decode disaggregation), 0.30 to 0.33: every
block id that ``_compute_desc_ids`` turns into an index, checked on both sides.

vLLM's ``NixlConnector`` (``kv_connector/v1/nixl/``) prepares one NIXL
descriptor per block per region (a region is one layer's cache), region
after region, and per transfer turns both sides' block ids into indices
into those lists: ``NixlBaseConnectorWorker._compute_desc_ids``, called by
the pull worker's ``_read_blocks`` (READ, the default) and the push worker's
``_xfer_blocks`` (WRITE), once for the remote side and once for the local
side. It checks no id: NIXL checks an index only against the whole list, so
an id past its region's count reads another layer's KV and completes without
an error, and an id of 2**31 or more raises from numpy outside the ``try``
that would fail the request (SPEC 14).

Patched, ``_compute_desc_ids`` checks each id against the block count of
every region it indexes, with vLLM's own scaling (``block_size_ratio`` on the
local side, logical blocks for SSM regions, scratch regions), following each
release's own branches. On in-range ids its output is vLLM's, element for
element and dtype: built by one compiled kernel (desc_ids_kernel) where the
regions are plain attention regions (one group, region-group mapping,
layer-name routing), and by vLLM's own method after the check where the model
has Mamba state. A bad id logs one line (side, engine, request, group,
position, value, the region's count) and makes indices NIXL refuses
(REFUSED_INDEX): ``make_prepped_xfer`` then raises inside vLLM's own ``try``,
and the request fails the way vLLM fails any transfer it cannot set up
(``transfer_setup_failed``: reported failed, its blocks invalidated or
reclaimed), with no byte moved; the connector goes on with the next request.

``_read_blocks`` and ``_xfer_blocks`` are wrapped only to say, for the log,
which request and engines a transfer is between. The wrapper, the worker's
``__init__`` and the log lines serve vLLM 0.34's patch too
(``ptrres.vllm._nixl_pairs``). ``ptrres.vllm`` decides
what to replace and when (``PTRRES_VLLM_NIXL=0`` leaves this path alone);
this module reads vLLM only through the objects it is given.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import numpy.typing as npt

from ._nixl_regions import (
    Arguments,
    BadId,
    CompiledLayout,
    Segment,
    all_in_range,
    compiled_layout,
    first_bad_id,
    flat_ids,
    in_range,
)
from ._state import reporter

# What a bad id's indices become: past the end of any prepared list (NIXL's
# indices are C ints, and a list holds fewer than 2**31 - 1 descriptors), so
# that NIXL refuses them, as numpy refuses them as indices into any smaller
# array; it fits the int32 of vLLM's Mamba branches.
REFUSED_INDEX = 2**31 - 1


@dataclass(frozen=True)
class NixlPatch:
    """What the patched methods need: vLLM's module and originals, and
    ptrres.vllm's switches."""

    # vLLM's nixl/base_worker module: its _is_attention_spec and _is_ssm_spec.
    base_worker: ModuleType
    vllm_compute_desc_ids: Callable[..., Any]
    # Whether ptrres.vllm is patched (workers ignore the patch once not).
    active: Callable[[], bool]
    # Build the indices with the compiled kernel (else: check, then vLLM's).
    compiled: bool = True


class Transfer(threading.local):
    """The transfer this thread is setting up (the wrapped _read_blocks or
    _xfer_blocks): which request, which engines, and how many of its two
    _compute_desc_ids calls (remote, then local) have run."""

    request_id: Any = None
    remote_engine: Any = None
    calls = 0


_transfer = Transfer()


def patched_init(
    vllm_init: Callable[..., None], prepare: Callable[[], None]
) -> Callable[..., None]:
    """The worker's __init__: vLLM's own, then every kernel made ready
    (``prepare``: loaded from Numba's cache, or compiled) and the index
    kernel called once, so that no transfer waits for either."""

    @functools.wraps(vllm_init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        vllm_init(self, *args, **kwargs)
        try:
            prepare()
            from .. import _kernels

            empty = np.zeros(0, np.int64)
            _kernels.desc_ids_kernel(
                empty, np.zeros(1, np.int64), np.zeros((0, 3), np.int64), empty.copy()
            )
        except Exception:  # a plugin never takes vLLM down: kernels compile later
            reporter().warning(
                "ptrres: could not make the kernels ready for vLLM's NIXL "
                "connector; they compile on its first transfer",
                exc_info=True,
            )

    return __init__


def patched_functions(
    patch: NixlPatch,
) -> tuple[Callable[..., Any], Callable[[Callable[..., Any]], Callable[..., Any]]]:
    """The patched _compute_desc_ids, and the wrapper of _read_blocks and
    _xfer_blocks (given each one's original), each showing vLLM's signature."""
    original = patch.vllm_compute_desc_ids

    @functools.wraps(original)
    def _compute_desc_ids(
        self: Any,
        block_ids: Any,
        dst_num_blocks: int,
        block_size_ratio: float | None,
        physical_blocks_per_logical: int,
        region_num_blocks: Sequence[int] | None = None,
        region_group_ids: Sequence[int] | None = None,
        uses_region_group_mapping: bool | None = None,
    ) -> Any:
        """vLLM's _compute_desc_ids, every id checked (ptrres)."""
        arguments: Arguments = (
            block_ids, dst_num_blocks, block_size_ratio, physical_blocks_per_logical,
            region_num_blocks, region_group_ids, uses_region_group_mapping,
        )  # fmt: skip
        _transfer.calls += 1
        if not patch.active():
            return original(self, *arguments)
        try:
            checked = checked_desc_ids(self, arguments, patch)
        except Exception:  # a plugin never takes vLLM down: vLLM's own, then
            warn_once(
                "ptrres: could not check this NIXL transfer's block ids; vLLM "
                "builds its descriptor ids unchecked"
            )
            return original(self, *arguments)
        return original(self, *arguments) if checked is None else checked

    return _compute_desc_ids, wrap_transfer


def wrap_transfer(transfer_method: Callable[..., Any]) -> Callable[..., Any]:
    """_read_blocks or _xfer_blocks: vLLM's, with the transfer named for the
    log (both take request_id and dst_engine_id; vLLM passes them by
    keyword). The same in every release 0.30 to 0.34."""
    names = list(inspect.signature(transfer_method).parameters)[1:]  # past self
    request_at, engine_at = names.index("request_id"), names.index("dst_engine_id")

    @functools.wraps(transfer_method)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        request = kwargs.get("request_id")
        if request is None and request_at < len(args):
            request = args[request_at]
        engine = kwargs.get("dst_engine_id")
        if engine is None and engine_at < len(args):
            engine = args[engine_at]
        _transfer.request_id, _transfer.remote_engine = request, engine
        _transfer.calls = 0
        try:
            return transfer_method(self, *args, **kwargs)
        finally:
            _transfer.request_id = _transfer.remote_engine = None

    return method


def checked_desc_ids(
    worker: Any, arguments: Arguments, patch: NixlPatch
) -> npt.NDArray[Any] | None:
    """_compute_desc_ids' output for ids in range (None: vLLM's own, called
    by the caller), or, for a bad id, after one log line, vLLM's output made
    of REFUSED_INDEX."""
    from .. import _kernels

    found = compiled_layout(worker, arguments, patch.base_worker)
    if found is None:  # vLLM fails on this input itself: let it
        return None
    block_ids = arguments[0]
    flat = flat_ids(block_ids)
    if isinstance(found, CompiledLayout):
        layout = found.layout
        if flat is not None and patch.compiled:
            ids, starts, lengths = flat
            n = found.all_groups * len(ids) + sum(
                m * k for m, k in zip(found.per_group, lengths)
            )
            desc_ids = np.empty(n, np.int64)
            if _kernels.desc_ids_kernel(ids, starts, found.segments, desc_ids) >= 0:
                return desc_ids
        elif flat is not None and all_in_range(flat, layout):
            return None
    else:
        layout = found
        if flat is not None and all_in_range(flat, layout):
            return None
    bad = first_bad_id(block_ids, layout)
    if bad is None:  # pragma: no cover (the fast checks and this disagree)
        return None
    log_bad_id(worker, bad)
    # vLLM's own shape and dtype (on ids numpy's int32 takes), every index one
    # NIXL refuses.
    sane = [[v if in_range(v, 2**31) else 0 for v in ids] for ids in block_ids]
    refused: npt.NDArray[Any] = patch.vllm_compute_desc_ids(
        worker, sane, *arguments[1:]
    )
    refused[...] = REFUSED_INDEX
    return refused


# The warnings already given, so that each is given once.
_warned: set[str] = set()


def warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        reporter().warning(message, exc_info=True)


def transfer_side(worker: Any) -> tuple[str, Any]:
    """Which side of which engine this _compute_desc_ids call is for, in the
    transfer this thread sets up: ("?", "?") outside one."""
    if _transfer.request_id is None:  # called outside a transfer
        return "?", "?"
    if _transfer.calls == 1:  # vLLM computes the remote side's first
        return "remote", _transfer.remote_engine
    return "local", getattr(worker, "engine_id", "?")


def log_bad_id(worker: Any, bad: BadId) -> None:
    """One WARNING line: side, engine, request, group, position, value, and
    the region's count."""
    side, engine = transfer_side(worker)
    reporter().warning(
        "ptrres: NIXL transfer of request %s: %s block id %r (engine %s, group %d, "
        "position %d) is out of range for region %d, of %d blocks; the request "
        "fails in vLLM's transfer setup, and no block moves",
        _transfer.request_id, side, bad.value, engine, bad.group, bad.position,
        bad.segment.region, bad.segment.blocks,
    )  # fmt: skip


def log_unaddressable(worker: Any, bad: BadId, segments: Sequence[Segment]) -> None:
    """One WARNING line for an id in its region whose index NIXL's C int
    cannot hold (the regions' block counts add up past it)."""
    side, engine = transfer_side(worker)
    segment = next(
        s for s in segments if (s.group, s.region, s.first) == bad.segment[:3]
    )
    reporter().warning(
        "ptrres: NIXL transfer of request %s: %s block id %r (engine %s, group %d, "
        "position %d) would be descriptor %d of region %d, which NIXL's int32 "
        "indices cannot hold; the request fails in vLLM's transfer setup, and "
        "no block moves",
        _transfer.request_id, side, bad.value, engine, bad.group,
        bad.position, segment.first + bad.value, segment.region,
    )  # fmt: skip
