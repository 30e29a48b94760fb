"""Triton tree walk (TRITON_INTERPRET=1, CPU tensors) vs the torch reference `walk.walk_tree`.

Trees from the real build (padding, chain seeds, one and several mask words), chain-shaped trees
deeper than their nodes (the round's max_depth = max(L, B)), hand-made trees whose siblings repeat
a token (the first matching child wins); targets that follow a random path to a random depth and
then go astray, so every path length occurs. Every output element is compared exactly, written
into buffers filled with garbage first.
"""

from __future__ import annotations

import os
import random

os.environ["TRITON_INTERPRET"] = "1"  # before the templates define their kernels

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

import ddtree_compile as dd  # noqa: E402
from ddtree_compile.core.tree import PAD_TOKEN, TreeBatch, WalkResult, ancestor_closure, pack_bits  # noqa: E402
from ddtree_compile.core.walk import walk_tree  # noqa: E402
from ddtree_compile.templates import tree_walk as walk_mod  # noqa: E402

FIELDS = ("accepted", "num_accepted", "bonus", "tokens")


def _poisoned(R, L1):
    return WalkResult(torch.full((R, L1), -77, dtype=torch.int64), torch.full((R,), -77, dtype=torch.int64),
                      torch.full((R,), -77, dtype=torch.int64), torch.full((R, L1), -77, dtype=torch.int64))


def _target_along_a_path(tree: TreeBatch, gen: random.Random, V: int) -> torch.Tensor:
    """Tokens no node has (V..2V-1), except that from the root down a random path to a random depth
    the target's token at each node is its chosen child's token: the walk must go exactly that deep."""
    R, N = tree.tokens.shape
    target = torch.tensor([[V + gen.randrange(V) for _ in range(N)] for _ in range(R)], dtype=torch.int64)
    for r in range(R):
        cur, n = 0, int(tree.num_nodes[r])
        for _ in range(gen.randint(0, tree.max_depth)):
            kids = [j for j in range(1, n + 1) if int(tree.parents[r, j]) == cur]
            if not kids:
                break
            j = gen.choice(kids)
            target[r, cur] = tree.tokens[r, j]
            cur = j
    return target


def _assert_walks_equal(got: WalkResult, want: WalkResult):
    for f in FIELDS:
        a, b = getattr(got, f), getattr(want, f)
        assert a.dtype == b.dtype and a.shape == b.shape, f
        assert torch.equal(a, b), f"{f}:\n{a}\n{b}"


def _check(tree, target):
    want = walk_tree(tree, target, impl="torch")
    got = walk_mod.walk_tree_triton(tree, target, out=_poisoned(*want.accepted.shape))
    _assert_walks_equal(got, want)
    _assert_walks_equal(walk_tree(tree, target, impl="triton"), want)
    return want


_rng = random.Random(4321)
# (R, L, V, budget, top_k, chain_seed): random shapes up to budget 64 (65 slots: three mask words)
CASES = [(1, 1, 3, 1, 1, True), (2, 2, 3, 40, 2, False), (3, 15, 50, 64, 8, True), (2, 8, 20, 32, 4, True)] + [
    (_rng.randint(1, 4), _rng.randint(1, 8), _rng.randint(2, 12), _rng.randint(1, 64), _rng.randint(1, 4),
     _rng.random() < 0.7) for _ in range(16)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "R{}L{}V{}B{}K{}{}".format(*c[:5], "c" if c[5] else ""))
def test_walk_kernel_equals_torch_walk_on_built_trees(case):
    R, L, V, budget, top_k, chain_seed = case
    gen = random.Random(hash(case) % 2**31)
    logits = torch.randn(R, L, V, generator=torch.Generator().manual_seed(gen.randrange(2**31))) * 2
    tree = dd.build_tree(logits, dd.TreeSpec(budget=budget, top_k=top_k, chain_seed=chain_seed), impl="torch")
    lengths = set()
    for _ in range(6):
        lengths.update(_check(tree, _target_along_a_path(tree, gen, V)).num_accepted.tolist())
    assert len(lengths) >= 2  # the targets made paths of several lengths


def test_walk_kernel_on_chain_trees_deeper_than_their_nodes():
    """The round's chain rows: parents j-1 over all B+1 slots, max_depth = max(L, B) > B."""
    R, B, depth = 3, 6, 9
    N = B + 1
    parents = torch.arange(-1, N - 1).expand(R, N).clone()
    tokens = torch.randint(0, 4, (R, N), generator=torch.Generator().manual_seed(0))
    tree = TreeBatch(tokens, parents, torch.arange(N).expand(R, N).clone(), torch.zeros(R, N),
                     torch.full((R,), B), pack_bits(ancestor_closure(parents, B)), max_depth=depth)
    target = torch.roll(tokens, -1, 1)  # row r accepts everything ...
    target[1, 3] = (tokens[1, 4] + 1) % 4  # ... except row 1 stops after 3 nodes
    target[2, 0] = (tokens[2, 1] + 1) % 4  # ... and row 2 accepts nothing
    want = _check(tree, target)
    assert want.num_accepted.tolist() == [N, 4, 1]


