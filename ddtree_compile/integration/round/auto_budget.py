"""budget "auto": per step, verify a tree bucket of the menu (`auto_budget`: B nodes, or a list of
budgets b_1 < .. < B) or the drafter's plain chain (flat DFlash's L drafts, through vLLM's own chain
verify), whichever is expected to commit more tokens per second at this batch size.

    choose(R) = the kind k (a bucket or the chain) with the largest E_k / cost_k(R); ties: the largest tree

Kinds: TREE is the largest bucket B, "tree:b" a smaller one (its tree is the first b nodes of the
B-node tree: one build, core.tree.TreeBatch.prefix), CHAIN the chain.

- E (tokens committed per request-round) comes from DDTree's own counters over the steps that
  verified the largest bucket: a tree commits 1 + its accepted nodes; a smaller bucket would have
  committed 1 + the path's accepted nodes inside its first b slots (a b-node best-first tree is a
  prefix of the B-node tree and the walk is greedy along it: walk_stage._accepted_within); the
  chain would have committed 1 + the accepted nodes that lie on the drafter's top-1 chain. The
  chain is in every tree (chain_seed) and the walk leaves it only where the target disagrees with
  it, so under greedy verification that is exactly what flat DFlash would have accepted from the
  same drafts (with sampling, an estimate). The counters live on the device; every few decisions
  they are copied (non-blocking, pinned) and read once that copy's event has completed: no host
  sync on the hot path, the statistics lag a few steps.
- cost(R) is the wall time of one engine step of that kind at batch bucket R (1, 2, 4, ...): the
  precompile cost table gives the prior (cli/precompile.py: round_ms of every bucket and of the
  chain from `--auto-budget`'s engine; or of fixed budgets, the chain's at budget L), then, from
  _MIN_SAMPLES steps on, the mean of the faster half of the last _WINDOW steps this engine measured:
  a step's whole cycle on the host, from the proposal that chose its kind to the next proposal (its
  drafting, vLLM's output processing and scheduling, its verify). Not a window inside it: the tree's
  round is free of host syncs, so the host waits for the tree's verify wherever vLLM next syncs,
  outside any window around the verify, while vLLM's chain verify syncs inside it: a window around
  the verify would undercount the tree's step and not the chain's. The faster half because
  interference (a first-call compile, a stall, an idle engine between requests) only ever adds time;
  its mean, not one order statistic (a lower quartile of few steps strayed by -22% to +11% on an
  H100), and both kinds' costs carry the same downward bias, which the comparison cancels. A cycle
  also holds what the step before left it (the host's wait for that step's verify, the drafter's
  run over its verified tokens), so it is timed only after `depth` clean steps of its own kind and
  batch bucket, and a probe is depth + 1 steps: depth 1, or 2 under async scheduling (Model Runner
  V2), where the host runs a step ahead of the device (single probes misread both kinds on an H100
  and an H200: CHANGELOG).
- On CUDA the cycle is read on the device's own timeline instead (auto_setup.DeviceClock): an event at
  each proposal's start, on the stream the step runs on, where the step before has all of its work
  enqueued and the proposal's drafter none; from one event to the next is one step on the device
  (its drafter, verify, walk and commit, and any time the device waited for the host), however far
  ahead the host runs. On an H100 (4B shape, c = 16) the host's own costs of every kind at bucket
  16 (10.7-13.6 ms; the 33-slot tree's 1.15x the chain's) sat below the engine's mean step there
  (up to 15.6 ms) and a budget-32 engine's (19.6-21.8 ms), as a host lead over the device of more
  than the two steps `depth` covers would make them (tests/test_auto_budget_costs.py plays a lead
  of three). Depth 1 there (the drafter of a step reads what the step before verified), read once
  both events completed (`query`: no sync).
- Which kind is faster is read from neighbouring steps. A losing kind is timed only at its probes,
  the winner at every step, and between the two the host's speed changes (on two H200s the same flat
  DFlash step took 10.9 ms in one cell and 15.3 ms in the next) and so does the batch inside its
  bucket (16 holds 16..31 requests). So a probe's timed step is also compared with the winner's timed
  steps right before and after it (depth + 1 steps apart: one host speed, nearly one batch). Once a
  pair of kinds has _MIN_PAIRS such ratios (a median; a ratio past _STALL_RATIO is a stall, not kept),
  the costs in the choice (and in the probe gaps) are one consistent set: the log-costs that best fit,
  by least squares, every such pair's median log-ratio (weight 1) and the kinds' own costs (weight
  _OWN_WEIGHT: they set the level, and the cost of a kind no ratio reaches). With three kinds or
  more the medians need not agree around a cycle, and costs read against the last winner (before)
  made each winner's view prefer the next: on an H200 (4B shape, menu 8/16/32, c = 16) the decisions
  rotated tree:16, chain, tree:8 step after step, where no step could be timed to end it. One fit
  serves every comparison: the choice does not depend on which kind won last.
- A kind without a cost at this bucket (no prior, fewer than _MIN_SAMPLES measured steps) is tried.
  While one kind wins at a bucket, every other kind is probed there now and then (each bucket keeps
  its own probe clocks, as its own costs): the largest tree so that every kind's acceptance keeps
  being measured (a drafter can get better, a workload can change), the others so that a cost whose
  samples were stalls is measured again. How often: as often as the probes of the m losing kinds cost
  at most _PROBE_SHARE of the rate together (on an H100 at c = 1, 3 losers probed at that share each took
  a quarter of the steps). A step of kind k instead of the winner w takes cost_k for E_k tokens, which w
  commits in cost_w * E_k / E_w, so a probe of n steps loses n * cost_w * (cost_k / cost_w - E_k / E_w):
      gap_k = n * (cost_k / cost_w - E_k / E_w) * m / _PROBE_SHARE
  steps, within probe_interval .. probe_interval * _PROBE_MAX (every probe_interval while fewer than
  _SETTLED of k's steps at that bucket were timed: a table's prior or warm-up stalls). The closer
  the race, the more often the loser is re-measured (a fixed back-off to 256 steps kept auto on the
  chain for most of a cell after the acceptance rose: CHANGELOG).

- A step with a request that brought its own seed takes one kind per batch bucket for the engine's life
  (`repeatable`: the same seed and requests give the same tokens again); others keep choosing (where the
  scheduler decides draft counts: not while a seeded request is the scheduler's, hold_seeded).

FULL CUDA graphs per kind and batch bucket: on V1 vLLM's own for the largest tree and the adapter's
for the others (round/graphs.py); on V2 its own for every count of the draft schedule that carries
the kind (adapters/draft_schedule.py).
"""

