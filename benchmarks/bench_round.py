"""Round overhead: build_tree + walk_tree per DDTree round, across requests R and budgets B.

    python benchmarks/bench_round.py --device cpu   [--out build/round_cpu.json]
    python benchmarks/bench_round.py --device cuda  [--impl torch triton] [--tune] [--sweep] [--out ...]

--impl picks the build and walk implementation(s) timed side by side (build_tree / walk_tree(..., impl=...)); CUDA
defaults to both, CPU to torch. On CUDA the script first checks on random shapes that the Triton
build and walk equal the torch ones bit for bit and that the Triton top-k gives the torch ids (log-probs to
1e-5), then times each (R, B, impl): build, walk and round eagerly, the round replayed as a CUDA
graph (how the runner executes it), and for Triton the two kernels alone as graphs; it also checks
that a round raises nothing under torch.cuda.set_sync_debug_mode("error") (no host sync).
--tune first sweeps the top-k launch parameters and times with the fastest; --sweep adds the
tree-build warps. Draft logits are bf16 on CUDA (what a drafter emits)
and float32 on CPU; L = 15, V = 151936.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import random
import statistics
import sys
import time
import traceback

import torch

import ddtree_compile as dd
from ddtree_compile.core.build import _build, draft_topk

L, V = 15, 151936
FIELDS = ("tokens", "parents", "depths", "scores", "num_nodes", "ancestor_bits")


def _time(fn, device: str, reps: int) -> float:
    """Median milliseconds of fn()."""
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        return statistics.median(times)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - t))
    return statistics.median(times)


def _graphed(fn):
    """Capture fn once in a CUDA graph; return its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def check_cases(n_random: int = 8) -> list[tuple]:
    """(R, L, V, B, top_k, chain_seed, integer-valued logits) for check_triton."""
    rng = random.Random(0)
    cases = [(64, 15, V, 64, 8, True, False), (8, 15, V, 128, 8, False, True), (3, 15, 4096, 22, 32, True, True),
             (5, 7, 1000, 1, 3, False, True), (2, 4, 50, 100, 4, True, False)]
    return cases + [(rng.randint(1, 16), rng.randint(1, 15), rng.choice([7, 300, 5000, 40000]), rng.randint(1, 160),
                     rng.randint(1, 12), rng.random() < 0.5, rng.random() < 0.5) for _ in range(n_random)]


def check_triton(device: str, cases: list[tuple]) -> list[dict]:
    """Triton vs torch on the device: build bit for bit, top-k ids exact and log-probs close."""
    from ddtree_compile.templates.draft_topk import draft_topk_triton
    from ddtree_compile.templates.tree_build import build_tree_triton

    rng = random.Random(1)
    out = []
    for i, (R, Ld, Vd, B, K, chain, ties) in enumerate(cases):
        gen = torch.Generator(device=device).manual_seed(i)
        if ties:  # integer logits: equal logits, equal path scores
            logits = torch.randint(-3, 4, (R, Ld, Vd), device=device, generator=gen).to(torch.bfloat16)
        else:
            logits = (torch.randn(R, Ld, Vd, device=device, generator=gen) * 4).to(torch.bfloat16)
        spec = dd.TreeSpec(budget=B, top_k=K, chain_seed=chain, temperature=rng.choice([1.0, 0.7]))
        row = {"R": R, "L": Ld, "V": Vd, "B": B, "K": K, "chain_seed": chain, "ties": ties}
        try:
            lq, ids = draft_topk(logits, spec)
            k = lq.shape[-1]
            lq_t, ids_t = draft_topk_triton(logits, spec.temperature, k)
            row["topk_ids_equal"] = bool(torch.equal(ids, ids_t))
            row["topk_lq_max_abs_err"] = float((lq - lq_t).abs().max())
            want = _build(lq, ids, B, chain)
            got = build_tree_triton(lq, ids, B, chain)
            row["build_equal"] = all(torch.equal(getattr(want, f), getattr(got, f)) for f in FIELDS)
            e2e = dd.build_tree(logits, spec, impl="triton")
            depth = spec.depth_limit(Ld)  # build_tree runs the top-k on these rows only
            ref = dd.build_tree(draft_topk_triton(logits[:, :depth], spec.temperature, k), spec, impl="torch")
            row["end_to_end_equal"] = all(torch.equal(getattr(e2e, f), getattr(ref, f)) for f in FIELDS)
            target = want.tokens.roll(-1, dims=1)  # along the first child of every node: deep paths
            target[:, ::3] = torch.randint(0, Vd, target[:, ::3].shape, device=device, generator=gen)  # and astray
            walks = [dd.walk_tree(want, target, impl=i) for i in ("torch", "triton")]
            row["walk_equal"] = all(torch.equal(getattr(walks[0], f), getattr(walks[1], f))
                                    for f in ("accepted", "num_accepted", "bonus", "tokens"))
            row["ok"] = row["topk_ids_equal"] and row["topk_lq_max_abs_err"] < 1e-4 and row["build_equal"] \
                and row["end_to_end_equal"] and row["walk_equal"]
        except Exception:  # report and keep going: the timings are still useful
            row["ok"], row["error"] = False, traceback.format_exc()[-2000:]
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