def test_walk_kernel_first_matching_sibling_wins():
    """Siblings with the same token (a drafter may repeat one): the lower slot and its subtree win."""
    # slot: 0 root; 1, 2 children of 0 with token 5; 3 child of 2 (token 6); 4 child of 1 (token 7)
    parents = torch.tensor([[-1, 0, 0, 2, 1]])
    tokens = torch.tensor([[9, 5, 5, 6, 7]])
    tree = TreeBatch(tokens, parents, torch.tensor([[0, 1, 1, 2, 2]]), torch.zeros(1, 5), torch.tensor([4]),
                     pack_bits(ancestor_closure(parents, 2)), max_depth=2)
    target = torch.tensor([[5, 7, 6, 0, 0]])  # 0 -> slot 1 (first 5), then slot 4 (7), not 2 -> 3
    want = _check(tree, target)
    assert want.accepted.tolist() == [[0, 1, 4]] and want.tokens.tolist() == [[5, 7, 0]]


def test_walk_kernel_strided_and_int32_targets_and_padding_never_accepted():
    tree = dd.build_tree(torch.randn(2, 2, 3), dd.TreeSpec(budget=12, top_k=2), impl="torch")  # 6 nodes + padding
    assert int(tree.num_nodes.max()) < 12
    wide = torch.zeros(2, 40, dtype=torch.int32)
    target = wide[:, 3:16]  # [2, 13], row stride 40
    target.copy_(torch.full((2, 13), PAD_TOKEN, dtype=torch.int32))  # the padding's token everywhere
    _check(tree, target)


def test_walk_kernel_rejects_what_it_cannot_hold():
    N = walk_mod.MAX_SLOTS + 1
    parents = torch.arange(-1, N - 1).unsqueeze(0)
    tree = TreeBatch(torch.zeros(1, N, dtype=torch.int64), parents, torch.arange(N).unsqueeze(0), torch.zeros(1, N),
                     torch.tensor([N - 1]), torch.zeros(1, N, 1, dtype=torch.int32), max_depth=N - 1)
    with pytest.raises(ValueError, match="impl='triton'"):
        walk_tree(tree, torch.zeros(1, N, dtype=torch.int64), impl="triton")
    with pytest.raises(ValueError, match="impl must be one of"):
        walk_tree(tree, torch.zeros(1, N, dtype=torch.int64), impl="cuda")
    small = TreeBatch(tree.tokens[:, :3], tree.parents[:, :3], tree.depths[:, :3], tree.scores[:, :3],
                      torch.tensor([2]), tree.ancestor_bits[:, :3], max_depth=2)
    with pytest.raises(ValueError, match="out.tokens must be int64"):
        bad = _poisoned(1, 3)
        bad.tokens = bad.tokens.int()
        walk_mod.walk_tree_triton(small, torch.zeros(1, 3, dtype=torch.int64), out=bad)


@pytest.mark.parametrize("case", CASES[:12], ids=lambda c: "R{}L{}V{}B{}K{}{}".format(*c[:5], "c" if c[5] else ""))
def test_walk_kernel_order_and_off_chain_equal_the_references(case):
    """The kernel's drafter order and off-chain count (what the round reads after the walk) equal
    walk.drafter_order / walk.accepted_off_chain, written into poisoned buffers, for a top1 that is
    the build's chain (paths on it count 0) and for one that leaves it at a random depth."""
    from ddtree_compile.core.walk import accepted_off_chain, drafter_order

    R, L, V, budget, top_k, chain_seed = case
    gen = random.Random(hash(case) % 2**31 + 7)
    logits = torch.randn(R, L, V, generator=torch.Generator().manual_seed(gen.randrange(2**31))) * 2
    tree = dd.build_tree(logits, dd.TreeSpec(budget=budget, top_k=top_k, chain_seed=chain_seed), impl="torch")
    N = tree.tokens.shape[1]
    offs = set()
    for trial in range(6):
        target = _target_along_a_path(tree, gen, V)
        top1 = logits.argmax(-1)
        if trial % 2:  # another chain: tokens differ from some random depth on
            cut = gen.randrange(L)
            top1[:, cut:] = torch.randint(0, V, (R, L - cut), generator=torch.Generator().manual_seed(trial))
        want = walk_tree(tree, target, impl="torch", top1=top1)
        assert torch.equal(want.order, drafter_order(want.accepted, N)) and torch.equal(want.off_chain, accepted_off_chain(want, top1))
        out = _poisoned(*want.accepted.shape)
        out.order, out.off_chain = torch.full((R * N,), -77, dtype=torch.int64), torch.full((R,), -77, dtype=torch.int64)
        got = walk_mod.walk_tree_triton(tree, target, out=out, top1=top1.to(torch.int32))
        _assert_walks_equal(got, want)
        assert torch.equal(got.order, want.order), (got.order, want.order)
        assert torch.equal(got.off_chain, want.off_chain), (got.off_chain, want.off_chain)
        assert sorted(got.order.tolist()) == list(range(R * N))  # a permutation of the verify's rows
        offs.update(want.off_chain.tolist())
        no_top1 = walk_mod.walk_tree_triton(tree, target)
        assert no_top1.off_chain is None and torch.equal(no_top1.order, want.order)
    if chain_seed and budget > L:
        assert len(offs) > 1, offs  # some paths left the chain, some did not
