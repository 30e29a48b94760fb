"""The tree context: what the replacement ops read while the target verifies a tree.

A module-level slot holds the current step's `TreeVerifyMetadata` (or None). The round sets it
around the TARGET model's verify forward only (never around the drafter or a prefill):

    with tree_verify(meta):
        hidden = model(input_ids, positions, ...)   # R*(B+1) tokens, positions = start + depth

The context keeps references, not copies: a runner that captures CUDA graphs keeps one metadata
object of persistent tensors per budget bucket, refills them in place each step, and captures
with the context set (the replacement ops branch on it in Python, at capture time).

Batch layout of a tree verify: request r owns query rows r*N .. r*N+N-1 (N = B+1, slot 0 the root,
core/tree.py); vLLM's slot mapping puts slot j at cache position context_len + j, which is what
the tree templates read.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch


@dataclass
class GdnVerify:
    """GatedDeltaNet state addressing for the tree GDN op. Every field is optional: the defaults
    come from vLLM's GDN spec-decode metadata (a verify scheduled with num_speculative_tokens = B).

    state_indices   int32 [R, NS] or {layer: tensor}: column 0 the request's conv line; committed SSM
                    line at column num_accepted-1; NS = N for snapshots. Per layer when GDN layers of
                    several KV cache groups hold their state in different block ids
    num_accepted    int32 [R] or {layer: tensor}: vLLM's num_accepted_tokens from the previous step
    write_snapshots every node's state written to state_indices[r, slot]
    records         {layer prefix: (rec_kv, rec_gb)}: per-node k/v and g/beta for the replay commit
    tree_meta       the per-step GdnTreeMeta the op builds from `parents` on first use
    stack           fp32 depth stack [R, >= levels, HV, V, K]: the round passes its engine's
                    (round/workspace.py); built on first use otherwise
    levels          the most stack levels the walk saves to: the kernel saves a node's state at its
                    depth only where the node has two or more live children, so trees at most L deep
                    (a drafter's L positions) need min(max depth, L); chain rows need none. None: the
                    tree's static max depth (trees of any depth)
    """

    state_indices: torch.Tensor | dict | None = None
    num_accepted: torch.Tensor | dict | None = None
    write_snapshots: bool = False
    records: dict = field(default_factory=dict)
    tree_meta: object | None = None
    stack: torch.Tensor | None = None
    levels: int | None = None

    def for_layer(self, value, layer: str):
        return value.get(layer) if isinstance(value, dict) else value


@dataclass
class TreeVerifyMetadata:
    """Per-step tree metadata read by the replacement ops (device tensors, fixed shapes per bucket).

    ancestor_bits  int32 [R, N, ceil(N/32)]  packed ancestor-or-self mask (core/tree.py)
    depths         int64/int32 [R, N]        depth of each slot (0 for root and padding)
    parents        int64 [R, N]              parent slot, -1 for the root and padding
    context_lens   [R] or None               committed tokens before the verify block; None:
                                             vLLM's attention seq_lens - N
    attn_scratch   fp32 [elems] or None      tree attention's split-KV scratch, one for every bucket:
                                             the round passes its engine's (round/workspace.py);
                                             None: each CUDA call allocates its own
    gdn            GdnVerify or None         GatedDeltaNet addressing; None: vLLM's defaults
    calls          tree implementation (tree_ops.TreeImpl) -> tree-mode calls (the round checks every layer ran its tree op)
    """

    ancestor_bits: torch.Tensor
    depths: torch.Tensor
    parents: torch.Tensor
    context_lens: torch.Tensor | None = None
    attn_scratch: torch.Tensor | None = None
    gdn: GdnVerify | None = None
    calls: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.gdn is not None and not isinstance(self.gdn, GdnVerify):
            raise ValueError(f"TreeVerifyMetadata.gdn: expected GdnVerify or None, got {type(self.gdn).__name__}")

    @property
    def num_requests(self) -> int:
        return self.ancestor_bits.shape[0]

    @property
    def num_slots(self) -> int:
        return self.ancestor_bits.shape[1]


_ACTIVE: TreeVerifyMetadata | None = None


def current_tree_verify() -> TreeVerifyMetadata | None:
    return _ACTIVE


def set_tree_verify(meta: TreeVerifyMetadata | None) -> None:
    global _ACTIVE
    if meta is not None and not isinstance(meta, TreeVerifyMetadata):
        raise ValueError(f"set_tree_verify: expected TreeVerifyMetadata or None, got {type(meta).__name__}")
    _ACTIVE = meta


@contextlib.contextmanager
def tree_verify(meta: TreeVerifyMetadata):
    """Make `meta` the active tree verify for the forwards inside the block."""
    prev = _ACTIVE
    set_tree_verify(meta)
    try:
        yield meta
    finally:
        set_tree_verify(prev)
