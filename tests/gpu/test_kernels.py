"""DDTree's kernels on the GPU, compiled (no interpreter), against their references. No engine.

Tree attention (benchmarks/_attn_checks.py, bench_tree_attention's checks): the Triton kernel against
the float32 reference over windows, soft caps, split-KV counts, GQA, head sizes 64-256, fp16 and an FP8
KV cache (the query FP8 too, as vLLM hands it over); on an FP8 cache no farther from the reference
than vLLM's own FA3 FP8 path; a chain equal to causal FlashAttention and a tree to dense-mask SDPA; the
CUDA op dispatching to Triton and replaying in a CUDA graph, the direct launcher equal to Triton's own
launch; the K/V compaction equal to its reference; long context at `vllm serve` case 9's shapes
(split-KV plan of the engine, a CUDA graph captured at a short context then replayed, vLLM's FA3 as
the yardstick). GatedDeltaNet (benchmarks/_gdn_checks.py): tree conv1d, tree GDN (snapshot and
records strategies) and the commit against their torch references at Qwen3.6-27B's head shapes; at the
4B shape a split walk equal to one part bit for bit, every tile equal to vLLM's. The
tree build at the 4B shape: after its warm-up's batch sizes, no batch of 1-64 requests compiles a
Triton kernel (issue 27).
"""

from __future__ import annotations

import pathlib
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def attn(gpu_env):
    """benchmarks/_attn_checks.py (its helpers import by name from benchmarks/)."""
    sys.path.insert(0, str(BENCHMARKS))
    import _attn_checks

    yield _attn_checks
    sys.path.remove(str(BENCHMARKS))


def _run(check, record, **kw) -> list[dict]:
    results: list[dict] = []
    check(results, **kw)
    # the per-token lists of the long-context records stay out of the evidence: max and mean say it
    record(results=[{k: ({m: x for m, x in v.items() if m != "per_token_max"} if isinstance(v, dict) else v)
                     for k, v in r.items()} for r in results])
    return results


def test_tree_attention_against_the_float32_reference(attn, record):
    results = _run(attn.check_against_reference, record)
    assert len(results) == len(attn.REF_CASES)
    bad = [r for r in results if not r["ok"] or r["nan"]]
    assert not bad, bad


def test_fp8_tree_attention_no_farther_than_vllm_fa3(attn, record):
    bad = [r for r in _run(attn.check_fp8_against_vllm_fa3, record) if not r["ok"]]
    assert not bad, bad


def test_chain_is_causal_attention_and_tree_is_dense_mask_attention(attn, record):
    bad = [r for r in _run(attn.check_causal_and_dense, record) if not r["ok"]]
    assert not bad, bad


def test_op_dispatch_cuda_graph_replay_and_kv_compaction(attn, record):
    results = _run(attn.check_op_graph_and_compact, record)
    assert {r["check"] for r in results} >= {"op_dispatch_and_cuda_graph_replay", "kv_compact_vs_reference"}
    bad = [r for r in results if not r["ok"]]
    assert not bad, bad


def test_long_context_at_serve_case9_shapes(attn, record):
    results = _run(attn.check_long_context, record)
    assert results and all("fa3_vs_ref" in r for r in results), [r.get("fa3_error") for r in results]
    bad = [(r["B"], r["tree"], r["ctx"], r["triton_vs_ref"]["max"], r.get("fa3_vs_ref", {}).get("max"))
           for r in results if not r["ok"]]
    assert not bad, bad


@pytest.fixture(scope="module")
def gdn(gpu_env):
    sys.path.insert(0, str(BENCHMARKS))
    import _gdn_checks
    import _gdn_layer

    yield _gdn_checks, _gdn_layer
    sys.path.remove(str(BENCHMARKS))


# Max abs error allowed per output: the conv output follows vLLM's bf16 arithmetic (each product rounded
# to bf16) where the reference sums in fp32: an ulp of bf16 at the outputs' magnitude; the GDN output
# and state are fp32 sums in another order; the conv window and num_accepted are copies: exact.
GDN_TOL = {"conv_out": 0.0625, "gdn_out": 1e-2, "ssm_state": 1e-3, "conv_state": 0.0, "num_accepted": 0.0}


def test_gdn_templates_and_commit_against_their_references(gdn, record):
    checks, layer = gdn
    err = checks.gpu_check(layer.QWEN36, R=2, B=22)
    record(**err)
    bad = {k: v for k, v in err.items()
           if v > GDN_TOL[k.removeprefix("snapshot_").removeprefix("records_").removesuffix("_max_abs")]}
    assert not bad, bad


