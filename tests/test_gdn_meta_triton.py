"""The one-launch GDN tree metadata (gdn_meta_triton, TRITON_INTERPRET=1 in a subprocess) equals the
torch reference `build_gdn_meta` exactly, both tensors, padding rows included, written into buffers
poisoned first: best-first-like trees with padding at the end, chains, stars, deep and bushy trees,
several requests of different shapes per launch, conv widths 2..4, max_depth N-1 and the tree's own
depth (the tightest bound that covers it).
"""

from __future__ import annotations

import heapq
import json
import math
import random

import pytest
import torch
from _gdn_common import KINDS, random_parents  # sets TRITON_INTERPRET for the in-process checks
from _interp import run_interpreted

POISON = -7
SIZES = (2, 3, 9, 17, 33, 65)


def best_first_parents(n: int, n_live: int, rng: random.Random, top_k: int) -> list[int]:
    """A tree grown like the drafter's: each node offers top_k children with falling scores and the
    best open candidate becomes the next slot (so siblings are far apart in slot order)."""
    p = [-1] * n
    heap = [(-math.log(rng.random() + 1e-9) * (j + 1), 0) for j in range(top_k)]
    heapq.heapify(heap)
    for i in range(1, n_live):
        cost, parent = heapq.heappop(heap)
        p[i] = parent
        for j in range(top_k):
            heapq.heappush(heap, (cost - math.log(rng.random() + 1e-9) * (j + 1), i))
    return p


def depth_of(p: list[int]) -> int:
    d = [0] * len(p)
    for i in range(1, len(p)):
        d[i] = d[p[i]] + 1 if p[i] >= 0 else 0
    return max(d)


def make_parents(name: str) -> tuple[torch.Tensor, int, int]:
    """(parents [R, N], width, max_depth) of a case named '<shape>_N<n>_R<r>_W<w>_<bound>'."""
    shape, n, r, w, bound = name.split("_")
    N, R, W = int(n[1:]), int(r[1:]), int(w[1:])
    rng = random.Random(name)
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    rows = []
    for i in range(R):
        n_live = N if i == 0 or rng.random() < 0.3 else rng.randint(1, N)  # padding at the end
        kind = shape if shape != "mixed" else rng.choice(("best",) + KINDS)
        if kind == "best":
            rows.append(best_first_parents(N, n_live, rng, rng.randint(1, 4)))
        else:
            rows.append(random_parents(kind, N, n_live, gen))
    parents = torch.tensor(rows, dtype=torch.int64 if rng.random() < 0.5 else torch.int32)
    if shape == "mixed" and N > 2:  # a row-strided view
        wide = torch.full((R, N + 5), 99, dtype=parents.dtype)
        wide[:, 2:N + 2] = parents
        parents = wide[:, 2:N + 2]
    max_depth = N - 1 if bound == "full" else max(depth_of(row) for row in rows)
    return parents, W, max_depth


def _case_names() -> list[str]:
    names = []
    for k, N in enumerate(SIZES):
        for j, R in enumerate((1, 3, 5)):
            W = 2 + (k + j) % 3
            shape = ("best", "chain", "star", "mixed")[(k + j) % 4] if R < 5 else "mixed"
            names += [f"{shape}_N{N}_R{R}_W{W}_full", f"{shape}_N{N}_R{R}_W{W}_tight"]
    # budget 128, the kernel's largest tree (a 128 x 128 matrix), and a chain as deep as it holds
    names += ["best_N129_R3_W4_full", "mixed_N129_R5_W3_tight", "chain_N129_R1_W4_tight", "chain_N129_R2_W2_full"]
    return names


CASES = _case_names()


