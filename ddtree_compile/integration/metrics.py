"""DDTree counters: what the tree rounds verified, accepted and wasted, and why they fell back.

Per-round numbers stay on the device (one small accumulator tensor, no host sync in a round); the
host reads them only when asked (`snapshot()`), for the periodic log line, or at `collect(llm)`.
Host-side counters (fallbacks, step kinds, wall time of each phase) are plain Python numbers.

vLLM's own spec-decode metrics (`vllm:spec_decode_num_drafts`, `..._num_draft_tokens`,
`..._num_accepted_tokens`, `..._num_accepted_tokens_per_pos`, also on Prometheus) keep working:
the scheduler sees B drafts per tree round and the accepted path as an accepted prefix.
The DDTree-specific counters below live in the worker process; `collect(llm)` fetches them.

Phase times are host wall clock around each phase: exact on CPU (synchronous), launch time only
on CUDA. The periodic "DDTree:" log line (every `log_interval` tree steps, DDTreeConfig) reads the
device counters, i.e. syncs once per interval; log_interval=0 turns it off.

Prometheus: vLLM's spec-decode series already carry the per-round numbers that the scheduler sees
(drafts = B per tree round -> nodes verified; accepted tokens and accepted-per-position -> accept
depth and its histogram; draft - accepted -> nodes wasted). The DDTree counters below are also
series of their own on the server's /metrics (`vllm:ddtree_*`): integration/prometheus.py carries
them from the worker to the front process (docs/serve.md says how and why).
"""

from __future__ import annotations

import collections
import logging
import os
import threading

import torch


def _logger() -> logging.Logger:
    """The package logger, visible without any logging setup (vLLM only configures its own "vllm"
    logger). DDTREE_LOG_LEVEL sets the level (default INFO). It does not propagate to the root logger
    (no duplicate lines where an application configured logging); tests that capture it turn that on."""
    lg = logging.getLogger("ddtree_compile")
    if not lg.handlers:
        lg.propagate = False
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter("(%(processName)s pid=%(process)d) %(levelname)s %(asctime)s "
                                         "[ddtree_compile] %(message)s", "%m-%d %H:%M:%S"))
        lg.addHandler(h)
        lg.setLevel(os.environ.get("DDTREE_LOG_LEVEL", "INFO"))
    return lg


logger = _logger()

# Accumulator columns (device, int64).
_COLS = ("tree_requests", "nodes_verified", "nodes_accepted", "sibling_rounds", "sibling_nodes",
         "full_accepts", "zero_accepts")
_ACCEPTANCE = [_COLS.index(c) for c in ("tree_requests", "nodes_accepted", "sibling_nodes")]
# Host-time phases of a round (DDTreeMetrics.seconds): "draft" is the drafter's forward as vLLM runs it
# (flat DFlash's work too); "build" .. "commit" are DDTree's own host work, the time in its code only
# ("verify": the step's preparation, arm and disarm, not vLLM's target forward between them; "commit":
# not vLLM's update after it).
ROUND_PHASES = ("draft", "build", "verify", "walk", "commit")
PROCESS_STARTUP_FALLBACKS: collections.Counter = collections.Counter()  # reason -> engines, this process
_REFUSED: set[str] = set()


def refuse_once(reason: str, consequence: str) -> None:
    """DDTree cannot run in this process (e.g. a vLLM outside the adapters' window): counted and
    logged once per reason and consequence, so every caller that meets it says what it does instead."""
    key = f"{reason} ({consequence})"
    if key in _REFUSED:
        return
    _REFUSED.add(key)
    PROCESS_STARTUP_FALLBACKS[reason] += 1
    logger.warning("ddtree_compile: %s; %s.", reason, consequence)
_LOCK = threading.Lock()
_REGISTRY: list = []  # live DDTreeMetrics of this process (one per DDTree runner)


