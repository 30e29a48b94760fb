"""Tree attention over vLLM's paged KV cache: the Triton kernels behind `ddtree::tree_attention` (ops.py).

    torch.ops.ddtree.tree_attention(
        query,          # [R*N, Hq, D] bf16/fp16 (fp32 on the CPU reference); N = B+1 slots per request
        key_cache,      # [num_blocks, block_size, Hkv, D] logical view, any strides
        value_cache,    # same shape/dtype as key_cache, any strides
        block_table,    # [R, max_blocks] int32
        context_lens,   # [R] int32/int64: committed tokens before the verify block
        ancestor_bits,  # [R, N, ceil(N/32)] int32 (ddtree_compile.core.tree layout)
        depths,         # [R, N] int32/int64: tree depth of each slot (0 for root and padding)
        out,            # [R*N, Hq, D], written in place (mutated; the op returns nothing)
        softmax_scale: float, sliding_window: int (<= 0: none), logits_soft_cap: float (<= 0: none),
        q_scale=None, k_scale=None, v_scale=None,  # float32 [1] or [Hkv]: an FP8 query / FP8 KV cache
    ) -> None
    torch.ops.ddtree.tree_attention_scratch(..., logits_soft_cap, scratch, q_scale, k_scale, v_scale)
        # the same, with the split-KV partials in `scratch` (1-D fp32, >= bucket_scratch_elems(...); mutated)

Semantics and the plain torch reference (the op's CPU kernel): tree_attention_ref.py. The verify
tokens' K/V must already sit in the cache at positions context_len + j. The op's CUDA kernel is
`launch_tree_attention` below (no host sync, no allocation when given its scratch; shapes fixed per
(R, N) bucket).

Kernel layout. Program (m-block, kv head x split, request). The N*G query rows that share a KV head
(N tree slots x G query heads of the GQA group) are packed into one tile, so one pass over the
request's context K/V serves them all through tl.dot. The keys (the context, then the N tree keys) are
cut into `num_splits` chunks (a fixed number per bucket, chunk size derived on the device from
context_len, never under `min_chunk` keys, so short contexts use fewer splits); the split that owns the
last chunk walks the tree keys with the packed ancestor bits, and since the tree keys count toward its
chunk it gets correspondingly less context. Splits write (out, log-sum-exp) partials that a combine
kernel merges, all splits of a (token, head) at once; with one split the kernel writes `out` directly.
No dense mask is ever built. FP8 (an FP8 KV cache, and the query vLLM quantizes for it): tiles are
loaded as FP8 and cast to the output's dtype (exact: every e4m3/e5m2 value is a bf16/fp16 value) for the
same tl.dot; q_scale * k_scale folds into the score scale and v_scale into the output, since attention
is linear in V, so the inner loop does no extra multiply. With PAGE_GROUP > 0 the block ids of a group
of pages are loaded once into registers (tl.gather per tile), so the K/V addresses inside the pipelined
loop depend on no load of that loop and Triton prefetches K/V tiles ahead of the math.

Host side. Everything that depends only on shapes, strides, dtypes and the scalar arguments (the
argument checks, tiles and split count (tuning.plan_tree_attention), grids) is computed once per bucket
and cached (`_PLANS`: launch parameters only, no tensor); after the first launch of a bucket its kernels
are launched straight through Triton's compiled launcher (launch.py), skipping Triton's per-call
argument binding, specialization and cache lookup, so an eager call costs a key lookup, two views of
its scratch and two launches.

Scratch. The split-KV partials (out fp32 [S, T, Hq, D], lse fp32 [S, T, Hq]) are views at fixed
offsets of the caller's `scratch` (1-D fp32): the partials of a bucket sit at the same addresses at
every call, so a captured CUDA graph replays over them. The template keeps no memory of its own: a
caller that runs many buckets (an engine: integration/round/workspace.py) sizes one scratch for all of
them with `bucket_scratch_elems` and owns it. A call without one allocates its partials for that call
(inside a CUDA-graph capture that memory comes from the graph's pool, and the graph keeps it: fine for
one graph, a cost per graph for an engine's buckets, which is why an engine passes its own).
"""

