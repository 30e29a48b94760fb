"""The users' model class on vLLM 0.26 (CUDA): a tiny multimodal Qwen3.5 (`Qwen3_5ForConditionalGeneration`,
M-RoPE, GatedDeltaNet + full attention) with DFlash drafters, text and image prompts.

    python benchmarks/gpu_mrope_026.py --out benchmarks/results/gpu_mrope_026_h100.json --parts ddtree,flat
    python benchmarks/gpu_mrope_026.py --out benchmarks/results/gpu_mrope_026_h100.json --parts mixed

Parts (each adds its section to the JSON at --out, so parts can run in separate commands):
- `ddtree`: no speculation (reference, log-probs) and DDTree with the all-full-attention drafter, which
  vLLM runs on its V1 runner (a hybrid target): random drafter, then the drafter harness (deep and
  sibling paths) with the committed GDN state checked against an fp32 replay, then seeded sampling
  (repeat, alone vs in a batch). Regret gates vs no speculation per prompt kind, tree steps and FULL
  graph replays per kind.
- `flat`: vLLM's own flat DFlash with the same drafter, gated against `ddtree`'s reference (same
  command): the control for the gates.
- `fp8kv`: DDTree on an FP8 KV cache (`kv_cache_dtype="fp8"`): attached, tree verifies (FULL-graph
  replays) reading FP8 K/V, text and images served.
- `mixed`: DDTree with a drafter mixing sliding and full attention (the Qwen3.6 drafter's shape), which
  forces Model Runner V2: what DDTree does there (today: refused at start-up, logged and counted, the
  engine runs flat DFlash) and that the engine serves text and images.
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

_V2_ENV = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import gpu_e2e_026 as base  # noqa: E402  (its engine settings: graphs, Inductor partition, GDN backend)

if _V2_ENV is None:  # vLLM's own runner choice (gpu_e2e_026 forces V1 for attention-only targets)
    os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)

BUDGET, TOP_K, DRAFT_LEN, MAX_TOKENS, TOL = 16, 4, 7, 96, 0.2
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
MM = {"skip_tokenizer_init": False, "max_model_len": 1024, "limit_mm_per_prompt": {"image": 1}}
_REFERENCE: dict = {}  # prompt kind -> the no-speculation outputs with log-probs (part ddtree)


def _prompts():
    import numpy as np
    from PIL import Image

    from ddtree_compile.testing import models

    def image(seed, size=128):
        return Image.fromarray((np.random.RandomState(seed).rand(size, size, 3) * 255).astype("uint8"))

    return {"text": models.token_prompts(4, 16, models.VOCAB - 8, seed=5),
            "image": [{"prompt": IMAGE + "what is this", "multi_modal_data": {"image": image(0)}},
                      {"prompt": "look " + IMAGE + "and say", "multi_modal_data": {"image": image(1)}},
                      {"prompt": "two " + IMAGE + "then", "multi_modal_data": {"image": image(2, 192)}},
                      {"prompt": IMAGE, "multi_modal_data": {"image": image(3, 64)}}]}


def _generate(llm, prompts, logprobs=None, max_tokens=MAX_TOKENS, **sampling):
    from vllm import SamplingParams

    params = SamplingParams(**{"temperature": 0.0, **sampling, "max_tokens": max_tokens, "ignore_eos": True,
                               "logprobs": logprobs})
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [{"prompt": list(o.prompt_token_ids), "tokens": list(o.outputs[0].token_ids),
             "lps": [{t: lp.logprob for t, lp in pos.items()} for pos in o.outputs[0].logprobs] if logprobs else None,
             "cached": o.num_cached_tokens}
            for o in outs]


def _gates(ref, got):
    from ddtree_compile.testing import harness

    return [harness.regret_gate((r["tokens"], r["lps"]), g["tokens"], TOL) for r, g in zip(ref, got)]


def _engine(dirs, drafter=None, flat=False, **kw):
    llm, start = base._engine(dirs["target"], drafter, hybrid=True, flat=flat, **MM, **kw)
    from ddtree_compile.integration import engines

    runner = engines.find_runner(llm)
    info = {"start_s": start, "runner": f"{type(runner).__module__}.{type(runner).__name__}",
            "architecture": runner.vllm_config.model_config.architectures[0],
            "uses_mrope": bool(runner.vllm_config.model_config.uses_mrope),
            "cudagraph_mode": str(runner.vllm_config.compilation_config.cudagraph_mode)}
    return llm, info


def part_ddtree(dirs, prompts, out):
    from ddtree_compile.integration import engines, metrics
    from ddtree_compile.testing import harness

    llm, out["reference_engine"] = _engine(dirs)
    try:
        ref = {k: _generate(llm, p, logprobs=5) for k, p in prompts.items()}
    finally:
        engines.shutdown(llm)
    _REFERENCE.update(ref)  # the flat DFlash control in the same command is gated against it
    out["reference"] = {k: [r["tokens"] for r in v] for k, v in ref.items()}
    out["prompt_ids"] = {k: [r["prompt"] for r in v] for k, v in ref.items()}
    llm, out["ddtree_engine"] = _engine(dirs, dirs["full"])
    try:
        state = engines.find_state(llm)
        out["attached"] = state is not None
        out["fallbacks_at_start"] = dict(metrics.PROCESS_STARTUP_FALLBACKS)
        if state is None:
            return
        check = harness.GdnStateCheck()
        reference = {tuple(r["prompt"]): r["prompt"] + r["tokens"] for v in ref.values() for r in v}
        for kind, p in prompts.items():
            c0 = metrics.collect(llm)[0]
            got = _generate(llm, p)
            c1 = metrics.collect(llm)[0]
            state.debug_gdn_records = True
            state.commit_hooks.append(check)
            h = harness.DraftHarness(reference).install(llm)
            try:
                guided = _generate(llm, p)
            finally:
                h.uninstall()
                state.commit_hooks.remove(check)
                state.debug_gdn_records = False
            c2 = metrics.collect(llm)[0]
            out[kind] = {"gates_random": _gates(ref[kind], got), "gates_harness": _gates(ref[kind], guided),
                         "counters_random": metrics.counters_delta(c1, c0),
                         "counters_harness": metrics.counters_delta(c2, c1)}
        out["state_check"] = {"paths": check.paths, "sibling_paths": check.sibling_paths, "max_rel_err": check.max_err}
        allp = prompts["text"] + prompts["image"]
        seeded = _generate(llm, allp, temperature=1.0, seed=1234)
        again = _generate(llm, allp, temperature=1.0, seed=1234)
        alone = [_generate(llm, [q], temperature=1.0, seed=1234)[0] for q in allp[3:6]]
        out["seeded_repeat_equal"] = [s["tokens"] for s in seeded] == [s["tokens"] for s in again]
        out["seeded_alone_equal"] = [s["tokens"] for s in alone] == [s["tokens"] for s in seeded[3:6]]
        out["counters_total"] = metrics.collect(llm)[0]
    finally:
        engines.shutdown(llm)
    ok_kind = [all(g["ok"] for g in out[k]["gates_random"] + out[k]["gates_harness"])
               and out[k]["counters_random"]["tree_steps"] > 0 and out[k]["counters_random"]["graph_steps"] > 0
               and out[k]["counters_harness"]["sibling_rounds"] > 0 for k in prompts]
    out["ok"] = bool(all(ok_kind) and out["state_check"]["paths"] > 0 and out["seeded_repeat_equal"]
                     and out["seeded_alone_equal"])


def part_flat(dirs, prompts, out):
    """vLLM's own flat DFlash, gated against the reference of the `ddtree` part run before it in the
    same command: what speculation alone changes in bf16, beside DDTree's gates."""
    from ddtree_compile.integration import engines

    if not _REFERENCE:
        raise SystemExit("--parts: flat needs ddtree before it in the same command (its reference)")
    llm, out["engine"] = _engine(dirs, dirs["full"], flat=True)
    try:
        got = {k: _generate(llm, p) for k, p in prompts.items()}
    finally:
        engines.shutdown(llm)
    out["tokens"] = {k: [g["tokens"] for g in v] for k, v in got.items()}
    out["gates"] = {k: _gates(_REFERENCE[k], got[k]) for k in prompts}


