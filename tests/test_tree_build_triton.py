"""Triton draft top-k and tree build (TRITON_INTERPRET=1, CPU tensors) vs the torch references in build.py.

The build must equal the torch build bit for bit (ties included); the top-k must give the same ids
(ties: lower token id first) and log-probs within fp32 rounding of the log-sum-exp.
"""

from __future__ import annotations

import inspect
import math
import os
import random

os.environ["TRITON_INTERPRET"] = "1"  # before the templates define their kernels

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

import ddtree_compile as dd  # noqa: E402
from ddtree_compile.core.build import _build, draft_topk  # noqa: E402
from ddtree_compile.core.tree import TreeBatch, num_mask_words  # noqa: E402
from ddtree_compile.templates import draft_topk as topk_mod  # noqa: E402
from ddtree_compile.templates import tree_build as build_mod  # noqa: E402

FIELDS = ("tokens", "parents", "depths", "scores", "num_nodes", "ancestor_bits")


@pytest.fixture(scope="module", autouse=True)
def fast_interpreter():
    """Two interpreter shortcuts with unchanged semantics (triton 3.9 internals; skipped if absent).

    tl.sort's compare-and-swap reduces with xor, which the interpreter runs as a Python loop per
    element: do it as one numpy reduce. And every nested @jit call re-patches triton.language
    (inspect.getmembers over the module): skip that while the same modules are already patched
    for the running kernel. Together they make these tests ~5x faster.
    """
    from triton.runtime import interpreter as interp

    if not (hasattr(interp, "ReduceOps") and hasattr(interp, "_patch_lang") and hasattr(tl.standard, "_xor_combine")):
        yield
        return
    orig_reduce, orig_patch, patched = interp.ReduceOps.apply_impl, interp._patch_lang, set()

    def apply_impl(self, input):
        if self.combine_fn is tl.standard._xor_combine and self.axis is not None:
            x = input[0]
            return self.to_tensor(np.bitwise_xor.reduce(x.handle.data, axis=self.axis, keepdims=self.keep_dims),
                                  x.dtype)
        return orig_reduce(self, input)

    def patch_lang(fn):
        langs = {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}
        if langs and langs <= patched:
            return interp._LangPatchScope()
        outer = not patched
        scope = orig_patch(fn)
        patched.update(langs)
        if outer:
            restore = scope.restore

            def restore_all():
                patched.clear()
                restore()

            scope.restore = restore_all
        return scope

    interp.ReduceOps.apply_impl, interp._patch_lang = apply_impl, patch_lang
    try:
        yield
    finally:
        interp.ReduceOps.apply_impl, interp._patch_lang = orig_reduce, orig_patch


def _poison_scratch():
    """Garbage in every cached scratch buffer: the kernels must not depend on a previous run."""
    for cache in (build_mod._SCRATCH, topk_mod._SCRATCH):
        for bufs in cache.values():
            for b in bufs:
                b.fill_(-123 if not b.dtype.is_floating_point else float("nan"))


def _poisoned_tree(R, budget, L):
    N, NW = budget + 1, num_mask_words(budget + 1)
    return TreeBatch(torch.full((R, N), -77, dtype=torch.int64), torch.full((R, N), -77, dtype=torch.int64),
                     torch.full((R, N), -77, dtype=torch.int64), torch.full((R, N), float("nan")),
                     torch.full((R,), -77, dtype=torch.int64), torch.full((R, N, NW), -77, dtype=torch.int32),
                     max_depth=L)


def _assert_trees_equal(got, want):
    for f in FIELDS:
        a, b = getattr(got, f), getattr(want, f)
        assert a.dtype == b.dtype and a.shape == b.shape, f
        assert torch.equal(a, b), f"{f}:\n{a}\n{b}"
    assert got.max_depth == want.max_depth


def _draft(gen, R, L, V, ties):
    if ties:  # few distinct values: many equal logits, equal scores, equal path sums
        return torch.randint(-2, 3, (R, L, V), generator=gen).float()
    return torch.randn(R, L, V, generator=gen) * 2


