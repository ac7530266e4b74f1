"""`ptrres bench`, `explain`, `warmup` and `check`, end to end, and the model
presets."""

from __future__ import annotations

import importlib.metadata
import io
import itertools
import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numba
import pytest

import ptrres
from ptrres._cli import main
from ptrres._config import KERNELS
from ptrres._operator import check_command, probe_findings
from ptrres.bench import PRESETS, VirtualTensor
from ptrres.vllm._state import PATHS

ROOT = Path(__file__).resolve().parents[1]

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


# --- `ptrres warmup` and `ptrres check` -----------------------------------------

JIT_DISABLED = os.environ.get("NUMBA_DISABLE_JIT", "0") not in ("", "0")
SIGNATURES = sum(len(signatures) for _, signatures in KERNELS)


def test_warmup_says_what_it_made_ready_and_where_the_cache_is(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status = main(["warmup", "--processes", "1"])
    text = capsys.readouterr().out
    if JIT_DISABLED:
        assert status == 1
        assert "NUMBA_DISABLE_JIT is set" in text
        return
    assert status == 0
    first, *rows = text.splitlines()
    assert re.fullmatch(
        rf"ptrres warmup: {SIGNATURES} kernel signatures \(.*\) in \d+\.\d\d s", first
    )
    counted = {}
    for row in rows[:-2]:
        how, count, names = row.split(maxsplit=2)
        counted[how] = int(count)
        assert set(re.sub(r" \(\d+\)", "", names).split(", ")) <= {
            d.__name__ for d, _ in KERNELS
        }
    assert sum(counted.values()) == SIGNATURES
    assert set(counted) <= {"compiled", "loaded", "ready"}
    cache = KERNELS[0][0].stats.cache_path
    assert rows[-2].startswith(f"Numba's cache: {cache} (NUMBA_CACHE_DIR")
    assert "on another CPU model the kernels compile again" in rows[-1]


def test_warmup_exits_non_zero_where_nothing_can_be_cached(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from ptrres import _config, _operator

    monkeypatch.setattr(_config, "cache_refused", "no locator available")
    monkeypatch.setattr(_operator, "_jit_disabled", lambda: False)
    assert main(["warmup"]) == 1
    text = capsys.readouterr().out
    assert "Numba cannot cache here (no locator available)" in text
    assert "Set NUMBA_CACHE_DIR to a writable directory" in text
    assert "kernel signatures" not in text  # nothing compiled for nothing


def test_warmup_refuses_a_processes_count_below_one() -> None:
    with pytest.raises(SystemExit, match="at least 1"):
        main(["warmup", "--processes", "0"])


def test_the_warmup_command_runs_in_a_fresh_process(tmp_path: Path) -> None:
    """`python -m ptrres warmup` on an empty cache, then again: what it
    compiled the first time, it loads the second."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    runs = [
        subprocess.run(
            [sys.executable, "-m", "ptrres", "warmup"],
            capture_output=True,
            text=True,
            env=env,
            cwd=ROOT,
            check=False,
        )
        for _ in range(2)
    ]
    if JIT_DISABLED:
        assert [run.returncode for run in runs] == [1, 1]
        return
    assert [run.returncode for run in runs] == [0, 0], runs[0].stderr
    assert f"({SIGNATURES} compiled)" in runs[0].stdout
    assert f"({SIGNATURES} loaded)" in runs[1].stdout
    assert f"Numba's cache: {tmp_path}" in runs[1].stdout


def check(*argv: str) -> tuple[int, dict[str, tuple[str, str]], str]:
    """`ptrres check`'s exit status, its findings by topic, and its text."""
    out = io.StringIO()
    status = check_command(out, kernels="--no-kernels" not in argv)
    text = out.getvalue()
    findings = {}
    for line in text.splitlines()[1:-1]:
        status_word, rest = line.split(maxsplit=1)
        topic, detail = re.split(r"\s{2,}", rest, maxsplit=1)
        findings[topic] = (status_word, detail)
    return status, findings, text


@pytest.fixture
def vllm_env(monkeypatch: pytest.MonkeyPatch) -> Any:
    """vLLM installed, ptrres's entry point visible to it, switches unset."""
    pytest.importorskip("vllm.v1.kv_offload.cpu.gpu_worker")
    for name in ("PTRRES_VLLM", "PTRRES_VLLM_COALESCE", "VLLM_PLUGINS"):
        monkeypatch.delenv(name, raising=False)
    ours = importlib.metadata.EntryPoint(
        "ptrres", "ptrres.vllm:register", "vllm.general_plugins"
    )
    real = importlib.metadata.entry_points

    def entry_points(**selection: Any) -> Any:
        if selection.get("group") == "vllm.general_plugins":
            return [ours]
        return real(**selection)

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    return monkeypatch


def test_check_says_the_plugin_will_patch(vllm_env: Any) -> None:
    status, findings, text = check("--no-kernels")
    import vllm

    assert status == 0, text
    assert text.splitlines()[-1] == (
        "The plugin will patch vLLM in every process vLLM starts."
    )
    assert findings["vLLM"][0] == "ok"
    assert findings["vLLM"][1].startswith(f"{vllm.__version__}, a tested release")
    assert findings["entry point"] == (
        "ok",
        "ptrres = ptrres.vllm:register in vllm.general_plugins",
    )
    assert findings["VLLM_PLUGINS"][0] == "ok"
    # The handler's form: vLLM 0.34's takes DevicePointers from its worker.
    gpu_worker = "vllm.v1.kv_offload.cpu.gpu_worker"
    assert findings["offloading handler"] == (
        "ok",
        "patched once vLLM imports gpu_worker: "
        + (
            "CPUOffloadingWorker.__init__, "
            "SingleDirectionOffloadingHandler.transfer_async, "
            f"{gpu_worker}.iter_pointer_groups"
            if hasattr(sys.modules[gpu_worker], "iter_pointer_groups")
            else "SingleDirectionOffloadingHandler.__init__, "
            "SingleDirectionOffloadingHandler.transfer_async"
        ),
    )
    assert findings["NIXL connector"] == (
        "ok",
        "patched once vLLM imports pull_worker or push_worker: "
        "NixlBaseConnectorWorker.__init__, NixlBaseConnectorWorker._compute_desc_ids, "
        "NixlPullConnectorWorker._read_blocks, NixlPushConnectorWorker._xfer_blocks "
        "(NixlConnector, pull and push): every block id checked on both sides",
    )
    assert findings["PTRRES_VLLM"][1].startswith("unset: the plugin is on")
    assert findings["PTRRES_VLLM_COALESCE"][1].startswith("unset: coalescing off")
    assert findings["PTRRES_VLLM_NIXL"] == (
        "ok",
        "unset: on for vLLM's NIXL connector (PTRRES_VLLM_NIXL=0 leaves it alone)",
    )
    assert findings["numba"] == ("ok", numba.__version__)
    if JIT_DISABLED:
        assert findings["Numba cache"][0] == "warn"
        assert "NUMBA_DISABLE_JIT" in findings["Numba cache"][1]
    else:
        assert findings["Numba cache"] == (
            "ok",
            f"{KERNELS[0][0].stats.cache_path} (NUMBA_CACHE_DIR unset), writable"
            if "NUMBA_CACHE_DIR" not in os.environ
            else f"{KERNELS[0][0].stats.cache_path} "
            f"(NUMBA_CACHE_DIR={os.environ['NUMBA_CACHE_DIR']}), writable",
        )
    assert "kernels" not in findings  # --no-kernels


@pytest.mark.parametrize(
    ("variable", "value", "topic"),
    [
        ("PTRRES_VLLM", "0", "PTRRES_VLLM"),
        ("PTRRES_VLLM", "off", "PTRRES_VLLM"),
        ("VLLM_PLUGINS", "lora_filesystem_resolver", "VLLM_PLUGINS"),
        ("VLLM_PLUGINS", "", "VLLM_PLUGINS"),  # vLLM reads it as [""]: none
    ],
)
def test_check_names_the_switch_that_keeps_the_plugin_off(
    variable: str, value: str, topic: str, vllm_env: Any
) -> None:
    vllm_env.setenv(variable, value)
    status, findings, text = check("--no-kernels")
    assert status == 1
    assert findings[topic][0] in ("off", "no")
    assert text.splitlines()[-1] == f"The plugin will not patch vLLM: {topic}."


def test_check_with_coalescing_on_and_ptrres_allowed(vllm_env: Any) -> None:
    vllm_env.setenv("PTRRES_VLLM_COALESCE", "1")
    vllm_env.setenv("VLLM_PLUGINS", "lora_filesystem_resolver,ptrres")
    status, findings, _ = check("--no-kernels")
    assert status == 0
    assert findings["PTRRES_VLLM_COALESCE"][1].startswith("1: coalescing on")
    assert findings["VLLM_PLUGINS"] == (
        "ok",
        "lora_filesystem_resolver,ptrres: includes it",
    )


def test_check_without_the_entry_point(vllm_env: Any) -> None:
    vllm_env.setattr(importlib.metadata, "entry_points", lambda **selection: [])
    status, findings, _ = check("--no-kernels")
    assert status == 1
    assert findings["entry point"] == (
        "no",
        "none in vllm.general_plugins: install ptrres into vLLM's environment",
    )


TESTED = "0.30.0, 0.31.0, 0.32.0, 0.33.0, 0.34.0"


def test_check_on_an_untested_vllm_with_tested_code(vllm_env: Any) -> None:
    """A version ptrres was not tested against is a warning, not a block:
    each path whose code is a tested release's is patched, and its line
    says whose."""
    import vllm

    installed = vllm.__version__
    real = importlib.metadata.version
    vllm_env.setattr(
        importlib.metadata,
        "version",
        lambda name: "0.40.0" if name == "vllm" else real(name),
    )
    vllm_env.setattr(vllm, "__version__", "0.40.0")
    status, findings, text = check("--no-kernels")
    assert status == 0, text
    assert findings["vLLM"] == (
        "warn",
        f"0.40.0, not a tested release ({TESTED}): each path is patched where "
        "its code is a tested release's",
    )
    assert findings["offloading handler"][0] == "ok"
    assert (
        f" (vLLM 0.40.0 is untested; its code here is {installed}'s): "
        in findings["offloading handler"][1]
    )
    assert text.splitlines()[-1] == (
        "The plugin will patch vLLM in every process vLLM starts."
    )


def test_check_on_a_missing_vllm(vllm_env: Any) -> None:
    real = importlib.metadata.version

    def fake_version(name: str) -> str:
        if name == "vllm":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    vllm_env.setattr(importlib.metadata, "version", fake_version)
    status, findings, text = check("--no-kernels")
    assert status == 1
    assert findings["vLLM"] == ("no", f"not installed here (tested: {TESTED})")
    assert "offloading handler" not in findings
    assert text.splitlines()[-1] == "The plugin will not patch vLLM: vLLM."


def test_check_names_a_handler_that_changed(vllm_env: Any) -> None:
    import vllm
    from vllm.v1.kv_offload.cpu.gpu_worker import SingleDirectionOffloadingHandler

    def transfer_async(self: Any, job_id: int, spec: Any) -> bool:
        return True

    vllm_env.setattr(SingleDirectionOffloadingHandler, "transfer_async", transfer_async)
    status, findings, text = check("--no-kernels")
    assert status == 1
    assert findings["offloading handler"] == (
        "no",
        f"left as vLLM has it: vLLM {vllm.__version__} (a tested release) has "
        "other code here than every tested release; closest, "
        f"{vllm.__version__}: gpu_worker.SingleDirectionOffloadingHandler."
        "transfer_async has other code",
    )
    # The other paths are patched on their own (those this vLLM has).
    others = [
        topic
        for topic, (status_word, _) in findings.items()
        if status_word == "ok" and topic in PATHS
    ]
    assert {"simple offload path", "NIXL connector"} <= set(others)
    patched = " and ".join([", ".join(others[:-1]), others[-1]])
    assert text.splitlines()[-1] == (
        f"The plugin will patch vLLM's {patched}, and leave its offloading "
        "handler as vLLM has it (why: above)."
    )


def test_check_finds_a_cold_cache_then_a_warm_one(
    vllm_env: Any, tmp_path: Path
) -> None:
    """A fresh interpreter warms up: on an empty cache it compiles (and fills
    the cache), the next check loads everything."""
    vllm_env.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    cold = check()
    warm = check()
    for status, findings, text in (cold, warm):
        assert status == 0, text
        if not JIT_DISABLED:
            assert findings["Numba cache"][1].startswith(f"{tmp_path}")
    if JIT_DISABLED:
        assert "kernels" not in cold[1]
        return
    assert cold[1]["kernels"][0] == "warn"
    assert cold[1]["kernels"][1].startswith(
        f"cold: {SIGNATURES} of {SIGNATURES} signatures compiled, into the cache"
    )
    assert warm[1]["kernels"][0] == "ok"
    assert warm[1]["kernels"][1].startswith(
        f"warm: {SIGNATURES} of {SIGNATURES} signatures loaded"
    )


def test_check_reports_a_numba_cache_dir_numba_passed_over(
    vllm_env: Any, tmp_path: Path
) -> None:
    """A NUMBA_CACHE_DIR that cannot be made (a file is in the way): Numba
    silently caches elsewhere (or nowhere), and the check says so."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    vllm_env.setenv("NUMBA_CACHE_DIR", str(blocker / "cache"))
    status, findings, _ = check("--no-kernels")
    assert status == 0  # the plugin still patches
    if JIT_DISABLED:
        return
    state, detail = findings["Numba cache"]
    assert state == "warn"
    assert "NUMBA_CACHE_DIR is not used (Not a directory)" in detail or (
        detail.startswith("none: ")
    )
    assert str(blocker / "cache") not in detail.split(" (NUMBA_CACHE_DIR=")[0]


def test_a_writable_folder_is_told_from_one_that_cannot_be_made(
    tmp_path: Path,
) -> None:
    from ptrres._operator import _writable

    assert _writable(str(tmp_path / "new" / "cache")) is None
    assert (tmp_path / "new" / "cache").is_dir()
    (tmp_path / "file").write_text("")
    assert _writable(str(tmp_path / "file" / "cache")) is not None


def probe(**fields: Any) -> dict[str, Any]:
    """A numba_probe() report, as a fresh interpreter would send it."""
    return {
        "numba": "0.65.0",
        "jit_disabled": False,
        "cache_refused": None,
        "cache_paths": [],
        **fields,
    }


def findings_of(report: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {f.topic: (f.status, f.detail) for f in probe_findings(report)}


def test_probe_findings_warm_cold_and_uncached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    cache = str(tmp_path / "ptrres_kernels")
    warm = findings_of(
        probe(cache_paths=[cache], counts={"loaded": 7}, signatures=7, seconds=0.06)
    )
    assert warm["numba"] == ("ok", "0.65.0")
    assert warm["Numba cache"] == (
        "ok",
        f"{cache} (NUMBA_CACHE_DIR={tmp_path}), writable",
    )
    assert warm["kernels"][0] == "ok"
    assert warm["kernels"][1].startswith("warm: 7 of 7 signatures loaded, in 0.06 s")
    assert "another CPU model recompiles" in warm["kernels"][1]
    cold = findings_of(
        probe(
            cache_paths=[cache],
            counts={"compiled": 5, "loaded": 2},
            signatures=7,
            seconds=3.1,
        )
    )
    assert cold["kernels"][0] == "warn"
    assert cold["kernels"][1].startswith(
        "cold: 5 of 7 signatures compiled, into the cache (a second check finds "
        "it warm), in 3.10 s"
    )
    uncached = findings_of(
        probe(
            cache_refused="no locator available",
            counts={"compiled": 7},
            signatures=7,
            seconds=3.0,
        )
    )
    assert uncached["Numba cache"] == (
        "warn",
        "none: no locator available; every process compiles",
    )
    assert uncached["kernels"][1].startswith("cold: 7 of 7 signatures compiled, in")
    assert "kernels" not in findings_of(probe(cache_paths=[cache]))  # --no-kernels


def test_probe_findings_on_a_cache_numba_cannot_use(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "file" / "cache"))
    elsewhere = str(tmp_path / "pycache")
    state, detail = findings_of(probe(cache_paths=[elsewhere]))["Numba cache"]
    assert state == "warn"
    assert detail.startswith(f"{elsewhere} (NUMBA_CACHE_DIR={tmp_path / 'file'}")
    assert detail.endswith("; NUMBA_CACHE_DIR is not used (Not a directory)")
    monkeypatch.delenv("NUMBA_CACHE_DIR")
    blocked = str(tmp_path / "file" / "pycache")
    state, detail = findings_of(probe(cache_paths=[blocked]))["Numba cache"]
    assert state == "warn"
    assert detail == (
        f"{blocked} (NUMBA_CACHE_DIR unset); {blocked} is not writable: Not a directory"
    )
    state, detail = findings_of(probe(jit_disabled=True))["Numba cache"]
    assert (state, detail.split(",")[0]) == ("warn", "none: NUMBA_DISABLE_JIT is set")


@pytest.mark.parametrize("failure", ["no interpreter", "a failing interpreter"])
def test_check_says_when_the_fresh_interpreter_fails(
    failure: str, vllm_env: Any
) -> None:
    from ptrres import _operator

    if failure == "no interpreter":
        vllm_env.setattr(sys, "executable", "/nonexistent/python")
    else:
        vllm_env.setattr(_operator, "_PROBE", "import sys; sys.exit('no numba here')")
    status, findings, _ = check("--no-kernels")
    assert status == 0  # the plugin would still patch
    assert findings["kernels"][0] == "warn"
    assert "numba" not in findings
    if failure != "no interpreter":
        assert findings["kernels"][1] == (
            "a fresh interpreter could not warm up ptrres: no numba here"
        )


def test_numba_probe_in_this_process() -> None:
    from ptrres._operator import numba_probe

    quick = numba_probe(kernels=False)
    assert quick["numba"] == numba.__version__
    assert quick["jit_disabled"] is JIT_DISABLED
    assert "counts" not in quick
    full = numba_probe(kernels=True)
    assert full["signatures"] == SIGNATURES == sum(full["counts"].values())
    assert full["seconds"] >= 0
    if JIT_DISABLED:
        assert full["counts"] == {"interpreted": SIGNATURES}
        assert full["cache_paths"] == []
    else:
        assert full["cache_paths"] == [str(KERNELS[0][0].stats.cache_path)]


def test_warmup_report_lists_each_kernel_under_how_it_was_made_ready(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The listing itself, with or without the JIT (without it, each kernel
    is "interpreted" and the cache is nobody's)."""
    from ptrres import _operator

    monkeypatch.setattr(_operator, "_jit_disabled", lambda: False)
    monkeypatch.setattr(_operator, "_cache_refused", lambda: None)
    assert main(["warmup", "--processes", "1"]) == 0
    rows = capsys.readouterr().out.splitlines()[1:-2]
    listed, names = {}, []
    for row in rows:
        how, count, kernels = row.split(maxsplit=2)
        listed[how] = int(count)
        names += kernels.split(", ")
    assert sum(listed.values()) == SIGNATURES
    if JIT_DISABLED:
        assert set(listed) == {"interpreted"}
    else:
        assert set(listed) <= {"compiled", "loaded", "ready"}
    # Each kernel by name, with its count of signatures where it has several.
    per_kernel: Counter[str] = Counter()
    for entry in names:
        name, count = re.fullmatch(r"(\w+)(?: \((\d+)\))?", entry).groups()  # type: ignore[union-attr]
        per_kernel[name] += int(count or 1)
    assert per_kernel == Counter({d.__name__: len(sigs) for d, sigs in KERNELS})
