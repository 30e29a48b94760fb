"""bench_tree_attention's correctness checks on the GPU: Triton against the float32 reference, the
baselines against the tree at the shapes where they compute the same function, the op's dispatch and
CUDA-graph replay, and the K/V compaction."""

from __future__ import annotations

import torch
from triton.testing import do_bench

from ddtree_compile.templates import launch
from ddtree_compile.templates.kv_compact import launch_kv_compact
from ddtree_compile.templates.kv_compact_ref import kv_compact_reference
from ddtree_compile.templates.tree_attention import launch_tree_attention
from ddtree_compile.templates.tree_attention_ref import tree_attention_reference

from _attn_common import (DEV, MODELS, causal_fa, dense_bias, dense_kv, dense_sdpa, gather, log, paged_cache, row_rel,
                          tree_meta)

REF_CASES = [  # (name, R, B, ctxs, Hq, Hkv, D, dtype, W, cap, splits)
    ("qwen_auto", 3, 22, [1000, 37, 0], 24, 4, 256, torch.bfloat16, 0, 0.0, None),
    ("h128_auto", 2, 64, [5000, 300], 32, 8, 128, torch.bfloat16, 0, 0.0, None),
    ("h64_gqa8_direct", 2, 16, [700, 90], 8, 1, 64, torch.bfloat16, 0, 0.0, 1),
    ("window_cap_split5", 2, 32, [3000, 64], 16, 4, 128, torch.bfloat16, 512, 30.0, 5),
    ("fp16_qwen_split3", 2, 16, [2048, 1], 24, 4, 256, torch.float16, 0, 0.0, 3),
    # an FP8 KV cache (e4m3, per-tensor scales as vLLM's), the query FP8 too ("qkv") as vLLM hands it over
    ("fp8_qkv_qwen_auto", 3, 22, [1000, 37, 0], 24, 4, 256, torch.bfloat16, 0, 0.0, None, "qkv"),
    ("fp8_kv_h128_window_split3", 2, 32, [3000, 64], 16, 4, 128, torch.bfloat16, 512, 0.0, 3, "kv"),
]
FP8 = torch.float8_e4m3fn


def _quantize(x):
    """(FP8 entries, float32 scale, the dequantized float32 values) with vLLM's per-tensor scale."""
    scale = (x.float().abs().amax() / torch.finfo(FP8).max).reshape(())
    q = (x.float() / scale).to(FP8)
    return q, scale, q.float() * scale
BASELINE_CHECK = (2, 16, 1000)  # (R, B, C) for chain == FA causal and tree == dense-mask SDPA
OP_CHECK = (4, 22, 24, 4, 256, [4096, 100, 2000, 7], [50, 3000, 4096, 0])  # R, B, Hq, Hkv, D, ctx, ctx2


def check_against_reference(results: list):
    """Triton vs the float32 reference on the GPU, over window / cap / splits / GQA / head sizes."""
    g = torch.Generator().manual_seed(0)
    for name, R, B, ctxs, Hq, Hkv, D, dtype, W, cap, splits, *fp8 in REF_CASES:
        N = B + 1
        anc, bits, depths = tree_meta(R, B, g)
        kc, vc, bt = paged_cache(R, max(ctxs) + N, Hkv, D, dtype, g)
        q = torch.randn(R * N, Hq, D, device=DEV, dtype=dtype)
        cl = torch.tensor(ctxs, dtype=torch.int32, device=DEV)
        out = torch.full_like(q, float("nan"))
        qf, kf, vf, scales = q.float(), kc.float(), vc.float(), {}
        if fp8:  # the kernel reads FP8 entries + scales; the reference the same values in float32
            (kc, scales["k_scale"], kf), (vc, scales["v_scale"], vf) = _quantize(kc), _quantize(vc)
            if fp8[0] == "qkv":
                q, scales["q_scale"], qf = _quantize(q)
        launch_tree_attention(q, kc, vc, bt, cl, bits, depths, out, D ** -0.5, W, cap, splits=splits, **scales)
        ref = torch.empty(q.shape, device=DEV, dtype=torch.float32)
        tree_attention_reference(qf, kf, vf, bt, cl, bits, depths, ref, D ** -0.5, W, cap)
        err = row_rel(out, ref)
        results.append(dict(check=name, row_rel_err=err, nan=bool(out.isnan().any()), ok=err < 2e-2))
        log(f"check {name}: row_rel {err:.2e}")


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
    (k8, ks, kf), (v8, vs, vf), (q8, qs, qf) = _quantize(kc), _quantize(vc), _quantize(q)
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


