"""The DDTree build (beam per depth, pre-order, final top-B, TreeBatch) as one Triton program per request.

Same algorithm and the same packed int64 keys as the torch reference `ddtree_compile.core.build._build`
(core/build.py calls this kernel instead on CUDA), so the result is equal bit for bit, ties included.

Per depth d the program scores the W*K candidates (beam position w, rank k; flat index c = w*K+k),
sorts their keys once to read the W-th largest, and keeps {key >= that}: keys hold a unique index,
so that is exactly the top-W set, and an exclusive cumsum of the flags in flat order gives each
kept candidate its beam position (the lexicographic order the reference re-sorts into). The beam
lives in per-request global scratch; other lanes' values are read back after tl.debug_barrier().
Subtree sizes come from a backward pass (children of a parent are contiguous in the next beam,
so segment sums by cumsum), pre-order numbers from a forward pass, and one more sort over the
union keys gives the slot order; a pre-order -> union index table decodes the sorted keys.
"""

from __future__ import annotations

import torch

from ddtree_compile.core.tree import PAD_TOKEN, TreeBatch, num_mask_words

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without triton: only the reference is available
    triton = None

MAX_SORT = 16384  # largest key vector a program sorts in registers (candidates W*K, union L*W)
_REGIONS = 10  # int32 scratch regions of L*W: parent, rank, chain, size, pre, offs, slot, table, ends, starts

