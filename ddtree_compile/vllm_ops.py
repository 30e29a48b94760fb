"""Tree-aware replacements for vLLM's attention / KV-write / GatedDeltaNet ops, and the tree context.

The pass (passes/engine.py) rewrites `vllm::X` to `ddtree::X`. Each `ddtree::X` is registered
with X's exact schema (copied from the installed op), so every argument, the `layer_name` graph
input and auto_functionalized's mutation bookkeeping stay as they were. At run time:

- no tree verify active (prefill, plain decode, the drafter): call the original `vllm::X` with
  the same arguments, so one compiled graph serves every step;
- a tree verify active: run the tree template instead (attention: `ddtree::tree_attention`).

The tree context
----------------
A module-level slot holds the current step's `TreeVerifyMetadata` (or None). The runner sets it
around the TARGET model's verify forward only (never around the drafter or a prefill):

    meta = TreeVerifyMetadata.from_tree(tree_batch)          # or fill persistent buffers
    with tree_verify(meta):
        hidden = model(input_ids, positions, ...)            # R*(B+1) tokens, positions = ctx+depth

or `set_tree_verify(meta)` / `set_tree_verify(None)` where a `with` block does not fit. The
context keeps references, not copies: a runner that captures CUDA graphs keeps one metadata
object of persistent tensors per budget bucket, refills them in place each step, and captures
with the context set (the Python branch below is taken at capture time).

Batch layout in a tree verify: request r owns query rows r*N .. r*N+N-1 (N = B+1, slot 0 the
root, ddtree_compile.tree layout); vLLM's slot mapping puts slot j at cache position
context_len + j, which is what the tree templates read.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

_ACTIVE: "TreeVerifyMetadata | None" = None


@dataclass
class TreeVerifyMetadata:
    """Per-step tree metadata read by the replacement ops (device tensors, fixed shapes per bucket).

    ancestor_bits  int32 [R, N, ceil(N/32)]  packed ancestor-or-self mask (ddtree_compile.tree)
    depths         int64/int32 [R, N]        depth of each slot (0 for root and padding)
    parents        int64 [R, N]              parent slot, -1 for the root and padding
    context_lens   [R] or None               committed tokens before the verify block; None:
                                             vLLM's attention seq_lens - N
    block_table    int32 [R, max_blocks] or None   None: vLLM's attention block table
    gdn            dict or None              GatedDeltaNet state addressing for the tree GDN op
                                             (see `_gdn_tree`); None on attention-only models
    """

    ancestor_bits: torch.Tensor
    depths: torch.Tensor
    parents: torch.Tensor
    context_lens: torch.Tensor | None = None
    block_table: torch.Tensor | None = None
    gdn: dict | None = None
    calls: dict = field(default_factory=dict)  # op name -> tree-mode calls (tests, debugging)

    @property
    def num_requests(self) -> int:
        return self.ancestor_bits.shape[0]

    @property
    def num_slots(self) -> int:
        return self.ancestor_bits.shape[1]

    @classmethod
    def from_tree(cls, tree, **kw) -> "TreeVerifyMetadata":
        """From a ddtree_compile.tree.TreeBatch."""
        return cls(ancestor_bits=tree.ancestor_bits, depths=tree.depths, parents=tree.parents, **kw)


def current_tree_verify() -> TreeVerifyMetadata | None:
    return _ACTIVE


def set_tree_verify(meta: TreeVerifyMetadata | None) -> None:
    global _ACTIVE
    if meta is not None and not isinstance(meta, TreeVerifyMetadata):
        raise ValueError(f"set_tree_verify: expected TreeVerifyMetadata or None, got {type(meta).__name__}")
    _ACTIVE = meta


@contextlib.contextmanager
def tree_verify(meta: TreeVerifyMetadata):
    """Make `meta` the active tree verify for the forwards inside the block."""
    prev = _ACTIVE
    set_tree_verify(meta)
    try:
        yield meta
    finally:
        set_tree_verify(prev)


# ---------------------------------------------------------------------------------------------
# Mirror-op registration
# ---------------------------------------------------------------------------------------------

_LIB = torch.library.Library("ddtree", "FRAGMENT")
_REGISTERED: dict[str, torch._ops.OpOverload] = {}


def register_replacement(name: str, original: torch._ops.OpOverload) -> torch._ops.OpOverload:
    """Define `ddtree::<name>` with `original`'s schema (idempotent). Returns the new overload."""
    if name in _REGISTERED:
        if _REGISTERED[name] is not original:
            raise RuntimeError(f"ddtree::{name} already mirrors {_REGISTERED[name]}, not {original}")
        return getattr(torch.ops.ddtree, name).default
    if name not in _TREE_IMPLS:
        raise ValueError(f"ddtree::{name}: no tree implementation; known: {', '.join(sorted(_TREE_IMPLS))}")
    _LIB.define(name + _schema_signature(original), tags=tuple(original.tags))
    tree_impl = _TREE_IMPLS[name]
    op_name = f"ddtree::{name}"

    def impl(*args, **kwargs):
        meta = _ACTIVE
        if meta is None:
            return original(*args, **kwargs)
        meta.calls[op_name] = meta.calls.get(op_name, 0) + 1
        return tree_impl(meta, original, *args, **kwargs)

    returns_nothing = len(original._schema.returns) == 0

    def fake(*args, **kwargs):
        # Same outputs as the original: nothing, or whatever its own fake produces.
        return None if returns_nothing else original(*args, **kwargs)

    _LIB.impl(name, impl, "CompositeExplicitAutograd")
    _LIB._register_fake(name, fake)
    _REGISTERED[name] = original
    return getattr(torch.ops.ddtree, name).default


