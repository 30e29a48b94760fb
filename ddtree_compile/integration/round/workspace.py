"""The round's persistent device buffers, and their place in vLLM's memory plan.

vLLM sizes the KV cache (gpu_memory_utilization) from a memory profile taken before the round is
attached, so whatever the round allocates afterwards comes out of the headroom vLLM left for
itself. The buffers:

    rec_kv [layers, R, N, H*K + HV*V]  model dtype  per-node k/v of every GDN layer (replay commit)
    rec_gb [layers, R, N, 2, HV]       fp32         per-node g/beta
    stack  [R, min(B, L), HV, V, K]    fp32         the tree GDN kernel's depth stack: the state at
                                                    each depth where its walk branches (above L),
                                                    shared by every layer
    attn_scratch [elems]               fp32         tree attention's split-KV partials (CUDA only):
                                                    the most any batch of 1..R trees needs
                                                    (templates/tree_attention.py), shared by every
                                                    attention layer and every batch size

(R = max_num_seqs, N = B + 1, or with budget "auto" 1 + max(B, L): `max_slots`; the scratch is
planned for every slot count of `verify_slots`; the GDN buffers on
hybrid targets only.) One set per engine, sized for the largest batch and bucket: a batch of R'
requests of N' slots uses the first R' x N' slots of each layer's GDN records (`records`) and the
first R' rows of the stack, the partials of its own bucket at fixed offsets of the scratch, so every
CUDA graph reads the same addresses, and the graphs share them because vLLM never replays two at once.
Allocated by an op inside a FULL graph's capture instead, a buffer would be held by the graph pool once
per batch bucket, outside the memory plan vLLM has already used to size the KV cache.

`reserve` (the adapter's memory-profile hook, before vLLM measures its peak) allocates the bytes
`plan` computes, so the KV cache is sized around them; `Workspace` (the verify stage, at attach)
frees that reservation and allocates the same shapes in its place; the engine's shutdown drops it.
"""

from __future__ import annotations

import math

import torch

from ... import adapters
from ...core import buckets
from ...core.buckets import chain_tokens, verify_tokens
from ...templates import tree_attention

_RESERVE = "_ddtree_reserve"  # on the runner instance: the bytes held from profiling to attach


def gdn_shapes(p, n_layers: int, R: int, N: int, L: int, dtype) -> dict:
    """name -> (shape, dtype) of the GDN buffers for `n_layers` GDN layers of parameters `p`
    (adapters' GdnParams), R requests, trees of N slots and a drafter of L positions. rec_kv / rec_gb
    are per KV cache group in Workspace; their byte total depends only on the layer count."""
    shape = buckets.gdn_workspace(n_layers, R, max(N - 1, 1), L, p.num_k_heads, p.head_k_dim, p.num_v_heads,
                                  p.head_v_dim)
    return {"rec_kv": (shape["rec_kv"], dtype), "rec_gb": (shape["rec_gb"], torch.float32),
            "stack": (shape["stack"], torch.float32)}


def attention_scratch_elems(view, attn_layers, R: int, slots) -> int:
    """fp32 elements of the tree-attention scratch that serves every batch of 1..R trees of any of
    `slots` slot counts on these layers (0: no layer runs the CUDA kernel, or no bucket splits its
    keys). Every count is planned: a smaller bucket splits its keys more (fewer query rows to fill the
    GPU), so its partials can outgrow the largest bucket's at the same batch."""
    if not attn_layers or not tree_attention.uses_scratch(view.device):
        return 0
    A = adapters.current()
    heads = {(p.num_heads, p.num_kv_heads, p.head_size) for p in map(A.attention_params, map(view.layer, attn_layers))}
    return scratch_elems(view.device, R, slots, heads)


def scratch_elems(device, R: int, slots, heads) -> int:
    """The most any batch of 1..R trees of any of `slots` slot counts needs, over `heads` {(query heads,
    KV heads, head size)} (templates/tree_attention.py bucket_scratch_elems)."""
    return max(tree_attention.bucket_scratch_elems(device, r, n, *h)
               for r in range(1, R + 1) for n in slots for h in heads)


def shapes(view, layers: dict, slots, L: int) -> dict:
    """name -> (shape, dtype) of the round's buffers on this engine (module docstring) for trees of
    `slots` slot counts (`verify_slots`) and a drafter of L positions; `layers` as
    checks.classify_layers returns them."""
    R, N, out = view.max_num_reqs, max(slots), {}
    if layers["gdn"]:
        p = adapters.current().gdn_params(view.layer(layers["gdn"][0]))
        out.update(gdn_shapes(p, len(layers["gdn"]), R, N, L, view.dtype))
    elems = attention_scratch_elems(view, layers["attention"], R, slots)
    if elems:
        out["attn_scratch"] = ((elems,), torch.float32)
    return out


