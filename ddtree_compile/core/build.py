"""Round step 1 (build): draft distributions -> a fixed-shape TreeBatch, on the device.

DDTree's tree is the best-first enumeration of rank paths (r_1..r_d), r_i < top_k, scored by
score = sum_i log q_i(r_i), popped from a heap with ties broken by the rank tuple (a prefix before
its extensions). Because a child never scores above its parent, the first B pops are exactly
the B best paths in the order (score desc, rank tuple asc), and that set is prefix-closed.

We compute that set without a heap and without a host sync:
  * depth by depth, keep the best B paths of that depth (the depth-d members of the answer
    are extensions of the depth-(d-1) members, so a beam of width B per depth is exact);
  * number the union of the beams in rank-tuple (pre-)order from subtree sizes;
  * take the best B of the union by (score, pre-order) with one top-k on a packed int64 key.
With `chain_seed` the top-1 chain carries a flag bit above the score, so it is always kept
and comes first; the remaining nodes are the best other paths, as in Lucebox's seeded heap.
"""

from __future__ import annotations

import torch

from ddtree_compile.core.dispatch import check_impl, use_triton
from ddtree_compile.core.spec import TreeSpec
from ddtree_compile.core.tree import PAD_TOKEN, TreeBatch, ancestor_closure, pack_bits

_IDX_BITS = 20  # beam index / pre-order fit below 2**20 because budget <= 1024
_SCORE_SHIFT = _IDX_BITS
_CHAIN_SHIFT = 62


