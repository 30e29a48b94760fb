"""Round step 3 (walk): follow the target's tokens down the verified tree, on the device.

Node j is on the accepted path iff, for j and each of its in-tree ancestors a, the target's
token at a's parent equals a's token (and a is the first such sibling). That is one masked
reduction over the ancestor mask: no loop over depths, no host sync. On CUDA the same walk is one
Triton program per request (templates/tree_walk.py) instead of ~70 small ops.
"""

from __future__ import annotations

import torch

from ddtree_compile.core.dispatch import check_impl, use_triton
from ddtree_compile.core.tree import TreeBatch, WalkResult


def walk_tree(tree: TreeBatch, target_tokens: torch.Tensor, impl: str = "auto",
              top1: torch.Tensor | None = None) -> WalkResult:
    """Accept the longest root path the target agrees with, plus one bonus token; also the
    drafter's next input order (`drafter_order`) and, given the drafter's top-1 chain top1 [R, L],
    the accepted nodes off it (`accepted_off_chain`).

    impl: "torch" (the reference below), "triton" (templates/tree_walk.py), or "auto" (Triton for
    CUDA tensors, else torch).
    """
    check_impl(impl)
    R, N = tree.tokens.shape
    if not isinstance(target_tokens, torch.Tensor) or target_tokens.shape != (R, N):
        shape = tuple(target_tokens.shape) if isinstance(target_tokens, torch.Tensor) else type(target_tokens)
        raise ValueError(f"target_tokens must be a tensor of shape [R, B+1] = {(R, N)}, got {shape}")
    if target_tokens.dtype.is_floating_point:
        raise ValueError(f"target_tokens must hold token ids (integer dtype), got {target_tokens.dtype}")
    if top1 is not None and (top1.dim() != 2 or top1.shape[0] != R or top1.dtype.is_floating_point):
        raise ValueError(f"top1 must hold token ids of shape [R, L] with R = {R}, got {top1.dtype} {tuple(top1.shape)}")
    if use_triton(tree.tokens, impl, "tree_walk", (N,)):
        from ddtree_compile.templates.tree_walk import walk_tree_triton

        return walk_tree_triton(tree, target_tokens, top1=top1)
    target = target_tokens.long()
    live = tree.live()
    idx = torch.arange(N, device=tree.tokens.device)
    parent = tree.parents.clamp(min=0)
    match = live & (idx > 0) & (tree.tokens == target.gather(1, parent))
    # A parent's first matching child wins (only matters if a drafter repeats a token among siblings).
    same_parent = (tree.parents.unsqueeze(2) == tree.parents.unsqueeze(1)) & (idx.view(1, 1, N) < idx.view(1, N, 1))
    match &= ~(same_parent & match.unsqueeze(1)).any(-1)
    good = match | (idx == 0)
    mask = tree.ancestor_mask()
    on_path = live & ~(mask & ~good.unsqueeze(1)).any(-1)

    L1 = tree.max_depth + 1
    accepted = torch.full((R, L1 + 1), -1, dtype=torch.int64, device=idx.device)  # spare column: sink
    depth_col = torch.where(on_path, tree.depths, torch.full_like(tree.depths, L1))
    accepted.scatter_(1, depth_col, torch.where(on_path, idx.expand(R, -1), -1))
    accepted = accepted[:, :L1].contiguous()
    num_accepted = on_path.sum(-1)
    last = accepted.gather(1, (num_accepted - 1).unsqueeze(1))
    bonus = target.gather(1, last).squeeze(1)

    path_tokens = tree.tokens.gather(1, accepted[:, 1:].clamp(min=0))  # [R, L]
    path_tokens = torch.cat([path_tokens, torch.full_like(path_tokens[:, :1], -1)], dim=1)
    pos = torch.arange(L1, device=idx.device).unsqueeze(0)
    n1 = (num_accepted - 1).unsqueeze(1)
    tokens = torch.where(pos < n1, path_tokens, torch.where(pos == n1, bonus.unsqueeze(1), -1))
    walk = WalkResult(accepted, num_accepted, bonus, tokens)
    walk.order = drafter_order(accepted, N)
    walk.off_chain = None if top1 is None else accepted_off_chain(walk, top1)
    return walk


def drafter_order(accepted: torch.Tensor, N: int) -> torch.Tensor:
    """int64 [R*N]: the rows of the verify's R x N slots that the drafter reads next, per request the
    accepted path first (root, depth 1, ...: `accepted` [R, W] as in WalkResult), then the other
    slots in slot order, offset by r * N.
    With flat positions, rows 0..a of a request then carry the path at start..start+a, which is what
    the drafter's context K/V must see."""
    R, W = accepted.shape
    dev = accepted.device
    slot = torch.arange(N, device=dev).expand(R, N)
    acc = accepted
    key = torch.full((R, N + 1), 2 * N, dtype=torch.int64, device=dev)  # column N: sink
    depth = torch.arange(W, device=dev).expand(R, W)
    key.scatter_(1, torch.where(acc >= 0, acc, N), torch.where(acc >= 0, depth, 2 * N))
    key = torch.where(key[:, :N] >= 2 * N, N + slot, key[:, :N])
    return (key.argsort(1) + torch.arange(R, device=dev).unsqueeze(1) * N).reshape(-1)


def accepted_off_chain(walk: WalkResult, top1: torch.Tensor) -> torch.Tensor:
    """int64 [R]: accepted nodes off the drafter's top-1 chain (the nodes flat DFlash could not have
    accepted from the same drafts). A path node is on the chain iff it and every node above it
    carries the drafter's argmax of its depth, so only the path's own tokens are read: the path at
    depth d is walk.tokens[:, d - 1], and paths are at most L deep (the drafter's positions)."""
    W = min(walk.tokens.shape[1], top1.shape[1])
    on_chain = (walk.tokens[:, :W] == top1[:, :W]).cumprod(1)
    depth = torch.arange(W, device=top1.device)
    return ((depth < (walk.num_accepted - 1).unsqueeze(1)) & (on_chain == 0)).sum(1)
