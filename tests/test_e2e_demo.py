"""The README's main command (`make demo`: python -m ddtree_compile.testing.demo) and the CLI's toy `round`
command."""

import os
import re
import subprocess
import sys


def _run(module, *args, timeout):
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout,
                          env=env)


def test_demo_runs_ddtree_in_vllm_and_passes_its_checks():
    proc = _run("ddtree_compile.testing.demo", "--max-tokens", "64", timeout=900)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert "RESULT: PASS" in out
    assert "--speculative-config" in out and "--additional-config" in out  # the `vllm serve` switch it used
    rounds = re.findall(r"round +\d+: (.*)", out)
    assert len(rounds) >= 5 and any("sibling" in r for r in rounds)  # per-round stats, branching trees
    harness_line = next(line for line in out.splitlines() if "harness drafter:" in line)
    depth = float(re.search(r"mean accept depth ([\d.]+)", harness_line).group(1))
    siblings = int(re.search(r"sibling rounds (\d+)", harness_line).group(1))
    assert depth > 2 and siblings > 0, harness_line
    # DDTree ran on whichever layout vLLM picked for this CPU (amx with AMX tiles, else vec).
    assert re.search(r"KV-cache layout vLLM picked on this CPU: (amx|vec|vec16)$", out, re.M), out[-3000:]


def test_round_command_prints_one_toy_round():
    proc = _run("ddtree_compile.cli", "round", "--budget", "6", "--top-k", "2", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "accepted" in proc.stdout.lower()
