"""`tree_verify_pass`: the object vLLM calls as its post-grad custom pass.

    compilation_config={"inductor_passes": {"post_grad_custom_post_pass": "ddtree_compile.tree_verify_pass"}}

vLLM resolves that name with `__import__("ddtree_compile").__dict__["tree_verify_pass"]`, so the
package's __init__ re-exports this object. The module is light (torch only): vLLM, the rules and
the engine are imported on the first call.

vLLM uses a pass object as is only if it is an `InductorPass` (otherwise it wraps it in a
`CallableInductorPass` whose uuid hashes only the class source). Importing vLLM here would cost
seconds on every `import ddtree_compile`, so the object reports vLLM's `InductorPass` flavour
through `__class__` once vLLM is loaded (the same mechanism `unittest.mock` uses for
isinstance), and plain `CustomGraphPass` before.

uuid(): sha256 of the package version, the rule table (canonical JSON) and the engine source,
so vLLM's and Inductor's compile caches key on exactly what decides the rewritten graph.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import sys

from torch._inductor.custom_graph_pass import CustomGraphPass

DUMP_ENV = "DDTREE_DUMP_DIR"  # set by `ddtree-compile dump`: write each graph before/after
STRICT_ENV = "DDTREE_PASS_STRICT"  # "0": report unmatched tree-relevant ops instead of raising


class TreeVerifyPass(CustomGraphPass):
    def __init__(self, strict: bool = True):
        self.strict = strict
        self.reports: list = []  # one RewriteReport per graph this process rewrote
        self.observers: list = []  # in-process hooks: fn(before_code, graph, report) after a rewrite
        self._engine = None

    # -- what vLLM / Inductor call ---------------------------------------------------------
    def __call__(self, graph) -> None:
        engine = self.engine()
        if engine is None:  # a vLLM outside the adapters' window: the graph stays vLLM's (flat DFlash)
            return
        dump_dir = os.environ.get(DUMP_ENV)
        before = graph.python_code("self").src if dump_dir or self.observers else None
        report = None
        try:
            strict = self.strict and os.environ.get(STRICT_ENV, "1") != "0"
            report = engine.run(graph, strict=strict)
        finally:  # dump even when strict mode refuses the graph: that is when it is needed
            if dump_dir:
                _dump(dump_dir, before, graph, report.to_json() if report else {"error": "unmatched ops"})
        self.reports.append(report)
        for fn in self.observers:
            fn(before, graph, report)

    def uuid(self) -> str:
        from ddtree_compile.passes import rules

        h = hashlib.sha256()
        h.update(_package_version().encode())
        h.update(rules.rules_digest().encode())
        h.update((pathlib.Path(__file__).parent / "engine.py").read_bytes())
        return h.hexdigest()

    def is_applicable_for_range(self, compile_range) -> bool:  # vLLM PostGradPassManager API
        return True

    # -- helpers -----------------------------------------------------------------------------
    def engine(self):
        """The rewrite engine, or None on a vLLM outside the adapters' window (refused once, logged
        and counted, like the plugin does)."""
        if self._engine is None:
            import ddtree_compile.adapters as adapters
            from ddtree_compile.passes.engine import RewriteEngine

            try:
                adapters.check()
            except adapters.UnsupportedVLLM as e:
                from ddtree_compile.integration.metrics import refuse_once

                refuse_once(str(e), "the tree-verify pass leaves the graphs unchanged")
                return None
            self._engine = RewriteEngine()
        return self._engine

    def __reduce__(self):  # pickles (vLLM ships its config to engine processes) as the singleton
        return (_singleton, ())

    @property
    def __class__(self):
        base = _vllm_inductor_pass()
        return _flavoured(base) if base is not None else TreeVerifyPass


def _vllm_inductor_pass():
    mod = sys.modules.get("vllm.compilation.passes.inductor_pass")
    return getattr(mod, "InductorPass", None)


_FLAVOURS: dict = {}


def _flavoured(base):
    """A subclass of (TreeVerifyPass, vLLM's InductorPass) for isinstance checks only."""
    if base not in _FLAVOURS:
        _FLAVOURS[base] = type("TreeVerifyPass", (TreeVerifyPass, base), {"__module__": __name__})
    return _FLAVOURS[base]


def _package_version() -> str:
    try:
        from importlib.metadata import version

        return version("ddtree-compile")
    except Exception:
        return "unknown"


def _dump(out_dir: str, before: str | None, graph, report: dict | None) -> None:
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    n = len(list(out.glob("graph_*_before.py")))
    (out / f"graph_{n}_before.py").write_text(before or "")
    (out / f"graph_{n}_after.py").write_text(graph.python_code("self").src)
    (out / f"graph_{n}_report.json").write_text(json.dumps(report, indent=2))


tree_verify_pass = TreeVerifyPass()


def _singleton():
    return tree_verify_pass


def compilation_config(platform: str = "cpu", pass_name: str = "ddtree_compile.tree_verify_pass") -> dict:
    """vLLM `compilation_config` that installs the pass where it sees the attention / GDN ops.

    cpu: vLLM compiles the whole model with Inductor (mode 2); the pass sees every op as is.
    cuda / rocm (VLLM_COMPILE): the default piecewise split hides the attention / GDN ops inside
    splitting submodules that no Inductor pass sees. `use_inductor_graph_partition=True` keeps one
    graph for the passes and partitions later, at the ops in `splitting_ops`, so the ddtree
    replacements must be listed there too (they stay outside piecewise CUDA graphs like the
    originals), and vLLM's KV-cache write (rules.TREE_SAFE) stays a split point as in vLLM's own
    default split. Needs torch >= 2.9.
    """
    cfg = {"inductor_passes": {"post_grad_custom_post_pass": pass_name}}
    if platform == "cpu":
        return cfg
    cfg["use_inductor_graph_partition"] = True
    cfg["splitting_ops"] = splitting_ops(platform)
    return cfg


def splitting_ops(platform: str) -> list[str]:
    """vLLM's attention-like ops, the `ddtree::` mirrors of this platform's rules (kept out of piecewise
    CUDA graphs like the ops they stand for) and vLLM's KV-cache write (rules.TREE_SAFE), as vLLM's own
    default split has it."""
    import ddtree_compile.adapters as adapters
    from ddtree_compile.passes import rules

    ours = [r.replacement for r in rules.parse_rules() if platform in r.platforms]
    return adapters.current().attention_splitting_ops() + sorted(set(ours)) + sorted(rules.TREE_SAFE)


def traced_compilation_config(platform: str = "cpu") -> dict:
    """vLLM `compilation_config` of an engine whose model is traced with vLLM's attention / GDN ops already
    pointed at their `ddtree::` mirrors (additional_config ddtree op_swap "trace": integration/plugin.py):
    no pass to install. cpu: vLLM's own. cuda / rocm: vLLM's own FX split (no graph partition), the
    mirrors split points beside vLLM's ops, so vLLM's GDN op runs outside Inductor's code as in flat
    DFlash's engines (in one Inductor graph, partitioned or not, vLLM 0.26's GDN verify kernel took
    1.09-1.12x on an H100: benchmarks/results/chain_step_h100_4b.json)."""
    return {} if platform == "cpu" else {"splitting_ops": splitting_ops(platform)}
