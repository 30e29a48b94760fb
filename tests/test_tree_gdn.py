"""Tree gated delta rule: metadata, Triton (interpreter) vs reference, per-path and chain oracles."""

import pytest
import torch
from _gdn_common import KINDS, ChainOracle, poison, random_parents, root_path  # sets TRITON_INTERPRET

from ddtree_compile.templates.gdn_meta import F_PAD, F_RELOAD, F_SAVE, build_gdn_meta, validate_tree
from ddtree_compile.templates.tree_gdn import tree_gdn_triton
from ddtree_compile.templates.tree_gdn_ref import tree_gdn_ref


def make_case(N, H, HV, K, V, kinds, seed, dtype=torch.float32, state_dtype=torch.float32, kv_major=False,
              single_line=False):
    gen = torch.Generator().manual_seed(seed)
    R = len(kinds)
    parents = torch.tensor([random_parents(k, N, N if i % 2 == 0 else max(1, N - 4), gen)
                            for i, k in enumerate(kinds)])
    T = R * N
    qkv = torch.randn(T, 2 * H * K + HV * V, generator=gen).to(dtype)
    a = torch.randn(T, HV, generator=gen).to(dtype)
    b = torch.randn(T, HV, generator=gen).to(dtype)
    A_log = torch.randn(HV, generator=gen) * 0.5
    dt_bias = torch.randn(HV, generator=gen) * 0.5
    lines = R * N + 3
    if kv_major:  # CPU vLLM stores each head's state as [K, V]: the logical view is a transpose
        ssm = torch.randn(lines, HV, K, V, generator=gen).to(state_dtype).transpose(-1, -2)
    else:
        ssm = torch.randn(lines, HV, V, K, generator=gen).to(state_dtype)
    si = (1 + torch.arange(T, dtype=torch.int32)).view(R, N)
    si[-1] = 0  # padded request on the null block
    if single_line:
        si = si[:, :1].contiguous()
    na = torch.randint(1, N + 1, (R,), generator=gen, dtype=torch.int32)
    return parents, qkv, a, b, A_log, dt_bias, ssm, si, na


def run(fn, case, meta, H, K, write_snapshots, records, stack_rows=None, stacks=None):
    parents, qkv, a, b, A_log, dt_bias, ssm, si, na = case
    R, N = parents.shape
    HV, V = ssm.shape[1], ssm.shape[2]
    ssm = ssm.clone()
    out = poison(torch.empty(R * N, HV, V, dtype=qkv.dtype))
    stack = poison(torch.empty(stack_rows or R, max(meta.max_depth, 1), HV, V, K))
    if stacks is not None:
        stacks.append(stack)
    rec_kv = poison(torch.empty(R, N, H * K + HV * V, dtype=qkv.dtype)) if records else None
    rec_gb = poison(torch.empty(R, N, 2, HV)) if records else None
    fn(qkv, a, b, A_log, dt_bias, ssm, si, na, meta.walk, stack, out, rec_kv, rec_gb, H, K, K ** -0.5,
       write_snapshots)
    return out, ssm, rec_kv, rec_gb


def check_oracle(case, out, H, K, tol):
    """Every live node's output equals the plain recurrence along its root path alone."""
    parents, qkv, a, b, A_log, dt_bias, ssm, si, na = case
    R, N = parents.shape
    orc = ChainOracle(None, None, A_log, dt_bias, H, K)
    for r in range(R):
        col = int(na[r]) - 1 if si.shape[1] > 1 else 0
        line = int(si[r, col])
        S0 = ssm[line].double() if line > 0 else torch.zeros(ssm.shape[1:], dtype=torch.float64)
        p = parents[r].tolist()
        for s in range(N):
            if s and p[s] < 0:
                assert (out[r * N + s] == 0).all(), "padding outputs must be zero"
                continue
            S = S0
            for t in root_path(p, s):
                o, S = orc.rec(S, qkv[r * N + t], a[r * N + t], b[r * N + t])
            torch.testing.assert_close(out[r * N + s].double(), o, rtol=tol, atol=tol)


def test_walk_is_preorder_with_flags():
    gen = torch.Generator().manual_seed(0)
    N = 14
    parents = torch.tensor([random_parents(k, N, N - 2 * (i % 2), gen) for i, k in enumerate(KINDS)])
    meta = build_gdn_meta(parents, 4)
    for r, p in enumerate(parents.tolist()):
        kids = {i: [j for j in range(N) if p[j] == i] for i in range(N)}
        order, stack = [], [0]
        while stack:  # reference DFS preorder, children in slot order
            s = stack.pop()
            order.append(s)
            stack.extend(reversed(kids[s]))
        pads = [i for i in range(1, N) if p[i] < 0]
        walk = meta.walk[r].tolist()
        assert [w[0] for w in walk] == order + pads
        for k, (s, par, d, f) in enumerate(walk):
            assert par == p[s] and d == len(root_path(p, s)) - 1 if s not in pads else f == F_PAD
            if s not in pads:
                assert bool(f & F_SAVE) == (len(kids[s]) >= 2)
                assert bool(f & F_RELOAD) == (par >= 0 and par != walk[k - 1][0])


