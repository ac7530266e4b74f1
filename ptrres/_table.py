"""PointerTable: a KV-cache layout flattened once, resolved many times."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from . import _kernels
from ._errors import BlockIdError
from ._layout import (
    ID_DTYPES,
    as_block_ids,
    as_block_indices,
    as_group_sizes,
    out_view,
    read_layout,
)
from ._types import DevicePointers

OutBuffers = tuple[npt.NDArray[Any], npt.NDArray[Any]]


class PointerTable:
    """The tensors and refs of a CanonicalKVCaches, as parallel arrays.

    Building the table reads every tensor's data pointer and row stride once and
    checks the layout (tensor_idx in range, every page within its tensor's
    rows). The table holds plain integers, not the tensors: it must not outlive
    the tensors' memory, and a re-allocated tensor needs a new table.

    Args:
        kv_caches: a CanonicalKVCaches, or any object with ``tensors`` (each with
            ``.tensor``) and ``group_data_refs`` (each ref with ``tensor_idx``
            and ``page_size_bytes``).
    """

    def __init__(self, kv_caches: Any) -> None:
        groups = read_layout(kv_caches)
        rows = [row for group in groups for row in group]
        # One row per (group, ref) in copy order; columns are _kernels.BASE_PTR...
        self.ref_table = np.array(rows, dtype=np.int64).reshape(
            len(rows), _kernels.REF_COLUMNS
        )
        # The refs of group g are rows group_ref_start[g]:group_ref_start[g + 1].
        self.group_ref_start = np.cumsum([0] + [len(g) for g in groups], dtype=np.int64)
        self.group_data_ref_counts: tuple[int, ...] = tuple(len(g) for g in groups)
        self.num_groups = len(groups)

    def __repr__(self) -> str:
        return (
            f"PointerTable({self.num_groups} groups, "
            f"refs per group {self.group_data_ref_counts})"
        )

    def num_ops(self, group_sizes: npt.NDArray[np.int64]) -> int:
        """Copy ops of a transfer with these group sizes: sum of size x refs."""
        return sum(
            int(size) * refs
            for size, refs in zip(group_sizes, self.group_data_ref_counts)
        )

    def resolve(
        self, device_spec: Any, *, out: OutBuffers | None = None
    ) -> DevicePointers:
        """Resolve a spec's block ids to device pointers, checking every id.

        Args:
            device_spec: a GPULoadStoreSpec or any object with ``block_ids``,
                ``group_sizes`` and ``block_indices``.
            out: optional ``(ptrs, sizes)`` buffers, 1-D int64 or uint64, at
                least as long as the number of ops (numpy views of pinned
                torch tensors, say). The result's arrays are then views of
                them, and nothing is allocated.

        Returns:
            DevicePointers with uint64 ``ptrs`` and ``sizes``, ordered group ->
            ref -> block.

        Raises:
            BlockIdError: a block id is outside its tensor (out's entries are
                then zeroed).
            SpecError, InputTypeError, OutBufferError: malformed input.
        """
        block_ids = device_spec.block_ids
        if not (
            type(block_ids) is np.ndarray
            and block_ids.dtype in ID_DTYPES
            and block_ids.ndim == 1
            and block_ids.flags.c_contiguous
        ):
            block_ids = as_block_ids(block_ids)
        n_ops, group_sizes, block_indices = self._check_groups(
            device_spec.group_sizes, device_spec.block_indices, len(block_ids)
        )
        group_size_array = np.array(group_sizes, dtype=np.int64)
        if out is None:
            ptrs = np.empty(n_ops, np.uint64)
            sizes = np.empty(n_ops, np.uint64)
        else:
            ptrs = out_view(out[0], n_ops, "out[0] (ptrs)")
            sizes = out_view(out[1], n_ops, "out[1] (sizes)")
        bad_op = _kernels.resolve_kernel(
            self.ref_table,
            self.group_ref_start,
            block_ids,
            group_size_array,
            ptrs,
            sizes,
        )
        if bad_op >= 0:
            ptrs[:] = 0
            sizes[:] = 0
            raise self._block_id_error(int(bad_op), block_ids, group_size_array)
        return DevicePointers(
            ptrs=ptrs,
            sizes=sizes,
            group_block_counts=group_sizes,
            group_data_ref_counts=self.group_data_ref_counts,
            block_indices=block_indices,
        )

    def _check_groups(
        self, group_sizes: Any, block_indices: Any, n_block_ids: int
    ) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
        """Check a spec's group sizes and block indices against the layout.

        Returns:
            The number of ops, and the group sizes and block indices as tuples
            of Python ints.

        The common case (sequences of Python ints, as vLLM passes) is checked
        in a plain loop; anything else goes through the thorough checks, which
        also produce the error messages.
        """
        try:
            if len(group_sizes) == len(block_indices) == self.num_groups:
                n_ops = n_ids = 0
                for size, refs, index in zip(
                    group_sizes, self.group_data_ref_counts, block_indices
                ):
                    if type(size) is not int or type(index) is not int:
                        break
                    if size < 0 or index < 0:
                        break
                    n_ids += size
                    n_ops += size * refs
                else:
                    if n_ids == n_block_ids:
                        return n_ops, tuple(group_sizes), tuple(block_indices)
        except TypeError:
            pass
        sizes = as_group_sizes(group_sizes, self.num_groups, n_block_ids)
        indices = as_block_indices(block_indices, self.num_groups)
        return self.num_ops(sizes), tuple(sizes.tolist()), indices

    def _block_id_error(
        self,
        op: int,
        block_ids: npt.NDArray[Any],
        group_sizes: npt.NDArray[np.int64],
    ) -> BlockIdError:
        """The error for the out-of-range block id of copy op ``op``."""
        first_id = 0
        for group, n_blocks in enumerate(group_sizes.tolist()):
            group_ops = n_blocks * self.group_data_ref_counts[group]
            if op < group_ops:
                d, position = divmod(op, n_blocks)
                row = self.ref_table[int(self.group_ref_start[group]) + d]
                value = int(block_ids[first_id + position])
                return BlockIdError(
                    f"group {group}, position {position} "
                    f"(block_ids[{first_id + position}]): block id {value} is out "
                    f"of range for ref {d}, whose tensor "
                    f"{int(row[_kernels.TENSOR_IDX])} has "
                    f"{int(row[_kernels.NUM_BLOCKS])} blocks",
                    group=group,
                    position=position,
                    value=value,
                )
            op -= group_ops
            first_id += n_blocks
        raise AssertionError("op index beyond the transfer")  # pragma: no cover
