"""PointerTable: a KV-cache layout flattened once, resolved many times.

The table is the facade: its columns and caches (TableColumns, _columns)
hold the layout; its methods check each call's arguments and call the
planners (_plan, _canonical, _mappings, _files, _peer) with plain arrays.
None of them knows the table.
"""

from __future__ import annotations

from typing import Any

import numpy.typing as npt

from . import _canonical, _files, _kernels, _peer, _peer_plan, _plan
from ._args import (
    PTRS_SIZES,
    SPEC_FIELDS,
    Buffers,
    block_ids_arg,
    max_run_arg,
    missing_attributes,
    out_arrays,
)
from ._columns import TableColumns
from ._diagnose import overlap_error, resolve_error
from ._errors import InputTypeError
from ._groups import (
    GroupCounts,
    check_groups,
    groups_array,
    sizes_array,
)
from ._heads import HeadSlice
from ._kernels.common import NO_CAP
from ._offloaded import OffloadedLayout
from ._results import (
    DevicePointers,
    FilePlan,
    PeerTransferPlan,
    StridedTransferPlan,
    TransferPlan,
)

# Peer pairs a table keeps checked: a decode rank at TP 1 gathers from up to
# 8 prefill ranks (TP 8), one plan_peer_transfer per rank, in turn.
PEER_PAIRS_KEPT = 8


