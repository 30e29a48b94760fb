"""DDTree behind a real `vllm serve` on the attention-only tiny Qwen3 in float32: outputs EQUAL to the
server without speculation (no regret gate: float32 has no bf16 near-ties, tests/test_e2e_attention.py),
and case 9, prefix caching on a multi-turn conversation (slow: one more server pair).

Server A: DDTree (exactly `config.cli_args`) WITH prefix caching; server B: no speculation, prefix
caching OFF. Turn 2 of a conversation must hit A's cached blocks (vLLM's prefix-cache counters)
and still equal B's answer token for token, with DDTree's tree steps running in turn 2.
"""

import pytest

from ddtree_compile.testing import models

import _serve_cases as sc

pytestmark = pytest.mark.slow
F32 = ["--dtype", "float32"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve_attn")
    target = models.write_tiny_chat_model("qwen3", root / "target", dtype="float32")
    return {"root": root, "target": target, "drafter": models.write_tiny_dflash_drafter(target, root / "dflash")}



@pytest.fixture(scope="module")
def plain(dirs):
    srv = sc.start(dirs["target"], dirs["drafter"], False, dirs["root"], extra=F32, name="plain_f32")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def ddtree(dirs, plain):
    srv = sc.start(dirs["target"], dirs["drafter"], True, dirs["root"], extra=[*F32, "--enable-prefix-caching"],
                   name="ddtree_f32_prefix")
    yield srv
    srv.stop()


def _steps(srv):
    m = sc.scrape_settled(srv)
    return {k: sc.total(m, f"vllm:{k}") for k in ("ddtree_tree_steps_total", "ddtree_rounds_total",
                                                 "prefix_cache_hits_total", "prefix_cache_queries_total")}


def _diff(a, b):
    return {k: b[k] - a[k] for k in a}


def test_plain_chat_and_streaming_equal(plain, ddtree):
    msgs = [{"role": "user", "content": "Hello! Who are you?"}]
    before = _steps(ddtree)
    ref = sc.token_ids(sc.chat(plain, msgs, 96))
    assert sc.token_ids(sc.chat(ddtree, msgs, 96)) == ref
    stream = sc.client(ddtree).chat.completions.create(
        model=ddtree.model, messages=msgs, max_tokens=96, temperature=0, stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True})
    assert [t for c in stream if c.choices for t in (getattr(c.choices[0], "token_ids", None) or [])] == ref
    assert _diff(before, _steps(ddtree))["ddtree_tree_steps_total"] > 0


def test_9_prefix_caching_multi_turn(plain, ddtree):
    turn1 = [{"role": "system", "content": "You are a terse assistant. " * 80},
             {"role": "user", "content": "Tell me about the weather in paris and tokyo, please."}]
    a1 = sc.chat(ddtree, turn1, 64, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    turn1_ids = a1.prompt_token_ids
    assert sc.token_ids(a1) == sc.token_ids(sc.chat(plain, turn1, 64, extra_body={
        "chat_template_kwargs": {"enable_thinking": False}}))
    turn2 = turn1 + [{"role": "assistant", "content": a1.choices[0].message.content},
                     {"role": "user", "content": "And in berlin?"}]
    before = _steps(ddtree)
    got = sc.chat(ddtree, turn2, 96, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    d = _diff(before, _steps(ddtree))
    ref = sc.chat(plain, turn2, 96, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    print(f"\nturn 2: {d}, prompt {len(got.prompt_token_ids)} tokens")
    # turn 1 (> 400 prompt tokens) ends in full KV blocks that turn 2 reads from the cache
    assert d["prefix_cache_hits_total"] >= 0.5 * len(turn1_ids)
    assert d["ddtree_tree_steps_total"] > 0 and d["ddtree_rounds_total"] > 0  # trees committed after the cached prefix
    assert sc.token_ids(got) == sc.token_ids(ref)
