"""Tree attention test cases shared by test_tree_attention.py (the Triton kernel and the reference against
dense oracles) and test_tree_attention_op.py (the launch plan and the registered op): each case's tree,
paged cache and query, the torch reference, a dense SDPA oracle and the tolerance per dtype."""

from __future__ import annotations

import math

import torch

from ddtree_compile.core.tree import ancestor_closure, pack_bits

# name -> case. kind: tree shape; live: nodes per request (<= N-1, rest padding); ctx: context lengths;
# bs: cache block size; heads: (Hq, Hkv); tiles: (BLOCK_M, BLOCK_N, min_chunk, page_group) or None (default
# table; page_group 0 = per-tile block-id loads, >0 = block ids loaded a group of pages at a time);
# splits: split-KV factor (None: launcher default); W: sliding window; cap: logit soft cap.
# fp8: None, "kv" (an FP8 KV cache, query in `dtype`) or "qkv" (the query FP8 too, as vLLM hands it over
# for FA/Triton backends), entries of `fp8_type`, scales of `scale_heads` elements (1 or Hkv).
BASE = dict(kind="random", N=8, live=None, ctx=(21, 45), bs=16, heads=(4, 2), D=64, dtype="bfloat16",
            tiles=(32, 16, 16, 0), splits=1, W=0, cap=0.0, layout="flash", seed=0, fp8=None,
            fp8_type="float8_e4m3fn", scale_heads=1)
CASES = {
    "chain": dict(kind="chain"),
    "star": dict(kind="star"),
    "deep": dict(kind="deep", N=12, seed=1),
    "bushy": dict(kind="bushy", N=12, seed=2),
    "padding_rows": dict(N=10, live=(4, 0), ctx=(30, 7), seed=3),
    "mixed_ctx_split_kv": dict(N=6, ctx=(0, 33, 100), splits=3, seed=4),
    "empty_splits": dict(N=5, ctx=(3, 20), splits=8, seed=5),
    "block_boundaries": dict(N=9, ctx=(16, 15, 8), bs=8, splits=2, seed=6),
    "gqa_1": dict(heads=(2, 2), seed=7),
    "gqa_4": dict(heads=(8, 2), splits=2, seed=8),
    "gqa_6": dict(heads=(6, 1), N=7, seed=9),
    "sliding_window": dict(kind="deep", N=10, ctx=(40, 12), W=10, splits=2, seed=10),
    "window_inside_tree": dict(kind="chain", N=10, ctx=(25, 5), W=3, seed=11),
    "soft_cap": dict(cap=2.0, seed=12),
    "soft_cap_window_split": dict(cap=5.0, W=17, ctx=(50, 9), splits=3, seed=13),
    "two_mask_words": dict(kind="bushy", N=40, live=(39, 31), ctx=(10, 3), heads=(2, 1),
                           tiles=(64, 32, 32, 0), seed=14),
    "cpu_layout": dict(layout="cpu", ctx=(19, 40), splits=2, seed=15),
    "head_128": dict(D=128, N=6, ctx=(20, 9), heads=(2, 1), seed=16),
    "head_256": dict(D=256, N=5, ctx=(12, 20), heads=(2, 1), splits=2, seed=17),
    "fp16": dict(dtype="float16", seed=18),
    "default_tiles": dict(tiles=None, splits=None, N=17, ctx=(70, 300), heads=(6, 2), seed=19),
    # grouped block ids: (4-1) pages of 8 keys = 24 -> groups of 16 keys, several groups per split
    "page_groups": dict(tiles=(32, 16, 16, 4), bs=8, ctx=(100, 37, 0), splits=2, seed=20),
    "page_groups_window_cap": dict(tiles=(32, 16, 16, 8), bs=4, ctx=(90, 61), W=33, cap=4.0, splits=3,
                                   kind="deep", N=12, seed=24),
    "page_groups_mid_page_window": dict(tiles=(32, 16, 16, 8), bs=4, ctx=(90, 70), W=50, seed=26),
    "page_groups_gqa_head128": dict(tiles=(64, 32, 32, 4), bs=16, ctx=(150, 3), heads=(8, 2), D=128, N=7,
                                    seed=25),
    "fp8_kv": dict(fp8="kv", seed=29),
    "fp8_qkv_split_kv": dict(fp8="qkv", ctx=(0, 33, 100), N=6, splits=3, seed=30),
    "fp8_qkv_per_head_gqa_window": dict(fp8="qkv", heads=(8, 2), scale_heads=2, W=17, ctx=(50, 9), seed=31),
    "fp8_e5m2_kv_fp16_cap": dict(fp8="kv", fp8_type="float8_e5m2", dtype="float16", cap=5.0, seed=32),
    "fp8_page_groups": dict(fp8="qkv", tiles=(32, 16, 16, 4), bs=8, ctx=(100, 37), splits=2, scale_heads=2, seed=33),
    # the combine merges 16 (pow2 of 9) splits x 8 heads per program: two head blocks per token
    "combine_head_blocks": dict(heads=(16, 2), N=5, ctx=(40, 200), splits=9, seed=27),
    # chunk = 16 keys: context 32 / 48 fills whole chunks, so the last split holds only the tree keys
    "tree_only_last_split": dict(ctx=(32, 48), splits=4, seed=28),
}
# second launch of the bucket: cached plan, new data
RERUN = ("mixed_ctx_split_kv", "gqa_4", "default_tiles", "fp8_qkv_split_kv")
CASES = {k: {**BASE, **v} for k, v in CASES.items()}


