"""`ptrres bench` and `ptrres explain`, end to end, and the model presets."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

import ptrres
from ptrres._cli import main
from ptrres.bench import PRESETS, VirtualTensor

KiB = 1024


def test_presets_match_the_spec() -> None:
    """SPEC section 8: groups x refs and the page of each ref."""
    expected = {
        "llama-3.1-8b": (1, 32, {64 * KiB}),
        "llama-3.1-8b-split": (1, 64, {32 * KiB}),
        "llama-3.1-70b": (1, 80, {64 * KiB}),
        "llama-3.1-70b-tp4": (1, 160, {8 * KiB}),
        "qwen2.5-7b": (1, 28, {32 * KiB}),
        "deepseek-v3-mla": (1, 61, {18432}),
        "hybrid-4x12": (4, 12, {32 * KiB, 64 * KiB}),
    }
    assert set(PRESETS) == set(expected)
    for name, (groups, refs, pages) in expected.items():
        kv = PRESETS[name].kv_caches(num_blocks=8)
        assert len(kv.group_data_refs) == groups, name
        assert {len(g) for g in kv.group_data_refs} == {refs}, name
        assert {r.page_size_bytes for g in kv.group_data_refs for r in g} == pages, name
    # Hybrid: tensor i is shared by layer i of every group.
    hybrid = PRESETS["hybrid-4x12"].kv_caches(num_blocks=8)
    assert len(hybrid.tensors) == 12
    assert all(
        [r.tensor_idx for r in g] == list(range(12)) for g in hybrid.group_data_refs
    )


def test_virtual_tensors_never_overlap() -> None:
    for preset in PRESETS.values():
        kv = preset.kv_caches()
        spans = sorted(
            (
                t.tensor.data_ptr(),
                t.tensor.data_ptr() + t.tensor.shape[0] * t.tensor.stride(0),
            )
            for t in kv.tensors
        )
        offloaded = sorted(
            (t.data_ptr(), t.data_ptr() + t.shape[0] * t.stride(0))
            for t in preset.offloaded_tensors(4)
        )
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert end <= start
        assert offloaded[-1][1] <= spans[0][0]
    assert "VirtualTensor(0x" in repr(VirtualTensor(0x1000, 4, 8))


def test_bench_quick_end_to_end(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bench.json"
    plot = tmp_path / "bench.png"
    status = main(
        ["bench", "--quick", "--preset", "qwen2.5-7b", "--blocks", "4,1",
         "--json", str(out), "--plot", str(plot)]
    )  # fmt: skip
    assert status == 0
    printed = capsys.readouterr()
    assert "qwen2.5-7b" in printed.out
    assert "speedup" in printed.out
    assert "[6/6] qwen2.5-7b coalesce 4 blocks" in printed.err  # progress
    results = json.loads(out.read_text())
    assert {"date", "ptrres", "numpy", "numba", "python", "cpu", "cpu_count"} <= set(
        results["environment"]
    )
    assert results["settings"]["blocks"] == [1, 4]
    rows = results["results"]
    assert [(r["operation"], r["blocks_per_group"]) for r in rows] == [
        (op, b) for op in ("resolve", "plan", "coalesce") for b in (1, 4)
    ]
    for row in rows:
        assert row["preset"] == "qwen2.5-7b"
        assert row["ops"] == row["blocks_per_group"] * 28
        assert 0 < row["descriptors"] <= row["ops"]
        assert row["reference_seconds"] > 0
        assert row["ptrres_seconds"] > 0
        assert row["speedup"] == pytest.approx(
            row["reference_seconds"] / row["ptrres_seconds"]
        )
        # The fill limit is measured at the largest size only.
        assert (row["fill_seconds"] is not None) == (row["blocks_per_group"] == 4)
    # make_spec hands out runs of consecutive blocks: coalescing merges them.
    coalesce_4 = rows[-1]
    assert coalesce_4["descriptors"] == 28
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_python_dash_m_runs_the_same_command(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "ptrres", "bench", "--quick", "--preset", "hybrid-4x12",
         "--blocks", "2", "--operation", "plan", "--json", str(tmp_path / "r.json")],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert "hybrid-4x12" in result.stdout
    (row,) = json.loads((tmp_path / "r.json").read_text())["results"]
    assert (row["operation"], row["ops"]) == ("plan", 2 * 48)


def test_explain_prints_offsets_of_each_block(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["explain", "--preset", "llama-3.1-8b", "--blocks", "3,7,9"]) == 0
    text = capsys.readouterr().out
    rows = [line.split() for line in text.splitlines() if line[:5].strip().isdigit()]
    assert len(rows) == 32 * 3
    for group, ref, tensor, block, stride, offset, size in rows:
        assert int(group) == 0
        assert int(ref) == int(tensor)
        assert int(offset.replace(",", "")) == int(block) * int(stride.replace(",", ""))
        assert int(size.replace(",", "")) == 64 * KiB
    assert "96 descriptors" in text


def test_explain_on_several_groups(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "--preset", "hybrid-4x12", "--blocks", "5"]) == 0
    text = capsys.readouterr().out
    assert "4 group(s) x 12 refs" in text
    assert "48 descriptors" in text


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "--blocks", "1,x"],
        ["bench", "--blocks", "-3"],
        ["bench", "--preset", "gpt-9"],
        [],
    ],
)
def test_bad_arguments_exit_with_usage(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2


def test_version_is_the_package_version() -> None:
    from importlib.metadata import version

    assert ptrres.__version__ == version("ptrres")
