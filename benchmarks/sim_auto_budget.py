"""Budget "auto"'s policy offline: the real AutoBudget (integration/round/auto_budget.py) and
DDTreeMetrics on the CPU, fed synthetic steps, to tell the policy's own losses from the GPU's.

    python benchmarks/sim_auto_budget.py --costs benchmarks/results/e2e_h200x2_4b.json \
        --out build/sim_auto_4b.json

The cells run in the benchmark's order (each profile, then each concurrency), one policy over all of
them, as one engine serves a side-by-side run. Per step the policy chooses a kind for R = c requests
(no request finishes), the step takes the kind's mean cost at c times a lognormal factor (--cv) and,
with probability --stall, --stall-factor times that; a tree step's walk records each row's accepted
nodes and those off the chain, drawn from oracle.simulate_rows for the cell's profile.

With --run-tokens the batch drains as on the GPU: a cell is --runs runs of c requests of that many
tokens each, a request leaves when its tokens are committed (each step commits 1 + a sampled row's
accepted nodes: the tree's, or those on the chain), a step of R requests costs the kind's cost
interpolated linearly between the measured concurrencies, and the policy is compared with the chain
and the tree every step over the same runs. --host-drift F,D multiplies every step by a host speed
that switches between 1 and F after D steps on average (the H200 run: the same flat step took 10.9 or
15.3 ms from one cell to the next). --no-pairs replays the policy before its probes were compared with
their neighbouring steps (AutoBudget.min_pairs). --lag 2 reports each step's cycle as the device time of
the step two before it, as the host sees it in vLLM's async loop (its batch queue keeps two steps in
flight); --depth is the policy's (AutoBudget.depth: 2 in that loop, 1 before). On CUDA the policy
reads each step on the device's own timeline (auto_setup.DeviceClock), which --lag 0 --depth 1 plays.

What a cell reports (mean and worst over --seeds): the tree's share of steps, and the rate (expected
tokens per second: a kind's mean tokens per request-round, times c, over the steps' time) over
flat DFlash's (every step a chain step) and over the better fixed kind's. What the policy loses here
is exploration, probes, estimator noise and lag after a switch of profile or batch bucket; what it
does not see is what a GPU adds: a chain step in auto costing more than flat DFlash's, the step after
a switch carrying the other kind's leftovers, run-to-run noise.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import pathlib
import random
import statistics
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def costs_from(result: dict, budget: int) -> dict:
    """{(kind, c): seconds per step} from a bench_e2e_gpu result: the chain's is flat DFlash's
    ms_per_step, the tree's budget `budget`'s, each the mean over the result's valid rows' profiles
    (a row summarize_e2e marked invalid timed other work than its cell: not a cost)."""
    out: dict = {}
    for kind, mode in (("chain", "flat"), ("tree", f"ddtree{budget}")):
        by_c: dict = {}
        for r in result["runs"]:
            if r.get("mode") == mode and "error" not in r and "invalid" not in r and r.get("ms_per_step"):
                by_c.setdefault(r["concurrency"], []).append(r["ms_per_step"] / 1e3)
        out.update({(kind, c): statistics.mean(v) for c, v in by_c.items()})
    return out


def _new_policy(budget, draft_len, probe_interval, no_pairs, depth=1):
    """(DDTreeMetrics, AutoBudget) on the CPU; no_pairs: the policy on its kinds' own costs alone."""
    import torch

    from ddtree_compile.integration import metrics
    from ddtree_compile.integration.round import auto_budget as ab

    m = metrics.DDTreeMetrics(draft_len, torch.device("cpu"))
    policy = ab.AutoBudget(m, budget, draft_len, probe_interval, None, depth=depth)
    policy.min_pairs = math.inf if no_pairs else policy.min_pairs
    return m, policy


