"""DDTree's counters as Prometheus series on vLLM's `/metrics` (names in vLLM's style: `vllm:ddtree_...`).

Path (docs/serve.md says why): DDTree's counters live in the worker process (metrics.DDTreeMetrics);
vLLM's `/metrics` is served by the API-server process from prometheus_client's default REGISTRY.
vLLM 0.32 carries no extensible per-step payload from the worker to its stat loggers, so:

* front process: the plugin's `register()` (vLLM runs it there before it spawns the engine core)
  calls `setup_front()`: it makes a private folder, names it in DDTREE_METRICS_DIR (inherited by
  the engine-core and worker processes) and registers `DDTreeCollector` in the default REGISTRY;
* worker: once DDTree is attached (`start_exporter(runner)`, from the plugin's KV-cache hook) a
  daemon thread writes the runner's `snapshot()` to `DDTREE_METRICS_DIR/worker-<pid>.json`
  (atomic rename) every EXPORT_INTERVAL seconds when a host-side counter moved;
* scrape: the collector reads those files (and the live runners of its own process, for
  in-process engines) and yields counters and the accept-depth histogram.

A scrape is at most EXPORT_INTERVAL seconds behind. Not served when PROMETHEUS_MULTIPROC_DIR is
set (vLLM's multi-API-server mode serves only the multiprocess collector there). Under tensor
parallelism only rank 0 exports: every rank runs the same rounds (tests/test_e2e_tp.py checks that
their counters are identical), so summing the ranks would count each round TP times; separate
engines (data parallel) each export and are summed.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
import threading

import ddtree_compile.adapters as adapters
from ddtree_compile.integration.metrics import ROUND_PHASES

ENV, OWNER = "DDTREE_METRICS_DIR", "DDTREE_METRICS_OWNER"
EXPORT_INTERVAL = float(os.environ.get("DDTREE_METRICS_INTERVAL", "1.0"))
PREFIX = "vllm:ddtree_"

# snapshot key -> (series name without prefix, help)
COUNTERS = {
    "tree_steps": ("tree_steps", "Engine steps verified as DDTree trees."),
    "chain_steps": ("chain_steps", "Engine steps with drafts verified as a plain chain (whole-step fallback)."),
    "auto_chain_steps": ("auto_chain_steps", "Budget \"auto\": steps it chose to verify as the drafter's chain."),
    "tree_requests": ("rounds", "Request rounds verified as trees."),
    "nodes_verified": ("nodes_verified", "Tree nodes verified by the target."),
    "nodes_accepted": ("nodes_accepted", "Tree nodes accepted (committed path length, bonus excluded)."),
    "nodes_wasted": ("nodes_wasted", "Tree nodes verified but not accepted."),
    "sibling_rounds": ("sibling_rounds", "Rounds whose accepted path left the drafter's top-1 chain."),
    "sibling_nodes": ("sibling_nodes", "Accepted nodes off the drafter's top-1 chain."),
    "full_accepts": ("full_accepts", "Rounds that accepted the whole draft depth."),
    "zero_accepts": ("zero_accepts", "Rounds that accepted no node."),
    "graph_steps": ("graph_steps", "Verifies (tree or chain-shaped) that replayed a FULL CUDA graph."),
}
_MODEL = {}  # id(DDTreeMetrics) -> served model name (labels)
_EXPORTERS: dict[int, threading.Thread] = {}


def setup_front() -> None:
    """In the first process that loads the plugin (vLLM's front end): the folder and the collector.
    vLLM's own child processes (engine core, workers: multiprocessing children) that inherit
    DDTREE_METRICS_DIR only write into it; any other process with the variable set (a server
    started by a test or a script that loaded the plugin itself) is a front of its own."""
    import multiprocessing

    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return
    if ENV in os.environ and multiprocessing.parent_process() is not None:
        return
    from prometheus_client import REGISTRY

    folder = tempfile.mkdtemp(prefix="ddtree-metrics-")
    os.environ[ENV], os.environ[OWNER] = folder, str(os.getpid())
    atexit.register(shutil.rmtree, folder, True)
    REGISTRY.register(DDTreeCollector(folder))


def start_exporter(runner) -> None:
    """Worker side, once DDTree is attached to `runner`: export its counters for the front's /metrics."""
    from ddtree_compile.integration.engines import state_of

    state = state_of(runner)
    if state is None:
        return
    A = adapters.current()
    _MODEL[id(state.metrics)] = A.settings_of(runner).served_model_name
    folder = os.environ.get(ENV)
    if not folder or os.environ.get(OWNER) == str(os.getpid()) or id(state.metrics) in _EXPORTERS:
        return  # no front collector, or the same process: the collector reads the live runner
    if A.tp_rank() != 0:
        return  # the same rounds as rank 0 (module docstring)
    t = threading.Thread(target=_export_loop, args=(state.metrics, folder), daemon=True, name="ddtree-metrics")
    _EXPORTERS[id(state.metrics)] = t
    t.start()


def _export_loop(m, folder: str) -> None:
    import time

    path = os.path.join(folder, f"worker-{os.getpid()}-{id(m)}.json")
    last, copy = None, None
    while os.path.isdir(folder):
        # Host-side counters move on every step; the device ones are only read when they did: on CUDA
        # a copy of a few ints started then (no host sync: a sync here, on vLLM's device, would wait
        # for the steps queued ahead) and written at the first interval that finds it done.
        sig = (m.tree_steps, m.chain_steps, m.auto_chain_steps, sum(m.fallback_steps.values()),
               sum(m.fallback_requests.values()))
        if copy is None and sig != last:
            copy, last = m.host_copy(), sig
        if copy is not None and (copy[0] is None or copy[0].query()):
            snap = {"model_name": _MODEL.get(id(m), ""), **m.snapshot(copy[1:])}
            copy = None
            tmp = path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(snap, f)
            os.replace(tmp, path)
        time.sleep(EXPORT_INTERVAL)


def _read(folder: str) -> list[dict]:
    from ddtree_compile.integration import metrics

    out = []
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if name.endswith(".json"):
            try:
                with open(os.path.join(folder, name)) as f:
                    out.append(json.load(f))
            except (OSError, ValueError):
                continue  # a writer vanished mid-rename: its next file comes with the next scrape
    with metrics._LOCK:
        live = list(metrics._REGISTRY)
    out += [{"model_name": _MODEL.get(id(m), ""), **m.snapshot()} for m in live if id(m) not in _EXPORTERS]
    return out


def families(snaps: list[dict]):
    """prometheus_client metric families for a list of worker snapshots (summed per model)."""
    from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

    by_model: dict[str, list[dict]] = {}
    for s in snaps:
        by_model.setdefault(s.get("model_name", ""), []).append(s)
    fams = {key: CounterMetricFamily(PREFIX + name, doc, labels=["model_name"]) for key, (name, doc) in COUNTERS.items()}
    fallbacks = CounterMetricFamily(PREFIX + "fallbacks", "DDTree fallbacks to a chain verify, by reason and "
                                    "scope (step: a whole step; request: one request's round).",
                                    labels=["model_name", "scope", "reason"])
    seconds = CounterMetricFamily(PREFIX + "phase_seconds", "Host wall time in each round phase "
                                  "(exact on CPU, launch time on CUDA).", labels=["model_name", "phase"])
    hist = HistogramMetricFamily(PREFIX + "accept_depth", "Accepted path depth per tree round.",
                                 labels=["model_name"])
    for model, group in sorted(by_model.items()):
        for key in COUNTERS:
            fams[key].add_metric([model], sum(s.get(key, 0) for s in group))
        for scope in ("step", "request"):
            reasons: dict[str, int] = {}
            for s in group:
                for reason, n in s.get(f"fallback_{scope}s", {}).items():
                    reasons[reason] = reasons.get(reason, 0) + n
            for reason, n in sorted(reasons.items()):
                fallbacks.add_metric([model, scope, reason], n)
        phases: dict[str, float] = {}
        for s in group:
            for phase, sec in s.get("seconds", {}).items():
                phases[phase] = phases.get(phase, 0.0) + sec
        for phase in ROUND_PHASES:
            seconds.add_metric([model, phase], phases.get(phase, 0.0))
        depth = max((len(s.get("accept_depth_histogram", [])) for s in group), default=0)
        counts = [sum(s["accept_depth_histogram"][d] for s in group if d < len(s.get("accept_depth_histogram", [])))
                  for d in range(depth)]
        cum, buckets = 0, []
        for d, c in enumerate(counts):
            cum += c
            buckets.append((str(float(d)), cum))
        buckets.append(("+Inf", cum))
        hist.add_metric([model], buckets, sum_value=sum(d * c for d, c in enumerate(counts)))
    return [*fams.values(), fallbacks, seconds, hist]


class DDTreeCollector:
    """A prometheus_client custom collector over the workers' exported snapshots."""

    def __init__(self, folder: str):
        self.folder = folder

    def describe(self):
        return []  # no fixed series before the first engine: skip the registry's duplicate check

    def collect(self):
        snaps = _read(self.folder)
        if snaps:
            yield from families(snaps)
