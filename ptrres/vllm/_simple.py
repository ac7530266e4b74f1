"""vLLM's simple CPU offload path, checked and compiled: ``build_params`` and
``copy_blocks`` of ``vllm/v1/simple_kv_offload/cuda_mem_ops.py`` (0.30-0.33).

vLLM's ``SimpleCPUOffloadConnector`` submits every copy of its DMA backend
(``copy_backend``) and of its disk backend (``disk_backend``, one block per
call) through ``copy_blocks(src_block_ids, dst_block_ids, params)``: numpy
broadcasts of ``base + id * bpb`` per layer, layer-major, handed to
``cuMemcpyBatchAsync`` (``hipMemcpyBatchAsync`` on ROCm) in chunks of
``_resolve_max_batch_descriptors()``. No id is checked.

Patched (SPEC 12), ``build_params`` runs vLLM's own and returns its params
carrying a CopyPlan: the layers' bases and bytes per block (vLLM's own
values), each side's block count, and buffers reused by every call. The
patched ``copy_blocks`` fills them with one kernel that checks every id on
both sides (a bad one raises CopyBlockIdError before anything reaches the
driver) and submits exactly as vLLM does: the module's own ``_batch_memcpy``,
the same chunks, the same arguments, the same error. Optionally (coalesce)
consecutive blocks merge into one descriptor per run and layer.

``ptrres.vllm._patching`` decides what to replace and when; this module reads
vLLM only through the objects it is given, and imports the kernels (and so
numba) only when the first params are built.
"""

from __future__ import annotations

import array
import ctypes
import functools
import operator
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import numpy.typing as npt

from .._errors import BlockIdError, InputTypeError, SpecError

# Lists of ids up to this long convert through np.asarray (the fastest for
# them); longer ones through array.array, about twice as fast as numpy's
# discovery of their type, and as strict: every item an int of int64.
_SHORT_LIST = 16
_INT64 = np.dtype(np.int64)
# The attribute of the params (a BatchMemcpyParams) that holds its CopyPlan.
PLAN_ATTRIBUTE = "_ptrres_copy_plan"
# A side without tensors addresses nothing: no id is out of its range.
_NO_LIMIT = np.iinfo(np.int64).max
# Blocks per call the buffers hold at first (they grow as calls need).
_FIRST_CAPACITY = 16
# cuMemcpyBatchAsync reads the descriptors as arrays of 8-byte entries.
_ENTRY_BYTES = 8


class CopyBlockIdError(BlockIdError):
    """A block id of ``copy_blocks`` outside its side's tensors.

    Attributes:
        side: "src" or "dst".
        position: the id's position in its list.
        value: the id itself.
        group: always 0 (the simple path has one group of layers).
    """

    def __init__(self, message: str, *, side: str, position: int, value: int):
        super().__init__(message, group=0, position=position, value=value)
        self.side = side


@dataclass(frozen=True)
class SimplePatch:
    """What the patched functions need: vLLM's module and originals, and
    ptrres.vllm's switches."""

    # vllm.v1.simple_kv_offload.cuda_mem_ops: its _batch_memcpy (the driver
    # function, read at every call) and _resolve_max_batch_descriptors().
    mem_ops: ModuleType
    vllm_build_params: Callable[..., Any]
    vllm_copy_blocks: Callable[..., None]
    # Whether ptrres.vllm is patched: params built before keep vLLM's copies,
    # and so do all params once it is unpatched.
    active: Callable[[], bool]
    # Makes every kernel ready (ptrres.warmup()): the first params pay for it.
    prepare: Callable[[], None]
    # Whether runs of consecutive blocks merge (PTRRES_VLLM_COALESCE=1).
    coalesce: Callable[[], bool]
    # Says why params keep vLLM's own copies (a warning).
    decline: Callable[[BaseException], None]


