"""Round overhead: build_tree + walk_tree per DDTree round, across requests R and budgets B.

    python benchmarks/bench_round.py --device cpu   [--out benchmarks/results/round_cpu.json]
    python benchmarks/bench_round.py --device cuda  [--out ...]   # on the lent GPU machine

On CUDA it also times the round replayed as a CUDA graph (how the runner executes it) and checks
that a round raises nothing under torch.cuda.set_sync_debug_mode("error") (no host sync).
Draft logits are bf16 on CUDA (what a drafter emits) and float32 on CPU; L = 15, V = 151936.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import torch

import ddtree_compile as dd

L, V = 15, 151936


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


def bench(device: str, requests, budgets, reps: int) -> list[dict]:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    rows = []
    for R in requests:
        gen = torch.Generator(device=device).manual_seed(R)
        logits = (torch.randn(R, L, V, device=device, generator=gen) * 4).to(dtype)
        for B in budgets:
            spec = dd.TreeSpec(budget=B, top_k=8)
            tree = dd.build_tree(logits, spec)
            target = tree.tokens.roll(-1, dims=1)  # agrees along the main chain: deep paths

            def round_():
                t = dd.build_tree(logits, spec)
                return dd.walk_tree(t, target)

            row = {"R": R, "B": B, "L": L, "V": V, "dtype": str(dtype).replace("torch.", "")}
            row["build_ms"] = _time(lambda: dd.build_tree(logits, spec), device, reps)
            row["walk_ms"] = _time(lambda: dd.walk_tree(tree, target), device, reps)
            row["round_ms"] = _time(round_, device, reps)
            if device == "cuda":
                torch.cuda.set_sync_debug_mode("error")
                try:
                    round_()
                    row["host_sync_free"] = True
                finally:
                    torch.cuda.set_sync_debug_mode(0)
                row["round_graph_ms"] = _time(_graphed(round_), device, reps)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--requests", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--budgets", type=int, nargs="+", default=[16, 22, 32, 64, 128])
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    reps = args.reps or (50 if args.device == "cuda" else 3)
    rows = bench(args.device, args.requests, args.budgets, reps)
    meta = {
        "command": " ".join(["python"] + sys.argv),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "goal": "R=64, B=64 round < 0.5 ms on H100",
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "results": rows}, f, indent=1)
    key = "round_graph_ms" if args.device == "cuda" else "round_ms"
    print(f"\n{'R':>4} {'B':>4} {'build':>9} {'walk':>9} {'round':>9} {key:>15}")
    for r in rows:
        print(f"{r['R']:>4} {r['B']:>4} {r['build_ms']:>9.3f} {r['walk_ms']:>9.3f} {r['round_ms']:>9.3f} {r.get(key, float('nan')):>15.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
