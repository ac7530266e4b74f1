"""Issue-12 speed targets: vLLM 0.33's transfer_async, patched by ptrres or not.

End-to-end CPU time of ``SingleDirectionOffloadingHandler.transfer_async``,
vLLM's own against ptrres.vllm's, on the same handler, in one process, in
interleaved rounds. The handler is vLLM's, built through its real __init__ on
CPU tensors (the device side a tensor subclass that reports is_cuda); streams
and events are stubs and the copy is skipped (``_swap_blocks_batch`` does
nothing), so what is timed is vLLM's Python and the descriptor fill: what a
vLLM worker spends on the CPU per store or load.

Tensors are real but their rows are small (each page divided by ROW_SCALE):
vLLM and ptrres only do pointer arithmetic here, whose cost does not depend on
the page size, and 2048-block transfers of 160 layers then fit in 30 MiB.

Run: python benchmarks/vllm_transfer.py [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from vllm.v1.kv_offload.base import CanonicalKVCacheRef, GPULoadStoreSpec
from vllm.v1.kv_offload.cpu import gpu_worker as worker
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

import ptrres.vllm as plugin
from ptrres.bench import PRESETS, geometric_mean, make_offloaded_ids, make_spec

LAYOUTS = ["llama-3.1-8b", "llama-3.1-70b-tp4", "hybrid-4x12"]
BLOCKS = [1, 16, 256, 2048]
BLOCKS_PER_CHUNK = 4
NUM_GPU_BLOCKS = 4096
NUM_CPU_CHUNKS = 4096
# Pages are this many times smaller than the model's (64 KiB -> 64 B).
ROW_SCALE = 1024


class FakeCudaTensor(torch.Tensor):
    """A CPU tensor that reports is_cuda, with plain (untraced) tensor methods."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


class FakeStream:
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

    def elapsed_time(self, other: Any) -> float:
        return 0.0


class FakePlatform:
    Stream = FakeStream

    def current_stream(self) -> FakeStream:
        return FakeStream()

    @contextlib.contextmanager
    def stream(self, stream: Any) -> Iterator[None]:
        yield

    def is_xpu(self) -> bool:
        return False

    def is_rocm(self) -> bool:
        return False


def skip_copy(*args: Any, **kwargs: Any) -> None:
    """The copy engine, skipped: only the CPU work is timed."""


def stub_vllm() -> None:
    worker.current_platform = FakePlatform()
    worker.PIN_MEMORY = False
    torch.Event = FakeEvent  # type: ignore[misc]


