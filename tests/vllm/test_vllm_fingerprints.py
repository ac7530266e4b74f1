"""The fingerprints that make a release a tested one (issue 39, item 4).

A path is patched where the fingerprint of the vLLM code it depends on (each
function's definition site and source text, ``ptrres.vllm._fingerprint``)
equals one recorded for a tested release in ``fingerprints.json``, whatever
the version string says. Here, on every release CI installs:

- the record of the installed release is its code's (what keeps the record
  true), and every record names the code its variant depends on;
- a copy of the installed vLLM (a tree of symlinks into it, in tmp_path)
  under another version string, imported in a fresh process: every path it
  has is patched as the tested release whose code it has, and ``ptrres
  check`` says so;
- the same copy with the body of one replaced function changed (a real file
  for that module): that path alone is left alone, with one warning naming
  it and what differs;
- a comment or a docstring is source text: changing one changes the
  fingerprint. Deliberately conservative: ptrres cannot tell a comment that
  documents a new behaviour from one that does not, and a release that
  touched a function was not tested with this patch. Trailing whitespace is
  not (lines are compared right-stripped);
- what fingerprinting costs, path by path (printed, not asserted).
"""

from __future__ import annotations

import ast
import inspect
import json
import linecache
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_vllm_patch import (
    ABSENT,
    ALL_PATCHES,
    INSTALLED,
    PRESENT,
    matching_release,
    patches_but,
    recorded_releases,
    version_key,
)
from vllm_harness import worker

import ptrres.vllm as plugin
from ptrres.vllm import _fingerprint, _patching, _record
from ptrres.vllm._fingerprint import fingerprint
from ptrres.vllm._release import match_path, path_code
from ptrres.vllm._state import HANDLER, PATHS, Match

ROOT = Path(__file__).resolve().parents[2]
Handler = worker.SingleDirectionOffloadingHandler
HANDLER_VARIANT = matching_release(HANDLER)[1]
UNTESTED = "0.35.0"


@pytest.fixture(autouse=True)
def _unpatched() -> Iterator[None]:
    plugin.unpatch()
    _patching._warned.clear()
    yield
    plugin.unpatch()


# --- the record ------------------------------------------------------------------


def test_the_record_of_this_release_is_its_code() -> None:
    """What `python -m ptrres.vllm._record` would write for the installed
    release is what fingerprints.json holds: every path it has, the form of
    the patch made for it, and the fingerprint of each piece of code."""
    recorded = recorded_releases()[INSTALLED]
    installed = _record.fingerprints_of_installed()
    assert list(installed) == list(PRESENT)
    for path in PRESENT:
        assert installed[path]["variant"] == recorded[path]["variant"], path
        have, want = installed[path]["fingerprint"], recorded[path]["fingerprint"]
        changed = sorted(
            k for k in have.keys() | want.keys() if have.get(k) != want.get(k)
        )
        assert changed == [], (
            f"{path}: re-record {INSTALLED} "
            "(PTRRES_VLLM=0 python -m ptrres.vllm._record)"
        )


def test_every_record_names_the_code_its_variant_depends_on() -> None:
    """Each tested release's record of each path has one fingerprint per
    piece of code that path's form names today: a code list changed without
    a new record fails here, on every release."""
    for release, paths in recorded_releases().items():
        for path, entry in paths.items():
            code = path_code(path, entry["variant"])
            assert list(entry["fingerprint"]) == list(dict.fromkeys(code.locators())), (
                release,
                path,
            )


# --- source text: a comment, a docstring ------------------------------------------


def with_doc(variant: str) -> Any:
    """A function defined in gpu_worker that the handler's form depends on
    and that has a docstring (transfer_async has none)."""
    for locator in path_code(HANDLER, variant).locators():
        module, _, qualname = locator.partition(":")
        if module != worker.__name__:
            continue
        found: Any = worker
        for part in qualname.split("."):
            found = getattr(found, part, None)
        # Defined there (not a binding of pointer_utils' functions).
        if inspect.isfunction(found) and found.__doc__ and found.__module__ == module:
            return found
    raise AssertionError("no function with a docstring")


