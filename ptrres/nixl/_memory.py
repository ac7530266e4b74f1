"""Where NIXL's descriptors point: memory types, and registration (SPEC 14).

Memory names one side's memory as NIXL does (DRAM, VRAM with its device,
FILE); memory_of() reads it off a layout; register() and register_files()
register what a layout or a set of files holds with an agent.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any, NamedTuple

from .._args import as_int
from .._errors import InputTypeError, LayoutError
from .._geometry import HOST
from .._offloaded import OffloadedLayout
from .._peer import PeerLayout
from .._table import PointerTable


class Memory(NamedTuple):
    """Where one side's descriptors point, as NIXL names it."""

    # "DRAM" (host memory), "VRAM" (GPU memory) or "FILE".
    mem_type: str
    # The device: 0 for DRAM, the GPU for VRAM, a file's descriptor for FILE.
    dev_id: int


# Host memory: NIXL's DRAM, device 0.
DRAM = Memory("DRAM", 0)


def vram(device: int) -> Memory:
    """The memory of CUDA device ``device``, as NIXL names it."""
    index = as_int(device, "device")
    if index < 0:
        raise LayoutError(f"a GPU's device index is >= 0, got {index}")
    return Memory("VRAM", index)


# What names one side's memory: a Memory, or a layout whose memory is all on
# one device (memory_of).
MemoryLike = Memory | PointerTable | OffloadedLayout | PeerLayout


def memory_of(layout: MemoryLike) -> Memory:
    """The memory of a table's, an offloaded layout's or a peer layout's
    tensors: DRAM for host memory, VRAM of their CUDA device. (A Memory is
    returned as it is.)

    Raises:
        LayoutError: tensors on several devices, or on a device NIXL has no
            name for here (pass a Memory instead).
    """
    if isinstance(layout, Memory):
        return layout
    try:
        return _memories[layout]  # layouts are read-only: their memory too
    except (KeyError, TypeError):  # not known yet, or not a layout
        pass
    if isinstance(layout, PeerLayout):
        devices = {ref.device for group in layout.groups for ref in group}
    elif isinstance(layout, (PointerTable, OffloadedLayout)):
        devices = {region.device for region in layout.memory_regions}
    else:
        raise InputTypeError(
            "memory must be a Memory, a PointerTable, an OffloadedLayout or a "
            f"PeerLayout, got {type(layout).__name__}"
        )
    if len(devices) > 1 or None in devices:
        raise LayoutError(
            f"{type(layout).__name__}'s tensors are on devices "
            f"{sorted(devices, key=str)} (-1: host, None: unknown): NIXL takes "
            "one memory per side; pass a ptrres.nixl.Memory"
        )
    memory = _memory(devices.pop() if devices else HOST)
    _memories[layout] = memory
    return memory


# The memory of each layout memory_of() has read (a set over its refs or
# regions: microseconds on a hot path that asks for it every transfer).
_memories: weakref.WeakKeyDictionary[Any, Memory] = weakref.WeakKeyDictionary()


def _memory(device: int | None) -> Memory:
    """NIXL's memory of a MemoryRegion's device."""
    if device is None:
        raise LayoutError(
            "a tensor's device is unknown (neither host memory nor CUDA): "
            "NIXL cannot register it"
        )
    return DRAM if device == HOST else Memory("VRAM", device)


class Registration:
    """Memory and files register() and register_files() registered with an
    agent: ``deregister()``, or leaving its ``with`` block, deregisters them.

    Attributes:
        agent: the agent they are registered with.
        regions: what was registered, as ``(address, nbytes, Memory)``;
            for a file, ``(0, 0, Memory("FILE", fd))``.
    """

    def __init__(
        self,
        agent: Any,
        descs: list[Any],
        regions: tuple[tuple[int, int, Memory], ...],
        backends: list[str],
    ) -> None:
        self.agent = agent
        self.regions = regions
        self._descs = descs
        self._backends = backends

    def deregister(self) -> None:
        """Deregister everything (once: later calls do nothing)."""
        descs, self._descs = self._descs, []
        for reg_descs in reversed(descs):
            self.agent.deregister_memory(reg_descs, backends=list(self._backends))

    def __enter__(self) -> Registration:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.deregister()

    def __repr__(self) -> str:
        state = "registered" if self._descs else "deregistered"
        return f"Registration({len(self.regions)} regions, {state})"


def register(
    agent: Any,
    *layouts: PointerTable | OffloadedLayout,
    backends: Iterable[str] = (),
) -> Registration:
    """Register with ``agent`` every allocation the layouts' tensors lie in,
    one region each: DRAM for host memory, VRAM with the device for CUDA
    tensors. Regions of several layouts that overlap are registered once.
    (A peer learns what an agent registered from its metadata: register
    before ``get_agent_metadata()``, or send the metadata again.)

    Args:
        agent: a ``nixl_agent``.
        layouts: PointerTables and OffloadedLayouts of this process (a peer
            registers its own memory).
        backends: the backends to register with (default: every backend of
            the agent that takes the memory type).

    Returns:
        A Registration (a context manager) that deregisters them.

    Raises:
        LayoutError: a tensor on a device NIXL has no name for here.
    """
    spans: dict[Memory, list[tuple[int, int]]] = {}
    for layout in layouts:
        if not isinstance(layout, (PointerTable, OffloadedLayout)):
            raise InputTypeError(
                "register() takes PointerTables and OffloadedLayouts, got "
                f"{type(layout).__name__}"
            )
        for region in layout.memory_regions:
            spans.setdefault(_memory(region.device), []).append(
                (region.address, region.address + region.nbytes)
            )
    regions = [
        (start, end - start, memory)
        for memory, memory_spans in spans.items()
        for start, end in _merged(memory_spans)
    ]
    return _register(agent, regions, backends)


def register_files(
    agent: Any, fds: Iterable[int], *, backends: Iterable[str] = ()
) -> Registration:
    """Register open files (their descriptors) with ``agent`` as FILE
    memory, for file_xfer_descs() transfers on the POSIX or GDS backends."""
    regions = [
        (0, 0, Memory("FILE", as_int(fd, "fds[{}]", i))) for i, fd in enumerate(fds)
    ]
    return _register(agent, regions, backends)


def _register(
    agent: Any, regions: list[tuple[int, int, Memory]], backends: Iterable[str]
) -> Registration:
    """register_memory() once per memory type; on a failure, undo what was
    done and raise."""
    names = list(backends)
    registration = Registration(agent, [], tuple(regions), names)
    rows: dict[str, list[tuple[int, int, int, str]]] = {}
    for address, nbytes, memory in regions:
        rows.setdefault(memory.mem_type, []).append(
            (address, nbytes, memory.dev_id, "")
        )
    try:
        for mem_type, type_rows in rows.items():
            registration._descs.append(
                agent.register_memory(type_rows, mem_type, backends=list(names))
            )
    except BaseException:
        registration.deregister()
        raise
    return registration


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """[start, end) spans with the overlapping ones merged, in order."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if merged and start < merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged
