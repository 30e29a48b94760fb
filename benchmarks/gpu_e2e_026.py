"""DDTree inside vLLM 0.26 on a CUDA GPU, end to end: greedy DDTree vs no speculation.

    python benchmarks/gpu_e2e_026.py --out benchmarks/results/gpu_e2e_026_h100.json [--kinds qwen3,qwen3_next]

Per target kind: one engine without speculation (reference, with log-probs for the regret gate) and
one with DDTree (tiny DFlash drafter, then the test drafter harness so trees really branch, then
seeded sampling twice and one request alone), both with vLLM's CUDA graphs (default
FULL_AND_PIECEWISE: tree verifies replay FULL graphs captured with the tree ops, mixed batches run
PIECEWISE) and Inductor graph partition (the tree-verify pass sees the attention / GDN ops).
Attention-only targets run on the V1 runner (VLLM_USE_V2_MODEL_RUNNER=0: the round's hooks live
there). `--quantization fp8` (FP8 weights) and `--kv-cache-dtype fp8` (an FP8 KV cache: tree attention
reads FP8 K/V and the FP8 query vLLM hands over) apply to every engine; a quantized target's gates count
only the prompts where DDTree leaves the reference and vLLM's own flat DFlash (the control, on the same
quantized target) does not: what quantization moves by itself is not DDTree's. `--control-backend
TRITON_ATTN` adds a no-speculation engine on another of vLLM's attention kernels: its own gate misses
against the reference are the noise floor of swapping one attention kernel for another (the tree
verify runs DDTree's tree attention where the reference runs FlashAttention), and a quantized target
passes when the tree's misses beyond flat DFlash's are no more than that control's. Writes one JSON with the
outputs' agreement, DDTree's counters (graph_steps: verifies that replayed a FULL graph), vLLM's capture
time and memory and the engine settings; prints a table last.

tests/test_gpu_vllm026.py runs the same checks as a GPU test module.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
import time
import traceback

os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: counters, harness
os.environ.setdefault("HF_HUB_OFFLINE", "1")

BUDGET, TOP_K, DRAFT_LEN, MAX_TOKENS, NUM_PROMPTS = 16, 4, 7, 96, 4
CUDAGRAPH_MODE = "FULL_AND_PIECEWISE"
# The hybrids' GDN state cache (vLLM's mamba_ssm_cache_dtype) in float32 for both engines: with
# "auto" (the model's bf16) no speculation rounds the state to bf16 after every token while a verify
# that accepts k tokens rounds once after k, and that alone moved one prompt's first divergence
# past the regret gate (0.375 nat), DDTree's plain chain (top_k 1) exactly as much as its trees
# (benchmarks/results/gpu_vllm026_h100.json, "probes").
SSM_CACHE_DTYPE = "float32"
SKIP_FLAT = False
QUANT_KW: dict = {}  # quantization / kv_cache_dtype for every engine (--quantization, --kv-cache-dtype)
CONTROL_BACKEND = None  # --control-backend: a no-speculation engine on this attention backend
AUTO_MENU: list = []  # --auto-budget: DDTree with budget "auto" over this menu of tree buckets


class _CaptureLog:
    """vLLM's own capture summary lines ("Graph capturing finished in X secs, took Y GiB")."""

    def __init__(self):
        import logging

        self.lines: list[str] = []
        outer = self

        class _H(logging.Handler):
            def emit(self, record):
                msg = record.getMessage()
                if "Graph capturing finished" in msg or "Capturing CUDA graphs" in msg:
                    outer.lines.append(msg)

        self.handler = _H()
        logging.getLogger("vllm").addHandler(self.handler)

    def close(self):
        import logging

        logging.getLogger("vllm").removeHandler(self.handler)