def handler_for(name: str, gpu_to_cpu: bool) -> Any:
    """vLLM's handler for a preset's layout, on small real tensors."""
    kv = PRESETS[name].kv_caches(num_blocks=1)
    gpu, cpu = [], []
    for entry in kv.tensors:
        row = max(8, entry.tensor.shape[1] // ROW_SCALE)
        gpu.append(
            torch.zeros((NUM_GPU_BLOCKS, row), dtype=torch.int8).as_subclass(
                FakeCudaTensor
            )
        )
        cpu.append(
            torch.zeros((NUM_CPU_CHUNKS, row * BLOCKS_PER_CHUNK), dtype=torch.int8)
        )
    refs = [
        [
            CanonicalKVCacheRef(r.tensor_idx, max(8, r.page_size_bytes // ROW_SCALE))
            for r in group
        ]
        for group in kv.group_data_refs
    ]
    handler = worker.SingleDirectionOffloadingHandler(
        gpu_tensors=gpu,
        cpu_tensors=cpu,
        blocks_per_chunk=BLOCKS_PER_CHUNK,
        layer_refs_per_group=refs,
        gpu_to_cpu=gpu_to_cpu,
    )
    handler._swap_blocks_batch = skip_copy
    return handler


def vllm_specs(name: str, blocks: int, gpu_to_cpu: bool) -> tuple[Any, Any]:
    """(src_spec, dst_spec) of vLLM's own classes (int32 ids, as vLLM makes)."""
    spec = make_spec(PRESETS[name], blocks, num_blocks=NUM_GPU_BLOCKS)
    chunk_ids = make_offloaded_ids(spec, BLOCKS_PER_CHUNK, num_chunks=NUM_CPU_CHUNKS)
    gpu_spec = GPULoadStoreSpec(
        spec.block_ids.tolist(), list(spec.group_sizes), list(spec.block_indices)
    )
    cpu_spec = CPULoadStoreSpec(chunk_ids.tolist())
    return (gpu_spec, cpu_spec) if gpu_to_cpu else (cpu_spec, gpu_spec)


def time_transfers(
    transfer: Callable[..., bool], handler: Any, specs: tuple[Any, Any], calls: int
) -> float:
    """Seconds per transfer_async call, the pool refilled between calls."""
    total = 0.0
    for job_id in range(calls):
        start = time.perf_counter()
        transfer(handler, job_id, *specs)
        total += time.perf_counter() - start
        handler.get_finished()
    return total / calls


def compare(
    contenders: dict[str, Callable[..., bool]],
    handler: Any,
    specs: tuple[Any, Any],
    *,
    seconds: float,
    rounds: int = 7,
) -> dict[str, float]:
    """Median seconds per call of each contender, in interleaved rounds."""
    batch = seconds / (rounds * len(contenders))
    calls = {}
    for name, transfer in contenders.items():
        per_call = time_transfers(transfer, handler, specs, 3)  # warm up
        calls[name] = max(3, int(batch / max(per_call, 1e-7)))
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(rounds):
        for name, transfer in contenders.items():
            times[name].append(time_transfers(transfer, handler, specs, calls[name]))
    return {name: statistics.median(t) for name, t in times.items()}


def check_same_descriptors(
    vllm_transfer: Callable[..., bool], handler: Any, specs: tuple[Any, Any]
) -> int:
    """Both paths submit the same descriptors (checked before timing them)."""
    submitted: list[tuple[bytes, ...]] = []

    def record(src: Any, dst: Any, sizes: Any, **kwargs: Any) -> None:
        submitted.append(tuple(t.numpy().tobytes() for t in (src, dst, sizes)))

    handler._swap_blocks_batch = record
    vllm_transfer(handler, 0, *specs)
    handler.transfer_async(1, *specs)
    handler.get_finished()
    handler._swap_blocks_batch = skip_copy
    assert submitted[0] == submitted[1], "ptrres's descriptors differ from vLLM's"
    return len(submitted[0][0]) // 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter timings")
    args = parser.parse_args()
    seconds = 0.15 if args.quick else 0.6

    stub_vllm()
    vllm_transfer = worker.SingleDirectionOffloadingHandler.transfer_async
    patched = plugin.patch()
    assert patched, "ptrres.vllm did not patch vLLM"
    ptrres_transfer = worker.SingleDirectionOffloadingHandler.transfer_async
    contenders = {"vllm": vllm_transfer, "ptrres": ptrres_transfer}

    print(
        "| layout | blocks/group | direction | descriptors | vLLM us | ptrres us "
        "| speedup |"
    )
    print("|---|---:|---|---:|---:|---:|---:|")
    speedups = []
    for name in LAYOUTS:
        for gpu_to_cpu in (True, False):
            handler = handler_for(name, gpu_to_cpu)
            for blocks in BLOCKS:
                specs = vllm_specs(name, blocks, gpu_to_cpu)
                descriptors = check_same_descriptors(vllm_transfer, handler, specs)
                timing = compare(contenders, handler, specs, seconds=seconds)
                speedup = timing["vllm"] / timing["ptrres"]
                speedups.append(speedup)
                print(
                    f"| {name} | {blocks} | {'store' if gpu_to_cpu else 'load'} "
                    f"| {descriptors} | {timing['vllm'] * 1e6:.1f} "
                    f"| {timing['ptrres'] * 1e6:.1f} | {speedup:.1f}x |",
                    flush=True,
                )
    plugin.unpatch()
    print(
        f"\ngeometric mean {geometric_mean(speedups):.1f}x (target >= 10x), "
        f"lowest {min(speedups):.1f}x (target >= 3x)"
    )


if __name__ == "__main__":
    main()
