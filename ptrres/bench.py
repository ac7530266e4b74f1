"""Model-shaped layouts and side-by-side timing, for benchmarks and notebooks.

Layouts are built from VirtualTensor: objects that answer the tensor calls
ptrres makes (data_ptr, stride, element_size, shape) for memory that is never
allocated. Pointer math does not touch the memory, so a 70B model's layout
costs nothing here.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from ._types import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
)

KiB = 1024
# Where virtual tensors start: a typical device address, far from zero.
VIRTUAL_BASE = 0x7F00_0000_0000
# Virtual tensors are spaced this far apart, so no two ever overlap.
VIRTUAL_ALIGN = 1 << 32


class VirtualTensor:
    """A (num_blocks, row_bytes) int8 tensor that answers ptrres' calls only.

    Args:
        base_ptr: its data pointer.
        num_blocks: its first dimension.
        row_bytes: bytes per row (its second dimension, as int8).
    """

    def __init__(self, base_ptr: int, num_blocks: int, row_bytes: int) -> None:
        self.base_ptr = base_ptr
        self.shape = (num_blocks, row_bytes)

    def data_ptr(self) -> int:
        return self.base_ptr

    def stride(self, dim: int) -> int:
        return self.shape[1] if dim == 0 else 1

    def element_size(self) -> int:
        return 1

    def __repr__(self) -> str:
        return f"VirtualTensor(0x{self.base_ptr:x}, shape={self.shape})"


@dataclass(frozen=True)
class Preset:
    """A model's KV-cache layout (SPEC section 8): groups, refs, pages."""

    name: str
    description: str
    # Page bytes of each ref, per group: len() is the number of groups.
    group_page_sizes: tuple[int, ...]
    refs_per_group: int
    # True: tensor i holds layer i of every group (hybrid models), its rows as
    # wide as the largest page. False: one tensor per ref.
    shared_tensors: bool = False

    @property
    def num_groups(self) -> int:
        return len(self.group_page_sizes)

    @property
    def num_refs(self) -> int:
        return self.num_groups * self.refs_per_group

    def offloaded_tensors(
        self, blocks_per_chunk: int, num_chunks: int = 8192
    ) -> list[VirtualTensor]:
        """Offloaded tensors aligned with kv_caches(): rows of bpc pages."""
        kv = self.kv_caches(num_blocks=1)
        tensors = []
        address = VIRTUAL_BASE // 2
        for entry in kv.tensors:
            row = blocks_per_chunk * entry.tensor.shape[1]
            tensors.append(VirtualTensor(address, num_chunks, row))
            address += -(-(num_chunks * row) // VIRTUAL_ALIGN) * VIRTUAL_ALIGN
        return tensors

    def kv_caches(self, num_blocks: int = 32768) -> CanonicalKVCaches:
        """The layout over virtual tensors of ``num_blocks`` blocks each."""
        if self.shared_tensors:
            row = max(self.group_page_sizes)
            tensor_rows = [row] * self.refs_per_group
            tensor_of = [list(range(self.refs_per_group))] * self.num_groups
        else:
            tensor_rows = [
                page
                for page in self.group_page_sizes
                for _ in range(self.refs_per_group)
            ]
            tensor_of = [
                list(range(g * self.refs_per_group, (g + 1) * self.refs_per_group))
                for g in range(self.num_groups)
            ]
        tensors = []
        address = VIRTUAL_BASE
        for row in tensor_rows:
            tensors.append(
                CanonicalKVCacheTensor(VirtualTensor(address, num_blocks, row), row)
            )
            size = num_blocks * row
            address += -(-size // VIRTUAL_ALIGN) * VIRTUAL_ALIGN
        return CanonicalKVCaches(
            tensors,
            [
                [CanonicalKVCacheRef(t, page) for t in tensor_of[g]]
                for g, page in enumerate(self.group_page_sizes)
            ],
        )


def _page(kv_heads: int, head_dim: int, block_tokens: int = 16) -> int:
    """Bytes of K and V of one layer for one block, in bf16."""
    return 2 * block_tokens * kv_heads * head_dim * 2


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in [
        Preset("llama-3.1-8b", "32 layers, K+V in one tensor", (_page(8, 128),), 32),
        Preset(
            "llama-3.1-8b-split",
            "32 layers, K and V as separate tensors",
            (_page(8, 128) // 2,),
            64,
        ),
        Preset("llama-3.1-70b", "80 layers, TP=1", (_page(8, 128),), 80),
        Preset(
            "llama-3.1-70b-tp4",
            "80 layers, TP=4, K and V split",
            (_page(2, 128) // 2,),
            160,
        ),
        Preset("qwen2.5-7b", "28 layers, 4 KV heads", (_page(4, 128),), 28),
        Preset(
            "deepseek-v3-mla",
            "61 layers, MLA, 576 values per token",
            (16 * 576 * 2,),
            61,
        ),
        Preset(
            "hybrid-4x12",
            "3 attention groups (32 KiB) + 1 linear-attention group (64 KiB),"
            " tensor i shared by layer i of each group",
            (32 * KiB, 32 * KiB, 32 * KiB, 64 * KiB),
            12,
            shared_tensors=True,
        ),
    ]
}


def make_spec(
    preset: Preset,
    blocks_per_group: int,
    *,
    num_blocks: int = 32768,
    run_length: int = 16,
    block_index: int = 0,
    id_dtype: Any = np.int64,
    seed: int = 0,
) -> GPULoadStoreSpec:
    """A spec of ``blocks_per_group`` ids per group, as an allocator hands out.

    Ids come in runs of up to ``run_length`` consecutive blocks starting at
    random places (what a block pool hands a request after some churn), so
    coalescing has realistic work.
    """
    rng = np.random.default_rng(seed)
    ids = []
    for _ in range(preset.num_groups):
        group: list[int] = []
        while len(group) < blocks_per_group:
            run = min(run_length, blocks_per_group - len(group))
            start = int(rng.integers(0, num_blocks - run))
            group.extend(range(start, start + run))
        ids.extend(group)
    return GPULoadStoreSpec(
        np.array(ids, dtype=id_dtype),
        [blocks_per_group] * preset.num_groups,
        [block_index] * preset.num_groups,
    )


def make_offloaded_ids(
    spec: GPULoadStoreSpec,
    blocks_per_chunk: int,
    *,
    num_chunks: int = 8192,
    seed: int = 1,
) -> npt.NDArray[np.int64]:
    """Chunk ids for a spec: each group's chunks consecutive from a random start."""
    rng = np.random.default_rng(seed)
    ids: list[int] = []
    for n, index in zip(spec.group_sizes, spec.block_indices):
        if n:
            count = -(-(n + index % blocks_per_chunk) // blocks_per_chunk)
            start = int(rng.integers(0, num_chunks - count))
            ids.extend(range(start, start + count))
    return np.array(ids, dtype=np.int64)


@dataclass(frozen=True)
class Timing:
    """Seconds per call of one contender: the median of interleaved rounds."""

    seconds: float
    rounds: tuple[float, ...]


def compare(
    contenders: dict[str, Callable[[], object]],
    *,
    seconds: float = 0.3,
    rounds: int = 7,
) -> dict[str, Timing]:
    """Time several functions side by side, interleaved, in this process.

    Each contender is calibrated to a batch of calls that takes about
    ``seconds / (rounds * len(contenders))``; then the rounds run the batches in
    turn, so that a noisy neighbour slows every contender alike.
    """
    batch_seconds = seconds / (rounds * len(contenders))
    batches = {name: _calibrate(fn, batch_seconds) for name, fn in contenders.items()}
    per_call: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(rounds):
        for name, fn in contenders.items():
            per_call[name].append(_time_batch(fn, batches[name]))
    return {
        name: Timing(statistics.median(times), tuple(times))
        for name, times in per_call.items()
    }


def _calibrate(fn: Callable[[], object], batch_seconds: float) -> int:
    fn()  # warm caches, compile if needed
    n = 1
    while True:
        elapsed = _time_batch(fn, n) * n
        if elapsed >= batch_seconds / 4 or n >= 1 << 20:
            return max(1, int(n * batch_seconds / max(elapsed, 1e-9)))
        n *= 4


def _time_batch(fn: Callable[[], object], n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n


def geometric_mean(values: Sequence[float]) -> float:
    """The geometric mean of positive numbers."""
    return float(np.exp(np.mean(np.log(values))))


def vllm_style_resolve(device_spec: Any, kv_caches: Any) -> tuple[Any, Any]:
    """vLLM's numpy resolver as it stands (no checks), for an honest baseline.

    One vectorised expression per group and ref, reading each tensor's pointer
    and stride per call; stride(0) is bytes only for int8 tensors, as in vLLM.
    """
    block_ids = device_spec.block_ids
    group_sizes = device_spec.group_sizes
    group_data_refs = kv_caches.group_data_refs
    num_ops = sum(n * len(refs) for n, refs in zip(group_sizes, group_data_refs))
    ptrs = np.empty(num_ops, dtype=np.uint64)
    sizes = np.empty(num_ops, dtype=np.uint64)
    first_id = 0
    op = 0
    for n_blocks, refs in zip(group_sizes, group_data_refs):
        if n_blocks == 0:
            continue
        group_ids = block_ids[first_id : first_id + n_blocks].astype(np.uint64)
        for ref in refs:
            tensor = kv_caches.tensors[ref.tensor_idx].tensor
            base_ptr = np.uint64(tensor.data_ptr())
            row_stride = np.uint64(tensor.stride(0))
            ptrs[op : op + n_blocks] = base_ptr + group_ids * row_stride
            sizes[op : op + n_blocks] = ref.page_size_bytes
            op += n_blocks
        first_id += n_blocks
    return ptrs, sizes


def vllm_style_plan(
    device_spec: Any,
    kv_caches: Any,
    offloaded_tensors: Sequence[Any],
    blocks_per_chunk: int,
    offloaded_ids: Any,
    store: bool,
) -> tuple[Any, Any, Any]:
    """vLLM 0.33's numpy descriptor fill (direct layout), without checks.

    Resolve the device side, then for each group, each ref and each side, one
    vectorised expression.
    """
    ptrs, sizes = vllm_style_resolve(device_spec, kv_caches)
    src = np.empty(len(ptrs), dtype=np.uint64)
    dst = np.empty(len(ptrs), dtype=np.uint64)
    op = 0
    first_chunk = 0
    for n_blocks, block_index, refs in zip(
        device_spec.group_sizes, device_spec.block_indices, kv_caches.group_data_refs
    ):
        if n_blocks == 0:
            continue
        skip = block_index % blocks_per_chunk
        n_chunks = -(-(n_blocks + skip) // blocks_per_chunk)
        group_chunks = offloaded_ids[first_chunk : first_chunk + n_chunks]
        first_chunk += n_chunks
        j = skip + np.arange(n_blocks)
        chunk = group_chunks[j // blocks_per_chunk].astype(np.uint64)
        sub_block = (j % blocks_per_chunk).astype(np.uint64)
        for ref in refs:
            cpu = offloaded_tensors[ref.tensor_idx]
            sub_bytes = np.uint64(cpu.shape[1] // blocks_per_chunk)
            cpu_ptrs = (
                np.uint64(cpu.data_ptr())
                + chunk * np.uint64(cpu.stride(0))
                + sub_block * sub_bytes
            )
            if store:
                src[op : op + n_blocks] = ptrs[op : op + n_blocks]
                dst[op : op + n_blocks] = cpu_ptrs
            else:
                src[op : op + n_blocks] = cpu_ptrs
                dst[op : op + n_blocks] = ptrs[op : op + n_blocks]
            op += n_blocks
    return src, dst, sizes


# The operations `ptrres bench` times, each against its numpy reference.
OPERATIONS = ("resolve", "plan", "coalesce")
BENCH_BLOCKS_PER_CHUNK = 4


@dataclass(frozen=True)
class BenchRow:
    """One cell of `ptrres bench`: an operation on a layout at one size."""

    preset: str
    operation: str
    blocks_per_group: int
    # Copy ops of the transfer (descriptors before coalescing).
    ops: int
    # Descriptors ptrres returned (fewer than ops when coalescing merged some).
    descriptors: int
    reference_seconds: float
    ptrres_seconds: float
    # A plain numpy fill of the same output bytes (measured at the largest
    # size only, else None): the physical limit of any implementation.
    fill_seconds: float | None

    @property
    def speedup(self) -> float:
        return self.reference_seconds / self.ptrres_seconds

    @property
    def ns_per_op(self) -> float:
        return self.ptrres_seconds / max(self.ops, 1) * 1e9


def bench_cell(
    preset: Preset,
    operation: str,
    blocks_per_group: int,
    *,
    seconds: float,
    with_fill: bool,
) -> BenchRow:
    """Time one operation of ptrres and of the reference, side by side.

    ptrres writes into preallocated int64 out= buffers (as a server does with
    pinned ones); the reference allocates, as vLLM's numpy code does.
    """
    from . import reference
    from ._coalesce import coalesce
    from ._offloaded import OffloadedLayout
    from ._table import PointerTable

    bpc = BENCH_BLOCKS_PER_CHUNK
    kv = preset.kv_caches()
    table = PointerTable(kv)
    spec = make_spec(preset, blocks_per_group)
    offloaded_tensors = preset.offloaded_tensors(bpc)
    offloaded = OffloadedLayout(offloaded_tensors, bpc)
    chunk_ids = make_offloaded_ids(spec, bpc)
    n_ops = blocks_per_group * preset.num_refs
    out = (
        np.empty(n_ops, np.int64),
        np.empty(n_ops, np.int64),
        np.empty(n_ops, np.int64),
    )

    def fill(n_outputs: int) -> None:
        for buffer in out[:n_outputs]:
            buffer.fill(1)

    contenders: dict[str, Callable[[], object]]
    if operation == "resolve":
        contenders = {
            "reference": lambda: reference.resolve_device_pointers(spec, kv),
            "ptrres": lambda: table.resolve(spec, out=out[:2]),
        }
        n_outputs = 2
        descriptors = n_ops
    elif operation == "plan":
        contenders = {
            "reference": lambda: reference.plan_transfer(
                spec, kv, offloaded_tensors, bpc, chunk_ids, store=True
            ),
            "ptrres": lambda: table.plan_transfer(
                spec, offloaded, chunk_ids, store=True, out=out
            ),
        }
        n_outputs = 3
        descriptors = n_ops
    elif operation == "coalesce":
        plan = table.plan_transfer(spec, offloaded, chunk_ids, store=True)
        contenders = {
            "reference": lambda: reference.coalesce(plan.src, plan.dst, plan.sizes),
            "ptrres": lambda: coalesce(plan.src, plan.dst, plan.sizes, out=out),
        }
        n_outputs = 3
        descriptors = len(coalesce(plan.src, plan.dst, plan.sizes).sizes)
    else:
        raise ValueError(f"unknown operation {operation!r}; one of {OPERATIONS}")
    if with_fill:
        contenders["fill"] = lambda: fill(n_outputs)
    timings = compare(contenders, seconds=seconds, rounds=5)
    return BenchRow(
        preset=preset.name,
        operation=operation,
        blocks_per_group=blocks_per_group,
        ops=n_ops,
        descriptors=descriptors,
        reference_seconds=timings["reference"].seconds,
        ptrres_seconds=timings["ptrres"].seconds,
        fill_seconds=timings["fill"].seconds if with_fill else None,
    )