def _interp_main() -> None:
    import triton
    from triton.runtime.interpreter import InterpretedFunction

    from ddtree_compile.templates import gdn_meta_triton as gm
    from ddtree_compile.templates.gdn_meta import build_gdn_meta

    torch.set_num_threads(1)  # tiny ops: a thread pool only spins (seconds per case on a 2-core runner)
    interpreted = bool(triton.knobs.runtime.interpret) and isinstance(gm._gdn_meta_kernel, InterpretedFunction)
    results = {}
    for name in CASES:
        parents, W, max_depth = make_parents(name)
        R, N = parents.shape
        want = build_gdn_meta(parents, W, max_depth)
        conv = torch.full((R, N, W - 1), POISON, dtype=torch.int32)
        walk = torch.full((R, N, 4), POISON, dtype=torch.int32)
        got = gm.build_gdn_meta_triton(parents, W, max_depth, conv_anc=conv, walk=walk)
        fresh = gm.build_gdn_meta_triton(parents, W, None if max_depth == N - 1 else max_depth)
        bad = []
        if got.conv_anc is not conv or got.walk is not walk:
            bad.append("outputs not written into the given buffers")
        for field in ("conv_anc", "walk"):
            a, b = getattr(got, field), getattr(want, field)
            if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
                bad.append(f"{field}: got {a.tolist()} want {b.tolist()}"[:3000])
            if not torch.equal(getattr(fresh, field), b):
                bad.append(f"{field} (allocated by the launcher) differs")
        if (got.width, got.max_depth) != (want.width, want.max_depth) or fresh.max_depth != want.max_depth:
            bad.append(f"width/max_depth {got.width}/{got.max_depth} vs {want.width}/{want.max_depth}")
        results[name] = dict(interpreted=interpreted, errors=bad, depth=max_depth)
    print(json.dumps(results))


@pytest.fixture(scope="module")
def interp_results() -> dict:
    pytest.importorskip("triton")
    return run_interpreted(__file__, timeout=600)


@pytest.mark.parametrize("name", CASES)
def test_triton_meta_equals_reference(interp_results, name):
    res = interp_results[name]
    assert res["interpreted"]
    assert not res["errors"], "\n".join(res["errors"])


def test_cases_cover_the_shapes():
    """The generator gives what the cases promise: padding, branching, bounds below N-1."""
    trees = {n: make_parents(n) for n in CASES}
    rows = [row for p, _, _ in trees.values() for row in p.tolist()]
    assert any(-1 in row[1:] and row[1] >= 0 for row in rows)  # live slots, then padding
    assert any(len(set(row[1:])) == 1 and row[1] == 0 and len(row) > 10 for row in rows)  # a star
    assert any(row == list(range(-1, len(row) - 1)) and len(row) > 10 for row in rows)  # a full chain
    assert sum(md < p.shape[1] - 1 for p, _, md in trees.values()) >= 8
    assert {w for _, w, _ in trees.values()} == {2, 3, 4}


@pytest.mark.parametrize("kwargs,match", [
    (dict(parents=torch.tensor([-1, 0, 0]), width=4), r"parents must be \[R, N\], got shape \(3,\)"),
    (dict(parents=torch.tensor([[-1, 0]]), width=5), "width .conv kernel size. must be 2, 3 or 4, got 5"),
    (dict(parents=torch.tensor([[-1, 0]]), width=1), "width .conv kernel size. must be 2, 3 or 4, got 1"),
    (dict(parents=torch.tensor([[-1.0, 0.0]]), width=4), "parents must be an integer tensor, got torch.float32"),
    (dict(parents=torch.full((1, 130), -1), width=4), "trees of 130 slots; the kernel holds 1..129"),
    (dict(parents=torch.tensor([[-1, 0]]), width=4, max_depth=-1), "max_depth must be >= 0, got -1"),
    (dict(parents=torch.tensor([[-1, 0]]), width=4, walk=torch.zeros(1, 2, 4, dtype=torch.int64)),
     r"walk must be a contiguous int32 \(1, 2, 4\) tensor"),
    (dict(parents=torch.tensor([[-1, 0]]), width=3, conv_anc=torch.zeros(1, 2, 3, dtype=torch.int32)),
     r"conv_anc must be a contiguous int32 \(1, 2, 2\) tensor"),
])
def test_bad_input_is_a_clear_value_error(kwargs, match):
    gm = pytest.importorskip("ddtree_compile.templates.gdn_meta_triton")
    if gm.triton is None:
        pytest.skip("triton is not installed")
    with pytest.raises(ValueError, match=match):
        gm.build_gdn_meta_triton(**kwargs)


def test_make_gdn_meta_keeps_the_reference_on_cpu():
    from ddtree_compile.templates import gdn_step
    from ddtree_compile.templates.gdn_meta import build_gdn_meta

    parents = torch.tensor([[-1, 0, 0, 1, -1]])
    got, want = gdn_step.make_gdn_meta(parents, 3), build_gdn_meta(parents, 3)
    assert torch.equal(got.walk, want.walk) and torch.equal(got.conv_anc, want.conv_anc)


if __name__ == "__main__":
    _interp_main()
