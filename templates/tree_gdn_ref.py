"""Tree gated delta rule (GatedDeltaNet recurrence) for the tree verify: checks and the torch reference.

The reference (float32, slot order) is the CPU kernel of `torch.ops.ddtree.tree_gdn` and the oracle
the Triton kernel (tree_gdn.py, same signature) is tested against; its per-step helpers (gates,
L2 norm, one delta-rule update, the committed line) are the reference math gdn_commit_ref.py replays.

Math is vLLM's `fused_sigmoid_gating_delta_rule_update` (use_qk_l2norm_in_kernel=True) with each
node starting from its PARENT's state (the root from the committed state):
    g = -exp(A_log) * softplus(a + dt_bias),  beta = sigmoid(b),  q, k L2-normalised (eps 1e-6)
    S = e^g S;  S += k (beta (v - S^T k))^T;  o = S^T q * scale      (GQA: head hv reads key head hv // (HV/H))
The state is held as S^T, i.e. h [V, K] per value head like vLLM's cache: `ssm_state` is a logical
[lines, HV, V, K] tensor with any strides (GPU vLLM: the cache itself; CPU vLLM stores [K, V]: pass
`cache.view(n, HV, K, V).transpose(-1, -2)`).

Committed state: line `state_indices[r, num_accepted[r] - 1]` (vLLM's lazy chain convention), or
`state_indices[r, 0]` when state_indices has a single column. Lines <= 0 (vLLM's null block) read as
zeros and are never written. Outputs of padding slots are zeros.

Strategies (both compute identical outputs; the walk keeps an exact fp32 stack for backtracks):
- snapshots: every live node's state is written to line `state_indices[r, slot]` (needs at least N columns);
  commit is lazy: the next step resumes from the last accepted node's line.
- records: each node's raw k, v and fp32 g, beta are written to `rec_kv`, `rec_gb`; the commit
  replays the accepted path from the committed line (state memory independent of the budget).
"""

from __future__ import annotations

import torch

from ddtree_compile.templates.gdn_meta import F_PAD

L2_EPS = 1e-6


def gates_ref(a, b, A_log, dt_bias):
    """fp32 (g, beta) as vLLM's fused gating computes them."""
    g = -A_log.float().exp() * torch.nn.functional.softplus(a.float() + dt_bias.float(), 1.0, 20.0)
    return g, torch.sigmoid(b.float())


def l2norm_ref(x):
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def qk_norms_ref(qkv, num_k_heads, head_k_dim):
    """float32 [rows, 2, H]: rsqrt(|x|^2 + eps) of every row's q (0) and k (1) heads: the tree GDN's
    norm pre-pass (tree_gdn.qk_norms_triton), which tiles off vLLM's warp count read."""
    H, K = num_k_heads, head_k_dim
    qk = qkv[:, : 2 * H * K].float().reshape(-1, 2, H, K)
    return torch.rsqrt((qk * qk).sum(-1) + L2_EPS)


def gdn_update_ref(h, k_raw, v, g, beta):
    """One delta-rule step. h [..., V, K] fp32; k_raw [..., K]; v [..., V]; g, beta [...]."""
    k = l2norm_ref(k_raw)
    h = h * g.exp()[..., None, None]
    vn = (v.float() - (h * k.unsqueeze(-2)).sum(-1)) * beta[..., None]
    return h + vn.unsqueeze(-1) * k.unsqueeze(-2)


