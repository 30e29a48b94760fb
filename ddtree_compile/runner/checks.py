"""Start-up checks: DDTree's settings against vLLM's, and what the engine must offer the tree round.

Bad settings raise ValueError naming the field; an engine the round cannot serve raises
UnsupportedEngine (the caller starts it as flat DFlash and logs why); a request whose sampling
needs a feature the tree walk lacks gets a reason (it is verified as a chain by vLLM's sampler).
"""

from __future__ import annotations

from .. import config as config_mod
from .. import vllm_ops


class UnsupportedEngine(RuntimeError):
    """The engine cannot run DDTree (it starts as flat DFlash); the message says why."""



def validate(vllm_config, cfg: config_mod.DDTreeConfig) -> tuple[int, int]:
    """Start-up checks of the DDTree settings against vLLM's; returns (draft_len L, vLLM's K)."""
    sc = vllm_config.speculative_config
    if sc is None or sc.method != "dflash":
        method = None if sc is None else sc.method
        raise ValueError(f"DDTree (additional_config['ddtree']) needs speculative_config method 'dflash' "
                         f"(a DFlash drafter), got method {method!r}")
    K = sc.num_speculative_tokens
    block = getattr(sc.draft_model_config.hf_config, "block_size", None)
    L = cfg.draft_len if cfg.draft_len is not None else min(K, (block - 1) if block and block > 1 else K)
    if L > K:
        raise ValueError(f"additional_config['ddtree']['draft_len'] = {L} exceeds speculative_config."
                         f"num_speculative_tokens = {K} (vLLM sizes the drafter's query buffers from it)")
    b_eff = config_mod.effective_budget(cfg.budget, cfg.top_k, L)
    if K < b_eff:
        raise ValueError(f"additional_config['ddtree']['budget'] = {cfg.budget} needs speculative_config."
                         f"num_speculative_tokens >= {b_eff} (vLLM sizes its draft slots from it), got {K}; "
                         f"ddtree_compile.vllm_kwargs sets it for you")
    if vllm_config.model_config.is_hybrid and K != b_eff:
        raise ValueError(
            f"hybrid (GatedDeltaNet) target: the tree needs one state/conv slot per node, so "
            f"speculative_config.num_speculative_tokens must equal the budget ({b_eff}), got {K}; this needs "
            f"budget >= num_speculative_tokens (the draft length {L}) on hybrid models")
    if sc.disable_padded_drafter_batch:
        raise ValueError("DDTree needs vLLM's padded drafter batch: leave speculative_config."
                         "disable_padded_drafter_batch off")
    return L, K


def classify_layers(runner) -> dict:
    """The target's sequence-state layers: attention and Qwen GatedDeltaNet; any other is unsupported."""
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention

    drafter_layers = set(getattr(runner.drafter, "_draft_attn_layer_names", ()) or ())
    attn, gdn, other = [], [], []
    for name, layer in runner.compilation_config.static_forward_context.items():
        if name in drafter_layers or not isinstance(layer, AttentionLayerBase):
            continue  # the drafter's own layers; MoE runners and other stateless modules
        if isinstance(layer, Attention):
            attn.append(name)
        elif isinstance(layer, QwenGatedDeltaNetAttention):
            gdn.append(name)
        else:
            other.append(f"{name} ({type(layer).__name__})")
    if other:
        raise UnsupportedEngine(f"model family: layers without a tree template: {', '.join(other[:3])}")
    return {"attention": attn, "gdn": gdn}


def check_engine(runner) -> None:
    from vllm.model_executor.layers.attention.attention import Attention

    cc = runner.vllm_config.compilation_config
    if cc.mode != 0 and "tree_verify_pass" not in str(cc.inductor_passes.get("post_grad_custom_post_pass", "")):
        raise UnsupportedEngine("a compiled engine without the tree-verify pass (compilation_config.inductor_passes"
                                "['post_grad_custom_post_pass'] = 'ddtree_compile.tree_verify_pass'; "
                                "ddtree_compile.vllm_kwargs sets it)")

    if getattr(runner, "use_async_scheduling", False):
        raise UnsupportedEngine("async scheduling (the tree round runs in the synchronous V1 path)")
    if getattr(runner, "uses_mrope", False):
        raise UnsupportedEngine("M-RoPE positions (multimodal rope) are not supported yet")
    if getattr(runner.drafter, "use_heterogeneous_vocab", False):
        raise UnsupportedEngine("a drafter with a heterogeneous vocabulary")
    if runner.vllm_config.model_config.logits_processors:
        raise UnsupportedEngine("custom logits processors (the tree walk does not apply them)")
    for name, layer in runner.compilation_config.static_forward_context.items():
        if not isinstance(layer, Attention) or name in (getattr(runner.drafter, "_draft_attn_layer_names", ()) or ()):
            continue
        backend = layer.attn_backend.get_name()
        try:
            layout = vllm_ops.kv_layout(layer)
            if not layout.packed:
                layout.views(layer.kv_cache, layer.impl.head_size)
        except NotImplementedError as e:
            raise UnsupportedEngine(f"attention backend {backend}: {e}") from e


# Sampling features the tree walk implements: greedy and plain temperature sampling.
def unsupported_reason(sp) -> str | None:
    """Why a request must be verified as a chain by vLLM's own sampler (None: the tree walk serves it)."""
    if sp is None:
        return "no sampling params"
    if sp.logprobs is not None:
        return "logprobs"
    if sp.presence_penalty != 0 or sp.frequency_penalty != 0 or sp.repetition_penalty != 1:
        return "penalties"
    if sp.temperature >= 1e-5 and (sp.top_k not in (0, -1) or sp.top_p < 1 or sp.min_p > 0):
        return "top_k/top_p/min_p"
    if sp.structured_outputs is not None:
        return "structured output"
    if sp.bad_words or getattr(sp, "_bad_words_token_ids", None):
        return "bad_words"
    if sp.logit_bias or sp.allowed_token_ids:
        return "logit_bias/allowed_token_ids"
    if sp.min_tokens:
        return "min_tokens"
    if getattr(sp, "thinking_token_budget", None) is not None:
        return "thinking_token_budget"
    return None

