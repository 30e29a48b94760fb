"""Budget "auto"'s policy offline: the real AutoBudget (integration/round/auto_budget.py) and
DDTreeMetrics on the CPU, fed synthetic steps, to tell the policy's own losses from the GPU's.

    python benchmarks/sim_auto_budget.py --costs benchmarks/results/e2e_h100x4_4b_s25_alone.json \
        --out benchmarks/results/sim_auto_4b_s25.json

The cells run in the benchmark's order (each profile, then each concurrency), one policy over all of
them, as one engine serves a side-by-side run. Per step the policy chooses a kind for R = c requests
(no request finishes), the step takes the kind's mean cost at c times a lognormal factor (--cv) and,
with probability --stall, --stall-factor times that; a tree step's walk records each row's accepted
nodes and those off the chain, drawn from oracle.simulate_rows for the cell's profile.

What a cell reports (mean and worst over --seeds): the tree's share of steps, and the rate (expected
tokens per second: a kind's mean tokens per request-round, times c, over the steps' time) over
flat DFlash's (every step a chain step) and over the better fixed kind's. What the policy loses here
is exploration, probes, estimator noise and lag after a switch of profile or batch bucket; what it
does not see is what a GPU adds: a chain step in auto costing more than flat DFlash's, the step after
a switch carrying the other kind's leftovers, run-to-run noise.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import random
import statistics
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def costs_from(result: dict, budget: int) -> dict:
    """{(kind, c): seconds per step} from a bench_e2e_gpu result: the chain's is flat DFlash's
    ms_per_step, the tree's budget `budget`'s, each the mean over the result's profiles."""
    out: dict = {}
    for kind, mode in (("chain", "flat"), ("tree", f"ddtree{budget}")):
        by_c: dict = {}
        for r in result["runs"]:
            if r.get("mode") == mode and "error" not in r and r.get("ms_per_step"):
                by_c.setdefault(r["concurrency"], []).append(r["ms_per_step"] / 1e3)
        out.update({(kind, c): statistics.mean(v) for c, v in by_c.items()})
    return out


def run_cells(cells, costs, rows, *, budget=32, draft_len=15, probe_interval=16, cv=0.12, stall=0.01,
              stall_factor=5.0, warmup=0, seed=0) -> list[dict]:
    """One policy over `cells` [(profile name, c, steps)], each cell after `warmup` untimed steps
    (bench_e2e_gpu's --warmup-runs); rows: profile name -> (accepted, chain) per sampled
    request-round (lists). Returns one dict per cell."""
    import torch

    from ddtree_compile.integration import metrics
    from ddtree_compile.integration.round import auto_budget as ab

    rng = random.Random(seed)
    m = metrics.DDTreeMetrics(draft_len, torch.device("cpu"))
    policy = ab.AutoBudget(m, budget, draft_len, probe_interval, None)
    slow = 1 + stall * (stall_factor - 1)  # the mean step's factor from stalls
    t, out = 0.0, []
    for name, c, steps in cells:
        accepted, chain = rows[name]
        tokens = {ab.TREE: 1 + statistics.mean(accepted), ab.CHAIN: 1 + statistics.mean(chain)}
        made = spent = 0.0
        taken = {ab.TREE: 0, ab.CHAIN: 0}
        for i in range(-warmup, steps):
            kind = policy.choose(c)
            dur = costs[(kind, c)] * math.exp(rng.gauss(0, cv) - cv * cv / 2)
            dur *= stall_factor if rng.random() < stall else 1.0
            policy.proposed(kind, c, t, t + min(0.002, dur / 2))
            policy.verify_began(t + min(0.002, dur / 2))
            policy.step_ended(t + dur)
            t += dur
            if kind == ab.TREE:
                pick = [rng.randrange(len(accepted)) for _ in range(c)]
                a = torch.tensor([accepted[j] for j in pick])
                m.record_round(torch.ones(c, dtype=torch.bool), torch.full((c,), budget), a,
                               a - torch.tensor([chain[j] for j in pick]), torch.zeros(c, dtype=torch.bool))
            if i >= 0:
                made += c * tokens[kind]  # expected tokens: the evaluation without the rows' sampling noise
                spent += dur
                taken[kind] += 1
        rate = {k: c * tokens[k] / (costs[(k, c)] * slow) for k in tokens}
        out.append({"profile": name, "concurrency": c, "steps": steps, "tree_share": taken[ab.TREE] / steps,
                    "vs_flat": made / spent / rate[ab.CHAIN], "vs_best": made / spent / max(rate.values()),
                    "tokens_per_round": tokens, "estimated": dict(policy.tokens)})
    return out


