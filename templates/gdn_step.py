"""The tree GatedDeltaNet work of one step, as the integration calls it: the tree metadata (validated in
debug mode), one layer's tree verify (tree conv, then the tree recurrence, the way vLLM's
`qwen_gdn_attention_core` chains conv and recurrence) and every layer's accepted-path commit, all
through the `ddtree::` ops (ops.py). Set DDTREE_DEBUG=1 to validate tree metadata and walk results on
the host before each use.
"""

from __future__ import annotations

import os

import torch

from ddtree_compile.templates import gdn_meta_triton
from ddtree_compile.templates import ops  # noqa: F401  registers the ddtree:: ops called below
from ddtree_compile.templates.gdn_commit import gdn_commit_triton
from ddtree_compile.templates.gdn_meta import GdnTreeMeta, build_gdn_meta, validate_path, validate_tree


def debug_enabled() -> bool:
    return os.environ.get("DDTREE_DEBUG", "0") == "1"


def make_gdn_meta(parents: torch.Tensor, width: int, max_depth: int | None = None) -> GdnTreeMeta:
    """`build_gdn_meta`, validating the tree first in debug mode. On CUDA one Triton launch builds
    the same tensors (gdn_meta_triton); the torch ops it replaces are ~350 kernels a graph replay."""
    if debug_enabled():
        validate_tree(parents, max_depth)
    if parents.is_cuda and gdn_meta_triton.supports(parents.shape[-1]):
        return gdn_meta_triton.build_gdn_meta_triton(parents, width, max_depth)
    return build_gdn_meta(parents, width, max_depth)


def tree_gdn_verify(mixed_qkv, b, a, core_attn_out, conv_state, ssm_state, conv_weight, conv_bias, A_log, dt_bias,
                    state_indices, num_accepted, meta: GdnTreeMeta, stack, num_k_heads, head_k_dim,
                    activation="silu", conv_out=None, rec_kv=None, rec_gb=None, write_snapshots=False, scale=None,
                    levels=None):
    """One GDN layer's tree verify: tree conv, then the tree recurrence into `core_attn_out`.

    `mixed_qkv` [R*N, 2*H*K + HV*V], b/a [R*N, HV], core_attn_out [R*N, HV, V]; conv_weight [dim, W]
    (vLLM's conv1d.weight viewed 2-D). Pass `conv_out` (like mixed_qkv) to avoid an allocation.
    `levels`: the stack levels the walk may save to (tree_context.GdnVerify.levels; None: max_depth).
    """
    need = meta.max_depth if levels is None else min(meta.max_depth, levels)
    if stack.dim() != 5 or stack.shape[1] < need:
        raise ValueError(f"stack must have >= {need} levels (max_depth {meta.max_depth}, levels {levels}), "
                         f"got shape {tuple(stack.shape)}")
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation must be None, 'silu' or 'swish', got {activation!r}")
    if conv_out is None:
        conv_out = torch.empty_like(mixed_qkv)
    torch.ops.ddtree.tree_conv1d(mixed_qkv, conv_weight, conv_bias, conv_state, state_indices, num_accepted,
                                 meta.conv_anc, conv_out, activation is not None)
    torch.ops.ddtree.tree_gdn(conv_out, a, b, A_log, dt_bias, ssm_state, state_indices, num_accepted, meta.walk,
                              stack, core_attn_out, rec_kv, rec_gb, num_k_heads, head_k_dim,
                              head_k_dim ** -0.5 if scale is None else scale, write_snapshots)


def commit_accepted_path(conv_states, ssm_states, state_indices, num_accepted, accepted, path_len, width,
                         rec_kv=None, rec_gb=None, parents=None, snap_depth=None, layer_group=None):
    """All GDN layers' commit, of every KV cache group with `layer_group` (see gdn_commit). In debug
    mode the walk result is checked against `parents`."""
    if debug_enabled() and parents is not None:
        validate_path(accepted, path_len, parents)
    args = (list(conv_states), list(ssm_states), state_indices, num_accepted, accepted, path_len, rec_kv, rec_gb,
            width, snap_depth, layer_group)
    if accepted.is_cuda:  # always eager, never traced: the launcher without the op's per-call dispatch
        gdn_commit_triton(*args)
    else:
        torch.ops.ddtree.gdn_commit(*args)
