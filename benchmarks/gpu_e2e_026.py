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

Long prompts (issue 28: `vllm serve` case 9 left the gate at ~1500-token chat prompts, the other gates
use 16-token prompts): `--prompt-len N` makes the prompts N random tokens (the engines then get
max_model_len and max_num_batched_tokens 4096, as the serve: the same KV block table width, hence the
same tree-attention split plan); `--prompt-kind chat` uses the serve's chat prompts (a repeated system
prompt, ~1570 tokens; with --prompt-len, repeated until at least N tokens), tokenized by the target's
own offline tokenizer and chat template. The kind `qwen3_5_vl` is the serve's target: the tiny
multimodal Qwen3.5 served text-only (language_model_only), `--model-seed 3` its weights and drafter.
`--prefix-caching` turns vLLM's prefix caching on for every engine ("align" GDN cache on hybrids, as
the serve). `--segments` keeps the reference engine running and gates every divergence of flat DFlash
and DDTree (random drafter) per prompt: after each divergence both continue from the reference's
prefix through the divergent token (`segments_*`: position, gap, rank, regret per divergence;
informational, unlike harness.regret_segments it goes on past a failing one). `--tree-attn-splits S`
forces the tree attention's split-KV count in the DDTree engine (1: one split, no merge: the direct
path), to tell the split path's numerics from the rest. `per_prompt` in each run's JSON: per prompt its
length and, per engine, the first divergence and regret.

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
PROMPT_LEN: int | None = None  # --prompt-len: random prompts of this many tokens (default 16); chat: at least
PROMPT_KIND = "random"  # --prompt-kind: random token ids, or the serve's chat prompts ("chat")
MODEL_SEED = 0  # --model-seed: the tiny target's and drafter's weights (gpu_serve_026 uses 3)
ENGINE_KW: dict = {}  # engine settings from the options above (max_model_len, prefix caching) for every engine
SEGMENTS = False  # --segments: every divergence of flat DFlash and DDTree gated (the reference kept running)
MAX_SEGMENTS, TOL = 16, 0.2
TREE_ATTN_SPLITS: int | None = None  # --tree-attn-splits: force the tree attention's split count
VL_KIND = "qwen3_5_vl"  # the serve's target: the tiny multimodal Qwen3.5, served text-only
LONG_MODEL_LEN = 4096  # the serve's max_model_len / max_num_batched_tokens, for prompts past 512 tokens
TOPICS = ("the weather in paris and tokyo", "rivers of europe", "mountains of asia", "the history of tea",
          "trains in japan", "old maps", "bees and flowers", "the moon landing")


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
                                **{**ENGINE_KW, **QUANT_KW, **llm_kw})
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


