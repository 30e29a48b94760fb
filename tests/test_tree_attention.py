"""Tree attention: Triton kernel (TRITON_INTERPRET=1) vs the torch reference vs dense SDPA oracles.

The interpreter needs TRITON_INTERPRET=1 before triton is first imported, and another test module may
already have imported triton in this process, so the Triton cases run in one subprocess (this file run
as a script) and the parametrized tests below check its per-case results. The cases live in
_tree_attention_cases.py; the launch plan and the registered op: test_tree_attention_op.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from _interp import run_interpreted
from _tree_attention_cases import BASE, CASES, RERUN, dense_oracle, make_case, run_ref, tolerance

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
            close=bool(torch.allclose(tri, ref, **tolerance(c["dtype"]))),
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
    assert res["row_rel"] < tolerance(case["dtype"])["rtol"], f"{name}: row relative error {res['row_rel']}"
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


# ------------------------------------------------------------------ reference vs dense oracles (in process)


@pytest.mark.parametrize("name", list(CASES))
def test_reference_matches_dense_sdpa(name):
    c = CASES[name]
    t = make_case(c)
    ref = run_ref(t)
    torch.testing.assert_close(ref, dense_oracle(t), atol=1e-4, rtol=1e-4)
    # the op-dtype path (FP8 entries and scales as given) rounds once, at the end
    low = run_ref(t, op_dtype=True)
    torch.testing.assert_close(low.float(), ref, **tolerance(c["dtype"]))


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


if __name__ == "__main__":
    _interp_main()
