"""README and docs stay true: their examples run, their links lead somewhere,
and CI runs README's test command."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
# Pages whose Python examples are whole programs, run top to bottom.
EXAMPLE_PAGES = ["README.md", "docs/canonical.md", "docs/file-tier.md", "docs/nixl.md"]
PAGES = sorted(
    {ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").glob("*.md")}
)
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def run_examples(page: str) -> dict[str, object]:
    """Every ```python block of a page, in order, in one namespace."""
    blocks = re.findall(
        r"^```python\n(.*?)^```", (ROOT / page).read_text(), re.S | re.M
    )
    assert blocks, f"{page} has no Python example"
    namespace: dict[str, object] = {}
    for block in blocks:
        exec(compile(block, page, "exec"), namespace)
    return namespace


def test_readme_examples_run() -> None:
    ns = run_examples("README.md")
    device_ptrs, ptrs = ns["device_ptrs"], ns["ptrs"]
    # The table's out= path gives what the drop-in allocates.
    assert ptrs.tolist() == device_ptrs.ptrs.tolist()  # type: ignore[attr-defined]
    store, merged = ns["store"], ns["merged"]
    assert merged.num_bytes == store.num_bytes  # type: ignore[attr-defined]
    buffers, load = ns["buffers"], ns["load"]
    assert np.shares_memory(load.src, buffers[0])  # type: ignore[attr-defined,index]


@pytest.mark.parametrize("page", EXAMPLE_PAGES[1:])
def test_docs_examples_run(page: str) -> None:
    run_examples(page)


def test_ci_runs_the_readme_test_command() -> None:
    commands = re.findall(r"```bash\n(.*?)\n```", README, re.S)
    test_command = next(c for c in commands if "pytest" in c)
    assert test_command in (ROOT / ".ci" / "run").read_text()


def test_readme_is_a_front_door() -> None:
    """At most 200 lines, the two set-up commands within the first 60."""
    lines = README.splitlines()
    assert len(lines) <= 200
    first = "\n".join(lines[:60])
    assert "pip install -e '.[dev]' && .venv/bin/ptrres bench" in first
    assert "pip install -e '.[dev]' && .venv/bin/python -m pytest" in first


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings."""
    found: set[str] = set()
    for heading in re.findall(r"^#+ (.*)$", FENCE.sub("", page.read_text()), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n = 0
        while (f"{slug}-{n}" if n else slug) in found:
            n += 1
        found.add(f"{slug}-{n}" if n else slug)
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_lead_somewhere(page: Path) -> None:
    """Every relative link names a file that exists, and a heading in it."""
    text = FENCE.sub("", page.read_text())
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no such heading")
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"
