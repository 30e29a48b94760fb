"""bench_tree_gdn's checks: compiled Triton against the torch reference at real head shapes, and the
drift of bf16/fp16 state storage against fp32 over committed rounds."""

from __future__ import annotations

import torch

from ddtree_compile.templates.gdn_commit import gdn_commit_triton
from ddtree_compile.templates.gdn_meta import build_gdn_meta

from _gdn_layer import DEV, L_DRAFT, Layer, accepted, ddtree_parents, metas, path_to, side_path


def drift(cfg, rounds, B=16, R=2):
    """Committed-state drift of bf16/fp16 storage vs fp32 after `rounds` verify+commit rounds."""
    W = cfg["W"]
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
                acc, plen = accepted(paths)
                gdn_commit_triton([L.conv_state], [L.ssm], si, L.na, acc,
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
            acc, plen = accepted(paths)
            convs = [L.conv_state] + [L.conv_state.clone() for _ in range(layers - 1)]
            ssms = [L.ssm] + [L.ssm.clone() for _ in range(layers - 1)]  # the commit moves every layer's state
            rk = L.rec_kv.expand(layers, *L.rec_kv.shape).contiguous() if strat == "records" else None
            rg = L.rec_gb.expand(layers, *L.rec_gb.shape).contiguous() if strat == "records" else None
            fn = gdn_commit_ref if impl == "ref" else gdn_commit_triton
            fn(convs, ssms, si, L.na, acc, plen, rk, rg, W)
            res.append((y_tri if impl == "triton" else y_ref, L.out, L.ssm, convs[-1], L.na.clone()))
        for name, u, v in zip(("conv_out", "gdn_out", "ssm_state", "conv_state", "num_accepted"), *res):
            err[f"{strat}_{name}_max_abs"] = float((u.float() - v.float()).abs().max())
    return err
