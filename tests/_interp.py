"""Run a test module's own __main__ in a fresh interpreter process with TRITON_INTERPRET=1.

Triton fixes some jit helpers (tl.sum, tl.max) when it is first imported, so a kernel test that
must run interpreted gets its own process; the module prints one JSON line of results last.
"""

import json
import os
import subprocess
import sys


def run_interpreted(path: str, timeout: int) -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, os.path.abspath(path)], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