def draft_topk(draft_logits: torch.Tensor, spec: TreeSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position top-k of the drafter: (log-probs [R, L, K], token ids [R, L, K]), ranks sorted.

    Log-probs are log_softmax(logits * (1 / temperature)) over the full vocabulary, in float32.
    Ranks follow (logit desc, token id asc): equal logits rank the lower id first (the Triton
    kernel in templates/draft_topk.py uses the same packed key, so both agree on ties).
    """
    _check_logits(draft_logits)
    logits = draft_logits.float() * (1.0 / spec.temperature)
    k = min(spec.top_k, logits.shape[-1], spec.budget)  # rank r needs r better siblings in the tree
    ids = _stable_topk_ids(logits, k)
    return logits.gather(-1, ids) - torch.logsumexp(logits, dim=-1, keepdim=True), ids


def topk_of(draft_logits: torch.Tensor, spec: TreeSpec, impl: str = "auto",
            out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`draft_topk` of every position of logits [R, L, V]: the Triton kernel (templates/draft_topk.py)
    for CUDA tensors where it serves the shape, else the torch reference; written into `out`
    ((log-probs fp32, ids int64) [R, L, k]) when given. Device work only (a CUDA graph may hold it)."""
    check_impl(impl)
    k = min(spec.top_k, draft_logits.shape[-1], spec.budget)
    if _triton_topk(draft_logits, spec, impl):
        from ddtree_compile.templates.draft_topk import draft_topk_triton

        return draft_topk_triton(draft_logits, spec.temperature, k, out=out)
    lp, ids = draft_topk(draft_logits, spec)
    if out is None:
        return lp, ids
    out[0].copy_(lp)
    out[1].copy_(ids)
    return out


def _stable_topk_ids(x: torch.Tensor, k: int) -> torch.Tensor:
    """Ids of the k largest x per row in (value desc, id asc) order (-0.0 ties with +0.0)."""
    if x.device.type == "cpu":  # a host-side branch is free here: skip the int64 key unless it matters
        vals, ids = x.topk(min(k + 1, x.shape[-1]), dim=-1)
        if k == x.shape[-1] or bool((vals[..., k - 1] > vals[..., k]).all()):  # the top-k set is unique
            ids = ids[..., :k].sort(dim=-1).values  # order it by (value desc, id asc)
            return ids.gather(-1, x.gather(-1, ids).sort(dim=-1, descending=True, stable=True).indices)
    return _packed_topk_ids(x, k)


def _packed_topk_ids(x: torch.Tensor, k: int) -> torch.Tensor:
    """_stable_topk_ids via one unique int64 key per element (order-preserving value bits, then V-1-id)."""
    V = x.shape[-1]
    bits = torch.where(x == 0, 0, x.view(torch.int32))  # -0.0 ties with +0.0
    key = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(torch.int64) << 32
    key |= (V - 1) - torch.arange(V, device=x.device)
    return (V - 1) - (key.topk(k, dim=-1).values & 0xFFFFFFFF)


def build_tree(draft, spec: TreeSpec, impl: str = "auto", out: TreeBatch | None = None) -> TreeBatch:
    """Build R trees from draft logits [R, L, V] or a precomputed (log_probs, token_ids) [R, L, K].

    impl: "torch" (the reference), "triton" (the kernels in templates/, which must support the
    shape), or "auto" (Triton for CUDA tensors when it supports the shape, else torch).
    out: a TreeBatch of contiguous [R, budget + 1] tensors to write into (fixed addresses: a CUDA
    graph may hold the build), returned.
    """
    if not isinstance(spec, TreeSpec):
        raise ValueError(f"spec must be a ddtree_compile.TreeSpec, got {type(spec).__name__}")
    check_impl(impl)
    if isinstance(draft, (tuple, list)):
        if len(draft) != 2:
            raise ValueError("draft top-k must be a pair (log_probs [R, L, K], token_ids [R, L, K])")
        log_probs, token_ids = draft
        _check_topk(log_probs, token_ids)
        k = min(spec.top_k, log_probs.shape[-1], spec.budget)
        log_probs, token_ids = log_probs[..., :k].float(), token_ids[..., :k]
    elif _triton_topk(draft, spec, impl):
        from ddtree_compile.templates.draft_topk import draft_topk_triton

        k = min(spec.top_k, draft.shape[-1], spec.budget)
        depth = spec.depth_limit(draft.shape[1])  # rows past the depth limit are never used
        log_probs, token_ids = draft_topk_triton(draft[:, :depth], spec.temperature, k)
    else:
        log_probs, token_ids = draft_topk(draft, spec)
    depth = spec.depth_limit(log_probs.shape[1])
    lq, ids = log_probs[:, :depth], token_ids[:, :depth]
    if use_triton(lq, impl, "tree_build", (spec.budget, lq.shape[2], depth)):
        from ddtree_compile.templates.tree_build import build_tree_triton

        return build_tree_triton(lq, ids, spec.budget, spec.chain_seed, out=out)
    tree = _build(lq, ids, spec.budget, spec.chain_seed)
    if out is None:
        return tree
    for name in ("tokens", "parents", "depths", "scores", "num_nodes", "ancestor_bits"):
        getattr(out, name).copy_(getattr(tree, name))
    out.max_depth = tree.max_depth
    return out


def _triton_topk(draft, spec: TreeSpec, impl: str) -> bool:
    _check_logits(draft)
    return use_triton(draft, impl, "draft_topk", (min(spec.top_k, draft.shape[-1], spec.budget),))


def _check_logits(x) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"draft_logits must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 3 or min(x.shape) == 0:
        raise ValueError(f"draft_logits must have shape [R, L, V] with R, L, V >= 1, got {tuple(x.shape)}")
    if not x.dtype.is_floating_point:
        raise ValueError(f"draft_logits must be a floating dtype (float32/bfloat16/float16), got {x.dtype}")


def _check_topk(lp, ids) -> None:
    if not isinstance(lp, torch.Tensor) or not isinstance(ids, torch.Tensor):
        raise ValueError("draft top-k log_probs and token_ids must be torch.Tensors")
    if lp.dim() != 3 or min(lp.shape) == 0 or ids.shape != lp.shape:
        raise ValueError(
            f"draft top-k log_probs and token_ids must both be [R, L, K] with R, L, K >= 1, "
            f"got {tuple(lp.shape)} and {tuple(ids.shape)}"
        )
    if not lp.dtype.is_floating_point or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"log_probs must be floating and token_ids int32/int64, got {lp.dtype}, {ids.dtype}")


def _ordered(score: torch.Tensor) -> torch.Tensor:
    """float32 -> int64 in [0, 2**32) with the same order (for packing into a sort key)."""
    bits = score.contiguous().view(torch.int32).to(torch.int64)
    return torch.where(bits >= 0, bits + 2**31, 2**31 - 1 - (bits & 0x7FFFFFFF))


def _key(score, valid, chain, order_idx) -> torch.Tensor:
    """int64 key: chain flag, then score, then smaller `order_idx` first; invalid -> -1."""
    key = (chain.to(torch.int64) << _CHAIN_SHIFT) | (_ordered(score) << _SCORE_SHIFT)
    key = key | ((2**_IDX_BITS - 1) - order_idx)
    return torch.where(valid, key, torch.full_like(key, -1))


