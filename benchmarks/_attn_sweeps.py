"""bench_tree_attention's sweeps: --sweep (tiles x waves per head size, f078ad5) and --lowr-sweep (the
per-bucket plan at low request counts / short contexts: row tile x split count, graph replays, then
eager launches next to FA and the dense mask)."""

from __future__ import annotations

import json
import math
import time

import torch

from ddtree_compile.templates import launch, tuning

from _attn_common import (DEV, MODELS, bench, causal_fa, config_error, dense_bias, dense_group, dense_sdpa,
                          fa_gqa_supported, kernel_info, log, make_tiles, setup_group, time_tree)

# (BLOCK_M, BLOCK_N, num_warps, num_stages, page_group); page_group 0 = block ids loaded per key tile
SWEEP_TILES = {
    256: [(128, 32, 8, 2, 0), (128, 32, 8, 2, 64), (128, 32, 8, 3, 64), (64, 32, 8, 3, 64), (64, 32, 4, 3, 64),
          (64, 32, 4, 2, 64), (128, 32, 8, 4, 64), (128, 16, 8, 4, 64)],
    128: [(64, 64, 4, 3, 0), (64, 64, 4, 3, 64), (64, 64, 4, 2, 64), (128, 64, 8, 3, 64), (128, 32, 8, 3, 64),
          (64, 32, 4, 4, 64), (128, 64, 8, 2, 64), (64, 64, 4, 4, 64)],
}
SWEEP_SHAPES = [(1, 32768, 64), (1, 8192, 22), (8, 8192, 32), (8, 32768, 16), (32, 8192, 64), (1, 1024, 16)]
SWEEP_WAVES = (1.0, 2.0, 4.0)


def run_sweep(doc, deadline):
    """Pick (tiles, waves) per head size by the geometric mean over SWEEP_SHAPES, among configs that pass
    a correctness check on this GPU; the winner must also pass with a sliding window and a soft-cap."""
    g = torch.Generator().manual_seed(3)
    chosen = {}
    for model, (Hq, Hkv, D) in MODELS.items():
        valid = []
        for cfg in SWEEP_TILES[D]:
            try:
                err = config_error(model, make_tiles(cfg), g)
            except Exception as e:  # noqa: BLE001  e.g. out of resources on this GPU
                err = float("inf")
                log(f"sweep {model} {cfg} failed: {str(e)[:300]}")
            doc["sweep_checks"].append(dict(model=model, tiles=list(cfg), row_rel_err=err))
            if err < 2e-2:
                valid.append(cfg)
        scores = {}
        for R, C, B in SWEEP_SHAPES:
            grp = setup_group(model, R, C, g)
            for cfg in valid:
                for waves in SWEEP_WAVES:
                    if time.time() > deadline:
                        break
                    ms, plan, _, _ = time_tree(grp, model, R, C, B, g, tiles=make_tiles(cfg), waves=waves)
                    doc["sweep"].append(dict(model=model, D=D, R=R, ctx=C, B=B, tiles=list(cfg), waves=waves,
                                             splits=plan["splits"], tree_ms=ms))
                    scores.setdefault((cfg, waves), []).append(ms)
            del grp
            torch.cuda.empty_cache()
        complete = {k: v for k, v in scores.items() if len(v) == len(SWEEP_SHAPES)} or scores
        ranked = sorted(complete, key=lambda k: sum(math.log(x) for x in complete[k]) / len(complete[k]))
        for cfg, waves in ranked:
            err = config_error(model, make_tiles(cfg), g, window=700, cap=30.0)
            doc["sweep_checks"].append(dict(model=model, tiles=list(cfg), window=700, cap=30.0, row_rel_err=err))
            if err < 2e-2:
                chosen[D] = dict(tiles=list(cfg), waves=waves)
                log(f"sweep {model}: best tiles {cfg} waves {waves}")
                break
    doc["chosen"] = {str(k): v for k, v in chosen.items()}
    doc["kernels"] = kernel_info()
    return chosen