def bench(device: str, requests, budgets, impls, reps: int) -> list[dict]:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    rows = []
    for R in requests:
        gen = torch.Generator(device=device).manual_seed(R)
        logits = (torch.randn(R, L, V, device=device, generator=gen) * 4).to(dtype)
        for B in budgets:
            spec = dd.TreeSpec(budget=B, top_k=8)
            for impl in impls:
                row = {"R": R, "B": B, "L": L, "V": V, "impl": impl, "dtype": str(dtype).replace("torch.", "")}
                try:
                    _bench_one(row, device, logits, spec, impl, reps)
                except Exception:
                    row["error"] = traceback.format_exc()[-2000:]
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def _bench_one(row, device, logits, spec, impl, reps):
    tree = dd.build_tree(logits, spec, impl=impl)
    target = tree.tokens.roll(-1, dims=1)  # agrees along the main chain: deep paths

    def round_():
        return dd.walk_tree(dd.build_tree(logits, spec, impl=impl), target, impl=impl)

    row["build_ms"] = _time(lambda: dd.build_tree(logits, spec, impl=impl), device, reps)
    row["walk_ms"] = _time(lambda: dd.walk_tree(tree, target, impl=impl), device, reps)
    row["round_ms"] = _time(round_, device, reps)
    if device != "cuda":
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        round_()
        row["host_sync_free"] = True
    finally:
        torch.cuda.set_sync_debug_mode(0)
    row["round_graph_ms"] = _time(_graphed(round_), device, reps)
    row["walk_graph_ms"] = _time(_graphed(lambda: dd.walk_tree(tree, target, impl=impl)), device, reps)
    if impl == "triton":
        from ddtree_compile.templates.draft_topk import draft_topk_triton
        from ddtree_compile.templates.tree_build import build_tree_triton

        k, depth = min(spec.top_k, V, spec.budget), spec.depth_limit(L)
        lq, ids = draft_topk_triton(logits[:, :depth], spec.temperature, k)
        row["topk_graph_ms"] = _time(_graphed(lambda: draft_topk_triton(logits[:, :depth], spec.temperature, k)),
                                     device, reps)
        row["tree_graph_ms"] = _time(_graphed(lambda: build_tree_triton(lq, ids, spec.budget, spec.chain_seed)),
                                     device, reps)


def tune_topk(device: str, reps: int) -> tuple[list[dict], dict]:
    """Sweep the top-k launch parameters (as graphs) per regime and apply the fastest correct ones."""
    from ddtree_compile.templates import draft_topk as tk

    rows, best = [], {}
    for R in (1, 64):  # 15 rows: the "small" regime; 960 rows: "large" (>= 2 rows per SM)
        logits = (torch.randn(R, L, V, device=device) * 4).to(torch.bfloat16)
        _, want = draft_topk(logits, dd.TreeSpec(budget=64, top_k=8))
        regime = "large" if R * L >= 2 * torch.cuda.get_device_properties(0).multi_processor_count else "small"
        for block in (1024, 2048):
            for warps in (2, 4, 8):
                for pipe in (0, 1, 2):
                    for waves in (4.0, 16.0):
                        row = {"kernel": "draft_topk", "R": R, "regime": regime, "block": block, "num_warps": warps,
                               "pipe": pipe, "waves": waves}
                        try:
                            splits = tk.plan_topk(R * L, V, logits.device, block, None, waves)[2]
                            row["splits"] = splits
                            fn = lambda: tk.draft_topk_triton(logits, 1.0, 8, block=block, splits=splits,  # noqa: E731
                                                              num_warps=warps, pipe=pipe)
                            row["ids_equal"] = bool(torch.equal(fn()[1], want))
                            row["ms"] = _time(_graphed(fn), device, reps)
                            if row["ids_equal"] and row["ms"] < best.get(regime, (None, float("inf")))[1]:
                                best[regime] = (tk.TopkConfig(block, warps, pipe, waves), row["ms"])
                        except Exception:
                            row["error"] = traceback.format_exc()[-1000:]
                        rows.append(row)
                        print(json.dumps(row), flush=True)
    for regime, (cfg, _) in best.items():
        tk.CONFIGS[regime] = cfg
    chosen = {regime: vars(tk.CONFIGS[regime]) for regime in tk.CONFIGS}
    print("top-k launch table:", json.dumps(chosen), flush=True)
    return rows, chosen


