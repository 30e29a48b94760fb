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


def commit_plan(walk: WalkResult | torch.Tensor, start) -> CommitPlan:
    """Source -> destination cache positions for compacting each request's accepted path.

    `walk` is the WalkResult or its `accepted` paths [R, L+1]; `start` is the root's cache position
    (an int or an int tensor [R]). Identity moves (the path already lies where it must, e.g. the
    main chain) and padding are -1.
    """
    acc = walk if isinstance(walk, torch.Tensor) else walk.accepted
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


def block_boundary_depth(start: torch.Tensor, path_len: torch.Tensor, block_size: int) -> torch.Tensor:
    """int32 [R]: per request, the path depth whose token completes a cache block, else -1.

    Hybrid prefix caching ("align") keeps a GDN state per block: after a step vLLM copies the state
    after the last block-completing token into that block. Its chain puts the state after depth d in
    column d; a tree commit writes the path's state there (gdn_commit's snap_depth). The root sits at
    position `start`; the n accepted tokens (root included) end at start + n; the last block
    boundary A = floor((start + n) / block_size) * block_size is reached inside the step iff
    A >= start + 1, at depth A - start - 1 (vLLM's align postprocess: bias = A - running).
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    start = start.reshape(-1).to(torch.int64)
    n = path_len.reshape(-1).to(torch.int64)
    boundary = torch.div(start + n, block_size, rounding_mode="floor") * block_size
    depth = boundary - start - 1
    return torch.where((n > 0) & (depth >= 0), depth, -1).to(torch.int32)
