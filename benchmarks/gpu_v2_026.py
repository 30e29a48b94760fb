"""DDTree on vLLM 0.26's Model Runner V2 (CUDA): the users' model pair and an attention-only target.

    python benchmarks/gpu_v2_026.py --out benchmarks/results/gpu_v2_026_h200.json --parts hybrid_graphs,qwen3_graphs
    python benchmarks/gpu_v2_026.py --out benchmarks/results/gpu_v2_026_h200.json --parts hybrid,qwen3
    python benchmarks/gpu_v2_026.py --out benchmarks/results/gpu_v2_026_align_h200.json --parts align

Parts (each adds its section to the JSON at --out, written after every part):
- `hybrid`: the tiny multimodal Qwen3.5 (`Qwen3_5ForConditionalGeneration`, M-RoPE, GatedDeltaNet + full
  attention) with a DFlash drafter mixing sliding and full attention (vLLM serves it on V2 only), eager,
  text and image prompts: no speculation on V2 (reference, log-probs); DDTree with the random drafter,
  then the drafter harness with the committed GDN state checked against an fp32 replay, then seeded
  sampling (repeat, alone vs in a batch); vLLM's own flat DFlash on V2 beside it as the control for the
  regret gates.
- `qwen3`: the attention-only Qwen3 on V2 by vLLM's own choice (no environment override), eager:
  reference, DDTree random + harness, seeded sampling.
- `hybrid_graphs`, `qwen3_graphs`: the same with torch.compile (the tree pass) and vLLM's default
  FULL_AND_PIECEWISE CUDA graphs: tree verifies replay FULL graphs captured with the tree ops
  (`graph_steps`), the drafter runs eagerly (its graphs are for K queries, DDTree drafts L).
- `align`: the hybrid with prefix caching (vLLM's "align" GDN cache; the GDN state cache in bf16),
  eager, a two-turn conversation per prompt (turn 1: 300 prompt tokens, 200 generated, crossing
  block boundaries inside tree rounds; turn 2: turn 1 as the reference continued it plus 8 tokens,
  32 generated): DDTree with the drafter harness drafting the engine's own greedy continuation (a
  first pass) and the GDN state check (the state and conv window
  at every block boundary a path crossed) against no speculation (regret gates) and DDTree without
  prefix caching (first divergence; vLLM's flat DFlash with and without prefix caching beside them:
  align schedules prefills in block-aligned chunks, which can move bf16 near-ties by themselves);
  turn 2's tokens read from the cache.
- `align_graphs`: `align` with torch.compile and FULL_AND_PIECEWISE CUDA graphs for the speculating
  engines (tree verifies replay FULL graphs; vLLM's align post-processing runs after them);
  `align_graphs_only`: the same without the control engines (DDTree without prefix caching, flat DFlash).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
import time

os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)  # vLLM's own runner choice: V2 for all three
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from gpu_mrope_026 import _gates, _generate, _prompts, run_parts  # noqa: E402  (the same prompts, gates, part loop)

BUDGET, TOP_K, DRAFT_LEN, TOL = 16, 4, 7, 0.2
MIXED = ["sliding_attention", "full_attention"]
MM = {"skip_tokenizer_init": False, "max_model_len": 1024, "limit_mm_per_prompt": {"image": 1},
      "mamba_ssm_cache_dtype": "float32"}


def _engine(target, drafter=None, flat=False, eager=True, hybrid=True, **kw):
    from vllm import LLM

    from ddtree_compile.integration import config, engines
    from ddtree_compile.testing import models

    args = models.tiny_llm_kwargs(target, dtype="bfloat16", async_scheduling=False, enforce_eager=eager,
                                  **{**(MM if hybrid else {}), **kw})
    extra = {"gdn_prefill_backend": "triton"} if hybrid else {}
    if flat:
        args["speculative_config"] = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": DRAFT_LEN}
    elif drafter is not None:
        switch = config.vllm_kwargs(drafter, budget=BUDGET, top_k=TOP_K, num_speculative_tokens=DRAFT_LEN)
        args["speculative_config"] = switch["speculative_config"]
        extra.update(switch["additional_config"])
        if not eager:
            args["compilation_config"] = dict(switch["compilation_config"])
    if extra:
        args["additional_config"] = extra
    t0 = time.perf_counter()
    llm = LLM(**args)
    runner = engines.find_runner(llm)
    mc = runner.vllm_config.model_config
    return llm, {"start_s": time.perf_counter() - t0, "runner": f"{type(runner).__module__}.{type(runner).__name__}",
                 "architecture": mc.architectures[0], "uses_mrope": bool(mc.uses_mrope),
                 "cudagraph_mode": str(runner.vllm_config.compilation_config.cudagraph_mode),
                 "compilation_mode": str(runner.vllm_config.compilation_config.mode)}


def _ddtree_runs(llm, ref, prompts, out, state_check: bool, graphs: bool = False):
    """Random drafter, then the harness (GDN state check on hybrids), then seeded sampling; per kind."""
    from ddtree_compile.integration import engines, metrics
    from ddtree_compile.testing import harness

    state = engines.find_state(llm)
    out["attached"] = state is not None
    out["fallbacks_at_start"] = dict(metrics.PROCESS_STARTUP_FALLBACKS)
    if state is None:
        return
    check = harness.GdnStateCheck()
    reference = {tuple(r["prompt"]): r["prompt"] + r["tokens"] for v in ref.values() for r in v}
    # the drafter's FULL graphs (V2 captures them for 1 + L queries under DDTree): count their replays
    drafter_graphs = engines.find_runner(llm).speculator.query_cudagraph_manager
    replays, replay = [0], drafter_graphs.run_fullgraph

    def counting(desc):
        replays[0] += 1
        return replay(desc)

    drafter_graphs.run_fullgraph = counting
    out["drafter_graphs_captured"] = sorted(str(d.num_tokens) for d in getattr(drafter_graphs, "graphs", {}))
    for kind, p in prompts.items():
        c0 = metrics.collect(llm)[0]
        got = _generate(llm, p)
        c1 = metrics.collect(llm)[0]
        if state_check:
            state.debug_gdn_records = True
            state.commit_hooks.append(check)
        h = harness.DraftHarness(reference).install(llm)
        try:
            guided = _generate(llm, p)
        finally:
            h.uninstall()
            if state_check:
                state.commit_hooks.remove(check)
                state.debug_gdn_records = False
        c2 = metrics.collect(llm)[0]
        out[kind] = {"gates_random": _gates(ref[kind], got), "gates_harness": _gates(ref[kind], guided),
                     "counters_random": metrics.counters_delta(c1, c0), "counters_harness": metrics.counters_delta(c2, c1)}
    if state_check:
        out["state_check"] = {"paths": check.paths, "sibling_paths": check.sibling_paths, "max_rel_err": check.max_err}
    out.update(_seeded(llm, prompts))
    out["counters_total"] = metrics.collect(llm)[0]
    out["drafter_graph_replays"] = replays[0]
    out["ok"] = bool(
        all(all(g["ok"] for g in out[k]["gates_random"] + out[k]["gates_harness"])
            and out[k]["counters_random"]["tree_steps"] > 0 and out[k]["counters_harness"]["sibling_rounds"] > 0
            and (not graphs or out[k]["counters_random"]["graph_steps"] > 0)
            for k in prompts)
        and (not state_check or out["state_check"]["paths"] > 0)
        and (not graphs or out["drafter_graph_replays"] > 0)
        and out["seeded_repeat_equal"] and out["seeded_alone_equal"])


def _seeded(llm, prompts) -> dict:
    """Seeded sampling (temperature 1, one seed): the batch twice, and requests 1-3 alone."""
    from ddtree_compile.testing import harness

    allp = [q for v in prompts.values() for q in v]
    seeded = [s["tokens"] for s in _generate(llm, allp, temperature=1.0, seed=1234)]
    again = [s["tokens"] for s in _generate(llm, allp, temperature=1.0, seed=1234)]
    alone = [_generate(llm, [q], temperature=1.0, seed=1234)[0]["tokens"] for q in allp[1:4]]
    return {"seeded_repeat_equal": seeded == again, "seeded_alone_equal": alone == seeded[1:4],
            "seeded_alone_first_divergence": [harness.first_divergence(a, b) for a, b in zip(alone, seeded[1:4])]}


_REFS: dict = {}  # (target, prompt kinds) -> the no-speculation outputs (one reference engine per command)


def _reference(target, prompts, out, hybrid=True):
    from ddtree_compile.integration import engines

    key = (str(target), tuple(prompts))
    if key not in _REFS:
        llm, info = _engine(target, hybrid=hybrid)
        try:
            _REFS[key] = (info, {k: _generate(llm, p, logprobs=5) for k, p in prompts.items()})
        finally:
            engines.shutdown(llm)
    out["reference_engine"], ref = _REFS[key]
    out["reference"] = {k: [r["tokens"] for r in v] for k, v in ref.items()}
    return ref


def part_hybrid(dirs, prompts, out, eager=True):
    from ddtree_compile.integration import engines

    ref = _reference(dirs["target"], prompts, out)
    llm, out["ddtree_engine"] = _engine(dirs["target"], dirs["mixed"], eager=eager)
    try:
        _ddtree_runs(llm, ref, prompts, out, state_check=True, graphs=not eager)
    finally:
        engines.shutdown(llm)
    llm, out["flat_engine"] = _engine(dirs["target"], dirs["mixed"], flat=True, eager=eager)
    try:  # the control: vLLM's own flat DFlash, gated and seeded alike
        got = {k: _generate(llm, p) for k, p in prompts.items()}
        out["flat_seeded"] = _seeded(llm, prompts)
    finally:
        engines.shutdown(llm)
    out["flat_gates"] = {k: _gates(ref[k], got[k]) for k in prompts}


def part_qwen3(dirs, prompts, out, eager=True):
    from ddtree_compile.integration import engines

    text = {"text": prompts["text"]}
    ref = _reference(dirs["qwen3"], text, out, hybrid=False)
    llm, out["ddtree_engine"] = _engine(dirs["qwen3"], dirs["qwen3_mixed"], hybrid=False, eager=eager)
    try:
        _ddtree_runs(llm, ref, text, out, state_check=False, graphs=not eager)
    finally:
        engines.shutdown(llm)


def part_align(dirs, prompts, out, eager=True, controls=True):
    """controls=False: no DDTree-without-prefix-caching engine and no flat DFlash pair (the gates vs
    no speculation, the state check and the cache hits still run)."""
    from ddtree_compile.integration import engines, metrics
    from ddtree_compile.testing import harness, models

    turn1 = models.token_prompts(2, 300, models.VOCAB - 8, seed=11)
    bf16_state = {"mamba_ssm_cache_dtype": "auto"}

    def gen(llm, ps, n, logprobs=None):
        return _generate(llm, ps, logprobs=logprobs, max_tokens=n)

    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"  # the reference on the runner DDTree runs on (the mixed drafter's)
    try:
        llm, out["reference_engine"] = _engine(dirs["target"], **bf16_state)
    finally:
        os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)
    try:
        ref1 = gen(llm, turn1, 200, logprobs=5)
        turn2 = [{"prompt_token_ids": r["prompt"] + r["tokens"] + list(range(40, 48))} for r in ref1]
        ref2 = gen(llm, turn2, 32, logprobs=5)
    finally:
        engines.shutdown(llm)
    for name, pc in (("prefix_caching", True), ("control", False))[: 2 if controls else 1]:
        o = out[name] = {}
        llm, o["engine"] = _engine(dirs["target"], dirs["mixed"], enable_prefix_caching=pc, eager=eager, **bf16_state)
        try:
            state = engines.find_state(llm)
            cc = engines.find_runner(llm).vllm_config.cache_config
            o.update(attached=state is not None, mamba_cache_mode=cc.mamba_cache_mode, block=cc.mamba_block_size,
                     fallbacks_at_start=dict(metrics.PROCESS_STARTUP_FALLBACKS))
            if state is None:
                continue
            # the harness drafts the engine's own greedy continuation (a first pass, random drafter): deep
            # paths to the end, where a bf16 near-tie would otherwise end the reference's continuation early
            own = gen(llm, turn1, 200) + gen(llm, turn2, 32)
            state.debug_gdn_records = True
            check = harness.GdnStateCheck()
            state.commit_hooks.append(check)
            h = harness.DraftHarness({tuple(g["prompt"]): g["prompt"] + g["tokens"] for g in own}).install(llm)
            c0 = metrics.collect(llm)[0]
            try:
                got1 = gen(llm, turn1, 200)
                got2 = gen(llm, turn2, 32)
            finally:
                h.uninstall()
            o["equal_to_first_pass"] = [g["tokens"] for g in got1 + got2] == [g["tokens"] for g in own]
            o["counters"] = metrics.counters_delta(metrics.collect(llm)[0], c0)
            o["outputs"] = [g["tokens"] for g in got1 + got2]
            o["turn2_cached"] = [g["cached"] for g in got2]
            o["gates"] = [harness.regret_gate((r["tokens"], r["lps"]), g["tokens"], TOL)
                          for r, g in zip(ref1 + ref2, got1 + got2)]
            o["state_check"] = {"paths": check.paths, "sibling_paths": check.sibling_paths,
                                "boundaries": check.boundaries, "max_rel_err": check.max_err}
        finally:
            engines.shutdown(llm)
    pc = out["prefix_caching"]
    done = bool(pc["mamba_cache_mode"] == "align" and all(g["ok"] for g in pc["gates"])
                and pc["counters"]["tree_steps"] > 0 and pc["counters"]["sibling_rounds"] > 0
                and pc["state_check"]["boundaries"] > 0 and min(pc["turn2_cached"]) > 0
                and (eager or pc["counters"]["graph_steps"] > 0))
    if not controls:
        out["ok"] = done
        return
    flat = {}
    for pc_on in (True, False):  # vLLM's own flat DFlash: what prefix caching alone changes
        llm, _ = _engine(dirs["target"], dirs["mixed"], flat=True, enable_prefix_caching=pc_on, eager=eager,
                         **bf16_state)
        try:
            flat[pc_on] = [g["tokens"] for g in gen(llm, turn1, 200) + gen(llm, turn2, 32)]
        finally:
            engines.shutdown(llm)
    out["flat_first_divergence_pc_vs_none"] = [harness.first_divergence(a, b) for a, b in zip(flat[True], flat[False])]
    ctl = out["control"]
    out["equal_to_control"] = pc.get("outputs") is not None and pc.get("outputs") == ctl.get("outputs")
    if pc.get("outputs") and ctl.get("outputs"):
        out["first_divergence_pc_vs_none"] = [harness.first_divergence(a, b) for a, b in zip(pc["outputs"], ctl["outputs"])]
    out["ok"] = done and all(g["ok"] for g in ctl["gates"])


PARTS = {"hybrid": part_hybrid, "qwen3": part_qwen3, "align": part_align,
         "align_graphs": lambda d, p, o: part_align(d, p, o, eager=False),
         "align_graphs_only": lambda d, p, o: part_align(d, p, o, eager=False, controls=False),
         "hybrid_graphs": lambda d, p, o: part_hybrid(d, p, o, eager=False),
         "qwen3_graphs": lambda d, p, o: part_qwen3(d, p, o, eager=False)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--parts", default="hybrid_graphs,qwen3_graphs,hybrid,qwen3")
    args = ap.parse_args(argv)
    import torch
    import vllm

    from ddtree_compile.integration import plugin
    from ddtree_compile.testing import models

    plugin.register()
    path = pathlib.Path(args.out)
    result = json.loads(path.read_text()) if path.exists() else {}
    result.update({"command": "python benchmarks/gpu_v2_026.py --out " + args.out, "vllm": vllm.__version__,
                   "torch": torch.__version__, "device": torch.cuda.get_device_name(0),
                   "budget": BUDGET, "top_k": TOP_K, "draft_len": DRAFT_LEN})
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        target = models.write_tiny_vl_model(root / "target", seed=4)
        qwen3 = models.write_tiny_model("qwen3", root / "qwen3")
        dirs = {"target": target, "qwen3": qwen3,
                "mixed": models.write_tiny_dflash_drafter(target, root / "mixed", seed=4, layer_types=MIXED),
                "qwen3_mixed": models.write_tiny_dflash_drafter(qwen3, root / "qwen3_mixed", layer_types=MIXED)}
        run_parts(args.parts.split(","), PARTS, (dirs, _prompts()), result, path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