class DDTreeMetrics:
    def __init__(self, max_depth: int, device, log_interval: int = 0):
        self.max_depth = max_depth
        self.log_interval = log_interval
        self.device = torch.device(device)
        self._log_copy = None  # (event, accepted counts, histogram) on their way to the host (maybe_log)
        self._acc = torch.zeros(len(_COLS), dtype=torch.int64, device=device)
        self._hist = torch.zeros(max_depth + 1, dtype=torch.int64, device=device)  # accept depth histogram
        # budget "auto"'s inputs: tree rows, accepted, off-chain of the largest bucket's steps, then
        # per smaller bucket of the menu what it would have accepted (set_menu)
        self._largest = torch.zeros(3, dtype=torch.int64, device=device)
        # on the device once: indexing a CUDA tensor with a host list copies the list from pageable
        # memory, which waits for the stream (here: for the whole tree verify, every step)
        self._acceptance = torch.tensor(_ACCEPTANCE, device=device)
        self.budget_steps: collections.Counter = collections.Counter()  # tree bucket (nodes) -> tree steps
        self.tree_steps = 0  # steps verified as trees
        self.chain_steps = 0  # steps with drafts verified as a plain chain (whole-step fallback)
        self.auto_chain_steps = 0  # steps budget "auto" (or a draft schedule's count) verified as the drafter's chain
        self.conv_repairs = 0  # GDN rows vLLM-cpu verified with short drafts, their conv lines repaired
        self.auto = None  # budget "auto": its policy (round/auto_budget.py), for the snapshot
        self.graph_steps = 0  # verifies (tree or chain-shaped) that replayed a FULL CUDA graph
        self.graph_sizes: list[int] = []  # batch sizes (requests) whose FULL graph holds the largest tree's ops
        self.graph_buckets: dict[int, list[int]] = {}  # tree bucket (nodes) -> batch sizes of its FULL graphs
        self.chain_graph_sizes: list[int] = []  # budget "auto": batch sizes of the chain's FULL graphs (vLLM's ops)
        self.plain_graph_steps = 0  # verifies without trees (auto's chain, fallbacks) that replayed a FULL graph
        self.stage_replays: collections.Counter = collections.Counter()  # stage -> steps it replayed a graph
        self.stage_eager: collections.Counter = collections.Counter()  # stage -> steps it ran eagerly (CUDA)
        self.stage_graphs: dict[str, int] = {}  # stage -> graphs captured (round/stage_graphs.py)
        # Model Runner V2: proposals whose drafter forward ran its Python (no FULL CUDA graph replayed
        # it), by the step's kind ("tree", "chain"): on a GPU every one is host time a replay saves
        self.drafter_eager: collections.Counter = collections.Counter()
        self.fallback_steps: collections.Counter = collections.Counter()  # reason -> steps
        self.fallback_requests: collections.Counter = collections.Counter()  # reason -> request rounds
        self.seconds: collections.Counter = collections.Counter()  # phase -> wall seconds
        self.kv_layouts: list[str] = []  # the attention layers' KV-cache layouts (kv_layouts.py)
        with _LOCK:
            _REGISTRY.append(self)

    # -- recording (device, no sync) ---------------------------------------------------------
    def set_menu(self, smaller: int) -> None:
        """Budget "auto" with `smaller` buckets below the largest: acceptance_totals grows by them."""
        self._largest = torch.zeros(3 + smaller, dtype=torch.int64, device=self._largest.device)

    def record_round(self, tree_rows: torch.Tensor, nodes: torch.Tensor, accepted: torch.Tensor,
                     off_chain: torch.Tensor, full: torch.Tensor, within: torch.Tensor | None = None,
                     largest: bool = True) -> None:
        """One tree step. All args [R] on the device: bool tree row; live nodes; accepted path length
        (excluding the root); accepted nodes off the drafter's top-1 chain; accepted the whole draft.
        largest: the step verified the largest bucket; within [smaller buckets, R]: what each smaller
        bucket of the menu would have accepted (walk_stage)."""
        t = tree_rows.to(torch.int64)
        acc = accepted.to(torch.int64) * t
        row = torch.stack([t.sum(), (nodes.to(torch.int64) * t).sum(), acc.sum(),
                           ((off_chain > 0) & tree_rows).sum(), (off_chain.to(torch.int64) * t).sum(),
                           (full & tree_rows).sum(), ((accepted == 0) & tree_rows).sum()])
        self._acc += row
        self._hist.scatter_add_(0, acc.clamp(max=self.max_depth), t)
        if largest:
            parts = [row.index_select(0, self._acceptance)] + ([] if within is None else [(within * t).sum(-1)])
            self._largest += torch.cat(parts)

    def device_counters(self) -> dict:
        """The device tensors `record_round` adds into (at fixed addresses: a graph of the walk writes them)."""
        return {"acc": self._acc, "hist": self._hist, "largest": self._largest}

    def acceptance_totals(self) -> torch.Tensor:
        """Device [3 + smaller buckets] int64 over the largest bucket's steps: tree rows, accepted
        nodes, accepted nodes off the drafter's top-1 chain, then per smaller bucket its accepted nodes."""
        return self._largest

    def fallback(self, reason: str, requests: int = 0) -> None:
        if requests:
            self.fallback_requests[reason] += requests
        else:
            self.fallback_steps[reason] += 1

    def add_time(self, phase: str, seconds: float) -> None:
        self.seconds[phase] += seconds

    # -- reading (host sync) -------------------------------------------------------------------
    def snapshot(self, acc_hist: tuple | None = None) -> dict:
        """The counters (a host sync), or with `acc_hist` the device counters as copied earlier."""
        acc, hist = acc_hist or (self._acc, self._hist)
        acc, hist = dict(zip(_COLS, acc.tolist())), hist.tolist()
        n = max(acc["tree_requests"], 1)
        return {
            **acc,
            "nodes_wasted": acc["nodes_verified"] - acc["nodes_accepted"],
            "mean_accept_depth": acc["nodes_accepted"] / n,
            "max_accept_depth": max((d for d, c in enumerate(hist) if c), default=0),
            "accept_depth_histogram": hist,
            "tree_steps": self.tree_steps,
            "budget_steps": {int(b): n for b, n in sorted(self.budget_steps.items())},
            "chain_steps": self.chain_steps,
            "auto_chain_steps": self.auto_chain_steps,
            "conv_repairs": self.conv_repairs,
            "auto": self.auto.snapshot() if self.auto is not None else None,
            "graph_steps": self.graph_steps,
            "graph_sizes": list(self.graph_sizes),
            "graph_buckets": {int(b): list(r) for b, r in sorted(self.graph_buckets.items())},
            "chain_graph_sizes": list(self.chain_graph_sizes),
            "plain_graph_steps": self.plain_graph_steps,
            "stage_replays": dict(self.stage_replays),
            "stage_eager": dict(self.stage_eager),
            "stage_graphs": dict(self.stage_graphs),
            "drafter_eager": {k: self.drafter_eager[k] for k in ("tree", "chain")},
            "fallback_steps": dict(self.fallback_steps),
            "fallback_requests": dict(self.fallback_requests),
            "fallback_total": sum(self.fallback_steps.values()) + sum(self.fallback_requests.values()),
            "seconds": dict(self.seconds),
            "kv_layouts": list(self.kv_layouts),
        }

    def maybe_log(self) -> None:
        """Every log_interval tree steps a line of the counters. On a GPU the device counters reach the
        host by a copy started then and logged at the first tree step that finds it done: no host sync,
        which under async scheduling would stall the loop the round overlaps."""
        if self._log_copy is not None and self._log_copy[0].query():
            _, acc, hist = self._log_copy
            self._log_copy = None
            logger.info("DDTree: %s", format_line(self.snapshot((acc, hist))))
        if not self.log_interval or self.tree_steps % self.log_interval:
            return
        if self._acc.device.type != "cuda":
            logger.info("DDTree: %s", format_line(self.snapshot()))
            return
        self._log_copy = self.host_copy()

    def host_copy(self) -> tuple:
        """(event, accepted counts, histogram): the device counters' copy to the host, started now on this
        thread's stream (pinned, non-blocking) and complete once `event.query()` (None off CUDA: the
        counters themselves); for `snapshot(copy[1:])` without a host sync."""
        if self._acc.device.type != "cuda":
            return None, self._acc, self._hist
        with torch.cuda.device(self._acc.device):
            acc, hist = self._acc.to("cpu", non_blocking=True), self._hist.to("cpu", non_blocking=True)  # pinned
            event = torch.cuda.Event()
            event.record()
        return event, acc, hist

    def close(self) -> None:
        with _LOCK:
            if self in _REGISTRY:
                _REGISTRY.remove(self)


