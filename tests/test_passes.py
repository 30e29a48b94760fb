"""Fast tests of the rule table, the rewrite engine, the replacement ops and the pass object.

No vLLM engine here: graphs are built by hand from the real vLLM op overloads (see
test_passes_vllm.py for vLLM's own traced graphs)."""

from __future__ import annotations

import copy
import operator
import pickle

import pytest
import torch
from torch import fx

from ddtree_compile.integration import tree_context
from ddtree_compile.passes import engine as engine_mod
from ddtree_compile.passes import rules as rules_mod
from ddtree_compile.passes.entry import TreeVerifyPass, tree_verify_pass

AF = torch.ops.higher_order.auto_functionalized


@pytest.fixture(scope="module")
def engine():
    return engine_mod.RewriteEngine()


def _row(**over):
    row = dict(rules_mod.RULES[0])
    row.update(over)
    return row


# --- rule table ------------------------------------------------------------------------------

def test_table_rows_parse_and_each_names_a_working_implementation():
    from ddtree_compile.integration.tree_ops import TREE_IMPLS

    rules = rules_mod.parse_rules()
    assert [r.name for r in rules] == [row["name"] for row in rules_mod.RULES]
    for r in rules:
        assert r.tree_impl in TREE_IMPLS and r.source_packet in r.tree_impl.serves
        assert r.replacement == "ddtree::" + r.source_packet.split("::")[1]


def test_a_row_without_a_working_implementation_is_refused_when_the_pass_loads():
    from ddtree_compile.integration.tree_ops import GDN

    with pytest.raises(rules_mod.RuleError, match=r"rule 'fused': tree_impl 'gdn' is not a tree implementation; "
                                                  r"allowed: tree_ops.ATTENTION, tree_ops.GDN"):
        engine_mod.RewriteEngine((_row(name="fused", tree_impl="gdn"),))  # a name, not the implementation
    fused = _row(name="fused", platforms=("cuda",), tree_impl=GDN,
                 source="vllm::qwen_gdn_attention_core_fused_norm_packed.default")
    with pytest.raises(rules_mod.RuleError, match=r"rule 'fused': tree_impl 'gdn' does not serve "
                                                  r"vllm::qwen_gdn_attention_core_fused_norm_packed"):
        rules_mod.parse_rules((fused,))
    assert "vllm::qwen_gdn_attention_core_fused_norm_packed" in rules_mod.tree_relevant_ops()  # compile-time error


def test_rule_naming_a_missing_op_fails_loudly_naming_the_rule():
    bad = _row(name="attention_typo", source="vllm::unified_attention_with_outptu.default")
    with pytest.raises(rules_mod.RuleError, match=r"rule 'attention_typo'.*does not serve"):
        rules_mod.load_rules((bad,))
    bad = _row(name="kv_typo", source="vllm::unified_attention_with_output.defualt")
    with pytest.raises(rules_mod.RuleError, match=r"rule 'kv_typo'.*unified_attention_with_output.defualt"):
        engine_mod.RewriteEngine((bad,))


def test_rule_with_a_missing_defining_module_fails_naming_the_rule():
    bad = _row(name="gone", defined_in="vllm.no_such_module")
    with pytest.raises(rules_mod.RuleError, match=r"rule 'gone': cannot import 'vllm.no_such_module'"):
        rules_mod.load_rules((bad,))


def test_rows_of_other_platforms_are_not_resolved():
    other_platform = _row(name="xpu_only", platforms=("xpu",), source="vllm::unified_attention_with_output.xpu")
    active = rules_mod.load_rules((rules_mod.RULES[0], other_platform), platform="cpu")
    assert [r.name for r, _ in active] == ["attention"]
    # ... but on the platform it names, the xpu row is checked and fails.
    with pytest.raises(rules_mod.RuleError, match="rule 'xpu_only'"):
        rules_mod.load_rules((other_platform,), platform="xpu", vllm_version="0.32.0")


