"""Tiny offline test models: Qwen3 / Qwen3-Next / Qwen3.5 targets and a DFlash drafter.

Seeded random weights are written with transformers (`from_config` + `save_pretrained`,
safetensors). vLLM's `load_format="dummy"` weights are near zero and make a target repeat
one token; these weights give varied greedy outputs, so equality tests mean something.
No hub access: configs are built in code, prompts are token ids, no tokenizer is needed.
"""

from __future__ import annotations

import json
import os
import pathlib
import random

import torch

KINDS = ("qwen3", "qwen3_next", "qwen3_next_dense", "qwen3_5")
DTYPES = ("bfloat16", "float16", "float32")
VOCAB = 512
HIDDEN = 128
INIT_STD = 0.2  # transformers' default 0.02 gives near-flat logits and repetitive outputs

# Shared by every target: attention heads of size 64 (CPU attention and GDN kernels support it).
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    initializer_range=INIT_STD,
    bos_token_id=None,
    eos_token_id=None,  # no EOS: generations always run to max_tokens
    pad_token_id=None,
)
# GatedDeltaNet: vLLM's CPU GDN op needs bf16 and head size 64 or 128 (32 fails).
_GDN = dict(
    linear_conv_kernel_dim=4,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
)


def _config(kind: str):
    """(config, model class) for one target kind; 4 layers, hybrids have layer 3 full attention."""
    if kind == "qwen3":
        from transformers import Qwen3Config, Qwen3ForCausalLM

        cfg = Qwen3Config(num_hidden_layers=4, **_COMMON)
        return cfg, Qwen3ForCausalLM
    if kind in ("qwen3_next", "qwen3_next_dense"):
        # qwen3_next_dense: ONE routed expert, top-1 (normalised weight exactly 1) plus the shared
        # expert: a dense hybrid that vLLM 0.26 serves (its Qwen3.5 text model is multimodal-only
        # there), with no routing decision a 1-ulp difference could flip.
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

        dense = kind == "qwen3_next_dense"
        cfg = Qwen3NextConfig(
            num_hidden_layers=4,
            full_attention_interval=4,
            num_experts=1 if dense else 4,
            num_experts_per_tok=1 if dense else 2,
            moe_intermediate_size=128,
            shared_expert_intermediate_size=128,
            decoder_sparse_step=1,
            **_GDN,
            **_COMMON,
        )
        return cfg, Qwen3NextForCausalLM
    if kind == "qwen3_5":
        # Text-only Qwen3.5: vLLM serves it as `Qwen3_5ForCausalLM` (model_type qwen3_5_text).
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

        cfg = Qwen3_5TextConfig(num_hidden_layers=4, full_attention_interval=4, **_GDN, **_COMMON)
        return cfg, Qwen3_5ForCausalLM
    raise ValueError(f"kind={kind!r} is not a tiny model kind; allowed values: {', '.join(KINDS)}")


