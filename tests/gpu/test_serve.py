"""`vllm serve` capability case 9 on the GPU (vLLM 0.26): prefix caching on a hybrid with DDTree running.

Two OpenAI servers on one GPU, started together (their compiles and captures overlap), each with a
fixed KV cache (`--kv-cache-memory-bytes`: with gpu_memory_utilization a server that profiles after
another has allocated counts that memory as its own and finds no room): DDTree with
`--enable-prefix-caching` (vLLM's "align" GDN cache on a hybrid), and no speculation with prefix
caching (the gates' reference: the same block-aligned prefill chunks). The target is the tiny
multimodal Qwen3.5 served text-only (`--language-model-only`; vLLM 0.26 builds no text-only Qwen3.5)
with the offline tokenizer and chat template; its all-full-attention drafter keeps it on the V1
runner with FULL_AND_PIECEWISE graphs. Per conversation (a long system prompt, > 4 align blocks, then
turn 2 = turn 1 + DDTree's answer + a question), from the servers' own /metrics: DDTree's tree steps
in both turns, FULL-graph replays in turn 2, turn 2 reading most of its prompt from the cache; both
answers within the regret gate of the reference's (log-probs). The OpenAI server needs modules the
default GPU bundle lacks (docs/serve.md, "On the GPU"): skipped without them.
"""

from __future__ import annotations

import time

import _engines as E
import pytest

ARGS = ["--dtype", "bfloat16", "--max-model-len", "4096", "--max-num-seqs", "8", "--max-num-batched-tokens", "4096",
        "--kv-cache-memory-bytes", str(2 << 30), "--seed", "0", "--mamba-ssm-cache-dtype", "float32",
        "--language-model-only", "--enable-prefix-caching", *E.memory_args()]  # text chat: no vision tower, no multimodal processor
ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "HF_HUB_OFFLINE": "1", "DDTREE_METRICS_INTERVAL": "0.25"}
GDN_PREFILL = {"additional_config": {"gdn_prefill_backend": "triton"}}  # the GPU bundle has no FlashInfer
TOPICS = ("the weather in paris and tokyo", "rivers of europe")


def _metrics(srv) -> dict:
    time.sleep(1.0)  # DDTree's worker exports its counters every 0.25 s
    names = ("vllm:ddtree_tree_steps_total", "vllm:ddtree_graph_steps_total", "vllm:prefix_cache_hits_total")
    tot = dict.fromkeys(names, 0.0)
    for line in srv.metrics().splitlines():
        for n in names:
            if line.startswith(n + "{") or line.startswith(n + " "):
                tot[n] += float(line.rsplit(" ", 1)[1])
    return {n.removeprefix("vllm:"): v for n, v in tot.items()}


def _chat(srv, messages, logprobs=False):
    from openai import OpenAI

    extra = {"return_token_ids": True, "ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}}
    kw = {}
    if logprobs:
        kw, extra["return_tokens_as_token_ids"] = dict(logprobs=True, top_logprobs=5), True
    client = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=600)
    return client.chat.completions.create(model=srv.model, messages=messages, max_tokens=E.MAX_TOKENS, temperature=0,
                                          extra_body=extra, **kw)


def _gate(ref, got) -> dict:
    from ddtree_compile.testing import e2e

    lps = [{int(t.token.split(":")[1]): t.logprob for t in pos.top_logprobs} for pos in ref.choices[0].logprobs.content]
    return e2e.regret_gate((list(ref.choices[0].token_ids), lps), list(got.choices[0].token_ids), E.TOL)


@pytest.fixture(scope="module")
def case9(gpu_env, tmp_path_factory):
    E.require_server_modules()
    from concurrent.futures import ThreadPoolExecutor

    from ddtree_compile.integration import config
    from ddtree_compile.testing import models, server

    root = tmp_path_factory.mktemp("serve")
    target = models.write_tiny_vl_model(root / "target", seed=3)
    drafter = models.write_tiny_dflash_drafter(target, root / "dflash", seed=3)
    switch = config.vllm_kwargs(drafter, budget=E.BUDGET, top_k=E.TOP_K, num_speculative_tokens=E.DRAFT_LEN)
    tree = server.Server(target, ARGS + config.cli_flags(config.merge_llm_kwargs(GDN_PREFILL, switch)),
                         root / "ddtree.log", env=ENV, name="ddtree")
    plain = server.Server(target, ARGS + config.cli_flags(GDN_PREFILL), root / "plain.log", env=ENV, name="plain")
    out = {"conversations": []}
    t0 = time.perf_counter()
    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda s: s.start(540), (tree, plain)))
        out["start_s"] = round(time.perf_counter() - t0, 1)
        for i, topic in enumerate(TOPICS):
            system = {"role": "system", "content": f"You are terse assistant number {i}. " * 90}
            turn1 = [system, {"role": "user", "content": f"Tell me about {topic}, please."}]
            m0 = _metrics(tree)
            a1 = _chat(tree, turn1)
            m1 = _metrics(tree)
            turn2 = turn1 + [{"role": "assistant", "content": a1.choices[0].message.content},
                             {"role": "user", "content": "And in berlin?"}]
            a2 = _chat(tree, turn2)
            m2 = _metrics(tree)
            r1, r2 = _chat(plain, turn1, logprobs=True), _chat(plain, turn2, logprobs=True)
            out["conversations"].append({
                "turn1_prompt_tokens": len(a1.prompt_token_ids), "turn2_prompt_tokens": len(a2.prompt_token_ids),
                "turn1": {k: m1[k] - m0[k] for k in m0}, "turn2": {k: m2[k] - m1[k] for k in m1},
                "gate_turn1": _gate(r1, a1), "gate_turn2": _gate(r2, a2)})
    finally:
        for s in (tree, plain):
            s.stop()
    return out


def test_case9_prefix_caching_on_a_hybrid(case9, record):
    conv = case9["conversations"]
    record(start_s=case9["start_s"], conversations=[
        {"turn1": c["turn1"], "turn2": c["turn2"], "turn2_prompt_tokens": c["turn2_prompt_tokens"],
         "regret": [c["gate_turn1"]["regret"], c["gate_turn2"]["regret"]]} for c in conv])
    assert len(conv) == len(TOPICS)
    for c in conv:
        assert c["turn1"]["ddtree_tree_steps_total"] > 0 and c["turn2"]["ddtree_tree_steps_total"] > 0, c
        assert c["turn2"]["ddtree_graph_steps_total"] > 0, c
        assert c["turn2"]["prefix_cache_hits_total"] >= 0.5 * c["turn1_prompt_tokens"], c
        assert c["gate_turn1"]["ok"] and c["gate_turn2"]["ok"], c
