"""The fixed-shape tree batch that one DDTree round passes from build to verify to walk, and the
walk's result (core/walk.py computes it, templates/tree_walk.py too) that commit reads.

Layout per request (N = budget + 1 slots):
  slot 0      the root: the last committed token (depth 0, parent -1)
  slots 1..n  the tree's nodes, parents before children (n = num_nodes[r] <= budget)
  slots n+1.. padding: parent -1, depth 0, token `PAD_TOKEN`, score -inf; they see nothing
              (all-zero ancestor row) and nobody sees them.

`ancestor_bits[r, i, w]` packs the ancestor-or-self set of slot i: bit (j % 32) of word
(j // 32) is set iff j == i or j is an ancestor of i (the root is every node's ancestor).
Bit 31 is stored as the int32 sign bit. Kernels read these words directly, so the verify
never builds a dense mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PAD_TOKEN = 0


def num_mask_words(num_slots: int) -> int:
    """int32 words per row of the packed ancestor mask."""
    return (num_slots + 31) // 32


def ancestor_closure(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """Bool [R, N, N]: row i is True at i and at every ancestor of i; padding rows are empty.

    `parents` is [R, N] with -1 for the root and padding. Padding is recognised as a slot other
    than 0 whose parent is -1. `max_depth` bounds the walk up the tree (no host sync).
    """
    R, N = parents.shape
    idx = torch.arange(N, device=parents.device)
    live = (parents >= 0) | (idx == 0)
    mask = torch.zeros(R, N, N, dtype=torch.bool, device=parents.device)
    cur = idx.expand(R, N).clone()
    cur = torch.where(live, cur, torch.full_like(cur, -1))
    for _ in range(max_depth + 1):
        ok = cur >= 0
        mask |= torch.nn.functional.one_hot(cur.clamp(min=0), N).bool() & ok.unsqueeze(-1)
        cur = torch.where(ok, torch.gather(parents, 1, cur.clamp(min=0)), cur)
    return mask


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """Pack a bool [..., N] mask into int32 words [..., ceil(N/32)] (bit j%32 of word j//32)."""
    n = mask.shape[-1]
    words = num_mask_words(n)
    padded = torch.zeros(*mask.shape[:-1], words * 32, dtype=torch.int64, device=mask.device)
    padded[..., :n] = mask.to(torch.int64)
    weights = torch.ones(32, dtype=torch.int64, device=mask.device) << torch.arange(
        32, dtype=torch.int64, device=mask.device
    )
    packed = (padded.view(*mask.shape[:-1], words, 32) * weights).sum(-1)
    # Wrap to signed 32-bit so bit 31 becomes the sign bit.
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)
    return packed.to(torch.int32)


def unpack_bits(bits: torch.Tensor, num_slots: int) -> torch.Tensor:
    """Inverse of `pack_bits`: int32 [..., W] -> bool [..., num_slots]."""
    shifts = torch.arange(32, dtype=torch.int32, device=bits.device)
    unpacked = (bits.unsqueeze(-1) >> shifts) & 1
    return unpacked.flatten(-2)[..., :num_slots].bool()


@dataclass
class TreeBatch:
    """R trees of budget B in the fixed [R, B+1] layout described in the module docstring."""

    tokens: torch.Tensor  # int64 [R, N]; slot 0 is filled by the caller (`with_root`)
    parents: torch.Tensor  # int64 [R, N]; -1 for the root and padding
    depths: torch.Tensor  # int64 [R, N]; 0 for the root and padding
    scores: torch.Tensor  # float32 [R, N]; cumulative draft log-prob, root 0, padding -inf
    num_nodes: torch.Tensor  # int64 [R]; live non-root nodes
    ancestor_bits: torch.Tensor  # int32 [R, N, ceil(N/32)]
    max_depth: int  # the deepest depth any tree of this batch may have (a static bound)

    @property
    def num_requests(self) -> int:
        return self.tokens.shape[0]

    @property
    def budget(self) -> int:
        return self.tokens.shape[1] - 1

    @property
    def num_slots(self) -> int:
        return self.tokens.shape[1]

    def live(self) -> torch.Tensor:
        """Bool [R, N]: slot holds the root or a node (not padding)."""
        idx = torch.arange(self.num_slots, device=self.tokens.device)
        return idx.unsqueeze(0) <= self.num_nodes.unsqueeze(1)

    def ancestor_mask(self) -> torch.Tensor:
        """Bool [R, N, N]: row i sees column j iff j is i or an ancestor of i."""
        return unpack_bits(self.ancestor_bits, self.num_slots)

    def positions(self, start: torch.Tensor | int) -> torch.Tensor:
        """RoPE positions [R, N] = start + depth (siblings share a position)."""
        if isinstance(start, torch.Tensor):
            start = start.to(self.depths.device).view(-1, 1)
        return self.depths + start

    def prefix(self, budget: int, out: "TreeBatch | None" = None) -> "TreeBatch":
        """Each tree's first `budget` nodes, as a batch of budget + 1 slots. A best-first tree's first
        b nodes are the best-first tree of budget b (core/build.py), parents before children: one
        build serves every smaller bucket. `out`: buffers of that shape to copy them into (returned)."""
        n = budget + 1
        parts = (self.tokens[:, :n], self.parents[:, :n], self.depths[:, :n], self.scores[:, :n],
                 self.ancestor_bits[:, :n, :num_mask_words(n)])
        if out is None:
            tok, par, dep, sc, bits = (p.contiguous() for p in parts)
            return TreeBatch(tok, par, dep, sc, self.num_nodes.clamp(max=budget), bits,
                             max_depth=min(self.max_depth, budget))
        for dst, src in zip((out.tokens, out.parents, out.depths, out.scores, out.ancestor_bits), parts):
            dst.copy_(src)
        torch.clamp(self.num_nodes, max=budget, out=out.num_nodes)
        return out

    def with_root(self, root_tokens: torch.Tensor) -> "TreeBatch":
        """Write the last committed token of each request into slot 0 (in place)."""
        self.tokens[:, 0] = root_tokens.to(self.tokens.dtype)
        return self


@dataclass
class WalkResult:
    """The accepted path of each request of a walked TreeBatch (core/walk.py), [R] rows."""

    accepted: torch.Tensor  # int64 [R, L+1]: slot indices along the path, root first, -1 padded
    num_accepted: torch.Tensor  # int64 [R]: path length including the root
    bonus: torch.Tensor  # int64 [R]: the target's token at the last accepted slot
    tokens: torch.Tensor  # int64 [R, L+1]: committed tokens (path after the root, then bonus), -1 padded
    # what the round reads next, which the Triton walk computes in the same program (walk_tree fills them):
    order: torch.Tensor | None = None  # int64 [R*N]: drafter_order (the drafter's next inputs, path first)
    off_chain: torch.Tensor | None = None  # int64 [R]: accepted_off_chain (with walk_tree's top1)

    @property
    def last(self) -> torch.Tensor:
        """Slot index of the last accepted node [R]."""
        return self.accepted.gather(1, (self.num_accepted - 1).unsqueeze(1)).squeeze(1)
