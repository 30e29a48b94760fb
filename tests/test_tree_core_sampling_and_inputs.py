"""DDTree core: lossless sampling, the checks that name a bad setting or input, and the depth of the
block-boundary state (vLLM's "align" prefix cache). Build, walk and commit: test_tree_core.py."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ddtree_compile as dd
from ddtree_compile.core.tree import ancestor_closure

# ---------------------------------------------------------------- sampling

def test_greedy_sampling_is_argmax_and_seeded_sampling_reproducible():
    torch.manual_seed(5)
    logits = torch.randn(3, 7, 11)
    assert torch.equal(dd.sample_target_tokens(logits, 0.0), logits.argmax(-1))
    pos = torch.arange(7).expand(3, -1) + 20
    seeds = torch.tensor([1, 2, 3])
    a = dd.sample_target_tokens(logits, 1.0, seeds, pos)
    assert torch.equal(a, dd.sample_target_tokens(logits, 1.0, seeds, pos))
    b = dd.sample_target_tokens(logits, torch.tensor([1.0, 0.0, 1.0]), seeds, pos)
    assert torch.equal(b[1], logits[1].argmax(-1)) and torch.equal(b[0], a[0])


def test_sampling_matches_the_target_distribution():
    """Chi-square: one node's draws over many positions follow softmax(logits / T)."""
    logits = torch.tensor([[[2.0, 1.0, 0.0, -1.0, 0.5]]])
    T, n = 0.8, 20000
    pos = torch.arange(n).view(n, 1)
    draws = dd.sample_target_tokens(logits.expand(n, 1, 5), T, torch.full((n,), 7), pos).flatten()
    counts = torch.bincount(draws, minlength=5).double()
    expect = torch.softmax(logits.flatten() / T, -1).double() * n
    chi2 = (((counts - expect) ** 2) / expect).sum().item()
    assert chi2 < 18.5, chi2  # 4 dof, p ~ 0.001


# ---------------------------------------------------------------- validation

@pytest.mark.parametrize(
    "kwargs, field",
    [({"budget": 0}, "budget"), ({"budget": 8, "top_k": 0}, "top_k"), ({"budget": 8, "temperature": 0.0}, "temperature"),
     ({"budget": 8, "temperature": float("nan")}, "temperature"), ({"budget": 8, "max_depth": 0}, "max_depth"),
     ({"budget": 2.5}, "budget"), ({"budget": 8, "chain_seed": 1}, "chain_seed"), ({"budget": 5000}, "budget")],
)
def test_tree_spec_rejects_bad_values(kwargs, field):
    with pytest.raises(ValueError, match=f"TreeSpec.{field}"):
        dd.TreeSpec(**kwargs)


def test_tree_spec_is_frozen():
    spec = dd.TreeSpec(budget=22)
    with pytest.raises(Exception):
        spec.budget = 3
    assert spec.num_slots == 23


@pytest.mark.parametrize(
    "draft, match",
    [(torch.randn(4, 10), r"\[R, L, V\]"), (torch.randint(0, 5, (1, 2, 3)), "floating dtype"),
     ([1, 2, 3], "must be a pair"), ((torch.randn(1, 2, 3), torch.zeros(1, 2, 4, dtype=torch.long)), r"\[R, L, K\]"),
     ((torch.randn(1, 2, 3), torch.zeros(1, 2, 3)), "token_ids int32/int64"), (torch.empty(1, 0, 5), r"\[R, L, V\]")],
)
def test_build_rejects_bad_inputs(draft, match):
    with pytest.raises(ValueError, match=match):
        dd.build_tree(draft, dd.TreeSpec(budget=4))


def test_walk_and_commit_reject_bad_inputs():
    tree = dd.build_tree(torch.randn(2, 3, 10), dd.TreeSpec(budget=4))
    with pytest.raises(ValueError, match="target_tokens"):
        dd.walk_tree(tree, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="integer"):
        dd.walk_tree(tree, torch.zeros(2, 5))
    walk = dd.walk_tree(tree, torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="start"):
        dd.commit_plan(walk, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="build_tree|TreeSpec"):
        dd.build_tree(torch.randn(1, 2, 3), {"budget": 4})


def test_ancestor_closure_padding_rows_are_empty():
    parents = torch.tensor([[-1, 0, 1, -1, -1]])
    mask = ancestor_closure(parents, 4)
    assert mask[0, 2].tolist() == [True, True, True, False, False]
    assert not mask[0, 3:].any()


def _vllm_align_snapshot(nc: int, accepted: int, bs: int) -> int:
    """vLLM's align postprocess (0.32 `v1/worker/mamba_utils.py` postprocess_mamba_fused_kernel), for a
    verify whose first token sits at position nc: -1 (no copy) or the chain column it copies into the
    block the step completed."""
    running = nc + 1  # num_computed + num_scheduled - num_draft: the root is computed
    new_nc = running + accepted - 1
    aligned = (new_nc // bs) * bs
    if aligned < running:
        return -1
    return aligned - running  # bias: the column of the block-completing token


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 600), st.integers(0, 17)), min_size=1, max_size=8),
       st.sampled_from([1, 2, 16, 64, 128, 256]))
def test_block_boundary_depth_matches_vllms_align_postprocess(rows, bs):
    from ddtree_compile.core.commit import block_boundary_depth

    start = torch.tensor([nc for nc, _ in rows])
    n = torch.tensor([a for _, a in rows], dtype=torch.int32)
    got = block_boundary_depth(start, n, bs)
    want = [_vllm_align_snapshot(nc, a, bs) if a > 0 else -1 for nc, a in rows]
    assert got.dtype == torch.int32 and got.tolist() == want
    assert all(-1 <= d < max(a, 1) for d, (_, a) in zip(got.tolist(), rows))  # inside the path


def test_block_boundary_depth_rejects_a_bad_block_size():
    from ddtree_compile.core.commit import block_boundary_depth

    for bad in (0, -16, 1.5, True):
        with pytest.raises(ValueError, match="block_size must be an int >= 1"):
            block_boundary_depth(torch.tensor([3]), torch.tensor([2], dtype=torch.int32), bad)
