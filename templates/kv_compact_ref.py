"""Commit-time K/V compaction in the paged cache: argument checks and the plain torch reference.

The reference is the CPU kernel of `torch.ops.ddtree.kv_compact` and the oracle the Triton kernel
(kv_compact.py) is tested against. Semantics (shared with kv_compact.py):

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
moves (src == dst) and moves with a -1 are skipped.
"""

from __future__ import annotations

import torch


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
