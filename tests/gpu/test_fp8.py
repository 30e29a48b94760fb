"""DDTree on quantized targets in vLLM 0.26 (V1 runner, FULL CUDA graphs): an FP8 KV cache and FP8 weights.

The tiny dense hybrid (Qwen3-Next architecture), every engine of a case on the same quantized target
and compiled alike: no speculation (the gates' reference, with log-probs), DDTree, and the controls:
vLLM's own flat DFlash (what quantization moves by itself under speculation) and, for FP8 weights, no
speculation on vLLM's TRITON_ATTN kernel (the noise floor of swapping one attention kernel for another:
the tree verify runs DDTree's tree attention where the reference runs FlashAttention).
A case passes when DDTree attached, its tree verifies replayed FULL graphs (an FP8 KV cache: tree
attention reading the FP8 entries), its committed GDN state equals a float32 replay, and its gate
misses beyond flat DFlash's are no more than the kernel control's (FP8 KV: none). Seeded sampling is
DDTree's own unless flat DFlash lacks it too on that target (FP8 GEMMs choose kernels by batch rows).
The controls start only where DDTree missed a gate or a seeded check (flat DFlash), and beyond flat
DFlash's misses (the kernel control).
"""

from __future__ import annotations

import _engines as E
import pytest

CASES = {"kv": {"kv_cache_dtype": "fp8"}, "weights": {"quantization": "fp8"}}
CONTROL = {"weights": "TRITON_ATTN"}


def _misses(gs) -> set:
    return {i for i, g in enumerate(gs) if not g["ok"]}


def _seeded_pair(llm, prompts) -> dict:
    one, again = (E.generate(llm, prompts, temperature=1.0, seed=1234) for _ in range(2))
    alone = E.generate(llm, prompts[1:2], temperature=1.0, seed=1234)
    return {"repeat": one == again, "alone": alone[0]["tokens"] == one[1]["tokens"]}


@pytest.fixture(scope="module", params=sorted(CASES))
def fp8(request, gpu_env, tmp_path_factory):
    gpu_env.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    from ddtree_compile import adapters
    from ddtree_compile.integration import engines, metrics
    from ddtree_compile.testing import harness, models

    case, quant = request.param, CASES[request.param]
    root = tmp_path_factory.mktemp(f"fp8_{case}")
    target = models.write_tiny_model("qwen3_next_dense", root / "target")
    drafter = models.write_tiny_dflash_drafter(target, root / "dflash")
    prompts = models.token_prompts(4, 16, models.VOCAB, seed=0)
    out = {"case": case, **quant}
    with E.running(target, **quant) as (llm, out["reference_engine"]):
        ref = E.generate(llm, prompts, logprobs=5)
    before = dict(metrics.PROCESS_STARTUP_FALLBACKS)
    with E.running(target, drafter, **quant) as (llm, out["engine"]):
        state = engines.find_state(llm)
        out["attached"] = state is not None
        out["fallbacks_at_start"] = {k: v - before.get(k, 0) for k, v in metrics.PROCESS_STARTUP_FALLBACKS.items()
                                     if v != before.get(k, 0)}
        if state is None:
            return out
        p = adapters.current().attention_params(state.ctx.layer(state.ctx.attn_layers[0]))
        out["tree_attention_kv"] = str(p.kv_fp8 or "model dtype")
        c0 = metrics.collect(llm)[0]
        random = E.generate(llm, prompts)
        c1 = metrics.collect(llm)[0]
        check = harness.GdnStateCheck()
        with E.drafting_from(llm, {tuple(r["prompt"]): r["prompt"] + r["tokens"] for r in ref}, check):
            guided = E.generate(llm, prompts)
        out["counters"] = {"random": metrics.counters_delta(c1, c0),
                           "harness": metrics.counters_delta(metrics.collect(llm)[0], c1)}
        out["state_check"] = {"paths": check.paths, "sibling_paths": check.sibling_paths, "max_rel_err": check.max_err}
        out["seeded"] = _seeded_pair(llm, prompts)
    out["gates_random"], out["gates_harness"] = E.gates(ref, random), E.gates(ref, guided)
    # The controls only where DDTree missed something: what they show is what it would be judged against
    # (engine starts are the suite's cost; with every gate and seeded check held they would change nothing).
    if _tree_misses(out) or not all(out["seeded"].values()):
        with E.running(target, drafter, flat=True, **quant) as (llm, out["flat_engine"]):
            out["gates_flat"] = E.gates(ref, E.generate(llm, prompts))
            out["flat_seeded"] = _seeded_pair(llm, prompts)
    if case in CONTROL and _tree_misses(out) - _misses(out.get("gates_flat", [])):
        with E.running(target, attention_config={"backend": CONTROL[case]}, **quant) as (llm, _):
            out["gates_control"] = E.gates(ref, E.generate(llm, prompts))
    return out


def _tree_misses(out) -> set:
    return _misses(out.get("gates_random", [])) | _misses(out.get("gates_harness", []))


def test_fp8_target_lossless_against_its_controls(fp8, record):
    tree_bad = _tree_misses(fp8)
    flat_bad, control_bad = _misses(fp8.get("gates_flat", [])), _misses(fp8.get("gates_control", []))
    record(case=fp8["case"], tree_attention_kv=fp8.get("tree_attention_kv"), counters=fp8.get("counters"),
           state_check=fp8.get("state_check"), seeded=fp8.get("seeded"), flat_seeded=fp8.get("flat_seeded"),
           controls_run=[k for k in ("gates_flat", "gates_control") if k in fp8],
           gate_misses={"ddtree": len(tree_bad), "flat_dflash": len(flat_bad), "beyond_flat": len(tree_bad - flat_bad),
                        "control_backend": len(control_bad)}, start_s=fp8.get("engine", {}).get("start_s"))
    assert fp8["attached"], fp8["fallbacks_at_start"]
    if fp8["case"] == "kv":
        assert "float8" in fp8["tree_attention_kv"], fp8["tree_attention_kv"]
    for phase, c in fp8["counters"].items():
        assert c["graph_steps"] >= c["tree_steps"] > 0, (phase, c)
    assert fp8["counters"]["harness"]["sibling_rounds"] > 0, fp8["counters"]
    assert fp8["state_check"]["paths"] > 0, fp8["state_check"]
    assert len(tree_bad - flat_bad) <= len(control_bad), (fp8["gates_random"], fp8["gates_harness"],
                                                          fp8.get("gates_flat"))
    flat_seeded = fp8.get("flat_seeded", {})
    for k in ("repeat", "alone"):  # DDTree's own, unless flat DFlash on the same target lacks it too
        assert fp8["seeded"][k] or not flat_seeded.get(k, True), (k, fp8["seeded"], flat_seeded)
