"""budget "auto"'s costs (integration/round/auto_budget.py): what a step is timed by under async
scheduling (the host's cycle after `depth` steps of its kind, or the device's timeline), and their
use in the choice (`_fitted_costs`): one least-squares fit of the kinds' neighbour ratios and own
costs. The rest of the policy: test_auto_budget.py."""

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


def _round(m, accepted, off):
    """One tree step of DDTreeMetrics: rows accepting `accepted` nodes, `off` of them off the chain."""
    n = len(accepted)
    m.record_round(torch.ones(n, dtype=torch.bool), torch.full((n,), BUDGET), torch.tensor(accepted),
                   torch.tensor(off), torch.zeros(n, dtype=torch.bool))


def _policy(probe=4, **kw):
    m = metrics.DDTreeMetrics(L, torch.device("cpu"))
    return m, ab.AutoBudget(m, BUDGET, L, probe, **kw)


def _async_loop(p, m, device_s: dict, n: int, R: int = 16, lag: int = 2) -> list:
    """n decisions of an engine in vLLM's async loop: its batch queue of two (0.26 `v1/engine/core.py`
    `step_with_batch_queue`) launches step i + 1 before it waits for step i, so the host's cycle of
    step i (one proposal to the next) ends when the device finished step i - `lag` (2 there). Each
    decision's kind runs; the tree accepts 5 nodes per round, 1 of them off the chain (tree 6 tokens,
    chain 5)."""
    kinds, t = [], 0.0
    for i in range(n):
        if i % 8 == 0:
            _round(m, [5] * 4, [1] * 4)
        kinds.append(p.choose(R))
        if isinstance(p.clock, _Device):
            p.clock.took(device_s[kinds[-1]])
        p.proposed(kinds[-1], R, t, t + 0.001)
        p.verify_began(t + 0.001)
        t += device_s[kinds[max(i - lag, 0)]]
        p.step_ended(t)
    return kinds


class _Device:
    """The device's timeline of `_async_loop`'s steps as DeviceClock reads it on CUDA (CUDA events are
    not on this machine): each step takes its kind's time there, and is read `lag` steps after it ended."""

    def __init__(self, lag: int = 3):
        self.lag, self._took, self._marks = lag, [], []

    def took(self, seconds: float) -> None:  # (the step about to run)
        self._took.append(seconds)

    def mark(self, step: int, key) -> None:
        self._marks.append((step, key, self._took[-1]))

    def ready(self) -> list:
        done, self._marks = self._marks[: -self.lag], self._marks[-self.lag:]
        return [(step, key, s) for step, key, s in done if key is not None]


@pytest.mark.parametrize("tree_ms,winner", [(17.5, ab.CHAIN), (12.0, ab.TREE)])
def test_under_async_scheduling_a_step_is_timed_after_two_of_its_kind(tree_ms, winner):
    """An H200 (4B shape, Model Runner V2, async scheduling, c = 16; `e2e_h200_4b.json`): the chain's step
    took 10.8 ms and the tree's 17.5, but probes of two steps timed the chain's second one while the
    device still ran the tree before the probe, and the tree step after it while it ran the probe:
    the neighbour ratios read the chain at 1.02-1.23x the tree and auto kept the tree in 55-64% of
    steps (0.61-0.75x flat DFlash). With one step of lag the same loop shows it (the first case: the
    chain's cost and its ratio to the tree held up, the tree kept); a lag of two (`depth`) times each
    kind's own work, and the faster rate wins: the chain's 5 / 10.8 ms over 6 / 17.5, or the tree's 6 / 12."""
    device = {ab.TREE: tree_ms / 1e3, ab.CHAIN: 0.0108}
    m1, one = _policy(probe=16)
    _async_loop(one, m1, device, 400)
    m2 = metrics.DDTreeMetrics(L, torch.device("cpu"))
    two = ab.AutoBudget(m2, BUDGET, L, 16, depth=2)
    kinds = _async_loop(two, m2, device, 400)[100:]
    assert two.costs[(ab.CHAIN, 16)] == pytest.approx(0.0108)
    assert two.costs[(ab.TREE, 16)] == pytest.approx(device[ab.TREE])
    assert two.snapshot()["step_ratio"]["chain/tree@16"] == pytest.approx(10.8 / tree_ms)
    assert kinds.count(winner) > 0.8 * len(kinds), (winner, kinds.count(winner))  # (the rest: probes)
    if winner == ab.CHAIN:  # one step of lag: the chain's cost held up by the tree's work, the tree kept
        assert one.costs[(ab.CHAIN, 16)] > 0.011 and one.snapshot()["step_ratio"]["chain/tree@16"] > 1.0
        assert one.decisions[ab.TREE] > 0.9 * sum(one.decisions.values())


