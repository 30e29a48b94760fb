"""Accepted-path commit of the GatedDeltaNet state for ALL GDN layers: the Triton kernels behind
`ddtree::gdn_commit` (ops.py).

Semantics and the plain torch reference (the op's CPU kernel): gdn_commit_ref.py. vLLM gives each
layer its own cache tensors; the kernels read them through a cached device table of base pointers
(`pointer_table`), so there is one launch for all layers' states (records strategy: the replay;
snapshots strategy: the copies; one program per block of BV value rows x request x value head x
layer) and one for all layers' conv lines (one program per request x block of BD channels x layer;
it also sets num_accepted). Layers of several KV cache groups share the launches: each layer reads
its group's state lines and num_accepted (`layer_group`, a cached device table like the pointers).
"""

from __future__ import annotations

import torch

from ddtree_compile.templates.gdn_commit_ref import check_commit_args

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without triton: only the reference is available
    triton = None


_PTR_TABLES: dict = {}
_GROUP_TABLES: dict = {}


def pointer_table(tensors) -> torch.Tensor:
    """int64 device tensor of base addresses, cached so CUDA-graph capture and replay reuse one
    table (the caches are persistent: the first, eager call builds it)."""
    key = (tensors[0].device, tuple(t.data_ptr() for t in tensors))
    tab = _PTR_TABLES.get(key)
    if tab is None:
        tab = torch.tensor(key[1], dtype=torch.int64, device=tensors[0].device)
        _PTR_TABLES[key] = tab
    return tab


if triton is not None:
    from ddtree_compile.templates.tree_gdn import gdn_update  # the delta-rule step the verify kernel runs

    @triton.jit
    def _conv_commit_kernel(tab, like, s_sl, s_sd, s_sc, idx, s_ig, s_ir, nacc, s_ng, lgrp, acc, s_ar, plen, D,
                            W: tl.constexpr, BD: tl.constexpr):
        r = tl.program_id(0)
        cb = tl.program_id(1)
        layer = tl.program_id(2)
        grp = tl.load(lgrp + layer).to(tl.int64)
        idx += grp * s_ig
        nacc += grp * s_ng
        n = tl.load(plen + r)
        line = tl.load(idx + r * s_ir).to(tl.int64)
        if n > 0:
            if line > 0:
                base = tl.load(tab + layer).to(tl.pointer_type(like.dtype.element_ty))  # `like`: layer 0
                c = cb * BD + tl.arange(0, BD)
                cm = c < D
                lp = base + line * s_sl + c.to(tl.int64) * s_sd
                # the path compacted to chain columns: column W-2+m <- W-2+path[m]; path[m] >= m, so
                # each channel's (one thread's) later reads are never at a column written before
                for m in range(n):
                    s = tl.load(acc + r * s_ar + m)
                    v = tl.load(lp + (W - 2 + s) * s_sc, mask=tl.where(s != m, cm, False))
                    tl.store(lp + (W - 2 + m) * s_sc, v, mask=tl.where(s != m, cm, False))
            if cb == 0:  # every layer of the group stores the same n (nothing in this launch reads it)
                tl.store(nacc + r, n)

    @triton.jit
    def _state_commit_kernel(tab, like, s_sl, s_sh, s_sv, s_sk, idx, s_ig, s_ir, s_ic, nacc, s_ng, lgrp, acc, s_ar,
                             plen, snap, rec_kv, rec_gb, s_kvl, s_gbl, N, NS, H: tl.constexpr, HV: tl.constexpr,
                             K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                             REC: tl.constexpr, SNAP: tl.constexpr):
        i_v = tl.program_id(0)
        i_rh = tl.program_id(1)
        layer = tl.program_id(2).to(tl.int64)
        grp = tl.load(lgrp + layer).to(tl.int64)
        idx += grp * s_ig
        nacc += grp * s_ng
        r = i_rh // HV
        hv = i_rh % HV
        hk = hv // (HV // H)
        n = tl.load(plen + r)
        if n > 0:
            ok = tl.arange(0, BK)
            ov = i_v * BV + tl.arange(0, BV)
            mk = ok < K
            mv = ov < V
            mh = mv[:, None] & mk[None, :]
            st_off = hv * s_sh + ov[:, None] * s_sv + ok[None, :] * s_sk
            base = tl.load(tab + layer).to(tl.pointer_type(like.dtype.element_ty))
            p = tl.load(acc + r * s_ar + n - 1)
            d = -1
            if SNAP:
                d = tl.load(snap + r)
            d = tl.where((d >= 0) & (d < n - 1) & (NS > 1), d, -1)
            snap_line = tl.load(idx + r * s_ir + tl.maximum(d, 0) * s_ic).to(tl.int64)
            snap_mask = tl.where((d >= 0) & (snap_line > 0), mh, False)
            col0 = 0
            col1 = 0
            if NS > 1:  # chain layout: read at num_accepted - 1, write at n - 1
                col0 = tl.load(nacc + r) - 1
                col1 = n - 1
            dst = tl.load(idx + r * s_ir + col1 * s_ic).to(tl.int64)
            if REC:
                src = tl.load(idx + r * s_ir + col0 * s_ic).to(tl.int64)
                h = tl.load(base + src * s_sl + st_off, mask=tl.where(src > 0, mh, False), other=0.0).to(tl.float32)
                KVD: tl.constexpr = H * K + HV * V
                kv_l = rec_kv + layer * s_kvl  # the layer's records (rows beyond the batch: padding)
                gb_l = rec_gb + layer * s_gbl
                for m in range(n):
                    row = r * N + tl.load(acc + r * s_ar + m)
                    kr = tl.load(kv_l + row * KVD + hk * K + ok, mask=mk, other=0.0).to(tl.float32)
                    v = tl.load(kv_l + row * KVD + H * K + hv * V + ov, mask=mv, other=0.0).to(tl.float32)
                    g = tl.load(gb_l + row * (2 * HV) + hv)
                    beta = tl.load(gb_l + row * (2 * HV) + HV + hv)
                    h = gdn_update(h, kr, v, g, beta)
                    tl.store(base + snap_line * s_sl + st_off, h.to(like.dtype.element_ty),
                             mask=tl.where(m == d, snap_mask, False))
                tl.store(base + dst * s_sl + st_off, h.to(like.dtype.element_ty), mask=tl.where(dst > 0, mh, False))
            elif NS > 1:  # snapshots: node s's state is in line s; path[d]'s line may be n - 1's: d first
                sd = tl.load(acc + r * s_ar + tl.maximum(d, 0))
                from_line = tl.load(idx + r * s_ir + sd * s_ic).to(tl.int64)
                h = tl.load(base + from_line * s_sl + st_off, mask=snap_mask, other=0.0)
                tl.store(base + snap_line * s_sl + st_off, h, mask=snap_mask)
                tl.debug_barrier()
                p_line = tl.load(idx + r * s_ir + p * s_ic).to(tl.int64)
                cm = tl.where((dst > 0) & (p != n - 1), mh, False)
                h = tl.load(base + p_line * s_sl + st_off, mask=cm, other=0.0)
                tl.store(base + dst * s_sl + st_off, h, mask=cm)


