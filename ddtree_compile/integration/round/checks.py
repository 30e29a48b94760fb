"""Start-up checks: DDTree's settings against vLLM's, and what the engine must offer the tree round.

Bad settings raise ValueError naming the field; an engine the round cannot serve raises
UnsupportedEngine (the caller starts it as flat DFlash and logs why); a request whose sampling
needs a feature the tree walk lacks gets a reason (it is verified as a chain by vLLM's sampler).
"""

from __future__ import annotations

import torch

from ... import adapters
from .. import config as config_mod
from ..tree_ops import ATTENTION, GDN, kv_layout, traced


class UnsupportedEngine(RuntimeError):
    """The engine cannot run DDTree (it starts as flat DFlash); the message says why."""


def validate(settings, cfg: config_mod.DDTreeConfig) -> tuple[int, int]:
    """Start-up checks of the DDTree settings against the engine's (adapters.EngineSettings); returns
    (draft_len L, vLLM's K)."""
    if settings.spec_method != "dflash":
        raise ValueError(f"DDTree (additional_config['ddtree']) needs speculative_config method 'dflash' "
                         f"(a DFlash drafter), got method {settings.spec_method!r}")
    K = settings.num_speculative_tokens
    block = settings.draft_block_size
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
    if settings.is_hybrid and K != b_eff:
        raise ValueError(
            f"hybrid (GatedDeltaNet) target: the tree templates read a conv line and state indices sized for "
            f"one draft slot per node, so "
            f"speculative_config.num_speculative_tokens must equal the budget ({b_eff}), got {K}; this needs "
            f"budget >= num_speculative_tokens (the draft length {L}) on hybrid models")
    if not settings.padded_drafter_batch:
        raise ValueError("DDTree needs vLLM's padded drafter batch: leave speculative_config."
                         "disable_padded_drafter_batch off")
    return L, K


def gdn_spec_blocks(settings, cfg: config_mod.DDTreeConfig) -> int | None:
    """The speculative GDN state slots per request a hybrid engine needs beyond the committed one:
    L with the replay strategy (the verify reads the committed slot only, the commit writes column
    n - 1 <= L, vLLM's chain of L drafts columns 0..L), or None: vLLM's K (snapshots keep a state
    per tree node; settings `validate` refuses; not a hybrid; L == K)."""
    if not settings.is_hybrid or cfg.gdn_state != "replay":
        return None
    try:
        L, K = validate(settings, cfg)
    except ValueError:  # attach fails the engine with the same message
        return None
    return L if L < K else None


def classify_layers(view) -> dict:
    """The target's sequence-state layers: attention and Qwen GatedDeltaNet; any other is unsupported."""
    attn, gdn, other = view.classify_layers()
    if other:
        raise UnsupportedEngine(f"model family: layers without a tree template: {', '.join(other[:3])}")
    return {"attention": attn, "gdn": gdn}


def check_engine(view, attn_layers) -> None:
    s = view.settings
    if s.compiled and "tree_verify_pass" not in str(s.post_grad_pass or "") and not traced(view.runner):
        raise UnsupportedEngine("a compiled engine without the tree-verify pass (compilation_config.inductor_passes"
                                "['post_grad_custom_post_pass'] = 'ddtree_compile.tree_verify_pass'; "
                                "ddtree_compile.vllm_kwargs sets it) nor additional_config ddtree op_swap 'trace'")
    reason = view.unsupported_features()
    if reason is not None:
        raise UnsupportedEngine(reason)
    if view.device.type == "cuda" and view.dtype not in (torch.bfloat16, torch.float16):
        raise UnsupportedEngine(f"a {view.dtype} model on CUDA (the Triton tree attention takes bfloat16 or "
                                f"float16; pass dtype='bfloat16')")
    A = adapters.current()
    for name in attn_layers:
        layer = view.layer(name)
        # What tree attention cannot read (a quantized KV cache, ALiBi, sinks, chunked local attention)
        # is refused here, once, not by the first tree verify's op.
        params = A.attention_params(layer)
        if params.unsupported:
            raise UnsupportedEngine(f"attention layer {name}: {params.unsupported} is not supported by tree attention")
        try:
            layout = kv_layout(layer)
            if not layout.packed:
                layout.views(layer.kv_cache, params.head_size)
        except NotImplementedError as e:
            raise UnsupportedEngine(f"attention backend {A.attention_backend(layer)[0]}: {e}") from e


def unsupported_reason(sp) -> str | None:
    """Why a request must be verified as a chain by vLLM's own sampler (None: the tree walk serves it)."""
    return adapters.current().sampling_unsupported_reason(sp)


def check_reached(ctx, calls: dict, what: str = "the tree verify") -> None:
    """Every attention and GDN layer ran its tree template through the ddtree ops during a forward
    whose Python ran (eager, PIECEWISE, or a FULL graph's capture): never a silent causal verify."""
    attn, gdn = calls.get(ATTENTION, 0), calls.get(GDN, 0)
    if attn != len(ctx.attn_layers) or gdn != len(ctx.gdn_layers):
        raise RuntimeError(
            f"DDTree: {what} reached {attn}/{len(ctx.attn_layers)} attention and {gdn}/{len(ctx.gdn_layers)} "
            f"GatedDeltaNet layers through the ddtree ops; the graph was not rewritten (is the "
            f"tree-verify pass in compilation_config.inductor_passes?)")
