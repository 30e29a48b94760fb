"""`ddtree-compile` command line: demo, dump."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ddtree-compile", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run a DDTree round on a tiny built-in example")
    demo.add_argument("--budget", type=int, default=12)
    demo.add_argument("--top-k", type=int, default=3)
    demo.add_argument("--seed", type=int, default=0)

    try:
        from . import dump
    except ImportError:  # dump needs vLLM; the core works without it
        dump = None
    if dump is not None:
        dump.add_arguments(sub.add_parser("dump", help="write vLLM's graphs before/after the tree pass"))

    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import run_demo

        run_demo(budget=args.budget, top_k=args.top_k, seed=args.seed)
        return 0
    return dump.run(args)


if __name__ == "__main__":
    sys.exit(main())