# Opaque (PyObject) arguments print as "PyObject" in a schema but must be declared by type name.
OPAQUE_ARG_TYPES = {"layer_name": ("vllm.utils.torch_utils", "LayerName")}


def _schema_signature(original) -> str:
    """'(args) -> returns' of `original`, with opaque argument types spelled out."""
    import importlib

    from torch._library.opaque_object import get_opaque_type_name

    schema = str(original._schema)
    sig = schema[schema.index("("):]
    for a in original._schema.arguments:
        if str(a.type) != "PyObject":
            continue
        if a.name not in OPAQUE_ARG_TYPES:
            raise ValueError(f"{original}: opaque argument {a.name!r} has no known type; "
                             f"known: {', '.join(OPAQUE_ARG_TYPES)}")
        module, cls = OPAQUE_ARG_TYPES[a.name]
        sig = sig.replace(f"PyObject {a.name}", f"{get_opaque_type_name(getattr(importlib.import_module(module), cls))} {a.name}")
    return sig


def registered_replacements() -> dict[str, torch._ops.OpOverload]:
    return dict(_REGISTERED)


# ---------------------------------------------------------------------------------------------
# Attention: KV-cache views and the tree path
# ---------------------------------------------------------------------------------------------

def kv_layout(layer):
    """The KV-cache layout of an attention layer (ddtree_compile.kv_layouts); raises
    NotImplementedError for layouts the tree path cannot read."""
    from .kv_layouts import layout_of

    return layout_of(layer.attn_backend.get_name(), getattr(layer, "isa", None))


def _attention_context(layer_name):
    from vllm.model_executor.layers.attention.attention import get_attention_context
    from vllm.utils.torch_utils import _resolve_layer_name

    return get_attention_context(_resolve_layer_name(layer_name))


def _attention_tree(meta, original, query, key, value, output, layer_name, output_scale=None,
                    output_block_scale=None, kv_cache_dummy_dep=None):
    if output_scale is not None or output_block_scale is not None:
        raise NotImplementedError("tree attention: fused output quantization is not supported")
    attn_metadata, layer, kv_cache, _ = _attention_context(layer_name)
    impl = layer.impl
    if getattr(impl, "alibi_slopes", None) is not None or getattr(impl, "sinks", None) is not None:
        raise NotImplementedError("tree attention: ALiBi and attention sinks are not supported")
    if str(getattr(impl, "kv_cache_dtype", "auto")) not in ("auto", "bfloat16", "float16", "float32"):
        raise NotImplementedError(f"tree attention: quantized KV cache {impl.kv_cache_dtype!r} is not supported")
    R, N = meta.num_requests, meta.num_slots
    T = R * N
    hq, d = impl.num_heads, impl.head_size
    ctx_lens = meta.context_lens
    if ctx_lens is None:
        ctx_lens = attn_metadata.seq_lens[:R] - N
    block_table = meta.block_table if meta.block_table is not None else attn_metadata.block_table[:R]
    k_cache, v_cache, block_table = kv_layout(layer).logical_blocks(kv_cache, d, block_table.to(torch.int32))
    out = output[:T].view(T, hq, d)
    import ddtree_compile.templates.tree_attention  # noqa: F401  registers ddtree::tree_attention

    window = getattr(impl, "sliding_window", None)
    cap = getattr(impl, "logits_soft_cap", None)
    torch.ops.ddtree.tree_attention(
        query[:T].view(T, hq, d), k_cache, v_cache, block_table, ctx_lens,
        meta.ancestor_bits, meta.depths, out, float(impl.scale),
        int(window) if window is not None and window > 0 else 0, float(cap or 0.0))


def _kv_update_tree(meta, original, key, value, layer_name):
    # The tree's K/V go where vLLM's slot mapping puts them (slot j at context_len + j), which is
    # the layout tree attention reads; only check that the cache layout is one we can read.
    _, layer, _, _ = _attention_context(layer_name)
    kv_layout(layer)
    return original(key, value, layer_name)


