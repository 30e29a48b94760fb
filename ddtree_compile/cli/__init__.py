"""`ddtree-compile` command line: round (one toy round), dump (the tree pass on vLLM's graphs),
precompile (compile cache and cost table per budget). The vLLM end-to-end demo on tiny offline
models is test support: `make demo` (python -m ddtree_compile.testing.demo)."""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ddtree-compile", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    rnd = sub.add_parser("round", help="one DDTree round (build, walk, commit plan) on a toy example, no vLLM")
    rnd.add_argument("--budget", type=int, default=12)
    rnd.add_argument("--top-k", type=int, default=3)
    rnd.add_argument("--seed", type=int, default=0)

    from ddtree_compile.cli import precompile

    precompile.add_arguments(sub.add_parser("precompile", help="warm vLLM's compile cache per budget and write "
                                                              "the cost table of every (budget, batch) bucket"))

    try:
        from ddtree_compile.cli import dump
    except ImportError:  # dump needs vLLM; the core works without it
        dump = None
    if dump is not None:
        dump.add_arguments(sub.add_parser("dump", help="write vLLM's graphs before/after the tree pass"))

    args = parser.parse_args(argv)
    if args.command == "round":
        from ddtree_compile.cli.round_demo import run_round

        run_round(budget=args.budget, top_k=args.top_k, seed=args.seed)
        return 0
    if args.command == "precompile":
        return precompile.main(args)
    return dump.run(args)