def _chat_prompts(target, n: int, min_len: int | None) -> list[dict]:
    """gpu_serve_026's turn-1 chat prompts (its system prompt repeated 90 times, its topics first), token
    ids from the target's offline tokenizer and chat template; with min_len, the system prompt repeated
    until the prompt has at least min_len tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target))

    def ids(i, reps):
        system = {"role": "system", "content": f"You are terse assistant number {i}. " * reps}
        msgs = [system, {"role": "user", "content": f"Tell me about {TOPICS[i % len(TOPICS)]}, please."}]
        t = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, enable_thinking=False)
        return list(t["input_ids"] if hasattr(t, "keys") else t)

    out = []
    for i in range(n):
        reps = 90
        if min_len is not None:
            reps = 1
            while len(ids(i, reps)) < min_len:
                reps = max(reps + 1, reps * min_len // max(1, len(ids(i, reps))))
        out.append({"prompt_token_ids": ids(i, reps)})
    return out


def _write_models(kind: str, root: pathlib.Path, name: str):
    """(target, drafter, extra engine kwargs, prompts) for one kind."""
    from ddtree_compile.testing import models, tokenizer

    if kind == VL_KIND:  # text-only, as `vllm serve --language-model-only` (gpu_serve_026)
        target = models.write_tiny_vl_model(root / name, seed=MODEL_SEED)
        extra = {"language_model_only": True, "skip_tokenizer_init": False}
        vocab = models.VOCAB - 8  # no vision token ids (VOCAB-5..VOCAB-2) in random prompts
    else:
        target = models.write_tiny_model(kind, root / name, seed=MODEL_SEED)
        extra, vocab = {}, models.VOCAB
        if PROMPT_KIND == "chat":  # the tokenizer and chat template beside it (prompts only: ids are passed)
            tokenizer.write_tokenizer(target, seed=MODEL_SEED)
    drafter = models.write_tiny_dflash_drafter(target, root / f"{name}_dflash", seed=MODEL_SEED)
    if PROMPT_KIND == "chat":
        prompts = _chat_prompts(target, NUM_PROMPTS, PROMPT_LEN)
    else:
        prompts = models.token_prompts(NUM_PROMPTS, PROMPT_LEN or 16, vocab, seed=0)
    return target, drafter, extra, prompts


def _segments(ref_llm, cand_llm, prompt: dict, total: int) -> list[dict]:
    """Every divergence of `cand_llm` from `ref_llm` over `total` greedy tokens (harness.regret_segments
    in one window, going on past a failing one up to MAX_SEGMENTS, so a systematic drift shows as many
    failures; later records start from a fresh prefill of the longer prefix)."""
    from ddtree_compile.testing import harness

    return harness.regret_segments(ref_llm, cand_llm, prompt, total, TOL, window=total, stop_at_failure=False,
                                   max_segments=MAX_SEGMENTS)


TREE_ATTN_PLANS: set = set()  # (R, N, Hq, Hkv, D, page size, table pages, splits) of the tree-attention calls seen


def _watch_tree_attention() -> None:
    """Wrap the tree-attention op's CUDA launcher (in-process engines): note each bucket's plan (shapes
    only, no sync: warm-ups, captures and eager verifies; FULL-graph replays run no Python) and, with
    --tree-attn-splits, force the split count."""
    from ddtree_compile.templates import ops, tuning

    orig = getattr(ops.launch_tree_attention, "__wrapped__", ops.launch_tree_attention)

    def launch(*a, **k):
        a = list(a)
        if TREE_ATTN_SPLITS is not None:
            a[13] = TREE_ATTN_SPLITS  # (query .. logits_soft_cap: 11, scratch, tiles, splits, scales)
        q, kc, bt, bits = a[0], a[1], a[3], a[5]
        TREE_ATTN_PLANS.add((bt.shape[0], bits.shape[1], q.shape[1], kc.shape[2], q.shape[2], kc.shape[1],
                             bt.shape[1], tuning.plan_tree_attention(q, kc, bits, bt, a[12], a[13])[3]))
        return orig(*a, **k)

    launch.__wrapped__ = orig
    ops.launch_tree_attention = launch


def _per_prompt(out: dict, prompts: list[dict]) -> list[dict]:
    """Per prompt: its length and, per engine, the first divergence / regret / ok (and the segments)."""
    rows = []
    for i, p in enumerate(prompts):
        row = {"prompt": i, "prompt_len": len(p["prompt_token_ids"])}
        for key, label in (("gates_random", "ddtree"), ("gates_harness", "ddtree_harness"),
                           ("gates_flat_dflash", "flat_dflash"), ("gates_control_backend", "control_backend")):
            if key in out:
                g = out[key][i]
                row[label] = {"first_divergence": g["divergence"], "regret": g["regret"], "rank": g["rank"],
                              "ok": g["ok"]}
        for key in ("segments_ddtree", "segments_flat_dflash"):
            if key in out:
                row[key] = [{k: g[k] for k in ("at", "gap", "rank", "regret", "ok")} for g in out[key][i]]
        rows.append(row)
    return rows


def run_kind(spec: str, root: pathlib.Path) -> dict:
    """spec: "kind" or "kind:dtype" (the engines' dtype; default bfloat16)."""
    from ddtree_compile.integration import engines
    from ddtree_compile.testing import harness

    kind, _, dtype = spec.partition(":")
    dtype = dtype or "bfloat16"
    target, drafter, extra_kw, prompts = _write_models(kind, root, spec.replace(":", "_"))
    hybrid = kind != "qwen3"
    out = {"kind": kind, "dtype": dtype, **QUANT_KW, "prompt_kind": PROMPT_KIND, "model_seed": MODEL_SEED,
           "prompt_lens": [len(p["prompt_token_ids"]) for p in prompts],
           "engine_kw": {k: v for k, v in {**ENGINE_KW, **extra_kw}.items()}}
    llm, out["start_s_reference"] = _engine(target, hybrid=hybrid, dtype=dtype, **extra_kw)
    try:
        ref = harness.generate_with_logprobs(llm, prompts, MAX_TOKENS)
        out.update(_seeded_controls(llm, prompts, "reference"))  # the controls for DDTree's
    except BaseException:
        engines.shutdown(llm)
        raise
    if not SEGMENTS:
        engines.shutdown(llm)
        llm = None
    try:
        return _run_candidates(out, kind, dtype, target, drafter, extra_kw, prompts, ref, llm)
    finally:
        if llm is not None:
            engines.shutdown(llm)


def _run_candidates(out, kind, dtype, target, drafter, extra_kw, prompts, ref, ref_llm) -> dict:
    """run_kind after the reference: flat DFlash, the control backend, DDTree (ref_llm: the reference
    engine, still running, for --segments)."""
    from ddtree_compile import adapters
    from ddtree_compile.integration import engines, metrics
    from ddtree_compile.testing import harness

    hybrid = kind != "qwen3"
    ref_tokens = [t for t, _ in ref]
    out["mamba_ssm_cache_dtype"] = SSM_CACHE_DTYPE
    if hybrid and not SKIP_FLAT:
        llm, out["start_s_flat"] = _engine(target, drafter, hybrid=hybrid, dtype=dtype, flat=True, **extra_kw)
        try:
            flat_out = harness.generate(llm, prompts, MAX_TOKENS)
            out.update(_seeded_controls(llm, prompts, "flat"))
            if ref_llm is not None:
                out["segments_flat_dflash"] = [_segments(ref_llm, llm, p, MAX_TOKENS) for p in prompts]
        finally:
            engines.shutdown(llm)
        out["gates_flat_dflash"] = [harness.regret_gate(r, g) for r, g in zip(ref, flat_out)]
    if CONTROL_BACKEND:
        llm, out["start_s_control_backend"] = _engine(target, hybrid=hybrid, dtype=dtype,
                                                      attention_config={"backend": CONTROL_BACKEND}, **extra_kw)
        try:
            control_out = harness.generate(llm, prompts, MAX_TOKENS)
        finally:
            engines.shutdown(llm)
        out["control_backend"] = CONTROL_BACKEND
        out["gates_control_backend"] = [harness.regret_gate(r, g) for r, g in zip(ref, control_out)]
    log = _CaptureLog()
    try:
        TREE_ATTN_PLANS.clear()
        llm, out["start_s_ddtree"] = _engine(target, drafter, hybrid=hybrid, dtype=dtype, **extra_kw)
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
        if ref_llm is not None:  # every divergence of DDTree with its own drafter (before the harness)
            out["segments_ddtree"] = [_segments(ref_llm, llm, p, MAX_TOKENS) for p in prompts]
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
    out["graph_buckets"] = c_all.get("graph_buckets", {})  # tree bucket -> batch sizes of its FULL graphs
    out["chain_graph_sizes"] = c_all.get("chain_graph_sizes", [])  # budget auto: the chain's FULL graphs
    # the commit replayed as CUDA graphs (round/stage_graphs.py) in the runs without commit hooks
    out["stage_replays"] = c_random.get("stage_replays", {})
    out["random_equal"] = random_out == ref_tokens
    out["harness_equal"] = harness_out == ref_tokens
    out["gates_random"] = [harness.regret_gate(r, g) for r, g in zip(ref, random_out)]
    out["gates_harness"] = [harness.regret_gate(r, g) for r, g in zip(ref, harness_out)]
    out["tree_attention_splits_forced"] = TREE_ATTN_SPLITS
    out["tree_attention_plans"] = [dict(zip(("R", "N", "Hq", "Hkv", "D", "block_size", "table_pages", "splits"), p))
                                   for p in sorted(TREE_ATTN_PLANS)]
    out["per_prompt"] = _per_prompt(out, prompts)
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
    if AUTO_MENU:
        # auto's kind follows measured step times, and a chain step samples through vLLM's sampler, a
        # tree step through the tree walk (other random draws): a seed fixes neither the kinds nor the
        # draws, so repeats are reported, not required. Its FULL graphs are: every served bucket's and
        # the chain's captured, and steps without trees (auto's chain) replaying them.
        seeded_ok = True
        served = c_all.get("auto", {}).get("menu") or []
        out["auto_graphs_ok"] = (not full or (set(map(int, out["graph_buckets"])) >= set(map(int, served))
                                              and bool(out["chain_graph_sizes"])
                                              and c_all.get("plain_graph_steps", 0) > 0))
        seeded_ok = out["auto_graphs_ok"]
    out["ok"] = bool(out["attached"] and c_random.get("tree_steps", 0) > 0 and gates_ok
                     and seeded_ok and out["seeded_seeds_differ"]
                     and (not full or (out["graph_sizes"] and c_all.get("graph_steps", 0) > 0))
                     and out["stage_replays"].get("commit", 0) > 0 and out["stage_replays"].get("walk", 0) > 0
                     and (not hybrid or out.get("state_check", {}).get("paths", 0) > 0))
    return out


def main(argv=None) -> int:
    global BUDGET, TOP_K, DRAFT_LEN, CUDAGRAPH_MODE, SSM_CACHE_DTYPE, SKIP_FLAT, QUANT_KW, NUM_PROMPTS, CONTROL_BACKEND
    global AUTO_MENU, PROMPT_LEN, PROMPT_KIND, MODEL_SEED, ENGINE_KW, SEGMENTS, TREE_ATTN_SPLITS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--kinds", default="qwen3,qwen3_next_dense",
                    help=f"kind[:dtype],... (qwen3, qwen3_next, qwen3_next_dense, qwen3_5, {VL_KIND})")
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
    ap.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 16; chat: at least)")
    ap.add_argument("--prompt-kind", default="random", choices=("random", "chat"),
                    help="random token ids, or gpu_serve_026's chat prompts (module docstring)")
    ap.add_argument("--model-seed", type=int, default=0, help="the tiny target's and drafter's seed (serve: 3)")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help=f"every engine's max_model_len and max_num_batched_tokens (default: the tiny 512, or "
                         f"{LONG_MODEL_LEN} when the prompts need more, as gpu_serve_026)")
    ap.add_argument("--prefix-caching", action="store_true", help="prefix caching on for every engine")
    ap.add_argument("--segments", action="store_true", help="gate every divergence of flat DFlash and DDTree "
                    "per prompt (the reference engine kept running)")
    ap.add_argument("--tree-attn-splits", type=int, default=None,
                    help="force the DDTree engine's tree-attention split count (1: no split-KV merge)")
    args = ap.parse_args(argv)
    QUANT_KW = {k: v for k, v in (("quantization", args.quantization), ("kv_cache_dtype", args.kv_cache_dtype)) if v}
    BUDGET, TOP_K, DRAFT_LEN, CUDAGRAPH_MODE = args.budget, args.top_k, args.draft_len, args.cudagraph_mode
    SSM_CACHE_DTYPE, SKIP_FLAT = args.ssm_cache_dtype, args.skip_flat
    NUM_PROMPTS, CONTROL_BACKEND = args.prompts, args.control_backend
    AUTO_MENU = [int(b) for b in args.auto_budget.split(",") if b]
    PROMPT_LEN, PROMPT_KIND, MODEL_SEED = args.prompt_len, args.prompt_kind, args.model_seed
    SEGMENTS, TREE_ATTN_SPLITS = args.segments, args.tree_attn_splits
    ENGINE_KW = engine_settings(args.max_model_len, args.prefix_caching)
    import torch
    import vllm

    from ddtree_compile.integration import plugin

    plugin.register()
    _watch_tree_attention()
    result = {"command": " ".join(sys.argv), "vllm": vllm.__version__, "torch": torch.__version__,
              "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
              "budget": BUDGET, "top_k": TOP_K, "draft_len": DRAFT_LEN, "max_tokens": MAX_TOKENS,
              "prompts": NUM_PROMPTS,
              "auto_budget": AUTO_MENU or None,
              "cudagraph_mode": CUDAGRAPH_MODE, "mamba_ssm_cache_dtype": SSM_CACHE_DTYPE, **QUANT_KW,
              "prompt_len": PROMPT_LEN, "prompt_kind": PROMPT_KIND, "model_seed": MODEL_SEED, "engine_kw": ENGINE_KW,
              "segments": SEGMENTS, "tree_attn_splits": TREE_ATTN_SPLITS, "runs": []}
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
    print_per_prompt(result)
    return 0 if all(r["ok"] for r in result["runs"]) else 1


