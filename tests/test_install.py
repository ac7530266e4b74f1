"""ptrres installed read-only: Numba caches elsewhere, or ptrres runs uncached.

Each case runs in a fresh process whose PYTHONPATH holds a copy of the package
in a site directory made read-only (chmod -R a-w). Root ignores permissions,
so when the tests run as root the package's __pycache__ is also made a plain
file: Numba then cannot create its in-tree cache there, which is what a
read-only directory does to any other user. The user-wide cache is made
unusable the same way for everyone: its path runs through a plain file.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import JIT_DISABLED

import ptrres

pytestmark = pytest.mark.skipif(
    JIT_DISABLED, reason="without the JIT nothing is compiled or cached"
)

# Import, warm up and resolve once; print how each signature was made ready.
RUN = """
import json, warnings
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    import numpy as np
    import ptrres
    report = ptrres.warmup()
    tensor = ptrres.CanonicalKVCacheTensor(np.zeros((4, 8), np.int8), 8)
    kv = ptrres.CanonicalKVCaches([tensor], [[ptrres.CanonicalKVCacheRef(0, 8)]])
    ptrs = ptrres.resolve_device_pointers(ptrres.GPULoadStoreSpec([3]), kv).ptrs
print(json.dumps({
    "file": ptrres.__file__,
    "hows": sorted({k.how for k in report.kernels}),
    "offset": int(ptrs[0]) - tensor.tensor.ctypes.data,
    "warnings": [str(w.message) for w in caught],
}))
"""


def make_read_only(path: Path) -> None:
    for entry in [path, *path.rglob("*")]:
        if entry.is_symlink():
            continue
        mode = entry.stat().st_mode
        entry.chmod(mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


def make_writable(path: Path) -> None:
    for entry in [path, *path.rglob("*")]:
        if not entry.is_symlink():
            entry.chmod(entry.stat().st_mode | stat.S_IWUSR)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A read-only site directory holding a copy of the package."""
    site = tmp_path_factory.mktemp("readonly") / "site"
    package = Path(ptrres.__file__).parent
    shutil.copytree(package, site / "ptrres", ignore=shutil.ignore_patterns("*.nb?"))
    for directory in (site / "ptrres", site / "ptrres" / "_kernels"):
        pycache = directory / "__pycache__"  # where Numba caches by default
        shutil.rmtree(pycache, ignore_errors=True)
        if os.geteuid() == 0:  # root writes anywhere: take the place away instead
            pycache.write_text("not a directory\n")
    make_read_only(site)
    yield site
    make_writable(site)


def run(site: Path, home: Path, **env: str) -> dict[str, object]:
    environ = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("NUMBA_", "XDG_", "PYTHON"))
    }
    environ.update(PYTHONPATH=str(site), HOME=str(home), **env)
    result = subprocess.run(
        [sys.executable, "-c", RUN],
        env=environ,
        cwd=home,
        capture_output=True,
        text=True,
        check=True,
    )
    answer: dict[str, object] = json.loads(result.stdout.strip().splitlines()[-1])
    assert answer["file"] == str(site / "ptrres" / "__init__.py")
    assert answer["offset"] == 3 * 8
    return answer


def test_read_only_install_caches_in_the_user_wide_cache(
    site: Path, tmp_path: Path
) -> None:
    first = run(site, tmp_path)
    assert first["warnings"] == []
    assert first["hows"] == ["compiled"]
    # Numba put its cache under $HOME/.cache/numba, nothing in the package.
    cached = list((tmp_path / ".cache" / "numba").rglob("*_kernel-*.nbi"))
    assert cached
    assert not list((site / "ptrres").rglob("*.nbi"))
    second = run(site, tmp_path)
    assert second["warnings"] == []
    assert second["hows"] == ["loaded"]


def test_nowhere_to_cache_runs_uncached_with_one_warning(
    site: Path, tmp_path: Path
) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("a file, so no directory can be made below it\n")
    home = tmp_path / "home"
    home.mkdir()
    # ~/.cache and $XDG_CACHE_HOME both lead through a plain file.
    (home / ".cache").symlink_to(blocker)
    make_read_only(home)
    try:
        answer = run(site, home, XDG_CACHE_HOME=str(blocker / "cache"))
    finally:
        make_writable(home)
    assert answer["hows"] == ["compiled"]
    assert len(answer["warnings"]) == 1
    message = answer["warnings"][0]
    assert "Numba cannot cache compiled kernels" in message
    assert "no locator available" in message
    assert "NUMBA_CACHE_DIR" in message
    # Nothing was cached anywhere: the next process compiles again.
    assert not list(tmp_path.rglob("*.nbi"))
    assert not list(site.rglob("*.nbi"))