def format_line(s: dict) -> str:
    return (f"tree steps {s['tree_steps']}, chain steps {s['chain_steps']}"
            f"{', auto chain steps ' + str(s['auto_chain_steps']) if s.get('auto') else ''}, rounds {s['tree_requests']}, "
            f"nodes verified {s['nodes_verified']} / accepted {s['nodes_accepted']} / wasted {s['nodes_wasted']}, "
            f"mean accept depth {s['mean_accept_depth']:.2f} (max {s['max_accept_depth']}), "
            f"sibling rounds {s['sibling_rounds']}, fallbacks {s['fallback_total']}")


# numeric lists that describe the engine, not counts
_DESCRIPTIVE = {"graph_sizes", "graph_buckets", "chain_graph_sizes"}


def counters_delta(after: dict, before: dict) -> dict:
    """Numeric difference of two `DDTreeMetrics.snapshot()`s (histograms element-wise): the counters
    of what ran between them (e.g. one timed batch of `precompile`)."""
    out = {}
    for k, v in after.items():
        b = before.get(k)
        if k in _DESCRIPTIVE:
            out[k] = v
        elif isinstance(v, (int, float)) and isinstance(b, (int, float)) and not isinstance(v, bool):
            out[k] = v - b
        elif (isinstance(v, list) and isinstance(b, list) and len(v) == len(b)
              and all(isinstance(x, (int, float)) for x in v + b)):
            out[k] = [x - y for x, y in zip(v, b)]
        elif (isinstance(v, dict) and isinstance(b, dict) and v
              and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v.values())):
            out[k] = {key: x - b.get(key, 0) for key, x in v.items()}  # counters by key (budget_steps)
        elif isinstance(v, (list, str)):  # descriptive fields (kv_layouts): as they are now
            out[k] = v
    if "nodes_accepted" in out:  # derived fields: recomputed, not differenced
        out["mean_accept_depth"] = out["nodes_accepted"] / max(out["tree_requests"], 1)
        out["max_accept_depth"] = max((d for d, c in enumerate(out["accept_depth_histogram"]) if c), default=0)
    return out


def collect(llm) -> list[dict]:
    """DDTree counters of a `vllm.LLM`'s workers: one snapshot per DDTree runner, by tensor-parallel
    rank ([] if DDTree is off). Multiprocess engines need VLLM_ALLOW_INSECURE_SERIALIZATION=1
    (`engines.on_runners`); without it, read the periodic "DDTree:" log line."""
    from ddtree_compile.integration import engines

    return [s for s in engines.on_runners(llm, _snapshot) if s is not None]


def _snapshot(runner) -> dict | None:
    from ddtree_compile.integration.engines import state_of

    state = state_of(runner)
    return state.metrics.snapshot() if state is not None else None
