"""The file tier, side by side (issue 13).

1. plan_file_ops against vLLM PR #56076's Python op building
   (`ptrres bench --operation files`), geometric mean over llama-3.1-8b,
   llama-3.1-70b-tp4 and hybrid-4x12 at 16 and 256 blocks.
2. write_files/read_files throughput against a plain loop of one os.pwrite
   (os.preadv of one buffer on load) per op, into the page cache: a 128 MiB
   transfer of real CPU tensors (32 refs of 16 KiB pages, 256 blocks, 16
   blocks per file) to files in a temporary directory, deleted after.

    PYTHONPATH=. python benchmarks/file_tier.py
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

import ptrres
from ptrres._posix import _host_bytes
from ptrres.bench import PRESETS, bench_cell, geometric_mean

PAGE = 16 * 1024
REFS = 32
BLOCKS = 256
BPC = 16
ROUNDS = 5


def planning() -> None:
    speedups = []
    for name in ("llama-3.1-8b", "llama-3.1-70b-tp4", "hybrid-4x12"):
        for blocks in (16, 256):
            row = bench_cell(
                PRESETS[name], "files", blocks, seconds=0.6, with_fill=False
            )
            speedups.append(row.speedup)
            print(
                f"{name:<18} {blocks:>4} blocks {row.ops:>6} ops: PR worker "
                f"{row.reference_seconds * 1e6:9.1f} us, ptrres "
                f"{row.ptrres_seconds * 1e6:7.1f} us, {row.speedup:6.1f}x"
            )
    print(f"plan_file_ops: geometric mean {geometric_mean(speedups):.1f}x\n")


def pwrite_loop(plan: ptrres.FilePlan, paths: list[Path], write: bool) -> None:
    """One os.pwrite (or a one-buffer os.preadv) per op, file by file."""
    for f, path in enumerate(paths):
        flags = (os.O_WRONLY | os.O_CREAT) if write else os.O_RDONLY
        fd = os.open(path, flags, 0o644)
        try:
            for i in range(plan.file_starts[f], plan.file_starts[f + 1]):
                buffer = _host_bytes(int(plan.dev_ptrs[i]), int(plan.sizes[i]))
                offset = int(plan.file_offsets[i])
                if write:
                    os.pwrite(fd, buffer, offset)
                else:
                    os.preadv(fd, [buffer], offset)
        finally:
            os.close(fd)


def executor() -> None:
    import torch

    tensors = [torch.randint(0, 256, (BLOCKS * 2, PAGE), dtype=torch.uint8)]
    tensors += [torch.empty_like(tensors[0]) for _ in range(REFS - 1)]
    for t in tensors[1:]:
        t.copy_(tensors[0])
    kv = ptrres.CanonicalKVCaches(
        [ptrres.CanonicalKVCacheTensor(t, PAGE) for t in tensors],
        [[ptrres.CanonicalKVCacheRef(d, PAGE) for d in range(REFS)]],
    )
    ids = np.random.default_rng(0).permutation(BLOCKS * 2)[:BLOCKS]
    spec = ptrres.GPULoadStoreSpec(ids, [BLOCKS], [0])
    plan = ptrres.PointerTable(kv).plan_file_ops(spec, BPC)
    mib = plan.num_bytes / 2**20
    print(
        f"executor: {plan.num_files} files, {len(plan.sizes)} ops of {PAGE} B, "
        f"{mib:.0f} MiB, page cache (files rewritten in place)"
    )
    contenders: dict[str, Any] = {
        "pwrite loop (1 call per op)": lambda p: pwrite_loop(plan, p, True),
        "write_files max_workers=1": lambda p: ptrres.write_files(
            plan, p, max_workers=1
        ),
        "write_files max_workers=None": lambda p: ptrres.write_files(plan, p),
        "preadv loop (1 call per op)": lambda p: pwrite_loop(plan, p, False),
        "read_files max_workers=1": lambda p: ptrres.read_files(plan, p, max_workers=1),
        "read_files max_workers=None": lambda p: ptrres.read_files(plan, p),
    }
    times: dict[str, list[float]] = {name: [] for name in contenders}
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        paths = [Path(tmp) / f"chunk{f}" for f in range(plan.num_files)]
        ptrres.write_files(plan, paths)  # create the files, warm the cache
        for _ in range(ROUNDS):
            for name, run in contenders.items():
                start = time.perf_counter()
                run(paths)
                times[name].append(time.perf_counter() - start)
    for name, samples in times.items():
        seconds = float(np.median(samples))
        print(
            f"  {name:<30} {seconds * 1e3:7.1f} ms  {mib / 1024 / seconds:5.2f} GiB/s"
        )


if __name__ == "__main__":
    ptrres.warmup()
    planning()
    executor()
