"""Accepted-path commit: Triton (interpreter) vs reference, and verify -> commit -> verify against
running the committed tokens sequentially (state and conv history), both state strategies."""

import pytest
import torch
from _gdn_common import ChainOracle, poison, random_parents, root_path  # sets TRITON_INTERPRET first

from ddtree_compile.templates import gdn_step  # (its import registers torch.ops.ddtree.*)
from ddtree_compile.templates.gdn_commit import gdn_commit_triton
from ddtree_compile.templates.gdn_commit_ref import gdn_commit_ref
from ddtree_compile.templates.gdn_meta import build_gdn_meta, validate_path
from ddtree_compile.templates.tree_conv import tree_conv1d_triton
from ddtree_compile.templates.tree_conv_ref import tree_conv1d_ref
from ddtree_compile.templates.tree_gdn import tree_gdn_triton
from ddtree_compile.templates.tree_gdn_ref import tree_gdn_ref

H, HV, K, V = 1, 2, 8, 8
D = 2 * H * K + HV * V
IMPLS = {"ref": (tree_conv1d_ref, tree_gdn_ref, gdn_commit_ref),
         "triton": (tree_conv1d_triton, tree_gdn_triton, gdn_commit_triton)}


class Model:
    """`layers` GDN layers with their own weights and vLLM-layout caches for R requests."""

    def __init__(self, layers, R, N, W, strategy, gen):
        self.R, self.N, self.W, self.strategy = R, N, W, strategy
        self.w = [torch.randn(D, W, generator=gen) * 0.5 for _ in range(layers)]
        self.bias = [torch.randn(D, generator=gen) * 0.1 for _ in range(layers)]
        self.A_log = [torch.randn(HV, generator=gen) * 0.5 for _ in range(layers)]
        self.dt = [torch.randn(HV, generator=gen) * 0.5 for _ in range(layers)]
        lines = R * N + 2
        self.conv = [torch.zeros(lines, W - 2 + N, D).transpose(1, 2) for _ in range(layers)]  # SD layout
        self.ssm = [torch.zeros(lines, HV, V, K) for _ in range(layers)]
        ns = 1 if strategy == "records1" else N
        self.si = (1 + torch.arange(R * ns, dtype=torch.int32)).view(R, ns)
        self.na = torch.randint(1, N + 1, (R,), generator=gen, dtype=torch.int32)
        self.orc = [ChainOracle(self.w[i], self.bias[i], self.A_log[i], self.dt[i], H, K) for i in range(layers)]
        # Committed (history, state) per layer and request, written where the next step reads them.
        self.hist = [[torch.randn(D, W - 1, generator=gen).double() for _ in range(R)] for _ in range(layers)]
        self.S = [[torch.randn(HV, V, K, generator=gen).double() * 0.3 for _ in range(R)] for _ in range(layers)]
        for i in range(layers):
            for r in range(R):
                o = int(self.na[r]) - 1
                self.conv[i][int(self.si[r, 0]), :, o: o + W - 1] = self.hist[i][r].float()
                self.ssm[i][int(self.si[r, o if ns > 1 else 0])] = self.S[i][r].float()
        records = strategy.startswith("records")
        self.rec_kv = torch.zeros(layers, R, N, H * K + HV * V) if records else None
        self.rec_gb = torch.zeros(layers, R, N, 2, HV) if records else None

    def verify(self, impl, parents, x, a, b):
        conv_fn, gdn_fn, _ = IMPLS[impl]
        meta = build_gdn_meta(parents, self.W)
        outs = []
        for i in range(len(self.w)):
            y = poison(torch.empty_like(x[i]))
            conv_fn(x[i], self.w[i], self.bias[i], self.conv[i], self.si, self.na, meta.conv_anc, y, True)
            out = poison(torch.empty(self.R * self.N, HV, V))
            stack = poison(torch.empty(self.R, self.N, HV, V, K))
            rec = (self.rec_kv[i], self.rec_gb[i]) if self.rec_kv is not None else (None, None)
            gdn_fn(y, a[i], b[i], self.A_log[i], self.dt[i], self.ssm[i], self.si, self.na, meta.walk, stack, out,
                   *rec, H, K, K ** -0.5, self.strategy == "snapshots")
            outs.append(out)
        return outs

    def check_outputs(self, outs, parents, x, a, b):
        for i, out in enumerate(outs):
            for r in range(self.R):
                p = parents[r].tolist()
                for s in [s for s in range(self.N) if s == 0 or p[s] >= 0]:
                    rows = [r * self.N + t for t in root_path(p, s)]
                    o, _, _ = self.orc[i].run(self.hist[i][r], self.S[i][r], x[i][rows], a[i][rows], b[i][rows])
                    torch.testing.assert_close(out[r * self.N + s].double(), o[-1], rtol=1e-4, atol=1e-4)

    def commit(self, impl, accepted, path_len, x, a, b, snap_depth=None):
        IMPLS[impl][2](self.conv, self.ssm, self.si, self.na, accepted, path_len, self.rec_kv, self.rec_gb, self.W,
                       snap_depth)
        for i in range(len(self.w)):  # advance the oracle along the accepted paths
            for r in range(self.R):
                rows = [r * self.N + int(s) for s in accepted[r, : int(path_len[r])]]
                d = -1 if snap_depth is None else int(snap_depth[r])
                if 0 <= d < len(rows) - 1 and self.si.shape[1] > 1:  # align's block-boundary state, line d
                    _, _, S_d = self.orc[i].run(self.hist[i][r], self.S[i][r], x[i][rows[: d + 1]],
                                                a[i][rows[: d + 1]], b[i][rows[: d + 1]])
                    torch.testing.assert_close(self.ssm[i][int(self.si[r, d])].double(), S_d, rtol=1e-4, atol=1e-4)
                _, self.hist[i][r], self.S[i][r] = self.orc[i].run(self.hist[i][r], self.S[i][r], x[i][rows],
                                                                   a[i][rows], b[i][rows])

    def check_committed(self, path_len):
        """The committed window and state sit where the next step (and vLLM) reads them: vLLM's chain
        layout, num_accepted = the path's length."""
        assert self.na.tolist() == path_len.tolist()
        for i in range(len(self.w)):
            for r in range(self.R):
                o = int(self.na[r]) - 1
                win = self.conv[i][int(self.si[r, 0]), :, o: o + self.W - 1]
                torch.testing.assert_close(win.double(), self.hist[i][r], rtol=0, atol=1e-6)
                line = int(self.si[r, o if self.si.shape[1] > 1 else 0])
                torch.testing.assert_close(self.ssm[i][line].double(), self.S[i][r], rtol=1e-4, atol=1e-4)