def test_a_vllm_outside_the_window_is_refused():
    with pytest.raises(rules_mod.RuleError, match=r"vLLM 0.99.0 is not supported.*release lines: 0.32.x, 0.26.x"):
        rules_mod.load_rules(platform="cpu", vllm_version="0.99.0")


@pytest.mark.parametrize("field,value,msg", [
    ("platforms", ("tpu",), "platforms"),
    ("source", "unified_attention_with_output", "must look like"),
    ("tree_impl", None, "tree_impl None is not a tree implementation"),
    ("vllm", ">=0.32", r"vllm '>=0.32' is not a release line with an adapter; allowed values: 0.32, 0.26"),
])
def test_malformed_rows_are_rejected(field, value, msg):
    with pytest.raises(rules_mod.RuleError, match=msg):
        rules_mod.parse_rule(_row(**{field: value}))


def test_duplicate_and_unknown_fields_are_rejected():
    with pytest.raises(rules_mod.RuleError, match="duplicate rule names"):
        rules_mod.parse_rules((rules_mod.RULES[0], rules_mod.RULES[0]))
    with pytest.raises(rules_mod.RuleError, match="unknown fields"):
        rules_mod.parse_rule(_row(colour="red"))


# --- engine on hand-built graphs ---------------------------------------------------------------

def _attention_graph(n_layers=2, extra_mamba=False):
    """Like vLLM's post-grad graph: plain KV update + auto_functionalized attention per layer."""
    attn = torch.ops.vllm.unified_attention_with_output.default
    kvu = torch.ops.vllm.unified_kv_cache_update.default
    g = fx.Graph()
    q, k, v = g.placeholder("q"), g.placeholder("k"), g.placeholder("v")
    outs = []
    for i in range(n_layers):
        name = g.placeholder(f"layer_name_{i}")
        dep = g.call_function(kvu, (k, v, name))
        buf = g.call_function(torch.ops.aten.empty.memory_format, ([4, 2, 8],), {"dtype": torch.float32})
        af = g.call_function(AF, (attn,), dict(query=q, key=k, value=v, output=buf, layer_name=name,
                                               output_scale=None, output_block_scale=None,
                                               kv_cache_dummy_dep=dep))
        outs.append(g.call_function(operator.getitem, (af, 1)))
    if extra_mamba:
        import vllm.model_executor.layers.mamba.mamba_mixer2  # noqa: F401  registers vllm::mamba_mixer2

        name = g.placeholder("mamba_name")
        buf = g.call_function(torch.ops.aten.empty.memory_format, ([4, 8],), {"dtype": torch.float32})
        g.call_function(AF, (torch.ops.vllm.mamba_mixer2.default,),
                        dict(projected_states=q, output=buf, layer_name=name))
    g.output(tuple(outs))
    return g


def _code(g):
    return g.python_code("self").src


def test_engine_rewrites_plain_and_wrapped_calls_and_keeps_layer_name_inputs(engine):
    g = _attention_graph()
    before = _code(g)
    report = engine.run(g)
    assert {k: v for k, v in report.rules.items() if v["matched"]} == {
        "attention": {"matched": 2, "rewritten": 2, "already_rewritten": 0}}
    assert report.unmatched == []  # vLLM's KV-cache write is right as it is (rules.TREE_SAFE): not unmatched
    after = _code(g)
    assert "torch.ops.vllm.unified_attention" not in after and after.count("torch.ops.vllm.unified_kv_cache_update") == 2
    # Nothing but the op names changed: layer_name placeholders, kwargs, users, order.
    assert after.replace("torch.ops.ddtree.", "torch.ops.vllm.") == before
    for node in g.nodes:
        op, wrapped = engine_mod.call_op(node)
        if op is not None and op._schema.name.split("::")[0] in ("vllm", "ddtree"):
            assert op._schema.name.startswith("ddtree::") or op._schema.name in rules_mod.TREE_SAFE
            name = node.kwargs["layer_name"] if wrapped else node.args[2]
            assert name.op == "placeholder"