# (model, R, C, B): the rows of the f078ad5 table below 0.8x FA under CUDA graphs, then regression guards.
LOWR_SHAPES = [
    ("qwen3.6-27b", 1, 1024, 16), ("qwen3.6-27b", 1, 1024, 22), ("qwen3.6-27b", 1, 1024, 32),
    ("qwen3.6-27b", 1, 1024, 64), ("llama3-8b-like", 1, 1024, 16), ("llama3-8b-like", 1, 1024, 22),
    ("llama3-8b-like", 1, 1024, 32), ("llama3-8b-like", 1, 1024, 64),
    ("qwen3.6-27b", 1, 8192, 22), ("qwen3.6-27b", 1, 8192, 32), ("qwen3.6-27b", 1, 8192, 64),
    ("llama3-8b-like", 1, 8192, 16), ("llama3-8b-like", 1, 8192, 22), ("llama3-8b-like", 1, 8192, 32),
    ("qwen3.6-27b", 8, 1024, 22), ("qwen3.6-27b", 8, 1024, 32), ("llama3-8b-like", 8, 1024, 64),
    ("llama3-8b-like", 1, 32768, 32),
    # guards (>= 0.8x before)
    ("qwen3.6-27b", 1, 8192, 16), ("qwen3.6-27b", 8, 1024, 16), ("qwen3.6-27b", 8, 1024, 64),
    ("llama3-8b-like", 8, 1024, 32), ("llama3-8b-like", 1, 8192, 64), ("qwen3.6-27b", 1, 32768, 22),
    ("llama3-8b-like", 1, 32768, 22), ("qwen3.6-27b", 8, 8192, 22), ("llama3-8b-like", 8, 8192, 64),
    ("qwen3.6-27b", 32, 1024, 22), ("qwen3.6-27b", 32, 1024, 32), ("llama3-8b-like", 32, 1024, 64),
    ("qwen3.6-27b", 8, 32768, 16), ("qwen3.6-27b", 32, 8192, 16),
]
LOWR_FULL = 18  # the first 18 shapes are swept fully
LOWR_EAGER = [("qwen3.6-27b", 1, 1024, 16), ("llama3-8b-like", 1, 1024, 16), ("llama3-8b-like", 1, 1024, 64),
              ("llama3-8b-like", 8, 1024, 16), ("qwen3.6-27b", 8, 1024, 22)]
OLD_WAVES = {256: 4.0, 128: 2.0}  # the f078ad5 rule: ceil(waves * SMs / programs), min_chunk 128


# 64-row tiles the low-R sweep also tried (rows padded less, twice the programs); they lost (tuning.py).
LOWR_NARROW = {256: tuning.AttnTiles(64, 32, 8, 3, page_group=64), 128: tuning.AttnTiles(64, 64, 4, 3, page_group=64)}


