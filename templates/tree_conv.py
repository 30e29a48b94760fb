"""Tree causal conv1d for GatedDeltaNet verify: each token's depthwise conv reads its W-1
predecessors along its ANCESTRY (in-tree ancestors first, then the committed history), never its
siblings. Torch reference (float32) + Triton kernel with the same signature.

State layout is vLLM's chain spec layout: `conv_state` is the [lines, dim, state_len] view of the
cache (vLLM's default SD layout is [lines, state_len, dim]: pass `.transpose(-1, -2)`), with
state_len = W - 2 + N (N = B + 1 tokens per request, i.e. vLLM's W - 1 + num_spec with
num_spec = B). Request r's line is `state_indices[r, 0]` (line <= 0 is vLLM's null block: zero
history, nothing written) and its committed window is columns [o, o + W - 1), o =
num_accepted[r] - 1. Like vLLM's `causal_conv1d_update`, the step rewrites the line to
[window[1:], x_0 .. x_B], so the accepted-path commit can rebuild the window from the line alone.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def check_conv_args(x, weight, bias, conv_state, state_indices, num_accepted, conv_anc, out):
    """Shape/dtype checks (host only, no sync)."""
    if conv_anc.dim() != 3 or conv_anc.dtype != torch.int32:
        raise ValueError(f"conv_anc must be int32 [R, N, W-1], got {conv_anc.dtype} {tuple(conv_anc.shape)}")
    R, N, Wm1 = conv_anc.shape
    if weight.dim() != 2 or weight.shape[1] != Wm1 + 1:
        raise ValueError(f"weight must be [dim, W] with W = {Wm1 + 1} (from conv_anc), got {tuple(weight.shape)}")
    D, W = weight.shape
    if x.shape != (R * N, D):
        raise ValueError(f"x must be [R*N, dim] = [{R * N}, {D}], got {tuple(x.shape)}")
    if out.shape != x.shape:
        raise ValueError(f"out must have x's shape {tuple(x.shape)}, got {tuple(out.shape)}")
    if bias is not None and bias.shape != (D,):
        raise ValueError(f"bias must be [dim] = [{D}] or None, got {tuple(bias.shape)}")
    if conv_state.dim() != 3 or conv_state.shape[1] != D or conv_state.shape[2] != W - 2 + N:
        raise ValueError(f"conv_state must be [lines, dim, state_len] = [*, {D}, {W - 2 + N}] "
                         f"(state_len = W - 2 + N), got {tuple(conv_state.shape)}")
    if state_indices.dim() != 2 or state_indices.shape[0] != R or state_indices.dtype != torch.int32:
        raise ValueError(f"state_indices must be int32 [R={R}, NS], got {state_indices.dtype} "
                         f"{tuple(state_indices.shape)}")
    if num_accepted.shape != (R,) or num_accepted.dtype != torch.int32:
        raise ValueError(f"num_accepted must be int32 [R={R}], got {num_accepted.dtype} {tuple(num_accepted.shape)}")


def tree_conv1d_ref(x, weight, bias, conv_state, state_indices, num_accepted, conv_anc, out, silu):
    """Float32 torch reference. Writes `out` and rewrites the requests' conv lines."""
    check_conv_args(x, weight, bias, conv_state, state_indices, num_accepted, conv_anc, out)
    R, N, Wm1 = conv_anc.shape
    D, W = weight.shape
    lines = state_indices[:, 0].long()
    valid = lines > 0
    cols = (num_accepted.long() - 1).view(R, 1, 1) + torch.arange(Wm1, device=x.device)
    hist = torch.gather(conv_state[lines.clamp(min=0)].float(), 2, cols.expand(R, D, Wm1))
    hist = hist * valid.view(R, 1, 1)  # [R, D, W-1], oldest first
    hist_t = hist.transpose(1, 2)  # [R, W-1, D]
    xr = x.view(R, N, D).float()
    wf = weight.float()
    acc = xr * wf[:, W - 1]
    for j in range(Wm1):  # (j+1)-th predecessor along the ancestry
        code = conv_anc[:, :, j].long()
        tree = torch.gather(xr, 1, code.clamp(min=0).unsqueeze(-1).expand(R, N, D))
        old = torch.gather(hist_t, 1, (Wm1 + code).clamp(0, Wm1 - 1).unsqueeze(-1).expand(R, N, D))
        acc = acc + torch.where((code >= 0).unsqueeze(-1), tree, old) * wf[:, W - 2 - j]
    if bias is not None:
        acc = acc + bias.float()
    if silu:
        acc = torch.nn.functional.silu(acc)
    out.copy_(acc.view(R * N, D))
    new = torch.cat([hist[:, :, 1:], xr.transpose(1, 2)], 2).to(conv_state.dtype)
    if bool(valid.any()):
        conv_state[lines[valid]] = new[valid]


@triton.jit
def _pred(acc, x, s_xt, anc_ptr, tm, r, N, c, m2, n1, n2, n3, wk):
    """Add one predecessor's contribution: a tree slot (code >= 0) or a history column."""
    code = tl.load(anc_ptr, mask=tm, other=-1)
    row = r * N + tl.maximum(code, 0)
    tv = tl.load(x + row[:, None].to(tl.int64) * s_xt + c[None, :], mask=m2 & (code >= 0)[:, None], other=0.0)
    hv = tl.where((code == -1)[:, None], n1[None, :], tl.where((code == -2)[:, None], n2[None, :], n3[None, :]))
    val = tl.where((code >= 0)[:, None], tv.to(tl.float32), hv)
    return acc + val * wk[None, :]


