"""Merge GPU-suite result files into the committed evidence (benchmarks/results/gpu_suite.json) by
test id, the later `finished` winning, superseded records pruned as the suite prunes them.

A device command runs on a fresh copy of the checkout, so the suite's merge (conftest.py) sees only
that command's modules: have each command write its own file and merge them here afterwards.

    DDTREE_COMMIT=<commit> DDTREE_GPU_RESULTS=$OUT/gpu_suite.json make test-gpu GPU_TESTS="v2_auto v2"
    python tests/gpu/merge_results.py <each command's gpu_suite.json> ...
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys

_spec = importlib.util.spec_from_file_location("gpu_conftest", pathlib.Path(__file__).resolve().parent / "conftest.py")
_suite = importlib.util.module_from_spec(_spec)  # (by path: "conftest" is also tests/conftest.py under pytest)
_spec.loader.exec_module(_suite)
DEFAULT_RESULTS, prune = _suite.DEFAULT_RESULTS, _suite.prune


def merge(paths, into: pathlib.Path = DEFAULT_RESULTS) -> dict:
    doc = json.loads(into.read_text()) if into.exists() else {}
    tests, updated = doc.get("tests", {}), doc.get("updated", "")
    for p in paths:
        part = json.loads(pathlib.Path(p).read_text())
        for key, entry in part.get("tests", {}).items():
            if entry.get("finished", "") >= tests.get(key, {}).get("finished", ""):
                tests[key] = entry
        updated = max(updated, part.get("updated", ""))
        doc.setdefault("what", part.get("what"))
    doc = {"what": doc.get("what"), "updated": updated, "tests": dict(sorted(prune(tests).items()))}
    into.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    return doc


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    done = merge(sys.argv[1:])
    print(f"{len(done['tests'])} entries in {DEFAULT_RESULTS}")
