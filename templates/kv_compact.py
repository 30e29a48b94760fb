"""Commit-time K/V compaction in the paged cache: `ddtree::kv_compact`.

    torch.ops.ddtree.kv_compact(
        key_caches,    # list of per-layer [num_blocks, block_size, Hkv, D] logical views (any strides,
        value_caches,  #   the same shape/dtype/strides in every layer; K and V strides may differ)
        block_table,   # [R, max_blocks] int32
        src_pos,       # [R, M] int64 absolute cache positions in request r's block table, -1 = no move
        dst_pos,       # [R, M] int64, same shape
    ) -> None          # mutates key_caches and value_caches in place

After a verify, the accepted path's nodes sit at cache positions ctx + slot; the next step expects
them at ctx + depth. Move m of request r copies K/V at src_pos[r, m] to dst_pos[r, m] in every layer.
Moves of one request run in list order, one after another, so a later move may read a position an
earlier move wrote. For the planner's moves (destination ctx + d for the d-th accepted node, source
its slot) the order of increasing destination is safe: every source is >= its destination and
sources strictly increase, so no move reads a position that an earlier move has overwritten. Identity
moves (src == dst) and moves with a -1 are skipped. Requests, layers, K/V and heads run in parallel,
all layers in one launch (the caches are addressed as element offsets from the first key cache).
"""

from __future__ import annotations

import torch

from ddtree_compile.templates import tuning

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def _fail(field: str, msg: str) -> None:
    raise ValueError(f"kv_compact: `{field}` {msg}")


def check_kv_compact_args(key_caches, value_caches, block_table, src_pos, dst_pos) -> None:
    """Metadata-only checks (no host sync)."""
    if len(key_caches) == 0:
        _fail("key_caches", "must hold at least one layer's cache")
    if len(value_caches) != len(key_caches):
        _fail("value_caches", f"must have as many layers as key_caches ({len(key_caches)}), got {len(value_caches)}")
    ref = key_caches[0]
    if ref.dim() != 4:
        _fail("key_caches", f"entries must be 4-D [num_blocks, block_size, Hkv, D], got {tuple(ref.shape)}")
    for name, caches in (("key_caches", key_caches), ("value_caches", value_caches)):
        for i, c in enumerate(caches):
            if tuple(c.shape) != tuple(ref.shape) or c.dtype != ref.dtype or c.device != ref.device:
                _fail(f"{name}[{i}]", f"must match key_caches[0] ({ref.dtype} {tuple(ref.shape)} on {ref.device}), "
                      f"got {c.dtype} {tuple(c.shape)} on {c.device}")
            if c.stride() != caches[0].stride():
                _fail(f"{name}[{i}]", f"strides {c.stride()} must equal {name}[0]'s {caches[0].stride()}")
    if block_table.dim() != 2 or block_table.dtype != torch.int32:
        _fail("block_table", f"must be int32 [R, max_blocks], got {block_table.dtype} {tuple(block_table.shape)}")
    R = block_table.shape[0]
    for name, t in (("src_pos", src_pos), ("dst_pos", dst_pos)):
        if t.dim() != 2 or t.shape[0] != R or t.dtype != torch.int64:
            _fail(name, f"must be int64 [R={R}, M], got {t.dtype} {tuple(t.shape)}")
    if tuple(dst_pos.shape) != tuple(src_pos.shape):
        _fail("dst_pos", f"shape {tuple(dst_pos.shape)} must equal src_pos's {tuple(src_pos.shape)}")
    for name, t in (("block_table", block_table), ("src_pos", src_pos), ("dst_pos", dst_pos)):
        if t.device != ref.device:
            _fail(name, f"must be on the caches' device {ref.device}, got {t.device}")


def kv_compact_reference(key_caches, value_caches, block_table, src_pos, dst_pos) -> None:
    """Plain torch: the moves of each request applied one by one, in list order."""
    check_kv_compact_args(key_caches, value_caches, block_table, src_pos, dst_pos)
    bs = key_caches[0].shape[1]
    for r, (srcs, dsts) in enumerate(zip(src_pos.tolist(), dst_pos.tolist())):
        for s, d in zip(srcs, dsts):
            if s < 0 or d < 0 or s == d:
                continue
            sb, db = int(block_table[r, s // bs]), int(block_table[r, d // bs])
            for cache in list(key_caches) + list(value_caches):
                cache[db, d % bs] = cache[sb, s % bs]


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
            _fail("key_caches", "caches must be element-aligned with one another")
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
        _fail("key_caches", f"head size must be a power of two for the Triton kernel, got {D}")
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


@torch.library.custom_op("ddtree::kv_compact", mutates_args=("key_caches", "value_caches"))
def kv_compact(key_caches: list[torch.Tensor], value_caches: list[torch.Tensor], block_table: torch.Tensor,
               src_pos: torch.Tensor, dst_pos: torch.Tensor) -> None:
    """CPU (and any non-CUDA device): the torch reference."""
    kv_compact_reference(key_caches, value_caches, block_table, src_pos, dst_pos)


@kv_compact.register_kernel("cuda")
def _kv_compact_cuda(key_caches, value_caches, block_table, src_pos, dst_pos) -> None:
    launch_kv_compact(key_caches, value_caches, block_table, src_pos, dst_pos)


@kv_compact.register_fake
def _kv_compact_fake(key_caches, value_caches, block_table, src_pos, dst_pos) -> None:
    check_kv_compact_args(key_caches, value_caches, block_table, src_pos, dst_pos)