def simulate(args) -> dict:
    from ddtree_compile.testing import oracle

    prof_json = json.loads(pathlib.Path(args.profiles).read_text())
    profiles = {p["name"]: oracle.profile_from(p) for p in prof_json["profiles"]}
    names = [n for n in args.profile_names.split(",") if n]
    for n in names:
        if n not in profiles:
            raise SystemExit(f"--profile-names: {n!r} is not in {args.profiles} (have: {', '.join(profiles)})")
    costs = costs_from(json.loads(pathlib.Path(args.costs).read_text()), args.budget)
    conc = [int(c) for c in args.concurrency.split(",")]
    for c in conc:
        for kind in ("chain", "tree"):
            if (kind, c) not in costs:
                raise SystemExit(f"--concurrency {c}: {args.costs} has no {kind} step cost at c={c}")
    rows = {}
    for n in names:
        a, ch = oracle.simulate_rows(profiles[n], args.budget, args.top_k, args.draft_len, args.samples)
        rows[n] = (a.tolist(), ch.tolist())
    cells = [(n, c, args.steps) for n in names for c in conc]
    kw = dict(budget=args.budget, draft_len=args.draft_len, probe_interval=args.probe_interval, cv=args.cv,
              stall=args.stall, stall_factor=args.stall_factor, warmup=args.warmup_steps)
    per_seed = [run_cells(cells, costs, rows, seed=s, **kw) for s in range(args.seeds)]
    summary = []
    for i, (n, c, _) in enumerate(cells):
        got = [cell[i] for cell in per_seed]
        row = {"profile": n, "concurrency": c, "tree_share": statistics.mean(g["tree_share"] for g in got)}
        for k in ("vs_flat", "vs_best"):
            row |= {f"{k}_mean": statistics.mean(g[k] for g in got), f"{k}_worst": min(g[k] for g in got)}
        summary.append(row)
    return {"args": vars(args), "costs_ms": {f"{k}@{c}": 1e3 * v for (k, c), v in sorted(costs.items())},
            "cells": summary, "per_seed": per_seed}


def table(result: dict) -> str:
    lines = ["| profile | c | tree share | vs flat (mean, worst seed) | vs the better fixed kind |",
             "|---|---|---|---|---|"]
    for r in result["cells"]:
        lines.append(f"| {r['profile']} | {r['concurrency']} | {100 * r['tree_share']:.0f}% | "
                     f"{r['vs_flat_mean']:.3f} ({r['vs_flat_worst']:.3f}) | "
                     f"{r['vs_best_mean']:.3f} ({r['vs_best_worst']:.3f}) |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--costs", required=True, help="a bench_e2e_gpu.py result JSON: flat DFlash's and budget "
                    "--budget's ms_per_step per concurrency are the chain's and the tree's step costs")
    ap.add_argument("--out", default=None)
    ap.add_argument("--profiles", default=str(ROOT / "benchmarks" / "oracle_profiles.json"))
    ap.add_argument("--profile-names", default="port_plus4,sglang_plus22,paper_1p35")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--steps", type=int, default=240, help="steps per cell (the GPU cells: ~200-260)")
    ap.add_argument("--warmup-steps", type=int, default=0, help="untimed steps per cell (bench_e2e_gpu's "
                    "--warmup-runs 1: about a fifth of a cell)")
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--budget", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--draft-len", type=int, default=15)
    ap.add_argument("--probe-interval", type=int, default=16, help="additional_config ddtree probe_interval")
    ap.add_argument("--cv", type=float, default=0.12, help="a step's lognormal spread around its kind's mean")
    ap.add_argument("--stall", type=float, default=0.01, help="probability that a step stalls")
    ap.add_argument("--stall-factor", type=float, default=5.0)
    ap.add_argument("--samples", type=int, default=20000, help="request-rounds drawn per profile")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    result = simulate(args)
    print(table(result))
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