# (R, L, V, budget, top_k, chain_seed, ties, neg_inf): edge cases, then random ones.
EDGE = [
    (1, 1, 1, 1, 1, True, False, False),
    (2, 3, 5, 1, 3, False, True, False),
    (1, 4, 3, 40, 3, True, True, False),  # ties across 120 paths, budget 40
    (2, 2, 3, 40, 2, False, False, False),  # 2 + 4 paths < budget: padding
    (1, 5, 4, 5, 1, True, False, False),  # top-1 chain
    (2, 3, 6, 17, 4, True, True, True),  # -inf log-probs: invalid candidates
    (1, 2, 2, 33, 2, False, True, True),  # 33 slots: two mask words
]
_rng = random.Random(1234)
RANDOM = [(_rng.randint(1, 2), _rng.randint(1, 5), _rng.randint(2, 9), _rng.randint(1, 40), _rng.randint(1, 4),
           _rng.random() < 0.5, _rng.random() < 0.5, _rng.random() < 0.25) for _ in range(40)]


@pytest.mark.parametrize("case", EDGE + RANDOM, ids=lambda c: "R{}L{}V{}B{}K{}{}{}{}".format(
    *c[:5], "c" if c[5] else "", "t" if c[6] else "", "i" if c[7] else ""))
def test_build_kernel_equals_torch_build(case):
    R, L, V, budget, top_k, chain_seed, ties, neg_inf = case
    gen = torch.Generator().manual_seed(hash(case) % 2**31)
    logits = _draft(gen, R, L, V, ties)
    if neg_inf:
        logits[torch.rand(R, L, V, generator=gen) < 0.3] = float("-inf")
        logits[..., 0] = 0.0  # every row keeps a finite max
    spec = dd.TreeSpec(budget=budget, top_k=top_k, chain_seed=chain_seed)
    lq, ids = draft_topk(logits, spec)
    want = _build(lq, ids, budget, chain_seed)
    _poison_scratch()
    got = build_mod.build_tree_triton(lq, ids, budget, chain_seed, out=_poisoned_tree(R, budget, L))
    _assert_trees_equal(got, want)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_build_tree_writes_into_the_given_trees(impl):
    """core.build_tree(..., out=): every field written into the caller's tensors (fixed addresses: the
    round builds inside the drafter's CUDA graph), equal to a build without `out`."""
    gen = torch.Generator().manual_seed(3)
    spec = dd.TreeSpec(budget=9, top_k=3, chain_seed=True)
    lq, ids = draft_topk(_draft(gen, 2, 4, 40, False), spec)
    out = _poisoned_tree(2, 9, 4)
    got = dd.build_tree((lq, ids), spec, impl=impl, out=out)
    assert got is out
    _assert_trees_equal(out, _build(lq, ids, 9, True))


def test_build_kernel_equals_torch_on_unnormalised_log_probs():
    """Positive precomputed log-probs: a child can outrank its parent; both builds then agree anyway."""
    gen = torch.Generator().manual_seed(5)
    for i in range(4):
        lq = torch.randn(2, 4, 3, generator=gen).sort(-1, descending=True).values
        ids = torch.randint(0, 100, (2, 4, 3), generator=gen)
        budget, chain_seed = 6 + 3 * i, i % 2 == 0
        got = build_mod.build_tree_triton(lq, ids, budget, chain_seed)
        _assert_trees_equal(got, _build(lq, ids, budget, chain_seed))


def test_build_kernel_strided_int32_ids_and_max_depth():
    gen = torch.Generator().manual_seed(7)
    logits = _draft(gen, 2, 6, 8, ties=True)
    spec = dd.TreeSpec(budget=12, top_k=3, max_depth=3, chain_seed=False)
    lq, ids = draft_topk(logits, spec)
    big_lq = torch.full((2, 6, 5), float("nan"))
    big_lq[..., :3] = lq
    lq_v, ids_v = big_lq[:, :3, :3], ids.int()[:, :3]  # non-contiguous log-probs, int32 ids
    _poison_scratch()
    got = build_mod.build_tree_triton(lq_v, ids_v, 12, False)
    _assert_trees_equal(got, dd.build_tree(logits, spec, impl="torch"))