def _engine(target, drafter=None, hybrid=False, dtype="bfloat16", flat=False, **llm_kw):
    from vllm import LLM

    from ddtree_compile.integration import config
    from ddtree_compile.passes.entry import compilation_config
    from ddtree_compile.testing import models

    cc = compilation_config("cuda")
    cc["cudagraph_mode"] = CUDAGRAPH_MODE
    kw = models.tiny_llm_kwargs(target, dtype=dtype, async_scheduling=False, compilation_config=cc,
                                **{**QUANT_KW, **llm_kw})
    if hybrid and SSM_CACHE_DTYPE != "auto":
        kw["mamba_ssm_cache_dtype"] = SSM_CACHE_DTYPE
    extra = {"gdn_prefill_backend": "triton"} if hybrid else {}
    if flat:  # vLLM's own flat DFlash: the control for what speculation alone changes in bf16
        kw["speculative_config"] = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": DRAFT_LEN}
    elif drafter is not None:
        auto = {"auto_budget": AUTO_MENU, "probe_interval": 4} if AUTO_MENU else {}
        switch = config.vllm_kwargs(drafter, budget="auto" if AUTO_MENU else BUDGET, top_k=TOP_K,
                                    num_speculative_tokens=DRAFT_LEN, **auto)
        kw["speculative_config"] = switch["speculative_config"]
        extra.update(switch["additional_config"])
    if extra:
        kw["additional_config"] = extra
    t0 = time.perf_counter()
    llm = LLM(**kw)
    return llm, time.perf_counter() - t0


def _seeded_controls(llm, prompts, prefix: str) -> dict:
    """Seeded sampling twice with the same seed, and prompt 1 alone: equal? (DDTree's
    seeded_repeat_equal / seeded_alone_equal beside the engines' own: an FP8-weight target's dynamic
    activation scales may make any engine's samples depend on the batch, with speculation or without.)"""
    from ddtree_compile.testing import harness

    a, b = (harness.generate(llm, prompts, MAX_TOKENS, temperature=1.0, seed=1234) for _ in range(2))
    alone = harness.generate(llm, prompts[1:2], MAX_TOKENS, temperature=1.0, seed=1234)
    return {f"{prefix}_seeded_repeat_equal": a == b, f"{prefix}_seeded_alone_equal": alone[0] == a[1]}


