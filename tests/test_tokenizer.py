"""The tiny offline tokenizer + chat template (testing/tokenizer.py): what `vllm serve` and its
qwen3 / qwen3_coder parsers rely on. No engine."""

import json

import pytest

from ddtree_compile.testing import models, tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("tok")
    (d / "config.json").write_text(json.dumps({"vocab_size": models.VOCAB}))
    tokenizer.write_tokenizer(d)
    return AutoTokenizer.from_pretrained(d), d


def test_vocab_matches_the_tiny_models_and_special_tokens_are_single_ids(tok):
    t, d = tok
    assert len(t) == models.VOCAB
    ids = t.convert_tokens_to_ids(tokenizer.SPECIAL)
    assert ids == list(range(len(tokenizer.SPECIAL)))
    assert t.convert_tokens_to_ids(tokenizer.MASK) == models.VOCAB - 1  # DFlash's mask id
    for s in tokenizer.SPECIAL:  # the parsers match these by token id: one id each, never split
        assert t.encode(f"a{s}b") == t.encode("a") + [t.convert_tokens_to_ids(s)] + t.encode("b")
    assert json.loads((d / "generation_config.json").read_text())["eos_token_id"] == t.convert_tokens_to_ids("<|im_end|>")
    text = "Weather in Paris? {\"city\": \"tokyo\", \"n\": 3} ünïcode ✓"
    assert t.decode(t.encode(text)) == text  # byte-level: any text round-trips


def test_training_is_deterministic():
    a, b = tokenizer.build(seed=0), tokenizer.build(seed=0)
    assert a.to_str() == b.to_str()


def test_chat_template_roles_tools_and_thinking(tok):
    t, _ = tok
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "paris"}}}]},
            {"role": "tool", "content": "sunny"}]
    s = t.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True)
    assert s.startswith("<|im_start|>system\nbe brief\n\n# Tools\n\n<tools>\n{\"name\": \"get_weather\"")
    assert ("<tool_call>\n<function=get_weather>\n<parameter=city>\nparis\n</parameter>\n</function>\n"
            "</tool_call><|im_end|>") in s
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n" in s
    assert s.endswith("<|im_start|>assistant\n<think>\n")  # thinking on: the template opens it
    off = t.apply_chat_template(msgs[:2], tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") and "# Tools" not in off
    parts = t.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": "hi"}]}], tokenize=False)
    assert parts == "<|im_start|>user\nhi<|im_end|>\n"


def test_vision_tokenizer_places_the_image_tokens_before_the_mask(tmp_path):
    from transformers import AutoTokenizer

    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"vocab_size": models.VOCAB}}))
    tokenizer.write_tokenizer(tmp_path, vision=True)
    t = AutoTokenizer.from_pretrained(tmp_path)
    assert len(t) == models.VOCAB and t.convert_tokens_to_ids(tokenizer.MASK) == models.VOCAB - 1
    assert t.convert_tokens_to_ids(tokenizer.VISION) == list(range(models.VOCAB - 5, models.VOCAB - 1))
    s = t.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}],
                              tokenize=False)
    assert s == "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>hi<|im_end|>\n"
    assert json.loads((tmp_path / "preprocessor_config.json").read_text())["merge_size"] == 2