def _play(policy, m, kind, R, t, dur, budget, accepted=(), chain=()):
    """One step as the round reports it to the policy (its proposal, its verify's start, the next
    proposal) and, for a tree step, its walk's rows: each row's accepted nodes and those on the chain."""
    import torch

    from ddtree_compile.integration.round import auto_budget as ab

    policy.proposed(kind, R, t, t + min(0.002, dur / 2))
    policy.verify_began(t + min(0.002, dur / 2))
    policy.step_ended(t + dur)
    if kind == ab.TREE:
        a = torch.tensor(accepted)
        m.record_round(torch.ones(R, dtype=torch.bool), torch.full((R,), budget), a, a - torch.tensor(chain),
                       torch.zeros(R, dtype=torch.bool))


def run_cells(cells, costs, rows, *, budget=32, draft_len=15, probe_interval=16, cv=0.12, stall=0.01,
              stall_factor=5.0, warmup=0, seed=0, no_pairs=False, lag=0, depth=1) -> list[dict]:
    """One policy over `cells` [(profile name, c, steps)], each cell after `warmup` untimed steps
    (bench_e2e_gpu's --warmup-runs); rows: profile name -> (accepted, chain) per sampled
    request-round (lists). Returns one dict per cell."""
    from ddtree_compile.integration.round import auto_budget as ab

    rng = random.Random(seed)
    m, policy = _new_policy(budget, draft_len, probe_interval, no_pairs, depth)
    slow = 1 + stall * (stall_factor - 1)  # the mean step's factor from stalls
    t, out, durs = 0.0, [], collections.deque(maxlen=lag + 1)
    for name, c, steps in cells:
        accepted, chain = rows[name]
        tokens = {ab.TREE: 1 + statistics.mean(accepted), ab.CHAIN: 1 + statistics.mean(chain)}
        made = spent = 0.0
        taken = {ab.TREE: 0, ab.CHAIN: 0}
        for i in range(-warmup, steps):
            kind = policy.choose(c)
            dur = costs[(kind, c)] * math.exp(rng.gauss(0, cv) - cv * cv / 2)
            dur *= stall_factor if rng.random() < stall else 1.0
            pick = [rng.randrange(len(accepted)) for _ in range(c)] if kind == ab.TREE else []
            durs.append(dur)
            seen = durs[-1 - lag] if len(durs) > lag else dur  # the cycle the host times (--lag)
            _play(policy, m, kind, c, t, seen, budget, [accepted[j] for j in pick], [chain[j] for j in pick])
            t += dur
            if i >= 0:
                made += c * tokens[kind]  # expected tokens: the evaluation without the rows' sampling noise
                spent += dur
                taken[kind] += 1
        rate = {k: c * tokens[k] / (costs[(k, c)] * slow) for k in tokens}
        out.append({"profile": name, "concurrency": c, "steps": steps, "tree_share": taken[ab.TREE] / steps,
                    "vs_flat": made / spent / rate[ab.CHAIN], "vs_best": made / spent / max(rate.values()),
                    "tokens_per_round": tokens, "estimated": dict(policy.tokens)})
    return out


def cost_at(costs: dict, kind: str, R: int) -> float:
    """A step of R requests: the kind's cost interpolated linearly between the measured
    concurrencies (constant below the smallest, extrapolated above the largest)."""
    cs = sorted(c for k, c in costs if k == kind)
    lo, hi = (cs[0], cs[0]) if R <= cs[0] else next(((a, b) for a, b in zip(cs, cs[1:]) if R <= b), tuple(cs[-2:]))
    if lo == hi:
        return costs[(kind, lo)]
    return costs[(kind, lo)] + (R - lo) * (costs[(kind, hi)] - costs[(kind, lo)]) / (hi - lo)


