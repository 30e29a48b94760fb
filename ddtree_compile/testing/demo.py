"""The main demo: vLLM with DDTree on the embedded tiny hybrid model (Qwen3.5 text: GatedDeltaNet +
attention, the family of the Qwen3.6-27B target), per-round stats, and the equality check against a
run without speculation. `kind="qwen3_next"` runs the MoE hybrid instead.

    python -m ddtree_compile.testing.demo [--model qwen3_5] [--budget 16] [--top-k 4] [--draft-len 8] [--max-tokens 96]

(`make demo`; exit status 0 on PASS, 1 on FAIL.)

It writes tiny offline models and drives the test drafter harness, so it lives with the test support
(ddtree_compile.testing), not in the `ddtree-compile` CLI.

Three engines, in this process, eager, CPU:
  1. no speculation (the reference, with top-2 log-probs for the regret gate)
  2. DDTree with the tiny random DFlash drafter (it accepts almost nothing, every round still
     verifies and commits a whole tree)
  3. the same DDTree engine with the harness drafter (drafts built from run 2's own output with
     controlled corruption), so rounds accept deep paths and sibling branches; its output must
     equal run 2 token for token
The hybrid runs in bf16 (vLLM's CPU GDN op needs it), where vLLM's own kernels and the float32
tree templates round differently: DDTree vs no speculation is judged by the regret gate (identical
up to the first divergence, which must be a near-tie at which DDTree took the runner-up token).
"""

from __future__ import annotations

import os
import pathlib
import tempfile
import time


# GDN state cache in float32 for both engines: with the model's bf16, no speculation rounds the state
# after every token and a verify after each accepted path, so two drafters (different accepted paths)
# can round a near-tie apart; in float32 the random and the harness drafter give the same tokens.
STATE = {"mamba_ssm_cache_dtype": "float32"}


def _env() -> None:
    # In-process engine (the per-round printer reads the live runner); no model hub, ever.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


class _RoundPrinter:
    def __init__(self, limit: int):
        self.limit, self.rounds = limit, 0

    def __call__(self, state, step) -> None:
        if self.rounds >= self.limit:
            return
        self.rounds += 1
        walk, tree = step.walk, step.tree
        acc, n, nodes = walk.accepted.tolist(), walk.num_accepted.tolist(), tree.num_nodes.tolist()
        depth = tree.depths.tolist()
        parts = []
        for r in range(step.R):
            path = acc[r][: n[r]]
            branch = "sibling" if any(s != d for d, s in enumerate(path)) else "chain"
            parts.append(f"req{r}: {nodes[r]} nodes, accepted depth {n[r] - 1} via slots {path[1:] or '-'} "
                         f"({branch}, deepest node depth {max(depth[r])})")
        print(f"  round {self.rounds:>3}: " + " | ".join(parts))


