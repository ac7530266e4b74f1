"""`ptrres explain`: the descriptors of a tiny transfer on a preset layout,
one a line, to learn how a layout's pointers are made."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TextIO

import numpy as np

from ..bench import PRESETS, make_spec


def explain_command(preset_name: str, block_ids: Sequence[int], out: TextIO) -> int:
    """`ptrres explain`: a transfer of block_ids in every group of the preset,
    one descriptor a line."""
    from .._table import PointerTable

    preset = PRESETS[preset_name]
    kv = preset.kv_caches(num_blocks=max(max(block_ids) + 1, 16))
    spec = make_spec(preset, len(block_ids))
    spec.block_ids = np.array(list(block_ids) * preset.num_groups, np.int64)
    device_ptrs = PointerTable(kv).resolve(spec)
    out.write(
        f"{preset.name}: {preset.description}\n"
        f"{preset.num_groups} group(s) x {preset.refs_per_group} refs; "
        f"each group transfers blocks {', '.join(map(str, block_ids))}\n"
        "ptr = base(tensor) + block_id * row_stride; offset = ptr - base\n\n"
    )
    header = (
        f"{'group':>5} {'ref':>4} {'tensor':>6} {'block':>6} "
        f"{'row stride':>11} {'offset':>14} {'size':>8}"
    )
    out.write(header + "\n" + "-" * len(header) + "\n")
    op = 0
    for group, refs in enumerate(kv.group_data_refs):
        for d, ref in enumerate(refs):
            tensor = kv.tensors[ref.tensor_idx].tensor
            for block in block_ids:
                offset = int(device_ptrs.ptrs[op]) - tensor.data_ptr()
                out.write(
                    f"{group:>5} {d:>4} {ref.tensor_idx:>6} {block:>6} "
                    f"{tensor.stride(0):>11,} {offset:>14,} "
                    f"{int(device_ptrs.sizes[op]):>8,}\n"
                )
                op += 1
    out.write(f"\n{op} descriptors\n")
    return 0