def drain_cells(cells, costs, rows, *, budget=32, draft_len=15, probe_interval=16, cv=0.12, stall=0.01,
                stall_factor=5.0, run_tokens=256, runs=7, drift=(1.0, 1e9), seed=0, no_pairs=False, lag=0,
                depth=1) -> list[dict]:
    """One policy per forced kind (None: auto, then the chain, then the tree) over `cells` [(profile
    name, c, _)], each cell `runs` runs of c requests of run_tokens tokens (the module docstring)."""
    from ddtree_compile.integration.round import auto_budget as ab

    got = {}
    host = random.Random(seed + 1000)  # the host: one sequence of step factors per cell, shared by the kinds
    factors, speed = [], 1.0
    for _ in cells:
        f = []
        for _ in range(runs * (run_tokens + 1)):  # (at most one step per token)
            if host.random() < 1 / drift[1]:
                speed = drift[0] if speed == 1.0 else 1.0
            f.append(speed * math.exp(host.gauss(0, cv) - cv * cv / 2) * (stall_factor if host.random() < stall else 1))
        factors.append(f)
    for forced in (None, ab.CHAIN, ab.TREE):
        rng = random.Random(seed)  # the requests' draws
        m, policy = _new_policy(budget, draft_len, probe_interval, no_pairs, depth)
        policy.forced = forced
        t, out, durs = 0.0, [], collections.deque(maxlen=lag + 1)
        for (name, c, _), f in zip(cells, factors):
            accepted, chain = rows[name]
            made = spent = 0.0
            taken = {ab.TREE: 0, ab.CHAIN: 0}
            step = iter(f)
            for _ in range(runs):
                left = [run_tokens] * c
                while any(left):
                    active = [i for i, n in enumerate(left) if n > 0]
                    R = len(active)
                    kind = policy.choose(R)
                    dur = cost_at(costs, kind, R) * next(step)
                    pick = [rng.randrange(len(accepted)) for _ in active]
                    durs.append(dur)
                    seen = durs[-1 - lag] if len(durs) > lag else dur  # the cycle the host times (--lag)
                    _play(policy, m, kind, R, t, seen, budget, [accepted[j] for j in pick], [chain[j] for j in pick])
                    t += dur
                    for i, j in zip(active, pick):
                        n = accepted[j] if kind == ab.TREE else chain[j]
                        made += min(1 + n, left[i])
                        left[i] = max(0, left[i] - 1 - n)
                    spent += dur
                    taken[kind] += 1
            out.append({"profile": name, "concurrency": c, "rate": made / spent,
                        "tree_share": taken[ab.TREE] / sum(taken.values())})
        got[forced] = out
    for a, ch, tr in zip(got[None], got[ab.CHAIN], got[ab.TREE]):
        a.update(vs_flat=a["rate"] / ch["rate"], vs_best=a["rate"] / max(ch["rate"], tr["rate"]),
                 tree_vs_flat=tr["rate"] / ch["rate"])
    return got[None]


def simulate(args) -> dict:
    from ddtree_compile.testing import oracle

    prof_json = json.loads((ROOT / args.profiles).read_text())
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
              stall=args.stall, stall_factor=args.stall_factor, no_pairs=args.no_pairs, lag=args.lag, depth=args.depth)
    if args.run_tokens:
        drift = tuple(float(x) for x in args.host_drift.split(","))
        per_seed = [drain_cells(cells, costs, rows, seed=s, run_tokens=args.run_tokens, runs=args.runs, drift=drift,
                                **kw) for s in range(args.seeds)]
    else:
        per_seed = [run_cells(cells, costs, rows, seed=s, warmup=args.warmup_steps, **kw) for s in range(args.seeds)]
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
    ap.add_argument("--profiles", default="benchmarks/oracle_profiles.json", help="relative to the repository "
                    "root unless absolute (results record no machine path)")
    ap.add_argument("--profile-names", default="port_plus4,sglang_plus22,paper_1p35,thinking_2p5")
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
    ap.add_argument("--run-tokens", type=int, default=0, help="tokens per request: the batch drains (0: R = c "
                    "every step, --steps per cell)")
    ap.add_argument("--runs", type=int, default=7, help="--run-tokens: runs per cell (the GPU's: 1 warm-up + 6)")
    ap.add_argument("--host-drift", default="1,1e9", help="F,D: --run-tokens: the host's speed switches between 1 "
                    "and F (step time x F) after D steps on average")
    ap.add_argument("--no-pairs", action="store_true", help="the policy without its neighbour comparisons")
    ap.add_argument("--lag", type=int, default=0, help="steps between a step and the cycle the host times for it "
                    "(2: vLLM's async loop, a batch queue of two)")
    ap.add_argument("--depth", type=int, default=1, help="the policy's AutoBudget.depth (2 under async scheduling)")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    result = simulate(args)
    print(table(result))
    if args.out:
        pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
