"""The round's persistent device buffers on a hybrid target, and their place in vLLM's memory plan.

vLLM sizes the KV cache (gpu_memory_utilization) from a memory profile taken before the round is
attached, so whatever the round allocates afterwards comes out of the headroom vLLM left for
itself. The big buffers are the GatedDeltaNet ones, which scale with max_num_seqs x (B + 1):

    rec_kv [layers, R, N, H*K + HV*V]  model dtype  per-node k/v of every GDN layer (replay commit)
    rec_gb [layers, R, N, 2, HV]       fp32         per-node g/beta
    stack  [R, B, HV, V, K]            fp32         the tree GDN kernel's depth stack: the state at
                                                    each depth of its walk, shared by every layer

(R = max_num_seqs, N = B + 1.) One set per engine, sized for the largest batch: a batch of R'
requests uses the first R' rows, so every CUDA graph reads the same addresses, and the graphs share
them because vLLM never replays two at once. The stack used to be allocated by the op on first use
inside each FULL graph's capture, one per batch bucket, kept by the graph pool: ~8.5 GiB on the
4B shape at 16 requests, which ran the H100 out of memory after vLLM had sized the KV cache.

`reserve` (the adapter's memory-profile hook, before vLLM measures its peak) allocates the bytes
`plan` computes, so the KV cache is sized around them; `GdnWorkspace` (the verify stage, at attach)
frees that reservation and allocates the same shapes in its place.
"""

from __future__ import annotations

import math

import torch

from ... import adapters

_RESERVE = "_ddtree_reserve"  # on the runner instance: the bytes held from profiling to attach


def gdn_shapes(p, n_layers: int, R: int, N: int, dtype) -> dict:
    """name -> (shape, dtype) of the GDN buffers for `n_layers` GDN layers of parameters `p`
    (adapters' GdnParams), R requests and trees of N slots. rec_kv / rec_gb are per KV cache
    group in GdnWorkspace; their byte total depends only on the layer count."""
    qkv = p.num_k_heads * p.head_k_dim + p.num_v_heads * p.head_v_dim
    return {"rec_kv": ((n_layers, R, N, qkv), dtype),
            "rec_gb": ((n_layers, R, N, 2, p.num_v_heads), torch.float32),
            "stack": ((R, max(N - 1, 1), p.num_v_heads, p.head_v_dim, p.head_k_dim), torch.float32)}


def nbytes(shapes: dict) -> int:
    return sum(math.prod(shape) * dtype.itemsize for shape, dtype in shapes.values())


def plan(runner, cfg) -> int:
    """Bytes of the GDN buffers the round will allocate on this engine (0: no GDN layers, or an
    engine the round will not serve; attach then logs and counts why)."""
    from .checks import UnsupportedEngine, classify_layers, validate

    view = adapters.current().RunnerView(runner)
    draft_len, _ = validate(view.vllm_config, cfg)
    try:
        gdn = classify_layers(view)["gdn"]
    except UnsupportedEngine:
        return 0
    if not gdn:
        return 0
    p = adapters.current().gdn_params(view.layer(gdn[0]))
    N = cfg.tree_spec(draft_len).budget + 1
    return nbytes(gdn_shapes(p, len(gdn), view.max_num_reqs, N, view.dtype))


def reserve(runner, cfg) -> int:
    """Hold `plan`'s bytes on the runner's device until attach (vLLM's profile counts them)."""
    size = plan(runner, cfg)
    if size and getattr(runner, _RESERVE, None) is None:
        setattr(runner, _RESERVE, torch.empty(size, dtype=torch.uint8, device=runner.device))
    return size


def release(runner) -> int:
    """Free the reservation (attach allocates the real buffers in its place); its size, 0 if none."""
    held = getattr(runner, _RESERVE, None)
    setattr(runner, _RESERVE, None)
    return 0 if held is None else held.numel()


def _empty(spec, device) -> torch.Tensor:
    shape, dtype = spec
    return torch.empty(shape, dtype=dtype, device=device)


class GdnWorkspace:
    """The GDN buffers of one engine (module docstring), allocated once at attach."""

    def __init__(self, ctx):
        A = adapters.current()
        R, N = ctx.view.max_num_reqs, ctx.N
        self.reserved = release(ctx.view.runner)
        p = A.gdn_params(ctx.layer(ctx.gdn_layers[0]))
        self.per_layer, self.per_group = {}, {}
        for gid, names in ctx.gdn_groups.items():
            shapes = gdn_shapes(p, len(names), R, N, ctx.view.dtype)
            rec_kv, rec_gb = (_empty(shapes[k], ctx.device) for k in ("rec_kv", "rec_gb"))
            self.per_group[gid] = (rec_kv, rec_gb)
            for i, n in enumerate(names):
                self.per_layer[A.gdn_params(ctx.layer(n)).prefix] = (rec_kv[i], rec_gb[i])
        self.stack = _empty(gdn_shapes(p, 1, R, N, ctx.view.dtype)["stack"], ctx.device)
        self.nbytes = sum(t.numel() * t.element_size() for kv_gb in self.per_group.values() for t in kv_gb) \
            + self.stack.numel() * self.stack.element_size()

    def records(self, rows: int):
        """({layer prefix: (rec_kv, rec_gb)}, {group: stacked [layers, rows, N, ...]}) of the first rows."""
        return ({k: (kv[:rows], gb[:rows]) for k, (kv, gb) in self.per_layer.items()},
                {g: (kv[:, :rows], gb[:, :rows]) for g, (kv, gb) in self.per_group.items()})
