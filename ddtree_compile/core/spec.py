"""TreeSpec: the declarative description of one DDTree tree shape."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .buckets import verify_tokens

MAX_BUDGET = 1024  # the paper sweeps up to 1024 nodes; past that a verify is not a decode step


def _check_int(name: str, value, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"TreeSpec.{name} must be an int, got {type(value).__name__} {value!r}")
    if value < low or (high is not None and value > high):
        allowed = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"TreeSpec.{name} must be {allowed}, got {value}")


@dataclass(frozen=True)
class TreeSpec:
    """How to turn the drafter's per-position distributions into a tree.

    budget       number of non-root nodes B (the verify runs B+1 tokens per request)
    top_k        candidates per depth (ranks < top_k)
    chain_seed   insert the drafter's top-1 chain first (the tree always contains flat DFlash)
    temperature  applied to draft logits before the log-softmax that scores nodes
    max_depth    deepest node allowed (None: as deep as the drafter proposes)
    """

    budget: int
    top_k: int = 8
    chain_seed: bool = True
    temperature: float = 1.0
    max_depth: int | None = None

    def __post_init__(self) -> None:
        _check_int("budget", self.budget, 1, MAX_BUDGET)
        _check_int("top_k", self.top_k, 1)
        if not isinstance(self.chain_seed, bool):
            raise ValueError(f"TreeSpec.chain_seed must be True or False, got {self.chain_seed!r}")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
            raise ValueError(f"TreeSpec.temperature must be a finite float > 0, got {t!r}")
        if self.max_depth is not None:
            _check_int("max_depth", self.max_depth, 1)

    @property
    def num_slots(self) -> int:
        """Verify tokens per request: root + budget."""
        return verify_tokens(self.budget)

    def depth_limit(self, draft_len: int) -> int:
        """Deepest possible node for a drafter proposing `draft_len` positions."""
        limit = min(draft_len, self.budget)
        return limit if self.max_depth is None else min(limit, self.max_depth)
