"""DDTree at tensor parallel 2 inside vLLM 0.26 on two GPUs (skipped with fewer): every rank checked.

A tiny held-out hybrid: the dense Qwen3-Next with TWO experts, both taken by every token (vLLM's
Qwen3-Next MoE block refuses tensor parallel > number of experts, and top-2 of 2 keeps it free of
routing decisions a 1-ulp difference could flip). No speculation (eager, the gates' reference), then
DDTree compiled with FULL_AND_PIECEWISE graphs, both at TP=2 with NCCL's all-reduce (vLLM's custom
all-reduce crashed the flat-DFlash control's graph capture there, CHANGELOG). Per rank, reached through
LLM.collective_rpc (VLLM_ALLOW_INSECURE_SERIALIZATION=1): DDTree attached, its tree verifies FULL-graph
replays, counters identical across ranks (same trees, walks and replays), the committed GDN state of
every path equal to a float32 replay on that rank's heads; the regret gates; seeded sampling.
"""

from __future__ import annotations

import _engines as E
import pytest

TP = 2
SAME_ON_EVERY_RANK = ("tree_steps", "chain_steps", "tree_requests", "nodes_verified", "nodes_accepted",
                      "sibling_rounds", "accept_depth_histogram", "fallback_steps", "fallback_requests", "graph_steps")


def _two_expert_target(out):
    """models.write_tiny_model("qwen3_next_dense") with 2 experts, top-2 (module docstring)."""
    import torch

    from ddtree_compile.testing import models

    cfg, model_cls = models._config("qwen3_next_dense")
    cfg.num_experts = cfg.num_experts_per_tok = TP
    models._seed_all(0)
    model = model_cls._from_config(cfg, dtype=torch.float32)
    models._randomize_norms(model, 0)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture(scope="module")
def tp2(gpu_env, tmp_path_factory):
    import torch

    if torch.cuda.device_count() < TP:
        pytest.skip(f"tensor parallel {TP} needs {TP} GPUs, this machine has {torch.cuda.device_count()}")
    gpu_env.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    gpu_env.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc ships the functions to the ranks
    # this process has CUDA initialised (the evidence names the device): forked ranks could not use it
    gpu_env.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    from ddtree_compile.integration import metrics
    from ddtree_compile.testing import harness, models

    root = tmp_path_factory.mktemp("tp2")
    target = _two_expert_target(root / "target")
    drafter = models.write_tiny_dflash_drafter(target, root / "dflash")
    prompts = models.token_prompts(4, 16, models.VOCAB, seed=0)
    kw = {"tensor_parallel_size": TP, "disable_custom_all_reduce": True}
    with E.running(target, graphs=False, **kw) as (llm, ref_info):
        ref = E.generate(llm, prompts, logprobs=5)
    out = {"reference_engine": ref_info}
    with E.running(target, drafter, **kw) as (llm, info):
        out["engine"] = info
        vc = getattr(llm.llm_engine, "vllm_config", None)  # the ranks' runners live in their own processes
        out["cudagraph_mode"] = str(vc.compilation_config.cudagraph_mode) if vc is not None else "FULL_AND_PIECEWISE"
        c0 = metrics.collect(llm)
        out["attached_ranks"] = len(c0)
        if len(c0) != TP:
            return out
        random = E.generate(llm, prompts)
        c1 = metrics.collect(llm)
        harness.install_state_check_on_workers(llm)  # each rank checks its own GDN heads
        harness.install_on_workers(llm, {tuple(r["prompt"]): r["prompt"] + r["tokens"] for r in ref})
        guided = E.generate(llm, prompts)
        harness.uninstall_on_workers(llm)
        c2 = metrics.collect(llm)
        out["state_checks"] = harness.state_checks(llm)
        out.update(E.seeded(llm, prompts))
        c3 = metrics.collect(llm)
    out["phases"] = {name: [metrics.counters_delta(a, b) for a, b in zip(after, before)]
                     for name, after, before in (("random", c1, c0), ("harness", c2, c1), ("seeded", c3, c2))}
    out["gates"] = E.gates(ref, random) + E.gates(ref, guided)
    return out


def test_every_rank_lossless_and_in_step(tp2, record):
    phases = tp2.get("phases", {})
    record(attached_ranks=tp2["attached_ranks"], cudagraph_mode=tp2.get("cudagraph_mode"),
           start_s=tp2["engine"]["start_s"], state_checks=tp2.get("state_checks"),
           per_rank={p: [{k: d.get(k) for k in ("tree_steps", "graph_steps", "sibling_rounds")} for d in ds]
                     for p, ds in phases.items()},
           gates_ok=f"{sum(g['ok'] for g in tp2.get('gates', []))}/{len(tp2.get('gates', []))}")
    assert tp2["attached_ranks"] == TP, "DDTree did not attach on every rank"
    full = "FULL" in tp2["cudagraph_mode"]
    for name, per_rank in phases.items():
        same = [{k: d.get(k) for k in SAME_ON_EVERY_RANK} for d in per_rank]
        assert all(s == same[0] for s in same), (name, same)
        if name != "seeded":
            assert all(d["tree_steps"] > 0 and (not full or d["graph_steps"] == d["tree_steps"]) for d in per_rank), \
                (name, per_rank)
    assert all(d["sibling_rounds"] > 0 for d in phases["harness"]), phases["harness"]
    sc = tp2["state_checks"]
    assert len(sc) == TP and all(x["paths"] > 0 and x["sibling_paths"] > 0 for x in sc), sc
    bad = [g for g in tp2["gates"] if not g["ok"]]
    assert not bad, bad
    assert tp2["seeded_repeat_equal"] and tp2["seeded_alone_equal"] and tp2["seeded_seeds_differ"], tp2
