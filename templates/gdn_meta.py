"""Per-step tree metadata for the GatedDeltaNet layers: built ONCE per step, shared by all layers.

Input: `parents` [R, N] (slot 0 the root with parent -1, nodes with parent < self, padding slots
with parent -1). Output (`GdnTreeMeta`, int32 device tensors, fixed shapes, no host sync):

- `conv_anc` [R, N, W-1]: the w-th entry is the (w+1)-th conv predecessor of a slot along its
  ancestry: a code >= 0 is a tree slot, a code -j < 0 is the j-th newest committed history column
  (-1 = the newest). Padding slots read like the root (history only).
- `walk` [R, N, 4]: the recurrence visit order, one row per position k: (slot, parent, depth,
  flags). Live slots come in DFS preorder (children in slot order), padding last. In preorder the
  parent of position k is position k-1 unless the walk backtracks, so the kernel keeps the state in
  registers and only reloads at backtracks, from a per-depth fp32 stack whose size depends on the
  tree depth, not on the budget.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ddtree_compile.core.tree import ancestor_closure

WALK_FIELDS = 4
F_FROM_COMMITTED = 1  # parent -1 (the root): start from the request's committed state
F_RELOAD = 2  # parent is not the previous position: reload its state from stack[depth - 1]
F_SAVE = 4  # two or more live children: save the state to stack[depth]
F_PAD = 8  # padding slot: zero output, no state


@dataclass
class GdnTreeMeta:
    conv_anc: torch.Tensor  # int32 [R, N, W-1]
    walk: torch.Tensor  # int32 [R, N, 4]
    width: int  # conv kernel width W
    max_depth: int  # static bound on tree depth; the stack needs max_depth levels

    @property
    def num_requests(self) -> int:
        return self.walk.shape[0]

    @property
    def num_slots(self) -> int:
        return self.walk.shape[1]


def _check_width(width: int) -> None:
    if width not in (2, 3, 4):
        raise ValueError(f"width (conv kernel size) must be 2, 3 or 4, got {width}")


def conv_ancestors(parents: torch.Tensor, width: int) -> torch.Tensor:
    """int32 [R, N, W-1] conv predecessor codes (see module docstring)."""
    _check_width(width)
    parents = parents.long()
    cur = torch.arange(parents.shape[1], device=parents.device).expand_as(parents)
    cols = []
    for _ in range(width - 1):
        up = torch.gather(parents, 1, cur.clamp(min=0))
        # Above the root the walk continues into the history: -1, -2, ...
        cur = torch.where(cur >= 0, up, cur - 1)
        cols.append(cur)
    return torch.stack(cols, -1).to(torch.int32)


def build_gdn_meta(parents: torch.Tensor, width: int, max_depth: int | None = None) -> GdnTreeMeta:
    """Build the GDN metadata for one step. `max_depth` is a static bound (default N-1)."""
    if parents.dim() != 2:
        raise ValueError(f"parents must be [R, N], got shape {tuple(parents.shape)}")
    R, N = parents.shape
    if max_depth is None:
        max_depth = N - 1
    parents = parents.long()
    dev = parents.device
    idx = torch.arange(N, device=dev)
    live = (parents >= 0) | (idx == 0)
    anc = ancestor_closure(parents, max_depth)  # [R, i, a]: a is i or an ancestor of i
    depth = (anc.sum(-1) - 1).clamp(min=0)
    size = anc.sum(1)  # subtree size of each slot
    nchild = (parents.unsqueeze(-1) == idx).sum(1)
    # Preorder position = depth + sizes of the earlier siblings of every ancestor-or-self.
    sib = (parents.unsqueeze(-1) == parents.unsqueeze(1)) & (idx.view(1, 1, N) < idx.view(1, N, 1))
    sib &= (parents >= 0).unsqueeze(-1) & live.unsqueeze(1)
    offs = (sib.long() * size.unsqueeze(1)).sum(-1)
    pos = depth + (anc.long() * offs.unsqueeze(1)).sum(-1)
    n_live = live.sum(-1, keepdim=True)
    pad_rank = torch.cumsum((~live).long(), -1) - 1
    pos = torch.where(live, pos, n_live + pad_rank)
    order = torch.empty_like(pos).scatter_(1, pos, idx.expand(R, N).contiguous())

    par = torch.gather(parents, 1, order)
    dep = torch.gather(depth, 1, order)
    lv = torch.gather(live, 1, order)
    prev = torch.cat([torch.full_like(order[:, :1], -2), order[:, :-1]], 1)
    flags = torch.where(lv & (par < 0), F_FROM_COMMITTED, 0)
    flags |= torch.where(lv & (par >= 0) & (par != prev), F_RELOAD, 0)
    flags |= torch.where(lv & (torch.gather(nchild, 1, order) >= 2), F_SAVE, 0)
    flags |= torch.where(~lv, F_PAD, 0)
    walk = torch.stack([order, par, dep, flags], -1).to(torch.int32).contiguous()
    return GdnTreeMeta(conv_ancestors(parents, width).contiguous(), walk, width, max_depth)


def validate_tree(parents: torch.Tensor, max_depth: int | None = None) -> None:
    """Reject bad tree metadata with a ValueError (host sync: tests and debug mode only)."""
    if parents.dim() != 2 or parents.shape[1] < 1:
        raise ValueError(f"parents must be [R, N] with N >= 1, got shape {tuple(parents.shape)}")
    if parents.dtype.is_floating_point or parents.dtype == torch.bool:
        raise ValueError(f"parents must be an integer tensor, got {parents.dtype}")
    p = parents.detach().long().cpu()
    R, N = p.shape
    for r in range(R):
        if p[r, 0] != -1:
            raise ValueError(f"request {r}: the root (slot 0) must have parent -1, got {int(p[r, 0])}")
        depth = [0] * N
        live = [True] + [False] * (N - 1)
        for i in range(1, N):
            q = int(p[r, i])
            if q < -1 or q >= N:
                raise ValueError(f"request {r}: slot {i} has parent {q}; allowed -1 (padding) or 0..{N - 1}")
            if q >= i:
                raise ValueError(f"request {r}: slot {i} has parent {q} >= itself; parents must come first")
            if q >= 0:
                if not live[q]:
                    raise ValueError(f"request {r}: slot {i} has parent {q}, which is a padding slot")
                live[i], depth[i] = True, depth[q] + 1
                if max_depth is not None and depth[i] > max_depth:
                    raise ValueError(f"request {r}: slot {i} has depth {depth[i]} > max_depth {max_depth}")


def validate_path(accepted: torch.Tensor, path_len: torch.Tensor, parents: torch.Tensor) -> None:
    """Reject a bad walk result: accepted [R, L+1] slots (root first, -1 padded), path_len [R]."""
    if accepted.dim() != 2 or path_len.shape != (accepted.shape[0],):
        raise ValueError(f"accepted must be [R, L+1] and path_len [R], got {tuple(accepted.shape)}, "
                         f"{tuple(path_len.shape)}")
    if accepted.shape[0] != parents.shape[0]:
        raise ValueError(f"accepted has {accepted.shape[0]} requests, parents {parents.shape[0]}")
    a, n, p = accepted.long().cpu(), path_len.long().cpu(), parents.long().cpu()
    N, L1 = p.shape[1], a.shape[1]
    for r in range(a.shape[0]):
        m = int(n[r])
        if not 0 <= m <= L1:
            raise ValueError(f"request {r}: path_len {m} not in 0..{L1}")
        if m and a[r, 0] != 0:
            raise ValueError(f"request {r}: the accepted path must start at the root (slot 0), got {int(a[r, 0])}")
        for j in range(1, m):
            s = int(a[r, j])
            if not 0 < s < N:
                raise ValueError(f"request {r}: accepted[{j}] = {s}; allowed slots 1..{N - 1}")
            if p[r, s] != a[r, j - 1]:
                raise ValueError(f"request {r}: accepted[{j}] = {s} is not a child of {int(a[r, j - 1])}")
        if (a[r, m:] != -1).any():
            raise ValueError(f"request {r}: accepted entries past path_len must be -1")
