"""DDTree end to end inside vLLM 0.26 on its V1 runner, with FULL CUDA graphs.

The tiny dense hybrid (Qwen3-Next architecture: GatedDeltaNet + full attention) with budget 16, top_k 4,
draft length 7: greedy within the regret gate of no speculation (its own random drafter, then the
drafter harness, whose trees branch), every tree verify a FULL-graph replay, the committed GDN state
and conv window equal to a float32 replay of every committed path, the walk and commit replayed as
CUDA graphs, seeded sampling reproducible and independent of the batch; then batches of 1-5 requests
compile no Triton kernel of DDTree's (issue 27: a first run at a new batch size was slow).
The attention-only Qwen3 with budget "auto" over tree buckets 8 and 16: FULL graphs captured for both
buckets and for the chain, every tree step and every chain step a replay, the gates hold.
"""

from __future__ import annotations

import _engines as E
import pytest

JIT_BATCHES = (1, 2, 3, 4, 1, 3, 5)


def _jit_batches(llm, prompts) -> list[dict]:
    """Greedy batches of JIT_BATCHES requests with a Triton post-compile hook: what compiled in each."""
    from triton import knobs

    events: list[tuple[int, str, str]] = []
    phase = [0]

    def hook(*args, **kw):
        fn = kw.get("fn")
        py = getattr(fn, "fn", fn)
        events.append((phase[0], getattr(py, "__name__", str(fn)), getattr(py, "__module__", "") or ""))

    old = knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_post_compile_hook = hook
    try:
        rows = []
        for R in JIT_BATCHES:
            phase[0] = len(rows)
            E.generate(llm, prompts[:R], max_tokens=32)
            new = [e for e in events if e[0] == len(rows)]
            rows.append({"R": R, "compiles": len(new), "kernels": sorted({e[1] for e in new}),
                         "ddtree_kernels": sorted({e[1] for e in new if e[2].startswith("ddtree_compile")})})
        return rows
    finally:
        knobs.runtime.jit_post_compile_hook = old


@pytest.fixture(scope="module")
def hybrid(gpu_env, tmp_path_factory):
    gpu_env.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")  # the V1 runner, whose hooks DDTree uses here
    from ddtree_compile.testing import models

    root = tmp_path_factory.mktemp("hybrid")
    target = models.write_tiny_model("qwen3_next_dense", root / "target")
    drafter = models.write_tiny_dflash_drafter(target, root / "dflash")
    prompts = {"text": models.token_prompts(4, 16, models.VOCAB, seed=0)}
    ref_info, ref = E.reference(target, prompts, score=True)
    # vLLM's compiled no-speculation engine (compiled as the DDTree engine is, FULL graphs): where DDTree
    # leaves the eager reference, whether the compiled target's numerics left it there too (recorded), and
    # what it prefers there given the reference's own prefix (teacher-forced, as the eager engine scored it)
    compiled_info, compiled = E.reference(target, prompts, graphs=True, score=ref)
    with E.running(target, drafter) as (llm, info):
        out = E.ddtree_runs(llm, ref, prompts, state_check=True, control=compiled)
        out["jit"] = _jit_batches(llm, models.token_prompts(max(JIT_BATCHES), 16, models.VOCAB, seed=9))
    forced = {k: tuple(i.get("forced", {}).get(k) for i in (ref_info, compiled_info)) for k in prompts}
    return {"reference_engine": ref_info, "engine": info, "compiled_vs_eager": E.gates(ref["text"], compiled["text"]),
            "forced": forced, "forced_error": ref_info.get("forced_error") or compiled_info.get("forced_error"), **out}


def test_hybrid_lossless_with_full_graphs(hybrid, record):
    def first(report):  # (first divergence, regret there) per prompt
        return [(g["divergence"], round(g["regret"], 3)) for g in report]

    text = hybrid.get("text", {})
    record(start_s=hybrid["engine"]["start_s"], runner=hybrid["engine"].get("runner"),
           cudagraph_mode=hybrid["engine"].get("cudagraph_mode"),
           compiled_no_spec={"vs_eager": first(hybrid["compiled_vs_eager"]),
                             **{f"ddtree_{d}_vs_it": first(text[f"control_{d}"]) for d in ("random", "harness")
                                if f"control_{d}" in text},
                             # at each DDTree divergence from eager: both engines' top 2 on the eager prefix
                             **{f"ddtree_{d}_at_divergence": E.at_divergences(text[f"gates_{d}"], *hybrid["forced"]["text"])
                                for d in ("random", "harness") if f"gates_{d}" in text},
                             "forced_error": hybrid["forced_error"]})
    assert ".gpu_model_runner." in hybrid["engine"].get("runner", ""), hybrid["engine"]  # V1 (V2: gpu.model_runner)
    graphs = not E.ddtree_eager()  # (the bisection switch: the gates of an eager DDTree engine)
    assert not graphs or "FULL" in hybrid["engine"]["cudagraph_mode"], hybrid["engine"]
    E.check_lossless(hybrid, ["text"], graphs=graphs, record=record)
    assert not graphs or hybrid["counters_total"].get("graph_sizes"), hybrid["counters_total"]


