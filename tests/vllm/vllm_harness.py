"""vLLM's own offloading code (0.30 to 0.33), on CPU tensors with stubbed streams.

The handler is built through its real ``__init__``: its GPU tensors are CPU
tensors of a subclass that reports ``is_cuda``, streams and events are stubs,
and what it submits to ``swap_blocks_batch`` is captured (or executed as
memmoves over the descriptors).

The simple offload path (``vllm/v1/simple_kv_offload``) runs its own
``build_params``, ``copy_blocks`` and backends: the driver function
(``cuda_mem_ops._batch_memcpy``, SPEC 12) is a BatchDriver, which reads back
the three arrays it is handed (and may execute them as memmoves).
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import strategies as st

# Not `import vllm`: without vLLM that finds tests/vllm as a namespace package.
worker = pytest.importorskip("vllm.v1.kv_offload.cpu.gpu_worker")
from vllm.v1.kv_offload.base import (  # noqa: E402
    CanonicalKVCacheRef,
    GPULoadStoreSpec,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec  # noqa: E402

# The simple offload path (modules, untyped: their tests hand them stand-ins).
cuda_mem_ops = pytest.importorskip("vllm.v1.simple_kv_offload.cuda_mem_ops")
copy_backend = pytest.importorskip("vllm.v1.simple_kv_offload.copy_backend")
disk_backend = pytest.importorskip("vllm.v1.simple_kv_offload.disk_backend")


class FakeCudaTensor(torch.Tensor):
    """A CPU tensor that says it is on CUDA (sharing the CPU tensor's storage)."""

    # Plain tensor methods, without __torch_function__'s per-call cost.
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


def fake_cuda(tensor: Any) -> Any:
    return tensor.as_subclass(FakeCudaTensor)


class FakeStream:
    cuda_stream = 0x5EED  # what build_params keeps as the stream handle

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass


class FakeEvent:
    def __init__(self, enable_timing: bool = False) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other: Any) -> float:
        return 0.0


class FakePlatform:
    """The few calls the handler and the backends make on current_platform."""

    Stream = FakeStream

    def __init__(self, xpu: bool = False) -> None:
        self.xpu = xpu

    def set_device(self, device: Any) -> None:
        pass

    def current_stream(self) -> FakeStream:
        return FakeStream()

    @contextlib.contextmanager
    def stream(self, stream: Any) -> Iterator[None]:
        yield

    def is_xpu(self) -> bool:
        return self.xpu

    def is_rocm(self) -> bool:
        return False


@dataclass
class Submitted:
    """What one swap_blocks_batch call received (copied: buffers are pooled)."""

    src: np.ndarray
    dst: np.ndarray
    sizes: np.ndarray


@dataclass
class CopyEngine:
    """Stands in for ops.swap_blocks_batch: records, and optionally copies."""

    memmove: bool = False
    calls: list[Submitted] = field(default_factory=list)

    def __call__(
        self,
        src: Any,
        dst: Any,
        sizes: Any,
        is_src_access_order_any: bool = False,
    ) -> None:
        assert src.dtype == dst.dtype == sizes.dtype
        assert src.dtype in (torch.int64, torch.uint64)
        call = Submitted(src.numpy().copy(), dst.numpy().copy(), sizes.numpy().copy())
        self.calls.append(call)
        if self.memmove:
            for s, d, n in zip(call.src, call.dst, call.sizes):
                ctypes.memmove(int(d), int(s), int(n))


@contextlib.contextmanager
def stubbed_vllm(
    copy: Callable[..., None] | None = None, *, xpu: bool = False
) -> Iterator[Any]:
    """Streams, events and pinned memory stubbed; ops.swap_blocks_batch = copy.

    With ``xpu``, the platform says XPU, so vLLM's buffers are uint64.
    """
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(worker, "current_platform", FakePlatform(xpu))
        mp.setattr(worker, "PIN_MEMORY", False)
        mp.setattr(torch, "Event", FakeEvent)
        mp.setattr(worker.ops, "swap_blocks_batch", copy or CopyEngine())
        yield mp


@dataclass(frozen=True)
class Layout:
    """A direct KV layout: GPU and CPU tensors, refs per group, bpc."""

    gpu_tensors: list[Any]
    cpu_tensors: list[Any]
    refs: list[list[Any]]
    blocks_per_chunk: int

    @property
    def num_gpu_blocks(self) -> int:
        return int(min(t.shape[0] for t in self.gpu_tensors))

    @property
    def num_cpu_chunks(self) -> int:
        return int(min(t.shape[0] for t in self.cpu_tensors))

    def handler(self, gpu_to_cpu: bool) -> Any:
        """vLLM's own handler, through its real __init__ (stubs in place)."""
        return worker.SingleDirectionOffloadingHandler(
            gpu_tensors=list(self.gpu_tensors),
            cpu_tensors=list(self.cpu_tensors),
            blocks_per_chunk=self.blocks_per_chunk,
            layer_refs_per_group=self.refs,
            gpu_to_cpu=gpu_to_cpu,
        )


def padded_rows(num_rows: int, row_bytes: int, pad: int) -> Any:
    """An int8 (num_rows, row_bytes) view with row stride row_bytes + pad."""
    base = torch.zeros((num_rows, row_bytes + pad), dtype=torch.int8)
    return base[:, :row_bytes]


