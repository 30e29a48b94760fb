"""Commit-time K/V compaction in the paged cache: the Triton kernel behind `ddtree::kv_compact` (ops.py).

Semantics and the plain torch reference (the op's CPU kernel): kv_compact_ref.py. One program per
(request, cache, KV head), where the caches are every layer's keys, then every layer's values: all
layers move in one launch, each cache addressed as an element offset from the first key cache. A
program runs its request's moves in list order (a later move may read what an earlier one wrote).
"""

from __future__ import annotations

import torch

from ddtree_compile.templates import tuning
from ddtree_compile.templates.kv_compact_ref import check_kv_compact_args

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without triton: only the reference is available
    triton = None


if triton is not None:

    @triton.jit
    def _kv_compact_kernel(
        BASE, OFFS, BT, SRC, DST, n_moves, n_layers, page_size,
        s_btr, s_btc, s_sr, s_sm, s_dr, s_dm,
        s_kb, s_kt, s_kh, s_kd, s_vb, s_vt, s_vh, s_vd,
        HEAD_DIM: tl.constexpr,
    ):
        r = tl.program_id(0)
        c = tl.program_id(1)  # cache index: 0..L-1 keys, L..2L-1 values
        h = tl.program_id(2)
        is_k = c < n_layers
        s_b = tl.where(is_k, s_kb, s_vb).to(tl.int64)
        s_t = tl.where(is_k, s_kt, s_vt)
        s_h = tl.where(is_k, s_kh, s_vh)
        s_d = tl.where(is_k, s_kd, s_vd)
        cache = BASE + tl.load(OFFS + c) + h * s_h
        offs_d = tl.arange(0, HEAD_DIM) * s_d
        for m in range(n_moves):  # sequential: a later move may read what an earlier one wrote
            src = tl.load(SRC + r * s_sr + m * s_sm)
            dst = tl.load(DST + r * s_dr + m * s_dm)
            if (src >= 0) & (dst >= 0) & (src != dst):
                sb = tl.load(BT + r * s_btr + (src // page_size) * s_btc).to(tl.int64)
                db = tl.load(BT + r * s_btr + (dst // page_size) * s_btc).to(tl.int64)
                x = tl.load(cache + sb * s_b + (src % page_size) * s_t + offs_d)
                tl.store(cache + db * s_b + (dst % page_size) * s_t + offs_d, x)
            tl.debug_barrier()


_OFFSETS: dict = {}


def _cache_offsets(key_caches, value_caches) -> torch.Tensor:
    """int64 element offsets of every cache from key_caches[0], cached per set of cache pointers."""
    base = key_caches[0]
    ptrs = tuple(t.data_ptr() for t in list(key_caches) + list(value_caches))
    key = (str(base.device), ptrs)
    offs = _OFFSETS.get(key)
    if offs is None:
        if base.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("kv_compact: cache offsets not prepared before CUDA-graph capture; "
                               "run the op once eagerly with these caches first")
        item = base.element_size()
        deltas = [p - ptrs[0] for p in ptrs]
        if any(d % item for d in deltas):
            raise ValueError("kv_compact: `key_caches` caches must be element-aligned with one another")
        offs = torch.tensor([d // item for d in deltas], dtype=torch.int64, device=base.device)
        _OFFSETS[key] = offs
    return offs


def launch_kv_compact(key_caches, value_caches, block_table, src_pos, dst_pos) -> None:
    """Triton path (CUDA, or CPU tensors under TRITON_INTERPRET=1): one launch for all layers."""
    if triton is None:
        raise RuntimeError("kv_compact: triton is not installed")
    check_kv_compact_args(key_caches, value_caches, block_table, src_pos, dst_pos)
    base = key_caches[0]
    if base.device.type == "cpu" and not triton.knobs.runtime.interpret:
        raise RuntimeError("kv_compact: CPU tensors need TRITON_INTERPRET=1 set before triton is imported")
    D = base.shape[3]
    if D & (D - 1):
        raise ValueError(f"kv_compact: `key_caches` head size must be a power of two for the Triton kernel, got {D}")
    R, M = src_pos.shape
    L = len(key_caches)
    if R == 0 or M == 0:
        return
    arch, _ = tuning.arch_of(base.device)
    _kv_compact_kernel[(R, 2 * L, base.shape[2])](
        base, _cache_offsets(key_caches, value_caches), block_table, src_pos, dst_pos, M, L, base.shape[1],
        *block_table.stride(), *src_pos.stride(), *dst_pos.stride(),
        *key_caches[0].stride(), *value_caches[0].stride(),
        HEAD_DIM=D, num_warps=tuning.compact_tiles(arch).num_warps,
    )
