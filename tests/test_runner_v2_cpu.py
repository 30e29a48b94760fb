"""Model Runner V2 on CPU in CI (ddtree_compile/testing/runner_v2_cpu.py: vLLM's V2 Triton kernels
under TRITON_INTERPRET=1), one subprocess per module run (the enabling shim changes how that process's
vLLM registers kernels).

What V2 engines do with DDTree switched on today, on real V2 engines: DDTree has no round on V2 yet,
so it is refused once at start-up (logged, counted) with advice that fits the engine, and the engine
serves as vLLM's own flat DFlash on V2, drafts accepted:
* the attention-only Qwen3 with an all-full-attention DFlash drafter (V2 asked for by environment,
  as vLLM 0.32 on CUDA does by default): the advice names the V1 runner;
* the same target with a drafter mixing sliding and full attention (the Qwen3.6 drafter's shape:
  vLLM itself forces V2 for it, and refuses it on V1): the advice says V1 is no way out.
"""

import pytest

from ddtree_compile.testing import runner_v2_cpu

SCRIPT = r"""
import json, pathlib, sys, tempfile
from ddtree_compile.testing import runner_v2_cpu
runner_v2_cpu.enable()
from vllm import LLM, SamplingParams
from ddtree_compile.integration import config, engines, metrics, plugin
from ddtree_compile.testing import harness, models

plugin.register()
said = []
class _Said(__import__("logging").Handler):
    def emit(self, record):
        said.append(record.getMessage())
metrics.logger.addHandler(_Said())
out = {}
with tempfile.TemporaryDirectory() as tmp:
    root = pathlib.Path(tmp)
    target = models.write_tiny_model("qwen3", root / "qwen3", seed=1)
    drafters = {"full": models.write_tiny_dflash_drafter(target, root / "full", seed=1),
                "mixed": models.write_tiny_dflash_drafter(target, root / "mixed", seed=1,
                                                          layer_types=["sliding_attention", "full_attention"])}
    prompts = models.token_prompts(2, 16, models.VOCAB, seed=2)
    for name, drafter in drafters.items():
        before, said[:] = dict(metrics.PROCESS_STARTUP_FALLBACKS), []
        llm = LLM(**models.tiny_llm_kwargs(target, enforce_eager=True, disable_log_stats=False,
                                           **config.vllm_kwargs(drafter, budget=8, top_k=4, num_speculative_tokens=7)))
        try:
            runner = engines.find_runner(llm)
            toks = harness.generate(llm, prompts, 24)
            out[name] = {
                "runner": type(runner).__module__ + "." + type(runner).__name__,
                "v2": any(c.__module__ == "vllm.v1.worker.gpu.model_runner" for c in type(runner).__mro__),
                "attached": engines.find_state(llm) is not None,
                "refusals": {k: v - before.get(k, 0) for k, v in metrics.PROCESS_STARTUP_FALLBACKS.items()
                             if v != before.get(k, 0)},
                "logged": [m for m in said if "Model Runner V2" in m],
                "served": [len(t) for t in toks],
                "spec": harness.spec_counters(llm)}
        finally:
            engines.shutdown(llm)
print("RESULT " + json.dumps(out, default=str))
"""


@pytest.fixture(scope="module")
def v2_run(tmp_path_factory):
    return runner_v2_cpu.run_script(SCRIPT, tmp_path_factory.mktemp("v2"))


def _drafts(spec: dict) -> float:
    v = spec.get("vllm:spec_decode_num_drafts")
    return sum(v) if isinstance(v, list) else (v or 0)


@pytest.mark.parametrize("drafter, advice", [
    ("full", "set VLLM_USE_V2_MODEL_RUNNER=0 to use the V1 runner"),
    ("mixed", "mixes sliding-window and full attention layers, which vLLM serves on Model Runner V2 only"),
])
def test_v2_engine_refuses_ddtree_once_and_serves_flat_dflash(v2_run, drafter, advice):
    r = v2_run[drafter]
    assert r["v2"], r["runner"]  # a real Model Runner V2 engine on this CPU
    assert not r["attached"]
    assert len(r["refusals"]) == 1 and list(r["refusals"].values()) == [1], r["refusals"]
    assert "runs this engine on Model Runner V2" in next(iter(r["refusals"]))
    assert len(r["logged"]) == 1 and advice in r["logged"][0], r["logged"]
    assert r["served"] == [24, 24]
    assert _drafts(r["spec"]) > 0, r["spec"]  # vLLM's flat DFlash ran on V2
