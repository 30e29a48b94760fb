"""bench_e2e_gpu's cells: one (mode, profile, concurrency) cell timed, its counters differenced into
rounds and DDTree's round split, its row, the GPU profile of a mode, and the break-even against flat
DFlash (also over merged parts)."""

from __future__ import annotations

import json
import pathlib

import _phase_timers
import _step_clock
from summarize_e2e import rounds_per_s


def cell(timed, llm, prompts, max_tokens, repeats, min_cell_s: float = 0.0) -> dict:
    """One (mode, profile, concurrency) cell: `repeats` timed runs, reported by the run of median
    tok/s. A run is c requests of max_tokens: at c=1 on the 4B shape well under a second, and
    single runs of the same engine varied by up to 25% (a log line, a GC pause, a clock step).
    With `min_cell_s`, runs are added until they sum to that much wall time (more_runs)."""
    runs = []
    while more_runs(len(runs), [runs], repeats, min_cell_s):
        runs.append(timed(llm, prompts, max_tokens))
    return median(runs)


def more_runs(done: int, runs_of_each: list, repeats: int, min_cell_s: float) -> bool:
    """Whether a cell takes another run (of every mode, alike): fewer than `repeats` done, or some
    mode's runs sum to less than `min_cell_s` of wall time, up to _MAX_RUNS_FACTOR x repeats (--min-cell-s:
    a short cell's runs, c = 1 of a fast engine, are the ones a hiccup moves)."""
    repeats = max(repeats, 1)
    if done < repeats:
        return True
    return done < _MAX_RUNS_FACTOR * repeats and any(sum(r["wall_s"] for r in runs) < min_cell_s
                                                      for runs in runs_of_each)


_MAX_RUNS_FACTOR = 8


