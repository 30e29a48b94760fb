"""A DDTree round on a tiny built-in example: build -> (a stand-in target) -> walk -> commit plan."""

from __future__ import annotations

import time

import torch

from ddtree_compile.core.build import build_tree
from ddtree_compile.core.commit import commit_plan
from ddtree_compile.core.spec import TreeSpec
from ddtree_compile.core.walk import walk_tree


def _render(tree, r: int, accepted: set[int]) -> list[str]:
    kids: dict[int, list[int]] = {}
    for s in range(1, int(tree.num_nodes[r]) + 1):
        kids.setdefault(int(tree.parents[r, s]), []).append(s)
    lines = []

    def visit(s: int, indent: str) -> None:
        mark = "*" if s in accepted else " "
        score = float(tree.scores[r, s])
        lines.append(f"{indent}{mark} slot {s:>2}  token {int(tree.tokens[r, s]):>4}  logq {score:7.3f}")
        for c in kids.get(s, []):
            visit(c, indent + "   ")

    visit(0, "")
    return lines


def run_round(budget: int = 12, top_k: int = 3, draft_len: int = 6, vocab: int = 64, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    spec = TreeSpec(budget=budget, top_k=top_k)
    draft_logits = torch.randn(1, draft_len, vocab, generator=gen) * 2.5
    root = torch.tensor([7])

    t0 = time.perf_counter()
    tree = build_tree(draft_logits, spec).with_root(root)
    t1 = time.perf_counter()
    # Stand-in target: at every node it wants that node's best child, except at slot 1, where it
    # wants the runner-up child, so the accepted path leaves the main chain through a sibling.
    target = torch.randint(0, vocab, tree.tokens.shape, generator=gen)
    children = [[] for _ in range(tree.num_slots)]
    for s in range(1, int(tree.num_nodes[0]) + 1):
        children[int(tree.parents[0, s])].append(s)
    for s, kids in enumerate(children):
        if kids:
            target[0, s] = tree.tokens[0, kids[1] if s == 1 and len(kids) > 1 else kids[0]]
    t2 = time.perf_counter()
    walk = walk_tree(tree, target)
    t3 = time.perf_counter()
    plan = commit_plan(walk, start=100)
    t4 = time.perf_counter()

    n = int(walk.num_accepted[0])
    path = walk.accepted[0, :n].tolist()
    print(f"DDTree round: budget={budget} top_k={top_k} draft_len={draft_len} vocab={vocab} (seed {seed})")
    print("tree (* = accepted):")
    print("\n".join(_render(tree, 0, set(path))))
    print(f"accepted slots {path}; committed tokens {walk.tokens[0, :n].tolist()} (bonus {int(walk.bonus[0])})")
    moves = [(s, d) for s, d in zip(plan.src_pos[0].tolist(), plan.dst_pos[0].tolist()) if s >= 0]
    print(f"K/V moves (cache position src -> dst): {moves or 'none (main chain)'}")
    print(f"timings (CPU): build {1e3 * (t1 - t0):.2f} ms, walk {1e3 * (t3 - t2):.2f} ms, commit plan {1e3 * (t4 - t3):.2f} ms")
    return {"path": path, "tokens": walk.tokens[0, :n].tolist(), "moves": moves}