def run_kind(spec: str, root: pathlib.Path) -> dict:
    """spec: "kind" or "kind:dtype" (the engines' dtype; default bfloat16)."""
    from ddtree_compile import adapters
    from ddtree_compile.integration import engines, metrics
    from ddtree_compile.testing import harness, models

    kind, _, dtype = spec.partition(":")
    dtype = dtype or "bfloat16"
    target = models.write_tiny_model(kind, root / spec.replace(":", "_"))
    drafter = models.write_tiny_dflash_drafter(target, root / f"{spec.replace(':', '_')}_dflash")
    prompts = models.token_prompts(NUM_PROMPTS, 16, models.VOCAB, seed=0)
    hybrid = kind != "qwen3"
    out = {"kind": kind, "dtype": dtype, **QUANT_KW}
    llm, out["start_s_reference"] = _engine(target, hybrid=hybrid, dtype=dtype)
    try:
        ref = harness.generate_with_logprobs(llm, prompts, MAX_TOKENS)
        out.update(_seeded_controls(llm, prompts, "reference"))  # the controls for DDTree's
    finally:
        engines.shutdown(llm)
    ref_tokens = [t for t, _ in ref]
    out["mamba_ssm_cache_dtype"] = SSM_CACHE_DTYPE
    if hybrid and not SKIP_FLAT:
        llm, out["start_s_flat"] = _engine(target, drafter, hybrid=hybrid, dtype=dtype, flat=True)
        try:
            flat_out = harness.generate(llm, prompts, MAX_TOKENS)
            out.update(_seeded_controls(llm, prompts, "flat"))
        finally:
            engines.shutdown(llm)
        out["gates_flat_dflash"] = [harness.regret_gate(r, g) for r, g in zip(ref, flat_out)]
    if CONTROL_BACKEND:
        llm, out["start_s_control_backend"] = _engine(target, hybrid=hybrid, dtype=dtype,
                                                      attention_config={"backend": CONTROL_BACKEND})
        try:
            control_out = harness.generate(llm, prompts, MAX_TOKENS)
        finally:
            engines.shutdown(llm)
        out["control_backend"] = CONTROL_BACKEND
        out["gates_control_backend"] = [harness.regret_gate(r, g) for r, g in zip(ref, control_out)]
    log = _CaptureLog()
    try:
        llm, out["start_s_ddtree"] = _engine(target, drafter, hybrid=hybrid, dtype=dtype)
    finally:
        log.close()
    out["capture_log"] = log.lines
    try:
        state = engines.find_state(llm)
        out["attached"] = state is not None
        out["fallbacks_at_start"] = dict(metrics.PROCESS_STARTUP_FALLBACKS)
        runner = engines.find_runner(llm)
        cc = runner.vllm_config.compilation_config
        out["cudagraph_mode"] = str(cc.cudagraph_mode)
        out["cudagraph_capture_sizes"] = list(cc.cudagraph_capture_sizes or [])
        out["runner"] = type(runner).__name__
        if state is not None and state.ctx.attn_layers:  # what tree attention reads (an FP8 KV cache or not)
            p = adapters.current().attention_params(state.ctx.layer(state.ctx.attn_layers[0]))
            out["tree_attention_kv"] = str(p.kv_fp8 or "model dtype")
        t0 = time.perf_counter()
        random_out = harness.generate(llm, prompts, MAX_TOKENS)
        out["random_s"] = time.perf_counter() - t0
        c_random = metrics.collect(llm)[0] if state is not None else {}
        check = None
        if hybrid and state is not None:  # committed GDN state and conv window == fp32 replay of the path
            state.debug_gdn_records = True
            check = harness.GdnStateCheck()
            state.commit_hooks.append(check)
        h = harness.DraftHarness(harness.reference_from_outputs(prompts, ref_tokens)).install(llm)
        try:
            harness_out = harness.generate(llm, prompts, MAX_TOKENS)
        except AssertionError as e:
            out["state_check_error"] = str(e)[:500]
            raise
        h.uninstall()
        if check is not None:
            out["state_check"] = {"paths": check.paths, "sibling_paths": check.sibling_paths,
                                  "max_rel_err": check.max_err,
                                  "ssm_cache_dtype": str(adapters.current().gdn_state_views(
                                      state.ctx.layer(state.ctx.gdn_layers[0]))[1].dtype)}
        c_harness = metrics.collect(llm)[0] if state is not None else {}
        if check is not None:
            state.commit_hooks.remove(check)
            state.debug_gdn_records = False
        # seeded sampling: reproducible, and a request's samples do not depend on its batch
        seeded = [harness.generate(llm, prompts, MAX_TOKENS, temperature=1.0, seed=1234 + i) for i in range(2)]
        again = harness.generate(llm, prompts, MAX_TOKENS, temperature=1.0, seed=1234)
        alone = harness.generate(llm, prompts[1:2], MAX_TOKENS, temperature=1.0, seed=1234)
        out["seeded_repeat_equal"] = again == seeded[0]
        out["seeded_alone_equal"] = alone[0] == seeded[0][1]
        out["seeded_seeds_differ"] = seeded[0] != seeded[1]
        c_all = metrics.collect(llm)[0] if state is not None else {}
    finally:
        engines.shutdown(llm)
    out["counters_random"] = c_random
    out["counters_harness"] = metrics.counters_delta(c_harness, c_random) if c_harness else {}
    out["counters_seeded"] = metrics.counters_delta(c_all, c_harness) if c_all else {}
    out["graph_sizes"] = c_all.get("graph_sizes", [])
    out["random_equal"] = random_out == ref_tokens
    out["harness_equal"] = harness_out == ref_tokens
    out["gates_random"] = [harness.regret_gate(r, g) for r, g in zip(ref, random_out)]
    out["gates_harness"] = [harness.regret_gate(r, g) for r, g in zip(ref, harness_out)]
    full = "FULL" in out.get("cudagraph_mode", "")
    gates_ok = all(g["ok"] for g in out["gates_random"] + out["gates_harness"])
    if QUANT_KW and "gates_flat_dflash" in out:  # the tree's divergences beyond what flat DFlash shows
        flat_bad = {i for i, g in enumerate(out["gates_flat_dflash"]) if not g["ok"]}
        tree_bad = {i for gs in (out["gates_random"], out["gates_harness"]) for i, g in enumerate(gs) if not g["ok"]}
        out["gates_beyond_flat"] = sorted(tree_bad - flat_bad)
        control_bad = [i for i, g in enumerate(out.get("gates_control_backend", [])) if not g["ok"]]
        out["gate_misses"] = {"ddtree": len(tree_bad), "flat_dflash": len(flat_bad),
                              "beyond_flat": len(tree_bad - flat_bad),
                              "control_backend": len(control_bad) if CONTROL_BACKEND else None}
        gates_ok = len(out["gates_beyond_flat"]) <= len(control_bad)
    # seeded sampling's batch independence and repeats: DDTree's own, unless flat DFlash (the control
    # on the same quantized target) lacks them too
    seeded_ok = all(out[f"seeded_{k}_equal"] or (QUANT_KW and out.get(f"flat_seeded_{k}_equal") is False)
                    for k in ("repeat", "alone"))
    out["ok"] = bool(out["attached"] and c_random.get("tree_steps", 0) > 0 and gates_ok
                     and seeded_ok and out["seeded_seeds_differ"]
                     and (not full or (out["graph_sizes"] and c_all.get("graph_steps", 0) > 0))
                     and (not hybrid or out.get("state_check", {}).get("paths", 0) > 0))
    return out


