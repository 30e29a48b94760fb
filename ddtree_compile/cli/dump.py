"""`ddtree-compile dump --model DIR --out DIR [--budget B]`: show what the tree-verify pass does.

Starts vLLM in this process on a local model folder (dummy weights unless the folder has
weights), with the pass installed and every compile cache off (so the pass really runs), and
writes into --out:

  graphs/graph_<i>_before.py, graphs/graph_<i>_after.py   each post-grad graph as FX code
  graphs/graph_<i>_report.json                            the pass report for that graph
  summary.json   {"rules": {RULE: {"matched": N, "rewritten": N}}, "unmatched": [OP, ...], ...}
  depyf/         decompiled Dynamo bytecode and graphs (with --depyf)

Exit status 0 when every tree-relevant op was rewritten, 1 when some were not (listed under
"unmatched"), 2 when vLLM failed to start. Importing this module is cheap; vLLM is imported in run().
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import sys
import tempfile
import threading
import time

_HYBRID_ARCHS = ("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="local model folder (config.json; weights optional)")
    parser.add_argument("--out", required=True, help="output folder (created)")
    parser.add_argument("--budget", type=int, default=None,
                        help="tree budget B: start vLLM with num_speculative_tokens=B (an ngram "
                             "speculator), so GatedDeltaNet caches have the tree-verify width")
    parser.add_argument("--dtype", default=None, help="model dtype (default: bfloat16 for hybrid "
                        "GatedDeltaNet models, whose CPU op needs it; else the config's)")
    parser.add_argument("--depyf", action="store_true", help="also write depyf's decompiled source")
    parser.add_argument("--load-format", default=None,
                        help="vLLM load format (default: dummy when the folder has no weights)")


class _Progress:
    """A one-line 'compiling... Ns' ticker on stderr while vLLM starts and compiles."""

    def __init__(self, what: str):
        self.what, self._stop, self.t0 = what, threading.Event(), time.time()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        tty = sys.stderr.isatty()
        while not self._stop.wait(1.0 if tty else 10.0):
            msg = f"ddtree-compile dump: {self.what} ({time.time() - self.t0:.0f} s)"
            sys.stderr.write(f"\r{msg}" if tty else f"{msg}\n")
            sys.stderr.flush()

    def __enter__(self):
        sys.stderr.write(f"ddtree-compile dump: {self.what}...\n")
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        sys.stderr.write(f"\rddtree-compile dump: {self.what}: done in {time.time() - self.t0:.1f} s\n")


def _check_args(args) -> pathlib.Path:
    model = pathlib.Path(args.model)
    if not (model / "config.json").is_file():
        raise ValueError(f"--model {args.model!r}: not a model folder (no config.json)")
    if args.budget is not None and not 1 <= args.budget <= 1024:
        raise ValueError(f"--budget must be in [1, 1024], got {args.budget}")
    return model


def run(args) -> int:
    try:
        model = _check_args(args)
    except ValueError as e:
        print(f"ddtree-compile dump: {e}", file=sys.stderr)
        return 2
    out = pathlib.Path(args.out)
    graphs = out / "graphs"
    graphs.mkdir(parents=True, exist_ok=True)
    for old in graphs.glob("graph_*"):
        old.unlink()
    # Before vLLM is imported: in-process engine, no compile caches (a cached artifact would skip
    # the pass), our own cache root, and the pass dumping each graph instead of raising.
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_DISABLE_COMPILE_CACHE="1",
                      TORCHINDUCTOR_FORCE_DISABLE_CACHES="1",
                      VLLM_CACHE_ROOT=tempfile.mkdtemp(prefix="ddtree-dump-vllm-cache-"),
                      DDTREE_DUMP_DIR=str(graphs), DDTREE_PASS_STRICT="0")
    import torch._inductor.config as inductor_config

    inductor_config.force_disable_caches = True  # in case Inductor was imported before the env was set
    cfg = json.loads((model / "config.json").read_text())
    arch = (cfg.get("architectures") or ["?"])[0]
    has_weights = any(model.glob("*.safetensors")) or any(model.glob("*.bin"))
    kwargs = dict(
        model=str(model), skip_tokenizer_init=True, max_model_len=512, max_num_seqs=4,
        max_num_batched_tokens=512, kv_cache_memory_bytes=64 << 20, enable_prefix_caching=False,
        load_format=args.load_format or ("auto" if has_weights else "dummy"),
        compilation_config={"inductor_passes": {"post_grad_custom_post_pass": "ddtree_compile.tree_verify_pass"}},
    )
    kwargs["dtype"] = args.dtype or ("bfloat16" if arch in _HYBRID_ARCHS else "auto")
    if args.budget is not None:
        kwargs["speculative_config"] = {"method": "ngram", "num_speculative_tokens": args.budget,
                                        "prompt_lookup_max": 3, "prompt_lookup_min": 2}

    from ddtree_compile.passes.entry import tree_verify_pass

    _ensure_exported(tree_verify_pass)
    first = len(tree_verify_pass.reports)  # reports of earlier engines in this process are not ours
    t0 = time.time()
    try:
        with _Progress(f"starting vLLM on {model} ({arch}) and compiling"):
            llm = _start(kwargs, out / "depyf" if args.depyf else None)
    except Exception as e:  # vLLM's own error, with whatever the pass dumped so far
        print(f"ddtree-compile dump: vLLM failed to start: {type(e).__name__}: {e}", file=sys.stderr)
        _write_summary(out, model, arch, args, tree_verify_pass, first, time.time() - t0, error=str(e))
        return 2
    summary = _write_summary(out, model, arch, args, tree_verify_pass, first, time.time() - t0)
    del llm
    rules = ", ".join(f"{k} {v['rewritten']}/{v['matched']}" for k, v in summary["rules"].items() if v["matched"])
    print(f"ddtree-compile dump: {summary['num_graphs']} graph(s); rewritten/matched: {rules or 'none'}; "
          f"unmatched: {summary['unmatched'] or 'none'}; wrote {out}")
    return 1 if summary["unmatched"] else 0


def _ensure_exported(pass_obj) -> None:
    """vLLM resolves the pass as an attribute of the top-level package."""
    import ddtree_compile

    if getattr(ddtree_compile, "tree_verify_pass", None) is not pass_obj:
        ddtree_compile.tree_verify_pass = pass_obj


def _start(kwargs, depyf_dir):
    from vllm import LLM

    if depyf_dir is None:
        return LLM(**kwargs)
    import depyf

    depyf_dir.mkdir(parents=True, exist_ok=True)
    with depyf.prepare_debug(str(depyf_dir)):
        return LLM(**kwargs)


def _write_summary(out, model, arch, args, pass_obj, first, seconds, error=None) -> dict:
    import vllm

    from ddtree_compile.passes.rules import current_platform_name

    reports = [r for r in pass_obj.reports[first:] if r is not None]
    rules: dict = collections.defaultdict(lambda: {"matched": 0, "rewritten": 0})
    unmatched: list = []
    for r in reports:
        for name, c in r.rules.items():
            rules[name]["matched"] += c["matched"]
            rules[name]["rewritten"] += c["rewritten"]
        unmatched += r.unmatched
    summary = {
        "rules": dict(rules),
        "unmatched": sorted(set(unmatched)),
        "unmatched_nodes": [n for r in reports for n in r.unmatched_nodes],
        "num_graphs": len(reports),
        "graphs": [{"before": f"graphs/graph_{i}_before.py", "after": f"graphs/graph_{i}_after.py",
                    "report": f"graphs/graph_{i}_report.json"} for i in range(len(reports))],
        "model": str(model), "architecture": arch, "budget": args.budget,
        "vllm_version": vllm.__version__, "platform": current_platform_name(),
        "pass_uuid": pass_obj.uuid(), "compile_seconds": round(seconds, 1),
    }
    if error is not None:
        summary["error"] = error
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="ddtree-compile dump", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
