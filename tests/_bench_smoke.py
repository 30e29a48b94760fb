"""A benchmark script's `--smoke` run (toy sizes, CPU) in its own Python, for the tests that check its
JSON: the script runs from a temporary folder and must exit 0 (its stderr is the failure's message)."""

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def smoke(script: str, tmp_path, *args: str) -> dict:
    """benchmarks/`script` --smoke `args` --out <tmp>: its JSON."""
    out = tmp_path / "smoke.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--smoke", *args, "--out", str(out)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())