def random_parents(kind: str, n_live: int, N: int, g: torch.Generator) -> list[int]:
    """Parents of slots 0..N-1 (parents before children); slots past n_live are padding (-1)."""
    par = [-1] * N
    for i in range(1, n_live + 1):
        if kind == "chain":
            par[i] = i - 1
        elif kind == "star":
            par[i] = 0
        elif kind == "deep":  # mostly extend the newest node, sometimes branch
            par[i] = i - 1 if torch.rand((), generator=g) < 0.75 else int(torch.randint(0, i, (), generator=g))
        elif kind == "bushy":  # few levels, many siblings
            par[i] = int(torch.randint(0, max(1, (i + 2) // 3), (), generator=g))
        else:
            par[i] = int(torch.randint(0, i, (), generator=g))
    return par


def make_case(c: dict) -> dict:
    g = torch.Generator().manual_seed(c["seed"])
    dtype = getattr(torch, c["dtype"])
    N, ctxs, bs, D = c["N"], list(c["ctx"]), c["bs"], c["D"]
    Hq, Hkv = c["heads"]
    R = len(ctxs)
    live = c["live"] or (N - 1,) * R
    parents = torch.tensor([random_parents(c["kind"], live[r], N, g) for r in range(R)])
    anc = ancestor_closure(parents, N)
    bits = pack_bits(anc)
    depths = (anc.sum(-1) - 1).clamp(min=0)
    max_blocks = max(-(-(x + N) // bs) for x in ctxs) + 1
    num_blocks = R * max_blocks + 2
    block_table = torch.randperm(num_blocks, generator=g)[: R * max_blocks].view(R, max_blocks).int()
    shape = (num_blocks, bs, Hkv, D) if c["layout"] == "flash" else (num_blocks, Hkv, bs, D)
    fp8 = getattr(torch, c["fp8_type"])
    kv_dtype = fp8 if c["fp8"] else dtype
    # FP8 scales: value = entry * scale, one scale per tensor or per KV head; values of ~N(0, 1) fill
    # ~[-4, 4] / scale of the e4m3 range (max 448)
    scales = {n: (0.01 + 0.02 * torch.rand(c["scale_heads"], generator=g)).reshape(() if c["scale_heads"] == 1 else -1)
              for n in ("q_scale", "k_scale", "v_scale")} if c["fp8"] else {}

    def store(x, name):  # a [.., Hkv or Hq, D] value as the cache / query holds it
        if name not in scales:
            return x.to(dtype)
        s = scales[name].reshape(-1)
        return (x / s.repeat_interleave(x.shape[-2] // s.numel())[:, None]).to(fp8)

    k_store = torch.full(shape, float("nan"), dtype=kv_dtype)  # unwritten slots stay NaN: never read them
    v_store = torch.full(shape, float("nan"), dtype=kv_dtype)
    kc = k_store if c["layout"] == "flash" else k_store.permute(0, 2, 1, 3)  # logical view, odd strides
    vc = v_store if c["layout"] == "flash" else v_store.permute(0, 2, 1, 3)
    for r, x in enumerate(ctxs):
        pos = torch.arange(x + N)
        blk, slot = block_table[r].long()[pos // bs], pos % bs
        kc[blk, slot] = store(torch.randn(x + N, Hkv, D, generator=g), "k_scale")
        vc[blk, slot] = store(torch.randn(x + N, Hkv, D, generator=g), "v_scale")
    q = store(torch.randn(R * N, Hq, D, generator=g), "q_scale" if c["fp8"] == "qkv" else "")
    if c["fp8"] == "kv":
        del scales["q_scale"]
    return dict(query=q, key_cache=kc, value_cache=vc, block_table=block_table,
                context_lens=torch.tensor(ctxs, dtype=torch.int32), ancestor_bits=bits, depths=depths,
                anc=anc, scale=0.9 / math.sqrt(D), W=c["W"], cap=c["cap"], out_dtype=dtype, scales=scales)


def dequant(t: dict) -> dict:
    """The case in float32 with no scales: FP8 entries times their scale (exact in float32)."""
    def f(x, name):
        s = t["scales"].get(name)
        if s is None:
            return x.float()
        s = s.reshape(-1)
        return x.float() * s.repeat_interleave(x.shape[-2] // s.numel())[:, None]

    return {**t, "query": f(t["query"], "q_scale"), "key_cache": f(t["key_cache"], "k_scale"),
            "value_cache": f(t["value_cache"], "v_scale"), "out_dtype": torch.float32, "scales": {}}


def run_ref(t: dict, op_dtype: bool = False) -> torch.Tensor:
    """The reference in float32 (inputs upcast exactly, FP8 entries dequantized), or with op_dtype the
    reference on the case's own tensors (FP8 entries and scales, output in the case's dtype)."""
    from ddtree_compile.templates.tree_attention_ref import tree_attention_reference

    t = t if op_dtype else dequant(t)
    out = torch.full(t["query"].shape, float("nan"), dtype=t["out_dtype"])
    tree_attention_reference(t["query"], t["key_cache"], t["value_cache"], t["block_table"], t["context_lens"],
                             t["ancestor_bits"], t["depths"], out, t["scale"], t["W"], t["cap"], **t["scales"])
    return out


def dense_oracle(t: dict) -> torch.Tensor:
    """Per request: gather K/V densely, build the explicit boolean mask, and run SDPA (or the
    soft-capped formula, which SDPA lacks)."""
    N = t["anc"].shape[1]
    Hq, Hkv = t["query"].shape[1], t["key_cache"].shape[2]
    bs = t["key_cache"].shape[1]
    outs = []
    t = dequant(t)
    for r, x in enumerate(t["context_lens"].tolist()):
        pos = torch.arange(x + N)
        blk = t["block_table"][r].long()[pos // bs]
        k = t["key_cache"][blk, pos % bs].float().transpose(0, 1)  # [Hkv, x+N, D]
        v = t["value_cache"][blk, pos % bs].float().transpose(0, 1)
        q = t["query"][r * N:(r + 1) * N].float().transpose(0, 1)  # [Hq, N, D]
        anc = t["anc"][r]
        depth = t["depths"][r]
        mask = torch.zeros(N, x + N, dtype=torch.bool)
        mask[:, :x] = anc.diagonal()[:, None]
        mask[:, x:] = anc
        if t["W"] > 0:
            kpos = torch.cat([torch.arange(x), x + depth])
            mask &= (x + depth)[:, None] - kpos[None, :] < t["W"]
        k, v = k.repeat_interleave(Hq // Hkv, 0), v.repeat_interleave(Hq // Hkv, 0)
        if t["cap"] > 0:
            s = t["cap"] * torch.tanh(q @ k.transpose(1, 2) * t["scale"] / t["cap"])
            o = torch.softmax(s.masked_fill(~mask, float("-inf")), -1) @ v
        else:
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=t["scale"])
        o = torch.where(anc.diagonal()[None, :, None], o, 0.0)  # padding rows: zeros (SDPA gives NaN)
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)


def tolerance(dtype: str) -> dict:
    return dict(atol=2e-2, rtol=2e-2) if dtype == "bfloat16" else dict(atol=4e-3, rtol=4e-3)