def run_demo(kind: str = "qwen3_5", budget: int = 16, top_k: int = 4, draft_len: int = 8,
                 num_prompts: int = 2, max_tokens: int = 96, rounds_to_print: int = 12, workdir=None) -> dict:
    """Run the demo; returns the outputs, the checks and the DDTree counters."""
    _env()
    from ddtree_compile.integration import config, metrics, plugin
    from ddtree_compile.integration.engines import find_state
    from ddtree_compile.testing import e2e, harness, models

    plugin.register()  # what the installed `vllm.general_plugins` entry point does

    tmp = None
    if workdir is None:
        tmp = tempfile.TemporaryDirectory(prefix="ddtree_demo_")
        workdir = tmp.name
    root = pathlib.Path(workdir)
    target = models.write_tiny_model(kind, root / kind)
    drafter = models.write_tiny_dflash_drafter(target, root / "dflash")
    prompts = models.token_prompts(num_prompts, 16, models.VOCAB, seed=0)
    switch = config.vllm_kwargs(drafter, budget=budget, top_k=top_k, num_speculative_tokens=draft_len)
    print(f"DDTree end to end on a tiny {kind} (vLLM {__import__('vllm').__version__}, CPU, bf16): "
          f"budget {budget}, top_k {top_k}, draft length {draft_len}, {num_prompts} prompts x {max_tokens} tokens")
    print("switch:", " ".join(config.cli_args(drafter, budget=budget, top_k=top_k,
                                               num_speculative_tokens=draft_len)))

    t0 = time.perf_counter()
    with e2e.engine(**models.tiny_llm_kwargs(target, enforce_eager=True, **STATE)) as llm:
        reference = e2e.generate_with_logprobs(llm, prompts, max_tokens)
    t_ref = time.perf_counter() - t0

    try:
        with e2e.engine(**models.tiny_llm_kwargs(target, enforce_eager=True, **STATE, **switch)) as llm:
            state = find_state(llm)
            if state is None:
                raise RuntimeError("DDTree did not attach to the engine (see the log for the reason)")
            t0 = time.perf_counter()
            random_out = e2e.generate(llm, prompts, max_tokens)
            t_random = time.perf_counter() - t0
            counters_random = metrics.collect(llm)[0]
            printer = _RoundPrinter(rounds_to_print)
            state.round_hooks.append(printer)
            h = harness.DraftHarness(harness.reference_from_outputs(prompts, random_out)).install(llm)
            print(f"\nharness drafter rounds (first {rounds_to_print}):")
            t0 = time.perf_counter()
            harness_out = e2e.generate(llm, prompts, max_tokens)
            t_harness = time.perf_counter() - t0
            h.uninstall()
            counters_harness = metrics.counters_delta(metrics.collect(llm)[0], counters_random)
    finally:
        if tmp is not None:  # after the engine is shut down
            tmp.cleanup()

    gates = e2e.gates(reference, random_out)
    same = harness_out == random_out
    print("\nDDTree counters:")
    for name, c in (("random drafter", counters_random), ("harness drafter", counters_harness)):
        print(f"  {name:>15}: {metrics.format_line(c)}")
        print(f"  {'':>15}  accept depth histogram {c['accept_depth_histogram']}")
    print(f"  KV-cache layout vLLM picked on this CPU: {'/'.join(counters_random['kv_layouts'])}")
    print("\nequality checks:")
    for i, g in enumerate(gates):
        verdict = ("identical to no speculation" if g["divergence"] is None else
                   f"first divergence from no speculation at token {g['divergence']}: reference top-2 gap "
                   f"{g['gap']:.3f} nat, DDTree's token is its choice #{(g['rank'] or 0) + 1 if g['rank'] is not None else '>5'} "
                   f"(regret {g['regret']:.3f} nat) -> {'near-tie, OK' if g['ok'] else 'FAIL'}")
        print(f"  prompt {i}: {verdict}")
    print(f"  harness-drafter output == random-drafter output (token for token): {same}")
    print(f"\nwall time: no speculation {t_ref:.1f} s (incl. engine start), DDTree random drafter {t_random:.1f} s, "
          f"harness drafter {t_harness:.1f} s (CPU, torch reference templates)")
    ok = same and all(g["ok"] for g in gates) and counters_random["tree_steps"] > 0
    print("RESULT:", "PASS" if ok else "FAIL")
    return {"ok": ok, "reference": [t for t, _ in reference], "random": random_out, "harness": harness_out,
            "gates": gates, "counters": {"random": counters_random, "harness": counters_harness}}


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m ddtree_compile.testing.demo",
                                     description="vLLM with DDTree on the embedded tiny hybrid model, checked "
                                                 "against no speculation")
    parser.add_argument("--model", choices=("qwen3_5", "qwen3_next", "qwen3"), default="qwen3_5")
    parser.add_argument("--budget", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--draft-len", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args(argv)
    result = run_demo(kind=args.model, budget=args.budget, top_k=args.top_k, draft_len=args.draft_len,
                      max_tokens=args.max_tokens)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