def main(argv=None) -> int:
    global BUDGET, TOP_K, DRAFT_LEN, CUDAGRAPH_MODE, SSM_CACHE_DTYPE, SKIP_FLAT, QUANT_KW, NUM_PROMPTS, CONTROL_BACKEND
    global AUTO_MENU
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--kinds", default="qwen3,qwen3_next_dense", help="kind[:dtype],...")
    ap.add_argument("--budget", type=int, default=BUDGET)
    ap.add_argument("--top-k", type=int, default=TOP_K)
    ap.add_argument("--draft-len", type=int, default=DRAFT_LEN)
    ap.add_argument("--cudagraph-mode", default=CUDAGRAPH_MODE, help="FULL_AND_PIECEWISE, PIECEWISE, NONE, ...")
    ap.add_argument("--ssm-cache-dtype", default=SSM_CACHE_DTYPE, help="the hybrids' mamba_ssm_cache_dtype "
                    "(auto: the model's dtype)")
    ap.add_argument("--skip-flat", action="store_true", help="no vLLM flat DFlash control engine")
    ap.add_argument("--quantization", default=None, help="vLLM's quantization for every engine (fp8: FP8 weights)")
    ap.add_argument("--kv-cache-dtype", default=None, help="vLLM's kv_cache_dtype for every engine (fp8)")
    ap.add_argument("--prompts", type=int, default=NUM_PROMPTS, help="prompts per engine")
    ap.add_argument("--auto-budget", default="", help="DDTree with budget \"auto\" over this menu of tree "
                    "buckets (e.g. 4,8,16; its largest sizes vLLM's slots) instead of --budget")
    ap.add_argument("--control-backend", default=None, help="a no-speculation control engine on this attention "
                    "backend (TRITON_ATTN): the noise floor of another attention kernel (module docstring)")
    args = ap.parse_args(argv)
    QUANT_KW = {k: v for k, v in (("quantization", args.quantization), ("kv_cache_dtype", args.kv_cache_dtype)) if v}
    BUDGET, TOP_K, DRAFT_LEN, CUDAGRAPH_MODE = args.budget, args.top_k, args.draft_len, args.cudagraph_mode
    SSM_CACHE_DTYPE, SKIP_FLAT = args.ssm_cache_dtype, args.skip_flat
    NUM_PROMPTS, CONTROL_BACKEND = args.prompts, args.control_backend
    AUTO_MENU = [int(b) for b in args.auto_budget.split(",") if b]
    import torch
    import vllm

    from ddtree_compile.integration import plugin

    plugin.register()
    result = {"command": " ".join(sys.argv), "vllm": vllm.__version__, "torch": torch.__version__,
              "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
              "budget": BUDGET, "top_k": TOP_K, "draft_len": DRAFT_LEN, "max_tokens": MAX_TOKENS,
              "prompts": NUM_PROMPTS,
              "auto_budget": AUTO_MENU or None,
              "cudagraph_mode": CUDAGRAPH_MODE, "mamba_ssm_cache_dtype": SSM_CACHE_DTYPE, **QUANT_KW, "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        for spec in args.kinds.split(","):
            try:
                result["runs"].append(run_kind(spec, pathlib.Path(tmp)))
            except Exception as e:  # keep going: every kind's result (or error) goes in the JSON
                result["runs"].append({"kind": spec, "ok": False, "error": repr(e),
                                       "traceback": traceback.format_exc()[-4000:]})
                print(traceback.format_exc()[-4000:], file=sys.stderr)
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    print("\nkind:dtype            attached  runner            graphs      tree/graph steps  equal(rand/harn)  ok")
    for r in result["runs"]:
        c = r.get("counters_random", {})
        print(f"{r['kind'] + ':' + r.get('dtype', ''):<21} {str(r.get('attached')):<9} {r.get('runner', '-'):<17} "
              f"{r.get('cudagraph_mode', '-')[-12:]:<11} {c.get('tree_steps', '-')!s:>6}/{c.get('graph_steps', '-')!s:<10} "
              f"{r.get('random_equal')!s}/{r.get('harness_equal')!s}  {r['ok']}"
              + (f"  ERROR {r['error'][:200]}" if "error" in r else ""))
    return 0 if all(r["ok"] for r in result["runs"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
