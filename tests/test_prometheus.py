"""integration/prometheus.py without an engine: worker snapshot files -> the exposition text vLLM's
/metrics serves (prometheus_client's own renderer), summed over workers, one histogram per model."""

import json

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from ddtree_compile.integration import metrics, prometheus


@pytest.fixture(autouse=True)
def _no_live_runners(monkeypatch):
    # The collector also reads live in-process runners; engines of other test modules may still exist.
    monkeypatch.setattr(metrics, "_REGISTRY", [])


def _snap(**kw):
    base = {"model_name": "m", "tree_steps": 3, "chain_steps": 1, "tree_requests": 4, "nodes_verified": 40,
            "nodes_accepted": 6, "nodes_wasted": 34, "sibling_rounds": 1, "sibling_nodes": 1, "full_accepts": 0,
            "zero_accepts": 1, "accept_depth_histogram": [1, 2, 0, 1], "fallback_steps": {"mixed batch": 1},
            "fallback_requests": {"logprobs": 2}, "seconds": {"draft": 0.75, "build": 0.5, "verify": 1.0, "walk": 0.25,
                                                                        "commit": 0.125}}
    return {**base, **kw}


def test_worker_files_become_vllm_style_series(tmp_path):
    (tmp_path / "worker-1.json").write_text(json.dumps(_snap()))
    (tmp_path / "worker-2.json").write_text(json.dumps(_snap(accept_depth_histogram=[0, 1],
                                                             fallback_requests={"penalties": 1})))
    (tmp_path / "worker-3.json.tmp").write_text("{half a fi")  # a writer mid-rename is skipped
    reg = CollectorRegistry()
    reg.register(prometheus.DDTreeCollector(str(tmp_path)))
    text = generate_latest(reg).decode()
    assert "# TYPE vllm:ddtree_nodes_verified_total counter" in text
    assert 'vllm:ddtree_nodes_verified_total{model_name="m"} 80.0' in text
    assert 'vllm:ddtree_rounds_total{model_name="m"} 8.0' in text
    assert 'vllm:ddtree_graph_steps_total{model_name="m"} 0.0' in text  # a snapshot without the key: 0
    assert 'vllm:ddtree_fallbacks_total{model_name="m",reason="logprobs",scope="request"} 2.0' in text
    assert 'vllm:ddtree_fallbacks_total{model_name="m",reason="penalties",scope="request"} 1.0' in text
    assert 'vllm:ddtree_fallbacks_total{model_name="m",reason="mixed batch",scope="step"} 2.0' in text
    assert 'vllm:ddtree_phase_seconds_total{model_name="m",phase="verify"} 2.0' in text
    assert 'vllm:ddtree_phase_seconds_total{model_name="m",phase="draft"} 1.5' in text  # the drafter, apart
    # depth counts [1, 3, 0, 1] -> cumulative buckets; count = rounds in it, sum = their depths
    assert "# TYPE vllm:ddtree_accept_depth histogram" in text
    for le, v in (("0.0", 1), ("1.0", 4), ("2.0", 4), ("3.0", 5), ("+Inf", 5)):
        assert f'vllm:ddtree_accept_depth_bucket{{le="{le}",model_name="m"}} {float(v)}' in text, le
    assert 'vllm:ddtree_accept_depth_count{model_name="m"} 5.0' in text
    assert 'vllm:ddtree_accept_depth_sum{model_name="m"} 6.0' in text


def test_no_series_before_any_worker(tmp_path):
    reg = CollectorRegistry()
    reg.register(prometheus.DDTreeCollector(str(tmp_path / "absent")))
    assert "ddtree" not in generate_latest(reg).decode()


def test_worker_exports_when_only_auto_chain_steps_move(tmp_path, monkeypatch):
    """Budget "auto" can run chain steps only for a long while (the chain wins): the worker's file must
    follow them, or /metrics would hold the counters of the last tree step."""
    import threading
    import time

    monkeypatch.setattr(prometheus, "EXPORT_INTERVAL", 0.01)
    m = metrics.DDTreeMetrics(max_depth=4, device="cpu")
    folder = tmp_path / "metrics"
    folder.mkdir()
    t = threading.Thread(target=prometheus._export_loop, args=(m, str(folder)), daemon=True)
    t.start()

    def exported():
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            files = list(folder.glob("worker-*.json"))
            if files:
                snap = json.loads(files[0].read_text())
                if snap["auto_chain_steps"] == m.auto_chain_steps:
                    return snap
            time.sleep(0.01)
        raise AssertionError(f"no export with auto_chain_steps={m.auto_chain_steps}")

    exported()
    m.auto_chain_steps += 3  # nothing else moves
    assert exported()["tree_steps"] == 0
    for f in folder.iterdir():
        f.unlink()
    folder.rmdir()  # ends the loop
    t.join(5)


def test_worker_writes_the_device_counters_once_their_copy_is_done(tmp_path, monkeypatch):
    """On CUDA the worker's counters reach the host by a non-blocking copy (DDTreeMetrics.host_copy), not
    a sync: the export loop writes the counters as copied, at the first interval that finds the copy's
    event done, never waiting on it. Here the event is a stand-in done at its fourth query (CUDA events
    are not on this machine); the counters move after the copy started and are not what is written."""
    import threading
    import time

    class Event:
        def __init__(self):
            self.queries = 0

        def query(self):
            self.queries += 1
            return self.queries >= 4

    monkeypatch.setattr(prometheus, "EXPORT_INTERVAL", 0.01)
    m = metrics.DDTreeMetrics(max_depth=4, device="cpu")
    m.record_round(torch.ones(1, dtype=torch.bool), torch.full((1,), 8), torch.tensor([3]), torch.tensor([1]),
                   torch.zeros(1, dtype=torch.bool))
    m.tree_steps = 1
    copies, started = [], threading.Event()

    def host_copy():
        copies.append((Event(), m._acc.clone(), m._hist.clone()))
        started.set()
        return copies[-1]

    monkeypatch.setattr(m, "host_copy", host_copy)
    folder = tmp_path / "metrics"
    folder.mkdir()
    t = threading.Thread(target=prometheus._export_loop, args=(m, str(folder)), daemon=True)
    t.start()
    assert started.wait(10)
    m.record_round(torch.ones(1, dtype=torch.bool), torch.full((1,), 8), torch.tensor([4]), torch.tensor([0]),
                   torch.zeros(1, dtype=torch.bool))  # (after the copy: not in this export)
    deadline = time.monotonic() + 10
    while not list(folder.glob("worker-*.json")) and time.monotonic() < deadline:
        time.sleep(0.01)
    snap = json.loads(next(folder.glob("worker-*.json")).read_text())
    assert copies[0][0].queries >= 4 and snap["nodes_accepted"] == 3 and snap["tree_requests"] == 1, snap
    for f in folder.iterdir():
        f.unlink()
    folder.rmdir()  # ends the loop
    t.join(5)
