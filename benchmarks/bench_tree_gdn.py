"""Tree GatedDeltaNet benchmark (Qwen3.6-27B GDN shapes): tree conv + recurrence vs the same kernels on
a chain of the same token count, snapshot vs replay (records) commit over all 48 GDN layers, bytes
written per step, and the drift of bf16/fp16 state storage vs fp32 after 256 committed rounds.

GPU:   python benchmarks/bench_tree_gdn.py --out benchmarks/results/tree_gdn_h100.json
CPU:   python benchmarks/bench_tree_gdn.py --smoke   (Triton interpreter, tiny shapes: checks the script)
Times are CUDA-graph replays with a cold L2 (triton.testing.do_bench flushes it), i.e. one layer as it
runs inside a 48-layer model whose states do not stay in L2 between steps.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import os
import sys
import time

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from ddtree_compile.templates.gdn_commit import gdn_commit_triton  # noqa: E402
from ddtree_compile.templates.gdn_meta import build_gdn_meta  # noqa: E402
from ddtree_compile.templates.tree_conv import tree_conv1d_triton  # noqa: E402
from ddtree_compile.templates.tree_gdn import tree_gdn_triton  # noqa: E402

QWEN36 = dict(H=16, HV=48, K=128, V=128, W=4, layers=48)  # Qwen3.6-27B: 48 of its 64 layers are GDN
TINY = dict(H=2, HV=4, K=16, V=16, W=4, layers=3)
L_DRAFT = 15  # DFlash block 16 -> tree depth <= 15
DEV = "cpu" if SMOKE else "cuda"


def ddtree_parents(B: int, seed: int, L: int = L_DRAFT, topk: int = 8) -> list[int]:
    """A DDTree-shaped tree: best-first over per-depth top-k draft log-probs (heap-pop slot order)."""
    g = torch.Generator().manual_seed(seed)
    lp = torch.log_softmax(torch.randn(L + 1, topk, generator=g) * 2.5, -1).sort(-1, descending=True).values
    lp = lp.tolist()
    parents, heap = [-1], [(-lp[1][0], 1, 0, 0)]
    while len(parents) <= B and heap:
        neg, d, par, rank = heapq.heappop(heap)
        slot = len(parents)
        parents.append(par)
        if d < L:
            heapq.heappush(heap, (neg - lp[d + 1][0], d + 1, slot, 0))
        if rank + 1 < topk:
            heapq.heappush(heap, (neg + lp[d][rank] - lp[d][rank + 1], d, par, rank + 1))
    return parents


def path_to(parents, s):
    p = [s]
    while parents[p[-1]] >= 0:
        p.append(parents[p[-1]])
    return p[::-1]


def side_path(parents, depth=7):
    """An accepted path of about `depth` that leaves the main chain (the conv window must move)."""
    best = None
    for s in range(len(parents) - 1, 0, -1):
        p = path_to(parents, s)
        if p != list(range(len(p))) and (best is None or abs(len(p) - 1 - depth) < abs(len(best) - 1 - depth)):
            best = p
    return best or list(range(min(depth + 1, len(parents))))


def timer(fn, graph: bool = True) -> float:
    """ms per call: CUDA-graph replay under do_bench (cold L2). CPU smoke: one wall-clock call."""
    if SMOKE:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    import triton.testing
    fn()
    torch.cuda.synchronize()
    if not graph:
        return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return triton.testing.do_bench(g.replay, warmup=10, rep=60, return_mode="median")


class Layer:
    """One GDN layer's inputs and caches for R requests of N = B + 1 slots."""

    def __init__(self, cfg, R, B, seed, state_dtype=torch.float32, snapshot_lines=True):
        H, HV, K, V, W = cfg["H"], cfg["HV"], cfg["K"], cfg["V"], cfg["W"]
        self.cfg, self.R, self.N = cfg, R, B + 1
        N, D = self.N, 2 * H * K + HV * V
        g = torch.Generator(device=DEV).manual_seed(seed)

        def rn(*shape, dtype=torch.bfloat16, scale=1.0):
            return (torch.randn(*shape, generator=g, device=DEV) * scale).to(dtype)

        self.x = rn(R * N, D)
        self.w = rn(D, W, scale=0.5)
        self.a, self.b = rn(R * N, HV), rn(R * N, HV)
        self.A_log = torch.log(torch.rand(HV, generator=g, device=DEV) * 15 + 1)
        self.dt = torch.log(torch.expm1(torch.rand(HV, generator=g, device=DEV) * 0.099 + 0.001))
        lines = 1 + R * N if snapshot_lines else 1 + R
        self.conv_state = rn(lines, W - 2 + N, D).transpose(1, 2)  # vLLM SD layout, seen as [lines, D, SL]
        self.ssm = rn(lines, HV, V, K, dtype=state_dtype, scale=0.1)
        self.si = (1 + torch.arange(R * N, device=DEV, dtype=torch.int32)).view(R, N)
        self.si1 = (1 + torch.arange(R, device=DEV, dtype=torch.int32)).view(R, 1)
        self.na = torch.ones(R, device=DEV, dtype=torch.int32)
        self.y = torch.empty_like(self.x)
        self.out = torch.empty(R * N, HV, V, device=DEV, dtype=torch.bfloat16)
        self.stack = torch.empty(R, L_DRAFT, HV, V, K, device=DEV)
        self.rec_kv = torch.empty(R, N, H * K + HV * V, device=DEV, dtype=torch.bfloat16)
        self.rec_gb = torch.empty(R, N, 2, HV, device=DEV)

    def conv(self, meta, strategy="records", **kw):
        si = self.si if strategy == "snapshot" else self.si1  # conv line = column 0, as in vLLM
        tree_conv1d_triton(self.x, self.w, None, self.conv_state, si, self.na, meta.conv_anc, self.y, True, **kw)

    def gdn(self, meta, strategy, **kw):
        c = self.cfg
        snap = strategy == "snapshot"
        tree_gdn_triton(self.y, self.a, self.b, self.A_log, self.dt, self.ssm, self.si if snap else self.si1,
                        self.na, meta.walk, self.stack, self.out, None if snap else self.rec_kv,
                        None if snap else self.rec_gb, c["H"], c["K"], c["K"] ** -0.5, snap, **kw)


