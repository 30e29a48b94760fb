"""budget "auto" (integration/round/auto_budget.py): the per-step choice between the tree and the
drafter's plain chain, its inputs (DDTree's device counters read back without a sync, the cost
table, measured step times) and its settings. Real engines: test_auto_budget_engine.py."""

import json

import pytest
import torch
from _auto_budget_common import BUDGET, L
from _auto_budget_common import rates as _rates

from ddtree_compile.integration import config, metrics
from ddtree_compile.integration.round import auto_budget as ab
from ddtree_compile.integration.round import auto_setup, workspace


# -- settings ------------------------------------------------------------------------------------
def test_settings_name_the_field_and_the_allowed_values():
    cfg = config.parse({"ddtree": {"budget": "auto"}})
    assert cfg.auto and cfg.tree_budget == 32 and cfg.probe_interval == 16 and cfg.cost_table is None
    assert config.parse({"ddtree": cfg.to_dict()}) == cfg  # round trip through vLLM's additional_config
    bad = [({"budget": "big"}, r"\['budget'\] must be an int in \[1, 1024\] or \"auto\""),
           ({"budget": 8, "auto_budget": 16}, r"\['auto_budget'\] is read only with budget \"auto\""),
           ({"budget": 8, "cost_table": "/x"}, r"\['cost_table'\] is read only"),
           ({"budget": "auto", "auto_budget": 0}, r"\['auto_budget'\] must be in \[1, 1024\]"),
           ({"budget": "auto", "probe_interval": 0}, r"\['probe_interval'\] must be >= 1"),
           ({"budget": "auto", "cost_table": 5}, r"\['cost_table'\] must be a path")]
    for raw, msg in bad:
        with pytest.raises(ValueError, match=msg):
            config.parse({"ddtree": raw})
    kw = config.vllm_kwargs("/d", "auto", top_k=4, num_speculative_tokens=7, auto_budget=24)
    assert kw["speculative_config"]["num_speculative_tokens"] == 24  # vLLM's slots hold the tree bucket
    assert "--additional-config" in config.cli_args("/d", "auto", auto_budget=24)


def test_a_budget_menu_names_the_field_and_sizes_vllms_slots_by_its_largest():
    cfg = config.parse({"ddtree": {"budget": "auto", "auto_budget": [16, 4, 8], "top_k": 4}})
    assert cfg.auto_budget == (4, 8, 16) and cfg.tree_budget == 16
    assert cfg.budget_menu(L) == (4, 8, 16)
    # the verifies the round's buffers serve: every bucket's b + 1 and the chain's L + 1 (workspace.py)
    assert workspace.verify_slots(cfg, 15) == (5, 9, 16, 17) and workspace.max_slots(cfg, 15) == 17
    assert workspace.verify_slots(config.parse({"ddtree": {"budget": 8}}), 15) == (9,)
    assert config.parse({"ddtree": json.loads(json.dumps(cfg.to_dict()))}) == cfg  # JSON round trip
    assert config.parse({"ddtree": {"budget": "auto", "auto_budget": [12]}}).auto_budget == 12
    # effective budgets: a top_k 2, L 2 tree holds 6 nodes, so 8 and 16 are one bucket of 6
    assert config.parse({"ddtree": {"budget": "auto", "auto_budget": [3, 8, 16], "top_k": 2}}).budget_menu(2) == (3, 6)
    for bad, msg in (([], r"non-empty list of distinct ints"), ([4, 4], r"non-empty list of distinct ints"),
                     ([4, 0], r"\['auto_budget'\] must be in \[1, 1024\], got 0"),
                     ([4, "8"], r"\['auto_budget'\] must be an int")):
        with pytest.raises(ValueError, match=msg):
            config.parse({"ddtree": {"budget": "auto", "auto_budget": bad}})
    kw = config.vllm_kwargs("/d", "auto", top_k=4, num_speculative_tokens=7, auto_budget=[8, 24])
    assert kw["speculative_config"]["num_speculative_tokens"] == 24