class CopyPlan:
    """One params' ptrres state: its layers, each side's block count, and the
    descriptor buffers every call of these params reuses.

    Calls with the same params (from any thread) take turns on ``lock``,
    held from the fill to the driver's return: no two calls share a buffer.
    """

    def __init__(
        self,
        params: Any,
        src_tensors: dict[str, Any],
        dst_tensors: dict[str, Any],
        *,
        coalesce: bool,
    ) -> None:
        # numba and the kernels: the first params pay for them.
        from .. import _kernels
        from .._kernels import copy_blocks as columns

        # vLLM's own bases and bytes per block, so that the bytes are its,
        # and each layer's tensors' blocks (vLLM zips the two dicts' values).
        self.layers = np.empty((len(params.bpb), columns.COPY_COLUMNS), np.int64)
        for column, values in (
            (columns.SRC_BASE, params.src_bases),
            (columns.DST_BASE, params.dst_bases),
            (columns.BLOCK_BYTES, params.bpb),
        ):
            self.layers[:, column] = np.asarray(values, np.uint64).view(np.int64)
        for column, tensors in (
            (columns.SRC_BLOCKS, src_tensors),
            (columns.DST_BLOCKS, dst_tensors),
        ):
            self.layers[:, column] = [_num_blocks(t) for t in tensors.values()]
        # An id must be a block of every tensor of its side.
        self.src_limit = _Limit.of("src", src_tensors)
        self.dst_limit = _Limit.of("dst", dst_tensors)
        self.coalesce = coalesce
        self.lock = threading.Lock()
        self._kernels = _kernels
        # The driver's pointer arguments, as vLLM passes them (made once).
        self.attrs_address = ctypes.addressof(params.attrs)
        self.attrs_index = ctypes.byref(params.attrs_idx)
        self.fail_index = ctypes.byref(params.fail_idx)
        self._grow(_FIRST_CAPACITY)

    def _grow(self, blocks: int) -> None:
        """Buffers for calls of up to ``blocks`` id pairs."""
        length = max(blocks * len(self.layers), 1)
        self.capacity = blocks
        # Rows: src, dst, sizes (the kernels' SRC_ROW, DST_ROW, SIZE_ROW).
        self.out = np.empty((3, length), np.uint64)
        self.runs = np.empty((3, max(blocks, 1)), np.int64)
        # The rows' addresses: the driver gets address + 8 * offset.
        first = self.out.ctypes.data
        row_bytes = length * _ENTRY_BYTES
        self.addresses = (first, first + row_bytes, first + 2 * row_bytes)

    def fill(
        self, src_ids: npt.NDArray[np.int64], dst_ids: npt.NDArray[np.int64]
    ) -> int:
        """Build the descriptors of one call into the buffers (hold ``lock``);
        return how many there are.

        Raises:
            CopyBlockIdError: an id out of range on either side (the first).
        """
        if len(src_ids) > self.capacity:
            self._grow(max(len(src_ids), 2 * self.capacity))
        kernels = self._kernels
        if self.coalesce:
            written = kernels.copy_block_runs_kernel(
                self.layers, src_ids, dst_ids, kernels.NO_CAP, self.runs, self.out
            )
        else:
            written = kernels.copy_blocks_kernel(
                self.layers, src_ids, dst_ids, self.out
            )
        if written < 0:
            raise self._error(int(written), src_ids, dst_ids)
        return int(written)

    def rehearse(self) -> None:
        """Fill no descriptor, as a call would: the first call of a kernel
        with given argument types costs Numba some typing, paid here."""
        empty = np.zeros(0, np.int64)
        self.fill(empty, empty.copy())

    def _error(
        self,
        status: int,
        src_ids: npt.NDArray[np.int64],
        dst_ids: npt.NDArray[np.int64],
    ) -> Exception:
        """The error of a kernel's negative status: the first bad id."""
        if status == self._kernels.BAD_BLOCK_ID:
            for position in range(len(src_ids)):
                for ids, limit in (
                    (src_ids, self.src_limit),
                    (dst_ids, self.dst_limit),
                ):
                    if not 0 <= ids[position] < limit.blocks:
                        return limit.error(position, int(ids[position]))
        return RuntimeError(  # pragma: no cover (our own buffers cannot)
            f"ptrres: copy_blocks' kernel failed with status {status}"
        )