def test_engine_is_idempotent(engine):
    g = _attention_graph()
    engine.run(g)
    once = _code(g)
    report = engine.run(g)
    assert _code(g) == once
    assert not report.changed
    assert report.rules["attention"]["already_rewritten"] == 2


def test_unmatched_tree_relevant_op_is_an_error_not_a_skip(engine):
    g = _attention_graph(n_layers=1, extra_mamba=True)
    with pytest.raises(engine_mod.UnmatchedOpError, match=r"vllm::mamba_mixer2 x1"):
        engine.run(g)
    report = engine.run(_attention_graph(n_layers=1, extra_mamba=True), strict=False)
    assert report.unmatched == ["vllm::mamba_mixer2"]
    assert report.rules["attention"]["rewritten"] == 1


def test_plain_call_keeps_its_arguments(engine):
    g = fx.Graph()
    q, k, v, out, n = (g.placeholder(x) for x in ("q", "k", "v", "out", "n"))
    node = g.call_function(torch.ops.vllm.unified_attention_with_output.default, (q, k, v), {"output": out,
                                                                                             "layer_name": n})
    g.output(node)
    engine.run(g)
    assert node.target is torch.ops.ddtree.unified_attention_with_output.default
    assert node.args == (q, k, v) and node.kwargs == {"output": out, "layer_name": n}


# --- replacement ops and the tree context -------------------------------------------------------

def test_replacement_ops_have_the_original_schemas(engine):
    for act in engine.active:
        src, dst = act.source._schema, act.replacement._schema
        assert [(a.name, str(a.type), a.alias_info and a.alias_info.is_write) for a in src.arguments] == \
               [(a.name, str(a.type), a.alias_info and a.alias_info.is_write) for a in dst.arguments]
        assert [str(r.type) for r in src.returns] == [str(r.type) for r in dst.returns]


def test_tree_context_api():
    from ddtree_compile.core.tree import ancestor_closure, pack_bits

    parents = torch.tensor([[-1, 0, 0, 1]])
    anc = ancestor_closure(parents, 3)
    meta = tree_context.TreeVerifyMetadata(ancestor_bits=pack_bits(anc), depths=anc.sum(-1) - 1, parents=parents)
    assert (meta.num_requests, meta.num_slots) == (1, 4)
    assert tree_context.current_tree_verify() is None
    with tree_context.tree_verify(meta) as m:
        assert tree_context.current_tree_verify() is m is meta
        inner = tree_context.TreeVerifyMetadata(ancestor_bits=meta.ancestor_bits, depths=meta.depths, parents=parents)
        with tree_context.tree_verify(inner):
            assert tree_context.current_tree_verify() is inner
        assert tree_context.current_tree_verify() is meta
    assert tree_context.current_tree_verify() is None
    with pytest.raises(ValueError, match="expected TreeVerifyMetadata"):
        tree_context.set_tree_verify({"parents": parents})


# --- the pass object vLLM calls ----------------------------------------------------------------

def test_pass_uuid_is_stable_and_keys_on_the_rules(monkeypatch):
    u = tree_verify_pass.uuid()
    assert u == TreeVerifyPass().uuid() and len(u) == 64
    monkeypatch.setattr(rules_mod, "RULES", rules_mod.RULES[:-1])
    assert TreeVerifyPass().uuid() != u


def test_pass_is_a_vllm_inductor_pass_and_pickles_as_the_singleton():
    from torch._inductor.custom_graph_pass import CustomGraphPass
    from vllm.compilation.passes.inductor_pass import InductorPass

    assert isinstance(tree_verify_pass, InductorPass) and isinstance(tree_verify_pass, CustomGraphPass)
    assert pickle.loads(pickle.dumps(tree_verify_pass)) is tree_verify_pass
    assert copy.deepcopy(tree_verify_pass) is tree_verify_pass
    assert tree_verify_pass.is_applicable_for_range(None)