# -- the policy (host logic over a real DDTreeMetrics on the CPU) ---------------------------------
def _round(m, accepted, off):
    """One tree step of DDTreeMetrics: rows accepting `accepted` nodes, `off` of them off the chain."""
    n = len(accepted)
    m.record_round(torch.ones(n, dtype=torch.bool), torch.full((n,), BUDGET), torch.tensor(accepted),
                   torch.tensor(off), torch.zeros(n, dtype=torch.bool))


def _policy(priors=None, probe=4):
    m = metrics.DDTreeMetrics(L, torch.device("cpu"))
    return m, ab.AutoBudget(m, BUDGET, L, probe, priors)


def _step(p, kind, R, t, verify_s, draft_s=0.002, gap_s=0.0):
    """The host's view of one clean step: its proposal (draft_s), vLLM's output processing and
    scheduling (gap_s), its start, the next proposal; it costs draft_s + gap_s + verify_s."""
    p.proposed(kind, R, t, t + draft_s)
    p.verify_began(t + draft_s + gap_s)
    p.step_ended(t + draft_s + gap_s + verify_s)


def _steps(p, kind, R, t, verify_s, n=2, **kw):
    """n steps of one kind in a row, 1 s apart: the first is timed only if a step of its kind (and
    bucket) came right before it."""
    for i in range(n):
        _step(p, kind, R, t + i, verify_s, **kw)


def test_unknown_costs_are_explored_then_the_faster_kind_wins():
    m, p = _policy()
    assert p.choose(1) == ab.TREE  # nothing known: the tree (its acceptance is measured from tree steps)
    _step(p, ab.TREE, 1, 0.0, 0.008)  # the first step follows no step of its kind: not timed
    _step(p, ab.TREE, 1, 0.1, 0.008)  # 8 ms verify + 2 ms drafting, after a tree step: timed
    assert (ab.TREE, 1) not in p.costs and p.choose(1) == ab.TREE  # one timed step is no cost yet: tried again
    _step(p, ab.TREE, 1, 0.2, 0.009)
    _round(m, [5, 3], [2, 0])  # its walk: tree 1 + 8/2 = 5 tokens per round; chain 1 + 6/2 = 4
    kinds = []
    while p.tokens[ab.TREE] is None and len(kinds) < 16:  # the counters are copied back every few
        kinds.append(p.choose(1))  # decisions and read when the copy has completed
    assert p.tokens == {ab.TREE: 5.0, ab.CHAIN: 4.0}
    # the tree until its acceptance is known, then the chain, whose cost at this bucket is unknown
    assert kinds == [ab.TREE] * (len(kinds) - 1) + [ab.CHAIN] and len(kinds) <= 3, kinds
    _step(p, ab.CHAIN, 1, 1.0, 0.030)  # after a tree step: not timed (it carries the tree's leftovers)
    assert (ab.CHAIN, 1) not in p.costs and p.choose(1) == ab.CHAIN
    _step(p, ab.CHAIN, 1, 1.1, 0.004)  # 4 ms verify + 2 ms drafting
    assert p.choose(1) == ab.CHAIN
    _step(p, ab.CHAIN, 1, 1.2, 0.005)
    # the lower quartile of each window (here: its faster step)
    assert p.costs == {(ab.TREE, 1): pytest.approx(0.010), (ab.CHAIN, 1): pytest.approx(0.006)}
    kinds = [p.choose(1) for _ in range(16)]  # 4/6 > 5/10 tokens per ms: the chain wins, the tree is probed
    at = [i for i, k in enumerate(kinds) if k == ab.TREE]
    # a probe is two tree steps (the second is timed); while fewer than 4 of the tree's steps were
    # timed, the next comes probe_interval (4) decisions after the probe's second step
    assert at[:6] == [at[0], at[0] + 1, at[0] + 5, at[0] + 6, at[0] + 10, at[0] + 11], kinds
    assert p.probes == len(at[::2]) and p.probe_gap == {1: 4}
    _steps(p, ab.CHAIN, 1, 2.0, 0.004)  # (after a chain step: both timed) four timed steps: a settled cost
    p.costs[(ab.CHAIN, 1)] = 0.009  # now 4/9 < 5/10: the tree wins
    assert [p.choose(1) for _ in range(4)] == [ab.TREE] * 4 and p.probe_gap == {1: 4}
    # the losing chain is still timed now and then (its cost may have been a stall): settled, as
    # often as its probes cost 1% of the rate, 2 * (9/10 - 4/5) / 1% = 20 decisions apart
    kinds = [p.choose(1) for _ in range(64)]
    at = [i for i, k in enumerate(kinds) if k == ab.CHAIN]
    assert at[:4] == [at[0], at[0] + 1, at[0] + 21, at[0] + 22] and p.chain_probes == len(at[::2]), at
    assert p.snapshot()["chain_probes"] == p.chain_probes
    assert _rates(p, 1)[ab.TREE] == pytest.approx(500.0) and _rates(p, 2)[ab.TREE] is None


