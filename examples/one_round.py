"""One DDTree round with the public API: build a tree from draft logits, walk it, plan the commit."""

import torch

import ddtree_compile as dd

spec = dd.TreeSpec(budget=22, top_k=4)
draft_logits = torch.randn(2, 15, 1000)  # [R requests, L draft positions, V vocab]
tree = dd.build_tree(draft_logits, spec).with_root(torch.tensor([11, 42]))

target_logits = torch.randn(2, spec.num_slots, 1000)  # the target's logits at every verify slot
target_tokens = dd.sample_target_tokens(target_logits, 0.0)  # greedy; > 0 samples losslessly
walk = dd.walk_tree(tree, target_tokens)
plan = dd.commit_plan(walk, start=torch.tensor([100, 250]))

print("accepted slots", walk.accepted.tolist())
print("committed tokens", walk.tokens.tolist())
print("K/V moves", plan.src_pos.tolist(), "->", plan.dst_pos.tolist())
