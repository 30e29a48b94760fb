"""DDTree in the compiled Model Runner V2 engine's forwards past the CUDA-graph capture sizes (vLLM 0.26).

V2 replays a FULL graph for a uniform batch up to `max_cudagraph_capture_size` tokens and calls the
compiled model, without CUDA graphs, for a larger one: users run vLLM's default size (512 tokens, below
a c = 16 verify of 33-slot trees). The compiled code does not pass through the model's Python `forward`,
so the round sets its tree verify before the forward, whatever form it takes (adapters/v2_driver.py).
Here the capture sizes stop at 32 tokens: one request's 17-slot tree verifies in a FULL graph, four
requests' (68 tokens) in the compiled model. Both within the regret gate of no speculation, trees in
every step, none verified as a fallback chain.
"""

from __future__ import annotations

import _engines as E
import pytest

CAPTURE_TOKENS = 32  # 1 request of 1 + 16 slots fits, 2 and more do not


@pytest.fixture(scope="module")
def run(gpu_env, tmp_path_factory):
    gpu_env.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)  # vLLM's own choice: V2 for the mixed drafter
    from ddtree_compile.integration import engines, metrics
    from ddtree_compile.passes.entry import compilation_config
    from ddtree_compile.testing import e2e, models

    root = tmp_path_factory.mktemp("v2eager")
    target = models.write_tiny_vl_model(root / "target", seed=4)
    drafter = models.write_tiny_dflash_drafter(target, root / "mixed", seed=4, layer_types=E.MIXED)
    prompts = E.text_and_image_prompts()["text"]
    ref_info, ref = E.reference(target, {"text": prompts}, **E.MM)
    args = E.engine_kwargs(target, drafter, async_scheduling=None, **E.MM)
    args["compilation_config"] = {**compilation_config("cuda"), "cudagraph_mode": "FULL_AND_PIECEWISE",
                                  "max_cudagraph_capture_size": CAPTURE_TOKENS}
    out = {}
    with e2e.engine(**args) as llm:
        runner = engines.find_runner(llm)
        info = {"runner": f"{type(runner).__module__}.{type(runner).__name__}",
                "async_scheduling": bool(runner.vllm_config.scheduler_config.async_scheduling),
                "capture_sizes": list(runner.vllm_config.compilation_config.cudagraph_capture_sizes or [])}
        for name, batch in (("batch", prompts), ("alone", prompts[:1])):
            c0 = metrics.collect(llm)[0]
            got = E.generate(llm, batch)
            out[name] = {"gates": E.gates(ref["text"][: len(batch)], got),
                         "counters": metrics.counters_delta(metrics.collect(llm)[0], c0)}
    return {"reference_engine": ref_info, "engine": info, **out}


def test_compiled_forward_past_the_capture_sizes_verifies_trees(run, record):
    c = run["batch"]["counters"]
    record(engine=run["engine"], batch={k: c.get(k) for k in ("tree_steps", "graph_steps", "chain_steps",
                                                              "fallback_total", "sibling_rounds")})
    assert ".gpu.model_runner." in run["engine"]["runner"] and run["engine"]["async_scheduling"] is True, run["engine"]
    e2e_check(run["batch"]["gates"], "4 requests (compiled forward, no CUDA graph)", c)
    assert c["tree_steps"] > 5 and c.get("fallback_total", 0) == 0 and c.get("chain_steps", 0) == 0, c
    assert c.get("graph_steps", 0) < c["tree_steps"], c  # steps of 2-4 requests (34-68 tokens) ran without a graph


def test_one_request_still_replays_its_full_graph(run, record):
    c = run["alone"]["counters"]
    record(alone={k: c.get(k) for k in ("tree_steps", "graph_steps", "fallback_total")})
    e2e_check(run["alone"]["gates"], "1 request (FULL graph)", c)
    assert c["tree_steps"] > 5 and c.get("graph_steps", 0) == c["tree_steps"] and c.get("fallback_total", 0) == 0, c


def e2e_check(gates, label, counters):
    from ddtree_compile.testing import e2e

    e2e.check_gates(gates, f"{label} (counters {counters})")