def edit_line(
    function: Any, monkeypatch: pytest.MonkeyPatch, edit: str
) -> tuple[str, str]:
    """Change one line of ``function``'s source where the fingerprint reads
    it (linecache, as if the file said so; no line added, so every other
    function keeps its lines). Returns the phrase naming it and the line."""
    code = function.__code__
    original = linecache.getlines(code.co_filename)
    lines = list(original)
    index = code.co_firstlineno - 1
    if edit == "docstring":
        first = function.__doc__.strip().splitlines()[0]
        index = next(i for i in range(index, len(lines)) if first in lines[i])
        lines[index] = lines[index].replace(first, f"{first} (said otherwise)", 1)
    elif edit == "comment":
        lines[index] = lines[index].rstrip("\n") + "  # another comment\n"
    else:  # trailing whitespace
        lines[index] = lines[index].rstrip("\n") + "   \n"
    assert len(lines) == len(original)
    assert [i for i, (a, b) in enumerate(zip(lines, original)) if a != b] == [index]
    monkeypatch.setitem(
        linecache.cache,
        code.co_filename,
        (len("".join(lines)), None, lines, code.co_filename),
    )
    qualname = f"{function.__module__.rpartition('.')[2]}.{function.__qualname__}"
    return qualname, lines[index]


@pytest.mark.parametrize(
    ("edit", "changes"),
    [("comment", True), ("docstring", True), ("trailing whitespace", False)],
)
def test_a_comment_or_a_docstring_is_a_change(
    edit: str, changes: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fingerprint is the source text: one comment or docstring line
    changed leaves the path alone, naming the function (ptrres cannot tell
    which comments matter); trailing whitespace changes nothing."""
    function = (
        with_doc(HANDLER_VARIANT) if edit == "docstring" else Handler.transfer_async
    )
    qualname, _ = edit_line(function, monkeypatch, edit)
    found = match_path(HANDLER)
    if not changes:
        assert isinstance(found, Match)
        return
    # Closest: the installed release (one difference), tried first.
    assert found == (
        f"vLLM {INSTALLED} (a tested release) has other code here than every "
        f"tested release; closest, {INSTALLED}: {qualname} has other code"
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert plugin.patch() == patches_but(HANDLER)
    assert [
        str(w.message) for w in caught if w.category is plugin.VllmPatchWarning
    ] == [f"ptrres.vllm left vLLM's {HANDLER} unpatched: {found}"]


# --- a copy of the installed vLLM, in a fresh process -------------------------------


def shadow(source: Path, target: Path, real: dict[Path, str]) -> None:
    """``target`` as a copy of the directory ``source``: a symlink for each
    entry, but for the files of ``real`` (relative path: text), written out,
    and the directories that hold them, made (their __pycache__ without
    those files' bytecode, which would be stale)."""
    target.mkdir()
    stems = {p.stem for p in real if len(p.parts) == 1}
    for entry in sorted(source.iterdir()):
        name = Path(entry.name)
        below = {
            p.relative_to(name): t for p, t in real.items() if p.parts[0] == entry.name
        }
        if name in real:
            (target / name).write_text(real[name])
        elif below:
            shadow(entry, target / name, below)
        elif entry.name == "__pycache__" and stems:
            (target / name).mkdir()
            for pyc in entry.iterdir():
                if pyc.name.split(".")[0] not in stems:
                    (target / name / pyc.name).symlink_to(pyc)
        else:
            (target / name).symlink_to(entry)


def edited_body(function: Any) -> str:
    """The source of ``function``'s module with a statement added at the
    end of its body: another release's code for that function alone."""
    module = sys.modules[function.__module__]
    path = Path(module.__file__ or "")
    lines = path.read_text().splitlines(keepends=True)
    start = function.__code__.co_firstlineno
    source = textwrap.dedent("".join(inspect.getsourcelines(function)[0]))
    tree = ast.parse(source).body[0]
    assert isinstance(tree, ast.FunctionDef)
    last = tree.body[-1]
    assert last.end_lineno is not None
    indent = " " * (
        len(lines[start - 1]) - len(lines[start - 1].lstrip()) + last.col_offset
    )
    at = start - 1 + last.end_lineno
    lines.insert(at, f"{indent}pass  # another release's body\n")
    return "".join(lines)


def vllm_copy(root: Path, version: str, edited: Any = None) -> Path:
    """A site directory under ``root`` holding a copy of the installed vLLM
    whose version is ``version`` (``vllm/_version.py``, and its dist-info
    for importlib.metadata), with ``edited``'s body changed (``edited_body``).
    Returns the directory to put first on PYTHONPATH."""
    import vllm

    package = Path(vllm.__file__ or "").parent
    site = root / "site"
    site.mkdir(parents=True)
    old_tuple = tuple(int(part) for part in INSTALLED.split("."))
    new_tuple = tuple(int(part) for part in version.split("."))
    version_text = (package / "_version.py").read_text()
    new_text = version_text.replace(f"'{INSTALLED}'", f"'{version}'").replace(
        f"= {old_tuple}", f"= {new_tuple}"
    )
    assert new_text.count(version) == 1
    assert str(new_tuple) in new_text
    real = {Path("_version.py"): new_text}
    if edited is not None:
        module_file = Path(sys.modules[edited.__module__].__file__ or "")
        real[module_file.relative_to(package)] = edited_body(edited)
    shadow(package, site / "vllm", real)
    dist_info = package.parent / f"vllm-{INSTALLED}.dist-info"
    copied = site / f"vllm-{version}.dist-info"
    copied.mkdir()
    for entry in dist_info.iterdir():
        if entry.name == "METADATA":
            text = entry.read_text()
            assert f"\nVersion: {INSTALLED}\n" in text
            (copied / entry.name).write_text(
                text.replace(f"\nVersion: {INSTALLED}\n", f"\nVersion: {version}\n", 1)
            )
        else:
            (copied / entry.name).symlink_to(entry)
    return site


# In the copy: `ptrres check` (ptrres's entry point visible to vLLM), then
# patch(), with every warning; the paths as patch() left them.
IN_THE_COPY = """
import importlib.metadata, io, json, os, sys, warnings
real = importlib.metadata.entry_points
group = "vllm.general_plugins"
if not any(ep.value == "ptrres.vllm:register" for ep in real(group=group)):
    ours = importlib.metadata.EntryPoint("ptrres", "ptrres.vllm:register", group)
    importlib.metadata.entry_points = (
        lambda **selection: [ours] if selection.get("group") == group
        else real(**selection)
    )
import vllm
from ptrres._operator import check_command
out = io.StringIO()
status = check_command(out, kernels=False)
import ptrres.vllm as plugin
from ptrres.vllm import _patching
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    names = plugin.patch()
from vllm.v1.kv_offload.cpu import gpu_worker
print(json.dumps({
    "vllm": vllm.__file__,
    "gpu_worker": [
        gpu_worker.__file__,
        os.path.islink(gpu_worker.__file__),
        os.path.realpath(gpu_worker.__file__),
    ],
    "version": [vllm.__version__, importlib.metadata.version("vllm")],
    "check": {"status": status, "text": out.getvalue()},
    "names": names,
    "warnings": [
        str(w.message) for w in caught if type(w.message).__name__ == "VllmPatchWarning"
    ],
    "states": {
        s.path: [s.status, *(
            [] if s.match is None
            else [s.match.release, s.match.variant, s.match.installed]
        )]
        for s in _patching.path_states()
    },
}))
"""


@pytest.fixture(scope="module")
def copies(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """IN_THE_COPY's reports, each in a fresh process, both at once: the
    installed vLLM as UNTESTED ("renamed"), and so with the handler's
    transfer_async changed ("edited"). Also how long it took."""
    start = time.perf_counter()
    sites = {
        "renamed": vllm_copy(tmp_path_factory.mktemp("renamed"), UNTESTED),
        "edited": vllm_copy(
            tmp_path_factory.mktemp("edited"), UNTESTED, vars(Handler)["transfer_async"]
        ),
    }
    built = time.perf_counter() - start
    processes = {}
    for name, site in sites.items():
        environ = {
            k: v for k, v in os.environ.items() if not k.startswith("PTRRES_VLLM")
        }
        environ.pop("VLLM_PLUGINS", None)
        environ["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT)])
        environ["PYTHONDONTWRITEBYTECODE"] = "1"  # nothing written into the venv
        processes[name] = subprocess.Popen(
            [sys.executable, "-c", IN_THE_COPY],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=environ,
            cwd=ROOT,
        )
    reports = {}
    for name, process in processes.items():
        out, err = process.communicate(timeout=300)
        assert process.returncode == 0, err
        reports[name] = json.loads(out.splitlines()[-1])
        reports[name]["site"] = str(sites[name])
    print(
        f"\nvLLM {INSTALLED} copied twice in {built:.2f} s, both imported, "
        f"checked and patched in {time.perf_counter() - start - built:.2f} s"
    )
    for site in sites.values():
        shutil.rmtree(site)
    return reports


def check_lines(text: str) -> dict[str, tuple[str, str]]:
    """`ptrres check`'s findings by topic: (status, detail)."""
    findings = {}
    for line in text.splitlines()[1:-1]:
        status, rest = line.split(maxsplit=1)
        topic, detail = re.split(r"\s{2,}", rest, maxsplit=1)
        findings[topic] = (status, detail)
    return findings


def test_the_copy_is_the_one_imported(copies: dict[str, dict[str, Any]]) -> None:
    """vLLM, its version and its metadata are the copy's; its gpu_worker is
    a symlink to the release's, or, edited, a file of its own."""
    installed = os.path.realpath(worker.__file__ or "")
    for name, report in copies.items():
        site = report["site"]
        assert report["vllm"] == f"{site}/vllm/__init__.py"
        assert report["version"] == [UNTESTED, UNTESTED]
        path, link, real = report["gpu_worker"]
        assert path == f"{site}/vllm/v1/kv_offload/cpu/gpu_worker.py"
        assert not link  # a file of a linked directory, or one of its own
        assert (real == installed) == (name == "renamed")


def test_the_installed_code_under_another_version_is_patched(
    copies: dict[str, dict[str, Any]],
) -> None:
    """Every path the release has is patched, as the newest tested release
    whose code it has, and `ptrres check` says whose, path by path; the
    version line is a warning, and nothing blocks."""
    report = copies["renamed"]
    assert report["warnings"] == []
    assert report["names"] == ALL_PATCHES
    assert report["states"] == {
        path: ["patched", *matching_release(path), UNTESTED]
        if path in PRESENT
        else ["absent"]
        for path in PATHS
    }
    findings = check_lines(report["check"]["text"])
    assert findings["vLLM"][0] == "warn"
    assert findings["vLLM"][1].startswith(f"{UNTESTED}, not a tested release (")
    for path in PRESENT:
        status, detail = findings[path]
        assert status == "ok"
        assert (
            f" (vLLM {UNTESTED} is untested; its code here is "
            f"{matching_release(path)[0]}'s): " in detail
        )
    for path in ABSENT:
        assert findings[path][0] == "none"
    assert report["check"]["status"] == 0
    assert report["check"]["text"].splitlines()[-1] == (
        "The plugin will patch vLLM in every process vLLM starts."
    )


def closest_where_changed(path: str, locator: str) -> str:
    """The tested release a vLLM of another version, whose code on ``path``
    is the installed release's but for ``locator``, is told closest to: the
    fewest differences (that locator's, and those between the installed
    code and the release's record), the newest first among equals."""
    best: tuple[int, str] | None = None
    for release, paths in sorted(
        recorded_releases().items(), key=lambda item: version_key(item[0]), reverse=True
    ):
        if path not in paths:
            continue
        have = fingerprint(path_code(path, paths[path]["variant"]))
        count = sum(
            key == locator or have.get(key) != want
            for key, want in paths[path]["fingerprint"].items()
        )
        if best is None or count < best[0]:
            best = (count, release)
    assert best is not None
    return best[1]


def test_a_changed_function_body_leaves_that_path_alone_only(
    copies: dict[str, dict[str, Any]],
) -> None:
    """transfer_async's body changed: the handler's path is left alone, with
    one warning naming it and what differs from the closest tested release;
    every other path is patched as its tested code."""
    report = copies["edited"]
    transfer = f"{worker.__name__}:SingleDirectionOffloadingHandler.transfer_async"
    closest = closest_where_changed(HANDLER, transfer)
    reason = (
        f"vLLM {UNTESTED} (not a tested release) has other code here than every "
        f"tested release; closest, {closest}: gpu_worker."
        "SingleDirectionOffloadingHandler.transfer_async has other code"
    )
    assert report["warnings"] == [
        f"ptrres.vllm left vLLM's {HANDLER} unpatched: {reason}"
    ]
    assert report["names"] == patches_but(HANDLER)
    assert report["states"] == {
        path: ["left alone"]
        if path == HANDLER
        else ["patched", *matching_release(path), UNTESTED]
        if path in PRESENT
        else ["absent"]
        for path in PATHS
    }
    findings = check_lines(report["check"]["text"])
    assert findings[HANDLER] == ("no", f"left as vLLM has it: {reason}")
    assert all(findings[path][0] == "ok" for path in PRESENT if path != HANDLER)
    assert report["check"]["status"] == 1
    others = [path for path in PRESENT if path != HANDLER]
    patched = " and ".join([", ".join(others[:-1]), others[-1]])
    assert report["check"]["text"].splitlines()[-1] == (
        f"The plugin will patch vLLM's {patched}, and leave its {HANDLER} as "
        "vLLM has it (why: above)."
    )


# --- what it costs ---------------------------------------------------------------


def test_what_matching_each_path_costs() -> None:
    """match_path per path, its modules imported (as when vLLM has just
    imported them): the first call, which reads the sources (linecache
    emptied), then the median of later ones; for a path this release lacks,
    what finding it absent costs. Printed (pytest -s), not asserted: a
    benchmark, on whatever machine runs it."""
    rows = []
    for path in PATHS:
        linecache.clearcache()
        start = time.perf_counter()
        first = match_path(path)
        cold = time.perf_counter() - start
        if path in PRESENT:
            assert isinstance(first, Match), first
            locators = len(dict.fromkeys(path_code(path, first.variant).locators()))
        else:
            assert first is None
            locators = 0
        times = []
        for _ in range(15):
            start = time.perf_counter()
            assert match_path(path) == first
            times.append(time.perf_counter() - start)
        warm = sorted(times)[len(times) // 2]
        rows.append((path, "patched" if first else "absent", locators, cold, warm))
    print(f"\nmatch_path on vLLM {INSTALLED} (ms): path, locators, first, later")
    for path, found, locators, cold, warm in rows:
        print(
            f"  {path:22} {found:8} {locators:3d} {cold * 1e3:8.2f} {warm * 1e3:8.2f}"
        )


def test_code_without_source_is_said_to_have_none() -> None:
    """vLLM installed as bytecode alone: its functions have no source to
    fingerprint, so no path matches, and the refusal says why."""
    namespace: dict[str, Any] = {}
    exec(
        compile("def resolve(spec, kv):\n    return 1\n", "/no/such/file.py", "exec"),
        namespace,
    )
    assert _fingerprint.digest(namespace["resolve"]) == _fingerprint.NO_SOURCE
    phrases = _fingerprint.differences(
        {"m.pointer_utils:resolve": _fingerprint.NO_SOURCE},
        {"m.pointer_utils:resolve": "0123456789abcdef"},
    )
    assert phrases == [
        "pointer_utils.resolve has no source to read (installed as bytecode?)"
    ]
