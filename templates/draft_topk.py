"""Draft top-k over the vocabulary: the Triton kernel for CUDA (and the interpreter).

Per row (request, depth) of drafter logits [R, L, V]: x = fp32(logits) * (1 / temperature), the top-K
(x, id) ordered by (value desc, id asc), and lse = log-sum-exp(x); log-probs = top - lse. The torch
reference is `ddtree_compile.core.build.draft_topk` (core/build.py calls this kernel instead on CUDA); both
rank by the same packed int64 key, so token ids agree exactly, ties included. lse uses the GPU's
exp2/log and a split-dependent summation order, so log-probs agree to ~1e-6, not bit for bit.

Kernel layout. Each row's vocabulary is cut into `splits` chunks, one program per (row, chunk). A
program streams its chunk in tiles of BLOCK (prefetching PIPE tiles ahead) with an online max /
sum-exp and a running top-K set of packed keys (order-preserving int32 of the value above V-1-id:
unique, so "largest key" is the tie rule). A tile builds keys and enters the insertion loop only
when its max value beats the set's smallest, so past the first tiles most tiles cost just the two
reductions. With one chunk per row the program writes the output itself; otherwise a merge kernel
per row sorts the chunks' lists and combines the (max, sum) partials.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ddtree_compile.templates import tuning

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without triton: only the reference is available
    triton = None

MAX_K = 32  # keys per row the kernel keeps in registers (K <= 32 covers top_k in practice)

if triton is not None:
    LOG2E = tl.constexpr(1.4426950408889634)
    _I64_MIN = tl.constexpr(-(2**63))
    _I64_MAX = tl.constexpr(2**63 - 1)

    @triton.jit
    def _pack_key(x, idx, V):
        """(value desc, id asc) order as one unique int64; -0.0 ties with +0.0."""
        b = x.to(tl.int32, bitcast=True)
        b = tl.where(x == 0.0, 0, b)
        o = tl.where(b >= 0, b, b ^ 0x7FFFFFFF)
        return (o.to(tl.int64) << 32) | (V - 1 - idx).to(tl.int64)

    @triton.jit
    def _key_value(key):
        o = (key >> 32).to(tl.int32)
        b = tl.where(o >= 0, o, o ^ 0x7FFFFFFF)
        return b.to(tl.float32, bitcast=True)

    @triton.jit
    def _write_row(LQ, IDS, row, n_l, s_or, s_ol, keys, offs, lse, V, K: tl.constexpr):
        """Store the first K of descending `keys` as (value - lse, id)."""
        r = row // n_l
        l = row % n_l
        dst = r.to(tl.int64) * s_or + l.to(tl.int64) * s_ol + offs
        ok = offs < K
        tl.store(LQ + dst, _key_value(keys) - lse, mask=ok)
        tl.store(IDS + dst, (V - 1) - (keys & 0xFFFFFFFF), mask=ok)

    @triton.jit
    def _load_tile(base, idx, hi, s_xv):
        return tl.load(base + idx.to(tl.int64) * s_xv, mask=idx < hi, other=float("-inf"),
                       eviction_policy="evict_first")

    @triton.jit
    def _topk_partial_kernel(
        X, LQ, IDS, PK, PM, PS, inv_t, V, n_l, chunk, splits,
        s_xr, s_xl, s_xv, s_or, s_ol,
        K: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr, DIRECT: tl.constexpr, PIPE: tl.constexpr,
    ):
        row = tl.program_id(0)
        sp = tl.program_id(1)
        base = X + (row // n_l).to(tl.int64) * s_xr + (row % n_l).to(tl.int64) * s_xl
        offs = tl.arange(0, BLOCK)
        offs_k = tl.arange(0, KP)
        # Slots >= K hold +max so they are never the set's minimum (never replaced).
        best = tl.where(offs_k < K, tl.full([KP], _I64_MIN, tl.int64), tl.full([KP], _I64_MAX, tl.int64))
        thr = tl.min(best, 0)
        m = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), 0)
        s = tl.sum(tl.zeros([BLOCK], tl.float32), 0)
        lo = sp * chunk
        hi = tl.minimum(lo + chunk, V)
        # Register prefetch PIPE tiles ahead, so a tile's loads overlap the previous tiles' math
        # (H100, R=64: 0.25 -> 0.19 ms, round_h100.json; the loop is latency-, not bandwidth-bound).
        if PIPE >= 1:
            xa = _load_tile(base, lo + offs, hi, s_xv)
        if PIPE >= 2:
            xb = _load_tile(base, lo + BLOCK + offs, hi, s_xv)
        for start in range(lo, hi, BLOCK):
            idx = start + offs
            ok = idx < hi
            if PIPE == 0:
                raw = _load_tile(base, idx, hi, s_xv)
            elif PIPE == 1:
                raw = xa
                xa = _load_tile(base, idx + BLOCK, hi, s_xv)
            else:
                raw = xa
                xa = xb
                xb = _load_tile(base, idx + 2 * BLOCK, hi, s_xv)
            x = raw.to(tl.float32) * inv_t
            t_max = tl.max(x, 0)
            m_new = tl.maximum(m, t_max)  # online log-sum-exp
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            s = s * tl.exp2((m - m_use) * LOG2E) + tl.sum(tl.exp2((x - m_use) * LOG2E), 0)
            m = m_new
            # Ids ascend through the chunk, so a value equal to the set's smallest never beats it:
            # only a tile whose max is strictly larger (or a set not yet full) needs keys.
            if (thr == _I64_MIN) | (t_max > _key_value(thr)):
                key = tl.where(ok, _pack_key(x, idx, V), _I64_MIN)
                kmax = tl.max(key, 0)
                while kmax > thr:  # insert the tile's keys that beat the set's minimum, largest first
                    slot = tl.argmin(best, 0)
                    best = tl.where(offs_k == slot, kmax, best)
                    thr = tl.min(best, 0)
                    key = tl.where(key == kmax, _I64_MIN, key)
                    kmax = tl.max(key, 0)
        best = tl.sort(tl.where(offs_k < K, best, _I64_MIN), descending=True)
        if DIRECT:
            m_use = tl.where(m == float("-inf"), 0.0, m)
            lse = tl.where(s > 0, m_use + tl.log(s), float("-inf"))
            _write_row(LQ, IDS, row, n_l, s_or, s_ol, best, offs_k, lse, V, K)
        else:
            part = row.to(tl.int64) * splits + sp
            tl.store(PK + part * KP + offs_k, best)
            tl.store(PM + part, m)
            tl.store(PS + part, s)

    @triton.jit
    def _topk_merge_kernel(
        PK, PM, PS, LQ, IDS, V, n_l, splits, s_or, s_ol,
        K: tl.constexpr, KP: tl.constexpr, SP: tl.constexpr,
    ):
        row = tl.program_id(0)
        offs = tl.arange(0, SP * KP)
        ok = (offs // KP < splits) & (offs % KP < K)
        keys = tl.load(PK + row.to(tl.int64) * splits * KP + offs, mask=ok, other=_I64_MIN)
        keys = tl.sort(keys, descending=True)
        offs_s = tl.arange(0, SP)
        s_ok = offs_s < splits
        pm = tl.load(PM + row.to(tl.int64) * splits + offs_s, mask=s_ok, other=float("-inf"))
        ps = tl.load(PS + row.to(tl.int64) * splits + offs_s, mask=s_ok, other=0.0)
        m = tl.max(pm, 0)
        m_use = tl.where(m == float("-inf"), 0.0, m)
        tot = tl.sum(ps * tl.exp2((pm - m_use) * LOG2E), 0)
        lse = tl.where(tot > 0, m_use + tl.log(tot), float("-inf"))
        _write_row(LQ, IDS, row, n_l, s_or, s_ol, keys, offs, lse, V, K)


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def supports(k: int) -> bool:
    """Whether the kernel handles this K (the dispatch falls back to torch otherwise)."""
    return triton is not None and 1 <= k <= MAX_K


@dataclass(frozen=True)
class TopkConfig:
    block: int  # vocabulary elements per tile
    num_warps: int
    pipe: int  # tiles loaded ahead (0, 1 or 2)
    waves: float  # aim for waves * SMs (row, chunk) programs


# By regime: "large" when the batch has >= 2 rows (R * L) per SM. sm_90 (H100) values: the fastest of the
# `bench_round.py --tune` sweep (round_h100.json in the git history: R=1 -> small, R=64 -> large); other
# GPUs use them unmeasured. Few warps win (cheaper cross-warp reductions, more programs per SM).
CONFIGS = {"small": TopkConfig(1024, 2, 1, 4.0), "large": TopkConfig(1024, 2, 2, 4.0)}


def plan_topk(rows: int, vocab: int, device: torch.device, block: int | None = None, splits: int | None = None,
              waves: float | None = None, num_warps: int | None = None, pipe: int | None = None):
    """(BLOCK, chunk, splits, num_warps, pipe) for a batch of `rows` rows; arguments override the table."""
    _, sms = tuning.arch_of(device)
    cfg = CONFIGS["large" if rows >= 2 * sms else "small"]
    block = block or min(cfg.block, max(16, _next_pow2(vocab)))
    if splits is None:
        splits = max(1, round((waves or cfg.waves) * sms / rows))
    splits = max(1, min(splits, -(-vocab // block)))
    chunk = -(-(-(-vocab // splits)) // block) * block
    pipe = cfg.pipe if pipe is None else pipe
    if pipe not in (0, 1, 2):
        raise ValueError(f"draft_topk: `pipe` must be 0, 1 or 2, got {pipe!r}")
    return block, chunk, -(-vocab // chunk), num_warps or cfg.num_warps, pipe


def compiled_variant(rows: int, vocab: int, device: torch.device) -> tuple:
    """What Triton compiles a separate kernel for at this many rows: the launch table's constexprs
    (BLOCK, warps, PIPE, DIRECT; the merge's SP) and the integer specializations of `splits` (== 1,
    % 16). The plan follows the batch (splits fill the SMs), so a batch size never seen before can
    compile a kernel mid-serving (the H100 at the 4B shape: seven variants, 9 kernels, between 1 and 24
    requests; gpu_jit_026_h100.json in the git history)."""
    block, _, splits, warps, pipe = plan_topk(rows, vocab, device)
    return block, warps, pipe, splits == 1, splits % 16 == 0, None if splits == 1 else _next_pow2(splits)


def variant_batches(max_batch: int, depth: int, vocab: int, device: torch.device) -> list[int]:
    """The smallest batch R in 1..max_batch of each compiled variant of a [R, depth, vocab] call."""
    first: dict = {}
    for R in range(1, max_batch + 1):
        first.setdefault(compiled_variant(R * depth, vocab, device), R)
    return sorted(first.values())


_SCRATCH: dict = {}


def _partials(device, rows: int, splits: int, kp: int):
    """Per-chunk partials (keys int64 [rows, S, KP], max and sum-exp fp32 [rows, S]), cached per shape."""
    key = (str(device), rows, splits, kp)
    ws = _SCRATCH.get(key)
    if ws is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"draft_topk: no scratch for {key} during CUDA-graph capture; run once eagerly first")
        ws = (torch.empty(rows, splits, kp, dtype=torch.int64, device=device),
              torch.empty(rows, splits, dtype=torch.float32, device=device),
              torch.empty(rows, splits, dtype=torch.float32, device=device))
        _SCRATCH[key] = ws
    return ws


def draft_topk_triton(logits: torch.Tensor, temperature: float, k: int, *, block: int | None = None,
                      splits: int | None = None, num_warps: int | None = None, pipe: int | None = None,
                      out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs fp32 [R, L, k], ids int64 [R, L, k]) of logits [R, L, V] (any strides, float dtypes).

    `k` is used as given (the caller clamps it to min(top_k, V, budget)). block / splits / num_warps /
    pipe override the launch table (CONFIGS). CPU tensors need TRITON_INTERPRET=1 set before triton
    is imported.
    """
    if triton is None:
        raise RuntimeError("draft_topk: triton is not installed")
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3 or min(logits.shape) == 0:
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"draft_topk: `logits` must be a tensor [R, L, V] with R, L, V >= 1, got {shape}")
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"draft_topk: `logits` dtype must be float32, bfloat16 or float16, got {logits.dtype}")
    R, L, V = logits.shape
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= min(MAX_K, V):
        raise ValueError(f"draft_topk: `k` must be an int in [1, min({MAX_K}, V={V})], got {k!r} "
                         "(larger k: use the torch path)")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 < temperature < math.inf:
        raise ValueError(f"draft_topk: `temperature` must be a finite number > 0, got {temperature!r}")
    if V >= 2**31:
        raise ValueError(f"draft_topk: vocabulary size V must be < 2**31, got {V}")
    if logits.device.type == "cpu" and not triton.knobs.runtime.interpret:
        raise RuntimeError("draft_topk: CPU tensors need TRITON_INTERPRET=1 set before triton is imported")
    rows, kp = R * L, max(2, _next_pow2(k))
    block, chunk, splits, warps, pipe = plan_topk(rows, V, logits.device, block, splits, None, num_warps, pipe)
    if out is None:
        out = (torch.empty(R, L, k, dtype=torch.float32, device=logits.device),
               torch.empty(R, L, k, dtype=torch.int64, device=logits.device))
    lq, ids = out
    for name, t, dt in (("out[0]", lq, torch.float32), ("out[1]", ids, torch.int64)):
        if t.shape != (R, L, k) or t.dtype != dt or t.device != logits.device or not t.is_contiguous():
            raise ValueError(f"draft_topk: `{name}` must be a contiguous {dt} tensor {(R, L, k)} on "
                             f"{logits.device}, got {t.dtype} {tuple(t.shape)}")
    direct = splits == 1
    pk, pm, ps = (lq, lq, lq) if direct else _partials(logits.device, rows, splits, kp)
    _topk_partial_kernel[(rows, splits)](
        logits, lq, ids, pk, pm, ps, 1.0 / temperature, V, L, chunk, splits,
        *logits.stride(), lq.stride(0), lq.stride(1),
        K=k, KP=kp, BLOCK=block, DIRECT=direct, PIPE=pipe, num_warps=warps,
    )
    if not direct:
        sp = _next_pow2(splits)
        _topk_merge_kernel[(rows,)](
            pk, pm, ps, lq, ids, V, L, splits, lq.stride(0), lq.stride(1),
            K=k, KP=kp, SP=sp, num_warps=4 if sp * kp <= 1024 else 8,
        )
    return lq, ids