def sweep_tree(device: str, reps: int) -> list[dict]:
    """Tree-build warps (as graphs) at R = 64."""
    from ddtree_compile.templates.tree_build import build_tree_triton

    out = []
    logits = (torch.randn(64, L, V, device=device) * 4).to(torch.bfloat16)
    lq, ids = draft_topk(logits, dd.TreeSpec(budget=128, top_k=8))
    for B in (16, 64, 128):
        for warps in (4, 8, 16):
            row = {"kernel": "tree_build", "R": 64, "B": B, "num_warps": warps}
            try:
                row["ms"] = _time(_graphed(lambda: build_tree_triton(lq, ids, B, True, num_warps=warps)), device, reps)
            except Exception:
                row["error"] = traceback.format_exc()[-1000:]
            out.append(row)
            print(json.dumps(row), flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--requests", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--budgets", type=int, nargs="+", default=[16, 22, 32, 64, 128])
    ap.add_argument("--impl", nargs="+", choices=["torch", "triton"], default=None)
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--no-check", action="store_true", help="skip the Triton == torch checks (CUDA)")
    ap.add_argument("--tune", action="store_true",
                    help="first sweep the top-k launch parameters and use the fastest (CUDA)")
    ap.add_argument("--sweep", action="store_true", help="also sweep the tree-build warps (CUDA)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cuda = args.device == "cuda"
    impls = args.impl or (["torch", "triton"] if cuda else ["torch"])
    reps = args.reps or (50 if cuda else 3)
    result = {"meta": {
        "command": " ".join(["python"] + sys.argv),
        "device": torch.cuda.get_device_name() if cuda else platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "triton": _triton_version(),
        "threads": torch.get_num_threads(),
        "goal": "R=64, B=64 round < 0.5 ms on H100",
    }}

    def save():
        if args.out:
            pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)

    if cuda and args.tune:
        result["topk_sweep"], result["topk_configs"] = tune_topk(args.device, min(reps, 20))
        save()
    if cuda and "triton" in impls and not args.no_check:
        result["checks"] = check_triton(args.device, check_cases())
        save()
    result["results"] = bench(args.device, args.requests, args.budgets, impls, reps)
    save()
    if cuda and args.sweep:
        result["tree_sweep"] = sweep_tree(args.device, min(reps, 20))
        save()
    _print_table(result, cuda)
    return 0


def _triton_version() -> str | None:
    try:
        import triton

        return triton.__version__
    except ImportError:
        return None


def _print_table(result: dict, cuda: bool) -> None:
    if "checks" in result:
        ok = sum(bool(c.get("ok")) for c in result["checks"])
        print(f"\nchecks: {ok}/{len(result['checks'])} Triton == torch")
    cols = ["build_ms", "walk_ms", "round_ms"] + (["round_graph_ms", "walk_graph_ms", "topk_graph_ms",
                                                   "tree_graph_ms"] if cuda else [])
    print(f"\n{'R':>4} {'B':>4} {'impl':>7} " + " ".join(f"{c.replace('_ms', ''):>11}" for c in cols))
    for r in result["results"]:
        vals = " ".join(f"{r[c]:>11.3f}" if c in r else f"{'-':>11}" for c in cols)
        print(f"{r['R']:>4} {r['B']:>4} {r['impl']:>7} {vals}" + ("  ERROR" if "error" in r else ""))


if __name__ == "__main__":
    sys.exit(main())