def part_mixed(dirs, prompts, out):
    from ddtree_compile.integration import engines, metrics

    llm, out["engine"] = _engine(dirs, dirs["mixed"])
    try:
        out["attached"] = engines.find_state(llm) is not None
        out["fallbacks_at_start"] = dict(metrics.PROCESS_STARTUP_FALLBACKS)
        got = {k: _generate(llm, p) for k, p in prompts.items()}
        out["served_tokens"] = {k: sum(len(g["tokens"]) for g in v) for k, v in got.items()}
    finally:
        engines.shutdown(llm)


def part_fp8kv(dirs, prompts, out):
    """DDTree on an FP8 KV cache (the users' NVFP4 checkpoints can switch it on by themselves): attached,
    tree verifies read the FP8 cache (FULL-graph replays), text and images served. The regret gates with
    the flat-DFlash control on an FP8 KV target: gpu_e2e_026.py --kv-cache-dtype fp8."""
    from ddtree_compile import adapters
    from ddtree_compile.integration import engines, metrics

    before = dict(metrics.PROCESS_STARTUP_FALLBACKS)
    llm, out["engine"] = _engine(dirs, dirs["full"], kv_cache_dtype="fp8")
    try:
        state = engines.find_state(llm)
        out["attached"] = state is not None
        out["fallbacks_at_start"] = {k: v - before.get(k, 0) for k, v in metrics.PROCESS_STARTUP_FALLBACKS.items()
                                     if v != before.get(k, 0)}
        if state is not None:
            out["tree_attention_kv"] = str(adapters.current().attention_params(
                state.ctx.layer(state.ctx.attn_layers[0])).kv_fp8)
        got = {k: _generate(llm, p) for k, p in prompts.items()}
        out["served_tokens"] = {k: sum(len(g["tokens"]) for g in v) for k, v in got.items()}
        out["counters"] = metrics.collect(llm)[0] if state is not None else {}
    finally:
        engines.shutdown(llm)
    out["ok"] = bool(out["attached"] and "float8" in out.get("tree_attention_kv", "")
                     and out["counters"].get("tree_steps", 0) > 0 and out["counters"].get("graph_steps", 0) > 0
                     and all(n == MAX_TOKENS * len(prompts[k]) for k, n in out["served_tokens"].items()))