def verify_slots(cfg, draft_len: int) -> tuple[int, ...]:
    """The slot counts of the verifies that may go through the templates, ascending: every tree bucket's
    b + 1, and with budget "auto" the chain's L + 1 (a chain verified as a chain-shaped tree where
    vLLM's GDN verify cannot take it: verify_stage)."""
    chain = {chain_tokens(draft_len)} if cfg.auto else set()
    return tuple(sorted({verify_tokens(b) for b in cfg.budget_menu(draft_len)} | chain))


def max_slots(cfg, draft_len: int) -> int:
    """The most tokens per request a verify through the templates has (sizes the GDN buffers)."""
    return max(verify_slots(cfg, draft_len))


def nbytes(shapes: dict) -> int:
    return sum(math.prod(shape) * dtype.itemsize for shape, dtype in shapes.values())


def plan(runner, cfg) -> int:
    """Bytes of the buffers the round will allocate on this engine (0: none, or an engine the round
    will not serve; attach then logs and counts why)."""
    from .checks import UnsupportedEngine, classify_layers, validate

    view = adapters.current().view_of(runner)
    draft_len, _ = validate(view.settings, cfg)
    try:
        layers = classify_layers(view)
    except UnsupportedEngine:
        return 0
    return nbytes(shapes(view, layers, verify_slots(cfg, draft_len), draft_len))


def reserve(runner, cfg) -> int:
    """Hold `plan`'s bytes on the runner's device until attach (vLLM's profile counts them)."""
    size = plan(runner, cfg)
    if size and getattr(runner, _RESERVE, None) is None:
        device = adapters.current().view_of(runner).device
        setattr(runner, _RESERVE, torch.empty(size, dtype=torch.uint8, device=device))
    return size


def release(runner) -> int:
    """Free the reservation (attach allocates the real buffers in its place); its size, 0 if none."""
    held = getattr(runner, _RESERVE, None)
    setattr(runner, _RESERVE, None)
    return 0 if held is None else held.numel()


def _empty(spec, device) -> torch.Tensor:
    shape, dtype = spec
    return torch.empty(shape, dtype=dtype, device=device)


class Workspace:
    """The round's buffers of one engine (module docstring), allocated once at attach."""

    def __init__(self, ctx):
        A = adapters.current()
        self.reserved = release(ctx.view.runner)
        planned = shapes(ctx.view, {"attention": ctx.attn_layers, "gdn": ctx.gdn_layers},
                         verify_slots(ctx.cfg, ctx.L), ctx.L)
        self.per_layer, self.per_group, self.all_layers, self.stack = {}, {}, None, None
        if ctx.hybrid:
            # one buffer for every GDN layer, in KV cache group order: a group's layers are a slice of
            # it, and the commit of all groups reads it in one launch (commit_stage.py)
            rec_kv, rec_gb = (_empty(planned[k], ctx.device) for k in ("rec_kv", "rec_gb"))
            self.all_layers = (rec_kv, rec_gb)
            first = 0
            for gid, names in ctx.gdn_groups.items():
                self.per_group[gid] = (rec_kv[first:first + len(names)], rec_gb[first:first + len(names)])
                for i, n in enumerate(names, first):
                    self.per_layer[A.gdn_params(ctx.layer(n)).prefix] = (rec_kv[i], rec_gb[i])
                first += len(names)
            self.stack = _empty(planned["stack"], ctx.device)
        self.attn_scratch = _empty(planned["attn_scratch"], ctx.device) if "attn_scratch" in planned else None
        tensors = [*(self.all_layers or ()), self.stack, self.attn_scratch]
        self.nbytes = sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def records(self, rows: int, N: int):
        """({layer prefix: (rec_kv, rec_gb)}, {group: stacked [layers, rows, N, ...]}, every layer's
        (rec_kv, rec_gb) in group order) of the first rows, for trees of N <= the largest bucket's slots."""
        every = None if self.all_layers is None else tuple(_slots(t, rows, N, 1) for t in self.all_layers)
        return ({k: (_slots(kv, rows, N, 0), _slots(gb, rows, N, 0)) for k, (kv, gb) in self.per_layer.items()},
                {g: (_slots(kv, rows, N, 1), _slots(gb, rows, N, 1)) for g, (kv, gb) in self.per_group.items()},
                every)


def _slots(t: torch.Tensor, rows: int, N: int, axis: int) -> torch.Tensor:
    """t [..., R, N_max, *rest] (axis: where R is) -> [..., rows, N, *rest], each leading index's first
    rows x N entries packed: contiguous per layer, as the templates read records, at fixed addresses
    for every bucket (a smaller bucket of budget "auto"'s menu uses the front of the largest's rows)."""
    if N > t.shape[axis + 1] or rows > t.shape[axis]:
        raise ValueError(f"GDN records of {rows} rows x {N} slots do not fit the workspace's {tuple(t.shape)}")
    rest = tuple(t.shape[axis + 2:])
    inner = math.prod(rest)
    return t.as_strided(tuple(t.shape[:axis]) + (rows, N) + rest,
                        t.stride()[:axis] + (N * inner, inner) + torch.empty(rest, device="meta").stride(),
                        t.storage_offset())