def check_gdn_args(qkv, a, b, ssm_state, state_indices, num_accepted, walk, stack, out, rec_kv, rec_gb,
                   num_k_heads, head_k_dim, write_snapshots):
    """Shape/dtype checks (host only, no sync)."""
    if walk.dim() != 3 or walk.shape[2] != 4 or walk.dtype != torch.int32 or not walk.is_contiguous():
        raise ValueError(f"walk must be contiguous int32 [R, N, 4] (GdnTreeMeta.walk), got {walk.dtype} "
                         f"{tuple(walk.shape)}")
    R, N = walk.shape[:2]
    if ssm_state.dim() != 4:
        raise ValueError(f"ssm_state must be [lines, HV, V, K], got {tuple(ssm_state.shape)}")
    _, HV, V, K = ssm_state.shape
    H = num_k_heads
    if K != head_k_dim or H <= 0 or HV % H:
        raise ValueError(f"ssm_state {tuple(ssm_state.shape)} needs K == head_k_dim ({head_k_dim}) and HV a "
                         f"multiple of num_k_heads ({H})")
    if qkv.shape != (R * N, 2 * H * K + HV * V) or qkv.stride(1) != 1:
        raise ValueError(f"qkv must be [R*N, 2*H*K + HV*V] = [{R * N}, {2 * H * K + HV * V}] with unit "
                         f"inner stride, got {tuple(qkv.shape)}")
    for name, t in (("a", a), ("b", b)):
        if t.shape != (R * N, HV) or t.stride(1) != 1:
            raise ValueError(f"{name} must be [R*N, HV] = [{R * N}, {HV}] with unit inner stride, got {tuple(t.shape)}")
    if a.stride(0) != b.stride(0):
        raise ValueError("a and b must share their row stride")
    if out.shape != (R * N, HV, V) or out.stride(2) != 1:
        raise ValueError(f"out must be [R*N, HV, V] = [{R * N}, {HV}, {V}] with unit inner stride, got {tuple(out.shape)}")
    if state_indices.dim() != 2 or state_indices.shape[0] != R or state_indices.dtype != torch.int32:
        raise ValueError(f"state_indices must be int32 [R={R}, NS], got {state_indices.dtype} {tuple(state_indices.shape)}")
    if write_snapshots and state_indices.shape[1] < N:
        raise ValueError(f"snapshots need one state line per slot: state_indices must be [R, >= N={N}], "
                         f"got {tuple(state_indices.shape)}")
    if num_accepted.shape != (R,) or num_accepted.dtype != torch.int32:
        raise ValueError(f"num_accepted must be int32 [R={R}], got {num_accepted.dtype} {tuple(num_accepted.shape)}")
    if stack.dim() != 5 or stack.shape[0] < R or stack.shape[2:] != (HV, V, K) or stack.dtype != torch.float32 \
            or not stack[0].is_contiguous():
        raise ValueError(f"stack must be float32 [>=R, levels, HV, V, K] = [{R}, *, {HV}, {V}, {K}] with "
                         f"contiguous levels, got {stack.dtype} {tuple(stack.shape)}")
    if (rec_kv is None) != (rec_gb is None):
        raise ValueError("rec_kv and rec_gb must be given together")
    if rec_kv is not None:
        if rec_kv.shape != (R, N, H * K + HV * V) or rec_kv.dtype != qkv.dtype or not rec_kv.is_contiguous():
            raise ValueError(f"rec_kv must be contiguous {qkv.dtype} [R, N, H*K + HV*V] = [{R}, {N}, "
                             f"{H * K + HV * V}], got {rec_kv.dtype} {tuple(rec_kv.shape)}")
        if rec_gb.shape != (R, N, 2, HV) or rec_gb.dtype != torch.float32 or not rec_gb.is_contiguous():
            raise ValueError(f"rec_gb must be contiguous float32 [R, N, 2, HV] = [{R}, {N}, 2, {HV}], got "
                             f"{rec_gb.dtype} {tuple(rec_gb.shape)}")


def committed_lines(state_indices, num_accepted):
    """int64 [R]: the line each request's committed state is read from."""
    if state_indices.shape[1] == 1:
        return state_indices[:, 0].long()
    col = (num_accepted.long() - 1).clamp(0, state_indices.shape[1] - 1)
    return torch.gather(state_indices.long(), 1, col.unsqueeze(1)).squeeze(1)


def tree_gdn_ref(qkv, a, b, A_log, dt_bias, ssm_state, state_indices, num_accepted, walk, stack, out,
                 rec_kv, rec_gb, num_k_heads, head_k_dim, scale, write_snapshots):
    """Float32 torch reference of the tree recurrence (slot order; `stack` is not used)."""
    check_gdn_args(qkv, a, b, ssm_state, state_indices, num_accepted, walk, stack, out, rec_kv, rec_gb,
                   num_k_heads, head_k_dim, write_snapshots)
    R, N = walk.shape[:2]
    _, HV, V, K = ssm_state.shape
    H, G = num_k_heads, ssm_state.shape[1] // num_k_heads
    slot = walk[..., 0].long()
    parent = torch.empty(R, N, dtype=torch.long, device=qkv.device).scatter_(1, slot, walk[..., 1].long())
    pad = torch.empty(R, N, dtype=torch.bool, device=qkv.device).scatter_(1, slot, (walk[..., 3] & F_PAD) != 0)
    q = l2norm_ref(qkv[:, : H * K].reshape(R, N, H, K)).repeat_interleave(G, 2) * scale
    k = qkv[:, H * K: 2 * H * K].reshape(R, N, H, K).float().repeat_interleave(G, 2)
    v = qkv[:, 2 * H * K:].reshape(R, N, HV, V).float()
    g, beta = gates_ref(a.reshape(R, N, HV), b.reshape(R, N, HV), A_log, dt_bias)
    line0 = committed_lines(state_indices, num_accepted)
    s0 = ssm_state[line0.clamp(min=0)].float() * (line0 > 0).view(R, 1, 1, 1)
    states = torch.zeros(R, N, HV, V, K, device=qkv.device)
    o = torch.zeros(R, N, HV, V, device=qkv.device)
    ar = torch.arange(R, device=qkv.device)
    for i in range(N):  # parents come before children
        p = parent[:, i]
        h0 = torch.where((p >= 0).view(R, 1, 1, 1), states[ar, p.clamp(min=0)], s0)
        h = gdn_update_ref(h0, k[:, i], v[:, i], g[:, i], beta[:, i])
        states[:, i] = h
        o[:, i] = torch.where(pad[:, i].view(R, 1, 1), 0.0, (h * q[:, i].unsqueeze(-2)).sum(-1))
    out.copy_(o.view(R * N, HV, V))
    if write_snapshots:
        lines = state_indices[:, :N].long()  # (vLLM's lines for num_spec drafts: a smaller tree uses the first N)
        ok = (lines > 0) & ~pad
        ssm_state[lines[ok]] = states[ok].to(ssm_state.dtype)
    if rec_kv is not None:  # live slots only, like the kernel
        live = ~pad
        rec_kv[live] = qkv[:, H * K:].reshape(R, N, -1)[live].to(rec_kv.dtype)
        rec_gb[live] = torch.stack([g, beta], 2)[live]
