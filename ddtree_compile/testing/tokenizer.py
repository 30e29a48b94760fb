"""A tiny offline tokenizer and chat template for the tiny targets, so `vllm serve <dir>` loads them.

Byte-level BPE trained with the `tokenizers` library on text generated here (seeded: chat turns,
JSON, Qwen3-coder tool calls, code), never downloaded. Its vocabulary is exactly the tiny models'
`VOCAB` (512): the Qwen3-style special tokens first (what vLLM's `qwen3` reasoning parser and
`qwen3_coder` tool parser look for: `<think>`, `</think>`, `<tool_call>`, `</tool_call>`,
`<|im_start|>`, `<|im_end|>`), then the 256 byte symbols and the merges, and the last id is
`<|mask|>`: the DFlash drafter's mask token is `vocab_size - 1` (models.write_tiny_dflash_drafter).

The chat template is our own Qwen3-like ChatML: system/user/assistant/tool roles, a tools list in
the system turn (Qwen3-coder XML call format), assistant tool calls rendered back, and thinking on
(the generation prompt opens `<think>`) or off (`enable_thinking=False`: an empty think block).
"""

from __future__ import annotations

import json
import pathlib
import random

IM_START, IM_END, EOT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
MASK = "<|mask|>"
# Order fixes their ids (0..n-1); the parsers match them by text and by token id.
SPECIAL = [EOT, IM_START, IM_END, "<think>", "</think>", "<tool_call>", "</tool_call>",
           "<tool_response>", "</tool_response>"]
# Multimodal targets only (models.write_tiny_vl_model): placed just before MASK, ids vocab-5..vocab-2.
VISION = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]

CHAT_TEMPLATE = r"""{%- macro text(c) -%}
{%- if c is string -%}{{ c }}{%- elif c -%}{%- for p in c -%}{%- if p.type == 'text' -%}{{ p.text }}{%- elif p.type in ('image', 'image_url') -%}<|vision_start|><|image_pad|><|vision_end|>{%- endif -%}{%- endfor -%}{%- endif -%}
{%- endmacro -%}
{%- set sys = messages[0].role == 'system' -%}
{%- if tools -%}
<|im_start|>system
{% if sys %}{{ text(messages[0].content) }}

{% endif %}# Tools

<tools>{% for tool in tools %}{{ '\n' ~ ((tool.function if tool.function is defined else tool) | tojson) }}{% endfor %}{{ '\n' }}</tools>

To call a function reply with:
<tool_call>
<function=NAME>
<parameter=ARG>
VALUE
</parameter>
</function>
</tool_call><|im_end|>
{% elif sys -%}
<|im_start|>system
{{ text(messages[0].content) }}<|im_end|>
{% endif -%}
{%- for m in messages -%}
{%- if m.role == 'system' -%}
{%- if not loop.first %}<|im_start|>system
{{ text(m.content) }}<|im_end|>
{% endif -%}
{%- elif m.role == 'user' -%}
<|im_start|>user
{{ text(m.content) }}<|im_end|>
{% elif m.role == 'assistant' -%}
<|im_start|>assistant
{% if m.reasoning_content is defined and m.reasoning_content %}<think>
{{ m.reasoning_content }}
</think>

{% endif %}{{ text(m.content) }}
{%- if m.tool_calls is defined and m.tool_calls -%}
{%- for tc in m.tool_calls -%}
{%- set f = tc.function if tc.function is defined else tc -%}
{{ '\n<tool_call>\n<function=' ~ f.name ~ '>\n' }}
{%- if f.arguments is mapping -%}
{%- for k, v in f.arguments.items() -%}
{{ '<parameter=' ~ k ~ '>\n' ~ (v if v is string else v | tojson) ~ '\n</parameter>\n' }}
{%- endfor -%}
{%- else -%}
{{ f.arguments ~ '\n' }}
{%- endif -%}
{{ '</function>\n</tool_call>' }}
{%- endfor -%}
{%- endif -%}
<|im_end|>
{% elif m.role == 'tool' -%}
<|im_start|>user
<tool_response>
{{ text(m.content) }}
</tool_response><|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% else %}<think>
{% endif -%}
{%- endif -%}"""

_WORDS = ("the model drafts a tree of tokens and the target verifies every node in one forward pass "
          "weather city paris tokyo berlin london temperature unit celsius fahrenheit search query "
          "result answer question think step first then because so we need to call function tool "
          "json schema object string number array true false null name value key user assistant "
          "system hello world please tell me about what is how many one two three four five").split()


