"""ptrres's plans in the form NIXL takes (SPEC 14).

NIXL (``nixl_agent``, NIXL 1.5) moves KV blocks between engines and to
storage. This module builds what it takes, and nothing more: the caller owns
the agents, the metadata exchange and progress.

- register(): every allocation a PointerTable or an OffloadedLayout lies in,
  one region each (``register_memory``), undone by ``deregister()`` or by
  leaving its ``with`` block; register_files() for the POSIX/GDS backends.
- Transfer descriptors (``get_xfer_descs``, ``initialize_xfer``): the two
  C-contiguous Nx3 uint64 arrays ``(addr, len, devId)``, one per side, of a
  TransferPlan (xfer_descs), a PeerTransferPlan (peer_xfer_descs) or a
  FilePlan (file_xfer_descs, FILE rows ``(offset, len, fd)``), in the plan's
  order, written by one kernel per side.
- Prepared lists (``prep_xfer_dlist``, ``make_prepped_xfer``): one strided
  Nx5 row ``(base, page, devId, stride, count)`` per ref of a table or a peer
  layout (prepped_rows), and a transfer's int32 indices into them
  (prepped_indices): ref-major, ``first index of the ref + block id``, every
  id checked against its own ref's block count, so that none lands in
  another ref's rows. NIXL checks an index only against the whole list.

Nothing here imports NIXL: its functions take the caller's agent. Every
check runs before NIXL sees anything, so that a bad id raises ptrres's error
and the agent keeps working.
"""

from ._descs import XferDescs, file_xfer_descs, peer_xfer_descs, xfer_descs
from ._memory import (
    DRAM,
    Memory,
    Registration,
    memory_of,
    register,
    register_files,
    vram,
)
from ._prepped import PreppedRows, prepped_indices, prepped_pair, prepped_rows

__all__ = [
    "DRAM",
    "Memory",
    "PreppedRows",
    "Registration",
    "XferDescs",
    "file_xfer_descs",
    "memory_of",
    "peer_xfer_descs",
    "prepped_indices",
    "prepped_pair",
    "prepped_rows",
    "register",
    "register_files",
    "vram",
    "xfer_descs",
]