def test_a_chain_cost_held_up_by_stalls_is_measured_again():
    """The H100 4B run: both of the chain's first steps at one bucket were stalls (313 ms), the tree
    won from then on and the chain was never timed again. A chain probe times it (every
    probe_interval steps while fewer than 4 of its steps were timed), and the window's lower
    quartile takes the steady cost, so the chain can win again."""
    m, p = _policy(probe=2)
    _steps(p, ab.TREE, 1, 0.0, 0.008, n=5)  # tree: 10 ms per step (four timed steps)
    _round(m, [4, 4], [0, 0])  # the tree accepts no more than the chain: 5 tokens per round each
    while p.tokens[ab.TREE] is None:
        p.choose(1)
    _steps(p, ab.CHAIN, 1, 10.0, 0.311, n=3)  # three stalls (the first not timed): the chain reads 313 ms
    assert p.costs[(ab.CHAIN, 1)] == pytest.approx(0.313)
    kinds = [p.choose(1) for _ in range(3)]
    # the probe, two chain steps, after probe_interval (2) decisions: only two of its steps were timed
    assert kinds == [ab.TREE, ab.CHAIN, ab.CHAIN] and p.chain_probes == 1, kinds
    _steps(p, ab.CHAIN, 1, 20.0, 0.004)  # the chain's steady step: 6 ms (the second timed)
    assert p.costs[(ab.CHAIN, 1)] == pytest.approx(0.006)
    assert _rates(p, 1)[ab.CHAIN] > _rates(p, 1)[ab.TREE]  # 5/6 > 5/10: the chain wins again,
    # (the tree's next probe: 2 * (10/6 - 5/5) / 1% = 133, at most probe_interval * 16 = 32 steps on)
    assert [p.choose(1) for _ in range(4)] == [ab.CHAIN] * 4 and p.probes == 0 and p.probe_gap == {1: 32}


def test_probes_are_scheduled_per_batch_bucket():
    """An H100 4B run (CHANGELOG, 2026-11-26 to 2026-11-27): the chain's cost at c=16 read 41 ms from two
    warm-up stalls; the tree won at 16 (31 ms) while the chain won at the buckets a finishing batch
    shrinks to, and every chain step there reset the one probe clock, so the chain was never timed
    at 16 again (0 chain probes) and auto verified trees at 0.75x flat DFlash. Each bucket keeps its
    own probe clock: the chain is probed at 16 however often it wins at 1."""
    m, p = _policy(probe=2)
    for R in (1, 16):
        _steps(p, ab.TREE, R, 0.0, 0.008, n=3)  # tree: 10 ms at both buckets
    _steps(p, ab.CHAIN, 1, 10.0, 0.004, n=3)  # chain at 1: 6 ms (it wins there)
    _steps(p, ab.CHAIN, 16, 20.0, 0.039, n=3)  # chain at 16: two stalls, 41 ms (the tree wins there)
    _round(m, [4, 4], [0, 0])  # equal acceptance: the cost decides
    while p.tokens[ab.TREE] is None:
        p.choose(16)
    kinds = []
    for _ in range(16):  # a finishing batch: each c=16 step followed by a c=1 step
        kinds.append(p.choose(16))
        assert p.choose(1) in (ab.CHAIN, ab.TREE)
    assert ab.CHAIN in kinds and p.chain_probes >= 1, kinds  # the chain is probed at 16
    _steps(p, ab.CHAIN, 16, 30.0, 0.004)  # its steady step: 6 ms
    assert p.costs[(ab.CHAIN, 16)] == pytest.approx(0.006) and _rates(p, 16)[ab.CHAIN] > _rates(p, 16)[ab.TREE]