from __future__ import annotations

import collections
import math
import statistics

import torch

from ...core.buckets import batch_bucket

TREE, CHAIN = "tree", "chain"
_EMA = 0.25  # weight of a new measurement (drafting time: per proposal; acceptance: per read-back window)
_READBACK = 8  # decisions between read-backs of the acceptance counters
_WINDOW = 16  # measured steps per (kind, bucket) whose faster half's mean is the cost
_MIN_SAMPLES = 2  # measured steps before they replace the table's prior (or make the cost known)
_SETTLED = 4  # measured steps before a losing kind's probes are priced (until then: every probe_interval)
_PROBE_SHARE = 0.01  # of the rate that the probes of every losing kind together may cost
_PROBE_MAX = 16  # a losing kind is probed at least every probe_interval * this steps
_MIN_PAIRS = 3  # such comparisons of a pair of kinds before their median ratio enters the costs' fit
# A neighbour ratio past this factor is a stall (a graph captured or a kernel compiled at a kind's first
# steps of a shape: the device idles through it), not a cost, and is not kept: steps of two kinds at one
# bucket differ by less (an H100, 4B shape, c = 16: the chain's step 0.48x the 33-slot tree's), but
# pairs are few where kinds meet only at probes, and an H100's engine read tree:16 at 0.05x tree:8 (bucket 1)
_STALL_RATIO = 4.0
_OWN_WEIGHT = 1e-3  # the kinds' own log-costs in that fit, against 1 for each pair's median log-ratio
_TRACE = 48  # the last steps kept for the snapshot: each decision's kind, each timed step's kind, bucket and ms


