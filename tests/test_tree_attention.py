"""Tree attention: Triton kernel (TRITON_INTERPRET=1) vs the torch reference vs dense SDPA oracles.

The interpreter needs TRITON_INTERPRET=1 before triton is first imported, and another test module may
already have imported triton in this process, so the Triton cases run in one subprocess (this file run
as a script) and the parametrized tests below check its per-case results.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from _interp import run_interpreted

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


def _tol(dtype: str) -> dict:
    return dict(atol=2e-2, rtol=2e-2) if dtype == "bfloat16" else dict(atol=4e-3, rtol=4e-3)


# ------------------------------------------------------------------ interpreter subprocess


def _interp_main() -> None:
    """Runs every case through the Triton launcher on CPU tensors under the interpreter."""
    import triton
    from triton.runtime.interpreter import InterpretedFunction

    from ddtree_compile.templates import tree_attention as ta
    from ddtree_compile.templates import tuning

    results = {}
    runs = [(name, c, False) for name, c in CASES.items()]
    # same bucket, new data and permuted context lengths (the largest, hence every shape, is unchanged)
    runs += [(name + "_rerun", {**CASES[name], "seed": CASES[name]["seed"] + 1000, "ctx": CASES[name]["ctx"][::-1]},
              True) for name in RERUN]
    for name, c, rerun in runs:
        t = make_case(c)
        out = torch.full(t["query"].shape, float("nan"), dtype=t["out_dtype"])  # poisoned: unwritten rows fail
        tiles = None
        if c["tiles"] is not None:
            bm, bn, mc, pg = c["tiles"]
            tiles = tuning.AttnTiles(bm, bn, 4, 1, min_chunk=mc, page_group=pg)
        n_plans = len(ta._PLANS)
        ta.launch_tree_attention(t["query"], t["key_cache"], t["value_cache"], t["block_table"], t["context_lens"],
                                 t["ancestor_bits"], t["depths"], out, t["scale"], t["W"], t["cap"],
                                 tiles=tiles, splits=c["splits"], **t["scales"])
        ref = run_ref(t)
        tri = out.float()
        dead = ~t["anc"].diagonal(dim1=1, dim2=2).reshape(-1)
        # per (token, head) relative error: a dropped or extra key moves a whole row by ~1/n_visible
        row_rel = ((tri - ref).norm(dim=-1) / ref.norm(dim=-1).clamp(min=1e-6))[~dead]
        res = dict(
            interpreted=bool(triton.knobs.runtime.interpret) and isinstance(ta._tree_attn_fwd_kernel, InterpretedFunction),
            splits=tuning.plan_tree_attention(t["query"], t["key_cache"], t["ancestor_bits"], t["block_table"], tiles,
                                          c["splits"])[3],
            nan=bool(tri.isnan().any()),
            close=bool(torch.allclose(tri, ref, **_tol(c["dtype"]))),
            max_err=float((tri - ref).abs().nan_to_num(float("inf")).max()),
            row_rel=float(row_rel.nan_to_num(float("inf")).max()),
            padding_zero=bool((tri[dead] == 0).all()),
            num_padding_rows=int(dead.sum()),
            new_plan=len(ta._PLANS) > n_plans,
            rerun=rerun,
        )
        if res["splits"] > 1:
            res.update(_scratch_checks(ta, t, out, tiles, c["splits"], res["splits"]))
        results[name] = res
    print(json.dumps(results))


def _scratch_checks(ta, t: dict, out: torch.Tensor, tiles, splits, resolved_splits: int) -> dict:
    """The same launch with the caller's scratch (poisoned): the same output, the partials written
    there, a scratch too small refused naming the field, and nothing of it kept by the template."""
    import gc
    import weakref

    R, N = t["ancestor_bits"].shape[:2]
    need = ta._partial_sizes(resolved_splits, R * N, *t["query"].shape[1:])[1]
    scratch = torch.full((need,), float("nan"))
    again = torch.full_like(out, float("nan"))
    args = (t["query"], t["key_cache"], t["value_cache"], t["block_table"], t["context_lens"], t["ancestor_bits"],
            t["depths"])
    ta.launch_tree_attention(*args, again, t["scale"], t["W"], t["cap"], scratch, tiles=tiles, splits=splits,
                             **t["scales"])
    try:
        ta.launch_tree_attention(*args, again, t["scale"], t["W"], t["cap"], scratch[: need - 1], tiles=tiles,
                                 splits=splits, **t["scales"])
        small = "accepted"
    except ValueError as e:
        small = str(e)
    res = dict(scratch_same=bool(torch.equal(again, out)), scratch_written=bool(scratch.isfinite().any()),
               scratch_small="`scratch`" in small)
    freed = weakref.ref(scratch)
    del scratch
    gc.collect()
    res["scratch_freed"] = freed() is None
    return res


@pytest.fixture(scope="module")
def interp_results() -> dict:
    return run_interpreted(__file__, timeout=900)


@pytest.mark.parametrize("name", list(CASES) + [n + "_rerun" for n in RERUN])
def test_triton_matches_reference(interp_results, name):
    res = interp_results[name]
    case = CASES[name.removesuffix("_rerun")]
    assert res["interpreted"], "the Triton kernel did not run under the interpreter"
    assert not res["nan"], f"{name}: NaN (poison or unmasked read) in the Triton output"
    assert res["close"], f"{name}: max abs error {res['max_err']}"
    assert res["row_rel"] < _tol(case["dtype"])["rtol"], f"{name}: row relative error {res['row_rel']}"
    assert res["padding_zero"], f"{name}: padding rows are not zero"
    if case["splits"] not in (None, 1):
        assert res["splits"] > 1  # the split-KV + combine path really ran
    if res["splits"] > 1:  # the caller's scratch serves it alike, and stays the caller's
        assert res["scratch_same"] and res["scratch_written"] and res["scratch_small"] and res["scratch_freed"], res
    if res["rerun"]:  # a second call of a bucket (same shapes, new data) reuses the cached plan
        assert not res["new_plan"], f"{name}: the plan cache missed"


def test_cases_cover_padding_and_splits(interp_results):
    assert sum(r["num_padding_rows"] for r in interp_results.values()) > 0
    assert any(r["splits"] > 1 for r in interp_results.values())


# ------------------------------------------------------------------ per-bucket plan rules (host only)

PLAN_SHAPES = [(R, B, heads, D) for R in (1, 2, 8, 32, 256) for B in (7, 16, 22, 32, 64)
               for heads, D in (((24, 4), 256), ((32, 8), 128), ((8, 1), 64))]


@pytest.mark.parametrize("max_keys", [None, 1100, 33000])
def test_plan_rules_sm90(max_keys):
    from ddtree_compile.templates import tuning

    for R, B, (Hq, Hkv), D in PLAN_SHAPES:
        N, G = B + 1, Hq // Hkv
        p = tuning.choose_plan("sm_90", 132, R, N, G, Hkv, D, max_keys)
        t = p.tiles
        assert t == tuning.attention_tiles("sm_90", D)
        assert p.m_blocks * t.block_m >= N * G > (p.m_blocks - 1) * t.block_m  # every packed row, no empty tile
        per_split = R * Hkv * p.m_blocks
        assert 1 <= p.splits <= t.max_splits
        if max_keys is not None and p.splits > 1:  # no split that the block table's keys could never fill
            assert (p.splits - 1) * max(t.min_chunk, t.block_n) < max_keys
        chunk = max(t.min_chunk, t.block_n)
        capped = p.splits == t.max_splits or (max_keys is not None and p.splits * chunk >= max_keys)
        if p.splits > 1 and not capped:  # whole waves: one more split would need one more wave
            waves = -(-per_split * p.splits // 132)
            assert per_split * (p.splits + 1) > waves * 132, (R, B, Hq, D, p)


@pytest.mark.parametrize("R,rows_per_head,Hkv,want", [
    (1, 17 * 6, 4, 32),   # Qwen B=16, R=1: 4 programs per split -> 32 (cap; 33 would fill the wave)
    (1, 23 * 6, 4, 16),   # B=22: two 128-row tiles -> 8 programs per split -> 16 fill one wave of 132
    (1, 65 * 6, 4, 8),    # B=64: four tiles -> 8
    (8, 23 * 6, 4, 2),    # R=8: 64 programs per split -> 2 (4 would take 2 waves of half the keys + partials)
    (8, 65 * 4, 8, 2),    # 192 programs: 1 split = 2 waves of the whole context, 2 = 3 waves of half
    (32, 23 * 6, 4, 1),   # 256 programs: splitting adds no speed
])
def test_split_count_whole_waves(R, rows_per_head, Hkv, want):
    from ddtree_compile.templates import tuning

    t = tuning.attention_tiles("sm_90", 256)
    mb = -(-rows_per_head // t.block_m)
    assert tuning.num_splits(t, 132, R, Hkv, mb) == want
    # the block table bounds the useful splits: 1104 keys / 96-key minimum chunks -> at most 12
    assert tuning.num_splits(t, 132, R, Hkv, mb, max_keys=1104) == min(want, 12)


def test_a_key_bound_never_adds_splits():
    """bucket_scratch_elems sizes an engine's scratch with no bound on the keys (the block table's width
    is unknown while vLLM profiles memory): that covers every block table only if a bound never
    raises the split count. Every table, SM counts of the H100 / H200 / GB10 / the CPU default."""
    from ddtree_compile.templates import tuning

    for arch, sms in (("sm_90", 132), ("sm_90", 114), ("sm_121", 48), ("default", 4)):
        for D in (64, 128, 256):
            t = tuning.attention_tiles(arch, D)
            for R in range(1, 65):
                for Hkv in (1, 2, 4, 8):
                    for mb in (1, 2, 3, 5):
                        free = tuning.num_splits(t, sms, R, Hkv, mb)
                        for max_keys in (16, 100, 128, 300, 1000, 4096, 40000):
                            assert tuning.num_splits(t, sms, R, Hkv, mb, max_keys) <= free


def test_bucket_scratch_covers_the_plan_of_its_bucket():
    from ddtree_compile.templates import tree_attention as ta
    from ddtree_compile.templates import tuning

    cpu = torch.device("cpu")
    assert not ta.uses_scratch(cpu) and ta.uses_scratch("cuda")
    for R, B, (Hq, Hkv), D in PLAN_SHAPES:
        N = B + 1
        splits = tuning.plan_bucket(cpu, R, N, Hq, Hkv, D)[3]
        elems = ta.bucket_scratch_elems(cpu, R, N, Hq, Hkv, D)
        if splits == 1:
            assert elems == 0
        else:  # out [S, T, Hq, D] and lse [S, T, Hq] partials, lse aligned
            assert elems >= splits * R * N * Hq * (D + 1) and ta._partial_sizes(splits, R * N, Hq, D)[0] % 32 == 0
        for max_keys in (64, 1100, 33000):  # any block table: no more
            s = tuning.plan_bucket(cpu, R, N, Hq, Hkv, D, max_keys)[3]
            assert ta._partial_sizes(s, R * N, Hq, D)[1] <= elems


def test_plan_other_arches_use_their_table():
    from ddtree_compile.templates import tuning

    assert tuning.choose_plan("sm_121", 48, 1, 23, 6, 4, 256).tiles == tuning.attention_tiles("sm_121", 256)
    assert tuning.attention_tiles("sm_80", 128) == tuning.attention_tiles("default", 128)


# ------------------------------------------------------------------ reference vs dense oracles (in process)


@pytest.mark.parametrize("name", list(CASES))
def test_reference_matches_dense_sdpa(name):
    c = CASES[name]
    t = make_case(c)
    ref = run_ref(t)
    torch.testing.assert_close(ref, dense_oracle(t), atol=1e-4, rtol=1e-4)
    # the op-dtype path (FP8 entries and scales as given) rounds once, at the end
    low = run_ref(t, op_dtype=True)
    torch.testing.assert_close(low.float(), ref, **_tol(c["dtype"]))


@pytest.mark.parametrize("ctx", [(0, 13), (40, 7)])
def test_chain_equals_causal_attention(ctx):
    t = make_case({**BASE, "kind": "chain", "N": 9, "ctx": ctx, "seed": 21})
    N = 9
    outs = []
    bs = t["key_cache"].shape[1]
    for r, x in enumerate(ctx):
        pos = torch.arange(x + N)
        blk = t["block_table"][r].long()[pos // bs]
        k = t["key_cache"][blk, pos % bs].float().transpose(0, 1).repeat_interleave(2, 0)
        v = t["value_cache"][blk, pos % bs].float().transpose(0, 1).repeat_interleave(2, 0)
        q = t["query"][r * N:(r + 1) * N].float().transpose(0, 1)
        causal = torch.ones(N, x + N, dtype=torch.bool).tril(diagonal=x)  # bottom-right aligned
        outs.append(torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=causal,
                                                                     scale=t["scale"]).transpose(0, 1))
    torch.testing.assert_close(run_ref(t), torch.cat(outs), atol=1e-4, rtol=1e-4)


def test_siblings_do_not_see_each_other():
    """Changing a sibling's K/V leaves the other sibling's output unchanged."""
    t = make_case({**BASE, "kind": "star", "N": 4, "ctx": (9,), "seed": 22})
    before = run_ref(t)
    blk = t["block_table"][0, (9 + 2) // 16].long()
    t["key_cache"][blk, (9 + 2) % 16] += 3.0  # slot 2
    t["value_cache"][blk, (9 + 2) % 16] -= 3.0
    after = run_ref(t)
    torch.testing.assert_close(after[[0, 1, 3]], before[[0, 1, 3]])
    assert not torch.allclose(after[2], before[2])


# ------------------------------------------------------------------ the op: dispatch, fake, compile, errors


def _op_args(t: dict, out: torch.Tensor):
    return (t["query"], t["key_cache"], t["value_cache"], t["block_table"], t["context_lens"], t["ancestor_bits"],
            t["depths"], out, t["scale"], t["W"], t["cap"])


def test_op_cpu_dispatches_to_reference():
    import ddtree_compile.templates.ops  # noqa: F401  registers the op

    t = make_case(CASES["sliding_window"])
    out = torch.full_like(t["query"], float("nan"))
    torch.ops.ddtree.tree_attention(*_op_args(t, out))
    assert torch.equal(out, run_ref(t, op_dtype=True))
    scratch = torch.full((64,), float("nan"))  # the reference needs none: a scratch is accepted, left alone
    out.fill_(float("nan"))
    torch.ops.ddtree.tree_attention_scratch(*_op_args(t, out), scratch)
    assert torch.equal(out, run_ref(t, op_dtype=True)) and scratch.isnan().all()
    for bad in (scratch.half(), scratch.view(8, 8), scratch[1:]):  # dtype, shape, a misaligned start
        with pytest.raises(ValueError, match="`scratch`"):
            torch.ops.ddtree.tree_attention_scratch(*_op_args(t, out), bad)


def test_op_opcheck_and_compile():
    import ddtree_compile.templates.ops  # noqa: F401

    t = make_case({**BASE, "N": 4, "ctx": (5, 3), "seed": 23})
    out = torch.zeros_like(t["query"])
    for op, args in ((torch.ops.ddtree.tree_attention, _op_args(t, out)),
                     (torch.ops.ddtree.tree_attention_scratch, _op_args(t, out) + (torch.zeros(32),))):
        torch.library.opcheck(op.default, args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))

    def f(q, kc, vc, bt, cl, bits, depths):
        o = torch.empty_like(q)
        torch.ops.ddtree.tree_attention(q * 1.0, kc, vc, bt, cl, bits, depths, o, t["scale"], 0, 0.0)
        return o + 0.0

    args = _op_args(t, out)[:7]
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(*args), f(*args))


def _bad(t: dict, **kw):
    args = dict(query=t["query"], key_cache=t["key_cache"], value_cache=t["value_cache"], block_table=t["block_table"],
                context_lens=t["context_lens"], ancestor_bits=t["ancestor_bits"], depths=t["depths"],
                out=torch.empty_like(t["query"]), softmax_scale=t["scale"], sliding_window=0, logits_soft_cap=0.0)
    args.update(kw)
    return args


@pytest.mark.parametrize("field,change", [
    ("query", lambda t: dict(query=t["query"][:-1], out=torch.empty_like(t["query"][:-1]))),
    ("query", lambda t: dict(query=t["query"].int(), out=t["query"].int())),
    ("key_cache", lambda t: dict(key_cache=t["key_cache"].half())),
    ("key_cache", lambda t: dict(key_cache=t["key_cache"][:, :, :1].expand(-1, -1, 3, -1),
                                 value_cache=t["value_cache"][:, :, :1].expand(-1, -1, 3, -1))),
    ("value_cache", lambda t: dict(value_cache=t["value_cache"][:-1])),
    ("block_table", lambda t: dict(block_table=t["block_table"].long())),
    ("context_lens", lambda t: dict(context_lens=t["context_lens"][:1])),
    ("ancestor_bits", lambda t: dict(ancestor_bits=t["ancestor_bits"].long())),
    ("depths", lambda t: dict(depths=t["depths"][:, :-1])),
    ("out", lambda t: dict(out=torch.empty_like(t["query"], dtype=torch.float32))),
    ("softmax_scale", lambda t: dict(softmax_scale=0.0)),
    ("logits_soft_cap", lambda t: dict(logits_soft_cap=float("nan"))),
])
def test_bad_inputs_name_the_field(field, change):
    import ddtree_compile.templates.ops  # noqa: F401  registers the op
    from ddtree_compile.templates.tree_attention import launch_tree_attention
    from ddtree_compile.templates.tree_attention_ref import tree_attention_reference

    t = make_case(CASES["chain"])
    args = _bad(t, **change(t))
    with pytest.raises(ValueError, match=f"`{field}`"):
        tree_attention_reference(**args)
    with pytest.raises(ValueError, match=f"`{field}`"):
        launch_tree_attention(**args)  # same checks before any launch
    with pytest.raises(ValueError, match=f"`{field}`"):
        torch.ops.ddtree.tree_attention(**args)


def _fp8_bad(name: str):
    t = make_case(CASES["fp8_qkv_split_kv"])
    sc = t["scales"]
    bf = make_case({**CASES["fp8_qkv_split_kv"], "fp8": None})
    return {
        "missing_k_scale": ("k_scale", dict(q_scale=sc["q_scale"], v_scale=sc["v_scale"])),
        "q_scale_without_fp8_query": ("q_scale", dict(query=bf["query"], out=torch.empty_like(bf["query"]), **sc)),
        "scale_per_query_head": ("v_scale", {**sc, "v_scale": torch.ones(t["query"].shape[1])}),
        "scale_float64": ("k_scale", {**sc, "k_scale": sc["k_scale"].double()}),
        "fp8_query_bf16_cache": ("key_cache", dict(key_cache=bf["key_cache"], value_cache=bf["value_cache"],
                                               q_scale=sc["q_scale"])),
        "fp8_out": ("out", dict(out=torch.empty_like(t["query"]), **sc)),
        "mixed_kv_dtypes": ("value_cache", dict(value_cache=t["value_cache"].view(torch.float8_e5m2), **sc)),
    }[name], t


@pytest.mark.parametrize("name", ["missing_k_scale", "q_scale_without_fp8_query", "scale_per_query_head",
                                  "scale_float64", "fp8_query_bf16_cache", "fp8_out", "mixed_kv_dtypes"])
def test_fp8_bad_inputs_name_the_field(name):
    import ddtree_compile.templates.ops  # noqa: F401  registers the op
    from ddtree_compile.templates.tree_attention import launch_tree_attention
    from ddtree_compile.templates.tree_attention_ref import tree_attention_reference

    (field, change), t = _fp8_bad(name)
    args = _bad(t, **{"out": torch.empty(t["query"].shape, dtype=torch.bfloat16), **change})
    for fn in (tree_attention_reference, launch_tree_attention, torch.ops.ddtree.tree_attention):
        with pytest.raises(ValueError, match=f"`{field}`"):
            fn(**args)


def test_fp8_op_dispatch_opcheck_and_compile():
    """The op with scales: the CPU kernel is the reference, schema / fake / AOT checks pass with and
    without the caller's scratch, and torch.compile traces it (the fake runs the FP8 checks)."""
    import ddtree_compile.templates.ops  # noqa: F401

    t = make_case({**CASES["fp8_qkv_per_head_gqa_window"], "N": 4, "ctx": (5, 3)})
    sc = (t["scales"]["q_scale"], t["scales"]["k_scale"], t["scales"]["v_scale"])
    out = torch.full(t["query"].shape, float("nan"), dtype=torch.bfloat16)
    torch.ops.ddtree.tree_attention(*_op_args(t, out), *sc)
    assert torch.equal(out, run_ref(t, op_dtype=True)) and not out.isnan().any()
    for op, args in ((torch.ops.ddtree.tree_attention, _op_args(t, out) + sc),
                     (torch.ops.ddtree.tree_attention_scratch, _op_args(t, out) + (torch.zeros(32),) + sc)):
        # test_schema compares FP8 tensors with an op torch lacks for them; test_op_opcheck_and_compile
        # checks the same schemas on bfloat16 inputs
        torch.library.opcheck(op.default, args, test_utils=("test_faketensor", "test_aot_dispatch_static"))

    def f(q, kc, vc, bt, cl, bits, depths, qs, ks, vs):
        o = torch.empty(q.shape, dtype=torch.bfloat16)
        torch.ops.ddtree.tree_attention(q, kc, vc, bt, cl, bits, depths, o, t["scale"], t["W"], 0.0, qs, ks, vs)
        return o + 0.0

    args = _op_args(t, out)[:7] + sc
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(*args), f(*args))


if __name__ == "__main__":
    _interp_main()