if triton is not None:

    @triton.jit
    def _key(chain, score, idx):
        """== build._key: chain flag << 62 | ordered(score) << 20 | (2**20 - 1 - idx)."""
        bits = score.to(tl.int32, bitcast=True).to(tl.int64)
        ordered = tl.where(bits >= 0, bits + 2147483648, 2147483647 - (bits & 0x7FFFFFFF))
        return (chain.to(tl.int64) << 62) | (ordered << 20) | (1048575 - idx.to(tl.int64))

    @triton.jit
    def _tree_build_kernel(
        LQ, IDS, TOK, PAR, DEP, SCO, NN, BITS, SI, SF, SK,
        s_lr, s_ld, s_lk, s_ir, s_id, s_ik, s_tr, s_br, s_bi,
        W: tl.constexpr, K: tl.constexpr, L: tl.constexpr, NW: tl.constexpr, CHAIN: tl.constexpr,
        CP: tl.constexpr, WP: tl.constexpr, UP: tl.constexpr, RB: tl.constexpr, NWP: tl.constexpr,
        PAD: tl.constexpr,
    ):
        r = tl.program_id(0).to(tl.int64)
        LW: tl.constexpr = L * W
        si = SI + r * (10 * LW + L)  # _REGIONS int32 regions of LW, then the per-depth counts
        s_par, s_rank, s_chain, s_size = si, si + LW, si + 2 * LW, si + 3 * LW
        s_pre, s_offs, s_slot, s_tbl = si + 4 * LW, si + 5 * LW, si + 6 * LW, si + 7 * LW
        s_end, s_start, s_cnt = si + 8 * LW, si + 9 * LW, si + 10 * LW
        sf = SF + r * LW
        lq = LQ + r * s_lr
        ids = IDS + r * s_ir

        # ---- beams: depth d keeps the best W of the W*K extensions of depth d-1's beam.
        offs_c = tl.arange(0, CP)
        w_of = offs_c // K
        k_of = offs_c % K
        c_ok = offs_c < W * K
        n_prev = tl.full([], 1, tl.int32)  # depth 0: only the root
        for d in range(L):
            pv = c_ok & (w_of < n_prev)
            up = pv & (d > 0)  # at depth 0 the parent is the root: score 0, chain = CHAIN
            ps = tl.load(sf + (d - 1) * W + w_of, mask=up, other=0.0)
            pc = tl.load(s_chain + (d - 1) * W + w_of, mask=up, other=CHAIN)
            cs = ps + tl.load(lq + d * s_ld + k_of * s_lk, mask=c_ok, other=float("-inf"))
            cv = pv & (cs > float("-inf"))
            cc = (pc != 0) & (k_of == 0)
            key = tl.where(cv, _key(cc, cs, offs_c), -1)
            thr = tl.sum(tl.where(offs_c == W - 1, tl.sort(key, descending=True), 0), 0)
            sel = cv & (key >= thr)
            sel_i = sel.to(tl.int32)
            dst = d * W + tl.cumsum(sel_i, 0) - sel_i
            tl.store(sf + dst, cs, mask=sel)
            tl.store(s_par + dst, w_of, mask=sel)
            tl.store(s_rank + dst, k_of, mask=sel)
            tl.store(s_chain + dst, cc.to(tl.int32), mask=sel)
            n_prev = tl.sum(sel_i, 0)
            tl.store(s_cnt + d, n_prev)
            tl.debug_barrier()

        # ---- subtree sizes, deepest first. A parent's children are contiguous in the next beam,
        # so its child sum is (cumsum at its last child) - (exclusive cumsum at its first child).
        offs_w = tl.arange(0, WP)
        w_ok = offs_w < W
        child = tl.zeros([WP], tl.int32)
        for i in range(L):
            d = L - 1 - i
            valid = offs_w < tl.load(s_cnt + d)
            size = valid.to(tl.int32) + child
            tl.store(s_size + d * W + offs_w, size, mask=w_ok)
            tl.store(s_end + offs_w, 0, mask=w_ok)
            tl.store(s_start + offs_w, 0, mask=w_ok)
            tl.debug_barrier()
            q = tl.load(s_par + d * W + offs_w, mask=valid, other=-1)
            q_next = tl.load(s_par + d * W + offs_w + 1, mask=valid & (offs_w + 1 < W), other=-1)
            nxt_ok = offs_w + 1 < tl.load(s_cnt + d)
            q_next = tl.where(nxt_ok, q_next, -1)
            q_prev = tl.load(s_par + d * W + offs_w - 1, mask=valid & (offs_w > 0), other=-1)
            incl = tl.cumsum(size, 0)
            tl.store(s_end + q, incl, mask=valid & (q_next != q))
            tl.store(s_start + q, incl - size, mask=valid & (q_prev != q))
            tl.debug_barrier()
            child = tl.load(s_end + offs_w, mask=w_ok, other=0) - tl.load(s_start + offs_w, mask=w_ok, other=0)
            tl.debug_barrier()

        # ---- pre-order numbers (rank-tuple order) from the sizes; table pre-order -> union index.
        for d in range(L):
            valid = offs_w < tl.load(s_cnt + d)
            size = tl.load(s_size + d * W + offs_w, mask=w_ok, other=0)
            q = tl.load(s_par + d * W + offs_w, mask=valid, other=0)
            up = valid & (d > 0)
            pp = tl.load(s_pre + (d - 1) * W + q, mask=up, other=0)
            op = tl.load(s_offs + (d - 1) * W + q, mask=up, other=0)
            pre = tl.where(valid, pp + 1 + tl.cumsum(size, 0) - size - op, 0)
            kids = size - valid.to(tl.int32)
            tl.store(s_pre + d * W + offs_w, pre, mask=w_ok)
            tl.store(s_offs + d * W + offs_w, tl.cumsum(kids, 0) - kids, mask=w_ok)
            tl.store(s_tbl + pre - 1, d * W + offs_w, mask=valid)
            tl.store(s_slot + d * W + offs_w, -1, mask=w_ok)  # like the reference's slot_of: unpicked -> -1
            tl.debug_barrier()

        # ---- the best W of the union by (chain, score, pre-order): slots 1..W in key order.
        offs_u = tl.arange(0, UP)
        u_ok = offs_u < LW
        vu = u_ok & (offs_u % W < tl.load(s_cnt + offs_u // W, mask=u_ok, other=0))
        su = tl.load(sf + offs_u, mask=vu, other=0.0)
        cu = tl.load(s_chain + offs_u, mask=vu, other=0)
        pu = tl.load(s_pre + offs_u, mask=vu, other=0)
        tl.store(SK + r * UP + offs_u, tl.sort(tl.where(vu, _key(cu != 0, su, pu), -1), descending=True))
        tl.debug_barrier()
        kj = tl.load(SK + r * UP + offs_w, mask=w_ok, other=-1)
        live = w_ok & (kj >= 0)
        u = tl.load(s_tbl + (1048575 - (kj & 1048575)) - 1, mask=live, other=0)
        tl.store(s_slot + u, offs_w + 1, mask=live)
        dj = u // W
        score = tl.load(sf + u, mask=live, other=0.0)
        rank = tl.load(s_rank + u, mask=live, other=0)
        q = tl.load(s_par + u, mask=live, other=0)
        tok = tl.load(ids + dj * s_id + rank * s_ik, mask=live, other=PAD)
        tl.debug_barrier()
        pslot = tl.load(s_slot + (dj - 1) * W + q, mask=live & (dj > 0), other=0)
        n_nodes = tl.sum(live.to(tl.int64), 0)
        row = r * s_tr + 1 + offs_w
        tl.store(TOK + row, tl.where(live, tok.to(tl.int64), PAD), mask=w_ok)
        tl.store(PAR + row, tl.where(live, pslot.to(tl.int64), -1), mask=w_ok)
        tl.store(DEP + row, tl.where(live, dj.to(tl.int64) + 1, 0), mask=w_ok)
        tl.store(SCO + row, tl.where(live, score, float("-inf")), mask=w_ok)
        tl.store(TOK + r * s_tr, PAD)
        tl.store(PAR + r * s_tr, -1)
        tl.store(DEP + r * s_tr, 0)
        tl.store(SCO + r * s_tr, 0.0)
        tl.store(NN + r, n_nodes)
        tl.debug_barrier()

        # ---- packed ancestor bits: walk each live slot up its parent chain (depth <= L).
        offs_b = tl.arange(0, NWP)
        for rb in range(0, W + 1, RB):
            offs_n = rb + tl.arange(0, RB)
            n_ok = offs_n < W + 1
            # Live rows, as ancestor_closure defines them: the root and every slot with a parent.
            own_par = tl.load(PAR + r * s_tr + offs_n, mask=n_ok, other=-1)
            cur = tl.where(n_ok & ((offs_n == 0) | (own_par >= 0)), offs_n, -1).to(tl.int64)
            bits = tl.zeros([RB, NWP], tl.int32)
            for _ in range(L + 1):
                ok = cur >= 0
                cc = tl.where(ok, cur, 0)
                bit = tl.full([RB], 1, tl.int32) << (cc % 32).to(tl.int32)
                hit = ok[:, None] & (offs_b[None, :] == (cc // 32).to(tl.int32)[:, None])
                bits = bits | tl.where(hit, bit[:, None], 0)
                cur = tl.where(ok, tl.load(PAR + r * s_tr + cc, mask=ok, other=-1), -1)
            tl.store(BITS + r * s_br + offs_n[:, None] * s_bi + offs_b[None, :], bits,
                     mask=n_ok[:, None] & (offs_b < NW)[None, :])


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _sizes(budget: int, k: int, depth: int) -> tuple[int, int]:
    return _next_pow2(budget * k), _next_pow2(depth * budget)


def supports(budget: int, k: int, depth: int) -> bool:
    """Whether the kernel handles this (B, K, L) (the dispatch falls back to torch otherwise)."""
    cp, up = _sizes(budget, k, depth)
    return triton is not None and max(cp, up) <= MAX_SORT


_SCRATCH: dict = {}


def _scratch(device, R: int, budget: int, depth: int, up: int):
    """Per-request scratch (int32 regions, fp32 beam scores, int64 sorted union keys), cached per shape."""
    key = (str(device), R, budget, depth, up)
    ws = _SCRATCH.get(key)
    if ws is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"tree_build: no scratch for {key} during CUDA-graph capture; run once eagerly first")
        lw = depth * budget
        ws = (torch.empty(R, _REGIONS * lw + depth, dtype=torch.int32, device=device),
              torch.empty(R, lw, dtype=torch.float32, device=device),
              torch.empty(R, up, dtype=torch.int64, device=device))
        _SCRATCH[key] = ws
    return ws


def build_tree_triton(log_probs: torch.Tensor, token_ids: torch.Tensor, budget: int, chain_seed: bool,
                      num_warps: int | None = None, out: TreeBatch | None = None) -> TreeBatch:
    """`build._build` on the device: log_probs fp32 [R, L, K] (ranks sorted), token_ids int32/int64 [R, L, K].

    Any strides. `out`: a TreeBatch of this shape to write into (every element is written).
    CPU tensors need TRITON_INTERPRET=1 set before triton is imported.
    """
    if triton is None:
        raise RuntimeError("tree_build: triton is not installed")
    for name, t in (("log_probs", log_probs), ("token_ids", token_ids)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3 or min(t.shape) == 0:
            raise ValueError(f"tree_build: `{name}` must be a tensor [R, L, K] with R, L, K >= 1")
    if token_ids.shape != log_probs.shape or token_ids.device != log_probs.device:
        raise ValueError(f"tree_build: `token_ids` must match `log_probs` in shape and device, got "
                         f"{tuple(token_ids.shape)} vs {tuple(log_probs.shape)}")
    if log_probs.dtype != torch.float32 or token_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"tree_build: `log_probs` must be float32 and `token_ids` int32/int64, got "
                         f"{log_probs.dtype}, {token_ids.dtype}")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"tree_build: `budget` must be an int >= 1, got {budget!r}")
    if not isinstance(chain_seed, bool):
        raise ValueError(f"tree_build: `chain_seed` must be True or False, got {chain_seed!r}")
    R, L, K = log_probs.shape
    if not supports(budget, K, L):
        raise ValueError(f"tree_build: budget*K = {budget * K} and L*budget = {L * budget} must both be "
                         f"<= {MAX_SORT} after rounding up to a power of two; use the torch build")
    if log_probs.device.type == "cpu" and not triton.knobs.runtime.interpret:
        raise RuntimeError("tree_build: CPU tensors need TRITON_INTERPRET=1 set before triton is imported")
    dev, N, NW = log_probs.device, budget + 1, num_mask_words(budget + 1)
    cp, up = _sizes(budget, K, L)
    si, sf, sk = _scratch(dev, R, budget, L, up)
    if out is None:
        i64 = dict(dtype=torch.int64, device=dev)
        out = TreeBatch(torch.empty(R, N, **i64), torch.empty(R, N, **i64), torch.empty(R, N, **i64),
                        torch.empty(R, N, dtype=torch.float32, device=dev), torch.empty(R, **i64),
                        torch.empty(R, N, NW, dtype=torch.int32, device=dev), max_depth=L)
    _check_out(out, R, N, NW, dev)
    out.max_depth = L
    tokens, parents, depths, scores, num_nodes, bits = (
        out.tokens, out.parents, out.depths, out.scores, out.num_nodes, out.ancestor_bits)
    nwp = _next_pow2(NW)
    rb = min(_next_pow2(N), max(16, 4096 // nwp))
    # H100 sweep (round_h100.json, R=64): more warps shorten the sorts except for tiny ones; at 1024
    # keys (B=64) 16 warps are ~5% faster than the 8 used for the committed numbers.
    warps = num_warps or (4 if max(cp, up) < 512 else 8 if max(cp, up) < 2048 else 16)
    _tree_build_kernel[(R,)](
        log_probs, token_ids, tokens, parents, depths, scores, num_nodes, bits, si, sf, sk,
        *log_probs.stride(), *token_ids.stride(), tokens.stride(0), bits.stride(0), bits.stride(1),
        W=budget, K=K, L=L, NW=NW, CHAIN=chain_seed, CP=cp, WP=_next_pow2(budget), UP=up, RB=rb, NWP=nwp,
        PAD=PAD_TOKEN, num_warps=warps,
    )
    return out


def _check_out(out: TreeBatch, R: int, N: int, NW: int, dev) -> None:
    want = {"tokens": ((R, N), torch.int64), "parents": ((R, N), torch.int64), "depths": ((R, N), torch.int64),
            "scores": ((R, N), torch.float32), "num_nodes": ((R,), torch.int64),
            "ancestor_bits": ((R, N, NW), torch.int32)}
    for name, (shape, dtype) in want.items():
        t = getattr(out, name)
        if tuple(t.shape) != shape or t.dtype != dtype or t.device != dev or not t.is_contiguous():
            raise ValueError(f"tree_build: `out.{name}` must be a contiguous {dtype} tensor {shape} on {dev}, "
                             f"got {t.dtype} {tuple(t.shape)} on {t.device}")