from __future__ import annotations

import torch

from ddtree_compile.templates import tuning
from ddtree_compile.templates.launch import Launch
from ddtree_compile.templates.tree_attention_ref import check_scratch, check_tree_attention_args

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without triton: only the reference is available
    triton = None

LOG2E = 1.4426950408889634

if triton is not None:

    @triton.jit
    def _attend_tile(q, K, V, k_row, v_row, offs_d, n_ok, vis, m_i, l_i, acc, qk_scale, cap_log2, s_kd, s_vd,
                     HAS_CAP: tl.constexpr, DOT_F32: tl.constexpr):
        """One online-softmax step over a tile of keys gathered from the paged cache (rows k_row/v_row)."""
        k = tl.load(K + k_row[None, :] + offs_d[:, None] * s_kd, mask=n_ok[None, :], other=0.0).to(q.dtype)
        if DOT_F32:  # interpreter only: its bf16 dot multiplies raw bits (triton 3.9)
            s = tl.dot(q.to(tl.float32), k.to(tl.float32))
        else:
            s = tl.dot(q, k)
        if HAS_CAP:  # cap * tanh(s * scale / cap), tanh(x) = 1 - 2 / (exp(2x) + 1)
            s = cap_log2 * (1.0 - 2.0 / (tl.exp(2.0 * qk_scale * s) + 1.0))
        else:
            s = s * qk_scale
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + v_row[:, None] + offs_d[None, :] * s_vd, mask=n_ok[:, None], other=0.0).to(q.dtype)
        if DOT_F32:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32))
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        return m_new, l_i, acc

    # Runtime ints that vary per bucket or per layer are not specialized, so buckets share compiles.
    @triton.jit(do_not_specialize=["window", "n_slots", "num_splits", "min_chunk"])
    def _tree_attn_fwd_kernel(
        Q, K, V, BT, CTX, BITS, DEPTH, OUT, PO, PL, QS, KS, VS,
        qk_scale, cap_log2, window, n_slots, page_size, num_splits, min_chunk, s_qs, s_ks, s_vs,
        s_qt, s_qh, s_qd,
        s_kb, s_kt, s_kh, s_kd,
        s_vb, s_vt, s_vh, s_vd,
        s_btr, s_btc, s_br, s_bi, s_bw, s_dr, s_dj,
        s_ot, s_oh, s_od,
        s_ps, s_pt, s_ph, s_ls, s_lt,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        HAS_WINDOW: tl.constexpr, HAS_CAP: tl.constexpr, DIRECT_OUT: tl.constexpr, DOT_F32: tl.constexpr,
        PAGE_GROUP: tl.constexpr, Q_FP8: tl.constexpr, KV_FP8: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        h = tl.program_id(1) // num_splits
        split = tl.program_id(1) % num_splits
        r = tl.program_id(2)

        # Packed rows: row m = slot i * GROUP + head g of the KV head's group.
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = offs_m < n_slots * GROUP
        qi = tl.where(row_ok, offs_m // GROUP, 0)
        qh = h * GROUP + offs_m % GROUP
        tok = (r * n_slots + qi).to(tl.int64)
        offs_d = tl.arange(0, HEAD_DIM)
        q = tl.load(Q + tok[:, None] * s_qt + qh[:, None] * s_qh + offs_d[None, :] * s_qd,
                    mask=row_ok[:, None], other=0.0).to(OUT.dtype.element_ty)  # FP8 -> the compute dtype
        v_scale = 1.0
        if Q_FP8:
            qk_scale = qk_scale * tl.load(QS + h * s_qs)
        if KV_FP8:
            qk_scale = qk_scale * tl.load(KS + h * s_ks)
            v_scale = tl.load(VS + h * s_vs)

        ctx = tl.load(CTX + r).to(tl.int32)
        depth_q = tl.load(DEPTH + r * s_dr + qi * s_dj, mask=row_ok, other=0).to(tl.int32)
        own = tl.load(BITS + r * s_br + qi * s_bi + (qi // 32) * s_bw, mask=row_ok, other=0)
        live = row_ok & (((own >> (qi % 32)) & 1) != 0)  # padding rows see nothing
        qpos = ctx + depth_q

        # This split's keys: chunks of `chunk` keys over [lo0, ctx) followed by the N tree keys. The tree
        # goes whole to the split owning the last chunk, whose context share shrinks by the tree's size.
        lo0 = 0
        if HAS_WINDOW:
            lo0 = tl.maximum(ctx - window + 1, 0)
        total = ctx - lo0 + n_slots
        chunk = tl.cdiv(tl.cdiv(total, num_splits), BLOCK_N) * BLOCK_N
        chunk = tl.maximum(chunk, min_chunk)
        n_eff = tl.cdiv(total, chunk)  # >= 1: n_slots >= 1
        lo = tl.minimum(lo0 + split * chunk, ctx)
        hi = tl.minimum(lo + chunk, ctx)
        tree_end = tl.where(split == n_eff - 1, ctx + n_slots, ctx)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        bt_row = BT + r * s_btr
        if PAGE_GROUP == 0:
            for start in range(lo, hi, BLOCK_N):  # context: every row sees every key (window aside)
                offs_n = start + tl.arange(0, BLOCK_N)
                n_ok = offs_n < hi
                blk = tl.load(bt_row + (offs_n // page_size) * s_btc, mask=n_ok, other=0).to(tl.int64)
                slot = offs_n % page_size
                vis = live[:, None] & n_ok[None, :]
                if HAS_WINDOW:
                    vis = vis & ((qpos[:, None] - offs_n[None, :]) < window)
                m_i, l_i, acc = _attend_tile(q, K, V, blk * s_kb + slot * s_kt + h * s_kh,
                                             blk * s_vb + slot * s_vt + h * s_vh, offs_d, n_ok, vis, m_i, l_i,
                                             acc, qk_scale, cap_log2, s_kd, s_vd, HAS_CAP, DOT_F32)
        else:
            # Block ids for PAGE_GROUP pages are loaded once per group into registers, so the K/V
            # addresses of the pipelined inner loop depend on no load of that loop: the software
            # pipeline can then prefetch K/V tiles ahead instead of waiting on the block table.
            group = ((PAGE_GROUP - 1) * page_size) // BLOCK_N * BLOCK_N
            for g0 in tl.range(lo, hi, group, num_stages=1):
                first = g0 // page_size
                pidx = first + tl.arange(0, PAGE_GROUP)
                bt_vec = tl.load(bt_row + pidx * s_btc, mask=pidx * page_size < hi, other=0)
                g1 = tl.minimum(g0 + group, hi)
                for start in range(g0, g1, BLOCK_N):
                    offs_n = start + tl.arange(0, BLOCK_N)
                    n_ok = offs_n < g1
                    blk = tl.gather(bt_vec, tl.where(n_ok, offs_n // page_size - first, 0), 0).to(tl.int64)
                    slot = offs_n % page_size
                    vis = live[:, None] & n_ok[None, :]
                    if HAS_WINDOW:
                        vis = vis & ((qpos[:, None] - offs_n[None, :]) < window)
                    m_i, l_i, acc = _attend_tile(q, K, V, blk * s_kb + slot * s_kt + h * s_kh,
                                                 blk * s_vb + slot * s_vt + h * s_vh, offs_d, n_ok, vis, m_i,
                                                 l_i, acc, qk_scale, cap_log2, s_kd, s_vd, HAS_CAP, DOT_F32)
        for start in tl.range(ctx, tree_end, BLOCK_N, num_stages=1):  # tree slots: ancestor bits
            offs_n = start + tl.arange(0, BLOCK_N)
            j = offs_n - ctx
            n_ok = j < n_slots
            jc = tl.where(n_ok, j, 0)
            blk = tl.load(bt_row + (offs_n // page_size) * s_btc, mask=n_ok, other=0).to(tl.int64)
            slot = offs_n % page_size
            word = tl.load(BITS + r * s_br + qi[:, None] * s_bi + (jc // 32)[None, :] * s_bw,
                           mask=live[:, None] & n_ok[None, :], other=0)
            vis = (((word >> (jc % 32)[None, :]) & 1) != 0) & live[:, None] & n_ok[None, :]
            if HAS_WINDOW:
                dk = tl.load(DEPTH + r * s_dr + jc * s_dj, mask=n_ok, other=0).to(tl.int32)
                vis = vis & ((depth_q[:, None] - dk[None, :]) < window)
            m_i, l_i, acc = _attend_tile(q, K, V, blk * s_kb + slot * s_kt + h * s_kh,
                                         blk * s_vb + slot * s_vt + h * s_vh, offs_d, n_ok, vis, m_i, l_i, acc,
                                         qk_scale, cap_log2, s_kd, s_vd, HAS_CAP, DOT_F32)

        o = acc * (v_scale / tl.where(l_i > 0, l_i, 1.0))[:, None]
        if DIRECT_OUT:
            tl.store(OUT + tok[:, None] * s_ot + qh[:, None] * s_oh + offs_d[None, :] * s_od,
                     o.to(OUT.dtype.element_ty), mask=row_ok[:, None])
        else:
            lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
            tl.store(PL + split * s_ls + tok * s_lt + qh, lse, mask=row_ok)
            tl.store(PO + split.to(tl.int64) * s_ps + tok[:, None] * s_pt + qh[:, None] * s_ph + offs_d[None, :], o,
                     mask=(row_ok & ((offs_m * 0 + split) < n_eff))[:, None])

    @triton.jit
    def _tree_attn_combine_kernel(
        PO, PL, OUT, num_splits, n_heads,
        s_ps, s_pt, s_ph, s_ls, s_lt, s_ot, s_oh, s_od,
        HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, SPLITS: tl.constexpr,
    ):
        """Merge the split partials of one token and BLOCK_H heads. All SPLITS (a power of two >=
        num_splits) partials are loaded at once, so the merge costs one round of loads, not one per split."""
        t = tl.program_id(0).to(tl.int64)
        offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        offs_s = tl.arange(0, SPLITS).to(tl.int64)
        offs_d = tl.arange(0, HEAD_DIM)
        h_ok = offs_h < n_heads
        lse = tl.load(PL + offs_s[:, None] * s_ls + t * s_lt + offs_h[None, :],
                      mask=(offs_s < num_splits)[:, None] & h_ok[None, :], other=float("-inf"))
        has = lse > float("-inf")  # empty splits / padding rows wrote -inf and no partial
        m = tl.max(lse, 0)
        m_use = tl.where(m == float("-inf"), 0.0, m)
        w = tl.exp2(lse - m_use[None, :])  # [SPLITS, BLOCK_H]; 0 where empty
        den = tl.sum(w, 0)
        o = tl.load(PO + offs_s[:, None, None] * s_ps + t * s_pt + offs_h[None, :, None] * s_ph
                    + offs_d[None, None, :], mask=has[:, :, None], other=0.0)
        acc = tl.sum(w[:, :, None] * o, 0)
        o = acc / tl.where(den > 0, den, 1.0)[:, None]
        tl.store(OUT + t * s_ot + offs_h[:, None] * s_oh + offs_d[None, :] * s_od,
                 o.to(OUT.dtype.element_ty), mask=h_ok[:, None])


_ALIGN = 32  # fp32 elements: the lse partials start 128 bytes into a line (Triton assumes 16)


def _partial_sizes(splits: int, num_tokens: int, num_heads: int, head_dim: int) -> tuple[int, int]:
    """(offset of the lse partials, total fp32 elements) of one bucket's scratch; (0, 0) with one split."""
    if splits == 1:
        return 0, 0
    n_out = -(-splits * num_tokens * num_heads * head_dim // _ALIGN) * _ALIGN
    return n_out, n_out + splits * num_tokens * num_heads


def uses_scratch(device) -> bool:
    """Whether `ddtree::tree_attention` on `device` runs this kernel (and so reads a scratch): CUDA."""
    return torch.device(device).type == "cuda"


def bucket_scratch_elems(device, num_requests: int, n_slots: int, num_heads: int, num_kv_heads: int,
                         head_dim: int) -> int:
    """fp32 elements of scratch the bucket of `num_requests` trees of `n_slots` slots needs on `device`
    (0: one split, `out` written directly). Planned with no bound on the keys a request holds: a
    bound only ever lowers the split count (tests/test_tree_attention.py checks a grid of shapes), so
    this covers every block table."""
    splits = tuning.plan_bucket(torch.device(device), num_requests, n_slots, num_heads, num_kv_heads, head_dim)[3]
    return _partial_sizes(splits, num_requests * n_slots, num_heads, head_dim)[1]


class _Plan:
    __slots__ = ("splits", "block_m", "m_blocks", "tiles", "main", "combine", "tail", "ctail", "partials")


_PLANS: dict = {}


def _plan_key(tensors, softmax_scale, sliding_window, logits_soft_cap, tiles, splits, scales):
    # Everything Triton specializes on is in the key: the plan's Launch objects rely on that.
    key = [softmax_scale, sliding_window, logits_soft_cap, tiles, splits]
    for t in tensors + scales:
        key += (None,) if t is None else (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0)
    return tuple(key)


def _make_plan(query, key_cache, value_cache, block_table, context_lens, ancestor_bits, depths, out,
               softmax_scale, sliding_window, logits_soft_cap, tiles, splits, q_scale, k_scale, v_scale) -> _Plan:
    R, N, Hq, Hkv, D = check_tree_attention_args(
        query, key_cache, value_cache, block_table, context_lens, ancestor_bits, depths, out,
        softmax_scale, sliding_window, logits_soft_cap, q_scale, k_scale, v_scale)
    if out.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"tree_attention: `out` (and a non-FP8 `query`) dtype must be bfloat16 or float16 for "
                         f"the Triton kernel, got {out.dtype}")
    interpret = bool(triton.knobs.runtime.interpret)
    if query.device.type == "cpu" and not interpret:
        raise RuntimeError("tree_attention: CPU tensors need TRITON_INTERPRET=1 set before triton is imported")
    G = Hq // Hkv
    p = _Plan()
    p.tiles, p.block_m, p.m_blocks, p.splits = tuning.plan_tree_attention(query, key_cache, ancestor_bits,
                                                                          block_table, tiles, splits)
    tiles = p.tiles
    min_chunk = max(tiles.block_n, tiles.min_chunk // tiles.block_n * tiles.block_n)
    has_cap = logits_soft_cap > 0
    qk_scale = softmax_scale / logits_soft_cap if has_cap else softmax_scale * LOG2E
    cap_log2 = logits_soft_cap * LOG2E if has_cap else 0.0
    direct = p.splits == 1
    p.partials = (p.splits, R * N, Hq, D) + _partial_sizes(p.splits, R * N, Hq, D)
    # the strides of the contiguous partials [S, T, Hq, D] and [S, T, Hq] (`_partials`)
    ps = (0, 0, 0, 0, 0) if direct else (R * N * Hq * D, Hq * D, D, R * N * Hq, Hq)
    kc, vc = key_cache, value_cache
    page_size = kc.shape[1]
    # grouped block-id loads need a group of pages to span at least one key tile
    page_group = tiles.page_group if (tiles.page_group - 1) * page_size >= tiles.block_n else 0
    device = query.device.index if query.device.type == "cuda" else None
    meta = dict(GROUP=G, HEAD_DIM=D, BLOCK_M=p.block_m, BLOCK_N=tiles.block_n,
                HAS_WINDOW=sliding_window > 0, HAS_CAP=has_cap, DIRECT_OUT=direct,
                DOT_F32=query.device.type == "cpu" and out.dtype == torch.bfloat16,
                PAGE_GROUP=page_group, Q_FP8=q_scale is not None, KV_FP8=k_scale is not None,
                num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    scale_strides = tuple(0 if t is None or t.numel() == 1 else t.stride(0) for t in (q_scale, k_scale, v_scale))
    p.tail = (qk_scale, cap_log2, int(sliding_window), N, page_size, p.splits, min_chunk, *scale_strides,
              *query.stride(), *kc.stride(), *vc.stride(), *block_table.stride(), *ancestor_bits.stride(),
              *depths.stride(), *out.stride(), *ps)
    p.main = Launch(_tree_attn_fwd_kernel, (p.m_blocks, Hkv * p.splits, R), meta, 13 + len(p.tail), device)
    p.combine = None
    if not direct:
        sp2 = tuning.next_pow2(p.splits)
        block_h = max(1, min(tuning.next_pow2(Hq), _COMBINE_ELEMS // (sp2 * D)))
        p.ctail = (p.splits, Hq, *ps, *out.stride())
        p.combine = Launch(_tree_attn_combine_kernel, (R * N, -(-Hq // block_h), 1),
                           dict(HEAD_DIM=D, BLOCK_H=block_h, SPLITS=sp2, num_warps=4), 3 + len(p.ctail), device)
    return p


_COMBINE_ELEMS = 8192  # fp32 partial elements a combine program loads at once (4 warps: 64 per thread)


def _partials(p: _Plan, scratch, device):
    """The bucket's split-KV partials (out [S, T, Hq, D], lse [S, T, Hq]): views at fixed offsets of
    `scratch`, or of a buffer allocated for this call when there is none (module docstring)."""
    S, T, Hq, D, off, need = p.partials
    if scratch is None:
        scratch = torch.empty(need, dtype=torch.float32, device=device)
    else:
        check_scratch(scratch, device, need)
    return scratch[: S * T * Hq * D].view(S, T, Hq, D), scratch[off: off + S * T * Hq].view(S, T, Hq)


def launch_tree_attention(
    query, key_cache, value_cache, block_table, context_lens, ancestor_bits, depths, out,
    softmax_scale: float, sliding_window: int = 0, logits_soft_cap: float = 0.0, scratch=None,
    tiles: tuning.AttnTiles | None = None, splits: int | None = None, q_scale=None, k_scale=None, v_scale=None,
) -> None:
    """Run the Triton kernel (CUDA, or CPU tensors under TRITON_INTERPRET=1). Writes `out`, and the
    split-KV partials into `scratch` (module docstring).

    The per-bucket plan (checks, tiles, splits, grids) is cached under a key of every tensor's shape,
    strides, dtype, device and pointer alignment plus the scalar arguments, so a call whose key was
    seen before does no checking or planning (those depend on nothing else)."""
    if triton is None:
        raise RuntimeError("tree_attention: triton is not installed")
    tensors = (query, key_cache, value_cache, block_table, context_lens, ancestor_bits, depths, out)
    scales = (q_scale, k_scale, v_scale)
    try:
        key = _plan_key(tensors, softmax_scale, sliding_window, logits_soft_cap, tiles, splits, scales)
        p = _PLANS.get(key)
    except (AttributeError, TypeError):  # not tensors / unhashable scalars: let the checks name the field
        key, p = None, None
    if p is None:
        p = _make_plan(*tensors, softmax_scale, sliding_window, logits_soft_cap, tiles, splits, *scales)
        if key is not None:
            _PLANS[key] = p
    scale_ptrs = tuple(out if t is None else t for t in scales)  # absent: any pointer, never read
    if p.combine is None:
        p.main(*tensors, out, out, *scale_ptrs, *p.tail)
        return
    po, pl = _partials(p, scratch, query.device)
    p.main(*tensors, po, pl, *scale_ptrs, *p.tail)
    p.combine(po, pl, out, *p.ctail)