def test_a_losing_kind_is_probed_as_often_as_its_probes_cost_one_percent_of_the_rate():
    """A probe of kind k in place of the winner w loses 2 * cost_w * (cost_k / cost_w - E_k / E_w):
    k is probed every 2 * (cost_k / cost_w - E_k / E_w) / 1% steps, within probe_interval ..
    probe_interval * 16. The closer the race, the sooner the loser is measured again: with a
    back-off to 256 steps instead, auto stayed on the chain for most of a cell after the acceptance
    rose on the H100 (1.10x flat DFlash where budget 32 read 1.17x)."""
    m, p = _policy(probe=4)
    _steps(p, ab.TREE, 1, 0.0, 0.0055, n=5)  # tree 7.5 ms (four timed steps: a settled cost)
    _steps(p, ab.CHAIN, 1, 10.0, 0.004, n=5)  # chain 6 ms
    _round(m, [4, 4], [0, 0])  # equal acceptance: the chain wins on cost
    while p.tokens[ab.TREE] is None:
        p.choose(1)

    def probe_gaps(n):
        at = [i for i, k in enumerate(p.choose(1) for _ in range(n)) if k == ab.TREE]
        assert at[1::2] == [i + 1 for i in at[::2]], at  # every probe is two tree steps in a row
        return {b - a - 1 for a, b in zip(at[::2], at[2::2])}  # decisions from a probe's second step on

    assert probe_gaps(200) == {50} and p.probe_gap == {1: 50}  # 2 * (7.5 / 6 - 5 / 5) / 1%
    probes = p.probes
    _round(m, [5, 5], [1, 1])  # the tree accepts one more than the chain: 6 against 5 tokens
    probe_gaps(16)  # (the read-back lands within a few decisions)
    assert p.tokens == {ab.TREE: pytest.approx(5.25), ab.CHAIN: pytest.approx(5.0)}  # (EMA)
    assert probe_gaps(100) == {40} and p.probe_gap == {1: 40} and p.probes > probes  # 2 * (7.5/6 - 5.25/5) / 1%
    p.costs[(ab.TREE, 1)] = 0.030  # a far slower tree: still probed every probe_interval * 16 steps
    assert probe_gaps(300) == {64} and p.probe_gap == {1: 64}


def test_a_step_costs_its_whole_cycle_wherever_the_host_waits():
    """The H100 4B run at c=16: the tree's round has no host sync, so the host waited for its verify
    after the next proposal, in vLLM's output processing; a window from the verify's start to the
    next proposal read 13.9 ms for tree steps that took 34 ms, against 22-39 ms for chain steps
    (vLLM's chain verify syncs inside that window), and auto kept the slower tree. Costed by whole
    cycles, the chain wins there."""
    m, p = _policy()
    # tree: 5 ms drafting, 20 ms waiting in vLLM's output processing, 9 ms in the window
    _steps(p, ab.TREE, 16, 0.0, 0.009, n=3, draft_s=0.005, gap_s=0.020)
    _steps(p, ab.CHAIN, 16, 10.0, 0.020, n=3, draft_s=0.005, gap_s=0.001)  # chain: waits in its window
    assert p.costs == {(ab.TREE, 16): pytest.approx(0.034), (ab.CHAIN, 16): pytest.approx(0.026)}
    _round(m, [6, 5], [1, 0])  # tree 1 + 11/2 = 6.5 tokens per round, chain 1 + 10/2 = 6
    while p.tokens[ab.TREE] is None:
        p.choose(16)
    assert _rates(p, 16)[ab.CHAIN] > _rates(p, 16)[ab.TREE]  # 6/26 ms > 6.5/34 ms
    p._since[ab.TREE, 16] = 0  # (no probe due)
    assert p._decide(16) == ab.CHAIN