@pytest.mark.parametrize("strategy", ["snapshots", "records"])
def test_triton_matches_reference_fp32(strategy):
    H, HV, K, V = 2, 4, 16, 16
    case = make_case(9, H, HV, K, V, ("bushy", "deep", "star", "random", "chain"), seed=3)
    meta = build_gdn_meta(case[0], 4)
    snap, rec = strategy == "snapshots", strategy == "records"
    ref = run(tree_gdn_ref, case, meta, H, K, snap, rec)
    tri = run(lambda *a: tree_gdn_triton(*a, block_v=8), case, meta, H, K, snap, rec)
    assert not tri[0].isnan().any()
    torch.testing.assert_close(tri[0], ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tri[1], ref[1], rtol=1e-5, atol=1e-5)  # snapshot lines; others untouched
    if rec:
        torch.testing.assert_close(tri[2], ref[2], rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(tri[3], ref[3], rtol=1e-6, atol=1e-6, equal_nan=True)
    else:
        torch.testing.assert_close(ref[1][0], case[6][0], rtol=0, atol=0)  # line 0 never written
    check_oracle(case, tri[0], H, K, 1e-4)


@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_snapshots_on_lines_for_more_drafts(impl):
    """vLLM gives each request 1 + K state lines (K = num_speculative_tokens); a smaller tree bucket, or a
    chain of fewer drafts, has N < 1 + K slots: the committed state may sit past column N (the last
    step committed more), snapshots go to the first N lines, the others stay as they were."""
    H, HV, K, V, N, extra = 2, 4, 16, 16, 7, 4
    case = list(make_case(N, H, HV, K, V, ("bushy", "deep", "chain"), seed=9))
    parents, si = case[0], case[7]
    R = parents.shape[0]
    more = (1000 + torch.arange(R * extra, dtype=torch.int32)).view(R, extra)
    si_long = torch.cat([si, torch.where(si[:, :1] > 0, more, 0)], 1)
    ssm = case[6]
    case[6] = torch.cat([ssm, torch.randn(1000 + R * extra - ssm.shape[0], *ssm.shape[1:])])
    case[7] = si_long
    case[8] = torch.tensor([N + extra, 2, N + 1], dtype=torch.int32)  # committed at columns N+3, 1, N
    meta = build_gdn_meta(parents, 4)
    fn = tree_gdn_ref if impl == "ref" else (lambda *a: tree_gdn_triton(*a, block_v=8))
    out, ssm_after, _, _ = run(fn, tuple(case), meta, H, K, True, False)
    check_oracle(tuple(case), out, H, K, 1e-4)
    untouched = si_long[:, N:][si_long[:, N:] > 0].long()
    torch.testing.assert_close(ssm_after[untouched], case[6][untouched], rtol=0, atol=0)
    live = (parents >= 0) | (torch.arange(N) == 0)
    written = si_long[:, :N][(si_long[:, :N] > 0) & live].long()
    assert not torch.equal(ssm_after[written], case[6][written])


def test_triton_bf16_kv_major_single_line():
    """bf16 inputs and state in CPU vLLM's [K, V] layout; records with one state line per request."""
    H, HV, K, V = 1, 2, 16, 8
    case = make_case(7, H, HV, K, V, ("deep", "bushy", "chain"), seed=4, dtype=torch.bfloat16,
                     state_dtype=torch.bfloat16, kv_major=True, single_line=True)
    meta = build_gdn_meta(case[0], 4)
    ref = run(tree_gdn_ref, case, meta, H, K, False, True)
    tri = run(tree_gdn_triton, case, meta, H, K, False, True)
    torch.testing.assert_close(tri[0].float(), ref[0].float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(tri[2], ref[2], rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(tri[1], case[6], rtol=0, atol=0)  # records strategy: no state writes
    check_oracle(case, ref[0], H, K, 2e-2)


@pytest.mark.parametrize("seed", range(3))
def test_reference_per_path_oracle(seed):
    H, HV, K, V = 2, 6, 8, 4
    case = make_case(12, H, HV, K, V, KINDS, seed=10 + seed)
    meta = build_gdn_meta(case[0], 2)
    out, ssm, _, _ = run(tree_gdn_ref, case, meta, H, K, True, False)
    check_oracle(case, out, H, K, 1e-5)


@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_chain_tree_equals_chain_recurrence(impl):
    """A chain-shaped tree is vLLM's chain spec step: token t's output and its state in slot t."""
    H, HV, K, V, N = 1, 2, 16, 8, 6
    case = make_case(N, H, HV, K, V, ("chain", "chain"), seed=7)
    parents, qkv, a, b, A_log, dt_bias, ssm0, si, na = case
    meta = build_gdn_meta(parents, 4)
    fn = tree_gdn_ref if impl == "ref" else tree_gdn_triton
    out, ssm, _, _ = run(fn, case, meta, H, K, True, False)
    orc = ChainOracle(None, None, A_log, dt_bias, H, K)
    r = 0  # request 0 (request 1 sits on the null block)
    S = ssm0[int(si[r, int(na[r]) - 1])].double()
    for t in range(N):
        o, S = orc.rec(S, qkv[t], a[t], b[t])
        torch.testing.assert_close(out[t].double(), o, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ssm[int(si[r, t])].double(), S, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("parents, msg", [
    ([[0, 0, 1]], "root"),
    ([[-1, 1, 0]], ">= itself"),
    ([[-1, 0, 7]], "allowed"),
    ([[-1, 0, -3]], "allowed"),
    ([[-1, -1, 1]], "padding"),
    ([[-1, 0, 1, 2]], "max_depth"),
])
def test_bad_metadata_rejected(parents, msg):
    with pytest.raises(ValueError, match=msg):
        validate_tree(torch.tensor(parents), max_depth=2)


def test_bad_arguments_rejected():
    H, HV, K, V = 1, 2, 8, 8
    case = make_case(5, H, HV, K, V, ("chain",), seed=0)
    meta = build_gdn_meta(case[0], 4)
    with pytest.raises(ValueError, match="snapshots need one state line per slot"):
        parents, qkv, a, b, A_log, dt_bias, ssm, si, na = case
        run(tree_gdn_ref, (parents, qkv, a, b, A_log, dt_bias, ssm, si[:, :1].contiguous(), na), meta, H, K,
            True, False)
    with pytest.raises(ValueError, match="multiple of num_k_heads"):
        run(tree_gdn_triton, case, meta, 3, K, False, False)


def test_budget_128_triton():
    """B = 128 (N = 129): preorder walk over a deep/bushy tree, Triton vs the per-path oracle."""
    H, HV, K, V = 1, 1, 8, 8
    case = make_case(129, H, HV, K, V, ("random",), seed=12)
    meta = build_gdn_meta(case[0], 4)
    out, _, _, _ = run(tree_gdn_triton, case, meta, H, K, False, False)
    check_oracle(case, out, H, K, 1e-4)


def test_gdn_plan_rows_pick_by_request_count(monkeypatch):
    """tuning.gdn_tiles: the first row whose request bound holds, of DDTREE_GDN_TILES if set (one tile, or a
    plan such as FAST_PLAN), else of the arch's plan (sm_90: FAST_PLAN),
    else vLLM's tile; every committed row is a tile the kernel takes, bounds rising to a last row for any
    count (so no batch falls through to another tile by accident)."""
    from ddtree_compile.templates import tuning

    T = tuning.GdnTiles
    for arch, rows in tuning._GDN_PLANS.items():
        bounds = [most for most, _ in rows]
        assert bounds[-1] is None and bounds[:-1] == sorted(bounds[:-1]), (arch, rows)
        assert all(t.block_v in (8, 16, 32, 64, 128) and t.num_warps in (1, 2, 4, 8) and 1 <= t.splits <= 8
                   for _, t in rows), (arch, rows)
    monkeypatch.delenv("DDTREE_GDN_TILES", raising=False)
    assert [tuning.gdn_tiles("sm_90", r) for r in (1, 2, 3, 64)] == [T(16, 1, 4), T(16, 1, 2), T(16, 1), T(16, 1)]
    assert tuning.gdn_tiles("sm_121", 1) == tuning.gdn_tiles("default", 1) == T(32, 4)
    monkeypatch.setenv("DDTREE_GDN_TILES", tuning.FAST_PLAN)
    picked = [tuning.gdn_tiles(arch, r) for arch in ("sm_90", "default") for r in (1, 2, 3, 64)]
    assert picked == [T(16, 1, 4), T(16, 1, 2), T(16, 1), T(16, 1)] * 2
    monkeypatch.setenv("DDTREE_GDN_TILES", "8x4")
    assert tuning.gdn_tiles("sm_90", 1) == T(8, 4)


def test_tile_override_runs_the_tile_it_names(monkeypatch):
    """DDTREE_GDN_TILES picks the launcher's tile where none is passed (how test_layer_diff and the benchmarks
    check a faster one); the tile changes the grid (V = 32: one program of 32 rows or two of 16), not the result.
    A malformed value names the variable and the allowed form."""
    from ddtree_compile.templates import tuning

    H, HV, K, V = 2, 4, 16, 32
    case = make_case(9, H, HV, K, V, ("bushy", "deep", "chain"), seed=5)
    meta = build_gdn_meta(case[0], 4)
    ref = run(tree_gdn_ref, case, meta, H, K, False, True)
    for value, want in (("", tuning.GdnTiles(32, 4)), ("16x1", tuning.GdnTiles(16, 1))):
        monkeypatch.setenv("DDTREE_GDN_TILES", value)
        assert tuning.gdn_tiles() == want
        tri = run(tree_gdn_triton, case, meta, H, K, False, True)
        torch.testing.assert_close(tri[0], ref[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(tri[3], ref[3], rtol=1e-6, atol=1e-6, equal_nan=True)
    monkeypatch.setenv("DDTREE_GDN_TILES", "32x4x2")
    assert tuning.gdn_tiles() == tuning.GdnTiles(32, 4, 2)
    for bad in ("16", "16x3", "32x4x0", "axb", "1:16x1", "16x1,32x4", "2:16x1,1:16x2,32x4", "a:16x1,32x4"):
        monkeypatch.setenv("DDTREE_GDN_TILES", bad)
        want = rf"DDTREE_GDN_TILES='{bad}': expected '<block_v>x<num_warps>\[x<splits>\]'"
        with pytest.raises(ValueError, match=want):
            tuning.gdn_tiles()


@pytest.mark.parametrize("splits", [2, 3, 5])
def test_split_walk_is_the_whole_walk_bit_for_bit(splits):
    """A request's walk in `splits` parts (each replays its first node's ancestors, then walks its part with
    its own depth stack) gives the one-part kernel's outputs, states and records exactly: the same updates in
    the same order. Parts start inside branches, at backtracks and on padding; a stack of R rows allows one
    part only, so the one-part run is also the capped split. Records (the default commit): snapshots take
    one part (tree_gdn_triton says why)."""
    H, HV, K, V, N = 2, 4, 16, 16, 13
    case = make_case(N, H, HV, K, V, ("bushy", "deep", "star", "random", "chain"), seed=11)
    meta = build_gdn_meta(case[0], 4)
    R = case[0].shape[0]
    snap, rec = False, True
    whole = run(lambda *a: tree_gdn_triton(*a, block_v=8, splits=splits), case, meta, H, K, snap, rec)
    stacks = []
    parts = run(lambda *a: tree_gdn_triton(*a, block_v=8, splits=splits), case, meta, H, K, snap, rec,
                stack_rows=R * splits, stacks=stacks)
    assert not stacks[0].view(R, splits, -1)[:, 1:].isnan().all()  # later parts saved branch points: they ran
    later = meta.walk[:, -(-N // splits)::-(-N // splits), 3]  # the flags at the first position of parts 2..
    assert (later & F_RELOAD).any() and ((later & F_PAD) == 0).any()  # at a backtrack; on a live node
    assert (later & F_PAD).any() or splits == 2  # on padding
    for got, want in zip(parts, whole):
        if want is not None:
            assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))
    ref = run(tree_gdn_ref, case, meta, H, K, snap, rec)
    torch.testing.assert_close(parts[0], ref[0], rtol=1e-5, atol=1e-5)


def _at_most_deep(n: int, depth: int, gen) -> list[int]:
    """Parents of a tree of n slots at most `depth` deep, every node's parent drawn among the shallower
    ones, with two children at depth `depth` under one node (a branch point at depth - 1, the deepest)."""
    p, d = [-1] + [0] * (n - 1), [0] * n
    for i in range(1, n):
        if i <= depth:  # the spine first: slot i at depth i
            p[i] = i - 1
        elif i == depth + 1:  # a sibling of the deepest spine node
            p[i] = depth - 1
        else:
            shallower = [j for j in range(i) if d[j] < depth]
            p[i] = shallower[int(torch.randint(0, len(shallower), (1,), generator=gen))]
        d[i] = d[p[i]] + 1
    return p


@pytest.mark.parametrize("splits", [1, 2])
def test_depth_stack_of_L_levels_serves_trees_at_most_L_deep(splits):
    """The round's workspace gives the walk min(B, L) stack levels (round/workspace.py, GdnVerify.levels):
    the kernel saves a state only at a node of two or more live children, so trees at most L deep save
    above level L, and a chain (a chain row, the padded rows' contents: B deep) saves nothing. Each row's
    stack is L levels wide inside a poisoned buffer one level wider: outputs, states and records match the
    reference, and no program wrote that extra level."""
    H, HV, K, V, N, L = 2, 4, 16, 16, 13, 4
    gen = torch.Generator().manual_seed(5)
    case = list(make_case(N, H, HV, K, V, ("random",) * 4, seed=12))
    case[0] = torch.tensor([_at_most_deep(N, L, gen), _at_most_deep(N, L, gen), _at_most_deep(N, L, gen),
                            list(range(-1, N - 1))])  # (the last: a chain of N - 1 > L)
    meta = build_gdn_meta(case[0], 4)
    walk_depth, flags = meta.walk[..., 2], meta.walk[..., 3]
    assert meta.max_depth == N - 1 and walk_depth.max() == N - 1
    assert walk_depth[(flags & F_SAVE) != 0].max() == L - 1  # the deepest branch point
    R = case[0].shape[0]
    wide = poison(torch.empty(R * splits, L + 1, HV, V, K))
    kernel = lambda *a: tree_gdn_triton(*a[:9], wide[:, :L], *a[10:], block_v=8, splits=splits)
    got = run(kernel, tuple(case), meta, H, K, False, True)
    want = run(tree_gdn_ref, tuple(case), meta, H, K, False, True)
    assert wide[:, L].isnan().all()  # the level past L: never written
    assert not wide[:, :L].isnan().all()  # saves went to the L levels
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[2], want[2], rtol=0, atol=0, equal_nan=True)
    check_oracle(tuple(case), got[0], H, K, 1e-4)


def test_norm_prepass_matches_its_reference():
    """The q / k norm pre-pass (tree_gdn.qk_norms_triton, vLLM's expression on vLLM's 4 warps) against its
    torch reference, bf16 rows of two key heads of K = 24 (a masked tail past 24 of the 32-lane block)."""
    from ddtree_compile.templates.tree_gdn import qk_norms_triton
    from ddtree_compile.templates.tree_gdn_ref import qk_norms_ref

    H, HV, K, V = 2, 4, 24, 16
    qkv = (torch.randn(11, 2 * H * K + HV * V, generator=torch.Generator().manual_seed(2)) * 3).to(torch.bfloat16)
    norms = poison(torch.empty(11, 2, H))
    assert qk_norms_triton(qkv, H, K, norms) is norms
    torch.testing.assert_close(norms, qk_norms_ref(qkv, H, K), rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match=r"norms must be contiguous float32 \[rows, 2, H\] = \[11, 2, 2\]"):
        qk_norms_triton(qkv, H, K, torch.empty(11, 2, H + 1))


@pytest.mark.parametrize("splits", [1, 3])
def test_tile_off_vllm_warps_reads_the_prepass_norms(splits):
    """A tile on a warp count other than vLLM's 4 takes its q / k norms from the pre-pass (so its bits can be
    vLLM's on a GPU, tests/gpu/test_kernels.py): the launcher writes the norms it is given, and the walk, the
    split walk's replay included, reads them: outputs and records equal the in-kernel norms' bit for bit (the
    interpreter does both in one order) and the reference."""
    from ddtree_compile.templates.tree_gdn import norms_apart

    H, HV, K, V, N = 2, 4, 16, 16, 13
    case = make_case(N, H, HV, K, V, ("bushy", "deep", "random"), seed=6, dtype=torch.bfloat16)
    meta = build_gdn_meta(case[0], 4)
    R = case[0].shape[0]
    assert norms_apart(1) and not norms_apart(4)
    norms = poison(torch.empty(R * N, 2, H))
    apart = run(lambda *a: tree_gdn_triton(*a, block_v=8, num_warps=1, splits=splits, norms=norms), case, meta,
                H, K, False, True, stack_rows=R * splits)
    assert not norms.isnan().any()  # the pre-pass ran
    inside = run(lambda *a: tree_gdn_triton(*a, block_v=8, num_warps=4, splits=splits), case, meta, H, K, False,
                 True, stack_rows=R * splits)
    for got, want in zip(apart, inside):
        assert torch.equal(got.float().nan_to_num(7.0), want.float().nan_to_num(7.0))
    ref = run(tree_gdn_ref, case, meta, H, K, False, True)
    torch.testing.assert_close(apart[0].float(), ref[0].float(), rtol=2e-2, atol=2e-2)