def _gdn_state_views(layer):
    """(conv_state [lines, dim, state_len], ssm_state logical [lines, HV, V, K], conv weight [dim, W])."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    conv, ssm = layer.kv_cache[0], layer.kv_cache[1]
    conv = conv if is_conv_state_dim_first() else conv.transpose(-1, -2)
    n, hv, a, b = ssm.shape
    try:  # the CPU kernels store the state [K, V] (and may pack the conv weight in place)
        from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention as cpu_gdn

        on_cpu = ssm.device.type == "cpu"
    except ImportError:
        on_cpu = False
    if on_cpu:
        return conv, ssm.view(n, hv, b, a).transpose(-1, -2), cpu_gdn._unpacked_conv_weight(layer)
    w = layer.conv1d.weight
    return conv, ssm, w.view(w.size(0), w.size(-1))


def _per_layer(value, layer_name):
    return value.get(layer_name) if isinstance(value, dict) else value


def _gdn_tree(meta, original, *args):
    """Tree verify of one GatedDeltaNet layer: tree conv + tree delta rule (ddtree::tree_gdn).

    meta.gdn keys (all optional; defaults come from vLLM's GDN spec-decode metadata, i.e. a verify
    batch scheduled with num_speculative_tokens = B):
      state_indices  int32 [R, NS]  column 0: the request's conv line; committed SSM line at
                                    column num_accepted-1 (template convention); NS = N for snapshots.
                                    Or {layer_name: tensor}: GDN layers of different KV cache
                                    groups hold their state in different block ids
      num_accepted   int32 [R]      vLLM's num_accepted_tokens from the previous step
      write_snapshots bool          write every node's state to state_indices[r, slot] (default False)
      records        {layer_name: (rec_kv, rec_gb)}  per-node k/v and g/beta for replay commit
      tree_meta      GdnTreeMeta    built from meta.parents on first use if absent (per step)
      stack          fp32 [R, levels, HV, V, K] workspace, allocated on first use if absent
      conv_state     {layer_name: [lines, dim, W-2+N]} conv buffers to use instead of the layer's
                     cache (an engine without a speculative config has W-1 columns only)
    """
    import ddtree_compile.templates.gdn_ops as gdn_ops
    from vllm.forward_context import get_forward_context
    from vllm.utils.torch_utils import _resolve_layer_name

    if original._schema.name != "vllm::cpu_gdn_attention_core" and \
            original._schema.name != "vllm::qwen_gdn_attention_core":
        raise NotImplementedError(f"tree verify through {original} (fused output norm) is not wired yet")
    mixed_qkv, b, a, core_attn_out, layer_name = args[:5]
    if len(args) > 5 and args[5]:
        raise NotImplementedError("tree GDN: the ROCm AITER packed path (use_aiter=True) is not supported")
    name = _resolve_layer_name(layer_name)
    fctx = get_forward_context()
    layer = fctx.no_compile_layers[name]
    g = meta.gdn if meta.gdn is not None else {}
    R, N = meta.num_requests, meta.num_slots
    conv, ssm, weight = _gdn_state_views(layer)
    conv = _per_layer(g.get("conv_state"), name) if g.get("conv_state") is not None else conv
    state_indices, num_accepted = _per_layer(g.get("state_indices"), name), _per_layer(g.get("num_accepted"), name)
    if state_indices is None or num_accepted is None:
        md = fctx.attn_metadata[layer.prefix]
        if md.spec_state_indices_tensor is None:
            raise ValueError("tree GDN: no state_indices in TreeVerifyMetadata.gdn and the batch is not "
                             "a vLLM spec-decode batch (schedule the verify with num_speculative_tokens = B)")
        state_indices = md.spec_state_indices_tensor[:R] if state_indices is None else state_indices
        num_accepted = md.num_accepted_tokens[:R] if num_accepted is None else num_accepted
    width = weight.shape[-1]
    tm = g.get("tree_meta")
    if tm is None or tm.width != width:
        tm = g["tree_meta"] = gdn_ops.make_gdn_meta(meta.parents, width)
    hv, v, k = ssm.shape[1:]
    stack = g.get("stack")
    if stack is None or stack.shape[1] < tm.max_depth or stack.shape[2:] != (hv, v, k):
        stack = g["stack"] = torch.empty(R, max(tm.max_depth, 1), hv, v, k, dtype=torch.float32,
                                         device=mixed_qkv.device)
    rec_kv, rec_gb = g.get("records", {}).get(name, (None, None))
    T = R * N
    gdn_ops.tree_gdn_verify(
        mixed_qkv[:T].contiguous(), b[:T].contiguous(), a[:T].contiguous(), core_attn_out[:T], conv, ssm,
        weight, layer.conv1d.bias, layer.A_log, layer.dt_bias, state_indices.to(torch.int32),
        num_accepted.to(torch.int32), tm, stack, layer.num_k_heads // layer.tp_size, layer.head_k_dim,
        activation=layer.activation, rec_kv=rec_kv, rec_gb=rec_gb,
        write_snapshots=bool(g.get("write_snapshots", False)))
    if meta.gdn is None:
        meta.gdn = g


# replacement op name -> tree implementation (meta, original op, *op args).
_TREE_IMPLS = {
    "unified_attention_with_output": _attention_tree,
    "unified_kv_cache_update": _kv_update_tree,
    "cpu_gdn_attention_core": _gdn_tree,
    "qwen_gdn_attention_core": _gdn_tree,
    "qwen_gdn_attention_core_fused_norm_packed": _gdn_tree,
}