def test_a_probe_is_compared_with_its_neighbouring_steps_not_with_stale_costs():
    """A two-H200 run (CHANGELOG, 2026-11-26 to 2026-11-27): the host's speed changed from cell to cell by up to
    1.4x for the same work (flat DFlash's 4B step at c = 1: 10.9 or 15.3 ms), and a batch bucket
    holds batches up to twice its size (16 for 16..31 requests: at c = 64, chain@16 read 29.9 ms where
    the c = 16 cell's read 17.4). A losing kind's cost is timed only at its probes, so its cost and
    the winner's came from different times and batch sizes, and auto verified trees in 20% of the
    c = 64 steps at 0.87x flat DFlash. A probe's timed step is compared with the winner's timed steps
    just before and after it (same host, same batch): from three such ratios on (a median that one
    stall cannot move), the choice uses their median."""
    m, p = _policy(probe=4)
    _round(m, [5, 5], [1, 1])  # tree 6 tokens per round, chain 5
    while p.tokens[ab.TREE] is None:
        p.choose(1)
    _steps(p, ab.CHAIN, 1, 0.0, 0.006, n=3)  # host fast: the chain's step 8 ms
    for t in (10.0, 30.0, 50.0, 70.0):  # four probes of the tree: 12 ms, between chain steps of 8 ms
        _steps(p, ab.TREE, 1, t, 0.010)
        _steps(p, ab.CHAIN, 1, t + 10, 0.006)
    assert p.snapshot()["step_ratio"] == {"chain/tree@1": pytest.approx(8 / 12)}
    assert len(p._pairs[(ab.TREE, ab.CHAIN, 1)]) == 8  # each probe: its neighbour before and after
    _steps(p, ab.CHAIN, 1, 90.0, 0.0108, n=17)  # host slow (x1.6): the chain's step 12.8 ms, not paired
    assert len(p._pairs[(ab.TREE, ab.CHAIN, 1)]) == 8
    assert p.costs == {(ab.TREE, 1): pytest.approx(0.012), (ab.CHAIN, 1): pytest.approx(0.0128)}
    # by these costs the tree would win (6/12 > 5/12.8); at one host speed it costs 1.5x the chain
    # (6/18 < 5/12): the chain wins, and a tree probe is priced at that ratio
    p._since[ab.TREE, 1] = 0
    assert p._decide(1) == ab.CHAIN and p.probe_gap == {1: 60}  # 2 * (12/8 - 6/5) / 1%
    m2, q = _policy(probe=4)  # one probe only: fewer than 3 comparisons, the kinds' own costs decide
    _round(m2, [5, 5], [1, 1])
    while q.tokens[ab.TREE] is None:
        q.choose(1)
    _steps(q, ab.CHAIN, 1, 0.0, 0.006, n=3)
    _steps(q, ab.TREE, 1, 10.0, 0.010)
    _steps(q, ab.CHAIN, 1, 20.0, 0.0108, n=17)  # its first timed step is the tree's neighbour too
    assert len(q._pairs[(ab.TREE, ab.CHAIN, 1)]) == 2
    q._since[ab.CHAIN, 1] = 0
    assert q._decide(1) == ab.TREE