def median(runs) -> dict:
    """The run of median tok/s, with every run's tok/s and outputs, their summed wall time and the
    smallest of their peak batches (a cell is as full as its emptiest run)."""
    mid = sorted(runs, key=lambda r: r["tok_s"])[len(runs) // 2]
    return mid | {"tok_s_runs": [r["tok_s"] for r in runs], "runs_outputs": [r["outputs"] for r in runs],
                     "wall_s_total": sum(r["wall_s"] for r in runs),  # the span of the cell's round counters
                     "steps_total": sum(r["steps"] for r in runs), "peak_batch": min(r["peak_batch"] for r in runs)}


def match(outputs, reference) -> float:
    same = total = 0
    for o, r in zip(outputs, reference):
        total += len(o)
        same += sum(a == b for a, b in zip(o, r))
    return same / max(total, 1)


def summary(r, ref, max_tokens) -> dict:
    """A cell's timings (the median run) and the worst reference match over its runs."""
    ref = [x[:max_tokens] for x in ref]
    outputs = min(r.get("runs_outputs", [r["outputs"]]), key=lambda o: match(o, ref))
    out = {k: r[k] for k in ("wall_s", "output_tokens", "tok_s", "tpot_p50_ms", "tpot_p90_ms")} | {
        "reference_match": match(outputs, ref), "tok_s_runs": r.get("tok_s_runs", [r["tok_s"]]),
        "wall_s_total": r.get("wall_s_total", r["wall_s"])}
    if "peak_batch" in r:
        out["peak_batch"] = r["peak_batch"]
    if "steps_total" in r:  # every mode's engine steps (prefill included): ms per step side by side
        out["ms_per_step"] = 1e3 * out["wall_s_total"] / max(r["steps_total"], 1)
    if out["reference_match"] < 0.9:  # evidence for the closing note: where the outputs left the reference
        out["mismatch_heads"] = [{"output": o[:24], "reference": x[:24]} for o, x in zip(outputs, ref)][:4]
    return out


def counters(llm, budget) -> dict:
    """vLLM's spec-decode counters, and DDTree's for a DDTree engine."""
    from ddtree_compile.integration import metrics
    from ddtree_compile.testing import e2e

    return {"vllm": e2e.spec_counters(llm), "ddtree": metrics.collect(llm)[0] if budget else None,
            "phases": _phase_timers.snapshot(llm), "clock": _step_clock.snapshot(llm)}


def rounds_of(budget, before, after) -> dict:
    """Tokens per round and rounds (per request), and DDTree's round split.

    Fixed budgets: DDTree's counters (tree rounds). Flat DFlash and budget "auto" (whose chain steps
    vLLM verifies): vLLM's spec-decode counters, which count every verify (tree or chain) as a draft
    and its committed tokens but the bonus as accepted."""
    va, vb = after["vllm"], before["vllm"]
    drafts = va["vllm:spec_decode_num_drafts"] - vb.get("vllm:spec_decode_num_drafts", 0)
    acc = va["vllm:spec_decode_num_accepted_tokens"] - vb.get("vllm:spec_decode_num_accepted_tokens", 0)
    out = {"rounds": drafts, "tokens_per_round": 1 + acc / max(drafts, 1)}
    if after.get("phases") is not None:  # --phase-timers: host wall per phase (per step: add_row)
        out["phase_s"] = {k: v - (before.get("phases") or {}).get(k, 0.0) for k, v in after["phases"].items()}
    if after.get("clock") is not None:  # and the steady steps by kind and bucket on one clock (_step_clock.py)
        out["step_clock"] = _step_clock.summary(before.get("clock"), after["clock"])
    if budget:
        from ddtree_compile.integration import metrics

        a, b = after["ddtree"], before["ddtree"]
        d = metrics.counters_delta(a, b)
        split = {k: a["seconds"].get(k, 0) - b["seconds"].get(k, 0) for k in a.get("seconds", {})}
        # (graph_steps: tree verifies that replayed a FULL graph; plain_graph_steps: verifies without a
        # tree that did, budget "auto"'s chain steps among them; the stage graphs' replays and eager runs;
        # proposals whose drafter ran eagerly, by kind, and the batch sizes the graphs were captured for)
        out.update(round_split_s=split, graph_steps=d.get("graph_steps"), tree_steps=d.get("tree_steps"),
                   plain_graph_steps=d.get("plain_graph_steps"), stage_replays=d.get("stage_replays"),
                   stage_eager=d.get("stage_eager"), drafter_eager=d.get("drafter_eager"),
                   graph_buckets=a.get("graph_buckets"), chain_graph_sizes=a.get("chain_graph_sizes"),
                   fallback_total=d.get("fallback_total"),
                   tree_tokens_per_round=1 + d["nodes_accepted"] / max(d["tree_requests"], 1))
        if budget != "auto":
            out.update(rounds=d["tree_requests"] + d.get("chain_steps", 0),
                       tokens_per_round=out["tree_tokens_per_round"])
        else:  # the policy's snapshot is the engine's whole life; its decisions per kind@bucket in this cell too
            was = (b.get("auto") or {}).get("decisions_at", {})
            now = (a.get("auto") or {}).get("decisions_at", {})
            out.update(auto_chain_steps=d.get("auto_chain_steps"), auto=a.get("auto"),
                       auto_decisions_in_cell={k: n - was.get(k, 0) for k, n in now.items() if n > was.get(k, 0)})
    return out


def gpu_profile_at(args, conc: list, bare: list) -> list:
    """The concurrencies of this command that get a --gpu-profile run: none without the option, `bare`
    for the bare flag, else the listed ones among `conc`."""
    wanted = getattr(args, "gpu_profile", None)
    if not wanted:
        return []
    return list(bare) if wanted == "all" else [c for c in wanted if c in conc]


def gpu_profile(llm, prompts, max_tokens, budget, top=60) -> dict:
    """One more timed run under torch.profiler: the GPU's busy time per round (kernel and copy
    durations, which host overhead does not change) next to the wall time per round, and the
    kernels that fill it. Wall - busy is the time the GPU waited for the host."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from ddtree_compile.cli.timing import timed_steps

    before = counters(llm, budget)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        r = timed_steps(llm, prompts, max_tokens)
    rounds = max(rounds_of(budget, before, counters(llm, budget))["rounds"], 1)
    dev = [e for e in p.key_averages() if e.device_type == DeviceType.CUDA]
    us = [(getattr(e, "self_device_time_total", 0) or 0, e.count, e.key) for e in dev]
    busy_ms = sum(t for t, _, _ in us) / 1e3 / rounds
    us.sort(reverse=True)
    host = sorted(((e.count, e.self_cpu_time_total, e.key) for e in p.key_averages()
                   if e.device_type == DeviceType.CPU and e.key.startswith("aten::")), reverse=True)
    return {"rounds": rounds, "started_s": r["started_s"], "wall_ms_per_round_profiled": 1e3 * r["wall_s"] / rounds,
            "gpu_busy_ms_per_round": busy_ms, "gpu_launches_per_round": sum(c for _, c, _ in us) / rounds,
            "host_aten_ops_per_round": sum(c for c, _, _ in host) / rounds,
            "kernels": [{"name": k[:120], "ms_per_round": t / 1e3 / rounds, "per_round": c / rounds}
                        for t, c, k in us[:top]],
            "host_ops": [{"name": k, "per_round": c / rounds, "self_cpu_ms_per_round": t / 1e3 / rounds}
                         for c, t, k in host[:top]],
            "triton_specializations": triton_specializations()}


# vLLM's GatedDeltaNet kernels of a chain verify: what each engine compiled them for (argument
# alignment, constexprs) tells two engines' launches apart where their kernel times differ
GDN_KERNELS = ("vllm.third_party.flash_linear_attention.ops.fused_sigmoid_gating:"
               "fused_sigmoid_gating_delta_rule_update_kernel",
               "vllm.model_executor.layers.mamba.ops.causal_conv1d:_causal_conv1d_update_kernel")


def triton_specializations(kernels=GDN_KERNELS) -> dict:
    """{kernel: [the keys of its compiled variants]}: Triton compiles one variant per specialization
    (pointer alignment, integer divisibility, constexpr values), and the key spells it out."""
    import importlib

    out = {}
    for ref in kernels:
        module, name = ref.split(":")
        try:
            fn = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
        while not hasattr(fn, "device_caches") and hasattr(fn, "fn"):  # autotuners, heuristics
            fn = fn.fn
        caches = getattr(fn, "device_caches", {})  # device -> (kernel cache, ...) in Triton 3.x
        out[name] = sorted(str(k) for c in caches.values() for k in (c[0] if isinstance(c, tuple) else c))
    return out


def add_row(result, args, mode, budget, prof, c, r, ref, rounds) -> None:
    from ddtree_compile.testing import oracle

    row = {"mode": mode, "budget": budget, "profile": prof.name, "concurrency": c,
           **summary(r, ref[:c], args.max_tokens), **rounds}
    if "phase_s" in rounds and r.get("steps_total"):
        row["phase_ms_per_step"] = {k: 1e3 * v / r["steps_total"] for k, v in rounds["phase_s"].items()}
    if rounds.get("round_split_s") and r.get("steps_total") and row.get("ms_per_step"):
        # DDTree's own host work (its round phases but the drafter's forward), per step and as a share of
        # the step: the goal line is <= 5% on Model Runner V2
        own = sum(v for k, v in rounds["round_split_s"].items() if k != "draft")
        row["own_host_ms_per_step"] = 1e3 * own / r["steps_total"]
        row["own_host_share"] = row["own_host_ms_per_step"] / row["ms_per_step"]
    row["simulated_tokens_per_round"] = None if budget == "auto" else oracle.simulate(
        prof, budget or args.flat_len, args.top_k if budget else 1, args.flat_len, samples=2000)
    result["runs"].append(row)
    print(line(row), flush=True)
    if row.get("peak_batch", c) < c:
        print(f"  ^ {mode} served at most {row['peak_batch']} of the cell's {c} requests at once: "
              "its KV cache holds fewer (summarize_e2e marks the row invalid)", flush=True)


def line(r) -> str:
    return (f"{r['mode']:<9} {r['profile']:<14} c={r['concurrency']:<3} {r['tok_s']:9.1f} tok/s  "
            f"TPOT p50 {r['tpot_p50_ms']:7.2f} ms  tokens/round {r['tokens_per_round']:.2f} "
            f"(sim {r['simulated_tokens_per_round'] or float('nan'):.2f})  ref match {r['reference_match']:.2f}")


def break_even(runs) -> None:
    """Per DDTree row: flat rounds/s over DDTree rounds/s at the same profile and concurrency, i.e.
    the tree acceptance gain over the chain at which DDTree's tok/s equals flat DFlash's."""
    flat = {(r.get("pair"), r["profile"], r["concurrency"]): r
            for r in runs if r.get("mode") == "flat" and "rounds" in r}
    for r in runs:
        f = flat.get((r.get("pair"), r.get("profile"), r.get("concurrency")))
        if r.get("budget") and f and r.get("rounds"):
            r["break_even_gain"] = rounds_per_s(f) / rounds_per_s(r)
            r["tok_s_vs_flat"] = r["tok_s"] / f["tok_s"]
            r["measured_gain"] = r["tokens_per_round"] / f["tokens_per_round"]


def merge(paths, out) -> dict:
    """One result from several commands' JSON files (runs and GPU profiles concatenated, break-even
    recomputed). The runs of a --side-by-side part carry `pair` (its modes, e.g. "flat+auto"): their
    ratios stay against that part's own flat runs, which ran interleaved with them."""
    parts = [json.loads(pathlib.Path(p).read_text()) for p in paths]
    result = {**parts[0], "merged_from": [str(p) for p in paths], "runs": [], "starts": {}, "gpu_profiles": []}
    for k in ("device", "vllm", "torch"):  # (a part cut off by its command's time limit has only its runs)
        result.setdefault(k, next((p[k] for p in parts if k in p), None))
    for p in parts:
        if p.get("args", {}).get("side_by_side"):
            pair = "+".join(dict.fromkeys(r["mode"] for r in p["runs"]))
            p["runs"] = [{**r, "pair": pair} for r in p["runs"]]
        result["runs"] += p["runs"]
        result["starts"].update(p.get("starts", {}))
        result["gpu_profiles"] += p.get("gpu_profiles", [])
    break_even(result["runs"])
    pathlib.Path(out).write_text(json.dumps(result, indent=1, default=str))
    return result
