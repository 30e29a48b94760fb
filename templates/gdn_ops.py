"""torch custom ops (namespace `ddtree`) for the tree GatedDeltaNet templates.

CPU (and any non-CUDA device) runs the float32 torch reference, CUDA runs the Triton kernels; the fake
impls let torch.compile trace them. All ops only mutate their outputs/caches and return nothing:
    ddtree::tree_conv1d(x, weight, bias?, conv_state!, state_indices, num_accepted, conv_anc, out!, silu)
    ddtree::tree_gdn(qkv, a, b, A_log, dt_bias, ssm_state!, state_indices, num_accepted, walk, stack!,
                     out!, rec_kv!?, rec_gb!?, num_k_heads, head_k_dim, scale, write_snapshots)
    ddtree::gdn_commit(conv_states![], ssm_states![], state_indices, num_accepted!, accepted, path_len,
                       rec_kv?, rec_gb?, width)
`tree_gdn_verify` chains conv + recurrence for one layer the way vLLM's `qwen_gdn_attention_core` does.
Set DDTREE_DEBUG=1 to validate tree metadata and walk results on the host before each use.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from .gdn_commit import gdn_commit_ref, gdn_commit_triton
from .gdn_meta import GdnTreeMeta, build_gdn_meta, validate_path, validate_tree
from .tree_conv import tree_conv1d_ref, tree_conv1d_triton
from .tree_gdn import tree_gdn_ref, tree_gdn_triton

Tensor = torch.Tensor


def debug_enabled() -> bool:
    return os.environ.get("DDTREE_DEBUG", "0") == "1"


@torch.library.custom_op("ddtree::tree_conv1d", mutates_args=("conv_state", "out"))
def tree_conv1d(x: Tensor, weight: Tensor, bias: Optional[Tensor], conv_state: Tensor, state_indices: Tensor,
                num_accepted: Tensor, conv_anc: Tensor, out: Tensor, silu: bool) -> None:
    tree_conv1d_ref(x, weight, bias, conv_state, state_indices, num_accepted, conv_anc, out, silu)


@tree_conv1d.register_kernel("cuda")
def _tree_conv1d_cuda(x, weight, bias, conv_state, state_indices, num_accepted, conv_anc, out, silu):
    tree_conv1d_triton(x, weight, bias, conv_state, state_indices, num_accepted, conv_anc, out, silu)


@tree_conv1d.register_fake
def _tree_conv1d_fake(x, weight, bias, conv_state, state_indices, num_accepted, conv_anc, out, silu):
    return None


@torch.library.custom_op("ddtree::tree_gdn", mutates_args=("ssm_state", "stack", "out", "rec_kv", "rec_gb"))
def tree_gdn(qkv: Tensor, a: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor, ssm_state: Tensor,
             state_indices: Tensor, num_accepted: Tensor, walk: Tensor, stack: Tensor, out: Tensor,
             rec_kv: Optional[Tensor], rec_gb: Optional[Tensor], num_k_heads: int, head_k_dim: int,
             scale: float, write_snapshots: bool) -> None:
    tree_gdn_ref(qkv, a, b, A_log, dt_bias, ssm_state, state_indices, num_accepted, walk, stack, out, rec_kv,
                 rec_gb, num_k_heads, head_k_dim, scale, write_snapshots)


@tree_gdn.register_kernel("cuda")
def _tree_gdn_cuda(*args):
    tree_gdn_triton(*args)


@tree_gdn.register_fake
def _tree_gdn_fake(*args):
    return None


@torch.library.custom_op("ddtree::gdn_commit", mutates_args=("conv_states", "ssm_states", "num_accepted"))
def gdn_commit(conv_states: list[Tensor], ssm_states: list[Tensor], state_indices: Tensor, num_accepted: Tensor,
               accepted: Tensor, path_len: Tensor, rec_kv: Optional[Tensor], rec_gb: Optional[Tensor],
               width: int) -> None:
    gdn_commit_ref(conv_states, ssm_states, state_indices, num_accepted, accepted, path_len, rec_kv, rec_gb, width)


@gdn_commit.register_kernel("cuda")
def _gdn_commit_cuda(*args):
    gdn_commit_triton(*args)


@gdn_commit.register_fake
def _gdn_commit_fake(*args):
    return None


def make_gdn_meta(parents: Tensor, width: int, max_depth: int | None = None) -> GdnTreeMeta:
    """`build_gdn_meta`, validating the tree first in debug mode."""
    if debug_enabled():
        validate_tree(parents, max_depth)
    return build_gdn_meta(parents, width, max_depth)


def tree_gdn_verify(mixed_qkv, b, a, core_attn_out, conv_state, ssm_state, conv_weight, conv_bias, A_log, dt_bias,
                    state_indices, num_accepted, meta: GdnTreeMeta, stack, num_k_heads, head_k_dim,
                    activation="silu", conv_out=None, rec_kv=None, rec_gb=None, write_snapshots=False, scale=None):
    """One GDN layer's tree verify: tree conv, then the tree recurrence into `core_attn_out`.

    `mixed_qkv` [R*N, 2*H*K + HV*V], b/a [R*N, HV], core_attn_out [R*N, HV, V]; conv_weight [dim, W]
    (vLLM's conv1d.weight viewed 2-D). Pass `conv_out` (like mixed_qkv) to avoid an allocation.
    """
    if stack.dim() != 5 or stack.shape[1] < meta.max_depth:
        raise ValueError(f"stack must have >= max_depth = {meta.max_depth} levels, got shape {tuple(stack.shape)}")
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
                         rec_kv=None, rec_gb=None, parents=None):
    """All GDN layers' commit (see gdn_commit). In debug mode the walk result is checked against `parents`."""
    if debug_enabled() and parents is not None:
        validate_path(accepted, path_len, parents)
    torch.ops.ddtree.gdn_commit(list(conv_states), list(ssm_states), state_indices, num_accepted, accepted,
                                path_len, rec_kv, rec_gb, width)