def test_a_step_is_timed_only_after_a_clean_step_of_its_kind_and_bucket():
    """A cycle holds what the step before it left (the host's wait for that step's verify, the
    drafter's run over its verified tokens). On the H100 (4B shape, c = 1) single probes timed after
    steps of the other kind read the tree at 11-13 ms and the chain at 13-17 ms per step, where the
    engines' steady steps took 15.5 and 11.5 ms, and auto kept the tree at 0.84x flat DFlash under
    the +4% profile (an H100 4B run, CHANGELOG)."""
    m, p = _policy()
    for i in range(5):  # alternating kinds, the last a tree: nothing is timed
        _step(p, (ab.TREE, ab.CHAIN)[i % 2], 1, float(i), 0.008)
    assert p.costs == {} and p._samples == {}
    _steps(p, ab.CHAIN, 1, 10.0, 0.004, n=3)  # after a tree step: the first is not timed, then 6 ms twice
    assert p.costs == {(ab.CHAIN, 1): pytest.approx(0.006)} and len(p._samples[(ab.CHAIN, 1)]) == 2
    p.proposed(ab.CHAIN, 1, 20.0, 20.002)  # a step that did not start clean (a prefill joined)
    p.step_ended(20.5)
    _step(p, ab.CHAIN, 1, 21.0, 0.100)  # after it: not timed
    _step(p, ab.CHAIN, 2, 22.0, 0.100)  # after a step of another batch bucket: not timed
    assert len(p._samples[(ab.CHAIN, 1)]) == 2 and (ab.CHAIN, 2) not in p._samples


def test_a_menu_learns_every_buckets_acceptance_from_the_largest_trees_and_picks_the_best_rate():
    """Menu 4 / 8 / 16: the largest tree is measured first (its walks say what the smaller buckets
    would have accepted), then every other kind's cost; then the best tokens per second wins, the
    largest tree is probed for acceptance and every other loser for its cost."""
    m = metrics.DDTreeMetrics(L, torch.device("cpu"))
    p = ab.AutoBudget(m, 16, L, 4, menu=(4, 8, 16))
    t4, t8 = ab.tree_kind(4, 16), ab.tree_kind(8, 16)
    assert p.kinds == [ab.TREE, t8, t4, ab.CHAIN] and p.budget_of(t4) == 4 and p.budget_of(ab.TREE) == 16
    assert p.choose(1) == ab.TREE
    _steps(p, ab.TREE, 1, 0.0, 0.018, n=5)  # 20 ms (four timed steps: a settled cost)
    # two rows: 6 and 2 nodes accepted (1 and 0 off the chain); within 4 / 8 nodes: 2+1 / 4+2
    m.record_round(torch.ones(2, dtype=torch.bool), torch.full((2,), 16), torch.tensor([6, 2]), torch.tensor([1, 0]),
                   torch.zeros(2, dtype=torch.bool), within=torch.tensor([[2, 1], [4, 2]]))
    m.record_round(torch.ones(2, dtype=torch.bool), torch.full((2,), 4), torch.tensor([3, 3]), torch.tensor([0, 0]),
                   torch.zeros(2, dtype=torch.bool), largest=False)  # a smaller bucket's step: no acceptance input
    kinds = []
    while p.tokens[ab.TREE] is None and len(kinds) < 16:
        kinds.append(p.choose(1))
    assert p.tokens == {ab.TREE: 5.0, t8: 4.0, t4: 2.5, ab.CHAIN: 4.5}
    assert kinds[-1] == ab.CHAIN  # then the costs it lacks: the chain's, the smaller buckets'
    for kind, verify_s in ((ab.CHAIN, 0.0076), (t8, 0.006), (t4, 0.0036)):
        _steps(p, kind, 1, 10.0, verify_s, n=5)  # four timed steps each: settled costs (probed rarely)
        assert kind == ab.CHAIN or p.choose(1) != kind
    # tokens per ms: tree 5/20, tree:8 4/8, tree:4 2.5/5.6, chain 4.5/9.6 -> tree:8 wins; the three
    # losers are probed (two steps each) as often as that costs 1% of the rate together: the chain and
    # tree:4 every 3 * 2 * (9.6/8 - 4.5/4) / 1% = 3 * 2 * (5.6/8 - 2.5/4) / 1% = 45 decisions, the tree
    # every 3 * 250, at most 64
    picks = [p.choose(1) for _ in range(120)]
    at = {k: [i for i, x in enumerate(picks) if x == k] for k in p.kinds}
    assert at[ab.CHAIN] == [a + d for a in at[ab.CHAIN][:1] for d in (0, 1, 46, 47)], picks
    assert at[t4] == [i + 2 for i in at[ab.CHAIN]], picks  # (due with the chain: after it)
    assert len(at[ab.TREE]) == 2 and p.probes == 1 and p.probe_gap == {1: 64}, picks
    assert len(at[t8]) == 120 - 10 and p.chain_probes == 2 and p.budget_probes == 2
    snap = p.snapshot()
    assert snap["menu"] == [4, 8, 16] and snap["decisions"][t8] > 0 and f"{t4}@1" in snap["step_ms"]