PARTS = {"ddtree": part_ddtree, "flat": part_flat, "mixed": part_mixed, "fp8kv": part_fp8kv}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--parts", default="ddtree,flat,mixed")
    args = ap.parse_args(argv)
    base.BUDGET, base.TOP_K, base.DRAFT_LEN = BUDGET, TOP_K, DRAFT_LEN
    import torch
    import vllm

    from ddtree_compile.integration import plugin
    from ddtree_compile.testing import models

    plugin.register()
    path = pathlib.Path(args.out)
    result = json.loads(path.read_text()) if path.exists() else {}
    result.update({"command": "python benchmarks/gpu_mrope_026.py --out " + args.out, "vllm": vllm.__version__,
                   "torch": torch.__version__, "device": torch.cuda.get_device_name(0),
                   "budget": BUDGET, "top_k": TOP_K, "draft_len": DRAFT_LEN, "max_tokens": MAX_TOKENS,
                   "mamba_ssm_cache_dtype": base.SSM_CACHE_DTYPE})
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        target = models.write_tiny_vl_model(root / "target", seed=4)
        dirs = {"target": target, "full": models.write_tiny_dflash_drafter(target, root / "full", seed=4),
                "mixed": models.write_tiny_dflash_drafter(target, root / "mixed", seed=4,
                                                          layer_types=["sliding_attention", "full_attention"])}
        run_parts(args.parts.split(","), PARTS, (dirs, _prompts()), result, path)
    return 0


def run_parts(parts, table: dict, args: tuple, result: dict, path: pathlib.Path) -> None:
    """table[part](*args, out) for each part in order; an error goes in the part's JSON and the next
    part runs; the JSON at `path` is rewritten after every part (a later timeout keeps the earlier)."""
    for part in parts:
        out = {}
        t0 = time.perf_counter()
        try:
            if part not in table:
                raise SystemExit(f"--parts: {part!r} is not one of {', '.join(table)}")
            table[part](*args, out)
        except Exception as e:  # keep going; the error goes in the JSON
            out.update(error=repr(e), traceback=traceback.format_exc()[-4000:])
            print(out["traceback"], file=sys.stderr)
        out["wall_s"] = time.perf_counter() - t0
        result[part] = out
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1, default=str))
        print(f"[{part}] done in {out['wall_s']:.0f} s: " + json.dumps(
            {k: out.get(k) for k in ("ok", "attached", "error", "fallbacks_at_start")}, default=str), flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