@pytest.mark.parametrize("lag", [2, 3])
def test_on_the_devices_timeline_a_step_is_its_own_work_however_far_the_host_runs_ahead(lag):
    """Under async scheduling the host's cycle of a step holds the device's work of a step `lag`
    before it. Timed after two steps of its kind (`depth`), the host's cycles read each kind right
    at a lag of two, and at three misread both (an H100 at c = 16 read every kind's own cost at
    bucket 16 at 10.7-13.6 ms, below auto's mean step there and a budget-32 engine's 19.6-21.8 ms,
    flat DFlash's 12.0). Read on the device's timeline (DeviceClock:
    an event at each proposal, read a few steps later), a step is timed after one of its kind (its
    drafter reads what the step before verified) and costs its own work at any lag: the chain's
    5 / 10.8 ms wins over the tree's 6 / 17.5."""
    device = {ab.TREE: 0.0175, ab.CHAIN: 0.0108}
    m1, host = _policy(probe=16, depth=2)
    _async_loop(host, m1, device, 400, lag=lag)
    m2, dev = _policy(probe=16, clock=_Device())
    kinds = _async_loop(dev, m2, device, 400, lag=lag)[100:]
    assert dev.snapshot()["clock"] == "device" and host.snapshot()["clock"] == "host"
    assert dev.costs[(ab.CHAIN, 16)] == pytest.approx(0.0108) and dev.costs[(ab.TREE, 16)] == pytest.approx(0.0175)
    assert dev.snapshot()["step_ratio"]["chain/tree@16"] == pytest.approx(10.8 / 17.5)
    assert kinds.count(ab.CHAIN) > 0.8 * len(kinds), kinds.count(ab.CHAIN)
    ratio = host.snapshot()["step_ratio"]["chain/tree@16"]
    if lag == 2:
        assert ratio == pytest.approx(10.8 / 17.5)
    else:  # (the host's lead past its depth: the tree's cost read near the chain's)
        assert ratio > 0.8 and host.decisions[ab.TREE] > 0.5 * sum(host.decisions.values()), (ratio, host.decisions)


def test_a_stall_next_to_a_probe_is_no_ratio():
    """A kind's first steps of a shape can stall (a graph captured, a kernel compiled, the device idle
    through it); where two kinds meet only at probes their pairs are few, and two stalls made the
    median: an H100's engine (4B shape, menu 8/16/32) read tree:16's step at 0.05x tree:8's at bucket 1.
    A ratio past _STALL_RATIO is dropped (counted), so the pair's median is the steps' own."""
    t8 = ab.tree_kind(8, BUDGET)
    _, p = _policy(menu=(8, BUDGET))
    steps = [(ab.TREE, 0.007), (t8, 0.150), (ab.TREE, 0.007), (t8, 0.150), (ab.TREE, 0.007), (t8, 0.0077),
             (ab.TREE, 0.007)]
    for i, (kind, seconds) in enumerate(steps):
        p._observe(kind, 1, seconds, i)
    assert p.stalled_pairs == 4, p.stalled_pairs  # (each stall against the step before and the one after)
    # (kept, the four stalls' ratios would be the median of six: tree at 0.047x tree:8)
    assert p.snapshot()["step_ratio"] == {"tree/tree:8@1": pytest.approx(0.007 / 0.0077)}