def test_hybrid_walk_and_commit_replay_cuda_graphs(hybrid, record):
    """The walk, the commit and (after a FULL verify's replay) the drafter inputs' reorder replay graphs."""
    total = hybrid.get("counters_total", {})
    stages = total.get("stage_replays", {})
    record(stage_replays=stages, stage_eager=total.get("stage_eager"), stage_graphs=total.get("stage_graphs"))
    assert all(stages.get(s, 0) > 0 for s in ("walk", "commit", "reorder")), stages


def test_no_triton_compiles_of_ddtree_kernels_after_serving(hybrid, record):
    rows = hybrid["jit"]
    record(batches=rows)
    late = [(r["R"], r["ddtree_kernels"]) for r in rows if r["ddtree_kernels"]]
    assert not late, f"DDTree kernels compiled at these batch sizes after start-up: {late}"


@pytest.fixture(scope="module")
def auto_menu(gpu_env, tmp_path_factory):
    gpu_env.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    from ddtree_compile.integration import engines, metrics
    from ddtree_compile.testing import models

    root = tmp_path_factory.mktemp("qwen3")
    target = models.write_tiny_model("qwen3", root / "target")
    drafter = models.write_tiny_dflash_drafter(target, root / "dflash")
    prompts = {"text": models.token_prompts(4, 16, models.VOCAB, seed=0)}
    _, ref = E.reference(target, prompts, hybrid=False)
    continuation = {tuple(r["prompt"]): r["prompt"] + r["tokens"] for r in ref["text"]}
    with E.running(target, drafter, hybrid=False, auto_menu=[8, 16]) as (llm, info):
        attached = engines.find_state(llm) is not None
        got = E.generate(llm, prompts["text"])
        c_random = metrics.collect(llm)[0] if attached else {}
        with E.drafting_from(llm, continuation):
            guided = E.generate(llm, prompts["text"])
        total = metrics.collect(llm)[0] if attached else {}
    return {"engine": info, "attached": attached, "fallbacks": dict(metrics.PROCESS_STARTUP_FALLBACKS),
            "counters_random": c_random, "counters_total": total,
            "gates": E.gates(ref["text"], got) + E.gates(ref["text"], guided)}


def test_auto_budget_replays_full_graphs_for_every_bucket_and_the_chain(auto_menu, record):
    """Budget "auto" over the menu 8 / 16 nodes (L = 7): FULL graphs captured for both tree buckets (with
    the tree ops) and for the chain (L + 1 tokens, vLLM's ops); every tree and chain step replays one."""
    from ddtree_compile.testing import e2e

    c, total = auto_menu["counters_random"], auto_menu["counters_total"]
    record(start_s=auto_menu["engine"]["start_s"], graph_buckets=total.get("graph_buckets"),
           chain_graph_sizes=total.get("chain_graph_sizes"), budget_steps=c.get("budget_steps"),
           tree_steps=c.get("tree_steps"), graph_steps=c.get("graph_steps"), auto_chain_steps=c.get("auto_chain_steps"),
           plain_graph_steps=c.get("plain_graph_steps"),
           gates_ok=f"{sum(g['ok'] for g in auto_menu['gates'])}/{len(auto_menu['gates'])}",
           max_regret=max(g["regret"] for g in auto_menu["gates"]))
    assert auto_menu["attached"], auto_menu["fallbacks"]
    assert set(map(int, total["graph_buckets"])) == {8, 16} and total["chain_graph_sizes"], total
    steps = {int(k): v for k, v in c["budget_steps"].items()}
    assert steps.get(8, 0) > 0 and steps.get(16, 0) > 0, c["budget_steps"]
    assert c["graph_steps"] >= c["tree_steps"] > 0, c  # the tree steps replayed their buckets' graphs
    assert c["auto_chain_steps"] > 0 and c["plain_graph_steps"] >= c["auto_chain_steps"], c  # and the chain's
    e2e.check_gates(auto_menu["gates"], "budget auto, random drafter (prompts 0-3) and harness (4-7) vs no speculation")
