"""bench_tree_attention's shared pieces: the shapes, random DDTree-shaped trees over a random paged K/V
cache, the baselines the tree is timed against (causal FlashAttention, dense-mask SDPA), the timers,
one timed tree-attention call, and a tile config's error against the float32 reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench, do_bench_cudagraph

from ddtree_compile.core.tree import ancestor_closure, pack_bits
from ddtree_compile.templates import tuning
from ddtree_compile.templates.tree_attention import launch_tree_attention
from ddtree_compile.templates.tree_attention_ref import tree_attention_reference

MODELS = {"qwen3.6-27b": (24, 4, 256), "llama3-8b-like": (32, 8, 128)}  # (Hq, Hkv, D)
CONTEXTS = (1024, 8192, 32768)
BUDGETS = (16, 22, 32, 64)
REQUESTS = (1, 8, 32)
BLOCK_SIZE = 16
DEV = torch.device("cuda")


def log(*a):
    print(*a, flush=True)


def ddtree_parents(B: int, g: torch.Generator) -> list[int]:
    """A DDTree-like shape: a spine of up to 15 nodes, the rest hung off nodes of depth < 15."""
    par, depth = [-1], [0]
    for i in range(1, B + 1):
        if i <= 15:
            p = i - 1
        else:
            cands = [j for j in range(i) if depth[j] < 15]
            p = cands[int(torch.randint(0, len(cands), (), generator=g))]
        par.append(p)
        depth.append(depth[p] + 1)
    return par


def tree_meta(R: int, B: int, g: torch.Generator, chain: bool = False):
    N = B + 1
    parents = torch.tensor([list(range(-1, N - 1)) if chain else ddtree_parents(B, g) for _ in range(R)])
    anc = ancestor_closure(parents, N)
    return anc.to(DEV), pack_bits(anc).to(DEV), (anc.sum(-1) - 1).clamp(min=0).to(DEV)


def paged_cache(R: int, L: int, Hkv: int, D: int, dtype, g: torch.Generator, block_size: int = BLOCK_SIZE):
    """Random paged K/V with a shuffled block table holding L positions per request."""
    per = -(-L // block_size)
    nb = R * per + 1
    bt = torch.randperm(nb, generator=g)[: R * per].view(R, per).int().to(DEV)
    kc = torch.randn(nb, block_size, Hkv, D, device=DEV, dtype=dtype)
    vc = torch.randn(nb, block_size, Hkv, D, device=DEV, dtype=dtype)
    return kc, vc, bt


def gather(cache, bt, r, n):
    bs = cache.shape[1]
    pos = torch.arange(n, device=DEV)
    return cache[bt[r].long()[pos // bs], pos % bs]  # [n, Hkv, D]


def row_rel(out, ref):
    e = (out.float() - ref.float()).norm(dim=-1) / ref.float().norm(dim=-1).clamp(min=1e-6)
    return float(e.nan_to_num(float("inf")).max())


# ------------------------------------------------------------------------------------------ baselines


_FA_GQA = None


def causal_fa(qt, k, v, scale):
    """FA2 through aten; K/V with fewer heads (GQA) if this build takes them, else expanded (untimed
    callers pass pre-expanded K/V: see run_table)."""
    if k.shape[1] != qt.shape[1] and not fa_gqa_supported():
        G = qt.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    return torch.ops.aten._scaled_dot_product_flash_attention(qt, k, v, 0.0, True, False, scale=scale)[0]


def fa_gqa_supported() -> bool:
    global _FA_GQA
    if _FA_GQA is None:
        q = torch.randn(1, 4, 8, 64, device=DEV, dtype=torch.bfloat16)
        k = torch.randn(1, 2, 24, 64, device=DEV, dtype=torch.bfloat16)
        try:
            torch.ops.aten._scaled_dot_product_flash_attention(q, k, k, 0.0, True, False)
            _FA_GQA = True
        except RuntimeError:
            _FA_GQA = False
    return _FA_GQA


def dense_bias(anc, C, dtype):
    """Additive mask [R, 1, N, C+N] (last dim padded to 16 so SDPA need not copy it)."""
    R, N, _ = anc.shape
    L = C + N
    full = torch.zeros(R, 1, N, -(-L // 16) * 16, device=DEV, dtype=dtype)
    full[:, 0, :, C:L] = torch.where(anc, 0.0, float("-inf")).to(dtype)
    return full[..., :L]


_DENSE_GQA = None


def dense_gqa_supported() -> bool:
    """Does the memory-efficient backend take GQA (enable_gqa) with a mask? Else K/V get expanded."""
    global _DENSE_GQA
    if _DENSE_GQA is None:
        q = torch.randn(1, 4, 8, 64, device=DEV, dtype=torch.bfloat16)
        k = torch.randn(1, 2, 24, 64, device=DEV, dtype=torch.bfloat16)
        bias = torch.zeros(1, 1, 8, 32, device=DEV, dtype=torch.bfloat16)[..., :24]
        try:
            with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
                F.scaled_dot_product_attention(q, k, k, attn_mask=bias, enable_gqa=True)
            _DENSE_GQA = True
        except RuntimeError:
            _DENSE_GQA = False
    return _DENSE_GQA


def dense_kv(k, v, G):
    """K/V as the dense path takes them: native GQA heads, or expanded once (outside any timing)."""
    if dense_gqa_supported() and fa_gqa_supported():
        return k, v
    return k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)


def dense_sdpa(qt, k, v, bias, scale):
    """Memory-efficient SDPA with the dense additive mask."""
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        return F.scaled_dot_product_attention(qt, k, v, attn_mask=bias, scale=scale,
                                              enable_gqa=qt.shape[1] != k.shape[1])


# ------------------------------------------------------------------------------------------ timing


def bench(fn, graph=False, rep=20):
    if graph:
        fn()
        return do_bench_cudagraph(fn, rep=rep, return_mode="median")
    return do_bench(fn, warmup=10, rep=40, return_mode="median")


def setup_group(model, R, C, g):
    Hq, Hkv, D = MODELS[model]
    Nmax = max(BUDGETS) + 1
    kc, vc, bt = paged_cache(R, C + Nmax, Hkv, D, torch.bfloat16, g)
    k = torch.randn(R, Hkv, C + Nmax, D, device=DEV, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    return dict(kc=kc, vc=vc, bt=bt, k=k, v=v, cl=torch.full((R,), C, dtype=torch.int32, device=DEV))


def dense_group(grp, model):
    Hq, Hkv, D = MODELS[model]
    try:
        grp["kx"], grp["vx"] = dense_kv(grp["k"], grp["v"], Hq // Hkv)
    except torch.OutOfMemoryError:
        grp["kx"] = grp["vx"] = None


def time_tree(grp, model, R, C, B, g, tiles=None, waves=None, graph=False, splits=None, check_ref=False, rep=20):
    """Time one tree-attention call; returns (ms, plan dict, (anc, q), row_rel error or None)."""
    Hq, Hkv, D = MODELS[model]
    N = B + 1
    anc, bits, depths = tree_meta(R, B, g)
    q = torch.randn(R * N, Hq, D, device=DEV, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    if waves is not None and splits is None:
        t = tiles or tuning.attention_tiles(tuning.arch_of(DEV)[0], D)
        splits = tuning.plan_tree_attention(q, grp["kc"], bits, grp["bt"], tuning.with_overrides(t, waves=waves))[3]
    fn = lambda: launch_tree_attention(q, grp["kc"], grp["vc"], grp["bt"], grp["cl"], bits, depths, out,  # noqa
                                       D ** -0.5, 0, 0.0, tiles=tiles, splits=splits)
    err = None
    if check_ref:
        out.fill_(float("nan"))
        fn()
        ref = torch.empty(q.shape, device=DEV, dtype=torch.float32)
        tree_attention_reference(q.float(), grp["kc"].float(), grp["vc"].float(), grp["bt"], grp["cl"], bits, depths,
                                 ref, D ** -0.5, 0, 0.0)
        err = row_rel(out, ref)
        del ref
    ms = bench(fn, graph, rep) if graph else bench(fn)
    t_used, block_m, m_blocks, s_used = tuning.plan_tree_attention(q, grp["kc"], bits, grp["bt"], tiles, splits)
    plan = dict(block_m=block_m, m_blocks=m_blocks, splits=s_used, block_n=t_used.block_n,
                min_chunk=t_used.min_chunk, num_warps=t_used.num_warps, num_stages=t_used.num_stages)
    return ms, plan, (anc, q), err


def make_tiles(cfg) -> tuning.AttnTiles:
    bm, bn, warps, stages, page_group = cfg
    return tuning.AttnTiles(bm, bn, warps, stages, page_group=page_group)


def config_error(model, tiles, g, window=0, cap=0.0) -> float:
    """Max row-relative error vs the float32 reference for one tile config (split and direct paths)."""
    Hq, Hkv, D = MODELS[model]
    R, B, ctxs = 2, 22, [3000, 77]
    N = B + 1
    anc, bits, depths = tree_meta(R, B, g)
    kc, vc, bt = paged_cache(R, max(ctxs) + N, Hkv, D, torch.bfloat16, g)
    q = torch.randn(R * N, Hq, D, device=DEV, dtype=torch.bfloat16)
    cl = torch.tensor(ctxs, dtype=torch.int32, device=DEV)
    ref = torch.empty(q.shape, device=DEV, dtype=torch.float32)
    tree_attention_reference(q.float(), kc.float(), vc.float(), bt, cl, bits, depths, ref, D ** -0.5, window, cap)
    err = 0.0
    for splits in (1, 3):
        out = torch.full_like(q, float("nan"))
        launch_tree_attention(q, kc, vc, bt, cl, bits, depths, out, D ** -0.5, window, cap, tiles=tiles,
                              splits=splits)
        err = max(err, row_rel(out, ref))
    return err


def kernel_info() -> list:
    """Registers / spills / shared memory of every compiled variant (best effort, Triton internals)."""
    from ddtree_compile.templates import tree_attention as ta

    info = []
    try:
        for cache in ta._tree_attn_fwd_kernel.device_caches.values():
            for key, k in cache[0].items():
                md = k.metadata
                info.append(dict(key=str(key)[-160:], n_regs=getattr(k, "n_regs", None),
                                 n_spills=getattr(k, "n_spills", None), shared=getattr(md, "shared", None),
                                 num_warps=getattr(md, "num_warps", None), num_stages=getattr(md, "num_stages", None)))
    except Exception as e:  # noqa: BLE001  diagnostics only
        info.append(dict(error=str(e)[:200]))
    return info
