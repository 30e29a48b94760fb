"""DDTree vs flat DFlash vs no speculation, end to end in one vLLM, with the oracle drafter.

    python benchmarks/bench_e2e_gpu.py --target qwen35_4b --out build/e2e_4b.json
    python benchmarks/bench_e2e_gpu.py --target tiny --max-tokens 32 --concurrency 1,2 --out build/e2e.json  # CPU smoke
    # over several 10-minute device commands: --modes nospec,flat / ddtree16,ddtree32 / ... with one
    # --reference build/ref.json, then: python benchmarks/bench_e2e_gpu.py --merge A.json B.json --out ALL.json
    # ratios side by side (the engines up together, one process each, their runs interleaved; see
    # _e2e_side_by_side.py): two cold 4B engines are up in 5-6 min on the H100 and the cells take ~2.5 min,
    # so one pair per 10-minute command (at c=16 a third 4B engine's KV cache does not fit), e.g.
    python benchmarks/bench_e2e_gpu.py --target qwen35_4b --modes flat,ddtree32 --budgets 32 --side-by-side \
        --repeat-reference --models-dir build/m4 --gpu-memory-utilization 0.9 --out build/e2e_4b_sbs.json
    # tensor parallel 2, side by side (two H200s; on two H100s run the modes one engine at a time, without
    # --side-by-side: see --tensor-parallel-size)
    python benchmarks/bench_e2e_gpu.py --target qwen36_27b --tensor-parallel-size 2 --modes flat,ddtree32 --budgets 32 \
        --side-by-side --kv-cache-gib flat=14,*=26 --repeat-reference --models-dir build/m27tp2 --out build/e2e_27b_tp2.json

Per target: the no-speculation engine first (timed per concurrency, and its greedy outputs are the
reference continuations the oracle drafts from), then one engine per speculative mode (vLLM's flat
DFlash with --flat-len drafts; DDTree per budget; DDTree with budget "auto": per step its tree of
--auto-budget nodes or the plain chain), each timed per oracle profile
(benchmarks/oracle_profiles.json, calibrated by calibrate_oracle.py) and concurrency (--repeats runs
per cell; the run of median tok/s is reported, every run's tok/s kept). Timing walks
`llm.llm_engine.step()` and stamps every step (cli/timing.py), so TPOT is per request and per step (p50/p90 over
output tokens). Per run: output tok/s, TPOT p50/p90, tokens per round (acceptance length: DDTree's
counters; flat DFlash: vLLM's spec-decode counters), DDTree's round split (its host-side phase
timers), the share of output tokens equal to the reference (bf16 verify can leave the reference:
the oracle then drafts the wrong continuation), and the break-even tree gain (flat DFlash rounds
per second / DDTree rounds per second: the acceptance gain DDTree needs to match flat DFlash).

Targets: "qwen35_4b" / "qwen36_27b" are Qwen3-Next-architecture dense hybrids (one expert, 3 GDN
layers per full-attention layer) with the layer shapes of Qwen3.5-4B / Qwen3.6-27B (vLLM 0.26
serves Qwen3.5 only as the multimodal model, whose M-RoPE DDTree does not run yet), vLLM dummy
weights, and a DFlash-shaped drafter (5 layers, block 16) with dummy weights. "tiny" is the
seeded tiny model of the test suite (CPU smoke).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _e2e_cells as cells  # noqa: E402  (beside this file)
import _phase_timers  # noqa: E402
import _step_clock  # noqa: E402
from _e2e_engine import (LOOPS, SHAPES, VOCAB, attached, force_chain, install_oracle, loop_info,  # noqa: E402
                         loop_of, precompile_command, spec_of, start_engine, use_loop, write_shaped)
from _e2e_side_by_side import side_by_side  # noqa: E402

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: counters, oracle
os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")  # later commands on a warm machine skip the GDN autotune

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run(args) -> dict:
    from ddtree_compile.cli.timing import timed_steps as _timed
    from ddtree_compile.integration import engines, plugin
    from ddtree_compile.testing import harness, models, oracle

    plugin.register()
    prof_json = json.loads((ROOT / args.profiles).read_text())
    unknown = sorted(set(args.profile_names) - {p["name"] for p in prof_json["profiles"]})
    if unknown:
        raise SystemExit(f"--profile-names: {unknown} not in {args.profiles}; allowed: "
                         f"{', '.join(p['name'] for p in prof_json['profiles'])}")
    profiles = [oracle.profile_from(p) for p in prof_json["profiles"] if p["name"] in args.profile_names]
    conc = [int(c) for c in args.concurrency.split(",")]
    # a fixed --models-dir keeps the model paths, so vLLM's compile cache of an earlier process applies
    tmp = pathlib.Path(args.models_dir) if args.models_dir else pathlib.Path(tempfile.mkdtemp(prefix="bench_e2e_"))
    if args.target == "tiny":
        target = models.write_tiny_model(args.tiny_kind, tmp / "t", dtype="bfloat16")
        drafter = models.write_tiny_dflash_drafter(target, tmp / "d")
        vocab = models.VOCAB
    else:
        target, drafter = write_shaped(args.target, tmp, experts=args.tensor_parallel_size)
        vocab = VOCAB
    prompts = models.token_prompts(max(conc), args.prompt_len, vocab, seed=0)
    result = {"args": dict(vars(args)), "profiles": prof_json, "runs": [], "starts": {}}
    if args.cost_table == "precompile" and "auto" in dict(speculative_modes(args)).values():
        args.cost_table = str(pathlib.Path(args.out).with_suffix(".cost_table.json"))
        subprocess.run(precompile_command(args, target, drafter, max(conc), args.cost_table), check=True)
    if args.cost_table:  # the table's rows beside the runs (its path and the models' are this machine's)
        table = json.loads(pathlib.Path(args.cost_table).read_text())
        result["cost_table"] = {k: table.get(k) for k in ("op_swap", "max_batch", "max_tokens", "buckets", "starts")}

    def save():  # after every run: a command cut off by its time limit keeps what it measured
        pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.out).write_text(json.dumps(result, indent=1, default=str))

    def engine(name, spec=None, extra=None):
        llm, result["starts"][name] = start_engine(args, target, conc, prompts, spec, extra, mode=name)
        if args.phase_timers:
            _phase_timers.install(llm)
            _step_clock.install(llm)
        return llm

    ref_path = pathlib.Path(args.reference) if args.reference else None
    ref = json.loads(ref_path.read_text())["outputs"] if ref_path and ref_path.exists() else None
    if ref is None and args.repeat_reference:  # a sharpened target's greedy (sharpen()); reference_match checks it
        ref = [[p["prompt_token_ids"][-1]] * (args.max_tokens + 32) for p in prompts]
    if ref is None or "nospec" in args.modes:
        llm = engine("nospec")
        try:
            if ref is None:
                ref = _timed(llm, prompts, args.max_tokens + 32)["outputs"]
                if ref_path:
                    ref_path.write_text(json.dumps({"target": args.target, "outputs": ref}))
            for c in conc if "nospec" in args.modes else ():
                r = cells.cell(_timed, llm, prompts[:c], args.max_tokens, args.repeats, args.min_cell_s)
                result["runs"].append({"mode": "nospec", "concurrency": c,
                                       **cells.summary(r, ref[:c], args.max_tokens)})
                save()
        finally:
            engines.shutdown(llm)
    reference = harness.reference_from_outputs(prompts, ref)
    modes = speculative_modes(args)
    if args.side_by_side:
        setup = {"args": vars(args), "target": target, "conc": conc, "prompts": prompts, "ref": ref}
        names = set(args.profile_names)
        side_by_side([(m, b, *spec_of(b, args, drafter)) for m, b in modes],
                     [p for p in prof_json["profiles"] if p["name"] in names], setup, result, save)
        cells.break_even(result["runs"])
        return result
    for mode, budget in modes:
        try:
            llm = engine(mode, *spec_of(budget, args, drafter))
        except Exception as e:  # one mode failing to start must not lose the others
            result["runs"].append({"mode": mode, "error": repr(e)[:500]})
            continue
        try:
            if not attached(llm, mode, budget, result):
                continue
            force_chain(llm, mode)
            for prof in profiles:
                od = install_oracle(llm, reference, prof, prompts, conc)
                try:
                    for c in conc:
                        for _ in range(args.warmup_runs):
                            _timed(llm, prompts[:c], args.max_tokens)
                        before = cells.counters(llm, budget)
                        r = cells.cell(_timed, llm, prompts[:c], args.max_tokens, args.repeats, args.min_cell_s)
                        after = cells.counters(llm, budget)
                        rounds = {**cells.rounds_of(budget, before, after), "loop": loop_of(mode, args), **loop_info(llm)}
                        cells.add_row(result, args, mode, budget, prof, c, r, ref, rounds)
                        save()
                finally:
                    od.uninstall()
            # --gpu-profile after the engine's timed cells, under the first profile (a profiled run
            # leaves the engine slower: _e2e_side_by_side.py)
            at = cells.gpu_profile_at(args, conc, conc[:1]) if profiles else []
            od = install_oracle(llm, reference, profiles[0], prompts, conc) if at else None
            try:
                for c in at:
                    result.setdefault("gpu_profiles", []).append(
                        {"mode": mode, "profile": profiles[0].name, "concurrency": c,
                         **cells.gpu_profile(llm, prompts[:c], args.max_tokens, budget)})
                    save()
            finally:
                if od is not None:
                    od.uninstall()
        finally:
            engines.shutdown(llm)
    cells.break_even(result["runs"])
    return result


def speculative_modes(args) -> list[tuple[str, object]]:
    """(mode, budget) of each speculative mode in --modes, in the order listed: "flat", "ddtree<B>"
    ("ddtree": every --budgets), "auto", "autochain", "flatalike", "flatpart", "flatnosplit", each optionally
    "@<loop>" (_e2e_engine.LOOPS)."""
    known = {"flat": None, "flatalike": None, "flatpart": None, "flatnosplit": None, "auto": "auto",
             "autochain": "auto",
             **{f"ddtree{b}": b for b in args.budgets}}
    out = []
    for m in args.modes:
        base, _, loop = m.partition("@")
        suffix = "@" + loop if loop else ""
        if base == "ddtree":
            out += [(f"ddtree{b}{suffix}", b) for b in args.budgets]
        elif base in known:
            out.append((m, known[base]))
        elif base != "nospec":
            raise SystemExit(f"--modes: unknown mode {m!r}")
    return out


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--attention-config: not JSON ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"--attention-config: a JSON object expected, got {text!r}")
    return value


def _gpu_profile_concurrency(text: str) -> str | list:
    if text == "all":
        return text
    try:
        return [int(c) for c in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--gpu-profile: concurrencies joined by ',' (e.g. '1,16') or bare, "
                                         f"got {text!r}") from None


def main(argv=None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--merge"]:  # --merge A.json B.json ... --out ALL.json
        i = argv.index("--out")
        cells.merge(argv[1:i], argv[i + 1])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="qwen35_4b", choices=[*SHAPES, "tiny"])
    ap.add_argument("--tiny-kind", default="qwen3", help="models.KINDS kind for --target tiny")
    ap.add_argument("--out", required=True)
    ap.add_argument("--budgets", default="16,22,32,64", type=lambda s: [int(x) for x in s.split(",") if x])
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--flat-len", type=int, default=15, help="flat DFlash's draft tokens = DDTree's draft length L")
    ap.add_argument("--auto-budget", default=[32], type=lambda s: [int(x) for x in s.split(",") if x],
                    help='budget "auto": its tree bucket, or a menu of them (8,16,32)')
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per cell; the median tok/s is reported")
    ap.add_argument("--min-cell-s", type=float, default=0.0, help="more timed runs (up to 8x --repeats) until the "
                    "cell's runs sum to this many seconds of wall time (side by side: every mode's, each taking "
                    "as many runs as the others)")
    ap.add_argument("--warmup-runs", type=int, default=1, help="untimed runs per cell and mode before its timed "
                    "runs: every engine enters a cell at its steady state (budget 'auto' carries the last cell's "
                    "costs and acceptance into the next: H100 4B runs without it lagged a profile switch, "
                    "taking the chain in most of a c=1 cell where budget 32 read 1.20x)")
    ap.add_argument("--profiles", default="benchmarks/oracle_profiles.json", help="relative to the repository root "
                    "unless absolute (so that results record no machine path)")
    ap.add_argument("--profile-names", default="port_plus4,sglang_plus22,paper_1p35,thinking_2p5")
    ap.add_argument("--modes", default="nospec,flat,ddtree,auto", help="any of nospec, flat, ddtree (every "
                    "budget), ddtree<B>, auto, autochain (budget \"auto\" held to the chain every step: what its chain "
                    "step costs against flat DFlash's), flatalike (flat DFlash compiled as DDTree's engines are, "
                    "--flat-compile alike, next to flat's own), flatpart (flat DFlash with vLLM's own compile config but "
                    "Inductor's graph partition, without DDTree's pass: flatalike's compile less DDTree's part), flatnosplit "
                    "(flat DFlash compiled as one graph, no split, FULL CUDA graphs), each with an optional @loop (see --loop; e.g. "
                    "flat@v1sync: the V1 synchronous flat DFlash); split a long run over several commands")
    ap.add_argument("--reference", default=None, help="JSON file of the reference outputs: read if it exists, "
                    "else written (so later commands skip computing them)")
    ap.add_argument("--repeat-reference", action="store_true", help="shaped targets: take the reference as the "
                    "last prompt token repeated (what sharpen() makes the target say) instead of a no-spec engine")
    ap.add_argument("--models-dir", default=None, help="where the config-only model folders are written "
                    "(default: a new temporary folder)")
    ap.add_argument("--gpu-profile", nargs="?", const="all", default=None, type=_gpu_profile_concurrency,
                    help="per mode, after every timed cell (a profiled run slows its engine for good), one more run "
                    "under the first profile and torch.profiler: GPU busy ms per round and the top kernels "
                    "(gpu_profiles); bare: every concurrency (--side-by-side) or "
                    "the first; or a list, e.g. '1,16' (a profiled run at c=64 takes minutes)")
    ap.add_argument("--phase-timers", action="store_true", help="host wall time per phase of vLLM's step "
                    "(scheduler, runner, drafter; _phase_timers.py) for every mode: rows get phase_ms_per_step, and on "
                    "Model Runner V2 step_clock: the steady steps by kind and batch bucket on the device's clock "
                    "(_step_clock.py)")
    ap.add_argument("--side-by-side", action="store_true", help="all speculative modes' engines up at once, "
                    "one process each (GPU memory split evenly), their runs alternating within each cell: ratios "
                    "immune to a drift of the host's speed between engines (see _e2e_side_by_side.py)")
    ap.add_argument("--devices", default=None, help="--side-by-side: the GPU of each mode's engine, in --modes "
                    "order (e.g. '1,2,3'; the list repeats if shorter; indices into CUDA_VISIBLE_DEVICES if it is "
                    "set). Engines on one GPU split its memory (fixed KV "
                    "caches, --kv-cache-gib); an engine alone on its GPU sizes its KV cache from vLLM's memory "
                    "profile. The runs still alternate, so one engine runs at a time: a 27B-shaped engine per "
                    "GPU keeps every mode side by side where two do not fit one GPU. With --tensor-parallel-size N, "
                    "each engine's N GPUs joined by '+' (e.g. '0+1,2+3')")
    ap.add_argument("--tensor-parallel-size", type=int, default=1, help="vLLM tensor_parallel_size of every "
                    "engine: one worker process per rank, the oracle and sharpen() on every rank (collective_rpc); the "
                    "shaped targets' one MoE layer gets TP experts (vLLM refuses TP > experts; write_shaped); "
                    "vLLM's custom all-reduce is off (it crashed vLLM's own flat DFlash graph capture on two "
                    "H100s: README, Known gaps). With --side-by-side two 27B-shaped engines at TP=2 need "
                    "per GPU ~29 GiB of weights each and, at c=16, ~20 (DDTree 32) and ~10 GiB (flat) of GDN "
                    "state: two H200s hold that, two 80 GiB H100s do not (run the modes one engine at a time there)")
    ap.add_argument("--loop", default=None, choices=list(LOOPS), help="the loop of modes without '@loop': "
                    "v2async (vLLM's default for the users' pair: Model Runner V2, async scheduling as vLLM "
                    "resolves it, on for DFlash), v2sync, v1sync (the V1 runner, async off); default v2async on "
                    "GPUs, v1sync on CPU (vLLM-cpu runs V1)")
    ap.add_argument("--cudagraph-mode", default="FULL_AND_PIECEWISE")
    ap.add_argument("--op-swap", default="pass", choices=["pass", "trace"], help="DDTree modes' additional_config "
                    "ddtree op_swap: 'pass' (the tree-verify pass, Inductor's graph partition on GPUs) or 'trace' "
                    "(vLLM's ops pointed at the mirrors before the trace, vLLM's own compile split)")
    ap.add_argument("--cost-table", default=None, help='budget "auto" engines\' precompile cost table (the '
                    'prior of every kind\'s cost per batch bucket): a JSON path, or "precompile": time one first with '
                    '`ddtree-compile precompile` (a child process: the auto mode\'s engine settings, --auto-budget, '
                    'batches up to the largest --concurrency), written beside --out; its rows go to the result '
                    '(default: none, costs measured online)')
    ap.add_argument("--flat-compile", default="vllm", choices=["alike", "vllm"], help="flat DFlash's compile: "
                    "'vllm' (vLLM's own compilation config: what users run) or 'alike' (DDTree's pass and graph "
                    "partition, whose mirror ops run vLLM's ops outside a tree verify: DDTree's Inductor graphs)")
    ap.add_argument("--attention-config", default=None, type=_json_object, help="vLLM's attention_config of "
                    "every engine, a JSON object, e.g. '{\"backend\": \"TRITON_ATTN\"}' or "
                    "'{\"flash_attn_max_num_splits_for_cuda_graph\": 1}' (default: vLLM's)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--block-size", type=int, default=None, help="vLLM's block_size for every engine (default: "
                    "vLLM's; on hybrids the smallest attention block whose page covers a Mamba state page)")
    # (4B shape on the H100: flat DFlash holds ~0.55 GiB per request, DDTree at budget 32 ~1.3 GiB: vLLM
    # keeps a GDN state slot per draft position, 33 of them; so c=16 needs ~9 and ~21 GiB)
    ap.add_argument("--kv-cache-gib", default="flat=11,*=23", help="--side-by-side on a GPU: each engine's KV "
                    "cache, GIB or MODE=GIB,... ('*': other modes); the engines start together, so none can "
                    "size it from a memory profile")
    args = ap.parse_args(argv)
    import torch

    args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.profile_names = args.profile_names.split(",")
    args.modes = args.modes.split(",")
    bad = sorted({m.partition("@")[2] for m in args.modes} - {"", *LOOPS})
    if bad:
        ap.error(f"--modes: unknown loop(s) {bad}; allowed: {', '.join(LOOPS)}")
    args.loop = args.loop or ("v2async" if torch.cuda.is_available() else "v1sync")
    if not args.side_by_side and len({loop_of(m, args) for m in args.modes}) > 1:
        ap.error("--modes with different loops: only with --side-by-side (a process runs one model runner)")
    use_loop(loop_of(args.modes[0], args))  # this process's engines (each --side-by-side worker sets its own)
    if args.devices and not args.side_by_side:
        ap.error("--devices: only with --side-by-side")
    if args.devices and any(len(g.split("+")) != args.tensor_parallel_size for g in args.devices.split(",")):
        ap.error(f"--devices {args.devices!r}: each engine needs --tensor-parallel-size "
                 f"({args.tensor_parallel_size}) GPUs, joined by '+' (e.g. '0+1,2+3' for 2)")
    if args.cost_table == "precompile" and "auto" not in dict(speculative_modes(args)).values():
        ap.error("--cost-table precompile: no budget \"auto\" mode in --modes (auto or autochain) to give it to")
    if args.tensor_parallel_size > 1:
        if args.gpu_profile:
            ap.error("--gpu-profile: not with --tensor-parallel-size > 1 (the kernels run in the rank processes, "
                     "which this process's profiler does not see)")
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc ships our functions
        if args.device == "cpu":  # one core per rank, or vLLM-cpu refuses two workers on a 2-core machine
            cores = sorted(os.sched_getaffinity(0))[: args.tensor_parallel_size]
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(c) for c in cores))
    result = run(args)
    result["device"] = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    import vllm

    result["vllm"], result["torch"] = vllm.__version__, torch.__version__
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    print("\nmode      profile        conc  tok/s   vs flat  tokens/round  break-even gain")
    for r in result["runs"]:
        if "error" in r:
            print(f"{r['mode']:<9} ERROR {r['error'][:150]}")
        elif r.get("budget"):
            print(f"{r['mode']:<9} {r['profile']:<14} {r['concurrency']:<4} {r['tok_s']:7.1f} "
                  f"{r.get('tok_s_vs_flat', float('nan')):7.3f}  {r['tokens_per_round']:6.2f}  "
                  f"{r.get('break_even_gain', float('nan')):7.3f}")
    return 0 if not any("error" in r for r in result["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
