"""The DDTree round prototype on Model Runner V2 (ddtree_compile/testing/v2_prototype.py), on a real V2
engine on CPU (testing/runner_v2_cpu.py), in a subprocess: what the V2 adapter will be built from
(docs/runner_v2.md), kept honest by this test while the product still refuses DDTree on V2.

Tiny Qwen3 in float32, greedy, budget 8, draft length 4, top_k 3, the drafter harness drafting from
the reference so trees are accepted deep and through siblings: DDTree on V2 equals V2 without
speculation token for token, with tree steps, sibling paths and K/V moves counted. The same engine
with the commit's K/V compaction switched off must leave that equality (the test can fail).
"""

import pytest

from ddtree_compile.testing import runner_v2_cpu

SCRIPT = r"""
import json, pathlib, tempfile
from ddtree_compile.testing import runner_v2_cpu
runner_v2_cpu.enable()
from vllm import LLM, SamplingParams
from ddtree_compile.integration import engines
from ddtree_compile.testing import harness, models, v2_prototype

B, L, TOP_K, MAX_TOKENS = 8, 4, 3, 40
out = {}
with tempfile.TemporaryDirectory() as tmp:
    root = pathlib.Path(tmp)
    target = models.write_tiny_model("qwen3", root / "qwen3")
    drafter = models.write_tiny_dflash_drafter(target, root / "dflash")
    prompts = models.token_prompts(3, 16, models.VOCAB, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    kw = dict(enforce_eager=True, dtype="float32", async_scheduling=False)
    llm = LLM(**models.tiny_llm_kwargs(target, **kw))
    try:
        ref = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        engines.shutdown(llm)
    llm = LLM(**models.tiny_llm_kwargs(target, **kw, speculative_config={
        "method": "dflash", "model": str(drafter), "num_speculative_tokens": B}))
    try:
        runner = engines.find_runner(llm)
        reference = {tuple(p["prompt_token_ids"]): p["prompt_token_ids"] + r for p, r in zip(prompts, ref)}
        rnd = v2_prototype.V2Round(runner, budget=B, draft_len=L, top_k=TOP_K,
                                   harness=v2_prototype.make_harness(runner, reference))
        out["runner"] = type(runner).__module__
        got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        out["tree"] = {"equal": got == ref, "counters": vars(rnd.c).copy()}
        rnd.compact = False
        got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        out["no_compaction"] = {"equal": got == ref, "counters": vars(rnd.c).copy()}
    finally:
        engines.shutdown(llm)
print("RESULT " + json.dumps(out, default=str))
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return runner_v2_cpu.run_script(SCRIPT, tmp_path_factory.mktemp("v2proto"))


def test_ddtree_on_v2_equals_no_speculation_with_trees_walked(run):
    assert run["runner"].startswith("vllm.v1.worker.cpu") or run["runner"].startswith("vllm.v1.worker.gpu")
    t = run["tree"]
    c = t["counters"]
    assert t["equal"], c
    assert c["tree_steps"] > 0 and c["nodes_accepted"] > c["tree_steps"]  # deep accepts
    assert c["sibling_rounds"] > 0 and c["kv_moves"] > 0  # paths through siblings, their K/V moved
    assert c["tree_attention_calls"] > 0


def test_without_the_kv_compaction_the_output_leaves_the_reference(run):
    assert not run["no_compaction"]["equal"]
