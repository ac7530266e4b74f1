"""OffloadedLayout: the offloaded side of transfer plans."""

from __future__ import annotations

from typing import Any, NoReturn

from ._args import as_int
from ._errors import InputTypeError
from ._geometry import MemoryRegion, OffloadedGeometry, read_offloaded


class OffloadedLayout:
    """The offloaded side of a transfer: one tensor per device tensor.

    Offloaded tensor t holds the chunks of device tensor t (aligned by
    tensor_idx): chunk c is its row c, which splits into ``blocks_per_chunk``
    sub-blocks of ``row_bytes // blocks_per_chunk`` bytes, one per device block.
    Like PointerTable, it is read once and holds plain integers, not tensors.
    It cannot be changed: its sub-block sizes were computed for its
    blocks_per_chunk, and tables cache it (build a new one instead).

    Args:
        tensors: CPU tensors (torch or numpy), or objects with a ``.tensor``.
        blocks_per_chunk: device blocks per offloaded chunk (>= 1).
        canonical: whether rows hold canonical pages (vLLM's
            ``canonical_layout``, SPEC 10): plans then follow the refs'
            mappings, and every ref must carry one. A sub-block must hold the
            largest canonical page of the refs on its tensor (checked when a
            table first plans with the layout: the layout knows no refs).
    """

    # __weakref__: ptrres.nixl keeps what it read of a layout by weak reference.
    __slots__ = (
        "__weakref__",
        "blocks_per_chunk",
        "canonical",
        "geometries",
        "memory_regions",
    )

    geometries: tuple[OffloadedGeometry, ...]
    blocks_per_chunk: int
    canonical: bool
    # The allocations the tensors lie in, one region each: what a transfer
    # engine registers (ptrres.nixl.register).
    memory_regions: tuple[MemoryRegion, ...]

    def __init__(
        self, tensors: Any, blocks_per_chunk: int, *, canonical: bool = False
    ) -> None:
        if type(canonical) is not bool:
            raise InputTypeError(f"canonical must be True or False, got {canonical!r}")
        geometries, regions = read_offloaded(tensors, blocks_per_chunk)
        object.__setattr__(self, "geometries", tuple(geometries))
        object.__setattr__(self, "memory_regions", regions)
        object.__setattr__(
            self, "blocks_per_chunk", as_int(blocks_per_chunk, "blocks_per_chunk")
        )
        object.__setattr__(self, "canonical", canonical)

    def __setattr__(self, name: str, value: Any) -> NoReturn:
        raise AttributeError(
            f"OffloadedLayout is read-only (setting {name!r}): build a new one"
        )

    def __delattr__(self, name: str) -> NoReturn:
        raise AttributeError(f"OffloadedLayout is read-only (deleting {name!r})")

    def __repr__(self) -> str:
        return (
            f"OffloadedLayout({len(self.geometries)} tensors, "
            f"blocks_per_chunk={self.blocks_per_chunk}"
            + (", canonical=True)" if self.canonical else ")")
        )
