"""benchmarks/bench_gdn_state_layout.py at toy size (`--smoke`: vLLM's own GDN verify kernel under Triton's
interpreter on CPU): every layout (flat DFlash's page and state indices, DDTree's, KV caches of two sizes,
blocks first or spread) runs vLLM's kernel to the same outputs and states, every token's state written.
Timings are not checked (the GPU run's JSON holds them)."""

from _bench_smoke import smoke


def test_bench_gdn_state_layout_smoke(tmp_path):
    res = smoke("bench_gdn_state_layout.py", tmp_path)
    assert res["device"] == "cpu-interpreter"
    rows = res["rows"]
    assert {r["layout"] for r in rows} == {"flat", "flat, 24 GiB", "ddtree page", "ddtree indices",
                                           "ddtree page + indices", "ddtree"}, rows
    assert all(r["equal_to_first"] and r["states_written"] for r in rows), rows
    flat = next(r for r in rows if r["layout"] == "flat")
    ddtree = next(r for r in rows if r["layout"] == "ddtree")
    # DDTree's page holds K drafts' conv columns: larger than flat's; its indices padded to 1 + K
    assert ddtree["page_bytes"] > flat["page_bytes"] and ddtree["index_columns"] > flat["index_columns"], rows
    assert {r["blocks"] for r in rows} == {"first", "spread"}