def engine_settings(max_model_len: int | None, prefix_caching: bool) -> dict:
    """Every engine's extra settings: a longer max_model_len (and as many batched tokens: the prompt in one
    prefill chunk, as gpu_serve_026) when asked or when the prompts need more than the tiny 512."""
    kw = {}
    need = (PROMPT_LEN or (1600 if PROMPT_KIND == "chat" else 16)) + MAX_TOKENS + 2 * max(BUDGET, DRAFT_LEN) + 64
    if max_model_len is None and need > 512:
        max_model_len = max(LONG_MODEL_LEN, -(-need // 256) * 256)
    if max_model_len is not None:
        kw.update(max_model_len=max_model_len, max_num_batched_tokens=max_model_len)
    if prefix_caching:
        kw["enable_prefix_caching"] = True
    return kw


def print_per_prompt(result: dict) -> None:
    for r in result["runs"]:
        if "per_prompt" not in r:
            continue
        print(f"\n{r['kind']}: per prompt (first divergence / regret; * = outside the gate)")
        for row in r["per_prompt"]:
            cells = [f"{label} {g['first_divergence']}/{g['regret']:.3f}{'' if g['ok'] else '*'}"
                     for label, g in row.items() if isinstance(g, dict)]
            segs = [f"{k.removeprefix('segments_')}: " + " ".join(
                f"{g['at']}/{g['regret']:.2f}{'' if g['ok'] else '*'}" for g in row[k])
                for k in ("segments_ddtree", "segments_flat_dflash") if k in row]
            print(f"  prompt {row['prompt']} ({row['prompt_len']} tokens): " + ", ".join(cells)
                  + ("; " + "; ".join(segs) if segs else ""))


if __name__ == "__main__":
    raise SystemExit(main())
