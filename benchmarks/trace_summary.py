"""Where a round's time goes, from a Chrome trace of bench_e2e_gpu.py --trace-tokens.

    python benchmarks/trace_summary.py benchmarks/results/X_trace_ddtree32_c1.json.gz [--top 25] [--json OUT]

Per engine step (`LLMEngine.step`): wall, GPU busy (the union of kernel, copy and memset intervals)
and GPU idle. The host code the GPU waited on is what ran while it was idle: every Python function's
self time inside the idle intervals ("exposed"), and the inclusive exposed time of the round's
named phases (vLLM's and DDTree's hooks). Steps are split into tree steps (DDTree's walk ran),
decode steps (the target's forward replayed a FULL CUDA graph: flat DFlash's, or a chain) and others
(prefills).
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import re
import sys
from collections import defaultdict

_AT = re.compile(r" at 0x[0-9a-f]+")  # object addresses in built-in methods' names
GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
# phases reported inclusively: (label, substring of the Python event's name)
PHASES = [
    ("step", "llm_engine.py", "step"),
    ("schedule", "scheduler.py", "schedule"),
    ("execute_model", "gpu_model_runner.py", "execute_model"),
    ("prepare_inputs", "gpu_model_runner.py", "_prepare_inputs"),
    ("sample_tokens", "gpu_model_runner.py", "sample_tokens"),
    ("propose_draft_token_ids", "gpu_model_runner.py", "propose_draft_token_ids"),
    ("update_states_after", "gpu_model_runner.py", "_update_states_after_model_execute"),
    ("bookkeeping", "gpu_model_runner.py", "_bookkeeping_sync"),
    ("update_from_output", "scheduler.py", "update_from_output"),
    ("ddtree.build", "build_stage.py", "propose"),
    ("ddtree.build_tree", "core/build.py", "build_tree"),
    ("ddtree.verify.prepare", "verify_stage.py", "prepare"),
    ("ddtree.verify.forward", "verify_stage.py", "forward"),
    ("ddtree.walk", "walk_stage.py", "sample"),
    ("ddtree.commit", "commit_stage.py", "commit"),
    ("ddtree.reorder", "commit_stage.py", "reorder_drafter_inputs"),
]


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def merge(intervals):
    out = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


class Idle:
    """The GPU's idle intervals within [t0, t1]: overlap queries in O(log n)."""

    def __init__(self, busy, t0, t1):
        gaps, cur = [], t0
        for a, b in busy:
            if b <= t0 or a >= t1:
                continue
            if a > cur:
                gaps.append((cur, a))
            cur = max(cur, b)
        if cur < t1:
            gaps.append((cur, t1))
        self.gaps = gaps
        self.starts = [g[0] for g in gaps]
        self.cum = [0.0]
        for a, b in gaps:
            self.cum.append(self.cum[-1] + b - a)

    def overlap(self, a, b) -> float:
        if b <= a or not self.gaps:
            return 0.0
        i = max(bisect.bisect_right(self.starts, a) - 1, 0)
        total = 0.0
        while i < len(self.gaps) and self.gaps[i][0] < b:
            ga, gb = self.gaps[i]
            total += max(0.0, min(b, gb) - max(a, ga))
            i += 1
        return total

    @property
    def total(self) -> float:
        return self.cum[-1]


def self_intervals(events):
    """(name, start, end) self-time pieces of nested Python events of one thread."""
    out, stack = [], []  # stack of [name, start, end, cursor]
    for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
        a, b = e["ts"], e["ts"] + e["dur"]
        while stack and stack[-1][2] <= a:
            n, s, t, cur = stack.pop()
            out.append((n, cur, t))
            if stack:
                stack[-1][3] = t
        if stack:
            out.append((stack[-1][0], stack[-1][3], a))
        stack.append([e["name"], a, b, a])
    while stack:
        n, s, t, cur = stack.pop()
        out.append((n, cur, t))
        if stack:
            stack[-1][3] = t
    return [(_AT.sub("", n), a, b) for n, a, b in out if b > a]


