"""Accepted-path commit of the GatedDeltaNet state after the tree walk, for ALL GDN layers at once.

Walk result: `accepted` [R, L+1] slot indices (root first, -1 padded) and `path_len` [R] (0 = leave the
request untouched). With p = accepted[r, path_len[r] - 1] the last accepted slot:
- conv: after the verify a request's conv line holds [h_1 .. h_{W-2}, x_0 .. x_B] (see tree_conv);
  the last W-1 entries of [h_1 .. h_{W-2}, x_path...] are written to columns [p, p + W - 1), where
  vLLM's lazy convention reads them (a main-chain path already has them there: nothing moves);
- state (records strategy only): replay the path from the committed line with the recorded
  (k, v, g, beta) and store the result in line `state_indices[r, p]` (or `[r, 0]` with a single
  column). The snapshots strategy needs no state work: the snapshot of p is already in that line;
- `num_accepted[r] = p + 1` (in place), so the next step reads the committed window and state there.
Per-layer cache tensors go in as lists (vLLM gives each layer its own tensors); the Triton path
reads them through a cached device table of base pointers: one launch for all layers' conv windows
and one for all layers' replays.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .tree_gdn import committed_lines, gdn_update, gdn_update_ref


def _check_same(tensors, name):
    t0 = tensors[0]
    for t in tensors[1:]:
        if t.shape != t0.shape or t.stride() != t0.stride() or t.dtype != t0.dtype or t.device != t0.device:
            raise ValueError(f"all {name} must share shape, strides, dtype and device")


def check_commit_args(conv_states, ssm_states, state_indices, num_accepted, accepted, path_len, rec_kv, rec_gb,
                      width):
    """Shape/dtype checks (host only, no sync)."""
    R = accepted.shape[0]
    if width not in (2, 3, 4):
        raise ValueError(f"width (conv kernel size) must be 2, 3 or 4, got {width}")
    if accepted.dim() != 2 or accepted.dtype != torch.int32 or path_len.shape != (R,) or path_len.dtype != torch.int32:
        raise ValueError(f"accepted must be int32 [R, L+1] and path_len int32 [R], got {accepted.dtype} "
                         f"{tuple(accepted.shape)}, {path_len.dtype} {tuple(path_len.shape)}")
    if state_indices.dim() != 2 or state_indices.shape[0] != R or state_indices.dtype != torch.int32:
        raise ValueError(f"state_indices must be int32 [R={R}, NS], got {state_indices.dtype} {tuple(state_indices.shape)}")
    if num_accepted.shape != (R,) or num_accepted.dtype != torch.int32:
        raise ValueError(f"num_accepted must be int32 [R={R}], got {num_accepted.dtype} {tuple(num_accepted.shape)}")
    if len(conv_states) == 0:
        raise ValueError("conv_states must list one [lines, dim, state_len] tensor per GDN layer")
    _check_same(conv_states, "conv_states")
    if conv_states[0].dim() != 3:
        raise ValueError(f"conv_states entries must be [lines, dim, state_len], got {tuple(conv_states[0].shape)}")
    if (rec_kv is None) != (rec_gb is None):
        raise ValueError("rec_kv and rec_gb must be given together (records strategy) or both None (snapshots)")
    if rec_kv is not None:
        nl = len(conv_states)
        if len(ssm_states) != nl:
            raise ValueError(f"replay needs one ssm_state per layer: {len(ssm_states)} ssm_states, {nl} conv_states")
        _check_same(ssm_states, "ssm_states")
        _, HV, V, K = ssm_states[0].shape
        if rec_gb.dim() != 5 or rec_gb.shape[:2] != (nl, R) or rec_gb.shape[3:] != (2, HV) or not rec_gb.is_contiguous():
            raise ValueError(f"rec_gb must be contiguous [layers={nl}, R={R}, N, 2, HV={HV}], got {tuple(rec_gb.shape)}")
        N = rec_gb.shape[2]
        if rec_kv.dim() != 4 or rec_kv.shape[:3] != (nl, R, N) or not rec_kv.is_contiguous():
            raise ValueError(f"rec_kv must be contiguous [layers={nl}, R={R}, N={N}, H*K + HV*V], got {tuple(rec_kv.shape)}")
        if (rec_kv.shape[3] - HV * V) % K or rec_kv.shape[3] <= HV * V:
            raise ValueError(f"rec_kv last dim {rec_kv.shape[3]} is not H*K + HV*V for K={K}, HV*V={HV * V}")


def gdn_commit_ref(conv_states, ssm_states, state_indices, num_accepted, accepted, path_len, rec_kv, rec_gb,
                   width):
    """Torch reference (float32 replay). Mutates the listed caches and num_accepted."""
    check_commit_args(conv_states, ssm_states, state_indices, num_accepted, accepted, path_len, rec_kv, rec_gb,
                      width)
    src_lines = committed_lines(state_indices, num_accepted)
    single = state_indices.shape[1] == 1
    for r in range(accepted.shape[0]):
        n = int(path_len[r])
        if n <= 0:
            continue
        path = accepted[r, :n].long().tolist()
        p = path[-1]
        if rec_kv is not None:
            src, dst = int(src_lines[r]), int(state_indices[r, 0 if single else p])
            for layer, ssm in enumerate(ssm_states):
                _, HV, V, K = ssm.shape
                H = (rec_kv.shape[3] - HV * V) // K
                h = ssm[src].float() if src > 0 else torch.zeros(HV, V, K, device=ssm.device)
                for s in path:
                    kv = rec_kv[layer, r, s]
                    k = kv[: H * K].view(H, K).repeat_interleave(HV // H, 0)
                    h = gdn_update_ref(h, k, kv[H * K:].view(HV, V), rec_gb[layer, r, s, 0], rec_gb[layer, r, s, 1])
                if dst > 0:
                    ssm[dst] = h.to(ssm.dtype)
        line = int(state_indices[r, 0])
        if line > 0:
            # Canonical line after the verify: h_1..h_{W-2} in columns 0..W-3, x_s in column W-2+s.
            seq = list(range(width - 2)) + [width - 2 + s for s in path]
            cols = torch.tensor(seq[-(width - 1):], device=conv_states[0].device)
            for conv in conv_states:
                conv[line, :, p: p + width - 1] = conv[line][:, cols].clone()
        num_accepted[r] = p + 1


_PTR_TABLES: dict = {}


def pointer_table(tensors) -> torch.Tensor:
    """int64 device tensor of base addresses, cached so CUDA-graph capture and replay reuse one
    table (the caches are persistent: the first, eager call builds it)."""
    key = (tensors[0].device, tuple(t.data_ptr() for t in tensors))
    tab = _PTR_TABLES.get(key)
    if tab is None:
        tab = torch.tensor(key[1], dtype=torch.int64, device=tensors[0].device)
        _PTR_TABLES[key] = tab
    return tab


@triton.jit
def _src_col(acc, r, s_ar, n, e, W: tl.constexpr):
    m = n - (W - 1) + e  # path index of window entry e (negative: history)
    s = tl.load(acc + r * s_ar + tl.maximum(m, 0))
    return W - 2 + tl.where(m >= 0, s, m)


@triton.jit
def _conv_commit_kernel(tab, like, s_sl, s_sd, s_sc, idx, s_ir, nacc, acc, s_ar, plen, D,
                        W: tl.constexpr, BD: tl.constexpr):
    r = tl.program_id(0)
    cb = tl.program_id(1)
    layer = tl.program_id(2)
    n = tl.load(plen + r)
    line = tl.load(idx + r * s_ir).to(tl.int64)
    if n > 0:
        p = tl.load(acc + r * s_ar + n - 1)
        if line > 0:
            base = tl.load(tab + layer).to(tl.pointer_type(like.dtype.element_ty))  # `like`: layer 0
            c = cb * BD + tl.arange(0, BD)
            cm = c < D
            lp = base + line * s_sl + c.to(tl.int64) * s_sd
            c0 = _src_col(acc, r, s_ar, n, 0, W)
            v0 = tl.load(lp + c0 * s_sc, mask=cm)
            c1 = c0
            v1 = v0
            c2 = c0
            v2 = v0
            if W > 2:
                c1 = _src_col(acc, r, s_ar, n, 1, W)
                v1 = tl.load(lp + c1 * s_sc, mask=cm)
            if W > 3:
                c2 = _src_col(acc, r, s_ar, n, 2, W)
                v2 = tl.load(lp + c2 * s_sc, mask=cm)
            tl.debug_barrier()  # all reads of the line before any write
            tl.store(lp + p * s_sc, v0, mask=tl.where(c0 != p, cm, False))
            if W > 2:
                tl.store(lp + (p + 1) * s_sc, v1, mask=tl.where(c1 != p + 1, cm, False))
            if W > 3:
                tl.store(lp + (p + 2) * s_sc, v2, mask=tl.where(c2 != p + 2, cm, False))
        if (cb == 0) & (layer == 0):
            tl.store(nacc + r, p + 1)


@triton.jit
def _replay_kernel(tab, like, s_sl, s_sh, s_sv, s_sk, idx, s_ir, s_ic, nacc, acc, s_ar, plen, rec_kv, rec_gb,
                   N, NS, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                   BK: tl.constexpr, BV: tl.constexpr):
    i_v = tl.program_id(0)
    i_rh = tl.program_id(1)
    layer = tl.program_id(2).to(tl.int64)
    R = tl.num_programs(1) // HV
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
        col0 = 0
        col1 = 0
        if NS > 1:  # lazy chain layout: read at num_accepted - 1, write at the last accepted slot
            col0 = tl.load(nacc + r) - 1
            col1 = p
        src = tl.load(idx + r * s_ir + col0 * s_ic).to(tl.int64)
        dst = tl.load(idx + r * s_ir + col1 * s_ic).to(tl.int64)
        h = tl.load(base + src * s_sl + st_off, mask=tl.where(src > 0, mh, False), other=0.0).to(tl.float32)
        KVD: tl.constexpr = H * K + HV * V
        rows = (layer * R + r) * N
        for m in range(n):
            row = rows + tl.load(acc + r * s_ar + m)
            kr = tl.load(rec_kv + row * KVD + hk * K + ok, mask=mk, other=0.0).to(tl.float32)
            v = tl.load(rec_kv + row * KVD + H * K + hv * V + ov, mask=mv, other=0.0).to(tl.float32)
            g = tl.load(rec_gb + row * (2 * HV) + hv)
            beta = tl.load(rec_gb + row * (2 * HV) + HV + hv)
            h = gdn_update(h, kr, v, g, beta)
        tl.store(base + dst * s_sl + st_off, h.to(like.dtype.element_ty), mask=tl.where(dst > 0, mh, False))


def gdn_commit_triton(conv_states, ssm_states, state_indices, num_accepted, accepted, path_len, rec_kv, rec_gb,
                      width, block_d: int = 128, block_v: int = 16, num_warps: int = 2):
    """Triton launcher (replay launch, then the conv launch that also moves num_accepted).
    Same contract as `gdn_commit_ref`; no host sync, no allocation after the first call."""
    check_commit_args(conv_states, ssm_states, state_indices, num_accepted, accepted, path_len, rec_kv, rec_gb,
                      width)
    R = accepted.shape[0]
    nl = len(conv_states)
    if rec_kv is not None:
        ssm = ssm_states[0]
        _, HV, V, K = ssm.shape
        BV = min(block_v, triton.next_power_of_2(V))
        _replay_kernel[(triton.cdiv(V, BV), R * HV, nl)](
            pointer_table(ssm_states), ssm, *ssm.stride(), state_indices, *state_indices.stride(), num_accepted,
            accepted, accepted.stride(0), path_len, rec_kv, rec_gb, rec_kv.shape[2], state_indices.shape[1],
            H=(rec_kv.shape[3] - HV * V) // K, HV=HV, K=K, V=V,
            BK=triton.next_power_of_2(K), BV=BV, num_warps=num_warps)
    conv = conv_states[0]
    D = conv.shape[1]
    _conv_commit_kernel[(R, triton.cdiv(D, block_d), nl)](
        pointer_table(conv_states), conv, *conv.stride(), state_indices, state_indices.stride(0), num_accepted,
        accepted, accepted.stride(0), path_len, D, W=width, BD=block_d,
        num_warps=4)
