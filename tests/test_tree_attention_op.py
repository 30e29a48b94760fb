"""Tree attention's launch plan per bucket (host only) and the registered op: dispatch, fake tensors,
torch.compile, and inputs that fail naming the field (FP8 scales included). Cases: _tree_attention_cases.py."""

from __future__ import annotations

import pytest
import torch
from _tree_attention_cases import BASE, CASES, make_case, run_ref

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


def test_a_smaller_bucket_can_need_more_scratch(monkeypatch):
    """Why an engine's scratch is planned for every slot count it verifies (round/workspace.py
    `verify_slots`), not only the largest bucket's: fewer query rows split the keys more. On an H100
    (132 SMs) at the 4B shape, 4 trees of 17 slots need more partials than 4 trees of 33; sized for 33
    alone, budget "auto" 8/16/32 at max_num_seqs 4 failed check_scratch at its FULL-graph capture."""
    from ddtree_compile.integration import config
    from ddtree_compile.integration.round import workspace
    from ddtree_compile.templates import tree_attention as ta
    from ddtree_compile.templates import tuning

    monkeypatch.setattr(tuning, "arch_of", lambda device: ("sm_90", 132))
    elems = {n: ta.bucket_scratch_elems("cuda", 4, n, 16, 4, 256) for n in (9, 16, 17, 33)}
    assert elems[17] > elems[33] > 0 and elems[33] == 2171136 and elems[17] == 2236928
    # the engine's scratch at max_num_seqs 4 over that menu's verifies (8/16/32 and the chain of 15)
    slots = workspace.verify_slots(config.parse({"ddtree": {"budget": "auto", "auto_budget": [8, 16, 32]}}), 15)
    assert slots == (9, 16, 17, 33)
    every = {(r, n): ta.bucket_scratch_elems("cuda", r, n, 16, 4, 256) for r in range(1, 5) for n in slots}
    largest_only = max(v for (_, n), v in every.items() if n == 33)  # what it was sized for before
    assert workspace.scratch_elems("cuda", 4, slots, {(16, 4, 256)}) == max(every.values()) > largest_only


def test_plan_other_arches_use_their_table():
    from ddtree_compile.templates import tuning

    assert tuning.choose_plan("sm_121", 48, 1, 23, 6, 4, 256).tiles == tuning.attention_tiles("sm_121", 256)
    assert tuning.attention_tiles("sm_80", 128) == tuning.attention_tiles("default", 128)


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
