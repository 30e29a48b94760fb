"""What test_auto_budget.py (the policy) and test_auto_budget_engine.py (real engines) share: the
tree's settings and the policy's expected rates."""

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
