"""core/buckets.py: the bucket arithmetic's sympy expressions, evaluated exactly, against direct
definitions (a loop, bit lengths, explicit shapes)."""

import math

import pytest

from ddtree_compile.core import buckets


def _capacity(k, L):  # nodes of a full k-ary tree of depth L below the root
    return sum(k**d for d in range(1, L + 1))


def test_tokens_and_batch_buckets():
    assert [buckets.verify_tokens(b) for b in (1, 16, 32)] == [2, 17, 33]
    assert buckets.chain_tokens(15) == 16 and buckets.capture_tokens(4, 33) == 132
    for R in range(1, 600):
        assert buckets.batch_bucket(R) == 1 << (R.bit_length() - 1), R  # exact at every power of two
    assert buckets.batch_bucket(0) == 1  # an empty batch counts as one request
    assert buckets.batch_buckets(1) == [1] and buckets.batch_buckets(6) == [1, 2, 4, 6]
    assert buckets.batch_buckets(64) == [1, 2, 4, 8, 16, 32, 64]


@pytest.mark.parametrize("k", [1, 2, 3, 8])
@pytest.mark.parametrize("L", [1, 3, 7, 15])
def test_effective_budget_is_the_tree_capacity_capped_by_the_budget(k, L):
    for b in (1, 5, 22, 64, 1024):
        assert buckets.effective_budget(b, k, L) == min(b, _capacity(min(k, b), L)), (b, k, L)


def test_gdn_workspace_shapes():
    shapes = buckets.gdn_workspace(layers=3, requests=4, budget=16, draft_len=7, key_heads=2, key_dim=8,
                                   value_heads=4, value_dim=16)
    # the stack's levels: min(b, L) (a drafter's tree is at most L deep: its branch points lie above L)
    assert shapes == {"rec_kv": (3, 4, 17, 2 * 8 + 4 * 16), "rec_gb": (3, 4, 17, 2, 4), "stack": (4, 7, 4, 16, 8)}
    assert math.prod(shapes["stack"]) == 4 * 7 * 4 * 16 * 8
    assert buckets.gdn_workspace(3, 4, 5, 7, 2, 8, 4, 16)["stack"] == (4, 5, 4, 16, 8)  # (b < L: b levels)


@pytest.mark.parametrize("call,field", [(lambda: buckets.verify_tokens(0), "b"),
                                        (lambda: buckets.capture_tokens(2, 1.5), "q"),
                                        (lambda: buckets.effective_budget(8, True, 3), "k"),
                                        (lambda: buckets.batch_buckets(0), "--max-batch")])
def test_bad_input_names_the_field(call, field):
    with pytest.raises(ValueError, match=f"`{field}`|{field}"):
        call()
