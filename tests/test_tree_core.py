"""DDTree core: build (against a heap oracle and brute-force enumeration), tree layout, walk, commit.
Sampling, input validation and the block-boundary depth: test_tree_core_sampling_and_inputs.py."""

import heapq
import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ddtree_compile as dd
from ddtree_compile.core.tree import pack_bits, unpack_bits
from ddtree_compile.core.walk import accepted_off_chain

# ---------------------------------------------------------------- oracles (plain Python)

def heap_tree(lq, budget, chain_seed):
    """The reference DDTree heap (ddtree.py; Lucebox's chain seed), one request -> [(ranks, score)]."""
    L, K = len(lq), len(lq[0])
    f32add = lambda a, b: (torch.tensor(a, dtype=torch.float32) + torch.tensor(b, dtype=torch.float32)).item()  # noqa: E731
    nodes, scores, heap = [], {(): 0.0}, []

    def push(ranks):
        score = f32add(scores[ranks[:-1]], lq[len(ranks) - 1][ranks[-1]])
        if score > -math.inf:
            heapq.heappush(heap, (-score, ranks))  # ties: the smaller rank tuple pops first

    if chain_seed:
        for d in range(1, min(L, budget) + 1):
            ranks = (0,) * d
            scores[ranks] = f32add(scores[ranks[:-1]], lq[d - 1][0])
            nodes.append((ranks, scores[ranks]))
        for ranks, _ in list(nodes):
            if K > 1:
                push(ranks[:-1] + (1,))
    else:
        push((0,))
    while heap and len(nodes) < budget:
        neg, ranks = heapq.heappop(heap)
        scores[ranks] = -neg
        nodes.append((ranks, -neg))
        if ranks[-1] + 1 < K:
            push(ranks[:-1] + (ranks[-1] + 1,))
        if len(ranks) < L:
            push(ranks + (0,))
    return nodes


def brute_force(lq, budget, chain_seed):
    """Every rank path, sorted by (score desc, rank tuple asc); chain first if seeded."""
    L, K = len(lq), len(lq[0])
    paths = []
    for d in range(1, L + 1):
        for ranks in itertools.product(range(K), repeat=d):
            s = torch.tensor(0.0)
            for i, r in enumerate(ranks):
                s = s + torch.tensor(lq[i][r], dtype=torch.float32)
            if s.item() > -math.inf:
                paths.append((ranks, s.item()))
    chain = [p for p in paths if set(p[0]) == {0} and len(p[0]) <= min(L, budget)] if chain_seed else []
    chain.sort(key=lambda p: len(p[0]))
    rest = sorted((p for p in paths if p not in chain), key=lambda p: (-p[1], p[0]))
    return (chain + rest)[:budget]


def tree_to_paths(tree, r, ids):
    """Our TreeBatch request r -> [(ranks, score)] in slot order (ranks recovered from token ids)."""
    out, ranks_of = [], {0: ()}
    for s in range(1, int(tree.num_nodes[r]) + 1):
        p, d = int(tree.parents[r, s]), int(tree.depths[r, s])
        assert 0 <= p < s, "parents come before children"
        tok = int(tree.tokens[r, s])
        rank = ids[r, d - 1].tolist().index(tok)
        ranks_of[s] = ranks_of[p] + (rank,)
        assert len(ranks_of[s]) == d
        out.append((ranks_of[s], float(tree.scores[r, s])))
    return out


def python_walk(tree, target, r):
    cur, path = 0, [0]
    while True:
        kids = [j for j in range(1, tree.num_slots) if int(tree.parents[r, j]) == cur and int(tree.tokens[r, j]) == int(target[r, cur])]
        if not kids:
            return path, int(target[r, cur])
        cur = kids[0]
        path.append(cur)


# ---------------------------------------------------------------- build

logit_values = st.one_of(st.integers(-3, 3).map(float), st.floats(-4, 4, width=32))


