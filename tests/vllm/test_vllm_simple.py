"""ptrres.vllm on vLLM's simple offload path (SimpleCPUOffloadConnector):
``cuda_mem_ops.build_params`` and ``copy_blocks``, its DMA and disk backends,
against the installed release's own code, on CPU tensors (vllm_harness).

vLLM's own ``copy_blocks`` and the patched one run on the same params, each
handing its arrays to a BatchDriver standing in for cuMemcpyBatchAsync.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st
from test_vllm_patch import refusal
from vllm_harness import (
    BatchDriver,
    DriverCall,
    FakeStream,
    copy_backend,
    cuda_mem_ops,
    disk_backend,
    simple_caches,
    stubbed_simple,
    worker,
)

import ptrres
import ptrres.vllm as plugin
from ptrres.vllm import _hook, _patching, _state, _warmup
from ptrres.vllm._simple import PLAN_ATTRIBUTE, CopyBlockIdError

ROOT = Path(__file__).resolve().parents[2]
Handler = worker.SingleDirectionOffloadingHandler
MODULES = (cuda_mem_ops, copy_backend, disk_backend)
# vLLM's own, as the release ships them (the tests start unpatched).
VLLM_BUILD_PARAMS = cuda_mem_ops.build_params
VLLM_COPY_BLOCKS = cuda_mem_ops.copy_blocks
SIMPLE_PATCHES = [
    f"{module.__name__}.{name}"
    for name in ("build_params", "copy_blocks")
    for module in MODULES
]


@pytest.fixture(autouse=True)
def _unpatched(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every test starts and ends with vLLM as it ships, coalescing off."""
    monkeypatch.delenv("PTRRES_VLLM_COALESCE", raising=False)
    plugin.unpatch()
    _patching._warned.clear()
    yield
    plugin.unpatch()


def build(src: dict[str, Any], dst: dict[str, Any], *, coalesce: bool = False) -> Any:
    """Params built by the patched build_params (patch() first)."""
    os.environ["PTRRES_VLLM_COALESCE"] = "1" if coalesce else "0"
    try:
        plugin.patch()
        params = cuda_mem_ops.build_params(src, dst, FakeStream())
    finally:
        del os.environ["PTRRES_VLLM_COALESCE"]
    assert hasattr(params, PLAN_ATTRIBUTE)
    return params


def run(copy: Callable[..., None], driver: BatchDriver, *args: Any) -> list[DriverCall]:
    """One copy_blocks call; what it handed the driver."""
    before = len(driver.calls)
    copy(*args)
    return driver.calls[before:]


def assert_same_calls(ours: list[DriverCall], vllms: list[DriverCall]) -> None:
    assert len(ours) == len(vllms)
    for a, b in zip(ours, vllms):
        assert a.src.tobytes() == b.src.tobytes()
        assert a.dst.tobytes() == b.dst.tobytes()
        assert a.sizes.tobytes() == b.sizes.tobytes()
        assert a.others == b.others


# --- patch() and unpatch() ---------------------------------------------------------


def test_patch_replaces_both_functions_wherever_vllm_looks_them_up() -> None:
    originals = {
        (m.__name__, n): getattr(m, n)
        for m in MODULES
        for n in ("build_params", "copy_blocks")
    }
    patched = plugin.patch()
    first = patched.index(SIMPLE_PATCHES[0])
    assert patched[first : first + len(SIMPLE_PATCHES)] == SIMPLE_PATCHES
    for name in ("build_params", "copy_blocks"):
        ours = getattr(cuda_mem_ops, name)
        assert ours is not originals[(cuda_mem_ops.__name__, name)]
        # The backends imported them by name: they get the same function.
        assert copy_backend.__dict__[name] is disk_backend.__dict__[name] is ours
        assert ours.__wrapped__ is originals[(cuda_mem_ops.__name__, name)]
    plugin.unpatch()
    for (module, name), original in originals.items():
        assert getattr(sys.modules[module], name) is original