@pytest.mark.parametrize("tiles", ["32x4", "16x1", "16x4", "8x4"])
def test_split_walk_and_tiles_on_the_4b_shape(gdn, record, tiles):
    """The tree recurrence compiled at the 4B GDN shape, records strategy, R = 1 and 2 requests of a 33-slot
    DDTree-shaped tree: a walk split in 2, 4 and 8 parts (templates/tree_gdn.py) gives the one-part
    kernel's outputs and records bit for bit; every tile gives vLLM's tile's (32 rows on 4 warps) bit for bit
    (a tile off 4 warps through the q / k norm pre-pass: the tile plans of templates/tuning.py need not
    cost vLLM's arithmetic); the one-part run against the float32 reference."""
    import torch

    from ddtree_compile.templates.tree_gdn import norms_apart
    from ddtree_compile.templates.tree_gdn_ref import tree_gdn_ref

    checks, layer = gdn
    bv, nw = (int(x) for x in tiles.split("x"))
    cfg, H, K = layer.QWEN35_4B, layer.QWEN35_4B["H"], layer.QWEN35_4B["K"]
    err = {}
    for R in (1, 2):
        L = layer.Layer(cfg, R, 32, seed=4)
        _, mt, _ = layer.metas(R, 32, cfg["W"], 5)
        L.conv(mt)  # the recurrence's input
        L.gdn(mt, "records", block_v=32, num_warps=4, splits=1)
        vllm_tile = (L.out.clone(), L.rec_kv.clone(), L.rec_gb.clone())
        L.out.zero_(), L.rec_kv.zero_(), L.rec_gb.zero_()
        L.gdn(mt, "records", block_v=bv, num_warps=nw, splits=1)
        one = (L.out.clone(), L.rec_kv.clone(), L.rec_gb.clone())
        err[f"R{R}_out_max_abs_vs_vllm_tile"] = (one[0].float() - vllm_tile[0].float()).abs().max().item()
        for sp in (2, 4, 8):
            L.out.zero_(), L.rec_kv.zero_(), L.rec_gb.zero_()
            L.gdn(mt, "records", block_v=bv, num_warps=nw, splits=sp)
            torch.cuda.synchronize()
            assert all(torch.equal(x, y) for x, y in zip((L.out, L.rec_kv, L.rec_gb), one)), (R, sp)
        out = torch.empty_like(L.out)
        tree_gdn_ref(L.y, L.a, L.b, L.A_log, L.dt, L.ssm, L.si1, L.na, mt.walk, L.stack, out, None, None, H, K,
                     K ** -0.5, False)
        err[f"R{R}_out_max_abs_vs_ref"] = (one[0].float() - out.float()).abs().max().item()
        err[f"R{R}_max_depth"] = int(mt.walk[..., 2].max())
        assert all(torch.equal(x, y) for x, y in zip(one, vllm_tile)), (R, err)
    record(tiles=tiles, norm_prepass=norms_apart(nw), **err)
    assert all(v <= GDN_TOL["gdn_out"] for k, v in err.items() if k.endswith("vs_ref")), err


def test_tree_build_compiles_nothing_after_its_warm_up(gpu_env, record):
    """The tree build at the 4B shape (vocabulary 151936, L 15, budget 32, top_k 8, bf16 logits): the
    warm-up's batch sizes (one per top-k launch variant, as BuildStage._warm_up runs them), then every
    batch of 1..64 requests must compile nothing more."""
    import torch
    from triton import knobs

    import ddtree_compile as dd
    from ddtree_compile.templates.draft_topk import variant_batches

    compiles: list[str] = []
    old = knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_post_compile_hook = lambda *a, **kw: compiles.append(str(getattr(kw.get("fn"), "__name__", "?")))
    try:
        dev, spec, L, vocab = torch.device("cuda"), dd.TreeSpec(budget=32, top_k=8), 15, 151936
        buf = torch.zeros(64, L, vocab, dtype=torch.bfloat16, device=dev)
        sizes = variant_batches(64, spec.depth_limit(L), vocab, dev)
        for r in sizes:
            dd.build_tree(buf[:r], spec)
        torch.cuda.synchronize()
        warm = len(compiles)
        for R in range(1, 65):
            dd.build_tree(buf[:R], spec)
        torch.cuda.synchronize()
    finally:
        knobs.runtime.jit_post_compile_hook = old
    record(warm_batches=sizes, warm_compiles=warm, sweep_compiles=len(compiles) - warm)
    assert len(compiles) == warm, compiles[warm:]


def test_gdn_resume_against_its_reference(gpu_env, record):
    """templates/gdn_resume.py compiled on CUDA against gdn_resume_ref at the 4B GDN shape (bf16 conv
    lines [lines, 8192, W - 1 + 15] stored (state_len, dim), fp32 SSM lines [lines, 32, 128, 128]), three
    layers, rows whose states sit at columns 1, 2, 15 (and 0: nothing moves): equal bit for bit."""
    import torch

    from ddtree_compile.templates.gdn_resume import gdn_resume_triton
    from ddtree_compile.templates.gdn_resume_ref import gdn_resume_ref

    g, dev, W, NS, lines = torch.Generator(device="cuda").manual_seed(0), "cuda", 4, 16, 70
    conv = [torch.randn(lines, W - 1 + 15, 8192, generator=g, device=dev).to(torch.bfloat16).transpose(1, 2)
            for _ in range(3)]
    ssm = [torch.randn(lines, 32, 128, 128, generator=g, device=dev) for _ in range(3)]
    si = (1 + torch.randperm(lines - 1, generator=g, device=dev)[: 4 * NS]).view(4, NS).to(torch.int32)
    nacc = torch.tensor([2, 3, 16, 1], dtype=torch.int32, device=dev)
    rows = torch.arange(4, dtype=torch.int32, device=dev)
    ref_c, ref_s = [c.clone() for c in conv], [s.clone() for s in ssm]  # (clone keeps the strides)
    before = conv[0].clone()
    gdn_resume_ref(ref_c, ref_s, si, nacc, rows, W)
    gdn_resume_triton(conv, ssm, si, nacc, rows, W)
    torch.cuda.synchronize()
    diff = [int((a != b).sum()) for a, b in zip(conv + ssm, ref_c + ref_s)]
    moved = int((conv[0] != before).sum())
    record(elements_differing=sum(diff), conv_elements_moved_layer0=moved)
    assert moved > 0 and sum(diff) == 0, diff
