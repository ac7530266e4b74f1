"""The head oracle (issue 34): what every rank's pages must hold, from a
model of the KV heads that shares nothing with ptrres's mapping code.

Each layer is a logical tensor ``[blocks, heads, tokens, head_bytes]`` of
bytes. A rank's page of a block is its shard of the heads, in HND order
(heads outermost), flattened: ``logical[block, shard].reshape(-1)``. With
MLA the latent page is not sharded: every rank holds all of it (the model
then has one "head", the latent vector). Plain numpy, so that NIXL's child
processes can use it without torch.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

Bytes = npt.NDArray[np.uint8]


def shard(rank: int, tp_size: int, num_kv_heads: int, mla: bool = False) -> list[int]:
    """The heads rank ``rank`` of TP ``tp_size`` holds, as vLLM shards a
    model of ``num_kv_heads`` KV heads: an even share when the TP size
    divides the heads, else one head, each held by ``tp_size //
    num_kv_heads`` consecutive ranks; all of them with MLA."""
    if mla:
        return list(range(num_kv_heads))
    if tp_size <= num_kv_heads:
        share = num_kv_heads // tp_size
        return [rank * share + i for i in range(share)]
    return [rank // (tp_size // num_kv_heads)]


def logical_kv(
    num_blocks: int, num_kv_heads: int, tokens: int, head_bytes: int, seed: int
) -> Bytes:
    """One layer's logical KV of random bytes: ``[blocks, heads, tokens,
    head_bytes]``."""
    rng = np.random.default_rng(seed)
    shape = (num_blocks, num_kv_heads, tokens, head_bytes)
    return rng.integers(0, 256, shape, dtype=np.uint8)


def rank_pages(logical: Bytes, heads: list[int]) -> Bytes:
    """A rank's pages of every block: its heads of the logical KV, HND,
    one row per block."""
    return np.ascontiguousarray(logical[:, heads].reshape(len(logical), -1))


def expected_pages(
    before: Bytes,
    source: Bytes,
    heads: list[int],
    local_ids: list[int],
    remote_ids: list[int],
) -> Bytes:
    """A decode rank's pages after its blocks ``local_ids`` received the
    prefill engine's blocks ``remote_ids`` (``source``: the prefill side's
    logical KV): those rows its shard of the source blocks, every other row
    as ``before``. Where a local id repeats, the transfer must not be asked
    to write it twice from different blocks (NIXL keeps no order), so the
    last pair is taken only where the caller made them agree."""
    after: Bytes = before.copy()
    for local, remote in zip(local_ids, remote_ids):
        after[local] = source[remote, heads].reshape(-1)
    return after
