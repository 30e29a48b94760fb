"""Cases 5 and 6 (vision input; multimodal plus tools) on a tiny multimodal Qwen3.5 behind a real
`vllm serve` pair (slow: two more server starts).

Every multimodal Qwen3.5 runs M-RoPE; DDTree writes each tree node's rotary position (root + depth +
the request's M-RoPE delta, in all three rows) and runs its trees on these requests. The tests check
that the DDTree server attaches (no refusal), really verifies trees on image requests
(`vllm:ddtree_tree_steps_total` moves), serves images with forced tool calls, and report its greedy
output against the server without speculation (the regret gate: bf16 hybrid kernels drift from the
float32 tree templates at near-ties, vLLM's own flat DFlash too; tests/test_e2e_mrope.py gates it).
"""

import base64
import io
import json

import numpy as np
import pytest

from ddtree_compile.testing import e2e, models, tokenizer

import _serve_cases as sc

pytestmark = pytest.mark.slow
REFUSAL = "DDTree is switched on but cannot run here"
TOOLS = [{"type": "function", "function": {"name": "describe", "parameters": {
    "type": "object", "properties": {"colour": {"type": "string"}}, "required": ["colour"]}}}]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve_vl")
    target = models.write_tiny_vl_model(root / "target")
    return {"root": root, "target": target, "drafter": models.write_tiny_dflash_drafter(target, root / "dflash")}


@pytest.fixture(scope="module")
def plain(dirs):
    srv = sc.start(dirs["target"], dirs["drafter"], False, dirs["root"], name="plain_vl")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def ddtree(dirs, plain):
    srv = sc.start(dirs["target"], dirs["drafter"], True, dirs["root"], name="ddtree_vl")
    yield srv
    srv.stop()


def _image_url(seed=0, size=64):
    from PIL import Image

    img = Image.fromarray((np.random.RandomState(seed).rand(size, size, 3) * 255).astype("uint8"))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _msgs(text):
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _image_url()}},
                                         {"type": "text", "text": text}]}]


def _image_tokens(resp):
    return resp.prompt_token_ids.count(tokenizer.VISION.index("<|image_pad|>") + models.VOCAB - 1 - len(tokenizer.VISION))


def test_5_vision_input(plain, ddtree):
    assert REFUSAL not in ddtree.log() and "DDTree on:" in ddtree.log()
    before = sc.total(sc.scrape_settled(ddtree), "vllm:ddtree_tree_steps_total")
    msgs = _msgs("What is in this picture?")
    ref = sc.chat(plain, msgs, 48, logprobs=True)
    got = sc.chat(ddtree, msgs, 48)
    assert _image_tokens(ref) == _image_tokens(got) == 4  # 64x64 px: 16 patches, 2x2 merge
    assert len(sc.token_ids(got)) == 48 and got.choices[0].message.reasoning
    print(f"\nvision, DDTree vs no speculation: {e2e.regret_gate(sc.reference(ref), sc.token_ids(got))}")
    m = sc.scrape_settled(ddtree)
    assert sc.total(m, "vllm:ddtree_tree_steps_total") > before  # trees verified on the image request
    assert sc.total(m, "vllm:spec_decode_num_draft_tokens_total") > 0


def test_6_multimodal_plus_tools(plain, ddtree):
    msgs = _msgs("Describe the colour with the tool.")
    for srv in (plain, ddtree):
        r = sc.chat(srv, msgs, 64, tools=TOOLS, tool_choice="required",
                    extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        assert _image_tokens(r) == 4 and len(r.prompt_token_ids) > 60  # image and tools list in the prompt
        calls = r.choices[0].message.tool_calls
        assert len(calls) == 1 and calls[0].function.name == "describe"
        assert isinstance(json.loads(calls[0].function.arguments), dict)
    # a forced tool call is structured output: DDTree verifies its drafts as a counted chain (lossless)
    assert sc.total(sc.scrape_settled(ddtree), "vllm:ddtree_fallbacks_total", reason="structured output") > 0