def test_package_exports_the_pass_for_vllms_qualname_lookup():
    from vllm.config import CompilationConfig

    import ddtree_compile

    # vLLM: __import__("ddtree_compile").__dict__["tree_verify_pass"] (no module __getattr__).
    assert ddtree_compile.__dict__.get("tree_verify_pass") is tree_verify_pass
    cc = CompilationConfig(inductor_passes={"post_grad_custom_post_pass": "ddtree_compile.tree_verify_pass"})
    assert cc.inductor_compile_config["post_grad_custom_post_pass"] is tree_verify_pass
    # vLLM's compile-cache key covers the pass through its uuid().
    h = cc.compute_hash()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(TreeVerifyPass, "uuid", lambda self: "another-rule-table")
        assert CompilationConfig(inductor_passes={"post_grad_custom_post_pass": "ddtree_compile.tree_verify_pass"}
                                 ).compute_hash() != h


def test_pass_rewrites_a_graph_and_records_a_report():
    p = TreeVerifyPass()
    seen = []
    p.observers.append(lambda before, graph, report: seen.append((before, report)))
    g = _attention_graph(n_layers=1)
    p(g)
    assert len(p.reports) == 1 and p.reports[0].rules["attention"]["rewritten"] == 1
    assert seen and "torch.ops.vllm.unified_attention_with_output" in seen[0][0]


def test_gpu_compilation_config_sees_and_splits_at_the_replacements():
    from vllm.config import CompilationConfig

    from ddtree_compile.passes.entry import compilation_config

    assert compilation_config("cpu") == {"inductor_passes": {
        "post_grad_custom_post_pass": "ddtree_compile.tree_verify_pass"}}
    cfg = compilation_config("cuda")
    assert cfg["use_inductor_graph_partition"] is True
    for op in ("vllm::unified_attention_with_output", "vllm::qwen_gdn_attention_core", "vllm::unified_kv_cache_update",
               "ddtree::unified_attention_with_output", "ddtree::qwen_gdn_attention_core"):
        assert op in cfg["splitting_ops"]
    assert "ddtree::qwen_gdn_attention_core_fused_norm_packed" not in cfg["splitting_ops"]  # no implementation
    cc = CompilationConfig(**cfg)  # vLLM accepts it
    assert cc.inductor_compile_config["post_grad_custom_post_pass"] is tree_verify_pass


def test_a_trace_claim_redirects_vllms_ops_until_its_engine_goes():
    """op_swap "trace": the claim taken before a runner's model is traced points torch.ops.vllm.X at its
    mirror once per runner, and a refused engine (round/state.attach) gives it back: vLLM's ops again for
    the engines that come next (an eager engine's claim, counted with it, keeps them redirected)."""
    import types

    from ddtree_compile.integration import tree_ops

    rules = rules_mod.load_rules()  # (imports the modules that register vLLM's ops)
    vllm_attn = torch.ops.vllm.unified_attention_with_output
    runner = types.SimpleNamespace()
    try:
        tree_ops.redirect_before_trace(runner, rules)
        tree_ops.redirect_before_trace(runner, rules)  # (once per runner)
        assert tree_ops.traced(runner)
        assert torch.ops.vllm.unified_attention_with_output is torch.ops.ddtree.unified_attention_with_output
        tree_ops.redirect_ops(rules)  # an eager engine's claim
        tree_ops.release_trace(runner)
        assert not tree_ops.traced(runner)
        assert torch.ops.vllm.unified_attention_with_output is torch.ops.ddtree.unified_attention_with_output
        tree_ops.release_redirects()  # the eager engine's shutdown
        assert torch.ops.vllm.unified_attention_with_output is vllm_attn
        tree_ops.release_trace(runner)  # (nothing left to give back)
        assert torch.ops.vllm.unified_attention_with_output is vllm_attn
    finally:
        tree_ops.undo_redirects()
