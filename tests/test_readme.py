"""README stays true: its example runs, and CI runs its test command."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_usage_example_runs() -> None:
    example = re.search(r"```python\n(.*?)```", README, re.S)
    assert example is not None
    namespace: dict[str, object] = {}
    exec(example.group(1), namespace)
    device_ptrs = namespace["device_ptrs"]
    pinned = namespace["pinned"]
    assert len(device_ptrs.ptrs) == 96  # type: ignore[attr-defined]
    assert pinned[0].tolist() == device_ptrs.ptrs.tolist()  # type: ignore[attr-defined,index]


def test_ci_runs_the_readme_test_command() -> None:
    commands = re.findall(r"```bash\n(.*?)\n```", README, re.S)
    test_command = next(c for c in commands if "pytest" in c)
    assert test_command in (ROOT / ".ci" / "run").read_text()
