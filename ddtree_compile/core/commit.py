"""Round step 4 (commit): where the accepted path's K/V must move so the sequence is linear again.

Verify slot s of a request was written at cache position start + s; after the walk, the node at
path depth d must live at position start + d. Path slots strictly increase with depth, so every
source lies at or after its destination, and applying the moves in increasing depth order in
place never reads a position that an earlier move overwrote.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ddtree_compile.core.tree import WalkResult


@dataclass
class CommitPlan:
    src_pos: torch.Tensor  # int64 [R, L+1]: cache position to read, -1 = nothing to move
    dst_pos: torch.Tensor  # int64 [R, L+1]: cache position to write, -1 = nothing to move


def commit_plan(walk: WalkResult, start) -> CommitPlan:
    """Source -> destination cache positions for compacting each request's accepted path.

    `start` is the root's cache position (an int or an int tensor [R]). Identity moves (the path
    already lies where it must, e.g. the main chain) and padding are -1.
    """
    acc = walk.accepted
    R, L1 = acc.shape
    if isinstance(start, torch.Tensor):
        if start.shape not in ((R,), (R, 1), ()):
            raise ValueError(f"start must be an int or a tensor of shape [R] = [{R}], got {tuple(start.shape)}")
        start = start.to(acc.device, torch.int64).reshape(-1, 1)
    elif isinstance(start, bool) or not isinstance(start, int):
        raise ValueError(f"start must be an int or an int tensor, got {type(start).__name__}")
    depth = torch.arange(L1, device=acc.device).unsqueeze(0)
    move = (acc >= 0) & (acc != depth)
    src = torch.where(move, start + acc, -1)
    dst = torch.where(move, start + depth, -1)
    return CommitPlan(src, dst)
