"""OffloadedLayout: the offloaded side of transfer plans."""

from __future__ import annotations

from typing import Any

from ._layout import OffloadedGeometry, as_int, read_offloaded


class OffloadedLayout:
    """The offloaded side of a transfer: one tensor per device tensor.

    Offloaded tensor t holds the chunks of device tensor t (aligned by
    tensor_idx): chunk c is its row c, which splits into ``blocks_per_chunk``
    sub-blocks of ``row_bytes // blocks_per_chunk`` bytes, one per device block.
    Like PointerTable, it is read once and holds plain integers, not tensors.

    Args:
        tensors: CPU tensors (torch or numpy), or objects with a ``.tensor``.
        blocks_per_chunk: device blocks per offloaded chunk (>= 1).
    """

    def __init__(self, tensors: Any, blocks_per_chunk: int) -> None:
        self.geometries: tuple[OffloadedGeometry, ...] = tuple(
            read_offloaded(tensors, blocks_per_chunk)
        )
        self.blocks_per_chunk: int = as_int(blocks_per_chunk, "blocks_per_chunk")

    def __repr__(self) -> str:
        return (
            f"OffloadedLayout({len(self.geometries)} tensors, "
            f"blocks_per_chunk={self.blocks_per_chunk})"
        )