def corpus(n: int = 400, seed: int = 0) -> list[str]:
    """Seeded training text shaped like what the tiny servers see: chat turns, reasoning, tool calls, JSON."""
    rng = random.Random(seed)

    def words(k):
        return " ".join(rng.choice(_WORDS) for _ in range(k))

    out = []
    for i in range(n):
        name = rng.choice(["get_weather", "search", "lookup_city", "add"])
        args = {rng.choice(["city", "query", "unit", "a"]): rng.choice([words(2), rng.randint(0, 999)])}
        out += [
            f"{IM_START}user\n{words(rng.randint(3, 12)).capitalize()}?{IM_END}\n",
            f"{IM_START}assistant\n<think>\n{words(rng.randint(5, 20))}.\n</think>\n\n{words(8)}.{IM_END}\n",
            "<tool_call>\n<function=" + name + ">\n" + "".join(
                f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in args.items()) + "</function>\n</tool_call>",
            json.dumps({"name": name, "arguments": args, "id": i, "ok": rng.random() > 0.5}),
            f"def f{i}(x):\n    return x * {rng.randint(0, 99)} + {words(1)!r}\n",
        ]
    return out


def build(vocab_size: int = 512, seed: int = 0, extra_special: tuple = ()):
    """A `tokenizers.Tokenizer` of exactly `vocab_size` ids (last ids: `extra_special`, then MASK)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 1 - len(extra_special), special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(seed=seed), trainer)
    tok.add_special_tokens([*extra_special, MASK])
    if tok.get_vocab_size() != vocab_size:
        raise ValueError(f"vocab_size={vocab_size} leaves no room for merges after 256 bytes and "
                         f"{len(SPECIAL) + len(extra_special) + 1} special tokens (got {tok.get_vocab_size()} ids)")
    return tok


def write_tokenizer(model_dir, *, seed: int = 0, vision: bool = False) -> pathlib.Path:
    """Save tokenizer.json, tokenizer_config.json (with the chat template) and generation_config.json
    beside a tiny target (its vocab_size from config.json); returns the folder. vision=True adds the
    VISION tokens and a Qwen2-VL image processor config (preprocessor_config.json)."""
    from transformers import PreTrainedTokenizerFast

    out = pathlib.Path(model_dir)
    cfg = json.loads((out / "config.json").read_text())
    vocab = cfg.get("text_config", cfg)["vocab_size"]
    extra = VISION if vision else []
    fast = PreTrainedTokenizerFast(tokenizer_object=build(vocab, seed, tuple(extra)), bos_token=None,
                                   eos_token=IM_END, pad_token=EOT, unk_token=None,
                                   additional_special_tokens=SPECIAL[3:] + extra + [MASK])
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 1 << 20
    fast.save_pretrained(out)
    # vLLM stops a chat turn at the template's end-of-turn token.
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": fast.convert_tokens_to_ids(IM_END)}))
    if vision:  # small images: a 64x64 picture is 16 patches of 16 px, 4 tokens after the 2x2 merge
        (out / "preprocessor_config.json").write_text(json.dumps({
            "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen3VLProcessor",
            "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2, "min_pixels": 1024, "max_pixels": 65536,
            "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}))
    return out


def write_word_tokenizer(model_dir) -> pathlib.Path:
    """A word-level tokenizer of a model folder's whole vocabulary (its vocab_size from config.json): id
    0 is EOT, the last id MASK (both special), every other id i the word "t<i>". For config-only targets
    of any vocabulary (the benchmarks' shaped models, benchmarks/_e2e_engine.write_shaped), which a BPE
    trained here could not fill: decoding ids and encoding the text gives the same ids back, so
    `vllm bench serve`'s random prompts keep their token count through the server. Returns the folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    out = pathlib.Path(model_dir)
    cfg = json.loads((out / "config.json").read_text())
    V = cfg.get("text_config", cfg)["vocab_size"]
    tok = Tokenizer(models.WordLevel({EOT: 0, **{f"t{i}": i for i in range(1, V - 1)}, MASK: V - 1}, unk_token=EOT))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # (no decoder: decode joins the words with spaces)
    tok.add_special_tokens([EOT, MASK])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOT, pad_token=EOT, unk_token=EOT)
    fast.model_max_length = 1 << 20
    fast.save_pretrained(out)
    return out