def bucket(R: int) -> int:
    """The batch bucket of R requests: the largest power of two <= R (core/buckets.BATCH_BUCKET)."""
    return batch_bucket(R)


def tree_kind(budget: int, largest: int) -> str:
    return TREE if budget == largest else f"{TREE}:{budget}"


class AutoBudget:
    """The per-step choice (module docstring). Host state only, besides the read-back buffer."""

    def __init__(self, metrics, tree_budget: int, draft_len: int, probe_interval: int, priors: dict | None = None,
                 table_path: str | None = None, menu: tuple = (), agree=None, depth: int = 1, clock=None):
        self.metrics = metrics
        # tensor parallel: every rank verifies what rank 0 chose (each times its own steps, and ranks
        # that chose apart would verify different batches: on the H100 at TP=2 rank 1 refused to
        # replay rank 0's tree graph for a chain step); None: one rank
        self.agree = agree
        self.B, self.L = tree_budget, draft_len
        self.menu = tuple(menu or (tree_budget,))  # ascending, the last is B
        if self.menu[-1] != tree_budget:
            raise ValueError(f"budget menu {self.menu} must end at the tree budget {tree_budget}")
        self._budgets = {tree_kind(b, tree_budget): b for b in self.menu}
        self.drafts = {**self._budgets, CHAIN: draft_len}  # kind -> drafts a request: b nodes, the chain's L
        smaller = [tree_kind(b, tree_budget) for b in self.menu[:-1]]
        # preference on equal rates: the largest tree, the smaller buckets (largest first), the chain
        self.kinds = [TREE] + smaller[::-1] + [CHAIN]
        metrics.set_menu(len(smaller))
        self.probe_interval = probe_interval
        self.probe_gap: dict[int, int] = {}  # bucket -> steps between the largest tree's probes, when it last lost
        self.costs: dict = dict(priors or {})  # (kind, bucket) -> seconds per step
        self._samples: dict = {}  # (kind, bucket) -> the last _WINDOW measured step times
        self.table_path = table_path
        self.tokens = dict.fromkeys(self.kinds)  # committed tokens per request-round (EMA)
        self.decisions = dict.fromkeys(self.kinds, 0)
        self.decisions_at: collections.Counter = collections.Counter()  # (kind, bucket) -> decisions
        self.probes = 0  # largest-tree steps taken while another kind won
        self.chain_probes = 0  # chain steps taken while another kind won
        self.budget_probes = 0  # smaller-bucket steps taken while another kind won
        # (kind, bucket) -> decisions at that bucket since the kind was last taken there: costs are per
        # bucket, so are probes (a chain taken at c=1 says nothing of its stale cost at c=16)
        self._since: collections.Counter = collections.Counter()
        self._n = 0
        self.draft_s: float | None = None  # seconds per proposal (drafter + tree build), both kinds
        self._next: tuple | None = None  # (kind, R, its proposal's start) for the next step
        self._began: tuple | None = None  # the same, once that step started clean after one of its kind
        self.depth = depth  # a cycle is timed after `depth` clean steps of its kind (module docstring)
        self.clock = clock  # DeviceClock: cycles on the device's timeline (CUDA); None: the host's
        self._prev = collections.deque(maxlen=depth)  # (kind, bucket) of the last clean steps; emptied if unclean
        self._clean = False  # the step now running started clean
        self._again: tuple | None = None  # (a probe's kind, its steps still to take)
        self._prev_totals = None
        self._readback = None  # (pinned host tensor, event or None)
        self._step = 0  # steps ended, to tell which timed steps were neighbours
        self._last: dict[int, dict] = {}  # bucket -> kind -> (step, seconds) of its last timed step there
        self._pairs: dict = {}  # (kind, other, bucket) -> the last _WINDOW log(its step / other's neighbouring step)
        self.stalled_pairs = 0  # neighbour ratios past _STALL_RATIO, not kept
        self._medians: dict = {}  # the same keys -> their median, until the next ratio (the fit reads it every step)
        self.min_pairs = _MIN_PAIRS  # (benchmarks/sim_auto_budget.py --no-pairs: out of reach, the costs alone)
        self.forced: str | None = None  # a kind every step takes (precompile times each kind this way)
        self.repeatable: dict[int, str] = {}  # bucket -> the kind of every step with a seeded request there
        self._chosen = collections.deque(maxlen=_TRACE)  # the kinds of the last decisions ("t", "c", "t:8")
        self._timed = collections.deque(maxlen=_TRACE)  # (step, kind, bucket, ms) of the last timed steps

    # -- the decision (host only) ------------------------------------------------------------------
    def choose(self, R: int, seeded: bool = False) -> str:
        """The kind of the next step of R requests; `seeded`: a request in it brought its own seed."""
        self._n += 1
        self._poll()
        b = bucket(R)
        if seeded and not self.forced:
            kind = self._seeded_kind(b)
        else:
            again, self._again = self._again, None
            if again is not None and again[1] > 1:
                self._again = (again[0], again[1] - 1)
            kind = self.forced or (again and again[0]) or self._decide(b)  # (_decide may start a probe: _again)
        if self.agree is not None:
            kind = self.agree(kind)
        self.decisions[kind] += 1
        self.decisions_at[kind, b] += 1
        self._chosen.append(kind)
        for k in self.kinds:
            self._since[k, b] = 0 if k == kind else self._since[k, b] + 1
        return kind

    def hold_seeded(self, buckets) -> dict[int, str]:
        """Each bucket's kind for seeded steps, fixed now where not yet (adapters/draft_schedule.hold_seeded)."""
        return {b: self.forced or self._seeded_kind(b) for b in buckets}

    def _seeded_kind(self, b: int) -> str:
        """Bucket b's kind for seeded steps, fixed at its first use (its cost fit runs once per bucket): their
        tokens must repeat, and in bf16 a verify of another shape rounds the target's logits otherwise."""
        if b not in self.repeatable:
            self.repeatable[b] = self._settled(b)
        return self.repeatable[b]

    def budget_of(self, kind: str) -> int:
        """The tree bucket (nodes) of a tree kind."""
        return self._budgets[kind]

    def _decide(self, b: int) -> str:
        if self.costs.get((TREE, b)) is None or self.tokens[TREE] is None:
            return TREE  # the largest tree's cost and every kind's acceptance are measured first
        for k in (CHAIN, *self.kinds[1:-1]):  # then every other kind's cost
            if self.costs.get((k, b)) is None:
                return k
        costs = self._fitted_costs(b)
        best = self._best(b, costs)
        for k in self.kinds:  # the largest tree first: its probes also measure every kind's acceptance
            if k == best:
                continue
            gap = self._probe_gap(k, best, b, costs)
            if k == TREE:
                self.probe_gap[b] = gap
            if self._since[k, b] + 1 >= gap:
                if k == TREE:
                    self.probes += 1
                elif k == CHAIN:
                    self.chain_probes += 1
                else:
                    self.budget_probes += 1
                return self._probe(k)
        return best

    def _settled(self, b: int) -> str:
        """The kind seeded steps take at bucket b: the best by what is measured when the first comes,
        the largest tree while a kind's cost or the acceptance is still unmeasured (as _decide tries)."""
        if self.tokens[TREE] is None or any(self.costs.get((k, b)) is None for k in self.kinds):
            return TREE
        return self._best(b, self._fitted_costs(b))

    def _best(self, b: int, costs: dict) -> str:
        return max(self.kinds, key=lambda k: (self.tokens[k] / costs[k], -self.kinds.index(k)))

    def _fitted_costs(self, b: int) -> dict:
        """Every kind's cost at bucket b for the choice: exp of the log-costs x that minimize
        sum over pairs (x_k - x_j - median log(k's step / j's neighbouring step))^2 + _OWN_WEIGHT *
        sum over kinds (x_k - log k's own cost)^2, over the pairs with _MIN_PAIRS ratios or more
        (module docstring). A few kinds: the normal equations, eliminated on the host."""
        kinds, n = self.kinds, len(self.kinds)
        a = [[_OWN_WEIGHT * (i == j) for j in range(n)] for i in range(n)]
        y = [_OWN_WEIGHT * math.log(self.costs[(k, b)]) for k in kinds]
        for i in range(n):
            for j in range(i + 1, n):
                key = (kinds[i], kinds[j], b)
                if len(self._pairs.get(key, ())) >= self.min_pairs:
                    m = self._medians.get(key)
                    if m is None:
                        m = self._medians[key] = statistics.median(self._pairs[key])
                    a[i][i] += 1.0
                    a[j][j] += 1.0
                    a[i][j] -= 1.0
                    a[j][i] -= 1.0
                    y[i] += m
                    y[j] -= m
        for c in range(n):  # (symmetric positive definite: elimination needs no pivoting)
            for r in range(c + 1, n):
                f = a[r][c] / a[c][c]
                for q in range(c, n):
                    a[r][q] -= f * a[c][q]
                y[r] -= f * y[c]
        x = [0.0] * n
        for c in reversed(range(n)):
            x[c] = (y[c] - sum(a[c][q] * x[q] for q in range(c + 1, n))) / a[c][c]
        return {k: math.exp(v) for k, v in zip(kinds, x)}

    def _probe_gap(self, k: str, best: str, b: int, costs: dict) -> int:
        """Steps between probes of the losing kind k at bucket b (module docstring)."""
        if len(self._samples.get((k, b), ())) < _SETTLED:
            return self.probe_interval
        gap = (self.depth + 1) * (costs[k] / costs[best] - self.tokens[k] / self.tokens[best]) / _PROBE_SHARE
        gap *= len(self.kinds) - 1  # (the losers share _PROBE_SHARE)
        return min(max(round(gap), self.probe_interval), self.probe_interval * _PROBE_MAX)

    def _probe(self, kind: str) -> str:
        """A probe is depth + 1 steps of its kind: the last is timed (after `depth` of its own kind)."""
        self._again = (kind, self.depth)
        return kind

    # -- costs: the host's step times --------------------------------------------------------------
    # A step of kind k costs one cycle: from the proposal that chose k (drafter forward and tree
    # build, shared by both kinds) through vLLM's output processing and scheduling and the step's
    # verify (forward, sampling, walk, commit) to the next proposal. The cycle is timed only when
    # the step started clean (verify_began); draft_s (the proposals' share) is for the snapshot.
    def proposed(self, kind: str, R: int, t_start: float, t_end: float) -> None:
        """The proposal for the next step took t_start..t_end; that step will be of `kind`, R requests."""
        d = t_end - t_start
        self.draft_s = d if self.draft_s is None else self.draft_s + _EMA * (min(d, 4 * self.draft_s) - self.draft_s)
        self._next = (kind, R, t_start)

    def verify_began(self, now: float) -> None:
        """The proposed step starts as a clean step of its kind (no prefill, no fallback); it is timed
        if the step before it was a clean one of the same kind and bucket."""
        began, self._next = self._next, None
        if began is None:
            return
        this = (began[0], bucket(began[1]))
        timed = len(self._prev) == self.depth and all(p == this for p in self._prev)
        self._prev.append(this)
        self._began = began if timed else None
        self._clean = True

    def step_ended(self, now: float) -> None:
        """The next proposal starts: the step timed since verify_began, from its own proposal on (on
        the device's timeline where there is a clock: read a few steps later)."""
        self._step += 1
        if self.clock is not None:
            self.clock.mark(self._step, None if self._began is None else (self._began[0], bucket(self._began[1])))
            for step, (kind, b), seconds in self.clock.ready():
                self._observe(kind, b, seconds, step)
        elif self._began is not None:
            kind, R, t = self._began
            self._observe(kind, bucket(R), now - t, self._step)
        if not self._clean:  # (a prefill or a fallback: the next step follows no clean step)
            self._prev.clear()
        self._began = self._next = None
        self._clean = False

    def _observe(self, kind: str, b: int, seconds: float, step: int) -> None:
        """Step `step` (of kind at bucket b) took `seconds`. The cost is the mean of the faster half of
        the key's last _WINDOW measured steps, once there are _MIN_SAMPLES of them: a first-call
        compile or any stall cannot move it unless it hits half the window. The table's prior stands
        until then."""
        self._timed.append((step, kind, b, round(1e3 * seconds, 3)))
        key = (kind, b)
        window = self._samples.setdefault(key, collections.deque(maxlen=_WINDOW))
        window.append(seconds)
        if len(window) >= _MIN_SAMPLES:
            faster = sorted(window)[: max(1, len(window) // 2)]
            self.costs[key] = sum(faster) / len(faster)
        last = self._last.setdefault(b, {})
        for other, (then, s) in last.items():
            if other != kind and step - then <= self.depth + 1:  # (a probe and its neighbours)
                r = math.log(seconds / s)
                if abs(r) > math.log(_STALL_RATIO):
                    self.stalled_pairs += 1
                    continue
                for key, v in (((kind, other, b), r), ((other, kind, b), -r)):
                    self._pairs.setdefault(key, collections.deque(maxlen=_WINDOW)).append(v)
                    self._medians.pop(key, None)
        last[kind] = (step, seconds)

    # -- acceptance: DDTree's device counters, read back without a sync ---------------------------
    def _poll(self) -> None:
        if self._readback is not None:
            host, event = self._readback
            if event is not None and not event.query():
                return
            self._readback = None
            self._update(host.tolist())
        if self._readback is None and (self._n % _READBACK == 0 or self.tokens[TREE] is None):
            totals = self.metrics.acceptance_totals()  # device: tree rows, accepted, off-chain, per smaller bucket
            pinned = totals.device.type == "cuda"
            host = torch.empty(totals.shape, dtype=totals.dtype, pin_memory=pinned)
            host.copy_(totals, non_blocking=pinned)
            event = None
            if pinned:
                event = torch.cuda.Event()
                event.record()
            self._readback = (host, event)

    def _update(self, totals: list) -> None:
        prev, self._prev_totals = self._prev_totals or [0] * len(totals), totals
        rows, acc, off, *within = (a - b for a, b in zip(totals, prev))
        if rows <= 0:
            return
        smaller = [(tree_kind(b, self.B), 1 + w / rows) for b, w in zip(self.menu, within)]
        for kind, tokens in ((TREE, 1 + acc / rows), (CHAIN, 1 + (acc - off) / rows), *smaller):
            old = self.tokens[kind]
            self.tokens[kind] = tokens if old is None else old + _EMA * (tokens - old)

    def snapshot(self) -> dict:
        return {"tree_budget": self.B, "menu": list(self.menu), "chain_len": self.L, "depth": self.depth,
                "clock": "host" if self.clock is None else "device",
                "decisions": dict(self.decisions),
                "decisions_at": {f"{k}@{b}": n for (k, b), n in sorted(self.decisions_at.items())},
                "probes": self.probes, "probe_gap": dict(self.probe_gap), "chain_probes": self.chain_probes,
                "stalled_pairs": self.stalled_pairs,
                "budget_probes": self.budget_probes, "repeatable": dict(self.repeatable),
                "tokens_per_round": dict(self.tokens), "table": self.table_path,
                "draft_ms": None if self.draft_s is None else 1e3 * self.draft_s,
                "step_ms": {f"{k}@{b}": 1e3 * c for (k, b), c in sorted(self.costs.items())},
                "step_ratio": {f"{k}/{o}@{b}": math.exp(statistics.median(r))
                               for (k, o, b), r in sorted(self._pairs.items()) if k < o},
                # what the choice and the costs rest on, step by step (the kind a decision wrote may
                # reach a step later, where the scheduler gives each step its draft count: Model Runner V2)
                "chosen": list(self._chosen), "timed": [list(t) for t in self._timed]}

