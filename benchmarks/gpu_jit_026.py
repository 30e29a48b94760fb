"""Which Triton kernels compile after start-up, per batch size (issue 27: the first run at a new batch
size was slow on the H100, in DDTree's engines only).

    python benchmarks/gpu_jit_026.py --out benchmarks/results/gpu_jit_026_h100.json [--kind qwen3_next_dense]

One DDTree engine (gpu_e2e_026's tiny target and drafter, FULL_AND_PIECEWISE graphs, budget 16, top_k 4,
L 7) runs greedy batches of 1, 2, 3, 4, 1, 3 and 5 requests; a Triton post-compile hook records every kernel
compiled (or loaded from Triton's disk cache) in this process, with its specialization key, the phase
(start-up or batch R) and the time. A round whose eager kernels specialize on something that changes
with the batch shows compiles in the batch phases. First, without an engine, the tree build at the
4B shape (vocabulary 151936, L 15, budget 32, top_k 8, bf16 logits): the warm-up's batch sizes
(`draft_topk.variant_batches`, as BuildStage._warm_up runs them), then every batch of 1..64 requests,
which must compile nothing more (`topk_sweep_compiles`).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import gpu_e2e_026 as e2e  # noqa: E402  (sets the engine environment before vLLM is imported)

BATCHES = (1, 2, 3, 4, 1, 3, 5)
MAX_TOKENS = 32


class CompileLog:
    def __init__(self):
        self.phase = "startup"
        self.events: list[dict] = []
        self.t0 = time.perf_counter()

    def __call__(self, *args, **kw):
        fn = kw.get("fn")
        name = getattr(fn, "name", None) or getattr(fn, "__name__", None) or str(fn)
        comp = kw.get("compile") or {}
        self.events.append({"phase": self.phase, "kernel": str(name).rsplit(".", 1)[-1],
                            "t_s": round(time.perf_counter() - self.t0, 3),
                            "repr": str(kw.get("repr"))[:1500],  # name[options](arg: type+specialization, ...)
                            "key": str(kw.get("key"))[:1500],
                            "constants": str(comp.get("constants"))[:400]})
        return None


def topk_sweep(log: CompileLog, max_batch: int = 64, vocab: int = 151936, L: int = 15) -> dict:
    import torch

    import ddtree_compile as dd
    from ddtree_compile.templates.draft_topk import variant_batches

    dev = torch.device("cuda")
    spec = dd.TreeSpec(budget=32, top_k=8)
    buf = torch.zeros(max_batch, L, vocab, dtype=torch.bfloat16, device=dev)
    sizes = variant_batches(max_batch, spec.depth_limit(L), vocab, dev)
    log.phase = "topk_warm"
    n0 = len(log.events)
    t = time.perf_counter()
    for r in sizes:
        dd.build_tree(buf[:r], spec)
    torch.cuda.synchronize()
    warm_s, n1 = time.perf_counter() - t, len(log.events)
    log.phase = "topk_sweep"
    t = time.perf_counter()
    for R in range(1, max_batch + 1):
        dd.build_tree(buf[:R], spec)
    torch.cuda.synchronize()
    out = {"warm_batches": sizes, "warm_compiles": n1 - n0, "warm_s": warm_s,
           "topk_sweep_compiles": len(log.events) - n1, "sweep_s": time.perf_counter() - t}
    print("tree build at the 4B shape:", out, flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--kind", default="qwen3_next_dense")
    args = ap.parse_args(argv)
    import torch
    from triton import knobs

    from ddtree_compile.integration import engines, metrics

    log = CompileLog()
    knobs.runtime.jit_post_compile_hook = log
    topk = topk_sweep(log)
    log.phase = "startup"
    root = pathlib.Path(tempfile.mkdtemp(prefix="ddtree_jit_"))
    target, drafter, extra, _ = e2e._write_models(args.kind, root, args.kind)
    hybrid = args.kind.startswith("qwen3_next") or args.kind.startswith("qwen3_5")
    from ddtree_compile.testing import models

    prompts = models.token_prompts(max(BATCHES), 16, models.VOCAB, seed=0)
    out = {"kind": args.kind, "torch": torch.__version__, "device": torch.cuda.get_device_name(),
           "batches": [], "tree_build_4b": topk}
    llm, start_s = e2e._engine(target, drafter, hybrid=hybrid, **extra)
    out["start_s"] = start_s
    try:
        from ddtree_compile.testing import harness

        for R in BATCHES:
            log.phase = f"batch{R}"
            n0 = len(log.events)
            torch.cuda.synchronize()
            t = time.perf_counter()
            harness.generate(llm, prompts[:R], MAX_TOKENS)
            torch.cuda.synchronize()
            new = log.events[n0:]
            out["batches"].append({"R": R, "wall_s": time.perf_counter() - t, "compiles": len(new),
                                   "kernels": sorted({e["kernel"] for e in new})})
            print(f"batch {R}: {out['batches'][-1]['wall_s']:.2f} s, {len(new)} compiles "
                  f"{out['batches'][-1]['kernels']}", flush=True)
        out["counters"] = {k: v for k, v in metrics.collect(llm)[0].items()
                           if k in ("tree_steps", "graph_steps", "plain_graph_steps")}
    finally:
        engines.shutdown(llm)
        out["events"] = log.events
        pathlib.Path(args.out).write_text(json.dumps(out, indent=1))
    ddtree = [e for e in log.events if e["phase"].startswith("batch")]
    by_kernel: dict[str, list] = {}
    for e in log.events:
        by_kernel.setdefault(e["kernel"], []).append(e)
    for k, evs in by_kernel.items():  # kernels compiled more than once: what their keys differ in
        if len(evs) > 1 and any(e["phase"].startswith("batch") for e in evs):
            print(f"{k}: {len(evs)} variants, phases {[e['phase'] for e in evs]}")
            for e in evs:
                print("   ", e["phase"], e["repr"][:600])
    print(f"compiles after start-up: {len(ddtree)}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
