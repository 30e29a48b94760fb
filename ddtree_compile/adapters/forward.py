"""Reads made inside the replacement ops and the round's forward: the forward context vLLM sets, the
layer objects and their metadata (the same in vLLM 0.26 and 0.32, and for either model runner:
both set the same forward context)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionParams:
    """What tree attention reads of an attention layer's impl; `unsupported` names a feature it lacks."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float
    sliding_window: int  # 0: none
    logits_soft_cap: float  # 0.0: none
    unsupported: str | None
    kv_fp8: torch.dtype | None = None  # the float8 type of a quantized KV cache's entries (None: not quantized)
    scales: tuple = ()  # with kv_fp8: the layer's (q_scale, k_scale, v_scale) float32 device tensors


@dataclass(frozen=True)
class GdnParams:
    """What the tree GDN op reads of a Qwen GatedDeltaNet layer (per tensor-parallel rank)."""

    num_k_heads: int
    head_k_dim: int
    num_v_heads: int
    head_v_dim: int
    conv_bias: torch.Tensor | None
    A_log: torch.Tensor
    dt_bias: torch.Tensor
    activation: str
    prefix: str


def attention_batch(attn_metadata, R: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(seq_lens [R], block_table int32 [R, blocks]) of an attention layer's metadata in a verify."""
    return attn_metadata.seq_lens[:R], attn_metadata.block_table[:R].to(torch.int32)


def gdn_spec_rows(gdn_metadata, R: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(state_indices [R, 1+K], num_accepted [R]) of a spec-decode GDN batch, or None if it is not one."""
    if gdn_metadata.spec_state_indices_tensor is None:
        return None
    return gdn_metadata.spec_state_indices_tensor[:R], gdn_metadata.num_accepted_tokens[:R]


def forward_attn_metadata():
    from vllm.forward_context import get_forward_context

    return get_forward_context().attn_metadata


def attention_context(layer_name):
    """(attention metadata, layer, kv_cache) of an attention layer, from the op's layer_name."""
    from vllm.model_executor.layers.attention.attention import get_attention_context
    from vllm.utils.torch_utils import _resolve_layer_name

    attn_metadata, layer, kv_cache, _ = get_attention_context(_resolve_layer_name(layer_name))
    return attn_metadata, layer, kv_cache


def attention_backend(layer) -> tuple[str, str | None]:
    """(backend name, the CPU ISA vLLM picked for the layer's KV layout or None)."""
    return layer.attn_backend.get_name(), getattr(layer, "isa", None)


def gdn_context(layer_name):
    """(layer name, layer, GDN attention metadata) of a GDN op's layer_name."""
    from vllm.forward_context import get_forward_context
    from vllm.utils.torch_utils import _resolve_layer_name

    name = _resolve_layer_name(layer_name)
    fctx = get_forward_context()
    layer = fctx.no_compile_layers[name]
    return name, layer, fctx.attn_metadata[layer.prefix]


def gdn_params(layer) -> GdnParams:
    tp = getattr(layer, "tp_size", 1)
    return GdnParams(layer.num_k_heads // tp, layer.head_k_dim, layer.num_v_heads // tp, layer.head_v_dim,
                     layer.conv1d.bias, layer.A_log, layer.dt_bias, layer.activation, layer.prefix)


def attention_splitting_ops() -> list[str]:
    """vLLM's attention-like ops: the piecewise split points, and ops a tree verify must not leave."""
    from vllm.config.compilation import CompilationConfig

    return list(CompilationConfig._attention_ops)
