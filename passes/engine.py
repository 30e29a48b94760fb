"""The generic rewrite engine: applies the rule table (rules.py) to a post-grad FX graph.

It matches a rule's source op both as a plain call (`vllm.unified_kv_cache_update.default(...)`)
and inside `auto_functionalized(op, **kwargs)` (v1, which vLLM forces, and v2), swaps the op for
the rule's ddtree replacement with the mapped arguments (layer_name stays the graph input it
is), and leaves every other node alone. It is idempotent: rewritten nodes no longer match, so a
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
    replacement: torch._ops.OpOverload | None
    arg_map: dict


class RewriteEngine:
    """Holds the resolved rules; `run(graph)` rewrites one graph in place and returns a report."""

    def __init__(self, rows=None, platform: str | None = None, vllm_version: str | None = None):
        from ddtree_compile import vllm_ops

        self.active: list[_Active] = []
        for rule, src in rules_mod.load_rules(rows, platform, vllm_version):
            repl, amap = None, {}
            if rule.replacement is not None:
                name = rule.replacement.split("::", 1)[1]
                try:
                    repl = vllm_ops.register_replacement(name, src)
                except Exception as e:
                    raise rules_mod.RuleError(f"rule {rule.name!r}: cannot register {rule.replacement} "
                                              f"for {rule.source}: {e}") from e
                amap = _check_arg_map(rule, src, repl)
            self.active.append(_Active(rule, src, repl, amap))
        self.by_source = {a.source: a for a in self.active}
        self.by_replacement = {a.replacement: a for a in self.active if a.replacement is not None}
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
                if act.replacement is not None:
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


def _check_arg_map(rule, src, repl) -> dict:
    src_args = [a.name for a in src._schema.arguments]
    dst = repl._schema.arguments
    amap = rule.arg_map([a.name for a in dst])
    for a in dst:
        if a.name not in amap and not a.has_default_value():
            raise rules_mod.RuleError(f"rule {rule.name!r}: replacement arg {a.name!r} has no source")
    bad = {k: v for k, v in amap.items() if v not in src_args}
    if bad:
        raise rules_mod.RuleError(f"rule {rule.name!r}: args map to unknown source args {bad}; "
                                  f"{rule.source} has {src_args}")
    # auto_functionalized returns the mutated args in schema order: keep that order.
    src_mut = [a.name for a in src._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    dst_mut = [amap.get(a.name) for a in dst if a.alias_info is not None and a.alias_info.is_write]
    if src_mut != dst_mut:
        raise rules_mod.RuleError(f"rule {rule.name!r}: mutated args {dst_mut} must map to the source's "
                                  f"{src_mut} in the same order")
    return amap


def _source_kwargs(node: fx.Node, op, wrapped: bool) -> dict:
    if wrapped:
        return dict(node.kwargs)
    out = {}
    schema_args = op._schema.arguments
    for a, v in zip(schema_args, node.args):
        out[a.name] = v
    out.update(node.kwargs)
    return out


def _rewrite(node: fx.Node, act: _Active, wrapped: bool) -> None:
    src = _source_kwargs(node, act.source, wrapped)
    new = {dst: src[s] for dst, s in act.arg_map.items() if s in src}
    if wrapped:
        if node.target is not _AF and act.rule.args != "same":
            raise rules_mod.RuleError(f"rule {act.rule.name!r}: auto_functionalized_v2 needs args='same'")
        node.args = (act.replacement,)
        node.kwargs = new if node.target is _AF else dict(node.kwargs)
    else:
        pos, kw = [], {}
        for i, a in enumerate(act.replacement._schema.arguments):
            if a.name not in new:
                continue
            if a.kwarg_only or kw or len(pos) < i:
                kw[a.name] = new[a.name]  # after a gap (a defaulted arg left out) go by name
            else:
                pos.append(new[a.name])
        node.target = act.replacement
        node.args = tuple(pos)
        node.kwargs = kw
    node.meta["ddtree_rule"] = act.rule.name
