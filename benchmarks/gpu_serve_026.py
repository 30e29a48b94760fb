"""`vllm serve` capability case 9 on the GPU (vLLM 0.26): prefix caching on a hybrid with DDTree running.

    python benchmarks/gpu_serve_026.py --out benchmarks/results/gpu_serve_026_case9_h100.json

Four OpenAI servers on one GPU, started together: A = DDTree (`config.cli_args`) with
`--enable-prefix-caching` (vLLM's "align" GDN cache on a hybrid), B = no speculation with prefix
caching (the gates' reference: the same block-aligned prefill chunks as A), C = no speculation without
it (what the cache alone moves: `cache_alone_*`, and A against C: `gate_*_vs_uncached`), D = vLLM's
own flat DFlash with prefix caching, gated against B (`flat_dflash_*`: the same drafter without the tree).
Each server gets a fixed KV cache size (`--kv-cache-memory-bytes`): with gpu_memory_utilization, a
server that profiles after another has allocated counts that memory as its own and finds no room.
The target is a tiny multimodal Qwen3.5 hybrid (`Qwen3_5ForConditionalGeneration`: GatedDeltaNet +
full attention, M-RoPE) served text-only (`--language-model-only`) with the offline tokenizer and chat
template; its DFlash drafter is all full attention, so vLLM serves it on its V1 runner (0.26's default
for hybrids) with FULL_AND_PIECEWISE CUDA graphs. Per conversation: turn 1 (a long system
prompt, > 4 align blocks), then turn 2 = turn 1 + A's answer + a new question. Checks from the
servers' own /metrics: turn 2 reads most of its prompt from A's prefix cache, DDTree's tree steps run
in both turns; both answers within the regret gate of B's (log-probs); the JSON is written after
each conversation. Gates, not token-for-token equality: bf16 near-ties move with the verify's shape
(gpu_v2_026_align_*.json: vLLM's flat DFlash with vs without prefix caching diverged on V2).
The OpenAI server needs modules the default GPU bundle lacks: docs/serve.md, "On the GPU".
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

BUDGET, TOP_K, DRAFT_LEN, TOL = 16, 4, 7, 0.2
ARGS = ["--dtype", "bfloat16", "--max-model-len", "4096", "--max-num-seqs", "8", "--max-num-batched-tokens", "4096",
        "--kv-cache-memory-bytes", str(2 << 30), "--seed", "0", "--mamba-ssm-cache-dtype", "float32",
        "--language-model-only"]  # text chat: no vision tower, no multimodal processor
ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "HF_HUB_OFFLINE": "1", "DDTREE_METRICS_INTERVAL": "0.25"}
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


GDN_PREFILL = {"additional_config": {"gdn_prefill_backend": "triton"}}  # the GPU bundle has no flashinfer


def _plain_args() -> list[str]:
    from ddtree_compile.integration import config

    return config.cli_flags(GDN_PREFILL)


def _flat_args(drafter) -> list[str]:
    from ddtree_compile.integration import config

    spec = {"speculative_config": {"method": "dflash", "model": str(drafter), "num_speculative_tokens": DRAFT_LEN}}
    return config.cli_flags({**GDN_PREFILL, **spec})


def _ddtree_args(drafter) -> list[str]:
    from ddtree_compile.integration import config

    switch = config.vllm_kwargs(drafter, budget=BUDGET, top_k=TOP_K, num_speculative_tokens=DRAFT_LEN)
    return config.cli_flags(config.merge_llm_kwargs(GDN_PREFILL, switch))


def _metrics(srv) -> dict:
    import urllib.request

    time.sleep(1.0)  # DDTree's worker exports its counters every 0.25 s
    text = urllib.request.urlopen(srv.url + "/metrics", timeout=30).read().decode()
    names = ("vllm:ddtree_tree_steps_total", "vllm:ddtree_rounds_total", "vllm:ddtree_graph_steps_total",
             "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")
    tot = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        for n in names:
            if line.startswith(n + "{") or line.startswith(n + " "):
                tot[n] += float(line.rsplit(" ", 1)[1])
    return {n.removeprefix("vllm:"): v for n, v in tot.items()}


def _chat(srv, messages, max_tokens, logprobs=False):
    from openai import OpenAI

    extra = {"return_token_ids": True, "ignore_eos": True, **NO_THINK}
    kw = {}
    if logprobs:
        kw, extra["return_tokens_as_token_ids"] = dict(logprobs=True, top_logprobs=5), True
    client = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=600)
    return client.chat.completions.create(model=srv.model, messages=messages, max_tokens=max_tokens, temperature=0,
                                          extra_body=extra, **kw)


def _ids(reply) -> list[int]:
    return list(reply.choices[0].token_ids)


def _gate(ref, got) -> dict:
    from ddtree_compile.testing import harness

    lps = [{int(t.token.split(":")[1]): t.logprob for t in pos.top_logprobs} for pos in ref.choices[0].logprobs.content]
    return harness.regret_gate((list(ref.choices[0].token_ids), lps), list(got.choices[0].token_ids), TOL)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    import torch
    import vllm

    from ddtree_compile.testing import models, server

    result = {"command": "python benchmarks/gpu_serve_026.py --out " + args.out, "vllm": vllm.__version__,
              "torch": torch.__version__, "device": torch.cuda.get_device_name(0), "budget": BUDGET, "top_k": TOP_K,
              "draft_len": DRAFT_LEN, "conversations": []}
    out = pathlib.Path(args.out)
    logs = out.parent / (out.stem + "_logs")
    logs.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        # the users' architecture (vLLM 0.26 builds no text-only Qwen3.5: its model class reads vision_config)
        target = models.write_tiny_vl_model(pathlib.Path(tmp) / "target", seed=3)
        drafter = models.write_tiny_dflash_drafter(target, pathlib.Path(tmp) / "dflash", seed=3)
        plain = server.Server(target, ARGS + ["--no-enable-prefix-caching"] + _plain_args(), logs / "plain.log",
                              env=ENV, name="plain")
        cached = server.Server(target, ARGS + ["--enable-prefix-caching"] + _plain_args(), logs / "cached.log", env=ENV,
                               name="cached")
        tree = server.Server(target, ARGS + ["--enable-prefix-caching"] + _ddtree_args(drafter), logs / "ddtree.log",
                             env=ENV, name="ddtree")
        flat = server.Server(target, ARGS + ["--enable-prefix-caching"] + _flat_args(drafter), logs / "flat.log",
                             env=ENV, name="flat")
        servers = (cached, tree, plain, flat)
        t0 = time.perf_counter()
        try:
            with ThreadPoolExecutor(len(servers)) as pool:  # all start at once: their compiles and captures overlap
                list(pool.map(lambda s: s.start(540), servers))
            result["start_s"] = time.perf_counter() - t0
            for i, topic in enumerate(("the weather in paris and tokyo", "rivers of europe")):
                system = {"role": "system", "content": f"You are terse assistant number {i}. " * 90}
                turn1 = [system, {"role": "user", "content": f"Tell me about {topic}, please."}]
                m0 = _metrics(tree)
                a1 = _chat(tree, turn1, 96)
                m1 = _metrics(tree)
                turn2 = turn1 + [{"role": "assistant", "content": a1.choices[0].message.content},
                                 {"role": "user", "content": "And in berlin?"}]
                a2 = _chat(tree, turn2, 96)
                m2 = _metrics(tree)
                (c1, c2), (r1, r2) = ([_chat(s, t, 96, logprobs=True) for t in (turn1, turn2)] for s in (cached, plain))
                f1, f2 = _chat(flat, turn1, 96), _chat(flat, turn2, 96)
                result["conversations"].append({
                    "turn1_prompt_tokens": len(a1.prompt_token_ids), "turn2_prompt_tokens": len(a2.prompt_token_ids),
                    "turn1": {k: m1[k] - m0[k] for k in m0}, "turn2": {k: m2[k] - m1[k] for k in m1},
                    "gate_turn1": _gate(c1, a1), "gate_turn2": _gate(c2, a2),
                    "equal_turn1": _ids(a1) == _ids(c1), "equal_turn2": _ids(a2) == _ids(c2),
                    "gate_turn1_vs_uncached": _gate(r1, a1), "gate_turn2_vs_uncached": _gate(r2, a2),
                    "cache_alone_turn1": _gate(r1, c1), "cache_alone_turn2": _gate(r2, c2),
                    "flat_dflash_turn1": _gate(c1, f1), "flat_dflash_turn2": _gate(c2, f2)})
                out.write_text(json.dumps(result, indent=1, default=str))
                print(json.dumps(result["conversations"][-1], default=str)[:600], flush=True)
        finally:
            for s in servers:
                s.stop()
    conv = result["conversations"]
    result["ok"] = bool(conv and all(
        c["gate_turn1"]["ok"] and c["gate_turn2"]["ok"] and c["turn1"]["ddtree_tree_steps_total"] > 0
        and c["turn2"]["ddtree_tree_steps_total"] > 0 and c["turn2"]["ddtree_graph_steps_total"] > 0
        and c["turn2"]["prefix_cache_hits_total"] >= 0.5 * c["turn1_prompt_tokens"] for c in conv))
    out.write_text(json.dumps(result, indent=1, default=str))
    print("ok" if result["ok"] else "NOT ok", flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