def random_step(model, layers, gen, kinds):
    N, R = model.N, model.R
    parents = torch.tensor([random_parents(k, N, N - (r % 2), gen) for r, k in enumerate(kinds)])
    x = torch.randn(layers, R * N, D, generator=gen)
    a = torch.randn(layers, R * N, HV, generator=gen)
    b = torch.randn(layers, R * N, HV, generator=gen)
    return parents, x, a, b


def pick_paths(parents, gen, mode):
    """Walk results: a path to the LAST live slot (a sibling branch in most trees) or a random one."""
    R, N = parents.shape
    acc = torch.full((R, N), -1, dtype=torch.int32)
    plen = torch.zeros(R, dtype=torch.int32)
    for r, p in enumerate(parents.tolist()):
        live = [s for s in range(N) if s == 0 or p[s] >= 0]
        end = live[-1] if mode == "last" else live[int(torch.randint(0, len(live), (1,), generator=gen))]
        path = root_path(p, end)
        acc[r, : len(path)] = torch.tensor(path, dtype=torch.int32)
        plen[r] = len(path)
    return acc, plen


@pytest.mark.parametrize("impl", ["ref", "triton"])
@pytest.mark.parametrize("strategy", ["snapshots", "records", "records1"])
@pytest.mark.parametrize("snap", [False, True])
def test_commit_then_continue_equals_sequential(impl, strategy, snap):
    """snap: every request also gets a block-boundary depth (align prefix caching), -1 or inside its path."""
    gen = torch.Generator().manual_seed(len(impl) * 7 + len(strategy) + 100 * snap)
    layers, R, N, W = 2, 3, 7, 4
    model = Model(layers, R, N, W, strategy, gen)
    for step, (kinds, mode) in enumerate([(("bushy", "deep", "star"), "last"), (("random", "chain", "bushy"), "rand"),
                                          (("chain", "bushy", "deep"), "last")]):
        parents, x, a, b = random_step(model, layers, gen, kinds)
        outs = model.verify(impl, parents, x, a, b)
        model.check_outputs(outs, parents, x, a, b)
        accepted, path_len = pick_paths(parents, gen, mode)
        validate_path(accepted, path_len, parents)
        depth = None
        if snap:
            depth = torch.tensor([int(torch.randint(-1, max(int(n) - 1, 0), (1,), generator=gen)) for n in path_len],
                                 dtype=torch.int32)
        model.commit(impl, accepted, path_len, x, a, b, depth)
        model.check_committed(path_len)


