"""Tree attention at the shapes of `vllm serve` case 9 on the H100 (issue 28, item 1): the split-KV path
at ~1500-4000 keys of context over vLLM's paged cache, Triton (TRITON_INTERPRET=1) vs the float32
reference.

The serve's target (the tiny multimodal Qwen3.5: one full-attention layer, 4 query heads, 2 KV heads of
size 64, bf16) with DDTree (budget 16 -> N = 17 slots, top_k 4, L 7) gets KV blocks of 176 tokens on
vLLM 0.26: for a hybrid the attention page is sized to hold the GDN page, here the conv state
(512 x (3 + 16 spec slots) bf16) plus the SSM state (4 x 64 x 64 float32) = 84992 bytes, over
512 bytes per token (K and V, 2 heads x 64, bf16) in multiples of 16 tokens: 16 x ceil(84992 / 8192)
= 176 (turn 2's 1232 cached tokens = 7 blocks). Its block table is ceil(4096 / 176) = 24 pages wide
(max_model_len 4096), so the H100's plan (the sm_90 table for head size 64: 64-row and 64-key tiles,
min_chunk 128, 132 SMs) gives a bucket of one request 32 splits; a ~1585-key request uses 13 of them
(128-key chunks, neither page- nor tile-aligned: tiles straddle the 176-key pages), and the last one
holds the tree. These cases run exactly that plan (tiles and split count passed in, as the H100 would
choose them) and a bucket of 3 requests (22 splits), with DDTree-shaped trees (a 7-node spine and
siblings), a FULL-graph padding row (a chain over no context), trees across a page boundary, a last
split holding only tree keys, and 4000 keys (all 32 splits busy).

Tolerances: bf16 rounds P and the output to 8 significant bits (unit roundoff 2^-8 = 3.9e-3); a correct
kernel measured 5e-3 to 7e-3 per (token, head) row here, so rows must stay under 2e-2 (the other tree
attention tests' bf16 tolerance). fp16 (unit roundoff 2^-11 = 4.9e-4) is the sensitive variant: rows
under 4e-3. `test_mutations_are_caught` shows on the float32 dense oracle that one key lost or gained
(at a split boundary, at a page boundary, a tree parent, a sibling) moves some row well past the fp16
tolerance, so these cases can fail for the bugs the split path could have.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from _interp import run_interpreted

from ddtree_compile.core.tree import ancestor_closure, pack_bits

BS, HEADS, D, N = 176, (4, 2), 64, 17  # the serve's block size, (Hq, Hkv), head size, budget 16 + 1
MAX_MODEL_LEN, SMS = 4096, 132  # block-table width; the H100's SM count (tuning.num_splits)
TOL = {"bfloat16": 2e-2, "float16": 4e-3}
# name -> (dtype, contexts, seed). Contexts: 1579 puts the tree across the page boundary at 1584;
# 1536 = 12 x 128 fills whole chunks, so the last split holds only the 17 tree keys; 0 = a FULL-graph
# padding row (a chain over no context). A bucket of 3 requests gets 22 splits (the combine masks 10 of
# its 32 partial slots); 2047 keys use 17 of them.
CASES = {
    "serve_r1_bf16": ("bfloat16", (1579,), 0),
    "serve_r1_fp16": ("float16", (1579,), 1),
    "serve_r3_bf16": ("bfloat16", (1536, 2047, 0), 2),
    "serve_r1_4k_fp16": ("float16", (4000,), 3),
}


def ddtree_parents(n_live: int, g: torch.Generator, spine: int = 7, top_k: int = 4) -> list[int]:
    """A DDTree-shaped tree: the drafter's top-1 chain of `spine` nodes, the other nodes hung off nodes
    of depth < spine, at most top_k children each; slots past n_live are padding (-1)."""
    par, depth, kids = [-1] * N, [0] * N, [0] * N
    for i in range(1, n_live + 1):
        if i <= spine:
            p = i - 1
        else:
            cands = [j for j in range(i) if depth[j] < spine and kids[j] < top_k]
            p = cands[int(torch.randint(0, len(cands), (), generator=g))]
        par[i], depth[i] = p, depth[p] + 1
        kids[p] += 1
    return par


def make_case(dtype: str, ctxs, seed: int) -> dict:
    """Random paged K/V in a block table as wide as vLLM's (max_model_len / block size), block ids
    shuffled; unwritten cache slots are NaN (a read of one poisons the output)."""
    g = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)
    Hq, Hkv = HEADS
    R = len(ctxs)
    live = [N - 1] * R
    if R > 1:
        live[1] = N - 4  # a tree with padding slots
    parents = torch.tensor([list(range(-1, N - 1)) if x == 0 else ddtree_parents(live[r], g)
                            for r, x in enumerate(ctxs)])
    anc = ancestor_closure(parents, N)
    width = -(-MAX_MODEL_LEN // BS)
    num_blocks = R * width + 3
    bt = torch.randperm(num_blocks, generator=g)[: R * width].view(R, width).int()
    kc = torch.full((num_blocks, BS, Hkv, D), float("nan"), dtype=dt)
    vc = torch.full((num_blocks, BS, Hkv, D), float("nan"), dtype=dt)
    for r, x in enumerate(ctxs):
        pos = torch.arange(x + N)
        blk, slot = bt[r].long()[pos // BS], pos % BS
        kc[blk, slot] = torch.randn(x + N, Hkv, D, generator=g).to(dt)
        vc[blk, slot] = torch.randn(x + N, Hkv, D, generator=g).to(dt)
    return dict(query=torch.randn(R * N, Hq, D, generator=g).to(dt), key_cache=kc, value_cache=vc, block_table=bt,
                context_lens=torch.tensor(ctxs, dtype=torch.int32), ancestor_bits=pack_bits(anc),
                depths=(anc.sum(-1) - 1).clamp(min=0), anc=anc, scale=1.0 / math.sqrt(D))


def h100_plan(t: dict):
    """(tiles, split count) the H100 would use for this bucket: the sm_90 table, 132 SMs, the keys the
    block table can hold (tuning.plan_tree_attention on a CUDA device)."""
    from ddtree_compile.templates import tuning

    R = t["block_table"].shape[0]
    max_keys = t["block_table"].shape[1] * BS
    p = tuning.choose_plan("sm_90", SMS, R, N, HEADS[0] // HEADS[1], HEADS[1], D, max_keys)
    return p.tiles, p.splits


def device_chunks(ctx: int, splits: int, tiles) -> tuple[int, int]:
    """(chunk, splits holding keys) as the kernel derives them on the device for one request."""
    min_chunk = max(tiles.block_n, tiles.min_chunk // tiles.block_n * tiles.block_n)
    total = ctx + N
    chunk = max(-(-(-(-total // splits)) // tiles.block_n) * tiles.block_n, min_chunk)
    return chunk, -(-total // chunk)


def run_ref(t: dict) -> torch.Tensor:
    from ddtree_compile.templates.tree_attention_ref import tree_attention_reference

    out = torch.full(t["query"].shape, float("nan"))
    tree_attention_reference(t["query"].float(), t["key_cache"].float(), t["value_cache"].float(), t["block_table"],
                             t["context_lens"], t["ancestor_bits"], t["depths"], out, t["scale"], 0, 0.0)
    return out


def dense(t: dict, r: int, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Request r in float32 from a dense boolean mask [N, ctx+N] (default: the tree's own): the oracle
    whose mask the mutation test edits. Padding rows: zeros."""
    x = int(t["context_lens"][r])
    Hq, Hkv = HEADS
    pos = torch.arange(x + N)
    blk = t["block_table"][r].long()[pos // BS]
    k = t["key_cache"][blk, pos % BS].float().transpose(0, 1).repeat_interleave(Hq // Hkv, 0)
    v = t["value_cache"][blk, pos % BS].float().transpose(0, 1).repeat_interleave(Hq // Hkv, 0)
    q = t["query"][r * N:(r + 1) * N].float().transpose(0, 1)
    anc = t["anc"][r]
    if mask is None:
        mask = torch.cat([anc.diagonal()[:, None].expand(N, x), anc], 1)
    s = (q @ k.transpose(1, 2) * t["scale"]).masked_fill(~mask, float("-inf"))
    o = torch.softmax(s, -1).nan_to_num(0.0) @ v
    return o.transpose(0, 1)  # [N, Hq, D]


def row_rel(a: torch.Tensor, b: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """Per (token, head) relative error over live rows."""
    return ((a.float() - b.float()).norm(dim=-1) / b.float().norm(dim=-1).clamp(min=1e-6))[live]


# ------------------------------------------------------------------ interpreter subprocess


def _interp_main() -> None:
    import triton
    from triton.runtime.interpreter import InterpretedFunction

    from ddtree_compile.templates import tree_attention as ta

    results = {}
    for name, (dtype, ctxs, seed) in CASES.items():
        t = make_case(dtype, ctxs, seed)
        tiles, splits = h100_plan(t)
        live = t["anc"].diagonal(dim1=1, dim2=2).reshape(-1)
        ref = run_ref(t)
        R = len(ctxs)
        need = ta._partial_sizes(splits, R * N, HEADS[0], D)[1]
        scratch = torch.full((need,), float("nan"))  # poisoned partials: an unwritten one that is read fails
        out = torch.full(t["query"].shape, float("nan"), dtype=t["query"].dtype)  # poisoned output
        args = (t["query"], t["key_cache"], t["value_cache"], t["block_table"], t["context_lens"],
                t["ancestor_bits"], t["depths"])
        ta.launch_tree_attention(*args, out, t["scale"], 0, 0.0, scratch, tiles=tiles, splits=splits)
        rel = row_rel(out, ref, live)
        res = dict(
            interpreted=bool(triton.knobs.runtime.interpret) and isinstance(ta._tree_attn_fwd_kernel,
                                                                           InterpretedFunction),
            splits=splits, tiles=[tiles.block_m, tiles.block_n, tiles.min_chunk, tiles.page_group],
            chunks=[device_chunks(x, splits, tiles) for x in ctxs],
            nan=bool(out.isnan().any()), row_rel_max=float(rel.nan_to_num(float("inf")).max()),
            row_rel_mean=float(rel.mean()), padding_zero=bool((out[~live] == 0).all()),
            num_padding_rows=int((~live).sum()), scratch_written=bool(scratch.isfinite().any()))
        if name == "serve_r1_bf16":  # the one-split (direct) path on the same data: the split path's peer
            direct = torch.full_like(out, float("nan"))
            ta.launch_tree_attention(*args, direct, t["scale"], 0, 0.0, tiles=tiles, splits=1)
            res["direct_row_rel_max"] = float(row_rel(direct, ref, live).nan_to_num(float("inf")).max())
        results[name] = res
    print(json.dumps(results))


@pytest.fixture(scope="module")
def interp_results() -> dict:
    return run_interpreted(__file__, timeout=600)


@pytest.mark.parametrize("name", list(CASES))
def test_long_context_split_kv_matches_reference(interp_results, name):
    res = interp_results[name]
    dtype, ctxs, _ = CASES[name]
    assert res["interpreted"], "the Triton kernel did not run under the interpreter"
    # the plan the H100 makes for the serve's buckets: sm_90 tiles for head size 64, 32 / 22 splits
    assert res["tiles"] == [64, 64, 128, 0] and res["splits"] == {1: 32, 3: 22}[len(ctxs)], res
    assert max(n for _, n in res["chunks"]) >= 13, res["chunks"]  # many splits hold keys, then merge
    assert res["scratch_written"]
    assert not res["nan"], f"{name}: NaN in the output (an unwritten row, a NaN cache slot or partial read)"
    assert res["row_rel_max"] < TOL[dtype], f"{name}: row relative error {res['row_rel_max']:.3g}"
    assert res["padding_zero"]
    if "direct_row_rel_max" in res:
        assert res["direct_row_rel_max"] < TOL[dtype], res


def test_cases_cover_the_serve_shapes():
    """The cases hit what the brief asks for, by construction: trees with siblings, a tree across a page
    boundary, chunk boundaries off the pages and tiles, a last split of tree keys only, padding rows."""
    from ddtree_compile.templates import tuning

    tiles = tuning.attention_tiles("sm_90", D)
    seen = set()
    for dtype, ctxs, seed in CASES.values():
        t = make_case(dtype, ctxs, seed)
        _, splits = h100_plan(t)
        for r, x in enumerate(ctxs):
            anc = t["anc"][r]
            depth = anc.sum(-1) - 1
            if x and int(depth.max()) < int((depth > 0).sum()):  # fewer levels than nodes
                seen.add("siblings")
            if x // BS != (x + N - 1) // BS:
                seen.add("tree_across_pages")
            chunk, used = device_chunks(x, splits, tiles)
            if x and x % chunk == 0:
                seen.add("tree_only_last_split")
            if x and chunk % BS and chunk % tiles.block_n == 0 and used > 1:
                seen.add("chunks_off_pages")
            if used == splits:
                seen.add("every_split_used")
            if x == 0 or not bool(anc.diagonal().all()):
                seen.add("padding")
    assert seen == {"siblings", "tree_across_pages", "tree_only_last_split", "chunks_off_pages",
                    "every_split_used", "padding"}, seen


def test_reference_matches_dense_oracle():
    t = make_case("float16", (1579, 0), 5)
    ref = run_ref(t)
    dense_all = torch.cat([dense(t, r) for r in range(2)])
    torch.testing.assert_close(ref, dense_all, atol=1e-5, rtol=1e-5)


def test_mutations_are_caught():
    """One key lost or gained moves some live row of the float32 oracle well past the fp16 tolerance
    (and a lost 64-key tile past the bf16 one): the kernel comparisons above would see those bugs."""
    from ddtree_compile.templates import tuning

    dtype, ctxs, seed = CASES["serve_r1_fp16"]
    t = make_case(dtype, ctxs, seed)
    x = ctxs[0]
    tiles = tuning.attention_tiles("sm_90", D)
    chunk, _ = device_chunks(x, h100_plan(t)[1], tiles)
    anc = t["anc"][0]
    live = anc.diagonal()[:, None].expand(N, HEADS[0])
    base = dense(t, 0)
    full = torch.cat([anc.diagonal()[:, None].expand(N, x), anc], 1)
    deepest = int((anc.sum(-1)).argmax())
    parent = int(anc[deepest].nonzero().flatten()[-2])  # the deepest node's parent (ancestors ascend)
    sib = next(j for j in range(1, N) if not anc[deepest, j] and not anc[j, deepest])
    muts = {"drop_key_before_split_boundary": (slice(None), chunk - 1, False),
            "drop_key_at_split_boundary": (slice(None), 5 * chunk, False),
            "drop_key_at_page_boundary": (slice(None), BS * 5, False),
            "drop_last_context_key": (slice(None), x - 1, False),
            "drop_parent": (deepest, x + parent, False), "see_sibling": (deepest, x + sib, True)}
    moved = {}
    for name, (rows, col, value) in muts.items():
        m = full.clone()
        assert bool(m[deepest, col]) != value  # a real change for the deepest row at least
        m[rows, col] = value
        moved[name] = float(row_rel(dense(t, 0, m), base, live).max())
    m = full.clone()
    m[:, 3 * tiles.block_n: 4 * tiles.block_n] = False
    moved["drop_one_tile"] = float(row_rel(dense(t, 0, m), base, live).max())
    for name, v in moved.items():
        floor = TOL["bfloat16"] if name == "drop_one_tile" else TOL["float16"]
        assert v > 2 * floor, (name, v, moved)


if __name__ == "__main__":
    _interp_main()