def check_causal_and_dense(results: list):
    """The baselines compute the same function: chain tree == FA causal; random tree == dense-mask SDPA."""
    g = torch.Generator().manual_seed(1)
    for model, (Hq, Hkv, D) in MODELS.items():
        R, B, C = BASELINE_CHECK
        N = B + 1
        kc, vc, bt = paged_cache(R, C + N, Hkv, D, torch.bfloat16, g)
        q = torch.randn(R * N, Hq, D, device=DEV, dtype=torch.bfloat16)
        cl = torch.full((R,), C, dtype=torch.int32, device=DEV)
        k = torch.stack([gather(kc, bt, r, C + N) for r in range(R)]).transpose(1, 2)  # [R, Hkv, C+N, D]
        v = torch.stack([gather(vc, bt, r, C + N) for r in range(R)]).transpose(1, 2)
        qt = q.view(R, N, Hq, D).transpose(1, 2)
        for chain in (True, False):
            anc, bits, depths = tree_meta(R, B, g, chain=chain)
            out = torch.full_like(q, float("nan"))
            launch_tree_attention(q, kc, vc, bt, cl, bits, depths, out, D ** -0.5, 0, 0.0)
            if chain:
                base = causal_fa(qt, k, v, D ** -0.5)
            else:
                bias = dense_bias(anc, C, q.dtype)
                base = dense_sdpa(qt, *dense_kv(k, v, Hq // Hkv), bias, D ** -0.5)
            err = row_rel(out, base.transpose(1, 2).reshape(R * N, Hq, D))
            name = f"{model}_{'chain_vs_fa_causal' if chain else 'tree_vs_dense_mask'}"
            results.append(dict(check=name, row_rel_err=err, ok=err < 2e-2))
            log(f"check {name}: row_rel {err:.2e}")


def check_op_graph_and_compact(results: list):
    """The CUDA op dispatches to Triton, replays inside a CUDA graph, and kv_compact matches its reference."""
    import ddtree_compile.templates.ops  # noqa: F401  registers ops

    g = torch.Generator().manual_seed(2)
    R, B, Hq, Hkv, D, ctx, ctx2 = OP_CHECK
    N = B + 1
    anc, bits, depths = tree_meta(R, B, g)
    kc, vc, bt = paged_cache(R, max(ctx + ctx2) + N, Hkv, D, torch.bfloat16, g)
    q = torch.randn(R * N, Hq, D, device=DEV, dtype=torch.bfloat16)
    cl = torch.tensor(ctx, dtype=torch.int32, device=DEV)
    ref = torch.full_like(q, float("nan"))
    launch_tree_attention(q, kc, vc, bt, cl, bits, depths, ref, D ** -0.5, 0, 0.0)
    out = torch.full_like(q, float("nan"))
    torch.ops.ddtree.tree_attention(q, kc, vc, bt, cl, bits, depths, out, D ** -0.5, 0, 0.0)
    same_op = bool(torch.equal(out, ref))
    graph = torch.cuda.CUDAGraph()
    out.fill_(float("nan"))
    with torch.cuda.graph(graph):
        torch.ops.ddtree.tree_attention(q, kc, vc, bt, cl, bits, depths, out, D ** -0.5, 0, 0.0)
    q.copy_(torch.randn_like(q))  # new data, same buffers
    cl.copy_(torch.tensor(ctx2, dtype=torch.int32))
    graph.replay()
    fresh = torch.full_like(q, float("nan"))
    launch_tree_attention(q, kc, vc, bt, cl, bits, depths, fresh, D ** -0.5, 0, 0.0)
    same_graph = bool(torch.equal(out, fresh))
    # the direct launcher path (used by every call above after the first) vs Triton's own launch path
    from ddtree_compile.templates import tree_attention as ta

    fast_used = any(p.main.compiled is not None for p in ta._PLANS.values())
    launch.set_fast_launch(False)
    slow = torch.full_like(q, float("nan"))
    launch_tree_attention(q, kc, vc, bt, cl, bits, depths, slow, D ** -0.5, 0, 0.0)
    launch.set_fast_launch(True)
    same_fast = bool(torch.equal(slow, fresh))
    ref32 = torch.empty(q.shape, device=DEV, dtype=torch.float32)
    tree_attention_reference(q.float(), kc.float(), vc.float(), bt, cl, bits, depths, ref32, D ** -0.5, 0, 0.0)
    err = row_rel(out, ref32)
    ok = same_op and same_graph and same_fast and err < 2e-2
    results.append(dict(check="op_dispatch_and_cuda_graph_replay", ok=ok,
                        op_equal=same_op, graph_equal=same_graph, fast_launch_used=fast_used,
                        fast_equals_triton_launch=same_fast, graph_row_rel_err=err))
    log(f"check op/graph: op {same_op} graph {same_graph} fast-launch used {fast_used} equal {same_fast} "
        f"graph row_rel {err:.2e}")

    layers = 4
    keys = [torch.randn_like(kc) for _ in range(layers)]
    vals = [torch.randn_like(vc) for _ in range(layers)]
    src = torch.full((R, 16), -1, dtype=torch.int64)
    dst = torch.full((R, 16), -1, dtype=torch.int64)
    paths = [[0, 2, 3], [0, 1, 2, 3], [0, 5, 9, 14, 15], [0, 1, 7]]
    for r, path in enumerate(paths[:R]):
        for d, s in enumerate(x for x in path if x < N):
            if s != d:
                src[r, d], dst[r, d] = int(cl[r]) + s, int(cl[r]) + d
    src, dst = src.to(DEV), dst.to(DEV)
    k2, v2 = [k.clone() for k in keys], [v.clone() for v in vals]
    kv_compact_reference(k2, v2, bt, src, dst)
    launch_kv_compact(keys, vals, bt, src, dst)
    ok = all(torch.equal(a, b) for a, b in zip(keys + vals, k2 + v2))
    results.append(dict(check="kv_compact_vs_reference", ok=ok))
    t = do_bench(lambda: launch_kv_compact(keys, vals, bt, src, dst), warmup=5, rep=20, return_mode="median")
    results.append(dict(check="kv_compact_time_ms_4layers_R4", ms=t, ok=True))
    log(f"check kv_compact: {ok}, {t * 1e3:.1f} us")


# ------------------------------------------------------------------ long context at the serve's shapes (issue 28)

LONG_CONTEXTS = (256, 1024, 1536, 2048, 4096)
LONG_SHAPE = dict(Hq=4, Hkv=2, D=64, block_size=176, max_model_len=4096, budgets=(16, 32))  # serve case 9
TOP_K, SPINE = 4, 7  # the serve's DDTree: top_k 4, draft length 7


def _ddtree_tree(B: int, g: torch.Generator, chain: bool = False) -> torch.Tensor:
    """Ancestor-or-self mask [N, N] of a DDTree-shaped tree: the drafter's top-1 chain (SPINE nodes),
    the other nodes hung off nodes of depth < SPINE with at most TOP_K children each (chain: one path)."""
    from ddtree_compile.core.tree import ancestor_closure

    N = B + 1
    par, depth, kids = [-1] * N, [0] * N, [0] * N
    for i in range(1, N):
        if chain or i <= SPINE:
            p = i - 1
        else:
            cands = [j for j in range(i) if depth[j] < SPINE and kids[j] < TOP_K]
            p = cands[int(torch.randint(0, len(cands), (), generator=g))]
        par[i], depth[i] = p, depth[p] + 1
        kids[p] += 1
    return ancestor_closure(torch.tensor([par]), N)[0]


def device_chunks(ctx: int, n_slots: int, splits: int, tiles) -> tuple[int, int]:
    """(chunk, splits that hold keys) as tree_attention's kernel derives them on the device."""
    min_chunk = max(tiles.block_n, tiles.min_chunk // tiles.block_n * tiles.block_n)
    total = ctx + n_slots
    chunk = max(-(-(-(-total // splits)) // tiles.block_n) * tiles.block_n, min_chunk)
    return chunk, -(-total // chunk)


def _rel_rows(out, ref, live):
    """Per (token, head) relative error [N, H] of live rows, as floats: max, mean, per-token max."""
    e = (out.float() - ref.float()).norm(dim=-1) / ref.float().norm(dim=-1).clamp(min=1e-6)
    e = e.nan_to_num(float("inf"))[live]
    return dict(max=float(e.max()), mean=float(e.mean()), per_token_max=[round(float(x), 5) for x in e.max(-1).values])


def _fa3_tree(fa, kv, bt, ctx: int, anc, q, scale: float):
    """vLLM's FA3 (paged, with a block table) computing the tree's function: every live node is a
    one-token query over its own sequence (the context, then its root-to-node path in depth order).
    The context's full pages are shared with the tree's block table; the partial page and the path go
    to fresh pages appended to a copy of the packed cache. Returns [N, Hq, D] (padding rows zero)."""
    bs, D = kv.shape[1], q.shape[-1]
    N = anc.shape[0]
    live = anc.diagonal().nonzero().flatten().tolist()
    base, off = ctx // bs, ctx % bs
    tails = -(-(off + N) // bs)
    nb = kv.shape[0]
    kv2 = torch.cat([kv, torch.zeros(len(live) * tails, *kv.shape[1:], dtype=kv.dtype, device=kv.device)])
    bt2 = torch.zeros(len(live), base + tails, dtype=torch.int32, device=kv.device)
    seq = torch.zeros(len(live), dtype=torch.int32, device=kv.device)
    row = bt[0].long()
    for n, i in enumerate(live):
        path = anc[i].nonzero().flatten().to(kv.device)  # ancestors-or-self, ascending = by depth
        pos = torch.cat([torch.arange(base * bs, ctx, device=kv.device), ctx + path])
        ids = nb + n * tails + torch.arange(tails, device=kv.device)
        dst = torch.arange(pos.numel(), device=kv.device)
        kv2[ids[dst // bs], dst % bs] = kv[row[pos // bs], pos % bs]
        bt2[n, :base], bt2[n, base:] = bt[0, :base], ids.int()
        seq[n] = ctx + path.numel()
    out = torch.zeros_like(q)
    o = torch.empty(len(live), *q.shape[1:], dtype=q.dtype, device=q.device)
    fa(q=q[live].contiguous(), k=kv2[..., :D], v=kv2[..., D:], out=o, max_seqlen_q=1,
       cu_seqlens_q=torch.arange(len(live) + 1, dtype=torch.int32, device=q.device), max_seqlen_k=int(seq.max()),
       seqused_k=seq, softmax_scale=scale, causal=True, block_table=bt2, fa_version=3)
    out[live] = o
    return out


def check_long_context(results: list, contexts=LONG_CONTEXTS, dev=DEV, budgets=None, block_size=None,
                       heads=None, seed: int = 7) -> None:
    """Tree attention at long context over vLLM's paged layout, at `vllm serve` case 9's shapes (the tiny
    multimodal Qwen3.5: 4 query / 2 KV heads of 64, bf16, KV blocks of 176 tokens, a block table 24 pages
    wide for max_model_len 4096): per context and tree (DDTree-shaped B = 16 / 32, and a chain), the
    Triton kernel with the plan and scratch the engine uses (split-KV + merge), the same kernel with one
    split, the op replayed in a CUDA graph captured at a short context (as vLLM captures FULL graphs),
    vLLM's FA3 (chain: one causal sequence, as the flat verify; tree: a one-token query per node over its
    path), each against the float32 reference: max / mean relative error per (token, head) row."""
    import ddtree_compile.templates.ops  # noqa: F401  registers ddtree::tree_attention_scratch
    from ddtree_compile.core.tree import pack_bits
    from ddtree_compile.templates import tree_attention as ta
    from ddtree_compile.templates import tuning

    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func as fa
    except ImportError as e:
        fa, fa_error = None, repr(e)
    Hq, Hkv, D = heads or (LONG_SHAPE["Hq"], LONG_SHAPE["Hkv"], LONG_SHAPE["D"])
    bs = block_size or LONG_SHAPE["block_size"]
    budgets = budgets or LONG_SHAPE["budgets"]
    dtype, scale = torch.bfloat16, D ** -0.5
    g = torch.Generator().manual_seed(seed)
    width = -(-LONG_SHAPE["max_model_len"] // bs)
    width = max(width, -(-(max(contexts) + max(budgets) + 1) // bs))
    nb = width + 3
    # the packed K|V cache of vLLM's FLASH_ATTN layout; block ids shuffled; one request
    kv = torch.randn(nb, bs, Hkv, 2 * D, generator=g).to(dtype).to(dev)
    kc, vc = kv[..., :D], kv[..., D:]
    bt = torch.randperm(nb, generator=g)[:width].view(1, width).int().to(dev)
    for B in budgets:
        N = B + 1
        for chain in (False, True):
            anc = _ddtree_tree(B, g, chain).to(dev)
            bits, depths = pack_bits(anc[None]), (anc.sum(-1) - 1).clamp(min=0)[None]
            live = anc.diagonal()
            q = torch.randn(N, Hq, D, generator=g).to(dtype).to(dev)
            cl = torch.zeros(1, dtype=torch.int32, device=dev)
            tiles, _, _, splits = tuning.plan_tree_attention(q, kc, bits, bt)
            scratch = torch.full((max(ta.bucket_scratch_elems(dev, 1, N, Hq, Hkv, D), 1),), float("nan"), device=dev)
            graph = graph_out = None
            if dev.type == "cuda":  # the op captured once at a short context (vLLM's capture), then replayed
                graph_out = torch.full_like(q, float("nan"))
                cl.fill_(16)
                torch.ops.ddtree.tree_attention_scratch(q, kc, vc, bt, cl, bits, depths, graph_out, scale, 0, 0.0,
                                                        scratch)  # warm-up: compile, plan
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    torch.ops.ddtree.tree_attention_scratch(q, kc, vc, bt, cl, bits, depths, graph_out, scale, 0,
                                                            0.0, scratch)
            for ctx in contexts:
                cl.fill_(ctx)
                rec = dict(check="long_context", B=B, N=N, tree="chain" if chain else "ddtree", ctx=ctx,
                           Hq=Hq, Hkv=Hkv, D=D, block_size=bs, dtype="bfloat16", block_table_pages=width,
                           tiles=dict(block_m=tuning.plan_tree_attention(q, kc, bits, bt)[1], block_n=tiles.block_n,
                                      min_chunk=tiles.min_chunk, page_group=tiles.page_group),
                           splits=splits, split_path=splits > 1)
                chunk, used = device_chunks(ctx, N, splits, tiles)
                rec.update(chunk=chunk, splits_with_keys=used, tree_split=used - 1,
                           tree_across_pages=ctx // bs != (ctx + N - 1) // bs)
                ref = torch.empty(q.shape, dtype=torch.float32, device=dev)
                tree_attention_reference(q.float(), kc.float(), vc.float(), bt, cl, bits, depths, ref, scale, 0, 0.0)
                out = torch.full_like(q, float("nan"))
                scratch.fill_(float("nan"))
                ta.launch_tree_attention(q, kc, vc, bt, cl, bits, depths, out, scale, 0, 0.0, scratch)
                direct = torch.full_like(q, float("nan"))
                ta.launch_tree_attention(q, kc, vc, bt, cl, bits, depths, direct, scale, 0, 0.0, splits=1)
                rec["triton_vs_ref"] = _rel_rows(out, ref, live)
                rec["triton_one_split_vs_ref"] = _rel_rows(direct, ref, live)
                rec["triton_vs_one_split"] = _rel_rows(out, direct, live)
                rec["nan"] = bool(out.isnan().any())
                if graph is not None:
                    graph_out.fill_(float("nan"))
                    graph.replay()
                    rec["graph_replay_equal_eager"] = bool(torch.equal(graph_out, out))
                if fa is None:
                    rec["fa3_error"] = "vLLM's FA3 not importable" if dev.type == "cuda" else "CPU run: no FA3"
                    if dev.type == "cuda":
                        rec["fa3_error"] += f": {fa_error}"
                else:
                    if chain:  # vLLM's flat verify: one causal sequence of N tokens over the paged cache
                        f3 = torch.full_like(q, float("nan"))
                        fa(q=q, k=kc, v=vc, out=f3, max_seqlen_q=N,
                           cu_seqlens_q=torch.tensor([0, N], dtype=torch.int32, device=dev), max_seqlen_k=ctx + N,
                           seqused_k=cl + N, softmax_scale=scale, causal=True, block_table=bt, fa_version=3)
                    else:
                        f3 = _fa3_tree(fa, kv, bt, ctx, anc, q, scale)
                    rec["fa3_vs_ref"] = _rel_rows(f3, ref, live)
                    rec["triton_vs_fa3"] = _rel_rows(out, f3, live)
                tri, f3e = rec["triton_vs_ref"]["max"], rec.get("fa3_vs_ref", {}).get("max")
                rec["ok"] = bool(not rec["nan"] and tri < 2e-2 and rec.get("graph_replay_equal_eager", True)
                                 and (f3e is None or tri <= 2 * f3e + 1e-3))
                results.append(rec)
                log(f"long_context B={B} {rec['tree']:<6} ctx={ctx:<5} splits {splits} (with keys {used}, chunk "
                    f"{chunk}): triton {tri:.2e} / one split {rec['triton_one_split_vs_ref']['max']:.2e}"
                    + (f" / FA3 {f3e:.2e}" if f3e is not None else "")
                    + (f" graph==eager {rec['graph_replay_equal_eager']}" if graph is not None else "")
                    + f"  ok {rec['ok']}")