@pytest.mark.parametrize("W", [2, 3, 4])
def test_full_chain_commit_equals_chain_run(W):
    """Committing a whole chain leaves vLLM's chain layout: nothing moves in the conv line."""
    gen = torch.Generator().manual_seed(W)
    model = Model(1, 2, 5, W, "snapshots", gen)
    parents, x, a, b = random_step(model, 1, gen, ("chain", "chain"))
    parents[1] = torch.tensor(random_parents("chain", 5, 5, gen))
    model.verify("ref", parents, x, a, b)
    before = model.conv[0].clone()
    accepted = torch.arange(5, dtype=torch.int32).repeat(2, 1)
    model.commit("ref", accepted, torch.tensor([5, 5], dtype=torch.int32), x, a, b)
    torch.testing.assert_close(model.conv[0], before, rtol=0, atol=0)
    model.check_committed(torch.tensor([5, 5]))


@pytest.mark.parametrize("W", [2, 3, 4])
@pytest.mark.parametrize("records", [False, True, "padded"])
@pytest.mark.parametrize("snap", [False, True])
def test_commit_triton_matches_reference(W, records, snap):
    """records="padded": the records are the first R rows of a buffer sized for a larger (CUDA-graph
    bucket) batch, the rows beyond the batch poisoned with NaN: they must never be read."""
    gen = torch.Generator().manual_seed(W + 10 * bool(records))
    layers, R, N = 3, 4, 8
    convs = [torch.randn(2 * R * N, W - 2 + N, D, generator=gen).transpose(1, 2) for _ in range(layers)]
    ssms = [torch.randn(2 * R * N, HV, V, K, generator=gen) for _ in range(layers)]
    si = (1 + torch.arange(R * N, dtype=torch.int32)).view(R, N)
    si[2] = 0  # padded request
    na = torch.randint(1, N + 1, (R,), generator=gen, dtype=torch.int32)
    parents = torch.tensor([random_parents(k, N, N, gen) for k in ("bushy", "deep", "star", "random")])
    accepted, path_len = pick_paths(parents, gen, "last")
    path_len[3] = 0  # a request left untouched
    rec_kv = torch.randn(layers, R, N, H * K + HV * V, generator=gen) if records else None
    rec_gb = torch.rand(layers, R, N, 2, HV, generator=gen) if records else None
    exact = (rec_kv, rec_gb)
    if records == "padded":
        big_kv = torch.full((layers, R + 3, N, H * K + HV * V), float("nan"))
        big_gb = torch.full((layers, R + 3, N, 2, HV), float("nan"))
        big_kv[:, :R], big_gb[:, :R] = rec_kv, rec_gb
        rec_kv, rec_gb = big_kv, big_gb  # the whole bucket (R + 3 rows) for the Triton kernel
    depth = None
    if snap:  # a boundary inside each path where there is room, else -1 (none) or past the path (ignored)
        depth = torch.tensor([int(n) - 2 if n > 1 else -1 for n in path_len], dtype=torch.int32)
        depth[0] = int(path_len[0]) + 3
    res = []
    for fn, recs in ((gdn_commit_ref, exact), (gdn_commit_triton, (rec_kv, rec_gb))):
        c, s, n = [t.clone() for t in convs], [t.clone() for t in ssms], na.clone()
        fn(c, s, si, n, accepted, path_len, *recs, W, depth)
        res.append((c, s, n))
    for i in range(layers):
        assert not s[i].isnan().any()
    for i in range(layers):
        torch.testing.assert_close(res[1][0][i], res[0][0][i], rtol=0, atol=0)
        torch.testing.assert_close(res[1][1][i], res[0][1][i], rtol=1e-5, atol=1e-5)
    assert torch.equal(res[1][2], res[0][2]) and int(res[0][2][3]) == int(na[3])