def metas(R, B, W, seed):
    N = B + 1
    tree = torch.tensor([ddtree_parents(B, seed + r) for r in range(R)], device=DEV)
    chain = torch.tensor([[-1] + list(range(N - 1))] * R, device=DEV)
    return tree, build_gdn_meta(tree, W, L_DRAFT), build_gdn_meta(chain, W, N - 1)


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
    acc = torch.full((R, L_DRAFT + 1), -1, dtype=torch.int32)
    for r, p in enumerate(paths):
        acc[r, : len(p)] = torch.tensor(p, dtype=torch.int32)
    acc = acc.to(DEV)
    plen = torch.tensor([len(p) for p in paths], dtype=torch.int32, device=DEV)
    na = torch.ones(R, dtype=torch.int32, device=DEV)
    t_rep = timer(lambda: gdn_commit_triton(convs, ssms, si1, na, acc, plen, rec_kv, rec_gb, W))
    t_snap = timer(lambda: gdn_commit_triton(convs, [], si1, na, acc, plen, None, None, W))
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


def drift(cfg, rounds, B=16, R=2):
    """Committed-state drift of bf16/fp16 storage vs fp32 after `rounds` verify+commit rounds."""
    H, HV, K, V, W = cfg["H"], cfg["HV"], cfg["K"], cfg["V"], cfg["W"]
    N = B + 1
    runs = {}
    gen = torch.Generator().manual_seed(5)
    plan = []
    for rd in range(rounds):
        tree = [ddtree_parents(B, 1000 * rd + r) for r in range(R)]
        ends = [int(torch.randint(0, N, (1,), generator=gen)) for _ in range(R)]
        plan.append((tree, [path_to(t, e) for t, e in zip(tree, ends)]))
    for strat in ("snapshot", "records"):
        for dt in (torch.float32, torch.bfloat16, torch.float16):
            L = Layer(cfg, R, B, seed=3, state_dtype=dt)
            L.ssm.copy_(Layer(cfg, R, B, seed=3).ssm)  # same start (the fp32 values rounded)
            L.conv_state.zero_()
            si = L.si if strat == "snapshot" else L.si1
            rec_kv, rec_gb = L.rec_kv.unsqueeze(0), L.rec_gb.unsqueeze(0)
            worst = 0.0
            for rd, (tree, paths) in enumerate(plan):
                g = torch.Generator(device=DEV).manual_seed(rd)
                L.x.copy_(torch.randn(L.x.shape, generator=g, device=DEV))
                L.a.copy_(torch.randn(L.a.shape, generator=g, device=DEV))
                L.b.copy_(torch.randn(L.b.shape, generator=g, device=DEV))
                meta = build_gdn_meta(torch.tensor(tree, device=DEV), W, L_DRAFT)
                L.conv(meta, strat)
                L.gdn(meta, strat)
                out = L.out.float()
                acc = torch.full((R, L_DRAFT + 1), -1, dtype=torch.int32)
                for r, p in enumerate(paths):
                    acc[r, : len(p)] = torch.tensor(p, dtype=torch.int32)
                plen = torch.tensor([len(p) for p in paths], dtype=torch.int32, device=DEV)
                gdn_commit_triton([L.conv_state], [L.ssm] if strat == "records" else [], si, L.na, acc.to(DEV),
                                  plen, rec_kv if strat == "records" else None,
                                  rec_gb if strat == "records" else None, W)
                runs.setdefault((strat, "fp32_out"), {})
                if dt == torch.float32:
                    runs[(strat, "fp32_out")][rd] = out
                else:
                    ref = runs[(strat, "fp32_out")][rd]
                    worst = max(worst, float((out - ref).abs().max() / ref.abs().max()))
            lines = torch.gather(si.long(), 1, (L.na.long() - 1).clamp(max=si.shape[1] - 1).view(R, 1)).view(-1)
            runs[(strat, str(dt))] = (L.ssm[lines].float(), worst)
            del L
    res = {}
    for strat in ("snapshot", "records"):
        ref = runs[(strat, str(torch.float32))][0]
        for dt in (torch.bfloat16, torch.float16):
            s, worst = runs[(strat, str(dt))]
            res[f"{strat}_{str(dt).split('.')[-1]}"] = dict(
                state_rel_err=float((s - ref).abs().max() / ref.abs().max()),
                state_rel_rms=float((s - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()),
                max_output_rel_err_over_rounds=worst)
    res["snapshot_vs_replay_fp32_state_max_abs"] = float(
        (runs[("snapshot", str(torch.float32))][0] - runs[("records", str(torch.float32))][0]).abs().max())
    return dict(rounds=rounds, B=B, R=R, **res)


def gpu_check(cfg, R=2, B=22, layers=3):
    """Compiled Triton vs the torch reference at real head shapes (max abs errors)."""
    from ddtree_compile.templates.gdn_commit_ref import gdn_commit_ref
    from ddtree_compile.templates.tree_conv_ref import tree_conv1d_ref
    from ddtree_compile.templates.tree_gdn_ref import tree_gdn_ref
    H, K, W = cfg["H"], cfg["K"], cfg["W"]
    tree, mt, _ = metas(R, B, W, 7)
    err = {}
    for strat in ("snapshot", "records"):
        res, y_tri = [], None
        for impl in ("triton", "ref"):
            L = Layer(cfg, R, B, seed=9)
            L.na.copy_(torch.tensor([3, 1][:R], dtype=torch.int32))
            si = L.si if strat == "snapshot" else L.si1
            if impl == "ref":
                tree_conv1d_ref(L.x, L.w, None, L.conv_state, si, L.na, mt.conv_anc, L.y, True)
                y_ref = L.y.clone()
                L.y.copy_(y_tri)  # same recurrence input: bf16 ulp flips in the conv output would mask errors
                snap = strat == "snapshot"
                tree_gdn_ref(L.y, L.a, L.b, L.A_log, L.dt, L.ssm, si, L.na, mt.walk, L.stack, L.out,
                             None if snap else L.rec_kv, None if snap else L.rec_gb, H, K, K ** -0.5, snap)
            else:
                L.conv(mt, strat)
                y_tri = L.y.clone()
                L.gdn(mt, strat)
            paths = [side_path(p) for p in tree.tolist()]
            acc = torch.full((R, L_DRAFT + 1), -1, dtype=torch.int32)
            for r, p in enumerate(paths):
                acc[r, : len(p)] = torch.tensor(p, dtype=torch.int32)
            plen = torch.tensor([len(p) for p in paths], dtype=torch.int32, device=DEV)
            convs = [L.conv_state] + [L.conv_state.clone() for _ in range(layers - 1)]
            ssms = [L.ssm] + [L.ssm.clone() for _ in range(layers - 1)] if strat == "records" else []
            rk = L.rec_kv.expand(layers, *L.rec_kv.shape).contiguous() if strat == "records" else None
            rg = L.rec_gb.expand(layers, *L.rec_gb.shape).contiguous() if strat == "records" else None
            fn = gdn_commit_ref if impl == "ref" else gdn_commit_triton
            fn(convs, ssms, si, L.na, acc.to(DEV), plen, rk, rg, W)
            res.append((y_tri if impl == "triton" else y_ref, L.out, L.ssm, convs[-1], L.na.clone()))
        for name, u, v in zip(("conv_out", "gdn_out", "ssm_state", "conv_state", "num_accepted"), *res):
            err[f"{strat}_{name}_max_abs"] = float((u.float() - v.float()).abs().max())
    return err


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/tree_gdn_h100.json")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--rounds", type=int, default=256)
    args = ap.parse_args()
    cfg = TINY if SMOKE else QWEN36
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
               device=records[0]["device"], torch=torch.__version__, kernel_configs=dict(gdn=gdn_kw, conv=conv_kw), gpu_check=check,
               tuning=tuning, records=records, drift=dr, wall_s=round(time.time() - t0, 1))
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