def _seed_all(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def write_tiny_model(kind, out_dir, *, seed=0, dtype="bfloat16") -> pathlib.Path:
    """Write a tiny random target of `kind` (see KINDS) to `out_dir`; returns the folder."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; allowed values: {', '.join(DTYPES)}")
    cfg, model_cls = _config(kind)
    out = pathlib.Path(out_dir)
    _seed_all(seed)
    model = model_cls._from_config(cfg, dtype=torch.float32)
    _randomize_norms(model, seed)
    model.to(getattr(torch, dtype)).save_pretrained(out, safe_serialization=True)
    return out


def _randomize_norms(model: torch.nn.Module, seed: int) -> None:
    """Give norm weights a seeded spread (init leaves them constant)."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                # Qwen3-Next/3.5 norms are (1 + w): keep w near 0; Qwen3 norms are w near 1.
                p.add_(0.1 * torch.randn(p.shape, generator=g))


def write_tiny_dflash_drafter(target_dir, out_dir, *, seed=0, layer_types=None, sliding_window=64) -> pathlib.Path:
    """Write a tiny DFlash drafter (vLLM arch `DFlashDraftModel`) that fits `target_dir`.

    `layer_types` (e.g. ["sliding_attention", "full_attention"], the Qwen3.6 drafter's mix) sets one
    decoder layer per entry; a mix of sliding and full layers makes vLLM 0.26 run the engine on Model
    Runner V2 (`config/vllm.py` `_dflash_needs_multi_kv_group`). Default: one full-attention layer.

    Layout follows vLLM's qwen3_dflash.py: Qwen3 decoder layers without embed_tokens or
    lm_head (both are shared from the target), plus `fc` (concatenated target hidden states
    of `target_layer_ids` -> hidden) and `hidden_norm`. The drafter must run in bfloat16 on
    CPU (float32 fails in `_project_context_kv`).
    """
    from transformers import Qwen3Config, Qwen3Model

    tcfg = json.loads((pathlib.Path(target_dir) / "config.json").read_text())
    tcfg = tcfg.get("text_config", tcfg)  # a multimodal target: the drafter fits its language model
    n_target = tcfg["num_hidden_layers"]
    target_layer_ids = sorted({1, n_target - 2} & set(range(n_target))) or [0]
    allowed = ("sliding_attention", "full_attention")
    if layer_types is not None and (not layer_types or any(t not in allowed for t in layer_types)):
        raise ValueError(f"layer_types={layer_types!r}: a non-empty list of {', '.join(allowed)}")
    extra = {} if layer_types is None else dict(layer_types=list(layer_types), sliding_window=sliding_window,
                                                use_sliding_window=True, max_window_layers=0)
    cfg = Qwen3Config(num_hidden_layers=len(layer_types or [None]), **{**_COMMON, "vocab_size": tcfg["vocab_size"]},
                      **extra)
    cfg.block_size = 16  # DDTree drafts L = block_size - 1 positions; vLLM 0.32 ignores it
    cfg.num_target_layers = n_target
    cfg.target_hidden_size = tcfg["hidden_size"]
    cfg.dflash_config = {
        "mask_token_id": tcfg["vocab_size"] - 1,
        "target_layer_ids": target_layer_ids,
    }
    _seed_all(seed)
    model = Qwen3Model._from_config(cfg, dtype=torch.float32)
    model.fc = torch.nn.Linear(tcfg["hidden_size"] * len(target_layer_ids), HIDDEN, bias=False)
    torch.nn.init.normal_(model.fc.weight, std=INIT_STD)
    model.hidden_norm = type(model.norm)(HIDDEN, eps=cfg.rms_norm_eps)
    del model.embed_tokens  # shared from the target by vLLM
    _randomize_norms(model, seed)
    out = pathlib.Path(out_dir)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    cfg.architectures = ["DFlashDraftModel"]  # save_pretrained wrote the class name
    cfg.save_pretrained(out)
    return out


def tiny_llm_kwargs(model_dir, **overrides) -> dict:
    """vllm.LLM kwargs that start a tiny model quickly on 2 CPU cores, without any hub.

    Add `enforce_eager=True` to skip the Inductor compile (engine start ~3 s instead of
    40-90 s), and set VLLM_ENABLE_V1_MULTIPROCESSING=0 to run the engine in-process.
    """
    kwargs = dict(
        model=str(model_dir),
        skip_tokenizer_init=True,
        dtype="bfloat16",  # CPU GDN op and the DFlash drafter need bf16
        max_model_len=512,
        max_num_seqs=4,
        max_num_batched_tokens=512,
        kv_cache_memory_bytes=256 << 20,  # CPU default reserves 92% of RAM; 4 seqs x 40 drafts fit
        enable_prefix_caching=False,  # hybrid spec decode on CPU crashes with it (align mode)
        seed=0,
    )
    share = os.environ.get("DDTREE_GPU_MEMORY_UTILIZATION")  # GPU suite modules sharing a GPU (run_suite --per-gpu)
    if share:
        kwargs["gpu_memory_utilization"] = float(share)
    kwargs.update(overrides)
    return kwargs


def token_prompts(n, length, vocab_size, seed) -> list[dict]:
    """`n` TokensPrompt dicts of `length` random token ids in [0, vocab_size - 1)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size - 1, (n, length), generator=g)  # vocab-1 is DFlash's mask id
    return [{"prompt_token_ids": row.tolist()} for row in ids]


def write_tiny_chat_model(kind, out_dir, *, seed=0, dtype="bfloat16") -> pathlib.Path:
    """A tiny target plus the offline tokenizer and chat template (testing/tokenizer.py) beside it,
    so vLLM's OpenAI server loads it like any model folder (no skip_tokenizer_init)."""
    from ddtree_compile.testing import tokenizer

    out = write_tiny_model(kind, out_dir, seed=seed, dtype=dtype)
    return tokenizer.write_tokenizer(out, seed=seed)


def write_tiny_vl_model(out_dir, *, seed=0) -> pathlib.Path:
    """A tiny multimodal Qwen3.5 (vLLM's `Qwen3_5ForConditionalGeneration`: one-block vision tower +
    the qwen3_5 text model, M-RoPE) in bf16, with the offline tokenizer (vision tokens at ids
    VOCAB-5..VOCAB-2) and a Qwen2-VL image processor config beside it."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from ddtree_compile.testing import tokenizer

    text = dict(_COMMON, **_GDN, num_hidden_layers=4, full_attention_interval=4,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                 "mrope_section": [2, 3, 3], "mrope_interleaved": True})
    vision = dict(depth=1, hidden_size=64, num_heads=2, out_hidden_size=HIDDEN, patch_size=16, spatial_merge_size=2,
                  temporal_patch_size=2, intermediate_size=128, num_position_embeddings=64)
    ids = {t: VOCAB - 1 - len(tokenizer.VISION) + i for i, t in enumerate(tokenizer.VISION)}
    cfg = Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False,
                        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
                        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"])
    _seed_all(seed)
    model = Qwen3_5ForConditionalGeneration._from_config(cfg, dtype=torch.float32)
    _randomize_norms(model, seed)
    out = pathlib.Path(out_dir)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    return tokenizer.write_tokenizer(out, seed=seed, vision=True)