class PointerTable(TableColumns):
    """The tensors and refs of a CanonicalKVCaches, as parallel arrays.

    Building the table reads every tensor's data pointer and row stride once and
    checks the layout (tensor_idx in range, every page within its tensor's
    rows). The table holds plain integers, not the tensors: it must not outlive
    the tensors' memory, and a re-allocated tensor needs a new table. A table
    may be shared by threads: its methods only read it, but for the cache of
    the offloaded layout last planned with, which is read and replaced as one
    (layout, its ref table) tuple, so no thread pairs a layout with another's.

    Args:
        kv_caches: a CanonicalKVCaches, or any object with ``tensors`` (each with
            ``.tensor``) and ``group_data_refs`` (each ref with ``tensor_idx``
            and ``page_size_bytes``).
    """

    def __repr__(self) -> str:
        return (
            f"PointerTable({self.num_groups} groups, "
            f"refs per group {self.group_data_ref_counts})"
        )

    def resolve(
        self, device_spec: Any, *, out: Buffers | None = None
    ) -> DevicePointers:
        """Resolve a spec's block ids to device pointers, checking every id.

        Args:
            device_spec: a GPULoadStoreSpec or any object with ``block_ids``,
                ``group_sizes`` and ``block_indices``.
            out: optional ``(ptrs, sizes)`` buffers, 1-D int64 or uint64, at
                least as long as the number of ops (numpy views of pinned
                torch tensors, say), apart from each other and from the ids.
                The result's arrays are then uint64 views of them, and nothing
                is allocated.

        Returns:
            DevicePointers with uint64 ``ptrs`` and ``sizes``, ordered group ->
            ref -> block.

        Raises:
            BlockIdError: a block id is outside its tensor (out's first
                entries are then zeroed).
            SpecError, InputTypeError, OutBufferError: malformed input.
        """
        try:
            raw_ids = device_spec.block_ids
            raw_sizes, raw_indices = device_spec.group_sizes, device_spec.block_indices
        except AttributeError:
            raise missing_attributes(device_spec, SPEC_FIELDS, "device_spec") from None
        block_ids = block_ids_arg(raw_ids)
        counts = check_groups(
            raw_sizes,
            raw_indices,
            len(block_ids),
            self.group_data_ref_counts,
            self.group_page_bytes,
        )
        return self._resolve(block_ids, counts, out)

    def _resolve(
        self, block_ids: npt.NDArray[Any], counts: GroupCounts, out: Buffers | None
    ) -> DevicePointers:
        """resolve() of a spec read and checked already (_read_spec)."""
        group_sizes = counts.group_sizes
        ptrs, sizes = out_arrays(out, counts.n_ops, PTRS_SIZES)
        status = _kernels.resolve_kernel(
            self.ref_table,
            self.group_ref_start,
            block_ids,
            sizes_array(self._group_arrays, group_sizes),
            ptrs,
            sizes,
        )
        if status < 0:
            if status == _kernels.OVERLAPPING_BUFFERS:
                raise overlap_error("out[0] (ptrs), out[1] (sizes) and block_ids")
            ptrs[:] = 0
            sizes[:] = 0
            raise resolve_error(self._groups, block_ids, group_sizes)
        # Positional: keywords would cost a fifth of a microsecond.
        return DevicePointers(
            ptrs, sizes, group_sizes, self.group_data_ref_counts, counts.block_indices
        )

    def plan_transfer(
        self,
        device_spec: Any,
        offloaded: OffloadedLayout,
        offloaded_ids: Any,
        *,
        store: bool,
        out: Buffers | None = None,
        coalesce: bool = False,
        max_run_bytes: int | None = None,
    ) -> TransferPlan:
        """Every copy descriptor of a store or a load, in one pass (SPEC 5).

        With a canonical layout (SPEC 10), each kept block adds one descriptor
        per fragment of its ref's mapping, ordered group -> ref -> kept block
        -> fragment: exactly vLLM 0.33's ``_fill_canonical_ops``. Stores keep
        only the blocks whose canonical page id (chunk * bpc + sub-block) is
        this rank's; loads keep every block.

        Descriptors are ordered as in resolve(): group -> ref -> block. Device
        block k of group g (ref d, tensor t) pairs with sub-block ``j % bpc``
        of chunk ``offloaded_ids_of_g[j // bpc]``, where ``j = skip(g) + k``.

        Args:
            device_spec: the device blocks, as for resolve().
            offloaded: the offloaded tensors, aligned with the device tensors.
            offloaded_ids: chunk ids, consumed group by group: each non-empty
                group takes the next n_chunks(g) ids.
            store: True for device -> offloaded (src is the device side),
                False for offloaded -> device.
            out: optional ``(src, dst, sizes)`` buffers, 1-D int64 or uint64,
                at least as long as the number of ops (before coalescing),
                apart from each other and from the ids. The plan's arrays are
                then uint64 views of them. With a canonical layout, ops are
                fragments: each block of a group makes as many as its refs'
                runs hold, and out= must hold that many for every block, as
                vLLM sizes its buffers (an upper bound: stores then drop the
                blocks other ranks write).
            coalesce: merge descriptors that continue each other on both sides
                in the same pass, as coalesce() does.
            max_run_bytes: the largest merged descriptor, when coalescing.

        Returns:
            A TransferPlan (src, dst, sizes, num_bytes).

        Raises:
            BlockIdError, OffloadedIdError: an id out of range, or the wrong
                number of offloaded ids (out's first entries are then zeroed).
            SpecError, LayoutError, InputTypeError, OutBufferError: malformed
                input.
        """
        # _read_spec() written out: a call frame is about 2% of a small plan,
        # the hot path of every engine step.
        try:
            raw_ids = device_spec.block_ids
            raw_sizes, raw_indices = device_spec.group_sizes, device_spec.block_indices
        except AttributeError:
            raise missing_attributes(device_spec, SPEC_FIELDS, "device_spec") from None
        block_ids = block_ids_arg(raw_ids)
        counts = check_groups(
            raw_sizes,
            raw_indices,
            len(block_ids),
            self.group_data_ref_counts,
            self.group_page_bytes,
        )
        return self._transfer(
            block_ids, counts, offloaded, offloaded_ids, store, out, coalesce,
            max_run_bytes,
        )  # fmt: skip

    def plan_from_device_pointers(
        self,
        device_ptrs: Any,
        offloaded: OffloadedLayout,
        offloaded_ids: Any,
        *,
        store: bool,
        out: Buffers | None = None,
        coalesce: bool = False,
        max_run_bytes: int | None = None,
    ) -> TransferPlan:
        """The plan of plan_transfer(), from already resolved device pointers.

        This is vLLM's two-step flow (resolve, then walk the groups with
        iter_pointer_groups) for callers that have resolved already. Every
        pointer is checked: it must be a block of its ref's tensor, the same
        block for every ref of its group, with the ref's page as its size.

        Args:
            device_ptrs: DevicePointers of this table's layout (any object with
                its fields).
            offloaded, offloaded_ids, store, out, coalesce, max_run_bytes: as
                for plan_transfer().

        Raises:
            DevicePointerError: a pointer that is not a block of its tensor.
            the errors of plan_transfer().
        """
        pointers, counts = _plan.read_device_pointers(
            device_ptrs, self.group_data_ref_counts, self.group_page_bytes
        )
        self._offloaded_refs(offloaded)  # an OffloadedLayout that fits
        block_ids, chunk_ids = _plan.block_ids_behind(
            self.ref_table,
            self.group_ref_start,
            sizes_array(self._group_arrays, counts.group_sizes),
            pointers,
            counts,
            offloaded_ids,
            offloaded.blocks_per_chunk,
            self._groups,
            self.group_data_ref_counts,
        )
        return self._transfer(
            block_ids, counts, offloaded, chunk_ids, store, out, coalesce,
            max_run_bytes,
        )  # fmt: skip

    def plan_peer_transfer(
        self,
        device_spec: Any,
        peer: _peer.PeerLayout,
        remote_ids: Any,
        *,
        heads: HeadSlice | None = None,
        coalesce: bool = False,
        max_run_bytes: int | None = None,
        out: Buffers | None = None,
    ) -> PeerTransferPlan:
        """Every copy descriptor between this engine's blocks and a peer's
        (SPEC 14), in one pass: for group g, ref d, block k,
        ``(local_base + local_id * local_stride, remote_base + remote_id *
        remote_stride, page)``, ordered as resolve(): group -> ref -> block.

        Every local id is checked against its ref's tensor and every remote id
        against the peer ref's ``num_blocks``, before anything is written. The
        plan says nothing of direction: NIXL READs the remote side into the
        local one, or WRITEs the local side to the remote one
        (ptrres.nixl.peer_xfer_descs).

        Args:
            device_spec: this engine's blocks, as for resolve() (its
                block_indices play no part).
            peer: the peer's KV caches: the same refs per group as this
                table, with the same page per ref.
            remote_ids: the peer's block ids, one per local block id and in
                the same order: group by group, as the spec's group sizes say.
            heads: a slice of the KV heads (one of ptrres.tp_mapping()'s, for
                the peer rank this layout is of): each copy is then that
                slice of the page on each side (SPEC 15). None: the whole
                page, the same on both sides.
            coalesce: merge descriptors that continue each other on both sides
                (upwards or downwards, never across two allocations on either
                side: SPEC 6), in the same pass.
            max_run_bytes: the largest merged descriptor, when coalescing.
            out: optional ``(local, remote, sizes)`` buffers, 1-D int64 or
                uint64, at least as long as the number of ops (before
                coalescing), apart from each other and from the ids.

        Returns:
            A PeerTransferPlan (local, remote, sizes, num_bytes).

        Raises:
            BlockIdError: a local id outside its tensor.
            RemoteBlockIdError: a remote id outside its peer ref (out's first
                entries are zeroed on either).
            SpecError: not one remote id per local block id; malformed spec.
            LayoutError: a peer of other refs per group or other pages (or,
                with heads, pages of other bytes per head).
            InputTypeError, OutBufferError: malformed input.
        """
        block_ids, counts = self._read_spec(device_spec)
        if type(coalesce) is not bool:
            raise InputTypeError(f"coalesce must be True or False, got {coalesce!r}")
        max_run = NO_CAP if max_run_bytes is None else max_run_arg(max_run_bytes)
        peers = self._peers
        pair = next((p for p in peers if p.matches(peer, heads)), None)
        if pair is None:
            pair = _peer_plan.pair_peer(
                peer, heads, self.ref_table, self._groups, self.group_data_ref_counts
            )
            self._peers = (pair, *peers[: PEER_PAIRS_KEPT - 1])
        return _peer_plan.plan_peer(
            self.group_ref_start,
            pair,
            groups_array(self._group_arrays, counts.group_sizes, self._zero_indices),
            block_ids,
            counts,
            remote_ids,
            out,
            coalesce,
            max_run,
            self._groups,
        )

    def plan_file_ops(
        self,
        device_spec: Any,
        blocks_per_chunk: int,
        *,
        layout: str = "ref-major",
        coalesce: bool = False,
        max_run_bytes: int | None = None,
        out: Buffers | None = None,
    ) -> FilePlan:
        """Resolve a spec and lay its blocks out in files, in one pass (SPEC 11).

        The result is ``ptrres.plan_file_ops(self.resolve(device_spec), ...)``,
        with resolve()'s checks: every block id against each ref's tensor.

        Args:
            device_spec: the device blocks, as for resolve().
            blocks_per_chunk, layout, coalesce, max_run_bytes, out: as for
                ptrres.plan_file_ops().

        Raises:
            BlockIdError: a block id is outside its tensor (nothing is written).
            SpecError, InputTypeError, OutBufferError: malformed input.
        """
        options = _files.file_options(blocks_per_chunk, layout, coalesce, max_run_bytes)
        block_ids, counts = self._read_spec(device_spec)
        return _files.plan_spec_file_ops(
            self.ref_table,
            self._ref_allocations,
            self.group_ref_start,
            sizes_array(self._group_arrays, counts.group_sizes),
            self._groups,
            self.group_data_ref_counts,
            block_ids,
            counts,
            options,
            out,
        )

    def plan_strided_transfer(
        self,
        device_spec: Any,
        offloaded: OffloadedLayout,
        offloaded_ids: Any,
        *,
        store: bool,
        out: Buffers | None = None,
    ) -> StridedTransferPlan:
        """2-D copy descriptors of a store or a load (SPEC 10).

        One descriptor per (kept block, ref, run), ordered as plan_transfer()'s
        fragments: ``height`` rows of ``width`` bytes (num_fragments rows of
        fragment_size bytes), rows ``src_pitch`` and ``dst_pitch`` apart
        (local_stride and canonical_stride, swapped on a load). Expanded row
        by row (``expand()``) it is exactly plan_transfer()'s plan. A direct
        layout gives one single-row descriptor per (block, ref). Runs with no
        fragments give no descriptor.

        Args:
            device_spec, offloaded, offloaded_ids, store: as for
                plan_transfer().
            out: optional ``(src, dst, width, height, src_pitch, dst_pitch)``
                buffers, 1-D int64 or uint64, at least (blocks x runs of
                their group's refs) long: the count before stores drop the
                blocks other ranks write.

        Raises:
            the errors of plan_transfer().
        """
        if type(store) is not bool:
            raise InputTypeError(f"store must be True or False, got {store!r}")
        block_ids, counts = self._read_spec(device_spec)
        tables = self._plan_tables(offloaded)
        return _canonical.plan_strided(
            self.ref_table,
            self.group_ref_start,
            tables,
            groups_array(self._group_arrays, counts.group_sizes, counts.block_indices),
            block_ids,
            counts,
            offloaded_ids,
            store,
            out,
            self._groups,
        )

    def _transfer(
        self,
        block_ids: npt.NDArray[Any],
        counts: GroupCounts,
        offloaded: OffloadedLayout,
        offloaded_ids: Any,
        store: bool,
        out: Buffers | None,
        coalesce: bool,
        max_run_bytes: int | None,
    ) -> TransferPlan:
        """Check the offloaded side and run the plan of its layout, for a
        checked spec (plan_transfer() documents the arguments)."""
        if type(store) is not bool:
            raise InputTypeError(f"store must be True or False, got {store!r}")
        if type(coalesce) is not bool:
            raise InputTypeError(f"coalesce must be True or False, got {coalesce!r}")
        # The usual None without a call: that pays for this method's frame.
        max_run = NO_CAP if max_run_bytes is None else max_run_arg(max_run_bytes)
        ref_table = self.ref_table
        cached = self._offloaded  # inline: a method call costs on every plan
        if cached is not None and cached[0] is offloaded:
            offloaded_refs = cached[1]
        elif isinstance(offloaded, OffloadedLayout) and offloaded.canonical:
            # Never cached in _offloaded: canonical layouts always come here.
            tables = self._plan_tables(offloaded)
            # A merged plan of one fragment per ref runs on the layout's
            # direct form: plan_kernel merges while it fills, where the
            # canonical kernel merges what it wrote (a copy's worth once one
            # pair merges). Not for stores that keep a writer's blocks.
            direct = tables.direct if coalesce else None
            if direct is None or (store and not direct.one_writer):
                return _canonical.plan(
                    ref_table,
                    self.group_ref_start,
                    tables,
                    groups_array(
                        self._group_arrays, counts.group_sizes, counts.block_indices
                    ),
                    block_ids,
                    counts,
                    offloaded_ids,
                    store,
                    out,
                    coalesce,
                    max_run,
                    self._groups,
                )
            ref_table, offloaded_refs = direct.ref_table, direct.offloaded_refs
            num_bytes = sum(
                n * b for n, b in zip(counts.group_sizes, direct.group_bytes)
            )
            counts = counts._replace(num_bytes=num_bytes)
        else:
            offloaded_refs = self._offloaded_refs(offloaded)
        # Positional, here and above: keywords cost a tenth of a microsecond.
        return _plan.run_plan(
            ref_table,
            self.group_ref_start,
            offloaded_refs,
            groups_array(self._group_arrays, counts.group_sizes, counts.block_indices),
            block_ids,
            counts,
            offloaded_ids,
            offloaded,
            store,
            out,
            coalesce,
            max_run,
            self._groups,
        )
