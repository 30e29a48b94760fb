"""Tree attention over a paged KV cache: argument checks and the plain torch reference.

The reference is the CPU kernel of `torch.ops.ddtree.tree_attention` and the oracle the Triton
kernel is tested against. Semantics (shared with `tree_attention.py`):

- query / out [R*N, Hq, D]: request r owns rows r*N .. r*N+N-1 (slot 0 = root, 1..N-1 = nodes).
- key_cache / value_cache: logical [num_blocks, block_size, Hkv, D] views, any strides.
- block_table [R, max_blocks] int32; context_lens [R] = committed tokens before the verify block.
  Cache position p < context_len is context; p = context_len + j holds tree slot j (its K/V were
  written by the KV-cache update before attention runs).
- Row i sees every context position and tree slot j iff bit j of ancestor_bits[r, i] is set.
  A row whose own bit is clear is padding: it sees nothing and outputs zeros.
- Logical positions: context p -> p, tree slot j -> context_len + depths[r, j]. With a sliding
  window W > 0, row i sees key k iff qpos - kpos < W.
- Scores: s = softmax_scale * q.k, then cap * tanh(s / cap) when logits_soft_cap > 0.
- scratch: the Triton kernel's split-KV partials (tree_attention.py); the reference needs none.
- FP8 KV cache (vLLM's `kv_cache_dtype="fp8"`): key/value_cache hold float8 entries that mean
  entry * k_scale / v_scale; the query is either the model dtype or float8 meaning query * q_scale
  (vLLM quantizes it before the op when the backend reads FP8 queries); `out` is then the model
  dtype. Scales are float32 device tensors of 1 or Hkv elements (one per KV head, each serving
  its GQA group of query heads), read on the device: no host sync, fixed addresses for CUDA graphs.

Only metadata is validated (no host sync): block ids and context lengths must be in range, and the
K/V of padding slots must be finite (the Triton kernel multiplies masked probabilities, 0, by them).
"""

from __future__ import annotations

import torch

from ddtree_compile.core.tree import num_mask_words, unpack_bits

HEAD_SIZES = (32, 64, 128, 256)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
INDEX_DTYPES = (torch.int32, torch.int64)


def _fail(field: str, msg: str) -> None:
    raise ValueError(f"tree_attention: `{field}` {msg}")


def check_tree_attention_args(
    query, key_cache, value_cache, block_table, context_lens, ancestor_bits, depths, out,
    softmax_scale, sliding_window, logits_soft_cap, q_scale=None, k_scale=None, v_scale=None,
) -> tuple[int, int, int, int, int]:
    """Validate shapes/dtypes/devices (metadata only: no host sync). Returns (R, N, Hq, Hkv, D)."""
    if query.dim() != 3:
        _fail("query", f"must be 3-D [R*N, Hq, D], got shape {tuple(query.shape)}")
    if query.dtype not in DTYPES + FP8_DTYPES:
        _fail("query", f"dtype must be one of {DTYPES + FP8_DTYPES}, got {query.dtype}")
    T, Hq, D = query.shape
    if D not in HEAD_SIZES:
        _fail("query", f"head size must be one of {HEAD_SIZES}, got {D}")
    kv_fp8 = key_cache.dtype in FP8_DTYPES
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if cache.dim() != 4:
            _fail(name, f"must be 4-D [num_blocks, block_size, Hkv, D], got shape {tuple(cache.shape)}")
        if cache.dtype != query.dtype and cache.dtype not in FP8_DTYPES:
            _fail(name, f"dtype must equal query's {query.dtype} or be one of {FP8_DTYPES} (an FP8 query "
                        f"needs an FP8 cache), got {cache.dtype}")
        if cache.shape[3] != D:
            _fail(name, f"head size must equal query's {D}, got {cache.shape[3]}")
    if value_cache.dtype != key_cache.dtype:
        _fail("value_cache", f"dtype must equal key_cache's {key_cache.dtype}, got {value_cache.dtype}")
    if tuple(value_cache.shape) != tuple(key_cache.shape):
        _fail("value_cache", f"shape {tuple(value_cache.shape)} must equal key_cache's {tuple(key_cache.shape)}")
    Hkv = key_cache.shape[2]
    if Hkv == 0 or Hq % Hkv != 0:
        _fail("key_cache", f"KV heads ({Hkv}) must divide query heads ({Hq})")
    if ancestor_bits.dim() != 3 or ancestor_bits.dtype != torch.int32:
        _fail("ancestor_bits", f"must be int32 [R, N, ceil(N/32)], got {ancestor_bits.dtype} {tuple(ancestor_bits.shape)}")
    R, N, W = ancestor_bits.shape
    if N < 1 or W != num_mask_words(N):
        _fail("ancestor_bits", f"must have ceil(N/32)={num_mask_words(max(N, 1))} words per row, got {W}")
    if T != R * N:
        _fail("query", f"rows ({T}) must equal R*N = {R}*{N} from ancestor_bits")
    if block_table.dim() != 2 or block_table.shape[0] != R or block_table.dtype != torch.int32:
        _fail("block_table", f"must be int32 [R={R}, max_blocks], got {block_table.dtype} {tuple(block_table.shape)}")
    if context_lens.dim() != 1 or context_lens.shape[0] != R or context_lens.dtype not in INDEX_DTYPES:
        _fail("context_lens", f"must be int32/int64 [R={R}], got {context_lens.dtype} {tuple(context_lens.shape)}")
    if depths.dim() != 2 or tuple(depths.shape) != (R, N) or depths.dtype not in INDEX_DTYPES:
        _fail("depths", f"must be int32/int64 [R={R}, N={N}], got {depths.dtype} {tuple(depths.shape)}")
    out_dtypes = DTYPES if query.dtype in FP8_DTYPES else (query.dtype,)
    if tuple(out.shape) != tuple(query.shape) or out.dtype not in out_dtypes:
        _fail("out", f"must have query's shape {tuple(query.shape)} and dtype in {out_dtypes}, "
                     f"got {out.dtype} {tuple(out.shape)}")
    tensors = dict(key_cache=key_cache, value_cache=value_cache, block_table=block_table,
                   context_lens=context_lens, ancestor_bits=ancestor_bits, depths=depths, out=out)
    for name, t in tensors.items():
        if t.device != query.device:
            _fail(name, f"must be on query's device {query.device}, got {t.device}")
    for name, scale, needed, why in (("q_scale", q_scale, query.dtype in FP8_DTYPES, "an FP8 query"),
                                     ("k_scale", k_scale, kv_fp8, "an FP8 KV cache"),
                                     ("v_scale", v_scale, kv_fp8, "an FP8 KV cache")):
        if (scale is not None) != needed:
            _fail(name, f"must be given exactly with {why} (query {query.dtype}, key_cache {key_cache.dtype}), "
                        f"got {'a tensor' if scale is not None else 'None'}")
        if scale is not None and (scale.dtype != torch.float32 or scale.numel() not in (1, Hkv)
                                  or scale.dim() > 1 or scale.device != query.device):
            _fail(name, f"must be a float32 tensor of 1 or Hkv={Hkv} elements (0-D or 1-D) on {query.device}, "
                        f"got {scale.dtype} {tuple(scale.shape)} on {scale.device}")
    if not (softmax_scale > 0.0) or softmax_scale == float("inf"):
        _fail("softmax_scale", f"must be a finite positive float, got {softmax_scale}")
    if not isinstance(sliding_window, int):
        _fail("sliding_window", f"must be an int (<= 0 for none), got {sliding_window!r}")
    if logits_soft_cap != logits_soft_cap or logits_soft_cap == float("inf"):
        _fail("logits_soft_cap", f"must be a finite float (<= 0 for none), got {logits_soft_cap}")
    return R, N, Hq, Hkv, D


