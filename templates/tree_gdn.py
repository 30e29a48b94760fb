"""Tree gated delta rule (GatedDeltaNet recurrence) for the tree verify.

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
- snapshots: every live node's state is written to line `state_indices[r, slot]` (needs N columns);
  commit is lazy: the next step resumes from the last accepted node's line.
- records: each node's raw k, v and fp32 g, beta are written to `rec_kv`, `rec_gb`; the commit
  replays the accepted path from the committed line (state memory independent of the budget).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gdn_meta import F_FROM_COMMITTED, F_PAD, F_RELOAD, F_SAVE

# Walk flags as constexpr globals (compiled Triton only reads constexpr globals).
_FROM_COMMITTED = tl.constexpr(F_FROM_COMMITTED)
_RELOAD = tl.constexpr(F_RELOAD)
_SAVE = tl.constexpr(F_SAVE)
_PAD = tl.constexpr(F_PAD)

L2_EPS = 1e-6


def gates_ref(a, b, A_log, dt_bias):
    """fp32 (g, beta) as vLLM's fused gating computes them."""
    g = -A_log.float().exp() * torch.nn.functional.softplus(a.float() + dt_bias.float(), 1.0, 20.0)
    return g, torch.sigmoid(b.float())


def l2norm_ref(x):
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


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
    if write_snapshots and state_indices.shape[1] != N:
        raise ValueError(f"snapshots need one state line per slot: state_indices must be [R, N={N}], "
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
        lines = state_indices.long()
        ok = (lines > 0) & ~pad
        ssm_state[lines[ok]] = states[ok].to(ssm_state.dtype)
    if rec_kv is not None:  # live slots only, like the kernel
        live = ~pad
        rec_kv[live] = qkv[:, H * K:].reshape(R, N, -1)[live].to(rec_kv.dtype)
        rec_gb[live] = torch.stack([g, beta], 2)[live]


@triton.jit
def gdn_update(h, kr, v, g, beta):
    """One delta-rule step on an fp32 [BV, BK] tile; shared by the verify walk and the replay."""
    k = kr * tl.rsqrt(tl.sum(kr * kr) + 1e-6)
    h = h * tl.exp(g)
    vn = (v - tl.sum(h * k[None, :], 1)) * beta
    return h + vn[:, None] * k[None, :]


@triton.jit
def _load_node(qkv, s_qt, a, b, s_abt, walk, r, kk, N, hk, hv, ok, mk, ov, mv,
               H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr):
    wp = walk + (r * N + kk) * 4
    s = tl.load(wp)
    row = (r * N + s).to(tl.int64)
    qp = qkv + row * s_qt
    q = tl.load(qp + hk * K + ok, mask=mk, other=0.0).to(tl.float32)
    kr = tl.load(qp + H * K + hk * K + ok, mask=mk, other=0.0).to(tl.float32)
    v = tl.load(qp + 2 * H * K + hv * V + ov, mask=mv, other=0.0).to(tl.float32)
    av = tl.load(a + row * s_abt + hv).to(tl.float32)
    bv = tl.load(b + row * s_abt + hv).to(tl.float32)
    return s, tl.load(wp + 2), tl.load(wp + 3), q, kr, v, av, bv


@triton.jit
def _tree_gdn_kernel(qkv, s_qt, a, b, s_abt, A_log, dt_bias,
                     state, s_sl, s_sh, s_sv, s_sk, idx, s_ir, s_ic, nacc, walk, stack, s_kr, s_kd,
                     out, s_ot, s_oh, rec_kv, rec_gb, scale, N, NS,
                     H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                     BK: tl.constexpr, BV: tl.constexpr, SNAP: tl.constexpr, REC: tl.constexpr):
    i_v = tl.program_id(0)
    i_rh = tl.program_id(1)
    r = i_rh // HV
    hv = i_rh % HV
    hk = hv // (HV // H)
    ok = tl.arange(0, BK)
    ov = i_v * BV + tl.arange(0, BV)
    mk = ok < K
    mv = ov < V
    mh = mv[:, None] & mk[None, :]
    st_off = hv * s_sh + ov[:, None] * s_sv + ok[None, :] * s_sk
    sk_off = hv * (V * K) + ov[:, None] * K + ok[None, :]
    stack_r = stack + r.to(tl.int64) * s_kr
    A = tl.load(A_log + hv).to(tl.float32)
    dtb = tl.load(dt_bias + hv).to(tl.float32)
    col0 = 0
    if NS > 1:  # lazy chain layout: the committed state is the slot num_accepted - 1
        col0 = tl.load(nacc + r) - 1
    line0 = tl.load(idx + r * s_ir + col0 * s_ic).to(tl.int64)
    KVD: tl.constexpr = H * K + HV * V
    h = tl.zeros([BV, BK], dtype=tl.float32)
    # Software pipelining: the next position's inputs are loaded before this one is computed.
    s_n, d_n, f_n, q_n, k_n, v_n, a_n, b_n = _load_node(qkv, s_qt, a, b, s_abt, walk, r, 0, N, hk, hv,
                                                        ok, mk, ov, mv, H, HV, K, V)
    for kk in range(N):
        s, d, f, q, kr, v, av, bv = s_n, d_n, f_n, q_n, k_n, v_n, a_n, b_n
        s_n, d_n, f_n, q_n, k_n, v_n, a_n, b_n = _load_node(qkv, s_qt, a, b, s_abt, walk, r,
                                                            tl.minimum(kk + 1, N - 1), N, hk, hv,
                                                            ok, mk, ov, mv, H, HV, K, V)
        row = (r * N + s).to(tl.int64)
        op = out + row * s_ot + hv * s_oh + ov
        if (f & _PAD) != 0:
            tl.store(op, tl.zeros([BV], dtype=tl.float32).to(out.dtype.element_ty), mask=mv)
        else:
            if (f & _FROM_COMMITTED) != 0:
                h = tl.load(state + line0 * s_sl + st_off, mask=tl.where(line0 > 0, mh, False), other=0.0).to(tl.float32)
            elif (f & _RELOAD) != 0:
                tl.debug_barrier()
                h = tl.load(stack_r + (d - 1) * s_kd + sk_off, mask=mh, other=0.0)
            x = av + dtb
            g = -tl.exp(A) * tl.where(x <= 20.0, tl.log(1.0 + tl.exp(x)), x)
            beta = tl.sigmoid(bv)
            h = gdn_update(h, kr, v, g, beta)
            qn = q * tl.rsqrt(tl.sum(q * q) + 1e-6) * scale
            tl.store(op, tl.sum(h * qn[None, :], 1).to(out.dtype.element_ty), mask=mv)
            if (f & _SAVE) != 0:
                tl.store(stack_r + d * s_kd + sk_off, h, mask=mh)
            if SNAP:
                line = tl.load(idx + r * s_ir + s * s_ic).to(tl.int64)
                tl.store(state + line * s_sl + st_off, h.to(state.dtype.element_ty), mask=tl.where(line > 0, mh, False))
            if REC:
                rp = rec_kv + row * KVD
                if (hv % (HV // H) == 0) & (i_v == 0):
                    tl.store(rp + hk * K + ok, kr.to(rec_kv.dtype.element_ty), mask=mk)
                tl.store(rp + H * K + hv * V + ov, v.to(rec_kv.dtype.element_ty), mask=mv)
                if i_v == 0:
                    tl.store(rec_gb + row * (2 * HV) + hv, g)
                    tl.store(rec_gb + row * (2 * HV) + HV + hv, beta)


def tree_gdn_triton(qkv, a, b, A_log, dt_bias, ssm_state, state_indices, num_accepted, walk, stack, out,
                    rec_kv, rec_gb, num_k_heads, head_k_dim, scale, write_snapshots,
                    block_v: int = 16, num_warps: int = 2):
    """Triton launcher; same contract as `tree_gdn_ref`. No host sync, no allocation."""
    check_gdn_args(qkv, a, b, ssm_state, state_indices, num_accepted, walk, stack, out, rec_kv, rec_gb,
                   num_k_heads, head_k_dim, write_snapshots)
    R, N = walk.shape[:2]
    _, HV, V, K = ssm_state.shape
    BV = min(block_v, triton.next_power_of_2(V))
    grid = (triton.cdiv(V, BV), R * HV)
    rec = rec_kv is not None
    _tree_gdn_kernel[grid](
        qkv, qkv.stride(0), a, b, a.stride(0), A_log, dt_bias,
        ssm_state, *ssm_state.stride(), state_indices, *state_indices.stride(), num_accepted, walk,
        stack, stack.stride(0), stack.stride(1), out, out.stride(0), out.stride(1),
        rec_kv if rec else qkv, rec_gb if rec else stack, float(scale), N, state_indices.shape[1],
        H=num_k_heads, HV=HV, K=K, V=V, BK=triton.next_power_of_2(K), BV=BV,
        SNAP=bool(write_snapshots), REC=rec, num_warps=num_warps)
