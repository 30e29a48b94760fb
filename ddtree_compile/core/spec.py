"""TreeSpec: the declarative description of one DDTree tree shape, and its CUDA-graph bucket math."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import sympy

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
        return self.budget + 1

    @property
    def mask_words(self) -> int:
        """int32 words per row of the packed ancestor mask."""
        return int(_symbolic()["mask_words"].subs(_B, self.budget))

    def depth_limit(self, draft_len: int) -> int:
        """Deepest possible node for a drafter proposing `draft_len` positions."""
        limit = min(draft_len, self.budget)
        return limit if self.max_depth is None else min(limit, self.max_depth)

    def verify_tokens(self, num_reqs: int) -> int:
        """Tokens in one uniform tree-verify batch of `num_reqs` requests."""
        return int(_symbolic()["verify_tokens"].subs({_B: self.budget, _R: num_reqs}))

    def padded_num_reqs(self, num_reqs: int, capture_sizes: list[int]) -> int:
        """Smallest request count whose verify batch fits a captured graph size.

        A tree verify is a uniform batch of B+1 tokens per request, so a graph captured for
        T tokens serves floor(T / (B+1)) requests; pad the batch to the smallest such count.
        """
        _check_int("num_reqs", num_reqs, 1)
        fits = [t // self.num_slots for t in capture_sizes if t // self.num_slots >= num_reqs]
        if not fits:
            raise ValueError(
                f"num_reqs={num_reqs} at budget {self.budget} needs {self.verify_tokens(num_reqs)} "
                f"tokens; capture_sizes go up to {max(capture_sizes, default=0)}"
            )
        return min(fits)


_B, _R = sympy.symbols("B R", integer=True, positive=True)


@functools.lru_cache(maxsize=1)
def _symbolic() -> dict[str, sympy.Expr]:
    """Symbolic sizes of a verify bucket, in the budget B and the request count R."""
    return {
        "verify_tokens": _R * (_B + 1),
        "mask_words": sympy.ceiling((_B + 1) / sympy.Integer(32)),
        "ancestor_bits_elems": _R * (_B + 1) * sympy.ceiling((_B + 1) / sympy.Integer(32)),
    }


def budget_buckets(max_budget: int, base: tuple[int, ...] = (8, 16, 22, 32, 40, 64, 96, 128)) -> list[int]:
    """Budgets to capture CUDA graphs for: the common budgets up to `max_budget`, plus it."""
    _check_int("max_budget", max_budget, 1, MAX_BUDGET)
    return sorted({b for b in base if b < max_budget} | {max_budget})


def bucket_for(budget: int, buckets: list[int]) -> int:
    """The smallest captured budget >= `budget` (a smaller tree pads up to it)."""
    fits = [b for b in buckets if b >= budget]
    if not fits:
        raise ValueError(f"budget {budget} exceeds the largest captured bucket {max(buckets)}")
    return min(fits)


def symbolic_sizes() -> dict[str, sympy.Expr]:
    """The bucket size expressions (for docs, dumps and memory planning)."""
    return dict(_symbolic())