@pytest.mark.parametrize("chain_seed", [True, False])
def test_build_tree_dispatch_triton_end_to_end(chain_seed):
    """build_tree(impl="triton"): top-k kernel on the depth-limited rows, then the build kernel."""
    gen = torch.Generator().manual_seed(11)
    logits = _draft(gen, 2, 5, 300, ties=False).to(torch.bfloat16)
    spec = dd.TreeSpec(budget=14, top_k=4, temperature=0.7, max_depth=4, chain_seed=chain_seed)
    got = dd.build_tree(logits, spec, impl="triton")
    lq, ids = topk_mod.draft_topk_triton(logits[:, :4], 0.7, 4)
    _assert_trees_equal(got, dd.build_tree((lq, ids), spec, impl="torch"))
    ref = dd.build_tree(logits, spec, impl="torch")  # float logits: no near-ties, same tree
    for f in ("tokens", "parents", "depths", "num_nodes", "ancestor_bits"):
        assert torch.equal(getattr(got, f), getattr(ref, f)), f
    torch.testing.assert_close(got.scores, ref.scores, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- draft top-k

TOPK_CASES = [  # (R, L, V, k, dtype, ties, temperature, block, splits, pipe)
    (2, 3, 1000, 8, torch.float32, False, 1.0, 128, None, 2),
    (1, 2, 1000, 8, torch.bfloat16, False, 0.6, 128, 3, 1),
    (2, 2, 700, 32, torch.float16, False, 1.3, 64, 1, 0),
    (2, 2, 500, 5, torch.float32, True, 1.0, 64, 4, 2),  # integer logits: ties everywhere
    (1, 3, 300, 7, torch.bfloat16, True, 0.5, 64, 1, 1),
    (1, 1, 1, 1, torch.float32, False, 1.0, None, None, None),
    (2, 1, 30, 30, torch.float32, True, 2.0, 16, 2, 2),  # k == V
    (1, 2, 200, 3, "ascending", False, 1.0, 32, 1, 2),  # every tile inserts (worst case for the loop)
    (1, 2, 200, 4, "neg_inf", False, 1.0, 32, 3, 0),  # -inf logits and an all -inf chunk
]


@pytest.mark.parametrize("case", TOPK_CASES, ids=lambda c: "R{}L{}V{}k{}-{}-{}-pipe{}".format(
    *c[:4], str(c[4]).replace("torch.", ""), "ties" if c[5] else "rand", c[9]))
def test_draft_topk_kernel_equals_torch(case):
    R, L, V, k, dtype, ties, temperature, block, splits, pipe = case
    gen = torch.Generator().manual_seed(V + k)
    if dtype == "ascending":
        logits = torch.linspace(-3, 3, V).expand(R, L, V).contiguous()
    elif dtype == "neg_inf":
        logits = torch.randn(R, L, V, generator=gen)
        logits[..., : V // 2] = float("-inf")
        logits[..., 7] = 1.0
    else:
        logits = _draft(gen, R, L, V, ties).to(dtype)
    spec = dd.TreeSpec(budget=64, top_k=k, temperature=temperature)
    want_lq, want_ids = draft_topk(logits, spec)
    out = (torch.full((R, L, k), float("nan")), torch.full((R, L, k), -5, dtype=torch.int64))
    _poison_scratch()
    lq, ids = topk_mod.draft_topk_triton(logits, temperature, k, block=block, splits=splits, pipe=pipe, out=out)
    assert lq is out[0] and ids is out[1]
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(lq, want_lq, rtol=1e-5, atol=1e-5)


def test_draft_topk_kernel_strided_view():
    gen = torch.Generator().manual_seed(3)
    full = torch.randint(-3, 4, (2, 5, 260), generator=gen).to(torch.bfloat16)
    view = full[:, 1:4]  # rows of a larger tensor
    lq, ids = topk_mod.draft_topk_triton(view, 1.0, 6, block=64, splits=2)
    want_lq, want_ids = draft_topk(view, dd.TreeSpec(budget=8, top_k=6))
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(lq, want_lq, rtol=1e-5, atol=1e-5)


def test_torch_reference_cpu_shortcut_equals_packed_key():
    """On CPU the reference skips the int64 key when the top-k set is unique; both must agree."""
    from ddtree_compile.core.build import _packed_topk_ids, _stable_topk_ids

    gen = torch.Generator().manual_seed(0)
    for i in range(200):
        V = int(torch.randint(1, 40, (), generator=gen))
        k = int(torch.randint(1, V + 1, (), generator=gen))
        x = torch.randint(-2, 3, (3, 4, V), generator=gen).float()
        if i % 3 == 0:
            x = torch.randn(3, 4, V, generator=gen)
        if i % 5 == 0:
            x[x == 0] = -0.0
        if i % 7 == 0:
            x[..., ::2] = float("-inf")
        assert torch.equal(_stable_topk_ids(x, k), _packed_topk_ids(x, k)), i


def test_torch_reference_breaks_ties_by_lower_token_id():
    logits = torch.tensor([[[1.0, 3.0, 3.0, 2.0, 3.0, -0.0, 0.0]]])
    lq, ids = draft_topk(logits, dd.TreeSpec(budget=8, top_k=7))
    assert ids.flatten().tolist() == [1, 2, 4, 3, 0, 5, 6]
    assert torch.equal(lq, torch.log_softmax(logits, -1).gather(-1, ids))


# ---------------------------------------------------------------- validation and dispatch

def test_kernels_reject_unsupported_shapes():
    with pytest.raises(ValueError, match="`k` must be an int in"):
        topk_mod.draft_topk_triton(torch.randn(1, 2, 100), 1.0, 33)
    with pytest.raises(ValueError, match="`k`"):
        topk_mod.draft_topk_triton(torch.randn(1, 2, 4), 1.0, 5)
    with pytest.raises(ValueError, match="dtype"):
        topk_mod.draft_topk_triton(torch.zeros(1, 2, 4, dtype=torch.int32), 1.0, 2)
    with pytest.raises(ValueError, match="`pipe`"):
        topk_mod.draft_topk_triton(torch.zeros(1, 2, 4), 1.0, 2, pipe=3)
    lq, ids = torch.zeros(1, 2, 32), torch.zeros(1, 2, 32, dtype=torch.long)
    with pytest.raises(ValueError, match="budget\\*K"):
        build_mod.build_tree_triton(lq, ids, 1024, True)
    with pytest.raises(ValueError, match="token_ids"):
        build_mod.build_tree_triton(lq, ids.float(), 4, True)
    with pytest.raises(ValueError, match="out.scores"):
        bad = _poisoned_tree(1, 4, 2)
        bad.scores = bad.scores.double()
        build_mod.build_tree_triton(lq[..., :2], ids[..., :2], 4, True, out=bad)
    assert not build_mod.supports(1024, 32, 15) and build_mod.supports(64, 8, 15)
    assert topk_mod.supports(32) and not topk_mod.supports(33)


def test_build_tree_impl_argument():
    logits = torch.randn(1, 3, 50)
    with pytest.raises(ValueError, match="impl must be one of"):
        dd.build_tree(logits, dd.TreeSpec(budget=4), impl="cuda")
    with pytest.raises(ValueError, match="does not support"):
        dd.build_tree(logits, dd.TreeSpec(budget=40, top_k=40), impl="triton")  # k = 40 > 32
    # "auto" on CPU tensors is the torch path; large top_k falls back without error.
    _assert_trees_equal(dd.build_tree(logits, dd.TreeSpec(budget=40, top_k=40)),
                        dd.build_tree(logits, dd.TreeSpec(budget=40, top_k=40), impl="torch"))
    assert math.isfinite(float(dd.build_tree(logits, dd.TreeSpec(budget=4), impl="triton").scores[0, 1]))


@pytest.mark.parametrize("depth,vocab", [(15, 151936), (7, 300), (16, 248320)])
def test_variant_batches_cover_every_batch_size(monkeypatch, depth, vocab):
    """The warm-up's batch sizes (BuildStage._warm_up): every batch size's launch shares every
    compile-relevant parameter with one of them (the H100's SM count; the plan follows the batch)."""
    monkeypatch.setattr(topk_mod.tuning, "arch_of", lambda device: ("sm_90", 132))
    dev = torch.device("cpu")
    sizes = topk_mod.variant_batches(64, depth, vocab, dev)
    assert sizes[0] == 1 and sizes == sorted(set(sizes))

    def launch(R):  # what the kernels are compiled for: constexprs, warps, and splits' int specialization
        block, chunk, splits, warps, pipe = topk_mod.plan_topk(R * depth, vocab, dev)
        sp = None if splits == 1 else 1 << (splits - 1).bit_length()
        return block, warps, pipe, splits == 1, splits % 16 == 0, chunk % 16 == 0, sp

    reps = {launch(r): r for r in sizes}
    assert len(reps) == len(sizes)  # one batch size per variant
    for R in range(1, 65):
        assert launch(R) in reps and reps[launch(R)] <= R, R
    if vocab > 100_000:  # the vocabulary is split across the SMs at small batches: several merge widths
        assert len(sizes) >= 4
