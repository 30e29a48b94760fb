"""benchmarks/bench_tree_gdn.py at toy size (its `--smoke`: Triton's interpreter on CPU): the script the
GPU runs to time the tree GDN templates against vLLM's chain kernels runs to its JSON, every template it
times is called as the round calls it (it once called the GDN commit without SSM states, failing only on
a GPU run), and its check of the Triton kernels against the torch references is in the JSON: the states
and counts equal (the bf16 outputs are compared to their references by the template tests). Timings are
not checked."""

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_bench_tree_gdn_smoke(tmp_path):
    out = tmp_path / "gdn.json"
    script = ROOT / "benchmarks" / "bench_tree_gdn.py"
    proc = subprocess.run([sys.executable, str(script), "--smoke", "--out", str(out)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["device"] == "cpu-interpreter"
    assert res["records"], res
    for rec in res["records"]:  # every shape: both commits and every template strategy timed
        assert set(rec["commit_all_layers_ms"]) >= {"snapshot", "replay"}, rec
        assert {"conv_tree", "gdn_snapshot_tree", "gdn_records_tree", "conv_chain"} <= set(rec["times_ms"]), rec
    assert {"snapshot_bfloat16", "records_bfloat16"} <= set(res["drift"]), res["drift"]
    checks = res["gpu_check"]  # (on CPU: the interpreter against the references)
    states = {k: v for k, v in checks.items() if k.endswith(("state_max_abs", "num_accepted_max_abs"))}
    assert len(states) == 6 and all(v < 1e-5 for v in states.values()), checks


def test_bench_tree_gdn_sweep_smoke(tmp_path):
    """`--sweep` (the recurrence's launch configs, split walks at small R) runs to its JSON."""
    out = tmp_path / "sweep.json"
    script = ROOT / "benchmarks" / "bench_tree_gdn.py"
    proc = subprocess.run([sys.executable, str(script), "--smoke", "--sweep", "--out", str(out)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["sweep"]
    assert [(r["R"], r["B"]) for r in rows] == [(1, 4), (2, 4)]
    assert all(set(r["ms"]) == {"8x1", "16x1", "16x1x8"} and r["best"] in r["ms"] for r in rows), rows