@dataclass(frozen=True)
class _Limit:
    """The block count an id of one side must stay under, and whose it is."""

    side: str
    blocks: int
    # The name (vLLM's cache key) of a tensor with that many blocks, and
    # whether the side's tensors have other counts.
    smallest: str
    uneven: bool

    @classmethod
    def of(cls, side: str, tensors: dict[str, Any]) -> _Limit:
        counts = {name: _num_blocks(tensor) for name, tensor in tensors.items()}
        if not counts:
            return cls(side, _NO_LIMIT, "", False)
        smallest = min(counts, key=counts.__getitem__)
        return cls(side, counts[smallest], smallest, len(set(counts.values())) > 1)

    def error(self, position: int, value: int) -> CopyBlockIdError:
        which = f" ({self.smallest!r} has the fewest)" if self.uneven else ""
        return CopyBlockIdError(
            f"copy_blocks, {self.side} position {position}: block id {value} is "
            f"out of range for the {self.side} tensors, of {self.blocks} "
            f"blocks{which}",
            side=self.side,
            position=position,
            value=value,
        )


def _num_blocks(tensor: Any) -> int:
    """A tensor's blocks: its first dimension (vLLM's regions are
    (num_blocks, block_bytes))."""
    shape = tuple(tensor.shape)
    if not shape:
        raise ValueError(f"a 0-dimensional tensor has no blocks: {tensor!r}")
    return int(shape[0])


def block_ids_array(block_ids: Any, side: str, limit: _Limit) -> npt.NDArray[np.int64]:
    """One side's ids (vLLM passes lists of ints) as a contiguous int64 array.

    Raises:
        InputTypeError: ids that are not integers, or not a flat list.
        CopyBlockIdError: an integer beyond int64 (no tensor has that block).
    """
    if type(block_ids) is list:
        if len(block_ids) > _SHORT_LIST:
            try:
                return np.frombuffer(array.array("q", block_ids), np.int64)
            except (TypeError, OverflowError):  # not all ints of int64
                return _python_ints(block_ids, side, limit)
        ids = np.asarray(block_ids)
        if ids.dtype is _INT64 and ids.ndim == 1:  # then contiguous
            return ids
    else:
        ids = np.asarray(block_ids)
        if ids.dtype is _INT64 and ids.ndim == 1:
            return ids if ids.flags.c_contiguous else np.ascontiguousarray(ids)
    if ids.ndim != 1:
        raise InputTypeError(
            f"copy_blocks: the {side} block ids must be a flat list of ints, "
            f"not of shape {ids.shape}"
        )
    if ids.dtype.kind == "u" and len(ids) and ids.max() > _NO_LIMIT:
        position = int(np.argmax(ids > _NO_LIMIT))
        raise limit.error(position, int(ids[position]))
    if ids.dtype.kind in "iu":
        return ids.astype(np.int64)
    if isinstance(block_ids, np.ndarray) and ids.dtype != object:
        raise InputTypeError(
            f"copy_blocks: the {side} block ids must be integers, not {ids.dtype}"
        )
    # A list numpy made floats or objects of: ints of mixed types (uint64 and
    # signed), ints beyond int64, or not ints.
    return _python_ints(block_ids, side, limit)


def _python_ints(ids: Iterable[Any], side: str, limit: _Limit) -> npt.NDArray[np.int64]:
    """Ids one by one: each must be an integer (of any type: Python's, numpy's;
    a bool is one, as in Python)."""
    values = []
    for position, block_id in enumerate(ids):
        try:
            value = operator.index(block_id)
        except TypeError:
            raise InputTypeError(
                f"copy_blocks: {side} position {position} is not an integer: "
                f"{block_id!r}"
            ) from None
        if not -_NO_LIMIT - 1 <= value <= _NO_LIMIT:
            raise limit.error(position, value)
        values.append(value)
    return np.array(values, np.int64)


