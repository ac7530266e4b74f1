"""FilePlans moved by a real NIXL agent's POSIX backend (SPEC 11, 14).

file_xfer_descs of plan_file_ops' plans (plain and coalesced, ref-major and
block-major, a partial first chunk) WRITE host KV caches into files that
must be byte-identical to the files ptrres.write_files writes, every byte
of them (the files are pre-filled, so that bytes no op covers compare too);
READ back into zeroed caches, they must leave the bytes ptrres.read_files
leaves, guard zones included.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from nixl_harness import DESIGNS, Caches, assert_same_bytes, new_agent, wait_for

import ptrres
import ptrres.nixl

BLOCKS_PER_CHUNK = 4
# Bytes after the last op of each file: the files are longer than the ops.
TAIL = 48
# Per group: its block ids (distinct: a READ writes each block once) and its
# skip (group 0's and group 2's first chunks are partial).
GROUP_IDS = ([3, 4, 5, 6, 9, 0], [2, 7], [11, 10, 9, 8, 1])
SKIPS = [1, 0, 3]


@pytest.fixture(scope="module")
def agent() -> Any:
    """An agent of the POSIX backend, its own transfers' remote agent."""
    return new_agent("files", "POSIX")


def spec() -> ptrres.GPULoadStoreSpec:
    return ptrres.GPULoadStoreSpec(
        np.array([i for ids in GROUP_IDS for i in ids], np.int64),
        [len(ids) for ids in GROUP_IDS],
        SKIPS,
    )


def pre_filled_files(directory: Path, plan: ptrres.FilePlan) -> list[Path]:
    """One file per file of the plan, TAIL bytes longer than its ops reach,
    filled with a pattern of its own."""
    directory.mkdir()
    paths = []
    ends = plan.file_offsets + plan.sizes
    for f in range(plan.num_files):
        first, end = int(plan.file_starts[f]), int(plan.file_starts[f + 1])
        size = int(ends[first:end].max()) + TAIL
        path = directory / f"chunk{f}"
        path.write_bytes(
            ((np.arange(size) * 7 + 13 * f) % 251).astype(np.uint8).tobytes()
        )
        paths.append(path)
    return paths


def run(agent: Any, descs: ptrres.nixl.XferDescs, op: str) -> None:
    """One NIXL transfer between memory and files (the agent is both ends)."""
    handle = descs.initialize_xfer(agent, op, agent.name)
    try:
        wait_for(agent, handle)
    finally:
        handle.release()


@pytest.mark.parametrize("coalesce", [False, True], ids=["plain", "coalesced"])
@pytest.mark.parametrize("file_layout", ["ref-major", "block-major"])
@pytest.mark.parametrize("library", ["numpy", "torch"])
def test_nixl_files_are_ptrres_files(
    agent: Any, tmp_path: Path, library: str, file_layout: str, coalesce: bool
) -> None:
    design = DESIGNS[f"{library} hybrid"][0]
    source = Caches(design)
    before = source.snapshot()
    plan = source.table.plan_file_ops(
        spec(), BLOCKS_PER_CHUNK, layout=file_layout, coalesce=coalesce
    )
    nixl_paths = pre_filled_files(tmp_path / "nixl", plan)
    ptrres_paths = pre_filled_files(tmp_path / "ptrres", plan)
    ptrres.write_files(plan, ptrres_paths)

    # Loaded into zeroed caches of the same design: through NIXL, and by
    # read_files from write_files' files.
    nixl_loaded, ptrres_loaded = Caches(design), Caches(design)
    nixl_loaded.zero()
    ptrres_loaded.zero()
    plans = [
        caches.table.plan_file_ops(
            spec(), BLOCKS_PER_CHUNK, layout=file_layout, coalesce=coalesce
        )
        for caches in (nixl_loaded, ptrres_loaded)
    ]
    ptrres.read_files(plans[1], ptrres_paths)

    fds = [os.open(path, os.O_RDWR) for path in nixl_paths]
    try:
        with (
            ptrres.nixl.register(agent, source.table, nixl_loaded.table),
            ptrres.nixl.register_files(agent, fds),
        ):
            run(
                agent,
                ptrres.nixl.file_xfer_descs(plan, fds, memory=source.table),
                "WRITE",
            )
            files = [path.read_bytes() for path in nixl_paths]
            expected = [path.read_bytes() for path in ptrres_paths]
            assert_same_bytes(files, expected, "the files NIXL wrote")
            descs = ptrres.nixl.file_xfer_descs(plans[0], fds, memory=nixl_loaded.table)
            run(agent, descs, "READ")
    finally:
        for fd in fds:
            os.close(fd)
    assert_same_bytes(source.snapshot(), before, "the source caches")
    assert_same_bytes(
        nixl_loaded.snapshot(), ptrres_loaded.snapshot(), "the caches NIXL read into"
    )
    assert any(any(buffer) for buffer in nixl_loaded.snapshot()), "nothing was read"
