"""benchmarks/bench_tree_gdn.py at toy size (its `--smoke`: Triton's interpreter on CPU): the script the
GPU runs to time the tree GDN templates against vLLM's chain kernels runs to its JSON, every template it
times is called as the round calls it (it once called the GDN commit without SSM states, failing only on
a GPU run), and its check of the Triton kernels against the torch references is in the JSON: the states
and counts equal (the bf16 outputs are compared to their references by the template tests). Timings are
not checked."""

from _bench_smoke import smoke


def test_bench_tree_gdn_smoke(tmp_path):
    res = smoke("bench_tree_gdn.py", tmp_path)
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
    rows = smoke("bench_tree_gdn.py", tmp_path, "--sweep")["sweep"]
    assert [(r["R"], r["B"]) for r in rows] == [(1, 4), (2, 4)]
    assert all(set(r["ms"]) == {"8x1", "16x1", "16x1x8"} and r["best"] in r["ms"] for r in rows), rows