def patched_functions(
    patch: SimplePatch,
) -> tuple[Callable[..., Any], Callable[..., None]]:
    """The patched build_params and copy_blocks, each showing vLLM's
    signature."""
    params_class = _params_class_for(patch)

    @functools.wraps(patch.vllm_build_params)
    def build_params(
        src_caches: Any, dst_caches: Any, stream: Any, *args: Any, **kwargs: Any
    ) -> Any:
        """vLLM's build_params; its params then carry their CopyPlan."""
        params = patch.vllm_build_params(
            src_caches, dst_caches, stream, *args, **kwargs
        )
        if not patch.active():  # unpatched since: vLLM's params alone
            return params
        try:
            patch.prepare()
            plan = CopyPlan(
                params,
                dict(src_caches),
                dict(dst_caches),
                coalesce=patch.coalesce(),
            )
            plan.rehearse()
        except Exception as error:  # a plugin never takes vLLM down
            patch.decline(error)
            return params
        ours = params_class(*params)
        setattr(ours, PLAN_ATTRIBUTE, plan)
        return ours

    mem_ops = patch.mem_ops
    vllm_copy_blocks = patch.vllm_copy_blocks
    active = patch.active

    @functools.wraps(vllm_copy_blocks)
    def copy_blocks(src_block_ids: Any, dst_block_ids: Any, params: Any) -> None:
        """vLLM's copy_blocks: its descriptors built by ptrres, checked."""
        plan: CopyPlan | None = getattr(params, PLAN_ATTRIBUTE, None)
        if plan is None or not active():
            return vllm_copy_blocks(src_block_ids, dst_block_ids, params)
        n = len(src_block_ids)
        if n != len(dst_block_ids):
            raise SpecError(
                f"copy_blocks: {n} src block ids but {len(dst_block_ids)} dst "
                "block ids: each src block copies to one dst block"
            )
        if n == 0:
            return None
        # From here on, as vLLM's copy_blocks: the driver function it resolved.
        batch_memcpy = mem_ops._batch_memcpy
        if batch_memcpy is None:
            raise AssertionError("build_params() must run before copy_blocks()")
        fn = batch_memcpy[0]
        src_ids = block_ids_array(src_block_ids, "src", plan.src_limit)
        dst_ids = block_ids_array(dst_block_ids, "dst", plan.dst_limit)
        with plan.lock:
            total = plan.fill(src_ids, dst_ids)
            src, dst, sizes = plan.addresses
            max_desc = mem_ops._resolve_max_batch_descriptors()
            step = total if max_desc <= 0 else max_desc
            for off in range(0, total, step):
                cnt = min(step, total - off)
                offset = off * _ENTRY_BYTES
                err = fn(
                    dst + offset,
                    src + offset,
                    sizes + offset,
                    cnt,
                    plan.attrs_address,
                    plan.attrs_index,
                    params.num_attrs,
                    plan.fail_index,
                    params.stream_handle,
                )
                if err != 0:
                    failed = params.fail_idx.value
                    raise RuntimeError(
                        f"batch memcpy failed: err={err} failIdx={failed}"
                    )
        return None

    return build_params, copy_blocks


# The params class of each vLLM BatchMemcpyParams class: a subclass whose
# instances can carry their CopyPlan (vLLM's is a NamedTuple, without a
# __dict__). Everything vLLM reads of its params reads the same.
_PARAMS_CLASSES: dict[type, type] = {}


def _params_class_for(patch: SimplePatch) -> type:
    vllm_class: type = patch.mem_ops.BatchMemcpyParams
    ours = _PARAMS_CLASSES.get(vllm_class)
    if ours is None:
        ours = type(
            vllm_class.__name__,
            (vllm_class,),
            {
                "__doc__": f"vLLM's {vllm_class.__name__}, with ptrres's "
                "CopyPlan (attribute _ptrres_copy_plan).",
                "__module__": __name__,
            },
        )
        _PARAMS_CLASSES[vllm_class] = ours
    return ours
