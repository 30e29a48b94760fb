"""budget "auto" (integration/round/auto_budget.py) when the workload turns: a request mix whose tree
acceptance rises (code: the tree's extra branches are taken) or falls (free text: the target agrees
with the drafter's chain or with nothing) while the engine runs. The policy reads acceptance only
from the largest tree's steps (every step while the tree wins, its probes while the chain does) and
must follow both turns within a bounded number of steps, with the default probe interval and the
costs of an H100 at c = 1 (the tree's step 1.25x the chain's)."""

import pytest
import torch
from _auto_budget_common import BUDGET, L

from ddtree_compile.integration import metrics
from ddtree_compile.integration.round import auto_budget as ab

PROBE_INTERVAL = 16  # the default (config.DDTreeConfig)
COST_S = {ab.TREE: 0.0075, ab.CHAIN: 0.006}  # one step of each kind at batch bucket 1
CODE = ([7, 7], [3, 3])  # per tree step: accepted nodes per row, those off the drafter's chain
TEXT = ([2, 2], [0, 0])  # (tree 8 tokens a round against the chain's 5; then 3 against 3)


def _run(p, m, workload, n, t0):
    """n steps of an engine at batch bucket 1: each decision's kind runs (its cost on the host's
    cycle, timed as the policy times it) and, where it is the largest tree, its walk's acceptance
    reaches DDTree's counters. Returns the kinds taken."""
    kinds, t = [], t0
    for _ in range(n):
        kind = p.choose(1)
        kinds.append(kind)
        if kind == ab.TREE:
            accepted, off = workload
            m.record_round(torch.ones(2, dtype=torch.bool), torch.full((2,), BUDGET), torch.tensor(accepted),
                           torch.tensor(off), torch.zeros(2, dtype=torch.bool))
        p.proposed(kind, 1, t, t + 0.001)
        p.verify_began(t + 0.001)
        t += COST_S[kind]
        p.step_ended(t)
    return kinds, t


def _share(kinds, kind):
    return sum(k == kind for k in kinds) / len(kinds)


@pytest.mark.parametrize("first", ["code", "text"])
def test_the_policy_follows_the_workload_when_acceptance_turns(first):
    """Code, then free text, then code again (or the other way round), 400 steps each: after each turn
    the policy takes the kind with the better rate (8 / 7.5 ms over 5 / 6 for code; 3 / 6 over 3 / 7.5
    for free text) within 160 steps, and in 85% of the steps after that."""
    m = metrics.DDTreeMetrics(L, torch.device("cpu"))
    p = ab.AutoBudget(m, BUDGET, L, PROBE_INTERVAL)
    phases = [CODE, TEXT, CODE] if first == "code" else [TEXT, CODE, TEXT]
    t, turned = 0.0, []
    for i, workload in enumerate(phases):
        kinds, t = _run(p, m, workload, 400, t)
        winner = ab.TREE if workload is CODE else ab.CHAIN
        settled = next((j for j in range(len(kinds) - 40) if _share(kinds[j: j + 40], winner) >= 0.85), None)
        assert settled is not None and settled <= 160, (i, winner, settled, "".join(k[0] for k in kinds))
        assert _share(kinds[settled:], winner) >= 0.85, (i, winner, "".join(k[0] for k in kinds))
        turned.append(settled)
    print(f"\nsteps to follow each turn ({'/'.join('code' if w is CODE else 'text' for w in phases)}): {turned}")
