"""Per-step state shared by the stages of the round."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .. import vllm_ops
from ..tree import TreeBatch
from ..walk import WalkResult


@dataclass
class Pending:
    """Trees proposed at the end of a step, verified by the next one."""

    req_ids: list[str]
    tree: TreeBatch  # [R, N], slot 0 = the bonus token the drafter started from
    top1: torch.Tensor  # [R, L] the drafter's argmax per depth (flat DFlash's chain)
    chain: list[str | None]  # per row: fallback reason (verify as a chain) or None (tree)

    def __post_init__(self):
        self.index = {r: i for i, r in enumerate(self.req_ids)}


@dataclass
class Step:
    R: int
    N: int
    tree: TreeBatch  # [R, N]; chain rows are chain-shaped
    tree_rows: torch.Tensor  # bool [R] on device: walked by us
    chain_rows: list[bool]
    top1: torch.Tensor  # [R, L]
    start: torch.Tensor  # [R] cache position of the root
    positions: torch.Tensor  # [R*N] start + depth
    meta: vllm_ops.TreeVerifyMetadata
    block_tables: dict = field(default_factory=dict)  # kv group id -> block table of the verify
    gdn_groups: dict = field(default_factory=dict)  # kv group id -> (state_indices, num_accepted) of the verify
    debug_pre: dict | None = None  # tests: GDN layer -> fp32 committed state [R, HV, V, K] before the verify
    walk: WalkResult | None = None  # combined (tree + chain rows) accepted paths
    t0: float = 0.0

