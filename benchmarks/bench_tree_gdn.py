"""Tree GatedDeltaNet benchmark (Qwen3.6-27B GDN shapes): tree conv + recurrence vs the same kernels on
a chain of the same token count, snapshot vs replay (records) commit over all 48 GDN layers, bytes
written per step, and the drift of bf16/fp16 state storage vs fp32 after 256 committed rounds.

GPU:   python benchmarks/bench_tree_gdn.py --out build/tree_gdn_h100.json
       python benchmarks/bench_tree_gdn.py --sweep --shape qwen35_4b --out build/tree_gdn_sweep_4b.json
CPU:   python benchmarks/bench_tree_gdn.py --smoke   (Triton interpreter, tiny shapes: checks the script)
Times are CUDA-graph replays with a cold L2 (triton.testing.do_bench flushes it), i.e. one layer as it
runs inside a 48-layer model whose states do not stay in L2 between steps.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

# first: with --smoke it selects Triton's interpreter before torch and the templates load
from _gdn_layer import DEV, L_DRAFT, SHAPES, SMOKE, TINY, Layer, accepted, metas, side_path, timer  # isort: skip

import torch

from ddtree_compile.templates.gdn_commit import gdn_commit_triton

from _gdn_checks import drift, gpu_check


def tune(cfg, shapes):
    """Pick the recurrence (block_v, num_warps) and conv (block_d, block_t) configs on a few shapes."""
    gdn_cfgs = [dict(block_v=8, num_warps=1), dict(block_v=16, num_warps=1), dict(block_v=16, num_warps=2),
                dict(block_v=32, num_warps=4), dict(block_v=32, num_warps=2)]
    conv_cfgs = [dict(block_d=64, block_t=32), dict(block_d=128, block_t=16), dict(block_d=256, block_t=8)]
    if SMOKE:
        gdn_cfgs, conv_cfgs = gdn_cfgs[:2], conv_cfgs[:1]
    gt, ct, rows = {}, {}, []
    for R, B in shapes:
        L = Layer(cfg, R, B, seed=1)
        _, mt, _ = metas(R, B, cfg["W"], 100)
        for i, kw in enumerate(gdn_cfgs):
            for strat in ("snapshot", "records"):
                ms = timer(lambda: L.gdn(mt, strat, **kw))
                gt[i] = gt.get(i, 0.0) + math.log(ms)
                rows.append(dict(R=R, B=B, kernel="tree_gdn", strategy=strat, **kw, ms=ms))
        for i, kw in enumerate(conv_cfgs):
            ms = timer(lambda: L.conv(mt, **kw))
            ct[i] = ct.get(i, 0.0) + math.log(ms)
            rows.append(dict(R=R, B=B, kernel="tree_conv", **kw, ms=ms))
        del L
    return gdn_cfgs[min(gt, key=gt.get)], conv_cfgs[min(ct, key=ct.get)], rows


# (block_v, num_warps). 8 x 4 and 16 x 4 get vLLM's 32 x 4 reduction layouts (Triton's TTGIR; tuning.py)
SWEEP_CFGS = [(8, 1), (16, 1), (16, 2), (32, 1), (32, 2), (32, 4), (64, 4), (64, 8), (16, 4), (8, 4)]
SPLIT_CFGS = [(32, 4, 4), (16, 4, 2), (16, 4, 4), (16, 4, 8), (16, 1, 2), (16, 1, 4), (16, 1, 8)]  # at R <= 8


def sweep(cfg, Rs, Bs):
    """The recurrence's launch configs on every (R, B) bucket, the product's strategy (records): tiles
    (block_v x num_warps) everywhere, split walks (x splits) where R <= 8."""
    rows = []
    for R in Rs:
        for B in Bs:
            L = Layer(cfg, R, B, seed=3)
            _, mt, _ = metas(R, B, cfg["W"], 100)
            cfgs = [(bv, nw, 1) for bv, nw in SWEEP_CFGS] + (SPLIT_CFGS if R <= 8 else [])
            t = {}
            for bv, nw, sp in cfgs[:2] + cfgs[-1:] if SMOKE else cfgs:
                name = f"{bv}x{nw}" + (f"x{sp}" if sp > 1 else "")
                t[name] = round(timer(lambda: L.gdn(mt, "records", block_v=bv, num_warps=nw, splits=sp)), 5)
            best = min(t, key=t.get)
            rows.append(dict(R=R, B=B, max_depth=int(mt.walk[..., 2].max()), ms=t, best=best,
                             best_vs_32x4=round(t[best] / t.get("32x4", t[best]), 3)))
            print(json.dumps(rows[-1]), flush=True)
            L = None  # free the layer's buffers before the next bucket's
    return rows


def bytes_per_layer(cfg, R, N, tree, state_bytes):
    H, HV, K, V, W = cfg["H"], cfg["HV"], cfg["K"], cfg["V"], cfg["W"]
    D, st = 2 * H * K + HV * V, HV * V * K
    live = sum(1 for p in tree for i, q in enumerate(p) if i == 0 or q >= 0)
    saves = sum(sum(1 for i in range(N) if sum(1 for q in p if q == i) >= 2) for p in tree)
    common = R * N * D * 2 + R * (W - 2 + N) * D * 2 + R * N * HV * V * 2 + saves * st * 4  # conv out, line, out, stack
    rec = live * ((H * K + HV * V) * 2 + 2 * HV * 4)
    return dict(verify_snapshot=common + live * st * state_bytes, verify_records=common + rec,
                commit_snapshot=R * (W - 1) * D * 2, commit_replay=R * (st * state_bytes + (W - 1) * D * 2),
                stack_saves=saves)


def bench_shape(cfg, R, B, gdn_kw, conv_kw, fla):
    N, W, nl = B + 1, cfg["W"], cfg["layers"]
    tree, mt, mc = metas(R, B, W, 100)
    L = Layer(cfg, R, B, seed=2)
    t = {}
    for name, meta in (("tree", mt), ("chain", mc)):
        t[f"conv_{name}"] = timer(lambda: L.conv(meta, **conv_kw))
        for strat in ("snapshot", "records"):
            t[f"gdn_{strat}_{name}"] = timer(lambda: L.gdn(meta, strat, **gdn_kw))
    rec = dict(R=R, B=B, N=N, tokens=R * N, max_depth=int(mt.walk[..., 2].max()),
               times_ms={k: round(v, 4) for k, v in t.items()})
    ratios = {}
    for strat in ("snapshot", "records"):
        ratios[f"tree_vs_chain_{strat}"] = (t["conv_tree"] + t[f"gdn_{strat}_tree"]) / (
            t["conv_chain"] + t[f"gdn_{strat}_chain"])
    rec["us_per_token_records_tree"] = round(1e3 * t["gdn_records_tree"] / N, 3)
    if fla is not None:
        try:
            t_fla = fla_chain(cfg, L, fla)
            rec["times_ms"].update(t_fla)
            ratios.update({f"records_tree_vs_{k}": t["gdn_records_tree"] / v for k, v in t_fla.items()})
        except Exception as e:  # noqa: BLE001 - report, do not abort the run
            rec["fla_error"] = repr(e)[:300]
    del L
    rec["ratios"] = {k: round(v, 3) for k, v in ratios.items()}
    # Commit for all GDN layers: replay (records) vs snapshot (the snapshot strategy only moves conv windows).
    H, HV, K, V = cfg["H"], cfg["HV"], cfg["K"], cfg["V"]
    D = 2 * H * K + HV * V
    convs = [torch.randn(R + 1, W - 2 + N, D, device=DEV).to(torch.bfloat16).transpose(1, 2) for _ in range(nl)]
    ssms = [torch.randn(R + 1, HV, V, K, device=DEV) * 0.1 for _ in range(nl)]
    rec_kv = torch.randn(nl, R, N, H * K + HV * V, device=DEV).to(torch.bfloat16)
    rec_gb = torch.rand(nl, R, N, 2, HV, device=DEV)
    si1 = (1 + torch.arange(R, device=DEV, dtype=torch.int32)).view(R, 1)
    paths = [side_path(p) for p in tree.tolist()]
    acc, plen = accepted(paths)
    na = torch.ones(R, dtype=torch.int32, device=DEV)
    t_rep = timer(lambda: gdn_commit_triton(convs, ssms, si1, na, acc, plen, rec_kv, rec_gb, W))
    t_snap = timer(lambda: gdn_commit_triton(convs, ssms, si1, na, acc, plen, None, None, W))
    rec["commit_all_layers_ms"] = dict(snapshot=round(t_snap, 4), replay=round(t_rep, 4),
                                       mean_path_len=round(sum(map(len, paths)) / R, 2))
    del convs, ssms, rec_kv
    by = bytes_per_layer(cfg, R, N, tree.tolist(), 4)
    by16 = bytes_per_layer(cfg, R, N, tree.tolist(), 2)
    st = HV * V * K
    rec["bytes_written_per_step_all_layers"] = {
        "snapshot_fp32": nl * (by["verify_snapshot"] + by["commit_snapshot"]),
        "snapshot_bf16": nl * (by16["verify_snapshot"] + by16["commit_snapshot"]),
        "replay_fp32": nl * (by["verify_records"] + by["commit_replay"]),
        "stack_saves_per_layer": by["stack_saves"]}
    rec["state_memory_per_request_all_layers"] = {
        "snapshot_fp32_lines": nl * N * st * 4,  # N persistent lines per request
        "replay_fp32_line": nl * st * 4,  # one persistent line, independent of B
        "replay_records": nl * N * ((H * K + HV * V) * 2 + 2 * HV * 4),  # transient, per step
        "stack_shared_by_layers": L_DRAFT * st * 4}  # transient, depends on depth only
    return rec


def fla_chain(cfg, L, fla):
    """flash-linear-attention chain kernels on the same tokens (R sequences of N), same gating."""
    H, HV, K, V = cfg["H"], cfg["HV"], cfg["K"], cfg["V"]
    R, N = L.R, L.N
    q = L.y[:, : H * K].reshape(R, N, H, K).contiguous()
    k = L.y[:, H * K: 2 * H * K].reshape(R, N, H, K).contiguous()
    v = L.y[:, 2 * H * K:].reshape(R, N, HV, V).contiguous()
    a, b = L.a.view(R, N, HV).contiguous(), L.b.view(R, N, HV).contiguous()
    h0 = L.ssm[1: R + 1].contiguous()
    res = {}
    with torch.no_grad():
        def run():
            return fla["rec"](q, k, v, g=a, beta=b, scale=K ** -0.5, initial_state=h0, output_final_state=True,
                              use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=L.A_log, dt_bias=L.dt,
                              use_beta_sigmoid_in_kernel=True, state_v_first=True)
        try:
            res["fla_fused_recurrent_chain"] = timer(run)
        except Exception:  # noqa: BLE001 - not capturable: time it eagerly (launch overhead included)
            res["fla_fused_recurrent_chain_eager"] = timer(run, graph=False)
    return {k2: round(v2, 4) for k2, v2 in res.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="build/tree_gdn_h100.json")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--rounds", type=int, default=256)
    ap.add_argument("--sweep", action="store_true", help="only the recurrence's launch configs on every bucket")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen36_27b")
    args = ap.parse_args()
    cfg = TINY if SMOKE else SHAPES[args.shape]
    if args.sweep:
        Rs, Bs = ([1, 2], [4]) if SMOKE else ([1, 2, 4, 8, 16, 32], [8, 16, 32, 64])
        doc = dict(command="python benchmarks/bench_tree_gdn.py " + " ".join(sys.argv[1:]), shape=cfg,
                   device=torch.cuda.get_device_name() if not SMOKE else "cpu-interpreter", torch=torch.__version__,
                   sweep=sweep(cfg, Rs, Bs))
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
        return
    Bs, Rs = ([4, 6], [1, 2]) if SMOKE else ([16, 22, 32, 64], [1, 8, 32])
    fla = None
    if not args.no_fla and not SMOKE:
        try:
            from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
            fla = dict(rec=fused_recurrent_gated_delta_rule)
        except Exception as e:  # noqa: BLE001
            print("fla unavailable:", repr(e)[:200])
    t0 = time.time()
    check = gpu_check(cfg, R=2, B=4 if SMOKE else 22)
    print("gpu_check", json.dumps(check), flush=True)
    tune_shapes = [(1, Bs[-1]), (Rs[-1], Bs[-1])] if not SMOKE else [(1, 4)]
    gdn_kw, conv_kw, tuning = tune(cfg, tune_shapes)
    print("chosen", gdn_kw, conv_kw, f"{time.time() - t0:.0f}s", flush=True)
    records = []
    for R in Rs:
        for B in Bs:
            rec = bench_shape(cfg, R, B, gdn_kw, conv_kw, fla)
            rec["device"] = torch.cuda.get_device_name() if not SMOKE else "cpu-interpreter"
            rec["shape"] = dict(cfg, R=R, B=B)
            records.append(rec)
            print(json.dumps(rec), flush=True)
            if not SMOKE:
                torch.cuda.empty_cache()
    dr = drift(cfg, 4 if SMOKE else args.rounds, B=4 if SMOKE else 16, R=1 if SMOKE else 2)
    print(json.dumps(dr), flush=True)
    doc = dict(command="python benchmarks/bench_tree_gdn.py " + " ".join(sys.argv[1:]),
               device=records[0]["device"], torch=torch.__version__, kernel_configs=dict(gdn=gdn_kw, conv=conv_kw),
               gpu_check=check, tuning=tuning, records=records, drift=dr, wall_s=round(time.time() - t0, 1))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"\n{'R':>3} {'B':>3} {'conv t/c':>9} {'snap t/c':>9} {'rec t/c':>9} {'gdnrec ms':>9} "
          f"{'ratio':>6} {'cmt snap':>8} {'cmt rep':>8} {'fla ms':>7}")
    for r in records:
        t, c = r["times_ms"], r["commit_all_layers_ms"]
        print(f"{r['R']:>3} {r['B']:>3} {t['conv_tree']:>4.3f}/{t['conv_chain']:<4.3f} "
              f"{t['gdn_snapshot_tree']:>4.3f}/{t['gdn_snapshot_chain']:<4.3f} "
              f"{t['gdn_records_tree']:>4.3f}/{t['gdn_records_chain']:<4.3f} {t['gdn_records_tree']:>9.4f} "
              f"{r['ratios']['tree_vs_chain_records']:>6.3f} {c['snapshot']:>8.4f} {c['replay']:>8.4f} "
              f"{t.get('fla_fused_recurrent_chain', float('nan')):>7.4f}")


if __name__ == "__main__":
    main()
