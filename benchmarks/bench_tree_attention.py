"""Tree attention on the GPU: correctness checks, a tile sweep, and the ratio table.

    python3 benchmarks/bench_tree_attention.py [--sweep | --lowr-sweep] --out results.json

--sweep: tile/waves sweep (f078ad5) before the table. --lowr-sweep: checks plus the per-bucket plan sweep at
low request counts / short contexts (row tile x split count, graph replays), no table.

Compares, at the same number of query tokens (R requests x N = B+1 tokens, context C):
  tree    ddtree tree attention over the paged cache (random DDTree-shaped trees, block size 16)
  causal  FlashAttention through torch (aten._scaled_dot_product_flash_attention, bottom-right causal,
          native GQA) over contiguous K/V: the chain verify of the same width
  dense   SDPA (memory-efficient backend) with a dense additive [R, 1, N, C+N] mask, what slow ports did
Times are triton.testing.do_bench medians (L2 flushed before each call); the launcher is called directly
(no op dispatch; after a bucket's first call it launches through Triton's compiled launcher, see
tree_attention.py). `graph` columns time CUDA-graph replays (do_bench_cudagraph medians), as in vLLM.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import triton

from ddtree_compile.templates import launch, tuning

from _attn_checks import (check_against_reference, check_causal_and_dense, check_fp8_against_vllm_fa3,
                          check_op_graph_and_compact)
from _attn_common import (BLOCK_SIZE, BUDGETS, CONTEXTS, DEV, MODELS, REQUESTS, bench, causal_fa, dense_bias,
                          dense_gqa_supported, dense_group, dense_sdpa, fa_gqa_supported, kernel_info, log,
                          make_tiles, setup_group, time_tree)
from _attn_sweeps import run_lowr_sweep, run_sweep


def run_table(doc, chosen, deadline, out_path):
    g = torch.Generator().manual_seed(4)
    for model, (Hq, Hkv, D) in MODELS.items():
        tiles, waves = None, None
        if D in chosen:
            tiles, waves = make_tiles(chosen[D]["tiles"]), chosen[D]["waves"]
        for R in REQUESTS:
            for C in CONTEXTS:
                if time.time() > deadline:
                    log("deadline reached: table incomplete")
                    return
                grp = setup_group(model, R, C, g)
                dense_group(grp, model)
                for B in BUDGETS:
                    N = B + 1
                    rec = dict(model=model, Hq=Hq, Hkv=Hkv, D=D, R=R, ctx=C, B=B, N=N, tokens=R * N,
                               block_size=BLOCK_SIZE, dtype="bfloat16")
                    tree_ms, plan, (anc, q), _ = time_tree(grp, model, R, C, B, g, tiles, waves)
                    splits = plan["splits"]
                    qt = q.view(R, N, Hq, D).transpose(1, 2)
                    k, v = grp["k"][:, :, :C + N], grp["v"][:, :, :C + N]
                    if not fa_gqa_supported():  # FA gets the pre-expanded heads (expansion untimed)
                        k, v = grp["kx"][:, :, :C + N], grp["vx"][:, :, :C + N]
                    causal_ms = bench(lambda: causal_fa(qt, k, v, D ** -0.5))
                    bias = dense_bias(anc, C, q.dtype)
                    dense_ms = None
                    if grp["kx"] is not None:
                        kx, vx = grp["kx"][:, :, :C + N], grp["vx"][:, :, :C + N]
                        try:
                            dense_ms = bench(lambda: dense_sdpa(qt, kx, vx, bias, D ** -0.5))
                        except torch.OutOfMemoryError:
                            pass
                    torch.cuda.empty_cache()
                    tree_g, _, _, _ = time_tree(grp, model, R, C, B, g, tiles, waves, graph=True)
                    causal_g = bench(lambda: causal_fa(qt, k, v, D ** -0.5), graph=True)
                    rec.update(tiles=list(chosen[D]["tiles"]) if D in chosen else "tuning default",
                               waves=waves, splits=splits, plan=plan, tree_ms=tree_ms, causal_fa_ms=causal_ms,
                               dense_mask_ms=dense_ms,
                               dense_variant="efficient+enable_gqa" if dense_gqa_supported()
                               else "efficient+expanded_kv (pre-expanded, untimed)",
                               tree_speed_vs_causal=causal_ms / tree_ms,
                               tree_speed_vs_dense=(dense_ms / tree_ms) if dense_ms else None,
                               graph_tree_ms=tree_g, graph_causal_fa_ms=causal_g,
                               graph_tree_speed_vs_causal=causal_g / tree_g,
                               fa_variant="native GQA" if fa_gqa_supported() else "expanded K/V (untimed)")
                    doc["records"].append(rec)
                    log(f"{model:15s} R={R:2d} C={C:5d} B={B:2d} S={splits:2d} tree {tree_ms * 1e3:8.1f}us "
                        f"causal {causal_ms * 1e3:8.1f}us dense {(dense_ms or 0) * 1e3:9.1f}us "
                        f"x{causal_ms / tree_ms:5.2f} vs causal, x{(dense_ms or 0) / tree_ms:6.2f} vs dense | "
                        f"graph x{causal_g / tree_g:5.2f}")
                del grp
                torch.cuda.empty_cache()
                json.dump(doc, open(out_path, "w"), indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--sweep", action="store_true", help="sweep tiles/waves first and use the best in the table")
    ap.add_argument("--lowr-sweep", action="store_true",
                    help="only the checks and the low-R / short-context plan sweep (no ratio table)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop timing after this many seconds")
    args = ap.parse_args()
    t0 = time.time()
    deadline = t0 + args.budget_s
    props = torch.cuda.get_device_properties(0)
    doc = dict(
        command="python3 " + " ".join(sys.argv),
        device=dict(name=props.name, capability=list(torch.cuda.get_device_capability(0)),
                    sms=props.multi_processor_count, torch=torch.__version__, triton=triton.__version__),
        arch_table=tuning.arch_of(DEV)[0], table_measured=tuning.is_measured(tuning.arch_of(DEV)[0]),
        checks=[], sweep_checks=[], sweep=[], records=[])
    for check in (check_against_reference, check_fp8_against_vllm_fa3, check_causal_and_dense,
                  check_op_graph_and_compact):
        try:
            check(doc["checks"])
        except Exception as e:  # noqa: BLE001  recorded as a failed check; timing still runs
            doc["checks"].append(dict(check=check.__name__, ok=False, error=repr(e)[:2000]))
            log(f"check {check.__name__} FAILED: {e!r}"[:2000])
    doc["fast_launch"] = dict(enabled=launch.FAST.enabled, error=launch.FAST.error)
    json.dump(doc, open(args.out, "w"), indent=1)
    if args.lowr_sweep:
        run_lowr_sweep(doc, deadline, args.out)
        doc["kernels"] = kernel_info()
        doc["elapsed_s"] = time.time() - t0
        json.dump(doc, open(args.out, "w"), indent=1)
        log("checks: " + ", ".join(f"{c['check']}={'ok' if c['ok'] else 'FAIL'}" for c in doc["checks"]))
        log(f"elapsed {doc['elapsed_s']:.0f}s")
        return
    chosen = run_sweep(doc, t0 + args.budget_s * 0.55) if args.sweep else {}
    json.dump(doc, open(args.out, "w"), indent=1)
    run_table(doc, chosen, deadline, args.out)
    doc["elapsed_s"] = time.time() - t0
    json.dump(doc, open(args.out, "w"), indent=1)

    log("\nchecks: " + ", ".join(f"{c['check']}={'ok' if c['ok'] else 'FAIL'}" for c in doc["checks"]))
    log(f"{'model':15s} {'R':>2s} {'ctx':>5s} {'B':>2s} {'tree_us':>8s} {'fa_us':>8s} {'dense_us':>9s} "
        f"{'vsFA':>5s} {'vsDense':>7s} {'graph_vsFA':>10s}")
    for r in doc["records"]:
        log(f"{r['model']:15s} {r['R']:2d} {r['ctx']:5d} {r['B']:2d} {r['tree_ms'] * 1e3:8.1f} "
            f"{r['causal_fa_ms'] * 1e3:8.1f} {(r['dense_mask_ms'] or 0) * 1e3:9.1f} {r['tree_speed_vs_causal']:5.2f} "
            f"{(r['tree_speed_vs_dense'] or 0):7.2f} {r['graph_tree_speed_vs_causal']:10.2f}")
    miss_fa = [r for r in doc["records"] if r["tree_speed_vs_causal"] < 0.8]
    miss_dense = [r for r in doc["records"] if (r["tree_speed_vs_dense"] or 0) <= 1.0]
    log(f"records {len(doc['records'])}, below 0.8x FA: {len(miss_fa)}, not faster than dense: {len(miss_dense)}, "
        f"elapsed {doc['elapsed_s']:.0f}s")


if __name__ == "__main__":
    main()
