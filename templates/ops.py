"""Every `ddtree::` custom op of the templates, registered here and only here (importing this module
registers them all).

Each op is registered the same way: `torch.library.custom_op` whose body is the plain torch reference
(`<kernel>_ref.py`: the CPU kernel, and that of any non-CUDA device), `.register_kernel("cuda")` calling
the Triton launcher (`<kernel>.py`), and `.register_fake` running the reference's argument checks
(metadata only), so torch.compile traces the op and a bad argument is named at trace time. Every op
mutates its outputs / caches in place and returns nothing; the semantics are in the `_ref` modules.
"""

from __future__ import annotations

from typing import Optional

import torch

from ddtree_compile.templates.gdn_commit import gdn_commit_triton
from ddtree_compile.templates.gdn_commit_ref import check_commit_args, gdn_commit_ref
from ddtree_compile.templates.kv_compact import launch_kv_compact
from ddtree_compile.templates.kv_compact_ref import check_kv_compact_args, kv_compact_reference
from ddtree_compile.templates.tree_attention import launch_tree_attention
from ddtree_compile.templates.tree_attention_ref import (
    check_scratch,
    check_tree_attention_args,
    tree_attention_reference,
)
from ddtree_compile.templates.tree_conv import tree_conv1d_triton
from ddtree_compile.templates.tree_conv_ref import check_conv_args, tree_conv1d_ref
from ddtree_compile.templates.tree_gdn import tree_gdn_triton
from ddtree_compile.templates.tree_gdn_ref import check_gdn_args, tree_gdn_ref

Tensor = torch.Tensor

# ------------------------------------------------------------------ tree attention (paged KV cache)


@torch.library.custom_op("ddtree::tree_attention", mutates_args=("out",))
def tree_attention(query: Tensor, key_cache: Tensor, value_cache: Tensor, block_table: Tensor,
                   context_lens: Tensor, ancestor_bits: Tensor, depths: Tensor, out: Tensor,
                   softmax_scale: float, sliding_window: int, logits_soft_cap: float,
                   q_scale: Optional[Tensor] = None, k_scale: Optional[Tensor] = None,
                   v_scale: Optional[Tensor] = None) -> None:
    tree_attention_reference(query, key_cache, value_cache, block_table, context_lens, ancestor_bits, depths, out,
                             softmax_scale, sliding_window, logits_soft_cap, q_scale, k_scale, v_scale)


# The same op with the CUDA kernel's split-KV partials in the caller's `scratch` (tree_attention.py), which
# it mutates. An op of its own, not an optional argument of the one above: torch 2.11 (vLLM 0.26's) indexes
# a mutated argument that a call leaves out, and fails.
@torch.library.custom_op("ddtree::tree_attention_scratch", mutates_args=("out", "scratch"))
def tree_attention_scratch(query: Tensor, key_cache: Tensor, value_cache: Tensor, block_table: Tensor,
                           context_lens: Tensor, ancestor_bits: Tensor, depths: Tensor, out: Tensor,
                           softmax_scale: float, sliding_window: int, logits_soft_cap: float, scratch: Tensor,
                           q_scale: Optional[Tensor] = None, k_scale: Optional[Tensor] = None,
                           v_scale: Optional[Tensor] = None) -> None:
    check_scratch(scratch, query.device)
    tree_attention_reference(query, key_cache, value_cache, block_table, context_lens, ancestor_bits, depths, out,
                             softmax_scale, sliding_window, logits_soft_cap, q_scale, k_scale, v_scale)


_ARGS = 11  # query .. logits_soft_cap: the arguments both ops share, in this order


@tree_attention.register_kernel("cuda")
def _tree_attention_cuda(*args) -> None:
    launch_tree_attention(*args[:_ARGS], None, None, None, *args[_ARGS:])  # scratch, tiles, splits: none


@tree_attention.register_fake
def _tree_attention_fake(*args) -> None:
    check_tree_attention_args(*args)


@tree_attention_scratch.register_kernel("cuda")
def _tree_attention_scratch_cuda(*args) -> None:
    launch_tree_attention(*args[:_ARGS], args[_ARGS], None, None, *args[_ARGS + 1:])


@tree_attention_scratch.register_fake
def _tree_attention_scratch_fake(*args) -> None:
    check_tree_attention_args(*args[:_ARGS], *args[_ARGS + 1:])
    check_scratch(args[_ARGS], args[0].device)


# ------------------------------------------------------------------ commit-time K/V compaction


@torch.library.custom_op("ddtree::kv_compact", mutates_args=("key_caches", "value_caches"))
def kv_compact(key_caches: list[Tensor], value_caches: list[Tensor], block_table: Tensor, src_pos: Tensor,
               dst_pos: Tensor) -> None:
    kv_compact_reference(key_caches, value_caches, block_table, src_pos, dst_pos)


