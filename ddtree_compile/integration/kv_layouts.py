"""vLLM's paged KV-cache layouts, as the tree path needs them: read K/V, move K/V.

A layer's cache is one tensor whose layout depends on the attention backend and, on CPU, on the
ISA vLLM picked for the layer (`_get_attn_isa` in vllm/v1/attention/backends/cpu_attn.py sets
`layer.isa`: `amx` on CPUs with AMX tiles for bf16 and block_size % 32 == 0, else `vec`, or
`vec16` for block sizes / head sizes that are not multiples of 32). Every layout here is read off
vLLM's own cache-write op (`cpu_attn_reshape_and_cache` / `reshape_and_cache_flash`) and tested
against it (tests/test_kv_layouts.py).

Two kinds:
- strided: K and V are plain strided views [num_blocks, block_size, Hkv, D] of the cache, so the
  tree templates (torch reference on CPU, Triton on CUDA) read and compact them in place;
- packed (AMX): vLLM tiles K and V for the AMX B-matrix loads; no strided view exists. Tree
  attention gathers the request's blocks into a logical copy first and compaction moves tokens
  through the tile indexing. That is CPU-only work on small caches (tests, CI); GPU layouts are
  all strided.

Layouts not listed (ARM `neon`, `vsx`, `vxe`, `rvv`, quantized CPU caches) raise NotImplementedError,
which the runner's start-up check turns into a logged, counted fallback to flat DFlash.
"""

from __future__ import annotations

import torch


def _check_record(kv_cache: torch.Tensor, head_size: int) -> tuple[int, int, int, int]:
    if kv_cache.dim() != 4 or kv_cache.shape[-1] != 2 * head_size:
        raise NotImplementedError(f"KV cache {tuple(kv_cache.shape)} is not the [num_blocks, Hkv, "
                                  f"block_size, 2*{head_size}] record layout")
    nb, hkv, bs, d2 = kv_cache.shape
    return nb, hkv, bs, d2 // 2


class StridedLayout:
    """K and V are strided views of the cache: everything works in place."""

    packed = False

    def __init__(self, name: str, views):
        self.name = name
        self._views = views  # (kv_cache, head_size) -> (K, V) logical [NB, bs, Hkv, D]

    def views(self, kv_cache: torch.Tensor, head_size: int):
        return self._views(kv_cache, head_size)

    def gather(self, kv_cache, head_size, blocks, offsets):
        """K, V [n, Hkv, D] of the tokens at (blocks[i], offsets[i])."""
        k, v = self.views(kv_cache, head_size)
        return k[blocks, offsets], v[blocks, offsets]

    def scatter(self, kv_cache, head_size, blocks, offsets, k, v) -> None:
        kc, vc = self.views(kv_cache, head_size)
        kc[blocks, offsets] = k
        vc[blocks, offsets] = v

    def logical_blocks(self, kv_cache, head_size, block_table):
        """(K, V, block_table) that the tree-attention op reads: the views and the table as they are."""
        k, v = self.views(kv_cache, head_size)
        return k, v, block_table

    def compact(self, kv_caches, head_size, block_table, src_pos, dst_pos) -> None:
        """Move token src_pos[r, m] -> dst_pos[r, m] in every layer (moves in list order)."""
        from ddtree_compile.templates import ops  # noqa: F401  registers ddtree::kv_compact
        from ddtree_compile.templates.kv_compact import launch_kv_compact

        pairs = [self.views(c, head_size) for c in kv_caches]
        args = ([k for k, _ in pairs], [v for _, v in pairs], block_table, src_pos, dst_pos)
        if src_pos.is_cuda:  # always eager, never traced: the launcher without the op's per-call dispatch
            launch_kv_compact(*args)
        else:
            torch.ops.ddtree.kv_compact(*args)