def lowr_configs(model, R, C, B, full=True):
    """(label, tiles, splits) candidates: the current default plan, the f078ad5 plan, and both row tiles x
    split counts (min_chunk = one key tile at 1k, so the split count is the effective one). Guards
    (full=False) get only whole-wave split counts."""
    Hq, Hkv, D = MODELS[model]
    arch, sms = tuning.arch_of(DEV)
    rows = (B + 1) * (Hq // Hkv)
    cfgs = [("default", None, None)]
    wide = tuning.attention_tiles(arch, D)
    mb = -(-rows // wide.block_m)
    old = tuning.with_overrides(wide, min_chunk=128)
    cfgs.append(("old_plan", old, max(1, min(-(-int(OLD_WAVES[D] * sms) // (R * Hkv * mb)), 32))))
    for name, t in (("wide", wide), ("narrow", LOWR_NARROW.get(D))):
        if t is None:
            continue
        base = R * Hkv * -(-rows // t.block_m)
        waves = {min(32, k * sms // base) for k in (1, 2, 4)}
        if C <= 1024:
            t = tuning.with_overrides(t, min_chunk=t.block_n)
            cands = {1, 2, 4, 8, 16} if full else waves | {1}
        else:
            t = tuning.with_overrides(t, min_chunk=128)
            cands = ({2, 4, 8, 16, 32} | waves) if full else waves
            if R == 1:
                cands = {c for c in cands if c >= 4}
        for S in sorted(c for c in cands if 1 <= c <= min(32, max(2, 8 * sms // base))):
            cfgs.append((f"{name}_S{S}", t, S))
    return cfgs


def run_lowr_sweep(doc, deadline, out_path):
    g = torch.Generator().manual_seed(5)
    doc["lowr_sweep"] = []
    for idx, (model, R, C, B) in enumerate(LOWR_SHAPES):
        if time.time() > deadline:
            log("deadline reached: low-R sweep incomplete")
            break
        Hq, Hkv, D = MODELS[model]
        N = B + 1
        grp = setup_group(model, R, C, g)
        q = torch.randn(R * N, Hq, D, device=DEV, dtype=torch.bfloat16)
        qt = q.view(R, N, Hq, D).transpose(1, 2)
        k, v = grp["k"][:, :, :C + N], grp["v"][:, :, :C + N]
        if not fa_gqa_supported():
            k, v = k.repeat_interleave(Hq // Hkv, 1), v.repeat_interleave(Hq // Hkv, 1)
        fa_g = bench(lambda: causal_fa(qt, k, v, D ** -0.5), graph=True, rep=10)
        rows = []
        for label, tiles, splits in lowr_configs(model, R, C, B, full=idx < LOWR_FULL):
            if time.time() > deadline:
                break
            try:
                ms, plan, _, err = time_tree(grp, model, R, C, B, g, tiles=tiles, splits=splits, graph=True,
                                             check_ref=C <= 1024 or label in ("default", "old_plan"), rep=10)
            except Exception as e:  # noqa: BLE001  e.g. out of resources for a tile on this GPU
                log(f"lowr {model} R={R} C={C} B={B} {label} failed: {str(e)[:300]}")
                continue
            rec = dict(model=model, R=R, ctx=C, B=B, config=label, graph_tree_ms=ms, graph_causal_fa_ms=fa_g,
                       graph_tree_speed_vs_causal=fa_g / ms, row_rel_err=err, ok=err is None or err < 2e-2, **plan)
            doc["lowr_sweep"].append(rec)
            rows.append(rec)
        del grp, k, v
        torch.cuda.empty_cache()
        if rows:
            by = {r["config"]: r for r in rows}
            best = min(rows, key=lambda r: r["graph_tree_ms"])
            d, o = by.get("default"), by.get("old_plan")
            o_ms, d_ms = (o or {}).get("graph_tree_ms", 0.0), (d or {}).get("graph_tree_ms", 0.0)
            log(f"{model[:5]} R={R:2d} C={C:5d} B={B:2d} fa {fa_g * 1e3:6.1f} | old {o_ms * 1e3:6.1f} "
                f"default {d_ms * 1e3:6.1f} (bm{(d or {}).get('block_m', 0)} S{(d or {}).get('splits', 0)}) "
                f"best {best['graph_tree_ms'] * 1e3:6.1f} {best['config']} | x{fa_g / best['graph_tree_ms']:.2f} "
                f"bad={[r['config'] for r in rows if not r['ok']]}")
        json.dump(doc, open(out_path, "w"), indent=1)
    # eager: the direct launcher path vs Triton's own path, next to FA and the dense mask
    doc["lowr_eager"] = []
    for model, R, C, B in LOWR_EAGER:
        if time.time() > deadline + 30:
            break
        Hq, Hkv, D = MODELS[model]
        N = B + 1
        grp = setup_group(model, R, C, g)
        dense_group(grp, model)
        rec = dict(model=model, R=R, ctx=C, B=B)
        for fast in (True, False):
            launch.set_fast_launch(fast)
            ms, plan, (anc, q), _ = time_tree(grp, model, R, C, B, g)
            rec["tree_ms_fast_launch" if fast else "tree_ms_triton_launch"] = ms
        launch.set_fast_launch(True)
        qt = q.view(R, N, Hq, D).transpose(1, 2)
        k, v = grp["k"][:, :, :C + N], grp["v"][:, :, :C + N]
        if not fa_gqa_supported():
            k, v = grp["kx"][:, :, :C + N], grp["vx"][:, :, :C + N]
        rec["causal_fa_ms"] = bench(lambda: causal_fa(qt, k, v, D ** -0.5))
        bias = dense_bias(anc, C, q.dtype)
        kx, vx = grp["kx"][:, :, :C + N], grp["vx"][:, :, :C + N]
        rec["dense_mask_ms"] = bench(lambda: dense_sdpa(qt, kx, vx, bias, D ** -0.5))
        doc["lowr_eager"].append(rec)
        log("eager " + " ".join(f"{k_}={v_ * 1e3:.1f}us" if isinstance(v_, float) else f"{k_}={v_}"
                                for k_, v_ in rec.items()))
        del grp
        torch.cuda.empty_cache()
    json.dump(doc, open(out_path, "w"), indent=1)
