"""The notebooks stay paired with their jupytext scripts and stay executed.

CI executes the notebooks themselves (nbmake, see .ci/run); these checks are
cheap enough for every test run: each ``notebooks/*.ipynb`` has the cells of
its ``.py`` twin (edit either, then ``jupytext --sync``), and its stored
outputs come from one clean run, top to bottom, in a fresh kernel. (They
cannot tell stale outputs: ``jupytext --sync`` keeps a changed cell's outputs,
so re-execute after an edit.)
"""

from __future__ import annotations

from pathlib import Path

import pytest

jupytext = pytest.importorskip("jupytext")

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


def test_the_notebooks_are_there() -> None:
    assert [p.stem for p in NOTEBOOKS] == [
        "01_resolving_pointers",
        "02_transfer_plans",
        "03_performance",
        "04_canonical_layouts",
        "05_file_tier",
        "06_nixl",
        "07_tp",
    ]


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_has_the_cells_of_its_script(notebook: Path) -> None:
    stored = jupytext.read(notebook)
    script = jupytext.read(notebook.with_suffix(".py"))
    assert [(c.cell_type, c.source) for c in stored.cells] == [
        (c.cell_type, c.source) for c in script.cells
    ], f"run: jupytext --sync {notebook.with_suffix('.py').name}"


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_outputs_come_from_one_run(notebook: Path) -> None:
    code = [c for c in jupytext.read(notebook).cells if c.cell_type == "code"]
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), (
        f"re-execute it: jupyter execute --inplace {notebook.name}"
    )
    assert not [o for c in code for o in c.outputs if o.output_type == "error"]