def group_table(layer_group, n_layers: int, device) -> torch.Tensor:
    """int32 device tensor of each layer's group (all 0 without groups), cached like pointer_table."""
    key = (device, tuple(int(g) for g in layer_group) if layer_group is not None else (0,) * n_layers)
    tab = _GROUP_TABLES.get(key)
    if tab is None:
        tab = torch.tensor(key[1], dtype=torch.int32, device=device)
        _GROUP_TABLES[key] = tab
    return tab


def gdn_commit_triton(conv_states, ssm_states, state_indices, num_accepted, accepted, path_len, rec_kv, rec_gb,
                      width, snap_depth=None, layer_group=None, block_d: int = 128, block_v: int = 32,
                      num_warps: int = 4):
    """Triton launcher (the state launch, then the conv launch that also sets num_accepted).
    Same contract as `gdn_commit_ref`; no host sync, no allocation after the first call."""
    if triton is None:
        raise RuntimeError("gdn_commit: triton is not installed")
    check_commit_args(conv_states, ssm_states, state_indices, num_accepted, accepted, path_len, rec_kv, rec_gb,
                      width, snap_depth, layer_group)
    R = accepted.shape[0]
    nl = len(conv_states)
    grouped = layer_group is not None
    lgrp = group_table(layer_group, nl, accepted.device)
    s_ig, s_ng = (state_indices.stride(0), num_accepted.stride(0)) if grouped else (0, 0)
    si = state_indices[0] if grouped else state_indices  # group 0's; a layer's group adds its offset
    rec = rec_kv is not None
    if rec or si.shape[1] > 1:
        ssm = ssm_states[0]
        _, HV, V, K = ssm.shape
        BV = min(block_v, triton.next_power_of_2(V))
        dummy = si  # (pointers the constexpr branches never read)
        _state_commit_kernel[(triton.cdiv(V, BV), R * HV, nl)](
            pointer_table(ssm_states), ssm, *ssm.stride(), state_indices, s_ig, *si.stride(), num_accepted, s_ng,
            lgrp, accepted, accepted.stride(0), path_len, dummy if snap_depth is None else snap_depth,
            rec_kv if rec else dummy, rec_gb if rec else dummy, rec_kv.stride(0) if rec else 0,
            rec_gb.stride(0) if rec else 0, rec_kv.shape[2] if rec else 0, si.shape[1],
            H=(rec_kv.shape[3] - HV * V) // K if rec else 1, HV=HV, K=K, V=V,
            BK=triton.next_power_of_2(K), BV=BV, REC=rec, SNAP=snap_depth is not None, num_warps=num_warps)
    conv = conv_states[0]
    D = conv.shape[1]
    _conv_commit_kernel[(R, triton.cdiv(D, block_d), nl)](
        pointer_table(conv_states), conv, *conv.stride(), state_indices, s_ig, si.stride(0), num_accepted, s_ng,
        lgrp, accepted, accepted.stride(0), path_len, D, W=width, BD=block_d,
        num_warps=4)