@st.composite
def draft_cases(draw):
    R, L, V = draw(st.integers(1, 3)), draw(st.integers(1, 4)), draw(st.integers(1, 6))
    logits = torch.tensor(draw(st.lists(logit_values, min_size=R * L * V, max_size=R * L * V))).view(R, L, V)
    spec = dd.TreeSpec(
        budget=draw(st.integers(1, 24)), top_k=draw(st.integers(1, 4)), chain_seed=draw(st.booleans()),
        temperature=draw(st.sampled_from([1.0, 0.5, 2.0])), max_depth=draw(st.sampled_from([None, 1, 2, 3])),
    )
    return logits, spec


@settings(max_examples=150, deadline=None)
@given(draft_cases())
def test_build_matches_heap_and_brute_force(case):
    logits, spec = case
    tree = dd.build_tree(logits, spec)
    lq, ids = dd.draft_topk(logits, spec)
    depth = spec.depth_limit(logits.shape[1])
    R, N = logits.shape[0], spec.budget + 1
    assert tree.tokens.shape == tree.parents.shape == tree.depths.shape == tree.scores.shape == (R, N)
    for r in range(R):
        ours = tree_to_paths(tree, r, ids)
        want_heap = heap_tree(lq[r, :depth].tolist(), spec.budget, spec.chain_seed)
        want_bf = brute_force(lq[r, :depth].tolist(), spec.budget, spec.chain_seed)
        assert [p for p, _ in ours] == [p for p, _ in want_heap] == [p for p, _ in want_bf]
        assert [s for _, s in ours] == pytest.approx([s for _, s in want_bf], abs=0, rel=0)
        n = len(ours)
        assert int(tree.num_nodes[r]) == n
        assert (tree.parents[r, n + 1:] == -1).all() and (tree.depths[r, n + 1:] == 0).all()
        assert torch.isinf(tree.scores[r, n + 1:]).all()


def test_scores_are_log_softmax_sums_at_temperature():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 50) * 3
    spec = dd.TreeSpec(budget=12, top_k=4, temperature=0.7)
    tree = dd.build_tree(logits, spec)
    logq = torch.log_softmax(logits / 0.7, dim=-1)
    for r in range(2):
        for s in range(1, 13):
            want, j = 0.0, s
            while j > 0:
                want += logq[r, int(tree.depths[r, j]) - 1, int(tree.tokens[r, j])].item()
                j = int(tree.parents[r, j])
            assert float(tree.scores[r, s]) == pytest.approx(want, abs=1e-4)


def test_budget_equals_depth_with_top1_is_flat_dflash_chain():
    torch.manual_seed(1)
    logits = torch.randn(3, 15, 100)
    for chain_seed in (True, False):
        tree = dd.build_tree(logits, dd.TreeSpec(budget=15, top_k=1, chain_seed=chain_seed))
        assert torch.equal(tree.tokens[:, 1:], logits.argmax(-1))
        assert torch.equal(tree.parents[0], torch.arange(-1, 15))
        assert torch.equal(tree.depths[0], torch.arange(16))


def test_budget_larger_than_all_paths_pads():
    logits = torch.randn(2, 2, 3)
    tree = dd.build_tree(logits, dd.TreeSpec(budget=40, top_k=2))
    assert tree.num_nodes.tolist() == [6, 6]  # 2 + 4 paths
    assert (tree.parents[:, 7:] == -1).all()
    assert not tree.ancestor_mask()[:, 7:].any() and not tree.ancestor_mask()[:, :, 7:].any()


def test_requests_with_different_distributions_get_different_trees():
    torch.manual_seed(2)
    logits = torch.randn(4, 4, 30) * 2
    batched = dd.build_tree(logits, dd.TreeSpec(budget=9, top_k=3))
    for r in range(4):
        single = dd.build_tree(logits[r : r + 1], dd.TreeSpec(budget=9, top_k=3))
        for f in ("tokens", "parents", "depths", "scores", "ancestor_bits"):
            assert torch.equal(getattr(batched, f)[r], getattr(single, f)[0]), f
    assert not torch.equal(batched.tokens[0], batched.tokens[1])


