"""What test_auto_budget.py (the policy) and test_auto_budget_engine.py (real engines) share: the
tree's settings, the policy's expected rates, and the policy fed steps by hand."""

import torch

from ddtree_compile.integration import metrics
from ddtree_compile.integration.round import auto_budget as ab
from ddtree_compile.testing import models

L, TOP_K, BUDGET, MAX_TOKENS = 7, 4, 16, 64
PROMPTS = models.token_prompts(4, 16, models.VOCAB, seed=3)


def rates(p, R):
    """Tokens per second per request the policy expects of each kind at R (None where unknown): the
    two sides of its comparison (auto_budget.py's module docstring)."""
    out = {}
    for kind in (ab.TREE, ab.CHAIN):
        c, e = p.costs.get((kind, ab.bucket(R))), p.tokens[kind]
        out[kind] = None if c is None or e is None else e / c
    return out


def round_(m, accepted, off):
    """One tree step of DDTreeMetrics: rows accepting `accepted` nodes, `off` of them off the chain."""
    n = len(accepted)
    m.record_round(torch.ones(n, dtype=torch.bool), torch.full((n,), BUDGET), torch.tensor(accepted),
                   torch.tensor(off), torch.zeros(n, dtype=torch.bool))


def policy(priors=None, probe=4):
    m = metrics.DDTreeMetrics(L, torch.device("cpu"))
    return m, ab.AutoBudget(m, BUDGET, L, probe, priors)


def step(p, kind, R, t, verify_s, draft_s=0.002, gap_s=0.0):
    """The host's view of one clean step: its proposal (draft_s), vLLM's output processing and
    scheduling (gap_s), its start, the next proposal; it costs draft_s + gap_s + verify_s."""
    p.proposed(kind, R, t, t + draft_s)
    p.verify_began(t + draft_s + gap_s)
    p.step_ended(t + draft_s + gap_s + verify_s)


def steps(p, kind, R, t, verify_s, n=2, **kw):
    """n steps of one kind in a row, 1 s apart: the first is timed only if a step of its kind (and
    bucket) came right before it."""
    for i in range(n):
        step(p, kind, R, t + i, verify_s, **kw)