def _build(lq: torch.Tensor, ids: torch.Tensor, budget: int, chain_seed: bool) -> TreeBatch:
    R, L, K = lq.shape
    W, dev = budget, lq.device
    # Depth-0 beam: only the root is live.
    score = torch.full((R, W), float("-inf"), device=dev)
    score[:, 0] = 0.0
    valid = torch.zeros(R, W, dtype=torch.bool, device=dev)
    valid[:, 0] = True
    chain = valid & chain_seed
    rank = torch.arange(K, device=dev)
    flat = torch.arange(W * K, device=dev)
    beams = []  # per depth: (parent beam pos, score, valid, chain, token), lex-sorted, invalid last
    for d in range(L):
        c_score = (score.unsqueeze(-1) + lq[:, d].unsqueeze(1)).reshape(R, W * K)
        c_valid = valid.unsqueeze(-1).expand(R, W, K).reshape(R, W * K) & (c_score > float("-inf"))
        c_chain = (chain.unsqueeze(-1) & (rank == 0)).reshape(R, W * K)
        top = _key(c_score, c_valid, c_chain, flat.expand(R, -1)).topk(W, dim=-1)
        live = top.values >= 0
        # Re-sort the kept candidates by flat index (= rank-tuple order within the depth).
        order = torch.where(live, top.indices, top.indices + W * K).sort(dim=-1).values
        live = order < W * K
        sel = order % (W * K)
        score = torch.where(live, c_score.gather(1, sel), torch.full_like(c_score[:, :W], float("-inf")))
        valid, chain = live, c_chain.gather(1, sel) & live
        token = ids[:, d].gather(1, sel % K)
        beams.append((sel // K, score, valid, chain, token))

    pre = _preorder(beams, W)
    u_parent = torch.cat([_union_parent(b[0], d, W, L) for d, b in enumerate(beams)], dim=1)
    u_score, u_valid, u_chain, u_token = (torch.cat([b[i] for b in beams], dim=1) for i in (1, 2, 3, 4))
    u_depth = torch.arange(1, L + 1, device=dev).repeat_interleave(W).expand(R, -1)

    top = _key(u_score, u_valid, u_chain, pre).topk(budget, dim=-1)
    pick, live = top.indices, top.values >= 0
    n_pick = pick.shape[1]
    slot_of = torch.full((R, L * W + 1), -1, dtype=torch.int64, device=dev)  # last column: root
    slot_of[:, L * W] = 0
    slot_of.scatter_(1, pick, torch.arange(1, n_pick + 1, device=dev).expand(R, -1).contiguous())

    N = budget + 1
    tokens = torch.full((R, N), PAD_TOKEN, dtype=torch.int64, device=dev)
    parents = torch.full((R, N), -1, dtype=torch.int64, device=dev)
    depths = torch.zeros(R, N, dtype=torch.int64, device=dev)
    scores = torch.full((R, N), float("-inf"), device=dev)
    scores[:, 0] = 0.0
    body = slice(1, n_pick + 1)
    tokens[:, body] = torch.where(live, u_token.gather(1, pick).long(), PAD_TOKEN)
    parents[:, body] = torch.where(live, slot_of.gather(1, u_parent.gather(1, pick)), -1)
    depths[:, body] = torch.where(live, u_depth.gather(1, pick), 0)
    scores[:, body] = torch.where(live, u_score.gather(1, pick), float("-inf"))
    bits = pack_bits(ancestor_closure(parents, L))
    return TreeBatch(tokens, parents, depths, scores, live.sum(-1), bits, max_depth=L)


def _union_parent(parent_pos: torch.Tensor, d: int, W: int, L: int) -> torch.Tensor:
    """Index of each depth-(d+1) node's parent in the concatenated union (the root is column L*W)."""
    return torch.full_like(parent_pos, L * W) if d == 0 else (d - 1) * W + parent_pos


def _preorder(beams, W: int) -> torch.Tensor:
    """Rank-tuple (DFS pre-order) number of every union node; the root is 0.

    Within a depth the beam is sorted by (parent's position, rank), so a parent's children are
    contiguous and siblings come in rank order; subtree sizes then give pre-order offsets.
    """
    sizes = [None] * len(beams)
    child_sum = None
    for d in range(len(beams) - 1, -1, -1):
        parent_pos, _, valid, _, _ = beams[d]
        size = valid.to(torch.int64) + (child_sum if child_sum is not None else 0)
        sizes[d] = size
        child_sum = torch.zeros_like(size).scatter_add_(1, parent_pos, size)  # per parent at d-1
    R = beams[0][1].shape[0]
    dev = beams[0][1].device
    pre_parent = torch.zeros(R, W, dtype=torch.int64, device=dev)  # the root's pre-order is 0
    offs_parent = torch.zeros(R, W, dtype=torch.int64, device=dev)
    out = []
    for d, (parent_pos, _, valid, _, _) in enumerate(beams):
        excl = torch.cumsum(sizes[d], dim=1) - sizes[d]
        pre = pre_parent.gather(1, parent_pos) + 1 + excl - offs_parent.gather(1, parent_pos)
        out.append(torch.where(valid, pre, torch.zeros_like(pre)))
        pre_parent = pre
        # Children of the parents before p occupy excl-offsets [0, offs_parent[p]).
        kids = sizes[d] - valid.to(torch.int64)
        offs_parent = torch.cumsum(kids, dim=1) - kids
    return torch.cat(out, dim=1)