def test_precomputed_topk_equals_logits_path():
    torch.manual_seed(3)
    logits = torch.randn(2, 6, 40)
    spec = dd.TreeSpec(budget=20, top_k=5)
    lq, ids = dd.draft_topk(logits, spec)
    a, b = dd.build_tree(logits, spec), dd.build_tree((lq, ids), spec)
    for f in ("tokens", "parents", "depths", "scores", "ancestor_bits"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f


def test_ancestor_bits_mask_and_parent_closure_agree():
    torch.manual_seed(4)
    tree = dd.build_tree(torch.randn(3, 6, 20), dd.TreeSpec(budget=40, top_k=4))
    mask = tree.ancestor_mask()
    assert tree.ancestor_bits.dtype == torch.int32 and tree.ancestor_bits.shape == (3, 41, 2)
    assert torch.equal(pack_bits(mask), tree.ancestor_bits)
    for r in range(3):
        for i in range(41):
            want = set()
            if i <= int(tree.num_nodes[r]):
                j = i
                while j >= 0:
                    want.add(j)
                    j = int(tree.parents[r, j])
            assert set(torch.nonzero(mask[r, i]).flatten().tolist()) == want


def test_pack_bits_uses_sign_bit_for_bit_31():
    mask = torch.zeros(1, 40, dtype=torch.bool)
    mask[0, 31] = True
    mask[0, 33] = True
    bits = pack_bits(mask)
    assert bits.tolist() == [[-(2**31), 2]]
    assert torch.equal(unpack_bits(bits, 40), mask)


def test_positions_are_start_plus_depth():
    tree = dd.build_tree(torch.randn(2, 3, 10), dd.TreeSpec(budget=6, top_k=2))
    assert torch.equal(tree.positions(7), tree.depths + 7)
    start = torch.tensor([3, 100])
    assert torch.equal(tree.positions(start), tree.depths + start.view(-1, 1))


# ---------------------------------------------------------------- walk and commit

@settings(max_examples=60, deadline=None)
@given(draft_cases(), st.integers(0, 2**31 - 1))
def test_walk_matches_python_walk(case, seed):
    logits, spec = case
    tree = dd.build_tree(logits, spec)
    gen = torch.Generator().manual_seed(seed)
    # Targets that mostly agree with the tree (a random child's token) so paths get deep.
    target = torch.randint(0, logits.shape[-1], tree.tokens.shape, generator=gen)
    for r in range(tree.num_requests):
        for s in range(1, int(tree.num_nodes[r]) + 1):
            if torch.rand((), generator=gen) < 0.7:
                target[r, int(tree.parents[r, s])] = tree.tokens[r, s]
    walk = dd.walk_tree(tree, target)
    L1 = tree.max_depth + 1
    assert walk.accepted.shape == walk.tokens.shape == (tree.num_requests, L1)
    top1 = logits.argmax(-1)  # the drafter's chain, as the round keeps it
    off = accepted_off_chain(walk, top1)
    for r in range(tree.num_requests):
        path, bonus = python_walk(tree, target, r)
        n = len(path)
        assert walk.accepted[r, :n].tolist() == path and (walk.accepted[r, n:] == -1).all()
        assert int(walk.num_accepted[r]) == n and int(walk.bonus[r]) == bonus
        assert walk.tokens[r, :n].tolist() == [int(tree.tokens[r, j]) for j in path[1:]] + [bonus]
        assert (walk.tokens[r, n:] == -1).all()
        # off the chain: a path node below the first node that is not the drafter's argmax of its depth
        ranks0 = [int(tree.tokens[r, j]) == int(top1[r, d]) for d, j in enumerate(path[1:])]
        assert int(off[r]) == sum(not all(ranks0[: d + 1]) for d in range(n - 1))


def test_walk_takes_sibling_branch_and_commit_plan_moves_it():
    logits = torch.full((1, 3, 8), -5.0)
    logits[0, :, 1] = 3.0  # chain 1,1,1
    logits[0, :, 2] = 2.5  # strong runner-up at every depth
    tree = dd.build_tree(logits, dd.TreeSpec(budget=6, top_k=2))
    # Target rejects the chain at depth 1 (wants 2), then agrees with 1 below it.
    target = torch.full((1, 7), 1)
    target[0, 0] = 2
    walk = dd.walk_tree(tree, target)
    n = int(walk.num_accepted[0])
    path = walk.accepted[0, :n].tolist()
    assert n >= 2 and path[1] > 1, "the accepted path leaves the main chain"
    assert walk.tokens[0, 0].item() == 2
    plan = dd.commit_plan(walk, start=torch.tensor([10]))
    moves = [(s, d) for s, d in zip(plan.src_pos[0].tolist(), plan.dst_pos[0].tolist()) if s >= 0]
    assert moves == [(10 + path[d], 10 + d) for d in range(n) if path[d] != d]
    assert all(s > d for s, d in moves)


def test_commit_plan_main_chain_moves_nothing():
    tree = dd.build_tree(torch.randn(2, 4, 9), dd.TreeSpec(budget=10, top_k=3))
    target = tree.tokens.clone()
    target[:, :4] = tree.tokens[:, 1:5]  # agree with the whole seeded chain (slots 1..4)
    walk = dd.walk_tree(tree, target)
    assert walk.num_accepted.tolist() == [5, 5]
    plan = dd.commit_plan(walk, 3)
    assert (plan.src_pos == -1).all() and (plan.dst_pos == -1).all()


# ---------------------------------------------------------------- a smaller budget's tree within a larger one

@pytest.mark.parametrize("seed", range(4))
def test_a_trees_prefix_is_the_smaller_budgets_tree_and_its_walk(seed):
    """budget "auto"'s menu builds once: the first b nodes of the B-node tree are the b-node tree
    (TreeBatch.prefix), and what the walk of the B-node tree says a b-node tree would have accepted
    (walk_stage._accepted_within) is what walking the b-node tree accepts."""
    from ddtree_compile.integration.round.walk_stage import _accepted_within

    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(5, 6, 40, generator=g) * 2.5
    B = 30
    big = dd.build_tree(logits, dd.TreeSpec(budget=B, top_k=4))
    # target tokens that mostly follow some child (deep, branching paths), sometimes none
    target = torch.randint(0, 40, (5, B + 1), generator=g)
    for r in range(5):
        for i in range(B + 1):
            kids = (big.parents[r] == i).nonzero().flatten()
            if len(kids) and torch.rand((), generator=g) < 0.85:
                target[r, i] = big.tokens[r, kids[torch.randint(len(kids), (), generator=g)]]
    walk = dd.walk_tree(big, target)
    budgets = (1, 3, 8, 17, 29)
    within = _accepted_within(walk.accepted, torch.tensor(budgets).view(-1, 1, 1))
    assert within.shape == (len(budgets), 5)
    for k, b in enumerate(budgets):
        small = dd.build_tree(logits, dd.TreeSpec(budget=b, top_k=4))
        pre = big.prefix(b)
        for f in ("tokens", "parents", "depths", "scores", "num_nodes", "ancestor_bits"):
            assert torch.equal(getattr(pre, f), getattr(small, f)), (b, f)
        assert pre.max_depth == min(big.max_depth, b)
        # into fixed buffers (the build's per-bucket trees, written in the drafter's graph): the same values
        bufs = dd.TreeBatch(*(torch.full_like(getattr(pre, f), 7) for f in ("tokens", "parents", "depths", "scores",
                            "num_nodes", "ancestor_bits")), max_depth=pre.max_depth)
        into = big.prefix(b, out=bufs)
        assert into is bufs and all(torch.equal(getattr(into, f), getattr(small, f)) for f in
                                    ("tokens", "parents", "depths", "scores", "num_nodes", "ancestor_bits")), b
        got = dd.walk_tree(pre, target[:, : b + 1]).num_accepted - 1
        assert torch.equal(within[k], got), (b, within[k], got)
    assert torch.equal(_accepted_within(walk.accepted, torch.tensor([B]).view(-1, 1, 1))[0], walk.num_accepted - 1)
    assert (walk.num_accepted > 2).any()  # the paths do go deep
