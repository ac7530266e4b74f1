"""The baselines ptrres is timed against: vLLM's numpy code as it stands.

Transcriptions without checks, for honest comparisons: vLLM's resolver and
its direct (0.33) and canonical (0.33's _fill_canonical_ops) descriptor fills,
and the file ops of vLLM PR #56076's FSOffloadingWorker, in plain Python.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from .._groups import iter_pointer_groups


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


def pr_worker_file_ops(
    device_ptrs: Any, blocks_per_chunk: int
) -> list[list[tuple[int, int, int]]]:
    """vLLM PR #56076's FSOffloadingWorker op building, in plain Python.

    Walk iter_pointer_groups and build, per file (one per group and chunk),
    a list of (dev_ptr, size, file_offset) in the ref-major layout, as the
    PR's worker does; with its pitfalls fixed (skips, per-ref pages), so that
    it builds the ops plan_file_ops does. Pointers are read as Python lists
    once per group, the fastest way to walk them from Python.
    """
    bpc = blocks_per_chunk
    files = []
    for info in iter_pointer_groups(device_ptrs, bpc):
        n = info.group_size
        first = info.dev_ptr_offset
        ptrs = device_ptrs.ptrs[first : first + n * info.n_data_refs].tolist()
        pages = [int(device_ptrs.sizes[first + d * n]) for d in range(info.n_data_refs)]
        for chunk in range(info.n_chunks):
            ops = []
            first_k = max(0, chunk * bpc - info.skip)
            end_k = min(n, (chunk + 1) * bpc - info.skip)
            before = 0
            for d, page in enumerate(pages):
                for k in range(first_k, end_k):
                    slot = info.skip + k - chunk * bpc
                    ops.append((ptrs[d * n + k], page, bpc * before + slot * page))
                before += page
            files.append(ops)
    return files


def vllm_canonical_copy_plans(
    kv_caches: Any, store: bool
) -> list[list[tuple[Any, Any, Any, int]]]:
    """vLLM 0.33's per-ref fragment templates (its _build_copy_plan), built
    once, as its handler does at start-up: (src offsets, dst offsets, sizes,
    bytes per block)."""
    plans = []
    for refs in kv_caches.group_data_refs:
        group = []
        for ref in refs:
            local, canonical, sizes = [], [], []
            for run in ref.mapping.runs:
                for i in range(run.num_fragments):
                    local.append(run.local_offset + i * run.local_stride)
                    canonical.append(run.canonical_offset + i * run.canonical_stride)
                    sizes.append(run.fragment_size)
            src, dst = (local, canonical) if store else (canonical, local)
            group.append(
                (
                    np.asarray(src, np.uint64),
                    np.asarray(dst, np.uint64),
                    np.asarray(sizes, np.int64),
                    sum(sizes),
                )
            )
        plans.append(group)
    return plans


def _sub_block_ptrs(
    ids: Any, bpc: int, count: int, skip: int, tensor: Any
) -> npt.NDArray[np.uint64]:
    """vLLM 0.33's compute_sub_block_ptrs (returning its output)."""
    base, stride = tensor.data_ptr(), tensor.stride(0)
    if bpc == 1:
        out: npt.NDArray[np.uint64] = base + ids.astype(np.uint64)[:count] * stride
        return out
    sub = np.arange(bpc, dtype=np.uint64) * (tensor.shape[1] // bpc)
    rows = (base + ids.astype(np.uint64)[:, None] * stride) + sub[None, :]
    flat: npt.NDArray[np.uint64] = rows.ravel()[skip : skip + count]
    return flat


def vllm_style_canonical_plan(
    device_spec: Any,
    kv_caches: Any,
    copy_plans: list[list[tuple[Any, Any, Any, int]]],
    offloaded_tensors: Sequence[Any],
    blocks_per_chunk: int,
    offloaded_ids: Any,
    store: bool,
    out: Sequence[Any],
) -> int:
    """vLLM 0.33's canonical fill (``_fill_canonical_ops`` per group, as
    ``transfer_async`` calls it), into ``out``, without checks.

    Returns:
        The number of descriptors written.
    """
    all_src, all_dst = out[0].view(np.uint64), out[1].view(np.uint64)
    all_sizes = out[2]
    block_ids = device_spec.block_ids
    bpc = blocks_per_chunk
    op = first_id = first_chunk = 0
    for g, (size, index) in enumerate(
        zip(device_spec.group_sizes, device_spec.block_indices)
    ):
        if size == 0:
            continue
        skip = index % bpc
        n_chunks = -(-(size + skip) // bpc)
        ids = block_ids[first_id : first_id + size]
        chunks = offloaded_ids[first_chunk : first_chunk + n_chunks]
        first_id += size
        first_chunk += n_chunks
        for plan, ref in zip(copy_plans[g], kv_caches.group_data_refs[g]):
            src_offsets, dst_offsets, frag_sizes, _ = plan
            n_frags = len(frag_sizes)
            if n_frags == 0:
                continue
            device = kv_caches.tensors[ref.tensor_idx].tensor
            offloaded = offloaded_tensors[ref.tensor_idx]
            device_bases = _sub_block_ptrs(ids, 1, size, 0, device)
            offloaded_bases = _sub_block_ptrs(chunks, bpc, size, skip, offloaded)
            mapping = ref.mapping
            if store and mapping.num_writers > 1:
                page_ids = (chunks[:, None] * bpc + np.arange(bpc)).ravel()
                page_ids = page_ids[skip : skip + size]
                mine = page_ids % mapping.num_writers == mapping.writer_index
                device_bases, offloaded_bases = (
                    device_bases[mine],
                    offloaded_bases[mine],
                )
            src_bases, dst_bases = (
                (device_bases, offloaded_bases)
                if store
                else (offloaded_bases, device_bases)
            )
            n = len(src_bases)
            end = op + n * n_frags
            np.add(
                src_bases[:, None],
                src_offsets[None, :],
                out=all_src[op:end].reshape(n, n_frags),
            )
            np.add(
                dst_bases[:, None],
                dst_offsets[None, :],
                out=all_dst[op:end].reshape(n, n_frags),
            )
            all_sizes[op:end].reshape(n, n_frags)[:] = frag_sizes
            op = end
    return op
