"""Record the installed vLLM's fingerprints, path by path, in
``fingerprints.json``: what makes a release a tested one.

Run it in an environment where one release ptrres.vllm was tested against is
installed, unpatched (vLLM loads no plugin when a module is imported):

    PTRRES_VLLM=0 python -m ptrres.vllm._record

Each of the release's paths is recorded with the form of its patch made for
that release (``_release.variant_for``); a path whose modules the release
does not have is not recorded. tests/vllm/test_vllm_fingerprints.py checks,
on every release CI installs, that the record is the installed code's.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from . import _state
from ._fingerprint import RECORD_FILE, fingerprint
from ._release import PATH_TRIGGERS, _exists, installed_version, path_code, variant_for


def fingerprints_of_installed() -> dict[str, dict[str, Any]]:
    """The installed release's record: each path it has, with its variant
    and fingerprint."""
    version = installed_version()
    if version is None:
        raise SystemExit("vLLM cannot be imported")
    if _state.applied:
        raise SystemExit("vLLM is patched here: record it unpatched")
    paths = {}
    for path in _state.PATHS:
        variant = variant_for(path, version)
        if variant is None or not any(_exists(m) for m in PATH_TRIGGERS[path]):
            continue
        try:
            code = path_code(path, variant)
        except ImportError as error:  # a form of the patch not written yet
            print(f"not recorded: {path} ({error})", file=sys.stderr)
            continue
        paths[path] = {"variant": variant, "fingerprint": fingerprint(code)}
    return paths


def main() -> None:
    version = installed_version()
    record = fingerprints_of_installed()
    try:
        with open(RECORD_FILE, encoding="utf-8") as file:
            recorded = json.load(file)
    except FileNotFoundError:
        recorded = {"releases": {}}
    recorded["releases"][version] = record
    recorded["releases"] = dict(sorted(recorded["releases"].items()))
    with open(RECORD_FILE, "w", encoding="utf-8") as file:
        json.dump(recorded, file, indent=1, sort_keys=False)
        file.write("\n")
    print(f"recorded vLLM {version}: {', '.join(record)}", file=sys.stderr)


if __name__ == "__main__":
    main()
