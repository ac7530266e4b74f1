"""coalesce(): merge copy descriptors that continue each other on both sides."""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _kernels
from ._args import SRC_DST_SIZES, descriptor_array, max_run_arg, out_arrays
from ._diagnose import overlap_error
from ._errors import SpecError
from ._results import TransferPlan


def coalesce(
    src: Any,
    dst: Any,
    sizes: Any,
    *,
    max_run_bytes: int | None = None,
    out: tuple[Any, Any, Any] | None = None,
) -> TransferPlan:
    """Merge runs of descriptors that are contiguous on both sides (SPEC 6).

    Descriptor i+1 joins the run ending at i when ``src[i] + sizes[i] ==
    src[i + 1]`` and ``dst[i] + sizes[i] == dst[i + 1]``. Order is kept, and so
    is the byte mapping: every source byte lands where it did before.

    Args:
        src, dst, sizes: 1-D int64 or uint64 arrays of the same length.
        max_run_bytes: the largest merged descriptor; a descriptor larger than
            that on its own stays as it is.
        out: optional ``(src, dst, sizes)`` buffers (int64 or uint64), at least
            as long as the input; each may be its own input array (in place),
            but no other array.

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
    out_src, out_dst, out_sizes = out_arrays(out, n, SRC_DST_SIZES)
    written = _kernels.coalesce_kernel(
        src_in, dst_in, sizes_in, max_run, out_src, out_dst, out_sizes
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
