"""Start-up checks: DDTree's settings against vLLM's, and what the engine must offer the tree round.

Bad settings raise ValueError naming the field; an engine the round cannot serve raises
UnsupportedEngine (the caller starts it as flat DFlash and logs why); a request whose sampling
needs a feature the tree walk lacks gets a reason (it is verified as a chain by vLLM's sampler).
"""

from __future__ import annotations

from ... import adapters
from .. import config as config_mod
from ..tree_ops import kv_layout


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
    b_eff = config_mod.effective_budget(cfg.tree_budget, cfg.top_k, L)
    if K < b_eff:
        field = "auto_budget" if cfg.auto else "budget"
        raise ValueError(f"additional_config['ddtree']['{field}'] = {cfg.tree_budget} needs speculative_config."
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


def classify_layers(view) -> dict:
    """The target's sequence-state layers: attention and Qwen GatedDeltaNet; any other is unsupported."""
    attn, gdn, other = view.classify_layers()
    if other:
        raise UnsupportedEngine(f"model family: layers without a tree template: {', '.join(other[:3])}")
    return {"attention": attn, "gdn": gdn}


def check_engine(view, attn_layers) -> None:
    cc = view.vllm_config.compilation_config
    if cc.mode != 0 and "tree_verify_pass" not in str(cc.inductor_passes.get("post_grad_custom_post_pass", "")):
        raise UnsupportedEngine("a compiled engine without the tree-verify pass (compilation_config.inductor_passes"
                                "['post_grad_custom_post_pass'] = 'ddtree_compile.tree_verify_pass'; "
                                "ddtree_compile.vllm_kwargs sets it)")
    reason = view.unsupported_features()
    if reason is not None:
        raise UnsupportedEngine(reason)
    A = adapters.current()
    for name in attn_layers:
        layer = view.layer(name)
        try:
            layout = kv_layout(layer)
            if not layout.packed:
                layout.views(layer.kv_cache, A.attention_params(layer).head_size)
        except NotImplementedError as e:
            raise UnsupportedEngine(f"attention backend {A.attention_backend(layer)[0]}: {e}") from e


def unsupported_reason(sp) -> str | None:
    """Why a request must be verified as a chain by vLLM's own sampler (None: the tree walk serves it)."""
    return adapters.current().sampling_unsupported_reason(sp)


def check_reached(ctx, calls: dict, what: str = "the tree verify") -> None:
    """Every attention and GDN layer ran its tree template through the ddtree ops during a forward
    whose Python ran (eager, PIECEWISE, or a FULL graph's capture): never a silent causal verify."""
    attn = sum(v for k, v in calls.items() if k.endswith("attention_with_output"))
    gdn = sum(v for k, v in calls.items() if "gdn_attention_core" in k)
    if attn != len(ctx.attn_layers) or gdn != len(ctx.gdn_layers):
        raise RuntimeError(
            f"DDTree: {what} reached {attn}/{len(ctx.attn_layers)} attention and {gdn}/{len(ctx.gdn_layers)} "
            f"GatedDeltaNet layers through the ddtree ops ({calls}); the graph was not rewritten (is the "
            f"tree-verify pass in compilation_config.inductor_passes?)")
