"""write_files() and read_files(): a POSIX executor for FilePlans (host memory).

The POSIX worker of vLLM PR #56076 stores host (CPU, pinned) pages in files
with one system call per op. Here each file is one task in a thread pool, and
each run of ops that follow each other in the file is one ``os.pwritev`` or
``os.preadv`` over the pages (at most IOV_MAX at a time), which releases the
GIL. Device memory needs a GPU-aware engine (cuFile, kvikio, NIXL): see
docs/file-tier.md for how a FilePlan maps onto them.
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import numpy.typing as npt

from ._args import as_int, as_list, attributes, descriptor_array
from ._errors import InputTypeError, SpecError

# The most buffers one pwritev/preadv takes (1024 on Linux).
IOV_MAX: int = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
# Files are created readable by all, writable by their owner (less the umask).
FILE_MODE = 0o644
_PLAN_FIELDS = ("dev_ptrs", "file_offsets", "sizes", "file_starts")


def write_files(
    plan: Any, paths: Sequence[Any], *, max_workers: int | None = None
) -> None:
    """Store a FilePlan: copy every op's host bytes to its file and offset.

    Files are opened with O_CREAT and without O_TRUNC (mode 0o644 less the
    umask): bytes no op covers, such as the slots before a partial first
    chunk, keep what the file held. Nothing is written outside ``paths``.

    Publishing a file atomically is the caller's job: write to a temporary
    name in the same directory, then ``os.replace`` it to its final name (and
    fsync where durability matters). A file holds one chunk that other
    workers and processes read by name (its offload key), so a reader must
    never see a file that is half written, or that a failed store left
    partial; only the caller knows the final name, whether it already exists
    (another writer got there first) and when the chunk counts as stored.

    Args:
        plan: a FilePlan (any object with dev_ptrs, file_offsets, sizes and
            file_starts) whose pointers are host memory: CPU tensors, pinned
            buffers. A device pointer would crash the process.
        paths: one path (str or os.PathLike) per file of the plan.
        max_workers: threads writing files in parallel (one task per file);
            None lets ThreadPoolExecutor choose, 1 writes in this thread.

    Raises:
        SpecError: not one path per file, or a malformed plan.
        OSError: a file could not be opened or written (it names the file and
            the offset where a write stopped making progress).
    """
    _run(plan, paths, max_workers, write=True)


def read_files(
    plan: Any, paths: Sequence[Any], *, max_workers: int | None = None
) -> None:
    """Load a FilePlan: copy every op's bytes from its file into host memory.

    Args:
        plan, paths, max_workers: as for write_files().

    Raises:
        FileNotFoundError: a file does not exist.
        OSError: a file ends before an op's bytes (it names the file and the
            offset), or could not be read.
        SpecError: not one path per file, or a malformed plan.
    """
    _run(plan, paths, max_workers, write=False)


def _run(plan: Any, paths: Any, max_workers: Any, *, write: bool) -> None:
    """Check the plan and the paths, then transfer each file as one task."""
    raw_ptrs, raw_offsets, raw_sizes, raw_starts = attributes(
        plan, _PLAN_FIELDS, "plan"
    )
    ptrs = descriptor_array(raw_ptrs, "plan.dev_ptrs")
    offsets = descriptor_array(raw_offsets, "plan.file_offsets")
    sizes = descriptor_array(raw_sizes, "plan.sizes")
    if not len(ptrs) == len(offsets) == len(sizes):
        raise SpecError(
            f"plan has {len(ptrs)} dev_ptrs, {len(offsets)} file_offsets and "
            f"{len(sizes)} sizes"
        )
    starts = checked_file_starts(raw_starts, len(sizes))
    ends = offsets.astype(np.float64) + sizes.astype(np.float64)
    if len(ends) and ends.max() > 2.0**63 - 4096:  # beyond any file (off_t)
        op = int(np.argmax(ends > 2.0**63 - 4096))
        raise SpecError(
            f"op {op}: {int(sizes[op])} B at offset {int(offsets[op])} ends "
            "beyond the largest file offset"
        )
    files = [_path(path, f) for f, path in enumerate(as_list(paths, "paths"))]
    n_files = len(starts) - 1
    if len(files) != n_files:
        raise SpecError(
            f"the plan has {n_files} files but {len(files)} paths were given"
        )
    workers = None if max_workers is None else as_int(max_workers, "max_workers")
    if workers is not None and workers < 1:
        raise SpecError(f"max_workers must be >= 1, got {workers}")
    tasks = [(files[f], int(starts[f]), int(starts[f + 1])) for f in range(n_files)]

    def transfer(task: tuple[str, int, int]) -> None:
        path, first, end = task
        _transfer_file(
            path,
            ptrs[first:end].tolist(),
            offsets[first:end].tolist(),
            sizes[first:end].tolist(),
            write=write,
        )

    if workers == 1 or n_files <= 1:
        for task in tasks:
            transfer(task)
        return
    with ThreadPoolExecutor(
        max_workers=workers, thread_name_prefix="ptrres-io"
    ) as pool:
        # list(): wait for every file, raising the first failure in file order.
        list(pool.map(transfer, tasks))


def checked_file_starts(values: Any, n_ops: int) -> npt.NDArray[np.int64]:
    """A plan's file_starts: from 0 to the number of ops, never decreasing."""
    if not isinstance(values, np.ndarray) or values.dtype.kind not in "iu":
        raise InputTypeError(
            f"plan.file_starts must be an integer numpy array, got {values!r}"
        )
    starts = values.astype(np.int64)
    if (
        starts.ndim != 1
        or len(starts) == 0
        or starts[0] != 0
        or starts[-1] != n_ops
        or (np.diff(starts) < 0).any()
    ):
        raise SpecError(
            f"plan.file_starts must rise from 0 to the number of ops ({n_ops}), "
            f"got {values}"
        )
    return starts


