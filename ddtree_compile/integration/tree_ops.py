"""The op swap, in one place: `ddtree::` mirror ops, their tree implementations, the eager redirect.

The tree-verify pass (passes/) rewrites `vllm::X` to `ddtree::X` (`mirror_name`); each row of
passes/rules.py holds the tree implementation of its op (ATTENTION, GDN below) by reference, and the
pass refuses a row whose implementation is not one of them or does not serve that op when it loads,
not at the first verify.
`ddtree::X` is registered with X's exact schema (copied from the installed op), so every argument,
the `layer_name` graph input and auto_functionalized's mutation bookkeeping stay as they were.
At run time a mirror op

- calls the original `vllm::X` with the same arguments when no tree verify is active (prefill,
  plain decode, the drafter), so one compiled graph serves every step;
- runs its tree implementation while a tree verify is active (integration/tree_context.py).

Eager engines (enforce_eager) have no compiled graph to rewrite: there `torch.ops.vllm.X` is
pointed at the same mirror ops (`redirect_ops`), counted per engine, and the last such DDTree
engine's shutdown restores vLLM's ops. An engine with op_swap "trace" is pointed there before its
model is traced (integration/plugin.py), so vLLM's compiled graphs call the mirrors from the start
and no pass rewrites them.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch

import ddtree_compile.adapters as adapters

from . import tree_context
from .kv_layouts import layout_of

# ---------------------------------------------------------------------------------------------
# Tree implementations: (meta, original op, *the op's arguments)
# ---------------------------------------------------------------------------------------------


def kv_layout(layer):
    """The KV-cache layout of an attention layer (kv_layouts.py); NotImplementedError if unreadable."""
    return layout_of(*adapters.current().attention_backend(layer))


def _attention_tree(meta, original, query, key, value, output, layer_name, output_scale=None,
                    output_block_scale=None, kv_cache_dummy_dep=None):
    import ddtree_compile.templates.ops  # noqa: F401  registers ddtree::tree_attention(_scratch)

    if output_scale is not None or output_block_scale is not None:
        raise NotImplementedError("tree attention: fused output quantization is not supported")
    A = adapters.current()
    attn_metadata, layer, kv_cache = A.attention_context(layer_name)
    p = A.attention_params(layer)
    if p.unsupported:
        raise NotImplementedError(f"tree attention: {p.unsupported} is not supported")
    R, N = meta.num_requests, meta.num_slots
    T = R * N
    seq_lens, block_table = A.attention_batch(attn_metadata, R)
    ctx_lens = meta.context_lens if meta.context_lens is not None else seq_lens - N
    k_cache, v_cache, block_table = kv_layout(layer).logical_blocks(kv_cache, p.head_size, block_table)
    scales = ()
    if p.kv_fp8 is not None:  # FP8 entries; the query is FP8 too when vLLM quantized it before the op
        k_cache, v_cache = k_cache.view(p.kv_fp8), v_cache.view(p.kv_fp8)
        q_scale, k_scale, v_scale = p.scales
        scales = (q_scale if query.dtype == p.kv_fp8 else None, k_scale, v_scale)
    args = (query[:T].view(T, p.num_heads, p.head_size), k_cache, v_cache, block_table, ctx_lens,
            meta.ancestor_bits, meta.depths, output[:T].view(T, p.num_heads, p.head_size), p.scale,
            p.sliding_window, p.logits_soft_cap)
    if meta.attn_scratch is None:
        torch.ops.ddtree.tree_attention(*args, *scales)
    else:  # the engine's scratch (round/workspace.py): the split-KV partials at fixed addresses
        torch.ops.ddtree.tree_attention_scratch(*args, meta.attn_scratch, *scales)


def _gdn_tree(meta, original, mixed_qkv, b, a, core_attn_out, layer_name, *rest):
    """Tree verify of one GatedDeltaNet layer: tree conv + tree delta rule (ddtree::tree_gdn)."""
    from ddtree_compile.templates import gdn_step

    if rest and rest[0]:
        raise NotImplementedError("tree GDN: the ROCm AITER packed path (use_aiter=True) is not supported")
    A = adapters.current()
    name, layer, md = A.gdn_context(layer_name)
    p = A.gdn_params(layer)
    g = meta.gdn if meta.gdn is not None else tree_context.GdnVerify()
    R, N = meta.num_requests, meta.num_slots
    conv, ssm, weight = A.gdn_state_views(layer)
    state_indices, num_accepted = g.for_layer(g.state_indices, name), g.for_layer(g.num_accepted, name)
    if state_indices is None or num_accepted is None:
        spec = A.gdn_spec_rows(md, R)
        if spec is None:
            raise ValueError("tree GDN: no state_indices in TreeVerifyMetadata.gdn and the batch is not "
                             "a vLLM spec-decode batch (schedule the verify with num_speculative_tokens = B)")
        state_indices = spec[0] if state_indices is None else state_indices
        num_accepted = spec[1] if num_accepted is None else num_accepted
    width = weight.shape[-1]
    if g.tree_meta is None or g.tree_meta.width != width:
        g.tree_meta = gdn_step.make_gdn_meta(meta.parents, width)
    tm = g.tree_meta
    hv, v, k = ssm.shape[1:]
    levels = tm.max_depth if g.levels is None else min(tm.max_depth, g.levels)
    if g.stack is None:  # a caller outside the round (the round passes its workspace's, round/workspace.py)
        g.stack = torch.empty(R, max(levels, 1), hv, v, k, dtype=torch.float32, device=mixed_qkv.device)
    elif g.stack.shape[0] < R or g.stack.shape[1] < levels or g.stack.shape[2:] != (hv, v, k):
        raise ValueError(f"tree GDN: GdnVerify.stack {tuple(g.stack.shape)} does not hold {R} requests x "
                         f"{levels} depths x state {(hv, v, k)} of layer {name}")
    rec_kv, rec_gb = g.records.get(p.prefix, (None, None))
    T = R * N
    gdn_step.tree_gdn_verify(
        mixed_qkv[:T].contiguous(), b[:T].contiguous(), a[:T].contiguous(), core_attn_out[:T], conv, ssm,
        weight, p.conv_bias, p.A_log, p.dt_bias, state_indices.to(torch.int32), num_accepted.to(torch.int32),
        tm, g.stack, p.num_k_heads, p.head_k_dim, activation=p.activation, rec_kv=rec_kv, rec_gb=rec_gb,
        write_snapshots=g.write_snapshots, levels=levels)
    if meta.gdn is None:
        meta.gdn = g


@dataclass(frozen=True, eq=False)  # identity: rules and the reach check hold the same objects (cheap hash per layer)
class TreeImpl:
    name: str  # what reports and the rule digest call it
    fn: object  # (meta, original, *args)
    serves: tuple[str, ...]  # the source ops ("ns::op") whose argument lists `fn` takes


# The tree implementations a rule row (passes/rules.py) refers to, and the reach check
# (round/checks.py) counts by: the same objects, no names to keep in step.
ATTENTION = TreeImpl("attention", _attention_tree, ("vllm::unified_attention_with_output",))
GDN = TreeImpl("gdn", _gdn_tree, ("vllm::cpu_gdn_attention_core", "vllm::qwen_gdn_attention_core"))
TREE_IMPLS = (ATTENTION, GDN)


def tree_impl_for(impl, source_op: str) -> TreeImpl:
    """A rule row's implementation, checked to be one of TREE_IMPLS and to serve the row's source op;
    ValueError if not."""
    if not any(impl is t for t in TREE_IMPLS):
        raise ValueError(f"tree_impl {impl!r} is not a tree implementation; allowed: "
                         f"{', '.join('tree_ops.' + t.name.upper() for t in TREE_IMPLS)}")
    if source_op not in impl.serves:
        raise ValueError(f"tree_impl {impl.name!r} does not serve {source_op} (it serves {', '.join(impl.serves)})")
    return impl


def mirror_name(source_op: str) -> str:
    """The mirror op of a source op: "vllm::X" -> "ddtree::X" (the pass rewrites to it; register_mirror defines it)."""
    return "ddtree::" + source_op.split("::", 1)[1]


# ---------------------------------------------------------------------------------------------
# Mirror-op registration
# ---------------------------------------------------------------------------------------------

_LIB = torch.library.Library("ddtree", "FRAGMENT")
_REGISTERED: dict[str, torch._ops.OpOverload] = {}


def register_mirror(original: torch._ops.OpOverload, impl: TreeImpl) -> torch._ops.OpOverload:
    """Define `ddtree::<original's name>` with `original`'s schema (idempotent); returns its overload."""
    name = mirror_name(original._schema.name).split("::", 1)[1]
    if name in _REGISTERED:
        if _REGISTERED[name] is not original:
            raise RuntimeError(f"ddtree::{name} already mirrors {_REGISTERED[name]}, not {original}")
        return getattr(torch.ops.ddtree, name).default
    _LIB.define(name + _schema_signature(original), tags=tuple(original.tags))

    def run(*args, **kwargs):
        meta = tree_context.current_tree_verify()
        if meta is None:
            return original(*args, **kwargs)
        meta.calls[impl] = meta.calls.get(impl, 0) + 1
        return impl.fn(meta, original, *args, **kwargs)

    returns_nothing = len(original._schema.returns) == 0

    def fake(*args, **kwargs):  # same outputs as the original: nothing, or what its own fake makes
        return None if returns_nothing else original(*args, **kwargs)

    _LIB.impl(name, run, "CompositeExplicitAutograd")
    _LIB._register_fake(name, fake)
    _REGISTERED[name] = original
    return getattr(torch.ops.ddtree, name).default


