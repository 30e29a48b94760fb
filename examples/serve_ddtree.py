"""Serve a model with DDTree: the one switch, for `vllm serve` and for `vllm.LLM`.

    # print the `vllm serve` command line (OpenAI server, parsers, scheduler all unchanged)
    python examples/serve_ddtree.py Qwen/Qwen3.6-27B z-lab/Qwen3.6-27B-DFlash --budget 22 --top-k 8

    # or generate offline with vllm.LLM (token-id prompts work without a tokenizer)
    python examples/serve_ddtree.py MODEL DRAFTER --offline --prompt-ids 1,2,3,4 --max-tokens 64

The DDTree plugin (entry point `vllm.general_plugins`: ddtree = "ddtree_compile.integration.plugin:register") is
loaded by vLLM in every process; it stays inert unless `additional_config` holds a "ddtree" entry.
Hybrid (GatedDeltaNet) targets need budget >= draft length (one state slot per tree node).
"""

from __future__ import annotations

import argparse
import shlex

from ddtree_compile.integration import config


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("drafter", help="a DFlash drafter (vLLM method 'dflash')")
    p.add_argument("--budget", type=int, default=22, help="tree nodes verified per round")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--draft-len", type=int, default=15, help="positions the drafter proposes (its block - 1)")
    p.add_argument("--temperature", type=float, default=1.0, help="draft temperature for scoring nodes")
    p.add_argument("--no-chain-seed", action="store_true")
    p.add_argument("--offline", action="store_true", help="run vllm.LLM here instead of printing the command")
    p.add_argument("--prompt-ids", default="1,2,3,4,5,6,7,8")
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args(argv)
    switch = dict(budget=args.budget, top_k=args.top_k, temperature=args.temperature,
                  chain_seed=not args.no_chain_seed, num_speculative_tokens=args.draft_len)
    if not args.offline:
        cmd = ["vllm", "serve", args.model, *config.cli_args(args.drafter, **switch)]
        print(" ".join(shlex.quote(c) for c in cmd))
        return 0

    from vllm import LLM, SamplingParams

    from ddtree_compile.integration import metrics, plugin

    plugin.register()  # the entry point does this once the package is installed
    llm = LLM(model=args.model, **config.vllm_kwargs(args.drafter, **switch))
    prompt = {"prompt_token_ids": [int(t) for t in args.prompt_ids.split(",")]}
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=args.max_tokens))
    print("tokens:", list(out[0].outputs[0].token_ids))
    for snap in metrics.collect(llm):
        print("DDTree:", metrics.format_line(snap))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
