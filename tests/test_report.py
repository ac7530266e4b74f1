"""benchmarks/report.py: every benchmark has a section, pages round-trip, and a
rerun of some sections keeps the others' figures. No timing is asserted."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load_report() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "report", ROOT / "benchmarks" / "report.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["report"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


report = load_report()


def printing(name: str, text: str, *, markdown: bool = False) -> Any:
    """A section whose command prints ``text`` (exits 3 if it contains FAIL)."""
    code = f"import sys; print({text!r}); sys.exit(3 if 'FAIL' in {text!r} else 0)"
    return report.Section(
        name, f"Title of {name}", f"About {name}.", ("python", "-c", code), (), markdown
    )


def test_every_benchmark_script_has_a_section() -> None:
    commands = [" ".join(s.command) for s in report.SECTIONS]
    scripts = sorted(p.name for p in (ROOT / "benchmarks").glob("*.py"))
    scripts.remove("report.py")
    for script in report.NOT_ON_THE_PAGE:
        scripts.remove(script)
    for script in scripts:
        assert f"python benchmarks/{script}" in commands, script
    assert "ptrres bench" in commands
    assert "ptrres bench --operation canonical" in commands
    assert len({s.name for s in report.SECTIONS}) == len(report.SECTIONS)


def test_page_round_trips() -> None:
    results = {
        "bench": report.Result(
            "ptrres bench", "a machine; commit abc", "```text\nx\n```"
        ),
        "vllm": report.Result(
            "python benchmarks/vllm_transfer.py",
            "another machine; commit def",
            report.as_markdown("| a |\n|---|\n| 1 |\ngeomean 2x\n", markdown=True),
        ),
    }
    page = report.render_page(results)
    assert report.parse_page(page) == results
    assert "| 1 |\n\ngeomean 2x" in page  # a table ends before the prose
    for section in report.SECTIONS:
        assert f"## {section.title}" in page
        assert f"#{report.anchor(report.SECTIONS, section.name)})" in page
    assert "Not measured yet: `python benchmarks/report.py --only canonical`" in page


def test_text_output_is_kept_verbatim() -> None:
    output = "  name   1.0 s\n| not a table"
    assert report.as_markdown(output, markdown=False) == f"```text\n{output}\n```"


def test_rerun_keeps_the_other_sections(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sections = (
        printing("one", "| a |\n| --- |\n| 1 |\ntotal 1", markdown=True),
        printing("two", "first run of two"),
    )
    monkeypatch.setattr(report, "SECTIONS", sections)
    page = tmp_path / "benchmarks.md"

    assert report.main(["--page", str(page)]) == 0
    first = report.parse_page(page.read_text())
    assert first["one"].output == "| a |\n| --- |\n| 1 |\n\ntotal 1"
    assert first["one"].command == " ".join(sections[0].command)
    assert "Python " in first["one"].ran_on
    assert "commit " in first["one"].ran_on

    monkeypatch.setattr(
        report, "SECTIONS", (sections[0], printing("two", "second run of two"))
    )
    assert report.main(["--page", str(page), "--only", "two"]) == 0
    second = report.parse_page(page.read_text())
    assert second["one"] == first["one"]
    assert "second run of two" in second["two"].output


def test_a_failed_command_keeps_its_old_figures(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    page = tmp_path / "benchmarks.md"
    monkeypatch.setattr(report, "SECTIONS", (printing("one", "good figures"),))
    assert report.main(["--page", str(page)]) == 0
    monkeypatch.setattr(report, "SECTIONS", (printing("one", "FAIL"),))
    assert report.main(["--page", str(page)]) == 1
    assert "good figures" in report.parse_page(page.read_text())["one"].output


def test_the_page_holds_every_section() -> None:
    """docs/benchmarks.md was written by report.py and has every section."""
    results = report.parse_page((ROOT / "docs" / "benchmarks.md").read_text())
    for section in report.SECTIONS:
        assert section.name in results, f"rerun: report.py --only {section.name}"
        assert results[section.name].command.startswith(" ".join(section.command))
        assert results[section.name].output.strip()


def test_readme_headlines_are_the_pages() -> None:
    """README's headline table is what report.py reads off docs/benchmarks.md."""
    results = report.parse_page((ROOT / "docs" / "benchmarks.md").read_text())
    readme = (ROOT / "README.md").read_text()
    assert report.with_headlines(readme, results) == readme
    for row in report.HEADLINES:
        assert f"| {row.what} | {row.against} |" in readme


def test_headlines_need_every_figure() -> None:
    results = report.parse_page((ROOT / "docs" / "benchmarks.md").read_text())
    readme = (ROOT / "README.md").read_text()
    broken = dict(results, vllm=report.Result("c", "r", "no figures here"))
    with pytest.raises(ValueError, match="vllm"):
        report.with_headlines(readme, broken)
    with pytest.raises(ValueError, match="markers"):
        report.with_headlines("# no table", results)


def test_a_rerun_keeps_sections_written_by_hand(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sections after the last report block (from commands report.py does not
    run) survive a rerun, as they were."""
    monkeypatch.setattr(report, "SECTIONS", (printing("one", "first figures"),))
    page = tmp_path / "benchmarks.md"
    assert report.main(["--page", str(page)]) == 0
    by_hand = "## Traces\n\nMeasured by hand: `ptrres bench --trace x`.\n\n| a |\n"
    page.write_text(page.read_text() + "\n" + by_hand)
    monkeypatch.setattr(report, "SECTIONS", (printing("one", "second figures"),))
    assert report.main(["--page", str(page)]) == 0
    text = page.read_text()
    assert text.endswith("<!-- report:end one -->\n\n" + by_hand)
    assert "second figures" in report.parse_page(text)["one"].output
    assert report.appendix(text) == by_hand.strip("\n")
