"""DDTree on vLLM 0.26's Model Runner V2 (docs/runner_v2.md).

A DFlash drafter mixing sliding and full attention (the Qwen3.6 drafter's shape) makes vLLM run V2.
Two engines with DDTree, one after the other in this process: the attention-only Qwen3 eager (V2 is
0.26's own choice for it; V2's synchronous loop), then the tiny multimodal Qwen3.5 hybrid compiled with
FULL_AND_PIECEWISE CUDA graphs in vLLM's default loop (async scheduling on), text and image prompts.
Only one compiled V2 engine per process: vLLM 0.26 crashes on a second one (its own flat DFlash too),
so `make test-gpu` runs every module in its own process and the compiled engine comes last here.
Checks: the regret gates against no speculation, trees that branch, (compiled) every tree verify a
FULL-graph replay and the drafter's own FULL graphs (captured for its L positions) replayed, (hybrid)
the committed GDN state equal to a float32 replay, seeded sampling, no host sync from DDTree's
code in a warm step (torch's sync debug mode), and the kernels launched outside CUDA graphs and the
graph replays per tree step (torch's profiler).
"""

from __future__ import annotations

import _engines as E
import pytest

V2 = ".gpu.model_runner."  # vllm.v1.worker.gpu.model_runner.GPUModelRunner (V1: gpu_model_runner)


def _count_drafter_replays(llm) -> list:
    """Count the V2 drafter's FULL-graph replays (V2 captures them for 1 + L queries under DDTree)."""
    from ddtree_compile.integration import engines

    replays = [0]
    graphs = getattr(getattr(engines.find_runner(llm), "speculator", None), "query_cudagraph_manager", None)
    if graphs is None:  # not V2 (the test says so): nothing to count
        return replays
    replay = graphs.run_fullgraph

    def counting(desc):
        replays[0] += 1
        return replay(desc)

    graphs.run_fullgraph = counting
    return replays


@pytest.fixture(scope="module")
def models_dir(gpu_env, tmp_path_factory):
    gpu_env.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)  # vLLM's own runner choice: V2 for these
    from ddtree_compile.testing import models

    root = tmp_path_factory.mktemp("v2")
    target = models.write_tiny_vl_model(root / "target", seed=4)
    qwen3 = models.write_tiny_model("qwen3", root / "qwen3")
    return {"target": target, "qwen3": qwen3,
            "mixed": models.write_tiny_dflash_drafter(target, root / "mixed", seed=4, layer_types=E.MIXED),
            "qwen3_mixed": models.write_tiny_dflash_drafter(qwen3, root / "qwen3_mixed", layer_types=E.MIXED)}


@pytest.fixture(scope="module")
def qwen3(models_dir):
    prompts = {"text": E.text_and_image_prompts()["text"]}
    ref_info, ref = E.reference(models_dir["qwen3"], prompts, hybrid=False)
    with E.running(models_dir["qwen3"], models_dir["qwen3_mixed"], hybrid=False, graphs=False) as (llm, info):
        out = E.ddtree_runs(llm, ref, prompts, state_check=False)
    return {"reference_engine": ref_info, "engine": info, **out}


@pytest.fixture(scope="module")
def hybrid(models_dir, qwen3):  # after qwen3: the one compiled V2 engine of this process comes last
    prompts = E.text_and_image_prompts()
    ref_info, ref = E.reference(models_dir["target"], prompts, **E.MM)
    # vLLM's default loop: async scheduling as vLLM resolves it (on for DFlash)
    with E.running(models_dir["target"], models_dir["mixed"], async_scheduling=None, **E.MM) as (llm, info):
        replays = _count_drafter_replays(llm)
        out = E.ddtree_runs(llm, ref, prompts, state_check=True)
        out["host_syncs"] = E.host_syncs(llm, prompts["text"])
        try:  # (its own test fails on an error here, not the module's others)
            out["launches"] = E.launches(llm, prompts["text"])
        except Exception as e:  # noqa: BLE001
            out["launches"] = {"error": repr(e)}
    return {"reference_engine": ref_info, "engine": info, "drafter_graph_replays": replays[0], **out}


def test_qwen3_eager_on_v2(qwen3, record):
    record(runner=qwen3["engine"].get("runner"), start_s=qwen3["engine"]["start_s"])
    assert V2 in qwen3["engine"]["runner"], qwen3["engine"]
    E.check_lossless(qwen3, ["text"], graphs=False, state_check=False, record=record)


def test_hybrid_with_full_graphs_on_v2_with_async_scheduling(hybrid, record):
    record(runner=hybrid["engine"].get("runner"), start_s=hybrid["engine"]["start_s"],
           async_scheduling=hybrid["engine"].get("async_scheduling"),
           drafter_graph_replays=hybrid["drafter_graph_replays"])
    assert V2 in hybrid["engine"]["runner"] and "FULL" in hybrid["engine"]["cudagraph_mode"], hybrid["engine"]
    assert hybrid["engine"]["async_scheduling"] is True, hybrid["engine"]  # vLLM's default loop
    assert hybrid["engine"]["uses_mrope"], hybrid["engine"]
    # the batch-independence of seeded sampling is checked below, on its own
    E.check_lossless({**hybrid, "seeded_alone_equal": True}, ["text", "image"], record=record)
    assert hybrid["drafter_graph_replays"] > 0


def test_the_round_adds_no_host_sync_under_async_scheduling(hybrid, record):
    """A warm greedy batch under torch's sync debug mode: no sync from DDTree's code (vLLM's own are
    recorded: the loop's output copy is its one per step)."""
    record(host_syncs=hybrid["host_syncs"])
    assert hybrid["host_syncs"]["ddtree"] == 0, hybrid["host_syncs"]


def test_launches_per_tree_step_are_measured(hybrid, record):
    """Kernels launched outside CUDA graphs and graph replays per tree step of a warm greedy batch
    (torch's profiler; every launch of the process), and of one more batch the torch operations the
    steps dispatch by owner, DDTree's or vLLM's (`by_owner`: outside a replay, each is a launch or a
    copy). Recorded for the round's launch budget (issue goal: at most 10 eager launches of DDTree's
    per tree step); asserted: the steps replayed graphs (the drafter's and the verify's at least),
    and the counts cover tree steps."""
    n = hybrid["launches"]
    record(launches=n)
    assert "error" not in n, n
    assert n["tree_steps"] > 10 and n["graphs_per_step"] >= 2, n
    assert n["by_owner"]["tree_steps"] > 10, n["by_owner"]


def test_hybrid_seeded_sampling_independent_of_the_batch(hybrid, record):
    """A seeded request gives the same tokens alone as in a batch: what users are promised. (Once, on an
    H200, one request's last token differed: README Known gaps. Asserted, not excused: a failure here is
    that gap, to be fixed, not a pass.)"""
    record(seeded_alone_equal=hybrid["seeded_alone_equal"])
    assert hybrid["seeded_alone_equal"]
