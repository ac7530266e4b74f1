"""Errors raised on bad input.

Every error is a ValueError or a TypeError, so callers that already catch
those keep working, and also a PtrresError, to catch ptrres' errors alone.
A failed call leaves the library as it was: the next call works.
"""

from __future__ import annotations


class PtrresError(Exception):
    """Base class of the errors ptrres raises on bad input."""


class LayoutError(PtrresError, ValueError):
    """The KV-cache (or offloaded) layout is inconsistent."""


class SpecError(PtrresError, ValueError):
    """A load/store spec is inconsistent: group sizes, block indices, lengths."""


class BlockIdError(PtrresError, ValueError):
    """A block id is out of range for the tensor it addresses.

    Attributes:
        group: the KV-cache group of the id.
        position: the id's position inside its group.
        value: the id itself.
    """

    def __init__(self, message: str, *, group: int, position: int, value: int):
        super().__init__(message)
        self.group = group
        self.position = position
        self.value = value


class OffloadedIdError(PtrresError, ValueError):
    """An offloaded chunk id is out of range, or there are too few or too many.

    Attributes:
        group: the KV-cache group of the id (None when the count is wrong).
        position: the id's position among its group's chunk ids (or None).
        value: the id itself (or None).
    """

    def __init__(
        self,
        message: str,
        *,
        group: int | None = None,
        position: int | None = None,
        value: int | None = None,
    ):
        super().__init__(message)
        self.group = group
        self.position = position
        self.value = value


class RemoteBlockIdError(BlockIdError):
    """A peer's block id (of a peer transfer) is out of range for the peer's
    tensor it addresses (SPEC 14). ``group``, ``position`` and ``value`` as
    for BlockIdError, of the remote ids."""


class DevicePointerError(BlockIdError):
    """A resolved device pointer is not a block of its ref's tensor.

    ``value`` is the pointer; ``position`` its position inside its group.
    """


class InputTypeError(PtrresError, TypeError):
    """An argument has the wrong type, dtype or number of dimensions."""


class OutBufferError(PtrresError, ValueError):
    """An out= buffer is too short, read-only or not contiguous."""