def summarize(events, top: int = 25) -> dict:
    busy = merge([(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in GPU_CATS and e.get("dur")])
    py = [e for e in events if e.get("cat") == "python_function" and e.get("dur")]
    steps = sorted((e for e in py if _is(e["name"], "llm_engine.py", "step")), key=lambda e: e["ts"])
    walks = sorted(e["ts"] for e in py if _is(e["name"], "walk_stage.py", "sample"))
    forwards = [e for e in py if _is(e["name"], "gpu_model_runner.py", "_model_forward")]
    by_tid = defaultdict(list)
    for e in py:
        by_tid[e["tid"]].append(e)
    pieces = sorted((p for evs in by_tid.values() for p in self_intervals(evs)), key=lambda p: p[1])
    piece_starts = [p[1] for p in pieces]
    phase_events = sorted((e["ts"], label, e["dur"]) for e in py for label, f, fn in PHASES if _is(e["name"], f, fn))
    phase_starts = [t for t, _, _ in phase_events]
    phase_events = [(label, t, d) for t, label, d in phase_events]
    # a FULL graph replay of the target's forward marks a decode step (prefills run PIECEWISE)
    replays = sorted(e["ts"] for e in events if e.get("cat") == "cuda_runtime" and e["name"] == "cudaGraphLaunch"
                     and any(f["tid"] == e["tid"] and f["ts"] <= e["ts"] <= f["ts"] + f["dur"] for f in forwards))
    kinds = {"tree": [], "decode": [], "other": []}
    for s in steps:
        t0, t1 = s["ts"], s["ts"] + s["dur"]
        kind = "tree" if _within(walks, t0, t1) else "decode" if _within(replays, t0, t1) else "other"
        kinds[kind].append((t0, t1))
    out = {}
    for kind, spans in kinds.items():
        if not spans:
            continue
        exposed, phase_wall, phase_exposed = defaultdict(float), defaultdict(float), defaultdict(float)
        wall = idle = 0.0
        for t0, t1 in spans:
            gap = Idle(busy, t0, t1)
            wall += t1 - t0
            idle += gap.total
            i = bisect.bisect_left(piece_starts, t0)
            while i < len(pieces) and pieces[i][1] < t1:
                n, a, b = pieces[i]
                exposed[n] += gap.overlap(a, min(b, t1))
                i += 1
            for label, a, d in phase_events[bisect.bisect_left(phase_starts, t0):bisect.bisect_left(phase_starts, t1)]:
                phase_wall[label] += d
                phase_exposed[label] += gap.overlap(a, a + d)
        n = len(spans)
        out[kind] = {
            "steps": n, "wall_ms": wall / n / 1e3, "gpu_busy_ms": (wall - idle) / n / 1e3,
            "gpu_idle_ms": idle / n / 1e3,
            "phases": {k: {"wall_ms": phase_wall[k] / n / 1e3, "gpu_idle_ms": phase_exposed[k] / n / 1e3}
                       for k, *_ in PHASES if phase_wall[k]},
            "exposed_self": [{"name": k, "ms": v / n / 1e3}
                             for k, v in sorted(exposed.items(), key=lambda kv: -kv[1])[:top]],
        }
    return out


def _within(times: list, t0: float, t1: float) -> bool:
    i = bisect.bisect_left(times, t0)
    return i < len(times) and times[i] < t1


def _is(name: str, file: str, fn: str) -> bool:
    return file in name and name.endswith(f": {fn}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json", default=None, help="write the summaries here, keyed by trace")
    args = ap.parse_args(argv)
    result = {}
    for path in args.traces:
        result[path] = s = summarize(load(path), args.top)
        for kind, r in s.items():
            print(f"\n{path} [{kind} steps: {r['steps']}] wall {r['wall_ms']:.2f} ms, GPU busy {r['gpu_busy_ms']:.2f}, "
                  f"idle {r['gpu_idle_ms']:.2f}")
            for k, v in r["phases"].items():
                print(f"  {k:26s} wall {v['wall_ms']:7.3f} ms   while the GPU idled {v['gpu_idle_ms']:7.3f} ms")
            print("  host self time while the GPU idled:")
            for x in r["exposed_self"]:
                print(f"    {x['ms']:7.3f} ms  {x['name'][:110]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