def test_every_bucket_is_served_but_one_of_the_chains_length_on_a_scheduled_runner():
    """Every bucket on every target (hybrids too: the templates read vLLM's state lines, sized for the
    largest, for any smaller bucket). Where the scheduler gives each step its draft count (Model Runner
    V2), a bucket of L nodes would read as the chain: it is left out, and why is said."""
    assert auto_setup.serveable_menu((4, 8, 16), 7) == ((4, 8, 16), None)
    assert auto_setup.serveable_menu((4, 7, 16), 7) == ((4, 7, 16), None)  # (the V1 runner: the round decides)
    assert auto_setup.serveable_menu((4, 8, 16), 7, scheduled=True) == ((4, 8, 16), None)
    menu, why = auto_setup.serveable_menu((4, 7, 16), 7, scheduled=True)
    assert menu == (4, 16) and "4/7/16" in why and "chain" in why
    assert auto_setup.serveable_menu((16,), 7, scheduled=True) == ((16,), None)


def test_buckets_priors_and_what_is_not_timed():
    assert [ab.bucket(r) for r in (1, 2, 3, 4, 7, 8, 16, 17)] == [1, 2, 2, 4, 4, 8, 16, 16]
    table = {"buckets": [{"budget": BUDGET, "batch": 1, "round_ms": 10.0}, {"budget": BUDGET, "batch": 6,
             "round_ms": 30.0}, {"budget": L, "batch": 1, "round_ms": 8.0}, {"budget": 99, "batch": 1,
             "round_ms": 1.0}]}
    priors = auto_setup.table_priors(table, BUDGET, L)
    assert priors == {(ab.TREE, 1): 0.010, (ab.TREE, 4): 0.030, (ab.CHAIN, 1): 0.008}
    m, p = _policy(priors)
    _step(p, ab.TREE, 1, -1.0, 0.018)  # the first step: not timed
    _step(p, ab.TREE, 1, 0.0, 1.198)  # a first-call compile: 1.2 s; the prior stands until _MIN_SAMPLES steps
    assert p.costs[(ab.TREE, 1)] == pytest.approx(0.010)
    _step(p, ab.TREE, 1, 1.0, 0.018)  # then a 20 ms step: the faster half (of two: one) forgets the stall
    assert p.costs[(ab.TREE, 1)] == pytest.approx(0.020)
    assert ab._WINDOW == 16
    for i in range(16):
        _step(p, ab.TREE, 1, 3.0 + i, 0.006 + 0.001 * i)  # 8 .. 23 ms
    # the last 16 steps only (the stall and the 20 ms step are gone): the mean of their faster half, 8 .. 15 ms
    assert p.costs[(ab.TREE, 1)] == pytest.approx(0.0115)
    _step(p, ab.TREE, 1, 19.0, 0.001)  # a 3 ms step moves the mean (one order statistic would read 8 ms)
    assert p.costs[(ab.TREE, 1)] == pytest.approx((0.003 + sum(range(9, 16)) * 1e-3) / 8)
    for i in range(8):  # stalls in half the window still leave a steady cost (of the 3 ms and 17 .. 23 ms)
        _step(p, ab.TREE, 1, 20.0 + i, 0.698)
    assert p.costs[(ab.TREE, 1)] == pytest.approx((0.003 + sum(range(17, 24)) * 1e-3) / 8)
    _step(p, ab.TREE, 1, 30.0, 0.698)  # in more than half, they do
    assert p.costs[(ab.TREE, 1)] > 0.1
    p.proposed(ab.TREE, 2, 30.0, 30.002)  # a step that did not start clean (a prefill joined): not timed
    p.step_ended(30.5)
    assert (ab.TREE, 2) not in p.costs and p.snapshot()["draft_ms"] == pytest.approx(2.0)