def _per_kv_head(scale, Hkv: int, G: int):
    """A [1] or [Hkv] scale as a factor over [.., Hq, D] (1.0 when there is none)."""
    if scale is None:
        return 1.0
    return scale.float().reshape(-1).expand(Hkv).repeat_interleave(G)[:, None]


def check_scratch(scratch, device, need: int = 0) -> None:
    """`scratch`: None, or a contiguous 1-D float32 tensor on `device`, 16-byte aligned, of at least
    `need` elements (the launcher knows its bucket's need; the op's fake and reference pass 0)."""
    if scratch is None:
        return
    if scratch.dim() != 1 or scratch.dtype != torch.float32 or not scratch.is_contiguous():
        _fail("scratch", f"must be a contiguous 1-D float32 tensor, got {scratch.dtype} {tuple(scratch.shape)}")
    if scratch.device != device:
        _fail("scratch", f"must be on query's device {device}, got {scratch.device}")
    if scratch.numel() < need or scratch.data_ptr() % 16:
        _fail("scratch", f"must hold >= {need} elements from a 16-byte aligned start, got {scratch.numel()} "
                         f"at address {scratch.data_ptr():#x}")


def tree_attention_reference(
    query, key_cache, value_cache, block_table, context_lens, ancestor_bits, depths, out,
    softmax_scale: float, sliding_window: int = 0, logits_soft_cap: float = 0.0,
    q_scale=None, k_scale=None, v_scale=None,
) -> None:
    """Plain float32 torch implementation (FP8 entries dequantized by their scales); writes `out` in place."""
    R, N, Hq, Hkv, D = check_tree_attention_args(
        query, key_cache, value_cache, block_table, context_lens, ancestor_bits, depths, out,
        softmax_scale, sliding_window, logits_soft_cap, q_scale, k_scale, v_scale)
    G = Hq // Hkv
    qs, ks, vs = (_per_kv_head(s, Hkv, G) for s in (q_scale, k_scale, v_scale))
    bs = key_cache.shape[1]
    dev = query.device
    anc = unpack_bits(ancestor_bits, N)  # [R, N, N]
    for r, c in enumerate(context_lens.tolist()):
        pos = torch.arange(c + N, device=dev)
        blocks = block_table[r].long()[pos // bs]
        k = key_cache[blocks, pos % bs].float().repeat_interleave(G, dim=1) * ks  # [c+N, Hq, D]
        v = value_cache[blocks, pos % bs].float().repeat_interleave(G, dim=1) * vs
        q = query[r * N:(r + 1) * N].float() * qs  # [N, Hq, D]
        s = torch.einsum("qhd,khd->hqk", q, k) * softmax_scale
        if logits_soft_cap > 0:
            s = logits_soft_cap * torch.tanh(s / logits_soft_cap)
        # Visibility per block: context (window only) and tree (ancestor bits, window by depth).
        live = anc[r].diagonal()  # a row's own bit: False for padding
        depth = depths[r].long()
        vis_ctx = live[:, None].expand(N, c)
        vis_tree = anc[r]
        if sliding_window > 0:
            qpos = c + depth
            vis_ctx = vis_ctx & (qpos[:, None] - torch.arange(c, device=dev)[None, :] < sliding_window)
            vis_tree = vis_tree & (depth[:, None] - depth[None, :] < sliding_window)
        s[:, :, :c] = s[:, :, :c].masked_fill(~vis_ctx, float("-inf"))
        s[:, :, c:] = s[:, :, c:].masked_fill(~vis_tree, float("-inf"))
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # padding rows: all -inf -> zeros
        o = torch.einsum("hqk,khd->qhd", p, v)
        out[r * N:(r + 1) * N] = o.to(out.dtype)
