"""bench_tree_attention's FP8 pieces: vLLM's per-tensor FP8 quantization of a K/V cache or query, and the
FP8 KV cache read by the tree kernel against vLLM's FA3 FP8 path."""

from __future__ import annotations

import torch

from ddtree_compile.templates.tree_attention import launch_tree_attention
from ddtree_compile.templates.tree_attention_ref import tree_attention_reference

from _attn_common import DEV, log, paged_cache, row_rel, tree_meta

FP8 = torch.float8_e4m3fn


def quantize(x):
    """(FP8 entries, float32 scale, the dequantized float32 values) with vLLM's per-tensor scale."""
    scale = (x.float().abs().amax() / torch.finfo(FP8).max).reshape(())
    q = (x.float() / scale).to(FP8)
    return q, scale, q.float() * scale


def check_fp8_against_vllm_fa3(results: list):
    """An FP8 KV cache read two ways, each against the float32 attention of the dequantized values: the
    tree kernel on a chain (dequantized entries, bf16 P.V) and vLLM's FA3 FP8 path (what no speculation
    and flat DFlash run on an FP8 KV cache; FP8 P.V). Informational: how far apart the two verifies
    are by numerics alone, the scale of the gates' divergences on FP8 KV targets."""
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func
    except ImportError as e:
        results.append(dict(check="fp8_vs_vllm_fa3", ok=False, error=f"vLLM's FA3 not importable: {e!r}"))
        return
    g = torch.Generator().manual_seed(3)
    R, B, ctxs, Hq, Hkv, D = 2, 7, [1000, 300], 16, 4, 128
    N = B + 1
    anc, bits, depths = tree_meta(R, B, g, chain=True)
    kc, vc, bt = paged_cache(R, max(ctxs) + N, Hkv, D, torch.bfloat16, g)
    q = torch.randn(R * N, Hq, D, device=DEV, dtype=torch.bfloat16)
    (k8, ks, kf), (v8, vs, vf), (q8, qs, qf) = quantize(kc), quantize(vc), quantize(q)
    cl = torch.tensor(ctxs, dtype=torch.int32, device=DEV)
    ref = torch.empty(q.shape, device=DEV, dtype=torch.float32)
    tree_attention_reference(qf, kf, vf, bt, cl, bits, depths, ref, D ** -0.5, 0, 0.0)
    ours = torch.full_like(q, float("nan"))
    launch_tree_attention(q8, k8, v8, bt, cl, bits, depths, ours, D ** -0.5, 0, 0.0, q_scale=qs, k_scale=ks, v_scale=vs)
    fa = torch.full_like(q, float("nan"))
    desc = (R, Hkv)
    flash_attn_varlen_func(q=q8, k=k8, v=v8, out=fa, max_seqlen_q=N,
                           cu_seqlens_q=torch.arange(0, (R + 1) * N, N, device=DEV, dtype=torch.int32),
                           max_seqlen_k=max(ctxs) + N, seqused_k=cl + N, softmax_scale=D ** -0.5, causal=True,
                           block_table=bt, fa_version=3, q_descale=qs.expand(desc), k_descale=ks.expand(desc),
                           v_descale=vs.expand(desc))
    e_ours, e_fa, e_between = row_rel(ours, ref), row_rel(fa, ref), row_rel(ours, fa)
    results.append(dict(check="fp8_vs_vllm_fa3", row_rel_err=e_ours, fa3_row_rel_err=e_fa, ours_vs_fa3=e_between,
                        nan=bool(ours.isnan().any()), ok=e_ours < 2e-2 and e_ours <= e_fa))
    log(f"check fp8_vs_vllm_fa3: ours {e_ours:.2e}, FA3 fp8 {e_fa:.2e}, between {e_between:.2e}")
