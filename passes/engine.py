"""The generic rewrite engine: applies the rule table (rules.py) to a post-grad FX graph.

It matches a rule's source op both as a plain call (`vllm.unified_kv_cache_update.default(...)`)
and inside `auto_functionalized(op, **kwargs)` (v1, which vLLM forces, and v2), swaps the op for
its `ddtree::` mirror (same schema, so the arguments stay as they are and layer_name stays the
graph input it is), and leaves every other node alone. It is idempotent: rewritten nodes no longer match, so a
second run changes nothing. Ops that matter to a tree verify (tree_relevant_ops) that no active
rule rewrote are reported as unmatched; in strict mode that is an error.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import torch
from torch import fx

from ddtree_compile.passes import rules as rules_mod

_AF = torch.ops.higher_order.auto_functionalized
_AF_V2 = getattr(torch.ops.higher_order, "auto_functionalized_v2", None)


class UnmatchedOpError(RuntimeError):
    """The graph holds tree-relevant ops that no active rule rewrites."""


@dataclass
class RewriteReport:
    rules: dict = field(default_factory=dict)  # rule -> {"matched", "rewritten", "already_rewritten"}
    unmatched: list = field(default_factory=list)  # "ns::op" per unrewritten tree-relevant node
    unmatched_nodes: list = field(default_factory=list)  # "node: ns::op.overload"
    graph_nodes: int = 0

    @property
    def changed(self) -> bool:
        return any(v["rewritten"] for v in self.rules.values())

    def to_json(self) -> dict:
        return {"rules": self.rules, "unmatched": self.unmatched, "unmatched_nodes": self.unmatched_nodes,
                "graph_nodes": self.graph_nodes}


def call_op(node: fx.Node):
    """(op overload, is_auto_functionalized) for a call_function node, else (None, False)."""
    if node.op != "call_function":
        return None, False
    if node.target is _AF or (_AF_V2 is not None and node.target is _AF_V2):
        op = node.args[0] if node.args else None
        return (op, True) if isinstance(op, torch._ops.OpOverload) else (None, False)
    if isinstance(node.target, torch._ops.OpOverload):
        return node.target, False
    return None, False


def op_key(op) -> str:
    """'ns::op.overload'."""
    return f"{op._schema.name}.{op._overloadname}"


@dataclass
class _Active:
    rule: rules_mod.Rule
    source: torch._ops.OpOverload
    replacement: torch._ops.OpOverload


class RewriteEngine:
    """Holds the resolved rules; `run(graph)` rewrites one graph in place and returns a report."""

    def __init__(self, rows=None, platform: str | None = None, vllm_version: str | None = None):
        from ddtree_compile.integration import tree_ops

        self.active: list[_Active] = []
        for rule, src in rules_mod.load_rules(rows, platform, vllm_version):
            try:
                repl = tree_ops.register_mirror(src, rule.tree_impl)
            except Exception as e:
                raise rules_mod.RuleError(f"rule {rule.name!r}: cannot register {rule.replacement} "
                                          f"for {rule.source}: {e}") from e
            self.active.append(_Active(rule, src, repl))
        self.by_source = {a.source: a for a in self.active}
        self.by_replacement = {a.replacement: a for a in self.active}
        self.tree_relevant = rules_mod.tree_relevant_ops(rows)

    def run(self, graph: fx.Graph, strict: bool = True) -> RewriteReport:
        report = RewriteReport(rules={a.rule.name: {"matched": 0, "rewritten": 0, "already_rewritten": 0}
                                      for a in self.active})
        for node in list(graph.nodes):
            report.graph_nodes += 1
            op, wrapped = call_op(node)
            if op is None:
                continue
            if op in self.by_replacement:
                report.rules[self.by_replacement[op].rule.name]["already_rewritten"] += 1
                continue
            act = self.by_source.get(op)
            if act is not None:
                report.rules[act.rule.name]["matched"] += 1
                _rewrite(node, act, wrapped)
                report.rules[act.rule.name]["rewritten"] += 1
                continue
            if op._schema.name in self.tree_relevant:
                report.unmatched.append(op._schema.name)
                report.unmatched_nodes.append(f"{node.name}: {op_key(op)}")
        graph.lint()
        if strict and report.unmatched:
            counts = collections.Counter(report.unmatched)
            raise UnmatchedOpError(
                "tree-verify pass: the graph holds tree-relevant ops that no active rule rewrites: "
                + ", ".join(f"{k} x{v}" for k, v in sorted(counts.items()))
                + f" (active rules: {', '.join(a.rule.name for a in self.active)})")
        return report


def _rewrite(node: fx.Node, act: _Active, wrapped: bool) -> None:
    """Point the node at the mirror op; its arguments stay (the mirror has the source's schema)."""
    if wrapped:
        node.args = (act.replacement, *node.args[1:])
    else:
        node.target = act.replacement
    node.meta["ddtree_rule"] = act.rule.name