def test_the_snapshot_keeps_the_last_decisions_and_timed_steps():
    """What the choice rested on, for a benchmark row to show: the decisions per kind and batch bucket,
    the last kinds decided and each timed step's kind, bucket and milliseconds (a step after one of
    another kind is not timed)."""
    m, p = _policy(probe=4)
    kinds = [p.choose(4) for _ in range(3)]
    _steps(p, ab.TREE, 4, 0.0, 0.010, n=2)  # the second is timed: 10 ms verify + the drafting
    _steps(p, ab.CHAIN, 4, 5.0, 0.006, n=1)  # after a tree step: not timed
    snap = p.snapshot()
    assert snap["chosen"][:3] == kinds and len(snap["chosen"]) >= 3
    assert snap["decisions_at"] == {f"{k}@4": kinds.count(k) for k in set(kinds)}  # (per batch bucket)
    assert len(snap["timed"]) == 1 and snap["timed"][0][1:3] == [ab.TREE, 4], snap["timed"]
    assert snap["timed"][0][3] == pytest.approx(1e3 * p._samples[(ab.TREE, 4)][-1])
    json.dumps(snap)  # (benchmark rows carry it)


def test_a_step_with_a_seeded_request_takes_one_kind_per_bucket_for_the_engines_life():
    """A seeded request's tokens repeat only where its steps repeat their kinds (in bf16 a verify of
    another shape rounds the target's logits otherwise): a step with a request that brought its own seed
    takes, at its batch bucket, the kind found best when the first such step came there (the largest
    tree while a cost or the acceptance is unmeasured); the other steps go on choosing."""
    m, p = _policy(priors={(ab.TREE, 4): 0.010, (ab.CHAIN, 4): 0.006}, probe=4)
    assert p.choose(1, seeded=True) == ab.TREE  # nothing measured at bucket 1
    _round(m, [5, 3], [2, 0])  # the tree commits 5 tokens per round, the chain 4
    for _ in range(16):
        if p.tokens[ab.TREE] is None:
            p.choose(8)
    assert p.tokens == {ab.TREE: 5.0, ab.CHAIN: 4.0}
    assert [p.choose(4, seeded=True) for _ in range(40)] == [ab.CHAIN] * 40  # 4/6 > 5/10 per ms, never a probe
    p.costs[(ab.CHAIN, 4)] = 0.009  # now 4/9 < 5/10: the tree wins, but not for the seeded steps
    assert [p.choose(4) for _ in range(2)] == [ab.TREE] * 2 and p.choose(4, seeded=True) == ab.CHAIN
    assert p.choose(1, seeded=True) == ab.TREE and p.snapshot()["repeatable"] == {1: ab.TREE, 4: ab.CHAIN}
    p.forced = ab.CHAIN  # (a held kind, as precompile times each kind, outranks it)
    assert p.choose(1, seeded=True) == ab.CHAIN
    # where the scheduler decides the counts, every bucket's seeded kind is fixed before a seeded schedule
    # (draft_schedule.hold_seeded): the fixed ones kept, the others the best now; a held kind its own
    assert p.hold_seeded([1, 2, 4]) == {1: ab.CHAIN, 2: ab.CHAIN, 4: ab.CHAIN}
    p.forced = None
    assert p.hold_seeded([1, 2, 4, 8]) == {1: ab.TREE, 2: ab.TREE, 4: ab.CHAIN, 8: ab.TREE}
    assert p.snapshot()["repeatable"] == {1: ab.TREE, 2: ab.TREE, 4: ab.CHAIN, 8: ab.TREE}
