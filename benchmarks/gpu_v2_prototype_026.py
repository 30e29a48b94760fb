"""The DDTree round prototype on vLLM 0.26's Model Runner V2 (CUDA): the V2 hook points of
docs/runner_v2.md, read from 0.26's source, exercised on the GPU.

    python benchmarks/gpu_v2_prototype_026.py --out benchmarks/results/gpu_v2_prototype_026_h100.json

A tiny attention-only Qwen3 (V2 is 0.26's default runner for it: no environment override), bfloat16,
eager (the prototype does not capture graphs): no speculation with log-probs (the reference), then
vLLM's DFlash with K = budget and the prototype round (testing/v2_prototype.py) attached, drafting
through the drafter harness so trees are accepted deep and through siblings. Per prompt the regret
gate against the reference; the round's counters (tree steps, sibling paths, K/V moves).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: the prototype hooks the runner
os.environ.setdefault("HF_HUB_OFFLINE", "1")

B, L, TOP_K, MAX_TOKENS = 8, 4, 3, 64


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    import torch
    import vllm
    from vllm import LLM

    from ddtree_compile.integration import engines
    from ddtree_compile.testing import harness, models, v2_prototype

    out = {"command": "python benchmarks/gpu_v2_prototype_026.py --out " + args.out, "vllm": vllm.__version__,
           "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "budget": B, "draft_len": L, "top_k": TOP_K,
           "max_tokens": MAX_TOKENS, "dtype": "bfloat16", "enforce_eager": True}
    path = pathlib.Path(args.out)
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        target = models.write_tiny_model("qwen3", root / "qwen3")
        drafter = models.write_tiny_dflash_drafter(target, root / "dflash")
        prompts = models.token_prompts(4, 16, models.VOCAB, seed=5)
        kw = dict(enforce_eager=True, async_scheduling=False)
        t0 = time.perf_counter()
        llm = LLM(**models.tiny_llm_kwargs(target, **kw))
        try:
            out["reference_runner"] = type(engines.find_runner(llm)).__module__
            ref = harness.generate_with_logprobs(llm, prompts, MAX_TOKENS)
        finally:
            engines.shutdown(llm)
        out["reference_s"] = time.perf_counter() - t0
        path.write_text(json.dumps(out, indent=1, default=str))
        llm = LLM(**models.tiny_llm_kwargs(target, **kw, speculative_config={
            "method": "dflash", "model": str(drafter), "num_speculative_tokens": B}))
        try:
            runner = engines.find_runner(llm)
            out["runner"] = f"{type(runner).__module__}.{type(runner).__name__}"
            tokens = [r[0] for r in ref]
            reference = {tuple(p["prompt_token_ids"]): p["prompt_token_ids"] + t for p, t in zip(prompts, tokens)}
            rnd = v2_prototype.V2Round(runner, budget=B, draft_len=L, top_k=TOP_K,
                                       harness=v2_prototype.make_harness(runner, reference))
            got = harness.generate(llm, prompts, MAX_TOKENS)
            out["gates"] = [harness.regret_gate(r, g) for r, g in zip(ref, got)]
            out["equal"] = [g == t for g, t in zip(got, tokens)]
            out["counters"] = vars(rnd.c)
            out["ok"] = bool(all(g["ok"] for g in out["gates"]) and rnd.c.tree_steps > 0 and rnd.c.sibling_rounds > 0)
        finally:
            engines.shutdown(llm)
    path.write_text(json.dumps(out, indent=1, default=str))
    print(json.dumps({k: out.get(k) for k in ("runner", "equal", "ok")}), json.dumps(out.get("counters"), default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
