"""budget "auto"'s costs in the choice (integration/round/auto_budget.py `_fitted_costs`): one
least-squares fit of the kinds' neighbour ratios and own costs. The rest of the policy:
test_auto_budget.py."""

import math

import pytest
import torch
from _auto_budget_common import BUDGET, L

from ddtree_compile.integration import metrics
from ddtree_compile.integration.round import auto_budget as ab


def _settled(p, b, costs_ms, pairs):
    """A policy at bucket b whose kinds each have a settled own cost (ms) and, per pair (k, j), three
    timed neighbour ratios k's step / j's step."""
    for k, ms in costs_ms.items():
        p.costs[(k, b)] = ms / 1e3
        p._samples[(k, b)] = [ms / 1e3] * 4
    for (k, j), r in pairs.items():
        p._pairs[(k, j, b)] = [math.log(r)] * 3
        p._pairs[(j, k, b)] = [-math.log(r)] * 3


def test_the_costs_of_three_kinds_are_one_fit_of_their_ratios_and_the_choice_does_not_rotate():
    """With three kinds or more, the neighbour ratios need not agree around a cycle (each is a median
    of other steps). Costs read against the last winner made each winner's view prefer the next: on
    an H200 (4B shape, menu 8/16/32, c = 16) the decisions rotated tree:16, chain, tree:8 step after
    step, and as a step is timed only after steps of its own kind, nothing was timed that could end
    it. The costs are one least-squares fit of all ratios and the own costs: one choice, every time."""
    m = metrics.DDTreeMetrics(L, torch.device("cpu"))
    p = ab.AutoBudget(m, BUDGET, L, 4, menu=(8, BUDGET))
    t8 = ab.tree_kind(8, BUDGET)
    p.tokens = dict.fromkeys(p.kinds, 4.0)
    # each kind 10% cheaper than another around the cycle: chain < tree, tree:8 < chain, tree < tree:8
    _settled(p, 1, {ab.TREE: 10.0, t8: 10.0, ab.CHAIN: 9.5},
             {(ab.CHAIN, ab.TREE): 0.9, (t8, ab.CHAIN): 0.9, (ab.TREE, t8): 0.9})
    picks = []
    for _ in range(6):
        p._since.clear()  # (no probe due)
        picks.append(p._decide(1))
    assert picks == [ab.CHAIN] * 6  # the ratios cancel around the cycle: the own costs decide
    fit = p._fitted_costs(1)
    assert fit[ab.TREE] == pytest.approx(fit[t8], rel=1e-6) and fit[ab.CHAIN] < fit[ab.TREE]
    # consistent ratios reach kinds no ratio joins directly: tree:8 / tree = 0.8 / 1.5, whatever the
    # stale own costs say (tree:8's own 20 ms); the level comes from the own costs
    q = ab.AutoBudget(metrics.DDTreeMetrics(L, torch.device("cpu")), BUDGET, L, 4, menu=(8, BUDGET))
    _settled(q, 1, {ab.TREE: 15.0, t8: 20.0, ab.CHAIN: 10.0}, {(ab.TREE, ab.CHAIN): 1.5, (t8, ab.CHAIN): 0.8})
    fit = q._fitted_costs(1)
    assert fit[t8] / fit[ab.TREE] == pytest.approx(0.8 / 1.5, rel=1e-3)
    assert fit[ab.TREE] / fit[ab.CHAIN] == pytest.approx(1.5, rel=1e-3)
    assert fit[ab.CHAIN] == pytest.approx(0.01357, rel=1e-3)  # the geometric mean of 10, 15 / 1.5, 20 / 0.8 ms
    # no pair with three ratios: the own costs, exactly
    r = ab.AutoBudget(metrics.DDTreeMetrics(L, torch.device("cpu")), BUDGET, L, 4, menu=(8, BUDGET))
    _settled(r, 1, {ab.TREE: 15.0, t8: 20.0, ab.CHAIN: 10.0}, {})
    assert r._fitted_costs(1) == {k: pytest.approx(r.costs[(k, 1)]) for k in r.kinds}