class PackedLayout(StridedLayout):
    """K and V are tiled: `tiles(kv_cache, head_size)` gives 6-D views and `index` maps logical
    (block, offset) to their subscripts. No strided [NB, bs, Hkv, D] view exists."""

    packed = True

    def __init__(self, name: str, tiles, k_index, v_index):
        self.name = name
        self._tiles, self._k_index, self._v_index = tiles, k_index, v_index

    def views(self, kv_cache, head_size):
        raise NotImplementedError(f"KV layout {self.name!r} is packed: it has no strided view")

    def gather(self, kv_cache, head_size, blocks, offsets):
        k6, v6 = self._tiles(kv_cache, head_size)
        n, hkv = blocks.shape[0], k6.shape[1]
        return (k6[self._k_index(blocks, offsets)].reshape(n, hkv, head_size),
                v6[self._v_index(blocks, offsets)].reshape(n, hkv, head_size))

    def scatter(self, kv_cache, head_size, blocks, offsets, k, v) -> None:
        k6, v6 = self._tiles(kv_cache, head_size)
        ki, vi = self._k_index(blocks, offsets), self._v_index(blocks, offsets)
        k6[ki] = k.reshape(k6[ki].shape)
        v6[vi] = v.reshape(v6[vi].shape)

    def logical_blocks(self, kv_cache, head_size, block_table):
        """The blocks of `block_table` copied out as logical [R*max_blocks, bs, Hkv, D] K and V, and
        the table that addresses the copy (CPU: tests and CI sizes)."""
        bs = kv_cache.shape[2]
        R, M = block_table.shape
        blocks = block_table.long().reshape(-1).repeat_interleave(bs)
        offsets = torch.arange(bs, device=kv_cache.device).repeat(R * M)
        k, v = self.gather(kv_cache, head_size, blocks, offsets)
        table = torch.arange(R * M, dtype=block_table.dtype, device=block_table.device).view(R, M)
        return k.view(R * M, bs, *k.shape[1:]), v.view(R * M, bs, *v.shape[1:]), table

    def compact(self, kv_caches, head_size, block_table, src_pos, dst_pos) -> None:
        bs = kv_caches[0].shape[2]
        for m in range(src_pos.shape[1]):  # in list order, like ddtree::kv_compact
            src, dst = src_pos[:, m].long(), dst_pos[:, m].long()
            rows = ((src >= 0) & (dst >= 0) & (src != dst)).nonzero().squeeze(1)
            if rows.numel() == 0:
                continue
            s, d = src[rows], dst[rows]
            sb, db = block_table[rows, s // bs].long(), block_table[rows, d // bs].long()
            for cache in kv_caches:
                k, v = self.gather(cache, head_size, sb, s % bs)
                self.scatter(cache, head_size, db, d % bs, k, v)


def _cpu_vec_views(kv_cache, head_size):
    """vec / vec16: per (block, head) the record holds K transposed [D, bs], then V [bs, D]
    (csrc/cpu/cpu_attn_vec.hpp, cpu_attn_vec16.hpp: reshape_and_cache)."""
    nb, hkv, bs, d = _check_record(kv_cache, head_size)
    rec = kv_cache.view(nb, hkv, 2, bs * d)
    k = rec[:, :, 0].view(nb, hkv, d, bs).permute(0, 3, 1, 2)
    v = rec[:, :, 1].view(nb, hkv, bs, d).permute(0, 2, 1, 3)
    return k, v


# AMX (csrc/cpu/cpu_attn_amx.hpp, reshape_and_cache): a tile row is 64 bytes, elements travel in
# 4-byte pairs (2 bf16). K of a (block, head): groups of 16 tokens; in a group, pair j of token t
# at [j, t]: [bs/16, D/2, 16, 2]. V: pairs of tokens; 16 head elements per group, groups of the
# whole block: [D/16, bs/2, 16, 2] (element i*16+j of token t at [i, t/2, j, t%2]).
_AMX_TOKENS, _AMX_N = 16, 16


def _amx_tiles(kv_cache, head_size):
    nb, hkv, bs, d = _check_record(kv_cache, head_size)
    pack = 4 // kv_cache.element_size()
    if pack != 2 or bs % _AMX_TOKENS or d % _AMX_N:
        raise NotImplementedError(f"AMX KV layout: needs a 2-byte dtype, block_size % 16 == 0 and head "
                                  f"size % 16 == 0; got {kv_cache.dtype}, {bs}, {d}")
    rec = kv_cache.view(nb, hkv, 2, bs * d)
    k6 = rec[:, :, 0].view(nb, hkv, bs // _AMX_TOKENS, d // pack, _AMX_TOKENS, pack)
    v6 = rec[:, :, 1].view(nb, hkv, d // _AMX_N, bs // pack, _AMX_N, pack)
    return k6, v6


def _amx_k_index(blocks, offsets):  # -> [n, Hkv, D/2, 2]
    return blocks, slice(None), offsets // _AMX_TOKENS, slice(None), offsets % _AMX_TOKENS, slice(None)


def _amx_v_index(blocks, offsets):  # -> [n, Hkv, D/16, 16]
    return blocks, slice(None), slice(None), offsets // 2, slice(None), offsets % 2


def _gpu_views(kv_cache, head_size):
    """FLASH_ATTN / TRITON_ATTN in vLLM 0.32: K and V side by side in each token row (their
    `kv_cache.transpose(1, 2).split(head_size, dim=-1)`). Read from the 0.32 source, not run here
    (no GPU vLLM 0.32 on the lent machine)."""
    _check_record(kv_cache, head_size)
    return kv_cache.transpose(1, 2).split(head_size, dim=-1)


CPU_ISA_LAYOUTS = {
    "vec": StridedLayout("vec", _cpu_vec_views),
    "vec16": StridedLayout("vec16", _cpu_vec_views),
    "amx": PackedLayout("amx", _amx_tiles, _amx_k_index, _amx_v_index),
}
_GPU = StridedLayout("gpu", _gpu_views)
BACKENDS = ("CPU_ATTN", "FLASH_ATTN", "TRITON_ATTN")


def layout_of(backend: str, isa: str | None = None):
    """The layout of an attention backend's cache (`isa`: vLLM's choice for the layer, CPU only)."""
    if backend == "CPU_ATTN":
        if isa not in CPU_ISA_LAYOUTS:
            raise NotImplementedError(f"tree attention on CPU: KV layout of ISA {isa!r} is not supported "
                                      f"(supported: {', '.join(CPU_ISA_LAYOUTS)})")
        return CPU_ISA_LAYOUTS[isa]
    if backend in BACKENDS:
        return _GPU
    raise NotImplementedError(f"tree attention: attention backend {backend!r} has no KV layout; "
                              f"supported: {', '.join(BACKENDS)}")