@triton.jit
def _tree_conv_kernel(x, s_xt, w, s_wd, s_ww, bias, state, s_sl, s_sd, s_sc, idx, s_ir, nacc, anc, out, s_ot,
                      N, D, W: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                      BD: tl.constexpr, TB: tl.constexpr):
    r = tl.program_id(0)
    c = tl.program_id(1) * BD + tl.arange(0, BD)
    cm = c < D
    line = tl.load(idx + r * s_ir).to(tl.int64)
    o = tl.load(nacc + r) - 1
    has = line > 0
    lm = tl.where(has, cm, False)  # (block & scalar-bool breaks the interpreter)
    sp = state + line * s_sl + c.to(tl.int64) * s_sd
    # History, newest first: n1 = code -1, n2 = code -2, n3 = code -3.
    n1 = tl.load(sp + (o + W - 2) * s_sc, mask=lm, other=0.0).to(tl.float32)
    n2 = tl.zeros([BD], dtype=tl.float32)
    n3 = tl.zeros([BD], dtype=tl.float32)
    if W > 2:
        n2 = tl.load(sp + (o + W - 3) * s_sc, mask=lm, other=0.0).to(tl.float32)
    if W > 3:
        n3 = tl.load(sp + (o + W - 4) * s_sc, mask=lm, other=0.0).to(tl.float32)
    wp = w + c * s_wd
    w_own = tl.load(wp + (W - 1) * s_ww, mask=cm, other=0.0).to(tl.float32)
    w1 = tl.load(wp + (W - 2) * s_ww, mask=cm, other=0.0).to(tl.float32)
    w2 = tl.zeros([BD], dtype=tl.float32)
    w3 = tl.zeros([BD], dtype=tl.float32)
    if W > 2:
        w2 = tl.load(wp + (W - 3) * s_ww, mask=cm, other=0.0).to(tl.float32)
    if W > 3:
        w3 = tl.load(wp + (W - 4) * s_ww, mask=cm, other=0.0).to(tl.float32)
    b = tl.zeros([BD], dtype=tl.float32)
    if HAS_BIAS:
        b = tl.load(bias + c, mask=cm, other=0.0).to(tl.float32)
    # Every read of this line happened above: from here on the program may overwrite it.
    tl.debug_barrier()
    # New line = [window[1:], x_0 .. x_{N-1}]; window[1:] is n2, n1 (W=4) or n1 (W=3).
    if W == 4:
        tl.store(sp, n2.to(state.dtype.element_ty), mask=lm)
        tl.store(sp + s_sc, n1.to(state.dtype.element_ty), mask=lm)
    if W == 3:
        tl.store(sp, n1.to(state.dtype.element_ty), mask=lm)
    for t0 in range(0, N, TB):
        t = t0 + tl.arange(0, TB)
        tm = t < N
        m2 = tm[:, None] & cm[None, :]
        rows = (r * N + t).to(tl.int64)
        xo = tl.load(x + rows[:, None] * s_xt + c[None, :], mask=m2, other=0.0)
        tl.store(sp[None, :] + (W - 2 + t)[:, None] * s_sc, xo.to(state.dtype.element_ty), mask=tl.where(has, m2, False))
        acc = xo.to(tl.float32) * w_own[None, :]
        ap = anc + (r * N + t) * (W - 1)
        acc = _pred(acc, x, s_xt, ap, tm, r, N, c, m2, n1, n2, n3, w1)
        if W > 2:
            acc = _pred(acc, x, s_xt, ap + 1, tm, r, N, c, m2, n1, n2, n3, w2)
        if W > 3:
            acc = _pred(acc, x, s_xt, ap + 2, tm, r, N, c, m2, n1, n2, n3, w3)
        acc += b[None, :]
        if SILU:
            acc = acc * tl.sigmoid(acc)
        tl.store(out + rows[:, None] * s_ot + c[None, :], acc.to(out.dtype.element_ty), mask=m2)


def tree_conv1d_triton(x, weight, bias, conv_state, state_indices, num_accepted, conv_anc, out, silu,
                       block_d: int = 64, block_t: int = 32, num_warps: int = 4):
    """Triton launcher; same contract as `tree_conv1d_ref`. No host sync, no allocation."""
    check_conv_args(x, weight, bias, conv_state, state_indices, num_accepted, conv_anc, out)
    if x.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError("x and out must be contiguous along dim (stride(1) == 1)")
    R, N, Wm1 = conv_anc.shape
    D, W = weight.shape
    grid = (R, triton.cdiv(D, block_d))
    _tree_conv_kernel[grid](
        x, x.stride(0), weight, weight.stride(0), weight.stride(1), bias if bias is not None else x,
        conv_state, conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
        state_indices, state_indices.stride(0), num_accepted, conv_anc, out, out.stride(0),
        N, D, W=W, HAS_BIAS=bias is not None, SILU=bool(silu), BD=block_d,
        TB=min(block_t, triton.next_power_of_2(N)), num_warps=num_warps)
