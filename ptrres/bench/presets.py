"""Model-shaped KV-cache layouts, over tensors that are never allocated.

Layouts are built from VirtualTensor: objects that answer the tensor calls
ptrres makes (data_ptr, stride, element_size, shape) for memory that is never
allocated. Pointer math does not touch the memory, so a 70B model's layout
costs nothing here. PRESETS are direct layouts (SPEC 8), CANONICAL_PRESETS
canonical ones (SPEC 10); make_spec and make_offloaded_ids make the ids of a
transfer on them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from .._types import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    CanonicalPageMapping,
    CopyRun,
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
class CanonicalPreset:
    """One rank's canonical mapping of a model: every layer one ref, one tensor.

    Each page maps to its canonical page through one run of ``num_fragments``
    fragments of ``fragment_size`` bytes, ``canonical_stride`` apart there.
    """

    name: str
    description: str
    num_layers: int
    # Bytes of the rank's page, and of the canonical page.
    local_page: int
    canonical_page: int
    # The rank's one run: (local_offset, canonical_offset, fragment_size,
    # num_fragments, local_stride, canonical_stride).
    run: tuple[int, int, int, int, int, int]
    num_writers: int
    writer_index: int
    # The direction timed: stores show writer rotation, loads keep every block.
    store: bool

    def kv_caches(self, num_blocks: int = 32768) -> CanonicalKVCaches:
        mapping = CanonicalPageMapping(
            self.canonical_page,
            self.local_page,
            (CopyRun(*self.run),),
            self.num_writers,
            self.writer_index,
            True,
        )
        tensors = [
            CanonicalKVCacheTensor(
                VirtualTensor(
                    VIRTUAL_BASE + layer * VIRTUAL_ALIGN, num_blocks, self.local_page
                ),
                self.local_page,
            )
            for layer in range(self.num_layers)
        ]
        refs = [
            CanonicalKVCacheRef(layer, self.local_page, mapping)
            for layer in range(self.num_layers)
        ]
        return CanonicalKVCaches(tensors, [refs])

    def offloaded_tensors(
        self, blocks_per_chunk: int, num_chunks: int = 8192
    ) -> list[VirtualTensor]:
        """Canonical offloaded tensors: rows of bpc canonical pages."""
        row = blocks_per_chunk * self.canonical_page
        stride = -(-(num_chunks * row) // VIRTUAL_ALIGN) * VIRTUAL_ALIGN
        return [
            VirtualTensor(VIRTUAL_BASE // 2 + layer * stride, num_chunks, row)
            for layer in range(self.num_layers)
        ]


def _nhd_row(kv_heads: int, head_dim: int = 128) -> int:
    """Bytes of one token of a packed NHD page: K and V of each head, bf16."""
    return kv_heads * 2 * head_dim * 2


CANONICAL_PRESETS: dict[str, CanonicalPreset] = {
    p.name: p
    for p in [
        CanonicalPreset(
            "llama-3.1-70b-tp4-nhd",
            "80 layers, packed NHD, TP=4 rank 1 (2 of 8 heads): a fragment "
            "per token, 16 per block; a load",
            80,
            16 * _nhd_row(2),
            16 * _nhd_row(8),
            (0, _nhd_row(2), _nhd_row(2), 16, _nhd_row(2), 4 * _nhd_row(2)),
            1,
            0,
            store=False,
        ),
        CanonicalPreset(
            "deepseek-v3-mla-tp8",
            "61 layers, MLA replicated over TP=8: one whole-page run, rank 3 "
            "of 8 writes every 8th page; a store",
            61,
            16 * 576 * 2,
            16 * 576 * 2,
            (0, 0, 16 * 576 * 2, 1, 16 * 576 * 2, 16 * 576 * 2),
            8,
            3,
            store=True,
        ),
    ]
}


# make_spec needs only the number of groups of a layout.
_ONE_GROUP = Preset("one-group", "", (1,), 1)
