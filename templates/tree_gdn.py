"""Tree gated delta rule for the tree verify: the Triton kernel behind `ddtree::tree_gdn` (ops.py).

Math, state layout, strategies and the plain torch reference (the op's CPU kernel): tree_gdn_ref.py.
One program per (block of BV value rows, request x value head) holds its [BV, K] fp32 state tile in
registers and visits the request's slots in `GdnTreeMeta.walk` order (DFS preorder, gdn_meta.py): a
node's parent is the previous position unless the walk backtracks, so the state is reloaded only
there (F_RELOAD, from the per-depth fp32 `stack`) and saved only at branch points (F_SAVE). The next
position's inputs are loaded before the current one is computed.

The q / k L2 norms are vLLM's bits only in vLLM's warp count (4): a tile on other warps reduces the
128 squares in another order. Such a tile reads them from `_qk_norms_kernel`, a pre-pass on vLLM's 4
warps (the same load, sum and rsqrt as vLLM's kernel), so every tile's outputs can be vLLM's.
"""

from __future__ import annotations

import torch

from ddtree_compile.templates.gdn_meta import F_FROM_COMMITTED, F_PAD, F_RELOAD, F_SAVE
from ddtree_compile.templates.tree_gdn_ref import check_gdn_args
from ddtree_compile.templates import tuning

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without triton: only the reference is available
    triton = None