def _path(path: Any, f: int) -> str:
    try:
        name = os.fspath(path)
    except TypeError:
        raise InputTypeError(
            f"paths[{f}] must be a str or an os.PathLike, got {type(path).__name__}"
        ) from None
    return os.fsdecode(name)


def _transfer_file(
    path: str, ptrs: list[int], offsets: list[int], sizes: list[int], *, write: bool
) -> None:
    """One file's ops: one vectored call per run of ops that follow each other."""
    flags = (os.O_WRONLY | os.O_CREAT) if write else os.O_RDONLY
    fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0), FILE_MODE)
    try:
        n = len(sizes)
        i = 0
        while i < n:
            end = offsets[i] + sizes[i]
            j = i + 1
            while j < n and j - i < IOV_MAX and offsets[j] == end:
                end += sizes[j]
                j += 1
            buffers = [_host_bytes(ptrs[k], sizes[k]) for k in range(i, j) if sizes[k]]
            if buffers:
                _vectored(fd, path, buffers, offsets[i], write)
            i = j
    finally:
        os.close(fd)


def _host_bytes(ptr: int, size: int) -> memoryview:
    """The ``size`` bytes of host memory at ``ptr``, as a writable buffer."""
    return memoryview((ctypes.c_ubyte * size).from_address(ptr)).cast("B")


def _vectored(
    fd: int, path: str, buffers: list[memoryview], offset: int, write: bool
) -> None:
    """pwritev/preadv all of ``buffers`` at ``offset``, resuming partial calls.

    POSIX lets a call move fewer bytes than asked (a signal, a full pipe, the
    end of a file on read): the rest is asked for again, and only a call that
    moves nothing is an error.
    """
    first = 0  # buffers[first:] are still to move
    while first < len(buffers):
        pending = buffers[first : first + IOV_MAX]
        done = (
            os.pwritev(fd, pending, offset) if write else os.preadv(fd, pending, offset)
        )
        if done == 0:
            raise OSError(
                errno.EIO,
                f"short {'write to' if write else 'read from'} {path} at offset "
                f"{offset}: "
                + ("no byte was written" if write else "the file ends there"),
                path,
            )
        offset += done
        while first < len(buffers) and done >= len(buffers[first]):
            done -= len(buffers[first])
            first += 1
        if done:
            buffers[first] = buffers[first][done:]
