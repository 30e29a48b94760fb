"""Every mode's steady decode steps on one clock (bench_e2e_gpu --phase-timers), by the step's kind and
batch bucket: budget "auto"'s chain step next to vLLM's flat DFlash step, a tree step next to both.

A host timer per step reads a host-bound loop's wait as the step's cost and a queue the device works
through as none; so on CUDA each step is timed on the device's timeline, as budget "auto"'s policy
times it (integration/round/auto_setup.DeviceClock): an event at the start of each proposal (Model
Runner V2's `speculator.propose`, the same point for every mode), a step being the time from the
proposal before it to its own, read back once both events completed (no sync). On CPU the host clock.

A step is timed when it and the step before it are clean decode steps (every request a query of
1 + its drafts, the same draft count for all: no prefill chunk, no cut drafts) of the same kind and
bucket, so a cycle holds no other kind's work. Kinds: "flat" (vLLM's flat DFlash), "chain" (a DDTree
engine's step without a tree: budget "auto"'s chain), "tree:<nodes>" (the tree bucket verified).
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict

_CLOCKS: dict[int, "StepClock"] = {}  # id(llm) -> its clock


class StepClock:
    def __init__(self, metrics, cuda: bool):
        from ddtree_compile.integration.round.auto_setup import DeviceClock

        self.metrics = metrics  # DDTree's counters (None: vLLM's flat DFlash)
        self.device = DeviceClock() if cuda else None
        self.samples: dict[str, list[float]] = defaultdict(list)  # "kind@bucket" -> seconds, in order
        self._budget_steps = dict(metrics.budget_steps) if metrics is not None else {}
        self._prev: str | None = None  # the key of the step before, where it was a clean decode step
        self._step, self._t = 0, None

    def proposal(self, input_batch) -> None:
        """At the start of the proposal that ends the step whose batch is `input_batch`."""
        from ddtree_compile.integration.round.auto_budget import bucket

        kind = self._kind()  # (every step: a count a step moved is not read as the next one's)
        key = f"{kind}@{bucket(input_batch.num_reqs)}" if _clean(input_batch) else None
        timed = key if key is not None and key == self._prev else None
        self._prev, self._step = key, self._step + 1
        if self.device is not None:
            self.device.mark(self._step, timed)
            for _, k, seconds in self.device.ready():
                self.samples[k].append(seconds)
            return
        now = time.perf_counter()
        if timed is not None and self._t is not None:
            self.samples[timed].append(now - self._t)
        self._t = now

    def _kind(self) -> str:
        """The kind of the step that just ended: the tree bucket whose count its commit moved."""
        if self.metrics is None:
            return "flat"
        now = dict(self.metrics.budget_steps)
        moved = [b for b, n in now.items() if n > self._budget_steps.get(b, 0)]
        self._budget_steps = now
        return f"tree:{moved[0]}" if moved else "chain"


def _clean(b) -> bool:
    """A decode step of one draft count for every request (V2's InputBatch)."""
    R, drafts = b.num_reqs, b.num_draft_tokens
    return R > 0 and drafts > 0 and drafts % R == 0 and b.num_tokens == R + drafts


def install(llm) -> StepClock | None:
    """On a Model Runner V2 engine in this process: the clock at its speculator's proposals. None elsewhere
    (V1: its drafter proposes with other arguments)."""
    from ddtree_compile.integration import engines

    runner = engines.find_runner(llm)
    spec = getattr(runner, "speculator", None)
    if spec is None or not callable(getattr(spec, "propose", None)):
        return None
    state = engines.find_state(llm)
    clock = _CLOCKS[id(llm)] = StepClock(state.metrics if state is not None else None,
                                         runner.device.type == "cuda")
    propose = spec.__dict__.get("propose") or (lambda *a, **k: type(spec).propose(spec, *a, **k))

    def timed_propose(input_batch, *a, **k):
        if not k.get("dummy_run"):
            clock.proposal(input_batch)
        return propose(input_batch, *a, **k)

    spec.propose = timed_propose
    return clock


def snapshot(llm) -> dict | None:
    """The samples so far (lists only grow: a cell's are those past its `before` snapshot's lengths)."""
    clock = _CLOCKS.get(id(llm))
    return {k: list(v) for k, v in clock.samples.items()} if clock is not None else None


def summary(before: dict | None, after: dict | None) -> dict | None:
    """The cell's steps per key: their count, median and 10th / 90th percentiles (ms; a kind whose steps
    took one time in some runs and another in others shows apart from one whose every step varies)."""
    if after is None:
        return None
    out = {}
    for k, v in sorted(after.items()):
        new = sorted(v[len((before or {}).get(k, ())):])
        if new:
            out[k] = {"n": len(new), "ms": 1e3 * statistics.median(new), "p10_ms": 1e3 * new[len(new) // 10],
                      "p90_ms": 1e3 * new[(9 * len(new)) // 10]}
    return out
