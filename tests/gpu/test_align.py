"""Prefix caching on a hybrid ("align" GDN cache) with DDTree on vLLM 0.26's Model Runner V2, FULL graphs.

The tiny multimodal Qwen3.5 with the mixed drafter (V2), the GDN state cache in bf16 (vLLM's default),
prefix caching on: a two-turn conversation per prompt (turn 1: 300 prompt tokens, 200 generated,
crossing block boundaries inside tree rounds; turn 2: turn 1 as the reference continued it plus 8
tokens, 32 generated). The drafter harness drafts the engine's own greedy continuation (a first pass:
deep paths to the end), with the GDN state check, which with prefix caching also checks the state and
conv window at every block boundary a path crossed. Checks: vLLM chose "align", gates against no
speculation (V2, eager), tree steps that branch, every tree verify a FULL-graph replay (vLLM's align
post-processing runs after it), block boundaries checked, turn 2 read from the cache.
"""

from __future__ import annotations

import _engines as E
import pytest

BF16_STATE = {"mamba_ssm_cache_dtype": "auto"}


@pytest.fixture(scope="module")
def align(gpu_env, tmp_path_factory):
    from ddtree_compile.integration import engines, metrics
    from ddtree_compile.testing import harness, models

    root = tmp_path_factory.mktemp("align")
    target = models.write_tiny_vl_model(root / "target", seed=4)
    drafter = models.write_tiny_dflash_drafter(target, root / "mixed", seed=4, layer_types=E.MIXED)
    turn1 = models.token_prompts(2, 300, models.VOCAB - 8, seed=11)
    gpu_env.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")  # the reference on the runner DDTree runs on
    with E.running(target, graphs=False, **E.MM, **BF16_STATE) as (llm, ref_info):
        ref1 = E.generate(llm, turn1, logprobs=5, max_tokens=200)
        turn2 = [{"prompt_token_ids": r["prompt"] + r["tokens"] + list(range(40, 48))} for r in ref1]
        ref2 = E.generate(llm, turn2, logprobs=5, max_tokens=32)
    gpu_env.delenv("VLLM_USE_V2_MODEL_RUNNER")  # the mixed drafter makes vLLM choose V2 by itself
    out = {"reference_engine": ref_info}
    with E.running(target, drafter, enable_prefix_caching=True, **E.MM, **BF16_STATE) as (llm, info):
        state = engines.find_state(llm)
        cc = engines.find_runner(llm).vllm_config.cache_config
        out.update(engine=info, attached=state is not None, mamba_cache_mode=cc.mamba_cache_mode,
                   block=cc.mamba_block_size, fallbacks_at_start=dict(metrics.PROCESS_STARTUP_FALLBACKS))
        if state is None:
            return out
        own = E.generate(llm, turn1, max_tokens=200) + E.generate(llm, turn2, max_tokens=32)
        check = harness.GdnStateCheck()
        c0 = metrics.collect(llm)[0]
        with E.drafting_from(llm, {tuple(g["prompt"]): g["prompt"] + g["tokens"] for g in own}, check):
            got1 = E.generate(llm, turn1, max_tokens=200)
            got2 = E.generate(llm, turn2, max_tokens=32)
        out.update(counters=metrics.counters_delta(metrics.collect(llm)[0], c0),
                   turn2_cached=[g["cached"] for g in got2], gates=E.gates(ref1 + ref2, got1 + got2),
                   state_check={"paths": check.paths, "sibling_paths": check.sibling_paths,
                                "boundaries": check.boundaries, "max_rel_err": check.max_err})
    return out


def test_align_prefix_caching_with_full_graphs(align, record):
    from ddtree_compile.testing import e2e

    c = align.get("counters", {})
    record(start_s=align.get("engine", {}).get("start_s"), runner=align.get("engine", {}).get("runner"),
           mamba_cache_mode=align.get("mamba_cache_mode"), block=align.get("block"),
           tree_steps=c.get("tree_steps"), graph_steps=c.get("graph_steps"), sibling_rounds=c.get("sibling_rounds"),
           turn2_cached=align.get("turn2_cached"), state_check=align.get("state_check"),
           gates_ok=f"{sum(g['ok'] for g in align.get('gates', []))}/{len(align.get('gates', []))}",
           max_regret=max((g["regret"] for g in align.get("gates", [])), default=None))
    assert align["attached"], align["fallbacks_at_start"]
    assert ".gpu.model_runner." in align["engine"]["runner"], align["engine"]
    assert align["mamba_cache_mode"] == "align", align["mamba_cache_mode"]
    assert c["tree_steps"] > 0 and c["sibling_rounds"] > 0, c
    assert c["graph_steps"] >= c["tree_steps"], c
    assert align["state_check"]["boundaries"] > 0 and align["state_check"]["paths"] > 0, align["state_check"]
    assert min(align["turn2_cached"]) > 0, align["turn2_cached"]
    e2e.check_gates(align["gates"], "align, turn 1 (prompts 0-1) and turn 2 (2-3) vs no speculation")