def _schema_signature(original) -> str:
    """'(args) -> returns' of `original`, with opaque (PyObject) argument types spelled out by name."""
    from torch._library.opaque_object import get_opaque_type_name

    known = adapters.current().OPAQUE_ARG_TYPES
    schema = str(original._schema)
    sig = schema[schema.index("("):]
    for a in original._schema.arguments:
        if str(a.type) != "PyObject":
            continue
        if a.name not in known:
            raise ValueError(f"{original}: opaque argument {a.name!r} has no known type; known: {', '.join(known)}")
        module, cls = known[a.name]
        type_name = get_opaque_type_name(getattr(importlib.import_module(module), cls))
        sig = sig.replace(f"PyObject {a.name}", f"{type_name} {a.name}")
    return sig


# ---------------------------------------------------------------------------------------------
# Eager engines and op_swap "trace": torch.ops.vllm.X -> ddtree::X
# ---------------------------------------------------------------------------------------------

_REDIRECTED: dict[str, tuple] = {}
_USERS = 0  # live DDTree engines of this process that need the redirect (eager, or op_swap "trace")


def redirect_ops(active_rules) -> dict[str, object]:
    """Point `torch.ops.<ns>.<op>` at its `ddtree::` mirror for every active rule ([(Rule, source op)]
    from passes.rules.load_rules: the pass's table, so eager and compiled engines reach the same ops).
    Counted per engine; returns {op name: original packet}."""
    global _USERS
    _USERS += 1
    for rule, source in active_rules:
        src_ns, src_name = rule.source_packet.split("::")
        if src_name in _REDIRECTED:
            continue
        register_mirror(source, rule.tree_impl)
        ns = getattr(torch.ops, src_ns)
        _REDIRECTED[src_name] = (ns, getattr(ns, src_name))
        setattr(ns, src_name, getattr(torch.ops.ddtree, src_name))
    return {k: packet for k, (_, packet) in _REDIRECTED.items()}


_TRACED = "_ddtree_traced"  # on the runner of an op_swap "trace" engine: redirected before its model's trace


def redirect_before_trace(runner, active_rules) -> None:
    """Op_swap "trace": point vLLM's ops at the mirrors before `runner`'s model is traced (once per runner;
    released by its engine's shutdown, round/state.py)."""
    if not traced(runner):
        redirect_ops(active_rules)
        setattr(runner, _TRACED, True)


def traced(runner) -> bool:
    return getattr(runner, _TRACED, False)


def release_trace(runner) -> None:
    """`runner`'s engine will not run the round (refused at attach): its claim on the redirect goes."""
    if traced(runner):
        setattr(runner, _TRACED, False)
        release_redirects()


def release_redirects() -> None:
    """One DDTree engine that needed the redirect is gone; the last one restores vLLM's ops."""
    global _USERS
    _USERS = max(_USERS - 1, 0)
    if _USERS == 0:
        undo_redirects()


def undo_redirects() -> None:
    global _USERS
    for name, (ns, packet) in _REDIRECTED.items():
        setattr(ns, name, packet)
    _REDIRECTED.clear()
    _USERS = 0
