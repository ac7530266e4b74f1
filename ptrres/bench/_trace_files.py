"""The trace files: the traces that ship in ``ptrres/bench/traces/*.npz``, read
and checked.

A trace is the block-id stream vLLM 0.33's own allocators handed its CPU
offloading worker (``benchmarks/vllm_traces.py`` records them); the format is
in ``ptrres.bench.traces``'s docstring. Reading one needs numpy only.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

TRACE_DIR = Path(__file__).resolve().parent / "traces"
# The traces that ship with ptrres, by name (the file stem).
TRACES: tuple[str, ...] = tuple(sorted(p.stem for p in TRACE_DIR.glob("*.npz")))

_ARRAYS = {
    "store": np.bool_,
    "gpu_offsets": np.int64,
    "gpu_ids": np.int32,
    "cpu_offsets": np.int64,
    "cpu_ids": np.int64,
    "block_indices": np.int64,
}


class TraceTransfer(NamedTuple):
    """One recorded transfer."""

    store: bool
    gpu_ids: npt.NDArray[np.int32]
    cpu_ids: npt.NDArray[np.int64]
    block_index: int


@dataclass(frozen=True, eq=False)
class Trace:
    """A recorded stream of transfers (ptrres.bench.traces gives the format)."""

    name: str
    metadata: dict[str, Any]
    store: npt.NDArray[np.bool_]
    gpu_offsets: npt.NDArray[np.int64]
    gpu_ids: npt.NDArray[np.int32]
    cpu_offsets: npt.NDArray[np.int64]
    cpu_ids: npt.NDArray[np.int64]
    block_indices: npt.NDArray[np.int64]

    @property
    def blocks_per_chunk(self) -> int:
        return int(self.metadata["blocks_per_chunk"])

    @property
    def num_gpu_blocks(self) -> int:
        return int(self.metadata["num_gpu_blocks"])

    @property
    def num_cpu_blocks(self) -> int:
        return int(self.metadata["num_cpu_blocks"])

    def __len__(self) -> int:
        return len(self.store)

    def transfer(self, i: int) -> TraceTransfer:
        """TraceTransfer i: (store, gpu_ids, cpu_ids, block_index)."""
        return TraceTransfer(
            bool(self.store[i]),
            self.gpu_ids[self.gpu_offsets[i] : self.gpu_offsets[i + 1]],
            self.cpu_ids[self.cpu_offsets[i] : self.cpu_offsets[i + 1]],
            int(self.block_indices[i]),
        )

    def transfers(self) -> Iterator[TraceTransfer]:
        """Every transfer, in the order vLLM's worker submits them."""
        return (self.transfer(i) for i in range(len(self)))


def load_trace(name_or_path: str | Path) -> Trace:
    """A shipped trace by name (one of TRACES), or any trace file by path.

    Raises:
        ValueError: the file is not a well-formed trace.
        FileNotFoundError: no such trace.
    """
    path = Path(name_or_path)
    if str(name_or_path) in TRACES:
        path = TRACE_DIR / f"{name_or_path}.npz"
    elif not path.exists():
        raise FileNotFoundError(
            f"no trace {str(name_or_path)!r}: neither a file nor one of {TRACES}"
        )
    with np.load(path, allow_pickle=False) as data:
        missing = {*_ARRAYS, "metadata"} - set(data.files)
        if missing:
            raise ValueError(f"{path}: not a trace, missing {sorted(missing)}")
        arrays = {key: data[key] for key in _ARRAYS}
        metadata = json.loads(str(data["metadata"][()]))
    for key, dtype in _ARRAYS.items():
        if arrays[key].dtype != dtype or arrays[key].ndim != 1:
            raise ValueError(
                f"{path}: {key} is {arrays[key].ndim}-D {arrays[key].dtype}, "
                f"not 1-D {np.dtype(dtype)}"
            )
    n = len(arrays["store"])
    for side in ("gpu", "cpu"):
        offsets = arrays[f"{side}_offsets"]
        if (
            len(offsets) != n + 1
            or offsets[0] != 0
            or offsets[-1] != len(arrays[f"{side}_ids"])
            or (np.diff(offsets) < 0).any()
        ):
            raise ValueError(f"{path}: {side}_offsets do not index {side}_ids")
    if len(arrays["block_indices"]) != n:
        raise ValueError(f"{path}: {len(arrays['block_indices'])} block_indices")
    return Trace(name=str(metadata.get("name", path.stem)), metadata=metadata, **arrays)
