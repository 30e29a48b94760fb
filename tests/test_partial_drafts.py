"""Steps where the scheduler gives requests fewer drafts than the tree slots, next to tree rows, on
both runners: a tight token budget (`max_num_batched_tokens` 48) makes vLLM chunk the long prompts'
prefills beside decoding requests and cut their drafts, as it does on a GPU under load (and as the
256-token block of the hybrid's align cache did on CPUs whose vLLM keeps the GDN state in float32).

Such a step is a counted whole-step chain fallback ("mixed batch"), verified by vLLM's own sampler;
on the hybrid its sampled tokens are then cut to the GDN state slots. Model Runner V2 keeps the
accepted counts on the device: the cut once recounted a prefill chunk's row as one rejected token,
V2's device `num_computed_tokens` fell one short of the scheduler's, the final chunk sampled
nothing, and the next step died in V2's `prepare_inputs` (`num_scheduled_tokens >= num_logits`).

Pass: the engine serves every request; the fallback was counted and trees still ran; every request
is within the regret gate of no speculation or of vLLM's flat DFlash under the same budget (the
control: on these tiny bf16 models vLLM's own chunked speculative path leaves no speculation at
some tokens, and DDTree then matches flat DFlash).
"""

import json

import pytest

from ddtree_compile.testing import runner_v2_cpu

MIXED_BATCH = "mixed batch (prefill or partial drafts next to trees)"

SCRIPT = r"""
import json, pathlib, sys, tempfile
RUNNER = sys.argv[1]
if RUNNER == "v2":
    from ddtree_compile.testing import runner_v2_cpu
    runner_v2_cpu.enable()
from ddtree_compile.integration import config, engines, metrics, plugin
from ddtree_compile.testing import e2e, models

plugin.register()
N = 24
with tempfile.TemporaryDirectory() as tmp:
    root = pathlib.Path(tmp)
    # the users' model class (GatedDeltaNet + attention, M-RoPE); on V2 their mixed sliding/full
    # drafter (vLLM serves it on V2 only), on V1 a full-attention one
    target = models.write_tiny_vl_model(root / "vl", seed=4)
    mixed = ["sliding_attention", "full_attention"] if RUNNER == "v2" else None
    drafter = models.write_tiny_dflash_drafter(target, root / "dflash", seed=4, layer_types=mixed)
    kw = dict(enforce_eager=True, skip_tokenizer_init=False, limit_mm_per_prompt={"image": 1}, max_model_len=1024,
              mamba_ssm_cache_dtype="float32", max_num_batched_tokens=48)
    prompts = [models.token_prompts(1, n, models.VOCAB - 8, seed=5 + i)[0] for i, n in enumerate((12, 12, 90, 90))]
    out = {}
    flat = {"speculative_config": {"method": "dflash", "model": str(drafter), "num_speculative_tokens": 8}}
    for name, extra in (("none", {}), ("flat", flat)):
        with e2e.engine(**models.tiny_llm_kwargs(target, **kw, **extra)) as llm:
            out[name] = e2e.generate_with_logprobs(llm, prompts, N)
    with e2e.engine(**models.tiny_llm_kwargs(target, **kw, **config.vllm_kwargs(drafter, budget=8, top_k=3,
                                                                                num_speculative_tokens=4))) as llm:
        state = engines.find_state(llm)
        out["runner"] = type(engines.find_runner(llm)).__module__
        before = metrics.collect(llm)[0]
        out["ddtree"] = e2e.generate(llm, prompts, N)
        out["counters"] = metrics.counters_delta(metrics.collect(llm)[0], before)
        out["fallback_steps"] = dict(state.metrics.fallback_steps)
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both runners side by side, each in its own Python (the V2 shim changes that process's vLLM)."""
    from concurrent.futures import ThreadPoolExecutor

    cwd = tmp_path_factory.mktemp("partial")
    scripts = {name: f"import sys; sys.argv[1:] = [{name!r}]\n" + SCRIPT for name in ("v1", "v2")}
    with ThreadPoolExecutor(2) as pool:
        done = {name: pool.submit(runner_v2_cpu.run_script, s, cwd) for name, s in scripts.items()}
        return {name: f.result() for name, f in done.items()}


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_partial_drafts_next_to_trees_are_served_and_counted(runs, runner):
    r = runs[runner]
    assert r["runner"].endswith("cpu_model_runner" if runner == "v1" else "cpu.model_runner"), r["runner"]
    assert all(len(t) == 24 for t in r["ddtree"]), [len(t) for t in r["ddtree"]]
    assert r["fallback_steps"].get(MIXED_BATCH, 0) > 0, r["fallback_steps"]  # the step kind this covers
    assert r["counters"]["tree_steps"] > 0, r["counters"]  # and trees ran around it


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_partial_drafts_greedy_within_the_regret_gate(runs, runner):
    from ddtree_compile.testing import e2e

    r = runs[runner]
    ref, ctl = _logprobs(r["none"]), _logprobs(r["flat"])
    gates = [e2e.controlled_gate(a, b, got) for a, b, got in zip(ref, ctl, r["ddtree"])]
    print(json.dumps(gates))
    assert all(g["ok"] for g in gates), gates


def _logprobs(outputs):
    """`generate_with_logprobs` results back from JSON (token ids were object keys: strings)."""
    return [(tokens, [{int(t): lp for t, lp in pos.items()} for pos in lps]) for tokens, lps in outputs]