def test_a_changed_copy_blocks_leaves_the_simple_path_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """All or nothing within the path: build_params stays vLLM's too, in
    every module; the handler's path is patched."""

    def copy_blocks(src_block_ids: Any, dst_block_ids: Any) -> None:
        raise AssertionError

    handler = vars(Handler)["transfer_async"]
    monkeypatch.setattr(cuda_mem_ops, "copy_blocks", copy_blocks)
    with pytest.warns(plugin.VllmPatchWarning) as caught:
        patched = plugin.patch()
    assert [
        str(w.message) for w in caught if w.category is plugin.VllmPatchWarning
    ] == [refusal(_state.SIMPLE, "cuda_mem_ops.copy_blocks has other code")]
    assert not set(patched) & set(SIMPLE_PATCHES)
    assert "SingleDirectionOffloadingHandler.transfer_async" in patched
    assert not _state.patched(_state.SIMPLE)
    assert cuda_mem_ops.copy_blocks is copy_blocks
    assert copy_backend.copy_blocks is VLLM_COPY_BLOCKS
    for module in MODULES:
        assert module.build_params is VLLM_BUILD_PARAMS
    assert vars(Handler)["transfer_async"] is not handler


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ("backend", "copy_backend.copy_blocks has other code"),
        ("driver", "cuda_mem_ops._batch_memcpy is missing"),
        ("fields", "cuda_mem_ops.BatchMemcpyParams has other code"),
        ("chunking", "cuda_mem_ops._resolve_max_batch_descriptors is missing"),
    ],
)
def test_what_the_patch_relies_on_is_checked_first(
    change: str, reason: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A backend that binds another copy_blocks, the driver, the params'
    fields, the chunking: what differs is named, the path left alone."""
    if change == "backend":
        monkeypatch.setattr(copy_backend, "copy_blocks", lambda *args: None)
    elif change == "driver":
        monkeypatch.delattr(cuda_mem_ops, "_batch_memcpy")
    elif change == "fields":

        class Params(tuple):  # type: ignore[type-arg]
            _fields = ("src_bases", "dst_bases")

        monkeypatch.setattr(cuda_mem_ops, "BatchMemcpyParams", Params)
    else:
        monkeypatch.delattr(cuda_mem_ops, "_resolve_max_batch_descriptors")
    with pytest.warns(plugin.VllmPatchWarning) as caught:
        patched = plugin.patch()
    assert [
        str(w.message) for w in caught if w.category is plugin.VllmPatchWarning
    ] == [refusal(_state.SIMPLE, reason)]
    assert not set(patched) & set(SIMPLE_PATCHES)
    assert _state.patched(_state.HANDLER)
    assert not _state.patched(_state.SIMPLE)
    assert cuda_mem_ops.build_params is VLLM_BUILD_PARAMS


# --- the same descriptors as vLLM's ----------------------------------------------


@st.composite
def copies(draw: st.DrawFn) -> dict[str, Any]:
    """Layers, both sides' block counts, id pairs and a chunk cap."""
    num_layers = draw(st.integers(1, 4))
    block_bytes = [draw(st.integers(1, 40)) for _ in range(num_layers)]
    src_blocks = draw(st.integers(1, 12))
    dst_blocks = draw(st.integers(1, 12))
    n = draw(st.integers(0, 10))
    kind = draw(st.sampled_from(["random", "ascending", "descending", "repeated"]))
    if kind == "random":
        src = draw(st.lists(st.integers(0, src_blocks - 1), min_size=n, max_size=n))
        dst = draw(st.lists(st.integers(0, dst_blocks - 1), min_size=n, max_size=n))
    else:
        n = min(n, src_blocks, dst_blocks)
        step = {"ascending": 1, "descending": -1, "repeated": 0}[kind]
        first_src = draw(st.integers(0, src_blocks - 1 - (n - 1) * abs(step)))
        first_dst = draw(st.integers(0, dst_blocks - 1 - (n - 1) * abs(step)))
        if step < 0:
            first_src += n - 1
            first_dst += n - 1
        src = [first_src + k * step for k in range(n)]
        dst = [first_dst + k * step for k in range(n)]
    return {
        "block_bytes": block_bytes,
        "src_blocks": src_blocks,
        "dst_blocks": dst_blocks,
        "src": src,
        "dst": dst,
        "max_batch": draw(st.integers(0, 5)),
    }


def params_of(case: dict[str, Any], *, coalesce: bool = False) -> Any:
    src = simple_caches(case["src_blocks"], case["block_bytes"])
    dst = simple_caches(case["dst_blocks"], case["block_bytes"], seed=1)
    return build(src, dst, coalesce=coalesce), src, dst


@given(copies())
@example(
    {
        "block_bytes": [8, 16],
        "src_blocks": 4,
        "dst_blocks": 4,
        "src": [],
        "dst": [],
        "max_batch": 0,
    }
)
@example(
    {
        "block_bytes": [8],
        "src_blocks": 64,
        "dst_blocks": 64,
        "src": [40, 39, 38],
        "dst": [12, 11, 10],
        "max_batch": 2,
    }
)
def test_the_same_driver_calls_as_vllms_own(case: dict[str, Any]) -> None:
    """Same arrays, same chunks (max_batch descriptors each), same arguments."""
    with stubbed_simple(max_batch=case["max_batch"]) as driver:
        params, _, _ = params_of(case)
        ours = run(cuda_mem_ops.copy_blocks, driver, case["src"], case["dst"], params)
        vllms = run(VLLM_COPY_BLOCKS, driver, case["src"], case["dst"], params)
    assert_same_calls(ours, vllms)
    total = len(case["src"]) * len(case["block_bytes"])
    cap = case["max_batch"] or total
    assert [len(c.sizes) for c in ours] == [
        min(cap, total - off) for off in range(0, total, cap or 1)
    ]


@pytest.mark.parametrize("coalesce", [False, True])
def test_rocms_cap_splits_a_large_batch_as_vllm_does(
    coalesce: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ROCm caps a batch at 8192 descriptors (and one CUDA 13 batch of
    51,828 hung, vLLM #49276): a copy of 3 layers x 6000 blocks, 18,000
    descriptors, goes out in vLLM's chunks of 8192, 8192 and 1616, the same
    arrays; coalesced, the merged list is split at the same cap."""
    if coalesce:
        monkeypatch.setenv("PTRRES_VLLM_COALESCE", "1")
    case = {"block_bytes": [16, 32, 8], "src_blocks": 6500, "dst_blocks": 6500}
    rng = np.random.default_rng(49276)
    src = rng.permutation(6500)[:6000].tolist()
    dst = rng.permutation(6500)[:6000].tolist()
    with stubbed_simple(max_batch=8192) as driver:
        params, _, _ = params_of(case)
        ours = run(cuda_mem_ops.copy_blocks, driver, src, dst, params)
        vllms = run(VLLM_COPY_BLOCKS, driver, src, dst, params)
    assert [len(c.sizes) for c in vllms] == [8192, 8192, 1616]
    if coalesce:  # scattered ids: nothing merges, the same chunks
        assert [len(c.sizes) for c in ours] == [8192, 8192, 1616]
    assert_same_calls(ours, vllms)


def test_numpy_ids_and_other_integer_types_give_the_same_calls() -> None:
    case = {"block_bytes": [8, 24], "src_blocks": 9, "dst_blocks": 9}
    with stubbed_simple() as driver:
        params, _, _ = params_of(case)
        vllms = run(VLLM_COPY_BLOCKS, driver, [3, 1, 8], [0, 2, 4], params)
        for src, dst in [
            (np.array([3, 1, 8]), np.array([0, 2, 4], np.uint8)),
            (np.array([3, 9, 1, 9, 8])[::2], (0, 2, 4)),
            ([np.int32(3), 1, np.uint64(8)], [0, 2, 4]),
        ]:
            assert_same_calls(
                run(cuda_mem_ops.copy_blocks, driver, src, dst, params), vllms
            )


def test_a_driver_error_is_vllms_and_the_next_call_works() -> None:
    case = {"block_bytes": [8], "src_blocks": 4, "dst_blocks": 4}
    with stubbed_simple(BatchDriver(status=700)) as driver:
        params, _, _ = params_of(case)
        errors = []
        for copy in (VLLM_COPY_BLOCKS, cuda_mem_ops.copy_blocks):
            with pytest.raises(RuntimeError) as error:
                copy([1], [2], params)
            errors.append(str(error.value))
        assert errors[0] == errors[1] == "batch memcpy failed: err=700 failIdx=0"
        driver.status = 0
        assert len(run(cuda_mem_ops.copy_blocks, driver, [1], [2], params)) == 1


def test_without_a_driver_both_raise_vllms_assertion() -> None:
    case = {"block_bytes": [8], "src_blocks": 4, "dst_blocks": 4}
    with stubbed_simple():
        params, _, _ = params_of(case)
        cuda_mem_ops._batch_memcpy = None
        for copy in (VLLM_COPY_BLOCKS, cuda_mem_ops.copy_blocks):
            with pytest.raises(AssertionError, match="build_params\\(\\) must run"):
                copy([1], [2], params)


def test_no_layers_behave_as_vllms() -> None:
    """No layer: CUDA's uncapped chunking steps by zero, in vLLM's code and
    ours alike (range() refuses); capped, nothing is submitted."""
    case = {"block_bytes": [], "src_blocks": 4, "dst_blocks": 4}
    with stubbed_simple() as driver:
        params, _, _ = params_of(case)
        for copy in (VLLM_COPY_BLOCKS, cuda_mem_ops.copy_blocks):
            with pytest.raises(ValueError, match="must not be zero"):
                copy([1], [2], params)
    with stubbed_simple(max_batch=4) as driver:
        run(cuda_mem_ops.copy_blocks, driver, [1], [2], params)
        assert driver.calls == []


# --- bad input -------------------------------------------------------------------

BAD_IDS = [
    # (src ids, dst ids, side, position, value): tensors of 64 src, 16 dst blocks
    ([5, 6, 70], [1, 2, 3], "src", 2, 70),
    ([5, 6, 7], [1, 2, 16], "dst", 2, 16),
    ([-1], [0], "src", 0, -1),
    ([0, 1], [3, -5], "dst", 1, -5),
    ([64, 1], [3, 99], "src", 0, 64),  # the first position, src before dst
    ([1, 2], [99, 100], "dst", 0, 99),
    ([2**64], [1], "src", 0, 2**64),
    ([1], [2**63], "dst", 0, 2**63),
    (np.array([2**63 + 5], np.uint64), [1], "src", 0, 2**63 + 5),
]


@pytest.mark.parametrize(("src", "dst", "side", "position", "value"), BAD_IDS)
def test_a_bad_id_is_refused_before_the_driver_and_the_next_call_works(
    src: Any, dst: Any, side: str, position: int, value: int
) -> None:
    with stubbed_simple() as driver:
        caches = simple_caches(64, [16, 32])
        params = build(caches, simple_caches(16, [16, 32], seed=1))
        with pytest.raises(CopyBlockIdError) as error:
            cuda_mem_ops.copy_blocks(src, dst, params)
        assert driver.calls == []
        assert isinstance(error.value, ptrres.BlockIdError)
        assert isinstance(error.value, ValueError)
        assert (error.value.side, error.value.position) == (side, position)
        assert error.value.value == value
        blocks = 64 if side == "src" else 16
        assert str(error.value) == (
            f"copy_blocks, {side} position {position}: block id {value} is out "
            f"of range for the {side} tensors, of {blocks} blocks"
        )
        ours = run(cuda_mem_ops.copy_blocks, driver, [63, 0], [15, 0], params)
        assert_same_calls(ours, run(VLLM_COPY_BLOCKS, driver, [63, 0], [15, 0], params))


def test_vllm_builds_a_descriptor_for_a_bad_id() -> None:
    """What the check prevents: vLLM's copy_blocks addresses block 70 of
    tensors of 64 blocks, past their end."""
    with stubbed_simple() as driver:
        src = simple_caches(64, [16])
        params = build(src, simple_caches(64, [16], seed=1))
        (call,) = run(VLLM_COPY_BLOCKS, driver, [5, 6, 70], [1, 2, 3], params)
    end = src["layer.0"].data_ptr() + src["layer.0"].nbytes
    assert int(call.src[2]) >= end


def test_the_smallest_tensor_of_a_side_is_named() -> None:
    with stubbed_simple() as driver:
        src = simple_caches(8, [16, 16])
        src["layer.1"] = src["layer.1"][:5]  # 5 blocks
        params = build(src, simple_caches(8, [16, 16], seed=1))
        with pytest.raises(CopyBlockIdError, match=r"of 5 blocks \('layer.1' has"):
            cuda_mem_ops.copy_blocks([5], [0], params)
        assert driver.calls == []


@pytest.mark.parametrize(
    ("src", "dst", "error", "match"),
    [
        ([1, 2], [3], ptrres.SpecError, "2 src block ids but 1 dst block ids"),
        ([], [3], ptrres.SpecError, "0 src block ids but 1 dst"),
        ([1.0], [3], ptrres.InputTypeError, "src position 0 is not an integer: 1.0"),
        ([1] * 20, [1] * 19 + [1.5], ptrres.InputTypeError, "position 19 is not an"),
        ([1] * 20, [1] * 19 + [2**63], CopyBlockIdError, "dst position 19: block"),
        ([np.float32(1)], [1], ptrres.InputTypeError, "src position 0 is not an"),
        ([1, 4], [2, "3"], ptrres.InputTypeError, "dst position 1 is not an integer"),
        (np.array([1.0]), [3], ptrres.InputTypeError, "must be integers, not float"),
        ([[1]], [[3]], ptrres.InputTypeError, "a flat list of ints"),
        ([2, 1.5], [1, 2], ptrres.InputTypeError, "position 1 is not an integer"),
    ],
)
def test_malformed_ids_are_refused(
    src: Any, dst: Any, error: type[Exception], match: str
) -> None:
    with stubbed_simple() as driver:
        params = build(simple_caches(8, [16]), simple_caches(8, [16], seed=1))
        with pytest.raises(error, match=match):
            cuda_mem_ops.copy_blocks(src, dst, params)
        assert driver.calls == []
        assert len(run(cuda_mem_ops.copy_blocks, driver, [1], [2], params)) == 1


def test_empty_calls_submit_nothing() -> None:
    with stubbed_simple() as driver:
        params = build(simple_caches(8, [16]), simple_caches(8, [16], seed=1))
        cuda_mem_ops.copy_blocks([], [], params)
        cuda_mem_ops.copy_blocks(np.array([], np.int64), [], params)
    assert driver.calls == []


# --- coalescing --------------------------------------------------------------------


@given(copies())
def test_coalesced_descriptors_move_the_same_bytes(case: dict[str, Any]) -> None:
    """Applied as memmoves on host memory, the merged descriptors leave the
    destination as vLLM's own do (repeated destinations included: order is
    kept)."""
    with stubbed_simple(
        BatchDriver(memmove=True), max_batch=case["max_batch"]
    ) as driver:
        params, _, dst = params_of(case, coalesce=True)
        before = {name: t.clone() for name, t in dst.items()}
        vllms = run(VLLM_COPY_BLOCKS, driver, case["src"], case["dst"], params)
        expected = {name: t.clone() for name, t in dst.items()}
        for name, tensor in dst.items():
            tensor.copy_(before[name])
        ours = run(cuda_mem_ops.copy_blocks, driver, case["src"], case["dst"], params)
    for name, tensor in dst.items():
        assert torch.equal(tensor, expected[name]), name
    submitted = sum(len(c.sizes) for c in ours)
    assert submitted <= sum(len(c.sizes) for c in vllms)
    assert sum(int(c.sizes.sum()) for c in ours) == sum(
        int(c.sizes.sum()) for c in vllms
    )
    cap = case["max_batch"]
    assert all(len(c.sizes) <= cap for c in ours) or not cap


@pytest.mark.parametrize(
    ("src", "dst", "runs"),
    [
        ([3, 4, 5], [7, 8, 9], [(3, 7, 3)]),
        ([40, 39, 38], [12, 11, 10], [(38, 10, 3)]),  # from the lowest block
        ([1, 2, 3, 2, 1], [5, 6, 7, 6, 5], [(1, 5, 3), (1, 5, 2)]),
        ([1, 2, 3], [5, 6, 8], [(1, 5, 2), (3, 8, 1)]),  # a gap on one side
        ([4, 4, 5], [1, 1, 2], [(4, 1, 1), (4, 1, 2)]),  # a repeat
        ([4, 5], [2, 1], [(4, 2, 1), (5, 1, 1)]),  # the sides disagree
        ([9], [0], [(9, 0, 1)]),
    ],
)
def test_runs_merge_both_ways_per_layer(
    src: list[int], dst: list[int], runs: list[tuple[int, int, int]]
) -> None:
    block_bytes = [16, 48]
    with stubbed_simple() as driver:
        src_caches = simple_caches(64, block_bytes)
        dst_caches = simple_caches(64, block_bytes, seed=1)
        params = build(src_caches, dst_caches, coalesce=True)
        (call,) = run(cuda_mem_ops.copy_blocks, driver, src, dst, params)
    expected = [
        (
            src_caches[f"layer.{layer}"].data_ptr() + s * bpb,
            dst_caches[f"layer.{layer}"].data_ptr() + d * bpb,
            n * bpb,
        )
        for layer, bpb in enumerate(block_bytes)
        for s, d, n in runs
    ]
    assert list(zip(call.src.tolist(), call.dst.tolist(), call.sizes.tolist())) == (
        expected
    )


def test_coalescing_is_off_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    with stubbed_simple() as driver:
        params = build(simple_caches(8, [16]), simple_caches(8, [16], seed=1))
        (call,) = run(cuda_mem_ops.copy_blocks, driver, [1, 2, 3], [1, 2, 3], params)
    assert len(call.sizes) == 3


def test_a_bad_id_is_refused_when_coalescing_too() -> None:
    with stubbed_simple() as driver:
        params = build(
            simple_caches(8, [16]), simple_caches(8, [16], seed=1), coalesce=True
        )
        with pytest.raises(CopyBlockIdError, match="dst position 1: block id 8"):
            cuda_mem_ops.copy_blocks([1, 2], [7, 8], params)
        assert driver.calls == []


# --- which params get ptrres's copies ------------------------------------------------


def test_params_built_before_patch_or_used_after_unpatch_are_vllms() -> None:
    case = {"block_bytes": [8, 8], "src_blocks": 4, "dst_blocks": 4}
    with stubbed_simple() as driver:
        src = simple_caches(4, [8, 8])
        dst = simple_caches(4, [8, 8], seed=1)
        plain = cuda_mem_ops.build_params(src, dst, FakeStream())
        plugin.patch()
        # Unchecked, as vLLM's: no plan to check them with.
        run(cuda_mem_ops.copy_blocks, driver, [9], [1], plain)
        assert not hasattr(plain, PLAN_ATTRIBUTE)
        params, _, _ = params_of(case)
        plugin.unpatch()
        assert cuda_mem_ops.copy_blocks is VLLM_COPY_BLOCKS
        assert len(run(VLLM_COPY_BLOCKS, driver, [9], [1], params)) == 1


def test_params_look_like_vllms() -> None:
    with stubbed_simple():
        src, dst = simple_caches(4, [8, 24]), simple_caches(6, [8, 24], seed=1)
        plain = VLLM_BUILD_PARAMS(src, dst, FakeStream(), 1)
        plugin.patch()
        ours = cuda_mem_ops.build_params(src, dst, FakeStream(), src_access_order=1)
    assert isinstance(ours, cuda_mem_ops.BatchMemcpyParams)
    assert type(ours).__name__ == "BatchMemcpyParams"
    assert ours._fields == plain._fields
    for field in ("src_bases", "dst_bases", "bpb"):
        assert getattr(ours, field).tobytes() == getattr(plain, field).tobytes()
    assert ours.attrs.srcAccessOrder == plain.attrs.srcAccessOrder == 1
    assert (ours.num_layers, ours.stream_handle) == (2, FakeStream.cuda_stream)


def test_params_ptrres_cannot_prepare_keep_vllms_copies(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken_warmup(**kwargs: Any) -> Any:
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(_warmup, "warmup", broken_warmup)
    with stubbed_simple() as driver, caplog.at_level(logging.WARNING, "ptrres"):
        plugin.patch()
        params = cuda_mem_ops.build_params(
            simple_caches(4, [8]), simple_caches(4, [8], seed=1), FakeStream()
        )
        assert not hasattr(params, PLAN_ATTRIBUTE)
        assert len(run(cuda_mem_ops.copy_blocks, driver, [9], [1], params)) == 1
    assert "params keep vLLM's own copies: no compiler here" in caplog.text


def test_after_build_params_the_first_copy_compiles_and_imports_nothing() -> None:
    from test_vllm_startup import kernel_state

    with stubbed_simple() as driver:
        params = build(simple_caches(8, [16, 16]), simple_caches(8, [16, 16], seed=1))
        before, modules = kernel_state(), set(sys.modules)
        run(cuda_mem_ops.copy_blocks, driver, [1, 2], [3, 4], params)
        assert kernel_state() == before
        assert set(sys.modules) == modules


# --- the backends and threads ----------------------------------------------------


def counted_fills(params: Any, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of id pairs of each fill of the params' plan."""
    plan = getattr(params, PLAN_ATTRIBUTE)
    fills: list[int] = []
    fill = plan.fill

    def counted(src_ids: Any, dst_ids: Any) -> int:
        fills.append(len(src_ids))
        return int(fill(src_ids, dst_ids))

    monkeypatch.setattr(plan, "fill", counted)
    return fills


def wait_for(events: list[Any], count: int) -> None:
    deadline = time.monotonic() + 30
    while len(events) < count:
        assert time.monotonic() < deadline, "the copy thread did not finish"
        time.sleep(0.005)


def test_the_dma_backend_copies_through_the_patched_function(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    block_bytes = [64, 32]
    gpu = simple_caches(12, block_bytes, seed=2)
    cpu = simple_caches(10, block_bytes, seed=1)
    for tensor in cpu.values():
        tensor.zero_()
    with stubbed_simple(BatchDriver(memmove=True)):
        plugin.patch()
        backend = copy_backend.DmaCopyBackend()
        backend.init(gpu, cpu, torch.device("cpu"), FakeStream(), FakeStream())
        try:
            stores = counted_fills(backend._store_params, monkeypatch)
            loads = counted_fills(backend._load_params, monkeypatch)
            events: list[Any] = []
            backend.launch_copy([7, 8, 2], [0, 1, 9], True, 0, events)
            wait_for(events, 1)
            for name, tensor in gpu.items():
                assert torch.equal(cpu[name][[0, 1, 9]], tensor[[7, 8, 2]])
            backend.launch_copy([9], [11], False, 1, events)
            wait_for(events, 2)
            assert torch.equal(gpu["layer.1"][11], cpu["layer.1"][9])
        finally:
            backend.shutdown()
    assert (stores, loads) == ([3], [1])


def test_the_disk_backend_stores_and_loads_through_the_patched_function(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GPU -> pinned slot -> file, and back: one block per copy_blocks call."""
    block_bytes = [64, 192]
    gpu = simple_caches(16, block_bytes, seed=2)
    saved = {name: t.clone() for name, t in gpu.items()}
    with stubbed_simple(BatchDriver(memmove=True)):
        plugin.patch()
        backend = disk_backend.DiskBackend()
        backend.init(
            gpu, torch.device("cpu"), FakeStream(), FakeStream(),
            str(tmp_path / "kv.bin"), 8, sum(block_bytes), use_page_cache=True,
        )  # fmt: skip
        try:
            stores = counted_fills(backend._store_params, monkeypatch)
            loads = counted_fills(backend._load_params, monkeypatch)
            events: list[Any] = []
            backend.launch_copy([3, 14, 5], [0, 7, 2], True, 0, events)
            wait_for(events, 1)
            for tensor in gpu.values():
                tensor.zero_()
            backend.launch_copy([7, 0, 2], [1, 2, 3], False, 1, events)
            wait_for(events, 2)
        finally:
            backend.shutdown()
    for name, tensor in gpu.items():
        assert torch.equal(tensor[[1, 2, 3]], saved[name][[14, 3, 5]]), name
    assert stores == loads == [1, 1, 1]


def test_threads_never_share_a_buffer() -> None:
    """Two threads on two params (the disk backend's store and load threads)
    and two on one params (one DMA thread's, shared): every call hands the
    driver its own descriptors."""
    block_bytes = [24, 8, 40]
    gpu = simple_caches(64, block_bytes, seed=2)
    cpu = simple_caches(64, block_bytes, seed=1)
    lock = threading.Lock()
    seen: list[tuple[bytes, bytes, bytes]] = []

    def read(address: int, count: int) -> bytes:
        return bytes((ctypes.c_uint64 * count).from_address(address))

    def recorder(dsts: int, srcs: int, sizes: int, count: int, *others: Any) -> int:
        """Reads the arrays twice, letting other threads run in between."""
        first = (read(srcs, count), read(dsts, count), read(sizes, count))
        time.sleep(0)
        again = (read(srcs, count), read(dsts, count), read(sizes, count))
        with lock:
            seen.append(first if first == again else (b"changed", b"", b""))
        return 0

    rng = np.random.default_rng(1)
    ids = [[rng.integers(0, 64, rng.integers(1, 40)).tolist() for _ in range(40)]
           for _ in range(4)]  # fmt: skip
    with stubbed_simple(recorder):
        store, load = build(gpu, cpu), build(cpu, gpu)
        work = list(zip([store, load, store, load], ids))
        for params, worker_ids in work:  # vLLM's own, one after another
            for block_ids in worker_ids:
                VLLM_COPY_BLOCKS(block_ids, block_ids[::-1], params)
        expected, seen[:] = sorted(seen), []
        errors: list[BaseException] = []

        def copy(params: Any, worker_ids: list[list[int]]) -> None:
            try:
                for block_ids in worker_ids:
                    cuda_mem_ops.copy_blocks(block_ids, block_ids[::-1], params)
            except BaseException as error:
                errors.append(error)

        threads = [threading.Thread(target=copy, args=w) for w in work]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert errors == []
    assert sorted(seen) == expected


# --- register(): nothing imported where nothing offloads ---------------------------

# In a fresh process: register() as vLLM's loader calls it, and what it
# imported; then vLLM imports the simple path's backend, as its connector
# does, and patch() runs; then params are built, which import the kernels.
LAZY_REGISTER = """
import json, sys
import vllm  # present, as in every process that loads the plugin
if sys.argv[1] == "vllm-loader":
    import vllm.plugins
    vllm.plugins.load_general_plugins()
else:
    import ptrres.vllm
    ptrres.vllm.register()
import ptrres.vllm as plugin
from ptrres.vllm._release import PATH_MODULES
registered = {
    "numba": "numba" in sys.modules,
    "kernels": "ptrres._kernels" in sys.modules,
    "patched": plugin.is_patched(),
    "offload_modules": [
        m for ms in PATH_MODULES.values() for m in ms if m in sys.modules
    ],
}
from vllm.v1.simple_kv_offload import copy_backend, cuda_mem_ops
imported = {
    "numba": "numba" in sys.modules,
    "patched": plugin.is_patched(),
    "loader": type(copy_backend.__loader__).__name__,
}
import torch
cuda_mem_ops._batch_memcpy = (lambda *args: 0, 1)
class Stream:
    cuda_stream = 0
caches = {"layer.0": torch.zeros((4, 8), dtype=torch.int8)}
params = copy_backend.build_params(caches, dict(caches), Stream())
copy_backend.copy_blocks([1], [2], params)
built = {
    "numba": "numba" in sys.modules,
    "checked": hasattr(params, "_ptrres_copy_plan"),
}
print(json.dumps({"registered": registered, "imported": imported, "built": built}))
"""


def run_lazy(how: str, switch: str | None = None) -> dict[str, Any]:
    """LAZY_REGISTER's report, in a fresh interpreter, PTRRES_VLLM=switch."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for name in ("PTRRES_VLLM", "PTRRES_VLLM_COALESCE", "VLLM_PLUGINS"):
        env.pop(name, None)
    if switch is not None:
        env["PTRRES_VLLM"] = switch
    result = subprocess.run(
        [sys.executable, "-c", LAZY_REGISTER, how],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    report: dict[str, Any] = json.loads(result.stdout.splitlines()[-1])
    return report


@pytest.mark.parametrize("how", ["register", "vllm-loader"])
def test_register_imports_neither_numba_nor_vllms_offloading_modules(
    how: str,
) -> None:
    if how == "vllm-loader":
        from test_vllm_startup import vllm_sees_the_entry_point

        if not vllm_sees_the_entry_point():
            pytest.skip("ptrres is not installed here, so vLLM cannot find it")
    report = run_lazy(how)
    assert report["registered"] == {
        "numba": False, "kernels": False, "patched": False, "offload_modules": []
    }  # fmt: skip
    # vLLM imports its backend: patched then, still without numba; the
    # module keeps its own loader.
    assert report["imported"] == {
        "numba": False, "patched": True, "loader": "SourceFileLoader"
    }  # fmt: skip
    assert report["built"] == {"numba": True, "checked": True}


def test_ptrres_vllm_0_patches_nothing_on_import() -> None:
    report = run_lazy("register", switch="0")
    assert report["imported"]["patched"] is False
    assert report["built"]["checked"] is False


# --- the kernels' own refusals (the wrapper never meets them) --------------------


@pytest.mark.parametrize("merged", [False, True])
def test_the_kernels_refuse_outputs_they_cannot_write(merged: bool) -> None:
    from ptrres import _kernels

    layers = np.zeros((2, _kernels.COPY_COLUMNS), np.int64)
    layers[:, 2:] = 8  # 8 bytes per block, 8 blocks on each side

    def call(src: Any, dst: Any, out: Any, runs: Any = None) -> int:
        if not merged:
            return int(_kernels.copy_blocks_kernel(layers, src, dst, out))
        runs = np.zeros((3, 4), np.int64) if runs is None else runs
        return int(_kernels.copy_block_runs_kernel(layers, src, dst, -1, runs, out))

    ids = np.array([1, 2], np.int64)
    out = np.zeros((3, 4), np.uint64)
    assert call(ids, ids.copy(), out) == (2 if merged else 4)
    short = _kernels.SHORT_OUTPUTS
    assert call(ids, ids.copy(), np.zeros((3, 3), np.uint64)) == short
    assert call(ids, ids.copy(), np.zeros((2, 4), np.uint64)) == short
    assert call(ids, ids[:1].copy(), out) == short
    shared = np.zeros((3, 4), np.uint64)
    overlapping = shared.view(np.int64)[0, :2]
    assert call(overlapping, ids, shared) == _kernels.OVERLAPPING_BUFFERS
    if merged:
        assert call(ids, ids.copy(), out, np.zeros((3, 1), np.int64)) == short
        assert call(ids, ids.copy(), out, out.view(np.int64)) == (
            _kernels.OVERLAPPING_BUFFERS
        )


# --- register()'s import hook, in this process ------------------------------------


@pytest.fixture
def triggers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[str, str]]:
    """Two modules standing in for vLLM's simple offload modules: the outer
    one imports the inner one, and each notes whether vLLM was patched when
    it ran. The other paths wait for modules nobody imports."""
    outer, inner = "ptrres_trigger_outer", "ptrres_trigger_inner"
    (tmp_path / f"{inner}.py").write_text(
        "import ptrres.vllm\nPATCHED = ptrres.vllm.is_patched()\n"
    )
    (tmp_path / f"{outer}.py").write_text(
        f"import ptrres.vllm, {inner}\nPATCHED = ptrres.vllm.is_patched()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(
        _patching,
        "PATH_TRIGGERS",
        {
            path: (outer, inner) if path == _state.SIMPLE else (never(path),)
            for path in _state.PATHS
        },
    )
    monkeypatch.delenv("PTRRES_VLLM", raising=False)
    yield outer, inner
    for name in (outer, inner):
        sys.modules.pop(name, None)


def never(path: str) -> str:
    """A module nobody imports, standing in for ``path``'s trigger."""
    return "ptrres_trigger_never_" + path.replace(" ", "_")


def hooks() -> list[Any]:
    return [f for f in sys.meta_path if isinstance(f, _hook.PatchOnImport)]


def test_register_patches_once_the_last_trigger_has_run(
    triggers: tuple[str, str],
) -> None:
    import importlib

    outer, inner = triggers
    plugin.register()
    assert not plugin.is_patched()
    assert len(hooks()) == 1
    plugin.register()  # again: still one hook
    assert len(hooks()) == 1
    module = importlib.import_module(outer)
    assert plugin.is_patched()
    # Neither module saw a patch: the inner one ended while the outer ran.
    assert (module.PATCHED, sys.modules[inner].PATCHED) == (False, False)
    # The simple path alone; the hook waits for the others.
    assert [(s.path, s.status) for s in _patching.path_states()] == [
        (path, "patched" if path == _state.SIMPLE else "waiting")
        for path in _state.PATHS
    ]
    assert len(hooks()) == 1
    assert hooks()[0].triggers == {
        never(path) for path in _state.PATHS if path != _state.SIMPLE
    }
    assert type(module.__loader__).__name__ == "SourceFileLoader"
    assert module.__spec__ is not None
    assert module.__spec__.loader is module.__loader__


def test_unpatch_cancels_a_pending_patch(triggers: tuple[str, str]) -> None:
    import importlib

    plugin.register()
    plugin.unpatch()
    assert hooks() == []
    importlib.import_module(triggers[0])
    assert not plugin.is_patched()


def test_a_trigger_imported_already_patches_at_once(
    triggers: tuple[str, str],
) -> None:
    import importlib

    importlib.import_module(triggers[1])
    plugin.register()
    assert _state.patched(_state.SIMPLE)
    assert not _state.patched(_state.HANDLER)
    assert len(hooks()) == 1  # the other paths wait


def test_the_wrapped_loader_answers_as_the_modules_own() -> None:
    import importlib.machinery

    spec = importlib.machinery.PathFinder.find_spec("json")
    assert spec is not None
    wrapped = _hook.ThenPatch(spec.loader)
    assert wrapped.is_package("json") is spec.loader.is_package("json")  # type: ignore[union-attr]
    assert wrapped.get_filename("json") == spec.origin