if triton is not None:
    # Walk flags as constexpr globals (compiled Triton only reads constexpr globals).
    _FROM_COMMITTED = tl.constexpr(F_FROM_COMMITTED)
    _RELOAD = tl.constexpr(F_RELOAD)
    _SAVE = tl.constexpr(F_SAVE)
    _PAD = tl.constexpr(F_PAD)

    @triton.jit
    def gdn_step(h, k, v, g, beta):
        """One delta-rule step on an fp32 [BV, BK] tile with k already L2-normalised."""
        h = h * tl.exp(g)
        vn = (v - tl.sum(h * k[None, :], 1)) * beta
        return h + vn[:, None] * k[None, :]

    @triton.jit
    def gdn_update(h, kr, v, g, beta):
        """One delta-rule step from the raw k; shared by the verify walk and the replay."""
        return gdn_step(h, kr * tl.rsqrt(tl.sum(kr * kr) + 1e-6), v, g, beta)

    @triton.jit
    def _qk_norms_kernel(qkv, s_qt, norms, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr):
        """norms[row, 0 / 1, hk] = rsqrt(|q|^2 + 1e-6) / rsqrt(|k|^2 + 1e-6) of key head hk: vLLM's
        expression on vLLM's 4 warps (the launcher's), one program per (row, key head)."""
        row = tl.program_id(0).to(tl.int64)
        hk = tl.program_id(1)
        ok = tl.arange(0, BK)
        mk = ok < K
        qp = qkv + row * s_qt + hk * K + ok
        q = tl.load(qp, mask=mk, other=0).to(tl.float32)
        k = tl.load(qp + H * K, mask=mk, other=0).to(tl.float32)
        tl.store(norms + row * (2 * H) + hk, tl.rsqrt(tl.sum(q * q) + 1e-6))
        tl.store(norms + row * (2 * H) + H + hk, tl.rsqrt(tl.sum(k * k) + 1e-6))

    @triton.jit
    def _load_node(qkv, s_qt, a, b, s_abt, norms, walk, r, kk, N, hk, hv, ok, mk, ov, mv,
                   H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, NORMS: tl.constexpr):
        wp = walk + (r * N + kk) * 4
        s = tl.load(wp)
        row = (r * N + s).to(tl.int64)
        qp = qkv + row * s_qt
        q = tl.load(qp + hk * K + ok, mask=mk, other=0.0).to(tl.float32)
        kr = tl.load(qp + H * K + hk * K + ok, mask=mk, other=0.0).to(tl.float32)
        v = tl.load(qp + 2 * H * K + hv * V + ov, mask=mv, other=0.0).to(tl.float32)
        av = tl.load(a + row * s_abt + hv).to(tl.float32)
        bv = tl.load(b + row * s_abt + hv).to(tl.float32)
        fq = 1.0
        fk = 1.0
        if NORMS:  # the pre-pass's factors (else the caller computes them from q and kr)
            fq = tl.load(norms + row * (2 * H) + hk)
            fk = tl.load(norms + row * (2 * H) + H + hk)
        return s, tl.load(wp + 2), tl.load(wp + 3), q, kr, v, av, bv, fq, fk

    @triton.jit
    def _gates(av, bv, A, dtb):
        """The step's decay (log space) and write strength, as vLLM's chain kernel computes them."""
        x = av + dtb
        g = -tl.exp(A) * tl.where(x <= 20.0, tl.log(1.0 + tl.exp(x)), x)
        return g, tl.sigmoid(bv)

    @triton.jit
    def _tree_gdn_kernel(qkv, s_qt, a, b, s_abt, norms, A_log, dt_bias,
                         state, s_sl, s_sh, s_sv, s_sk, idx, s_ir, s_ic, nacc, walk, stack, s_kr, s_kd,
                         out, s_ot, s_oh, rec_kv, rec_gb, scale, N, NS, NSPLIT,
                         H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                         BK: tl.constexpr, BV: tl.constexpr, SNAP: tl.constexpr, REC: tl.constexpr,
                         NP2: tl.constexpr, NORMS: tl.constexpr):
        i_v = tl.program_id(0)
        i_rh = tl.program_id(1)
        i_p = tl.program_id(2)  # this program's part of the walk (NSPLIT parts; 1: the whole walk)
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
        stack_r = stack + (r * NSPLIT + i_p).to(tl.int64) * s_kr  # each part its own depth stack
        A = tl.load(A_log + hv).to(tl.float32)
        dtb = tl.load(dt_bias + hv).to(tl.float32)
        col0 = 0
        if NS > 1:  # lazy chain layout: the committed state is the slot num_accepted - 1
            col0 = tl.load(nacc + r) - 1
        line0 = tl.load(idx + r * s_ir + col0 * s_ic).to(tl.int64)
        KVD: tl.constexpr = H * K + HV * V
        chunk = tl.cdiv(N, NSPLIT)
        k0 = i_p * chunk  # this part visits walk positions [k0, k1)
        k1 = tl.minimum(N, k0 + chunk)
        h = tl.zeros([BV, BK], dtype=tl.float32)
        if NP2 > 1:  # split walk: replay the ancestors of position k0 (no outputs), saving branch points
            f0 = tl.load(walk + (r * N + tl.minimum(k0, N - 1)) * 4 + 3)
            if (k0 > 0) & (k0 < N) & ((f0 & _PAD) == 0):
                d0 = tl.load(walk + (r * N + k0) * 4 + 2)
                pos = tl.arange(0, NP2)
                dep = tl.load(walk + (r * N + pos) * 4 + 2, mask=pos < k0, other=-1)
                h = tl.load(state + line0 * s_sl + st_off, mask=tl.where(line0 > 0, mh, False),
                            other=0.0).to(tl.float32)
                for t in range(0, d0):
                    # In preorder the ancestor at depth t is the last position before k0 at depth t.
                    at = tl.max(tl.where(dep == t, pos, -1), 0)
                    _, _, fa, _, kr, v, av, bv, _, fk = _load_node(qkv, s_qt, a, b, s_abt, norms, walk, r, at, N,
                                                                   hk, hv, ok, mk, ov, mv, H, HV, K, V, NORMS)
                    g, beta = _gates(av, bv, A, dtb)
                    if NORMS:
                        h = gdn_step(h, kr * fk, v, g, beta)
                    else:
                        h = gdn_update(h, kr, v, g, beta)
                    if (fa & _SAVE) != 0:
                        tl.store(stack_r + t * s_kd + sk_off, h, mask=mh)
        # Software pipelining: the next position's inputs are loaded before this one is computed.
        s_n, d_n, f_n, q_n, k_n, v_n, a_n, b_n, fq_n, fk_n = _load_node(
            qkv, s_qt, a, b, s_abt, norms, walk, r, tl.minimum(k0, N - 1), N, hk, hv, ok, mk, ov, mv,
            H, HV, K, V, NORMS)
        for kk in range(k0, k1):
            s, d, f, q, kr, v, av, bv, fq, fk = s_n, d_n, f_n, q_n, k_n, v_n, a_n, b_n, fq_n, fk_n
            s_n, d_n, f_n, q_n, k_n, v_n, a_n, b_n, fq_n, fk_n = _load_node(
                qkv, s_qt, a, b, s_abt, norms, walk, r, tl.minimum(kk + 1, k1 - 1), N, hk, hv, ok, mk, ov, mv,
                H, HV, K, V, NORMS)
            row = (r * N + s).to(tl.int64)
            op = out + row * s_ot + hv * s_oh + ov
            if (f & _PAD) != 0:
                tl.store(op, tl.zeros([BV], dtype=tl.float32).to(out.dtype.element_ty), mask=mv)
            else:
                if (f & _FROM_COMMITTED) != 0:
                    h = tl.load(state + line0 * s_sl + st_off, mask=tl.where(line0 > 0, mh, False),
                                other=0.0).to(tl.float32)
                elif (f & _RELOAD) != 0:
                    tl.debug_barrier()
                    h = tl.load(stack_r + (d - 1) * s_kd + sk_off, mask=mh, other=0.0)
                g, beta = _gates(av, bv, A, dtb)
                if NORMS:
                    h = gdn_step(h, kr * fk, v, g, beta)
                    qn = q * fq * scale
                else:
                    h = gdn_update(h, kr, v, g, beta)
                    qn = q * tl.rsqrt(tl.sum(q * q) + 1e-6) * scale
                tl.store(op, tl.sum(h * qn[None, :], 1).to(out.dtype.element_ty), mask=mv)
                if (f & _SAVE) != 0:
                    tl.store(stack_r + d * s_kd + sk_off, h, mask=mh)
                if SNAP:
                    line = tl.load(idx + r * s_ir + s * s_ic).to(tl.int64)
                    tl.store(state + line * s_sl + st_off, h.to(state.dtype.element_ty),
                             mask=tl.where(line > 0, mh, False))
                if REC:
                    rp = rec_kv + row * KVD
                    if (hv % (HV // H) == 0) & (i_v == 0):
                        tl.store(rp + hk * K + ok, kr.to(rec_kv.dtype.element_ty), mask=mk)
                    tl.store(rp + H * K + hv * V + ov, v.to(rec_kv.dtype.element_ty), mask=mv)
                    if i_v == 0:
                        tl.store(rec_gb + row * (2 * HV) + hv, g)
                        tl.store(rec_gb + row * (2 * HV) + HV + hv, beta)


VLLM_WARPS = 4  # vLLM's `fused_sigmoid_gating_delta_rule_update` launches 4 warps whatever the shape


def norms_apart(num_warps: int) -> bool:
    """Whether a tile on `num_warps` warps reads its q / k norms from the pre-pass (see the module doc)."""
    return num_warps != VLLM_WARPS


def qk_norms_triton(qkv, num_k_heads, head_k_dim, norms=None):
    """The pre-pass alone: float32 [rows, 2, H] rsqrt factors of every row's q and k heads (`norms`, if
    given, is written and returned). Reference: tree_gdn_ref.qk_norms_ref."""
    if triton is None:
        raise RuntimeError("tree_gdn: triton is not installed")
    T, H, K = qkv.shape[0], num_k_heads, head_k_dim
    if norms is None:
        norms = torch.empty(T, 2, H, dtype=torch.float32, device=qkv.device)
    elif norms.shape != (T, 2, H) or norms.dtype != torch.float32 or not norms.is_contiguous():
        raise ValueError(f"norms must be contiguous float32 [rows, 2, H] = [{T}, 2, {H}], got {norms.dtype} "
                         f"{tuple(norms.shape)}")
    if T:
        _qk_norms_kernel[(T, H)](qkv, qkv.stride(0), norms, H=H, K=K, BK=triton.next_power_of_2(K),
                                 num_warps=VLLM_WARPS)
    return norms


def tree_gdn_triton(qkv, a, b, A_log, dt_bias, ssm_state, state_indices, num_accepted, walk, stack, out,
                    rec_kv, rec_gb, num_k_heads, head_k_dim, scale, write_snapshots,
                    block_v: int | None = None, num_warps: int | None = None, splits: int | None = None,
                    norms=None):
    """Triton launcher; same contract as `tree_gdn_ref`. No host sync; no allocation but, for a tile off
    vLLM's 4 warps, the pre-pass's [R*N, 2, H] norms when `norms` is not given. The tile and the walk
    split are tuning.gdn_tiles()'s unless given.

    `splits` > 1 cuts each request's walk into that many parts of consecutive positions, one program
    each: a part first replays, without outputs, the ancestors of its first position (in preorder,
    the last earlier position at each smaller depth), so its sequential steps are that depth plus its
    part's length rather than all N, and every node's state comes from the same updates in the same
    order as in one part. Each part has its own depth stack: the split is capped at stack rows // R.
    Snapshots take one part: a part would read the committed state from a line another part's snapshot
    may already have overwritten (the slot num_accepted - 1's).
    """
    if triton is None:
        raise RuntimeError("tree_gdn: triton is not installed")
    check_gdn_args(qkv, a, b, ssm_state, state_indices, num_accepted, walk, stack, out, rec_kv, rec_gb,
                   num_k_heads, head_k_dim, write_snapshots)
    R, N = walk.shape[:2]
    _, HV, V, K = ssm_state.shape
    tiles = tuning.gdn_tiles(tuning.arch_of(qkv.device)[0], R)  # (by module: aot_compile sets the arch)
    block_v = tiles.block_v if block_v is None else block_v
    num_warps = tiles.num_warps if num_warps is None else num_warps
    splits = max(1, min(tiles.splits if splits is None else splits, stack.shape[0] // R, N))
    if write_snapshots:
        splits = 1
    BV = min(block_v, triton.next_power_of_2(V))
    grid = (triton.cdiv(V, BV), R * HV, splits)
    rec = rec_kv is not None
    apart = norms_apart(num_warps)
    if apart:
        norms = qk_norms_triton(qkv, num_k_heads, head_k_dim, norms)
    _tree_gdn_kernel[grid](
        qkv, qkv.stride(0), a, b, a.stride(0), norms if apart else qkv, A_log, dt_bias,
        ssm_state, *ssm_state.stride(), state_indices, *state_indices.stride(), num_accepted, walk,
        stack, stack.stride(0), stack.stride(1), out, out.stride(0), out.stride(1),
        rec_kv if rec else qkv, rec_gb if rec else stack, float(scale), N, state_indices.shape[1], splits,
        H=num_k_heads, HV=HV, K=K, V=V, BK=triton.next_power_of_2(K), BV=BV,
        SNAP=bool(write_snapshots), REC=rec, NP2=triton.next_power_of_2(N) if splits > 1 else 1, NORMS=apart,
        num_warps=num_warps)
