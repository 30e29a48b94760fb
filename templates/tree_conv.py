"""Tree causal conv1d for GatedDeltaNet verify: the Triton kernel behind `ddtree::tree_conv1d` (ops.py).

Semantics, state layout and the plain torch reference (the op's CPU kernel): tree_conv_ref.py. One
program per (request, block of BD channels): it reads the newest W-1 committed history columns and the
weights into registers, rewrites the request's conv line to [window[1:], x_0 .. x_B] once every read of
the line is done, then runs the tokens TB at a time, each adding its W-1 predecessors (a tree slot or
one of the history columns in registers, as `conv_anc` says).
"""

from __future__ import annotations

from ddtree_compile.templates.tree_conv_ref import check_conv_args, vllm_cuda_order

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without triton: only the reference is available
    triton = None

if triton is not None:

    @triton.jit
    def _product(val, wk, ROUND: tl.constexpr):
        """val * wk, rounded to bf16 when following vLLM's CUDA conv (tree_conv_ref.vllm_cuda_order).
        Rounded to nearest even on the bits: the interpreter's float32 -> bf16 cast truncates."""
        p = val * wk
        if ROUND:
            bits = p.to(tl.int32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
            p = bits.to(tl.float32, bitcast=True)
        return p

    @triton.jit
    def _pred(acc, x, s_xt, anc_ptr, tm, r, N, c, m2, n1, n2, n3, wk, ROUND: tl.constexpr):
        """Add one predecessor's contribution: a tree slot (code >= 0) or a history column."""
        code = tl.load(anc_ptr, mask=tm, other=-1)
        row = r * N + tl.maximum(code, 0)
        tv = tl.load(x + row[:, None].to(tl.int64) * s_xt + c[None, :], mask=m2 & (code >= 0)[:, None], other=0.0)
        hv = tl.where((code == -1)[:, None], n1[None, :], tl.where((code == -2)[:, None], n2[None, :], n3[None, :]))
        val = tl.where((code >= 0)[:, None], tv.to(tl.float32), hv)
        return acc + _product(val, wk[None, :], ROUND)

    @triton.jit
    def _tree_conv_kernel(x, s_xt, w, s_wd, s_ww, bias, state, s_sl, s_sd, s_sc, idx, s_ir, nacc, anc, out, s_ot,
                          N, D, W: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                          BD: tl.constexpr, TB: tl.constexpr, ROUND: tl.constexpr):
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
            tl.store(sp[None, :] + (W - 2 + t)[:, None] * s_sc, xo.to(state.dtype.element_ty),
                     mask=tl.where(has, m2, False))
            ap = anc + (r * N + t) * (W - 1)
            if ROUND:  # vLLM's CUDA order (tree_conv_ref.vllm_cuda_order): bias, oldest first, own input last
                acc = tl.zeros([TB, BD], dtype=tl.float32) + b[None, :]
                if W > 3:
                    acc = _pred(acc, x, s_xt, ap + 2, tm, r, N, c, m2, n1, n2, n3, w3, ROUND)
                if W > 2:
                    acc = _pred(acc, x, s_xt, ap + 1, tm, r, N, c, m2, n1, n2, n3, w2, ROUND)
                acc = _pred(acc, x, s_xt, ap, tm, r, N, c, m2, n1, n2, n3, w1, ROUND)
                acc = acc + _product(xo.to(tl.float32), w_own[None, :], ROUND)
                if SILU:
                    acc = acc / (1 + tl.exp(-acc))
            else:
                acc = xo.to(tl.float32) * w_own[None, :]
                acc = _pred(acc, x, s_xt, ap, tm, r, N, c, m2, n1, n2, n3, w1, ROUND)
                if W > 2:
                    acc = _pred(acc, x, s_xt, ap + 1, tm, r, N, c, m2, n1, n2, n3, w2, ROUND)
                if W > 3:
                    acc = _pred(acc, x, s_xt, ap + 2, tm, r, N, c, m2, n1, n2, n3, w3, ROUND)
                acc += b[None, :]
                if SILU:
                    acc = acc * tl.sigmoid(acc)
            tl.store(out + rows[:, None] * s_ot + c[None, :], acc.to(out.dtype.element_ty), mask=m2)


def tree_conv1d_triton(x, weight, bias, conv_state, state_indices, num_accepted, conv_anc, out, silu,
                       vllm_order=None, block_d: int = 64, block_t: int = 32, num_warps: int = 4):
    """Triton launcher; same contract as `tree_conv1d_ref`. No host sync, no allocation."""
    if triton is None:
        raise RuntimeError("tree_conv1d: triton is not installed")
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
        TB=min(block_t, triton.next_power_of_2(N)),
        ROUND=bool(vllm_cuda_order(x, weight, conv_state) if vllm_order is None else vllm_order),
        num_warps=num_warps)
