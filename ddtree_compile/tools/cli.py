"""`ddtree-compile` command line: demo (vLLM + DDTree end to end), round (one toy round), dump,
precompile (compile cache and cost table per budget)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ddtree-compile", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="vLLM with DDTree on the embedded tiny hybrid model, checked against "
                                       "no speculation")
    demo.add_argument("--model", choices=("qwen3_5", "qwen3_next", "qwen3"), default="qwen3_5")
    demo.add_argument("--budget", type=int, default=16)
    demo.add_argument("--top-k", type=int, default=4)
    demo.add_argument("--draft-len", type=int, default=8)
    demo.add_argument("--max-tokens", type=int, default=96)

    rnd = sub.add_parser("round", help="one DDTree round (build, walk, commit plan) on a toy example, no vLLM")
    rnd.add_argument("--budget", type=int, default=12)
    rnd.add_argument("--top-k", type=int, default=3)
    rnd.add_argument("--seed", type=int, default=0)

    from ddtree_compile.tools import precompile

    precompile.add_arguments(sub.add_parser("precompile", help="warm vLLM's compile cache per budget and write "
                                                              "the cost table of every (budget, batch) bucket"))

    try:
        from ddtree_compile.tools import dump
    except ImportError:  # dump needs vLLM; the core works without it
        dump = None
    if dump is not None:
        dump.add_arguments(sub.add_parser("dump", help="write vLLM's graphs before/after the tree pass"))

    args = parser.parse_args(argv)
    if args.command == "demo":
        from ddtree_compile.tools.demo import run_demo

        result = run_demo(kind=args.model, budget=args.budget, top_k=args.top_k, draft_len=args.draft_len,
                              max_tokens=args.max_tokens)
        return 0 if result["ok"] else 1
    if args.command == "round":
        from ddtree_compile.tools.round_demo import run_round

        run_round(budget=args.budget, top_k=args.top_k, seed=args.seed)
        return 0
    if args.command == "precompile":
        return precompile.main(args)
    return dump.run(args)


if __name__ == "__main__":
    sys.exit(main())