def make_layout(
    gpu_rows: Sequence[tuple[int, int, int]],
    refs: Sequence[Sequence[tuple[int, int]]],
    blocks_per_chunk: int,
    num_cpu_chunks: int,
    cpu_pad: int = 0,
) -> Layout:
    """gpu_rows: (num_blocks, row_bytes, pad) per tensor; refs: (tensor, page)."""
    gpu = [fake_cuda(padded_rows(n, row, pad)) for n, row, pad in gpu_rows]
    cpu = [
        padded_rows(num_cpu_chunks, row * blocks_per_chunk, cpu_pad)
        for _, row, _ in gpu_rows
    ]
    return Layout(
        gpu,
        cpu,
        [[CanonicalKVCacheRef(t, page) for t, page in group] for group in refs],
        blocks_per_chunk,
    )


def chunks_of(
    group_sizes: Sequence[int], block_indices: Sequence[int], bpc: int
) -> int:
    """How many CPU chunk ids a transfer of these groups takes."""
    return sum(
        -(-(n + index % bpc) // bpc)
        for n, index in zip(group_sizes, block_indices)
        if n
    )


def draw_ids(
    draw: Any, num_groups: int, num_blocks: int, num_cpu_chunks: int, bpc: int
) -> tuple[list[int], list[int], list[int], list[int]]:
    """A transfer's ids, drawn: (block ids, group sizes, block indices, CPU
    chunk ids), as many chunk ids as the groups take."""
    group_sizes = [draw(st.integers(0, 6)) for _ in range(num_groups)]
    block_indices = [draw(st.integers(0, 20)) for _ in range(num_groups)]
    n_ids = sum(group_sizes)
    block_ids = draw(
        st.lists(st.integers(0, num_blocks - 1), min_size=n_ids, max_size=n_ids)
    )
    n_chunks = chunks_of(group_sizes, block_indices, bpc)
    cpu_ids = draw(
        st.lists(
            st.integers(0, num_cpu_chunks - 1), min_size=n_chunks, max_size=n_chunks
        )
    )
    return block_ids, group_sizes, block_indices, cpu_ids


def specs(
    block_ids: Sequence[int],
    group_sizes: Sequence[int],
    block_indices: Sequence[int],
    cpu_ids: Sequence[int],
    *,
    gpu_to_cpu: bool,
    dtype: Any = np.int32,
) -> tuple[Any, Any]:
    """(src_spec, dst_spec) as vLLM's offloading connector passes them."""
    gpu = GPULoadStoreSpec(list(block_ids), list(group_sizes), list(block_indices))
    cpu = CPULoadStoreSpec(list(cpu_ids))
    gpu.block_ids = gpu.block_ids.astype(dtype)
    cpu.block_ids = cpu.block_ids.astype(dtype)
    return (gpu, cpu) if gpu_to_cpu else (cpu, gpu)


# --- the simple offload path (SimpleCPUOffloadConnector) ----------------------


@dataclass(frozen=True)
class DriverCall:
    """One call of the batch-memcpy driver: the three arrays, read back from
    the addresses it was handed, and its other arguments."""

    src: np.ndarray
    dst: np.ndarray
    sizes: np.ndarray
    # (attrs address, numAttrs, stream handle): what else identifies a call.
    others: tuple[int, int, int]


@dataclass
class BatchDriver:
    """Stands in for cuMemcpyBatchAsync, as ``cuda_mem_ops._batch_memcpy =
    (driver, 1)``: records what each call describes, executes it as memmoves
    with ``memmove``, and returns ``status`` (0: success)."""

    memmove: bool = False
    status: int = 0
    calls: list[DriverCall] = field(default_factory=list)

    def __call__(
        self,
        dsts: int,
        srcs: int,
        sizes: int,
        count: int,
        attrs: int,
        attr_idxs: Any,
        num_attrs: int,
        fail_idx: Any,
        stream: int,
    ) -> int:
        def read(address: int) -> np.ndarray:
            entries = (ctypes.c_uint64 * count).from_address(address)
            return np.frombuffer(bytes(entries), np.uint64)

        call = DriverCall(
            read(srcs), read(dsts), read(sizes), (attrs, num_attrs, stream)
        )
        self.calls.append(call)
        if self.memmove:
            for s, d, n in zip(call.src, call.dst, call.sizes):
                ctypes.memmove(int(d), int(s), int(n))
        return self.status


@contextlib.contextmanager
def stubbed_simple(
    driver: Callable[..., int] | None = None, *, max_batch: int = 0
) -> Iterator[Any]:
    """The driver function stood in for by ``driver`` (a new BatchDriver by
    default), ``max_batch`` descriptors per call (0: one call), platform,
    events and pinning stubbed; yields the driver."""
    driver = BatchDriver() if driver is None else driver
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cuda_mem_ops, "_batch_memcpy", (driver, 1))
        mp.setattr(cuda_mem_ops, "_max_batch_descriptors", max_batch)
        for backend in (copy_backend, disk_backend):
            mp.setattr(backend, "current_platform", FakePlatform())
        mp.setattr(disk_backend, "pin_tensor", lambda tensor: None)
        mp.setattr(torch, "Event", FakeEvent)
        yield driver


def simple_caches(
    num_blocks: int, block_bytes: Sequence[int], seed: int = 0
) -> dict[str, Any]:
    """One int8 (num_blocks, bpb) tensor per layer, named as vLLM's worker
    names its regions (the same names on both sides of a copy), filled with
    bytes that differ from block to block (and with ``seed``)."""
    caches = {}
    for layer, bpb in enumerate(block_bytes):
        values = torch.arange(num_blocks * bpb, dtype=torch.int64) * 7 + layer * 131
        caches[f"layer.{layer}"] = (
            ((values + seed * 37) % 251 - 125).to(torch.int8).view(num_blocks, bpb)
        )
    return caches
