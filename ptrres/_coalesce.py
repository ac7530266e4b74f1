"""coalesce(): merge copy descriptors that continue each other on both sides."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from . import _kernels
from ._args import SRC_DST_SIZES, descriptor_array, max_run_arg, out_arrays
from ._diagnose import overlap_error
from ._errors import InputTypeError, SpecError
from ._results import TransferPlan


def coalesce(
    src: Any,
    dst: Any,
    sizes: Any,
    *,
    max_run_bytes: int | None = None,
    out: tuple[Any, Any, Any] | None = None,
    allocations: Any = None,
) -> TransferPlan:
    """Merge runs of descriptors that are contiguous on both sides (SPEC 6).

    Descriptor i+1 joins an ascending run ending at i when ``src[i] +
    sizes[i] == src[i + 1]`` and ``dst[i] + sizes[i] == dst[i + 1]``, and a
    descending one when ``src[i + 1] + sizes[i + 1] == src[i]`` and
    ``dst[i + 1] + sizes[i + 1] == dst[i]``; a run goes one way, and a merged
    run starts at its lowest address on each side. Order is kept, and so is
    the byte mapping: every source byte lands where it did before.

    Addresses are all coalesce() sees: two allocations that lie next to each
    other in memory look like one. Give ``allocations`` to keep each copy
    inside one (a PointerTable's plans do this by themselves).

    Args:
        src, dst, sizes: 1-D int64 or uint64 arrays of the same length.
        max_run_bytes: the largest merged descriptor; a descriptor larger than
            that on its own stays as it is.
        out: optional ``(src, dst, sizes)`` buffers (int64 or uint64), at least
            as long as the input; each may be its own input array (in place),
            but no other array.
        allocations: one integer per descriptor, say the index of the pair
            of allocations it copies between: no run joins descriptors of
            different values.

    Returns:
        A TransferPlan of the merged descriptors (uint64 views of ``out`` when
        given).
    """
    src_in = descriptor_array(src, "src")
    dst_in = descriptor_array(dst, "dst")
    sizes_in = descriptor_array(sizes, "sizes")
    n = len(sizes_in)
    if not len(src_in) == len(dst_in) == n:
        raise SpecError(
            f"src, dst and sizes have {len(src_in)}, {len(dst_in)} and {n} entries"
        )
    max_run = max_run_arg(max_run_bytes)
    breaks = _breaks(allocations, n)
    out_src, out_dst, out_sizes = out_arrays(out, n, SRC_DST_SIZES)
    written = _kernels.coalesce_kernel(
        src_in, dst_in, sizes_in, max_run, breaks, out_src, out_dst, out_sizes
    )
    if written == _kernels.OVERLAPPING_BUFFERS:
        raise overlap_error("out's src, dst and sizes (each may be its own input)")
    out_src, out_dst, out_sizes = (
        out_src[:written],
        out_dst[:written],
        out_sizes[:written],
    )
    # The bytes of the merged sizes, each an exact sum of input sizes: the
    # same total (modulo 2**64, as numpy sums), from fewer entries.
    num_bytes = int(out_sizes.sum(dtype=np.uint64))
    return TransferPlan(out_src, out_dst, out_sizes, num_bytes)


# No break at all (the kernel's signature takes a writable array; it is empty).
_NO_BREAKS = np.empty(0, np.int64)


def _breaks(allocations: Any, n: int) -> npt.NDArray[np.int64]:
    """Where a new run must start: each descriptor whose allocations differ
    from the one's before it."""
    if allocations is None:
        return _NO_BREAKS
    values = np.asarray(allocations)
    if values.ndim != 1 or (values.size and values.dtype.kind not in "iu"):
        raise InputTypeError(
            "allocations must be a 1-D integer array, got "
            f"{values.ndim}-D {values.dtype}"
        )
    if len(values) != n:
        raise SpecError(f"allocations has {len(values)} entries for {n} descriptors")
    return np.flatnonzero(values[1:] != values[:-1]).astype(np.int64) + 1