@kv_compact.register_kernel("cuda")
def _kv_compact_cuda(key_caches, value_caches, block_table, src_pos, dst_pos) -> None:
    launch_kv_compact(key_caches, value_caches, block_table, src_pos, dst_pos)


@kv_compact.register_fake
def _kv_compact_fake(key_caches, value_caches, block_table, src_pos, dst_pos) -> None:
    check_kv_compact_args(key_caches, value_caches, block_table, src_pos, dst_pos)


# ------------------------------------------------------------------ GatedDeltaNet: tree conv1d


@torch.library.custom_op("ddtree::tree_conv1d", mutates_args=("conv_state", "out"))
def tree_conv1d(x: Tensor, weight: Tensor, bias: Optional[Tensor], conv_state: Tensor, state_indices: Tensor,
                num_accepted: Tensor, conv_anc: Tensor, out: Tensor, silu: bool) -> None:
    tree_conv1d_ref(x, weight, bias, conv_state, state_indices, num_accepted, conv_anc, out, silu)


@tree_conv1d.register_kernel("cuda")
def _tree_conv1d_cuda(x, weight, bias, conv_state, state_indices, num_accepted, conv_anc, out, silu) -> None:
    tree_conv1d_triton(x, weight, bias, conv_state, state_indices, num_accepted, conv_anc, out, silu)


@tree_conv1d.register_fake
def _tree_conv1d_fake(x, weight, bias, conv_state, state_indices, num_accepted, conv_anc, out, silu) -> None:
    check_conv_args(x, weight, bias, conv_state, state_indices, num_accepted, conv_anc, out)


# ------------------------------------------------------------------ GatedDeltaNet: tree delta rule


@torch.library.custom_op("ddtree::tree_gdn", mutates_args=("ssm_state", "stack", "out", "rec_kv", "rec_gb"))
def tree_gdn(qkv: Tensor, a: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor, ssm_state: Tensor,
             state_indices: Tensor, num_accepted: Tensor, walk: Tensor, stack: Tensor, out: Tensor,
             rec_kv: Optional[Tensor], rec_gb: Optional[Tensor], num_k_heads: int, head_k_dim: int,
             scale: float, write_snapshots: bool) -> None:
    tree_gdn_ref(qkv, a, b, A_log, dt_bias, ssm_state, state_indices, num_accepted, walk, stack, out, rec_kv,
                 rec_gb, num_k_heads, head_k_dim, scale, write_snapshots)


@tree_gdn.register_kernel("cuda")
def _tree_gdn_cuda(qkv, a, b, A_log, dt_bias, ssm_state, state_indices, num_accepted, walk, stack, out, rec_kv,
                   rec_gb, num_k_heads, head_k_dim, scale, write_snapshots) -> None:
    tree_gdn_triton(qkv, a, b, A_log, dt_bias, ssm_state, state_indices, num_accepted, walk, stack, out, rec_kv,
                    rec_gb, num_k_heads, head_k_dim, scale, write_snapshots)


@tree_gdn.register_fake
def _tree_gdn_fake(qkv, a, b, A_log, dt_bias, ssm_state, state_indices, num_accepted, walk, stack, out, rec_kv,
                   rec_gb, num_k_heads, head_k_dim, scale, write_snapshots) -> None:
    check_gdn_args(qkv, a, b, ssm_state, state_indices, num_accepted, walk, stack, out, rec_kv, rec_gb,
                   num_k_heads, head_k_dim, write_snapshots)


# ------------------------------------------------------------------ GatedDeltaNet: accepted-path commit


@torch.library.custom_op("ddtree::gdn_commit", mutates_args=("conv_states", "ssm_states", "num_accepted"))
def gdn_commit(conv_states: list[Tensor], ssm_states: list[Tensor], state_indices: Tensor, num_accepted: Tensor,
               accepted: Tensor, path_len: Tensor, rec_kv: Optional[Tensor], rec_gb: Optional[Tensor],
               width: int, snap_depth: Optional[Tensor] = None, layer_group: Optional[list[int]] = None) -> None:
    gdn_commit_ref(conv_states, ssm_states, state_indices, num_accepted, accepted, path_len, rec_kv, rec_gb, width,
                   snap_depth, layer_group)


@gdn_commit.register_kernel("cuda")
def _gdn_commit_cuda(conv_states, ssm_states, state_indices, num_accepted, accepted, path_len, rec_kv, rec_gb,
                     width, snap_depth=None, layer_group=None) -> None:
    gdn_commit_triton(conv_states, ssm_states, state_indices, num_accepted, accepted, path_len, rec_kv, rec_gb,
                      width, snap_depth, layer_group)


@gdn_commit.register_fake
def _gdn_commit_fake(conv_states, ssm_states, state_indices, num_accepted, accepted, path_len, rec_kv, rec_gb,
                     width, snap_depth=None, layer_group=None) -> None:
    check_commit_args(conv_states, ssm_states, state_indices, num_accepted, accepted, path_len, rec_kv, rec_gb,
                      width, snap_depth, layer_group)