@pytest.mark.parametrize("records", [False, True])
def test_commit_of_several_groups_in_one_call(records):
    """Layers of two KV cache groups (their own state lines and num_accepted) in one call: equal to one
    reference call per group, and the Triton kernels equal the grouped reference."""
    gen = torch.Generator().manual_seed(7 + records)
    W, R, N, groups = 4, 3, 6, [0, 1, 0, 1, 1]
    nl = len(groups)
    convs = [torch.randn(4 * R * N, W - 2 + N, D, generator=gen).transpose(1, 2) for _ in range(nl)]
    ssms = [torch.randn(4 * R * N, HV, V, K, generator=gen) for _ in range(nl)]
    si = torch.stack([1 + torch.arange(R * N, dtype=torch.int32).view(R, N),
                      1 + R * N + torch.randperm(R * N, generator=gen).to(torch.int32).view(R, N)])
    na = torch.randint(1, N + 1, (2, R), generator=gen, dtype=torch.int32)
    parents = torch.tensor([random_parents(k, N, N, gen) for k in ("bushy", "deep", "star")])
    accepted, path_len = pick_paths(parents, gen, "last")
    rec_kv = torch.randn(nl, R, N, H * K + HV * V, generator=gen) if records else None
    rec_gb = torch.rand(nl, R, N, 2, HV, generator=gen) if records else None

    def run(fn):
        c, s, n = [t.clone() for t in convs], [t.clone() for t in ssms], na.clone()
        if fn is None:  # one reference call per group, the oracle of the grouping
            for g in (0, 1):
                mine = [i for i, x in enumerate(groups) if x == g]
                recs = (rec_kv[mine], rec_gb[mine]) if records else (None, None)
                gdn_commit_ref([c[i] for i in mine], [s[i] for i in mine], si[g], n[g], accepted, path_len, *recs, W)
        else:
            fn(c, s, si, n, accepted, path_len, rec_kv, rec_gb, W, None, groups)
        return c, s, n

    want, ref, got = run(None), run(gdn_commit_ref), run(gdn_commit_triton)
    for i in range(nl):
        assert torch.equal(ref[0][i], want[0][i]) and torch.equal(ref[1][i], want[1][i])
        assert not torch.equal(want[1][i], ssms[i]) or not records  # the commit wrote something
        torch.testing.assert_close(got[0][i], want[0][i], rtol=0, atol=0)
        torch.testing.assert_close(got[1][i], want[1][i], rtol=1e-5, atol=1e-5)
    assert torch.equal(ref[2], want[2]) and torch.equal(got[2], want[2])
    assert torch.equal(want[2][0], path_len) and torch.equal(want[2][1], path_len)
    with pytest.raises(ValueError, match="layer_group must give each"):
        gdn_commit_ref(convs, ssms, si, na.clone(), accepted, path_len, rec_kv, rec_gb, W, None, [0, 1, 2, 0, 0])
    with pytest.raises(ValueError, match=r"state_indices must be \[G, R, NS\]"):
        gdn_commit_ref(convs, ssms, si[0], na[0].clone(), accepted, path_len, rec_kv, rec_gb, W, None, groups)


def test_custom_ops_cpu_and_compile():
    """torch.ops.ddtree.* run the reference on CPU and trace under torch.compile (fake impls)."""
    gen = torch.Generator().manual_seed(0)
    model = Model(1, 2, 5, 4, "records", gen)
    parents, x, a, b = random_step(model, 1, gen, ("bushy", "deep"))
    meta = build_gdn_meta(parents, 4)
    stack = torch.zeros(2, 5, HV, V, K)

    def step(conv, ssm, na, out):
        gdn_step.tree_gdn_verify(x[0], b[0], a[0], out, conv, ssm, model.w[0], model.bias[0], model.A_log[0],
                                 model.dt[0], model.si, na, meta, stack, H, K, rec_kv=model.rec_kv[0],
                                 rec_gb=model.rec_gb[0])
        return out

    outs = []
    for fn in (step, torch.compile(step, backend="aot_eager", fullgraph=True)):
        conv, ssm, na = model.conv[0].clone(), model.ssm[0].clone(), model.na.clone()
        outs.append((fn(conv, ssm, na, poison(torch.empty(10, HV, V))), conv))
    torch.testing.assert_close(outs[1][0], outs[0][0])
    torch.testing.assert_close(outs[1][1], outs[0][1])
    model.check_outputs([outs[0][0]], parents, x, a, b)


@pytest.mark.parametrize("acc, plen, msg", [
    ([[1, 2, -1]], [2], "start at the root"),
    ([[0, 2, -1]], [2], "not a child"),
    ([[0, 9, -1]], [2], "allowed slots"),
    ([[0, 1, 5]], [2], "past path_len"),
    ([[0, 1, 2]], [4], "path_len"),
])
def test_bad_walk_result_rejected(acc, plen, msg):
    parents = torch.tensor([[-1, 0, 1, 0]])
    with pytest.raises(ValueError, match=msg):
        validate_path(torch.tensor(acc, dtype=torch.int32), torch.tensor(plen, dtype=torch.int32), parents)


def test_debug_mode_validates(monkeypatch):
    monkeypatch.setenv("DDTREE_DEBUG", "1")
    with pytest.raises(ValueError, match=">= itself"):
        gdn_step.make_gdn_meta(torch.tensor([[-1, 2, 0]]), 4)
    with pytest.raises(ValueError, match="not a child"):
        gdn_step.commit_accepted_path([torch.zeros(1, D, 4)], [], torch.ones(1, 1, dtype=torch.int32),
                                      torch.ones(1, dtype=torch.int32), torch.tensor([[0, 2]], dtype=torch.int32),
                                      torch.tensor([2], dtype=torch.int32), 4, parents=torch.tensor([[-1, 0, 1]]))
