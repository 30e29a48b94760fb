"""DDTree vs flat DFlash vs no speculation, end to end in one vLLM, with the oracle drafter.

    python benchmarks/bench_e2e_gpu.py --target qwen35_4b --out build/e2e_4b.json
    python benchmarks/bench_e2e_gpu.py --target tiny --max-tokens 32 --concurrency 1,2 --out build/e2e.json  # CPU smoke
    # over several 10-minute device commands: --modes nospec,flat / ddtree16,ddtree32 / ... with one
    # --reference build/ref.json, then: python benchmarks/bench_e2e_gpu.py --merge A.json B.json --out ALL.json
    # ratios side by side (the engines up together, one process each, their runs interleaved; see
    # _side_by_side): two cold 4B engines are up in 5-6 min on the H100 and the cells take ~2.5 min,
    # so one pair per 10-minute command (at c=16 a third 4B engine's KV cache does not fit), e.g.
    python benchmarks/bench_e2e_gpu.py --target qwen35_4b --modes flat,ddtree32 --budgets 32 --side-by-side \
        --repeat-reference --models-dir build/m4 --gpu-memory-utilization 0.9 --out build/e2e_4b_sbs.json

Per target: the no-speculation engine first (timed per concurrency, and its greedy outputs are the
reference continuations the oracle drafts from), then one engine per speculative mode (vLLM's flat
DFlash with --flat-len drafts; DDTree per budget; DDTree with budget "auto": per step its tree of
--auto-budget nodes or the plain chain), each timed per oracle profile
(benchmarks/oracle_profiles.json, calibrated by calibrate_oracle.py) and concurrency (--repeats runs
per cell; the run of median tok/s is reported, every run's tok/s kept). Timing walks
`llm.llm_engine.step()` and stamps every step (tools/timing.py), so TPOT is per request and per step (p50/p90 over
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
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from summarize_e2e import rounds_per_s  # noqa: E402  (beside this file)

os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")  # the round's hooks live in the V1 runner
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: counters, oracle
os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")  # later commands on a warm machine skip the GDN autotune

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Layer shapes (public configs of Qwen3.5-4B and Qwen3.6-27B as we know them; check against the
# real config.json when one is reachable). Qwen3-Next architecture with plain MLPs (write_shaped).
SHAPES = {
    "qwen35_4b": dict(hidden_size=2560, num_hidden_layers=32, intermediate_size=9216, num_attention_heads=16,
                      num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32),
    "qwen36_27b": dict(hidden_size=5120, num_hidden_layers=64, intermediate_size=17408, num_attention_heads=24,
                       num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48),
}
VOCAB = 248320


def write_shaped(shape: str, root: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """Config-only target and drafter folders (load_format="dummy" makes the weights)."""
    from transformers import Qwen3Config, Qwen3NextConfig

    s = SHAPES[shape]
    target = root / shape
    n = s["num_hidden_layers"]
    # Qwen3.5/3.6 dense models have plain MLPs; vLLM's Qwen3-Next needs one MoE layer, so the last layer
    # is a one-expert MoE of the same width and the others are plain MLPs (`mlp_only_layers`). A
    # one-expert MoE in every layer would time vLLM's fused_moe Triton kernel instead of the cuBLAS
    # GEMMs of a dense model: on the H100 it cost 13.6 ms per round at 16 tokens and 24.1 ms at 33.
    cfg = Qwen3NextConfig(vocab_size=VOCAB, full_attention_interval=4, num_experts=1, num_experts_per_tok=1,
                          moe_intermediate_size=s["intermediate_size"], mlp_only_layers=list(range(n - 1)),
                          shared_expert_intermediate_size=512, decoder_sparse_step=1, linear_conv_kernel_dim=4,
                          linear_key_head_dim=128, linear_value_head_dim=128, max_position_embeddings=32768,
                          tie_word_embeddings=False, torch_dtype="bfloat16", **s)
    cfg.architectures = ["Qwen3NextForCausalLM"]
    cfg.save_pretrained(target)
    drafter = root / f"{shape}_dflash"
    d = Qwen3Config(vocab_size=VOCAB, hidden_size=s["hidden_size"], intermediate_size=s["intermediate_size"],
                    num_hidden_layers=5, num_attention_heads=s["num_attention_heads"],
                    num_key_value_heads=s["num_key_value_heads"], head_dim=128, tie_word_embeddings=False,
                    torch_dtype="bfloat16")
    d.architectures = ["DFlashDraftModel"]
    d.block_size = 16
    d.num_target_layers = n
    d.target_hidden_size = s["hidden_size"]
    d.dflash_config = {"mask_token_id": VOCAB - 1, "target_layer_ids": [round(i * (n - 2) / 4) + 1 for i in range(5)]}
    d.save_pretrained(drafter)
    return target, drafter


def _engine_kwargs(target, args, max_seqs: int, spec: dict | None, extra: dict) -> dict:
    from ddtree_compile.tools import models

    hybrid = args.target != "tiny" or args.tiny_kind != "qwen3"
    # the reference run's 32 extra tokens, and room for the deepest verify near the end
    max_len = args.prompt_len + args.max_tokens + 32 + 2 * max(args.budgets + [args.flat_len, args.auto_budget]) + 64
    kw = models.tiny_llm_kwargs(target, max_num_seqs=max_seqs, seed=0, disable_log_stats=False, max_model_len=max_len,
                                max_num_batched_tokens=max(2048, max_seqs * 80))
    if args.device == "cuda":
        from ddtree_compile.passes.entry import compilation_config

        cc = compilation_config("cuda")
        cc["cudagraph_mode"] = args.cudagraph_mode
        if spec is not None:  # every concurrency's verify batch in a graph (vLLM's default stops at 512 tokens)
            cc["max_cudagraph_capture_size"] = max(512, max_seqs * (spec["num_speculative_tokens"] + 1))
        kw.update(compilation_config=cc, gpu_memory_utilization=args.gpu_memory_utilization)
        kw.pop("kv_cache_memory_bytes", None)
        if hybrid:
            extra = {"gdn_prefill_backend": "triton", **extra}
    else:
        kw["enforce_eager"] = True
        if args.tiny_kind == "qwen3":
            kw["dtype"] = "float32"
    if args.target != "tiny":
        kw["load_format"] = "dummy"
    if spec is not None:
        kw["speculative_config"] = spec
        # DDTree's round runs in vLLM's synchronous loop; flat DFlash runs in the same loop (vLLM 0.26
        # turns async scheduling on for DFlash: the first H100 run saw 2-3 s stalls and one run whose
        # drafts went out of step with the oracle there), so the ratios compare drafting, not loops.
        kw["async_scheduling"] = False
    if extra:
        kw["additional_config"] = extra
    return kw


def sharpen(llm) -> None:
    """Dummy weights (uniform +-1e-3) give near-flat logits whose greedy choice flips with the
    batch shape's bf16 numerics, so a verify would leave the reference and the oracle would draft
    a wrong continuation. Scale the token embedding up 1000x (the residual stream is then the
    input token's embedding plus ~1e-3 per layer), tie lm_head to it and make the final norm the
    identity: greedy repeats the last prompt token with a margin of ~10^3 in the logits. Same
    shapes, same kernels, so the same costs; the oracle decides what is accepted, not the text."""
    import torch

    from ddtree_compile.integration import engines

    model = engines.find_runner(llm).get_model()
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb.mul_(1000.0)
        model.lm_head.weight.copy_(emb)
        model.model.norm.weight.zero_()  # GemmaRMSNorm: x * (1 + weight)


def _match(outputs, reference) -> float:
    same = total = 0
    for o, r in zip(outputs, reference):
        total += len(o)
        same += sum(a == b for a, b in zip(o, r))
    return same / max(total, 1)


def kv_cache_gib(spec: str, mode: str) -> float:
    """--kv-cache-gib: "12" (every mode) or "flat=11,*=23" (per mode, "*" for the others)."""
    table = {}
    for item in spec.split(","):
        key, _, value = item.rpartition("=")
        try:
            table[key.strip() or "*"] = float(value)
        except ValueError:
            raise ValueError(f"--kv-cache-gib: {item!r} is not GIB or MODE=GIB (e.g. 'flat=11,*=23')") from None
    if mode not in table and "*" not in table:
        raise ValueError(f"--kv-cache-gib {spec!r} names no size for mode {mode!r}; add '{mode}=GIB' or '*=GIB'")
    return table.get(mode, table.get("*"))


def _start_engine(args, target, conc, prompts, spec=None, extra=None, share=1, mode=None):
    """(engine of one mode, warmed up; seconds it took to start). share > 1 (--side-by-side): the
    engines up at once split the GPU memory evenly."""
    from vllm import LLM

    t = time.perf_counter()
    kw = _engine_kwargs(target, args, max(conc), spec, extra or {})
    if share > 1 and "gpu_memory_utilization" in kw:
        # the engines start together (_side_by_side): a KV cache sized from a memory profile would count
        # what the other engines allocate meanwhile as this one's, so each gets a fixed cache instead
        kw["gpu_memory_utilization"] = args.gpu_memory_utilization / share
        kw["kv_cache_memory_bytes"] = int(kv_cache_gib(args.kv_cache_gib, mode) * (1 << 30))
    llm = LLM(**kw)
    start = time.perf_counter() - t
    if args.target != "tiny":
        sharpen(llm)
    _warm_up(llm, prompts, conc)
    return llm, start


def _warm_up(llm, prompts, conc) -> None:
    """A short run per batch shape outside the timings: its first-call kernel compiles (the engine's,
    then again the oracle's once one is installed)."""
    from ddtree_compile.tools.timing import timed_steps

    for c in conc:
        timed_steps(llm, prompts[:c], 16)


def _install_oracle(llm, reference, prof, prompts, conc):
    """The oracle drafter of profile `prof` on this engine, warmed up; returns it (to uninstall)."""
    from ddtree_compile.tools import oracle

    od = oracle.OracleDrafter(reference, prof, seed=1).install(llm)
    _warm_up(llm, prompts, conc)
    return od


def run(args) -> dict:
    from ddtree_compile.integration import engines, plugin
    from ddtree_compile.tools import harness, models, oracle
    from ddtree_compile.tools.timing import timed_steps as _timed

    plugin.register()
    prof_json = json.loads(pathlib.Path(args.profiles).read_text())
    profiles = [oracle.profile_from(p) for p in prof_json["profiles"] if p["name"] in args.profile_names]
    conc = [int(c) for c in args.concurrency.split(",")]
    # a fixed --models-dir keeps the model paths, so vLLM's compile cache of an earlier process applies
    tmp = pathlib.Path(args.models_dir) if args.models_dir else pathlib.Path(tempfile.mkdtemp(prefix="bench_e2e_"))
    if args.target == "tiny":
        target = models.write_tiny_model(args.tiny_kind, tmp / "t", dtype="bfloat16")
        drafter = models.write_tiny_dflash_drafter(target, tmp / "d")
        vocab = models.VOCAB
    else:
        target, drafter = write_shaped(args.target, tmp)
        vocab = VOCAB
    prompts = models.token_prompts(max(conc), args.prompt_len, vocab, seed=0)
    result = {"args": vars(args), "profiles": prof_json, "runs": [], "starts": {}}

    def save():  # after every run: a command cut off by its time limit keeps what it measured
        pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.out).write_text(json.dumps(result, indent=1, default=str))

    def engine(name, spec=None, extra=None):
        llm, result["starts"][name] = _start_engine(args, target, conc, prompts, spec, extra)
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
                r = _cell(_timed, llm, prompts[:c], args.max_tokens, args.repeats)
                result["runs"].append({"mode": "nospec", "concurrency": c, **_summary(r, ref[:c], args.max_tokens)})
                save()
        finally:
            engines.shutdown(llm)
    reference = harness.reference_from_outputs(prompts, ref)
    modes = [("flat", None)] + [(f"ddtree{b}", b) for b in args.budgets] + [("auto", "auto")]
    modes = [(m, b) for m, b in modes if m in args.modes or (isinstance(b, int) and "ddtree" in args.modes)]
    modes.sort(key=lambda mb: args.modes.index(mb[0]) if mb[0] in args.modes else len(args.modes))  # as listed
    if args.side_by_side:
        setup = {"args": vars(args), "target": target, "conc": conc, "prompts": prompts, "ref": ref}
        names = set(args.profile_names)
        _side_by_side([(m, b, *_spec(b, args, drafter)) for m, b in modes],
                      [p for p in prof_json["profiles"] if p["name"] in names], setup, result, save)
        _break_even(result["runs"])
        return result
    for mode, budget in modes:
        try:
            llm = engine(mode, *_spec(budget, args, drafter))
        except Exception as e:  # one mode failing to start must not lose the others
            result["runs"].append({"mode": mode, "error": repr(e)[:500]})
            continue
        try:
            if not _attached(llm, mode, budget, result):
                continue
            for prof in profiles:
                od = _install_oracle(llm, reference, prof, prompts, conc)
                try:
                    for c in conc:
                        before = _counters(llm, budget)
                        r = _cell(_timed, llm, prompts[:c], args.max_tokens, args.repeats)
                        after = _counters(llm, budget)
                        _add_row(result, args, mode, budget, prof, c, r, ref, _rounds(budget, before, after))
                        save()
                    if args.gpu_profile and prof is profiles[0]:
                        result.setdefault("gpu_profiles", []).append(
                            {"mode": mode, "profile": prof.name, "concurrency": conc[0],
                             **_gpu_profile(llm, prompts[: conc[0]], args.max_tokens, budget)})
                        save()
                finally:
                    od.uninstall()
        finally:
            engines.shutdown(llm)
    _break_even(result["runs"])
    return result


def _spec(budget, args, drafter) -> tuple[dict, dict]:
    """(speculative_config, additional_config) of a mode: flat DFlash (budget None) or DDTree."""
    from ddtree_compile.integration import config

    if budget is None:
        return {"method": "dflash", "model": str(drafter), "num_speculative_tokens": args.flat_len}, {}
    auto = {"auto_budget": args.auto_budget} if budget == "auto" else {}
    kw = config.vllm_kwargs(drafter, budget=budget, top_k=args.top_k, num_speculative_tokens=args.flat_len, **auto)
    return kw["speculative_config"], kw["additional_config"]


def _attached(llm, mode, budget, result) -> bool:
    """A DDTree mode whose round did not attach is reported as an error row, not timed as flat."""
    from ddtree_compile.integration import engines, metrics

    if budget and engines.find_state(llm) is None:
        result["runs"].append({"mode": mode, "error": "DDTree did not attach",
                               "fallbacks": dict(metrics.PROCESS_STARTUP_FALLBACKS)})
        return False
    return True


def _add_row(result, args, mode, budget, prof, c, r, ref, rounds) -> None:
    from ddtree_compile.tools import oracle

    row = {"mode": mode, "budget": budget, "profile": prof.name, "concurrency": c,
           **_summary(r, ref[:c], args.max_tokens), **rounds}
    row["simulated_tokens_per_round"] = None if budget == "auto" else oracle.simulate(
        prof, budget or args.flat_len, args.top_k if budget else 1, args.flat_len, samples=2000)
    result["runs"].append(row)
    print(_line(row), flush=True)


class _ModeWorker:
    """--side-by-side: one speculative mode's engine in a process of its own (spawned), driven over a
    pipe. Two vLLM engines in one process share process-wide state: on the H100, vLLM 0.26 switches
    CUDA graph capture off for the whole process once an engine has captured, and the first engine's
    next run then failed ("CUDA graph capturing detected at an inappropriate time"); the Prometheus
    registry, which the spec-decode counters are read from, holds only the last engine's."""

    def __init__(self, mp, mode, budget, spec, extra, setup):
        self.mode, self.budget = mode, budget
        self.conn, child = mp.Pipe()
        # not a daemon: a daemonic process may not start processes of its own (torch.compile's workers)
        self.proc = mp.Process(target=_worker_main, args=(child, mode, budget, spec, extra, setup))
        self.proc.start()
        child.close()
        self.spawned_s, self.info = time.time(), None

    def ready(self) -> dict:
        """Wait for the engine to be up: {start_s, attached, fallbacks, pid, ready_s}."""
        self.info = {**self._reply(), "spawned_s": self.spawned_s, "ready_s": time.time()}
        return self.info

    def call(self, *msg):
        self.conn.send(msg)
        return self._reply()

    def _reply(self):
        try:
            kind, value = self.conn.recv()
        except EOFError:
            raise RuntimeError(f"{self.mode}: its process died (exit code {self.proc.exitcode})") from None
        if kind == "error":
            raise RuntimeError(f"{self.mode}: {value}")
        return value

    def close(self) -> None:
        try:
            self.conn.send(("close",))
        except OSError:
            pass
        self.proc.join(120)
        if self.proc.is_alive():
            self.proc.kill()


def _worker_main(conn, mode, budget, spec, extra, setup) -> None:
    """A _ModeWorker's process: start the engine, then answer ("profile", dict) (install that oracle
    profile, warm up), ("counters",) and ("run", c) until ("close",)."""
    import traceback

    from ddtree_compile.integration import engines, metrics, plugin
    from ddtree_compile.tools import harness, oracle
    from ddtree_compile.tools.timing import timed_steps

    args, conc, prompts = argparse.Namespace(**setup["args"]), setup["conc"], setup["prompts"]
    try:
        plugin.register()
        llm, start = _start_engine(args, setup["target"], conc, prompts, spec, extra, share=setup["share"], mode=mode)
        conn.send(("ok", {"start_s": start, "attached": not budget or engines.find_state(llm) is not None,
                          "fallbacks": dict(metrics.PROCESS_STARTUP_FALLBACKS), "pid": os.getpid()}))
    except Exception:
        conn.send(("error", traceback.format_exc()[-2000:]))
        return
    reference, od = harness.reference_from_outputs(prompts, setup["ref"]), None
    try:
        while (msg := _recv(conn))[0] != "close":
            try:
                out = None
                if msg[0] == "profile":
                    if od is not None:
                        od.uninstall()
                    od = _install_oracle(llm, reference, oracle.profile_from(msg[1]), prompts, conc)
                elif msg[0] == "counters":
                    out = _counters(llm, budget)
                elif msg[0] == "run":
                    out = timed_steps(llm, prompts[: msg[1]], args.max_tokens)
                conn.send(("ok", out))
            except Exception:
                conn.send(("error", traceback.format_exc()[-2000:]))
    finally:
        engines.shutdown(llm)


def _recv(conn) -> tuple:
    """The next message; a closed pipe (the parent died or was killed) is a close."""
    try:
        return conn.recv()
    except EOFError:
        return ("close",)


def _side_by_side(modes, profiles, setup, result, save) -> None:
    """--side-by-side: every speculative mode's engine is up at once, each in its own process
    (_ModeWorker), the GPU's memory split evenly between them, and in each (profile, concurrency)
    cell their timed runs alternate, the order rotated per repeat. A drift of the host's speed then
    hits every mode alike: on the H100 (session 11) flat DFlash's three identical c=1 cells,
    measured minutes apart in one engine, took 13.9, 17.4 and 14.8 ms per round, a spread larger
    than the gains being measured."""
    import multiprocessing

    from ddtree_compile.tools import oracle

    args = argparse.Namespace(**setup["args"])
    mp = multiprocessing.get_context("spawn")  # (CUDA cannot be forked)
    setup = {**setup, "share": len(modes)}
    workers, started = [], []
    try:
        # all engines start at once (a cold 4B engine takes ~4.5 min on the H100, mostly compile and
        # graph capture on one host thread each); each has a fixed KV cache (_start_engine)
        for mode, budget, spec, extra in modes:
            started.append(_ModeWorker(mp, mode, budget, spec, extra, setup))
        for w in started:
            try:
                w.ready()
            except RuntimeError as e:
                result["runs"].append({"mode": w.mode, "error": str(e)[-500:]})
                continue
            result["starts"][w.mode] = w.info["start_s"]
            result.setdefault("worker_pids", {})[w.mode] = w.info["pid"]
            result.setdefault("worker_start_wall", {})[w.mode] = [w.info["spawned_s"], w.info["ready_s"]]
            if not w.info["attached"]:
                result["runs"].append({"mode": w.mode, "error": "DDTree did not attach", "fallbacks": w.info["fallbacks"]})
                continue  # (closed with the others below)
            workers.append(w)
        for prof in profiles:
            for w in workers:
                w.call("profile", prof)
            for c in setup["conc"]:
                before = {w.mode: w.call("counters") for w in workers}
                runs = {w.mode: [] for w in workers}
                for i in range(max(args.repeats, 1)):
                    for w in workers[i % len(workers):] + workers[:i % len(workers)]:
                        runs[w.mode].append(w.call("run", c))
                for w in workers:
                    rounds = _rounds(w.budget, before[w.mode], w.call("counters"))
                    rounds["run_started_s"] = [r["started_s"] for r in runs[w.mode]]  # the interleaving, on record
                    _add_row(result, args, w.mode, w.budget, oracle.profile_from(prof), c, _median(runs[w.mode]),
                             setup["ref"], rounds)
                save()
    finally:
        for w in started:
            w.close()


def _gpu_profile(llm, prompts, max_tokens, budget, top=30) -> dict:
    """One more timed run under torch.profiler: the GPU's busy time per round (kernel and copy
    durations, which host overhead does not change) next to the wall time per round, and the
    kernels that fill it. Wall - busy is the time the GPU waited for the host."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from ddtree_compile.tools.timing import timed_steps

    before = _counters(llm, budget)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        r = timed_steps(llm, prompts, max_tokens)
    rounds = max(_rounds(budget, before, _counters(llm, budget))["rounds"], 1)
    dev = [e for e in p.key_averages() if e.device_type == DeviceType.CUDA]
    us = [(getattr(e, "self_device_time_total", 0) or 0, e.count, e.key) for e in dev]
    busy_ms = sum(t for t, _, _ in us) / 1e3 / rounds
    us.sort(reverse=True)
    host = sorted(((e.count, e.self_cpu_time_total, e.key) for e in p.key_averages()
                   if e.device_type == DeviceType.CPU and e.key.startswith("aten::")), reverse=True)
    return {"rounds": rounds, "wall_ms_per_round_profiled": 1e3 * r["wall_s"] / rounds,
            "gpu_busy_ms_per_round": busy_ms, "gpu_launches_per_round": sum(c for _, c, _ in us) / rounds,
            "host_aten_ops_per_round": sum(c for c, _, _ in host) / rounds,
            "kernels": [{"name": k[:120], "ms_per_round": t / 1e3 / rounds, "per_round": c / rounds}
                        for t, c, k in us[:top]],
            "host_ops": [{"name": k, "per_round": c / rounds, "self_cpu_ms_per_round": t / 1e3 / rounds}
                         for c, t, k in host[:top]]}


def _cell(timed, llm, prompts, max_tokens, repeats) -> dict:
    """One (mode, profile, concurrency) cell: `repeats` timed runs, reported by the run of median
    tok/s. A run is c requests of max_tokens: at c=1 on the 4B shape well under a second, and
    single runs of the same engine varied by up to 25% (a log line, a GC pause, a clock step)."""
    return _median([timed(llm, prompts, max_tokens) for _ in range(max(repeats, 1))])


def _median(runs) -> dict:
    """The run of median tok/s, with every run's tok/s and outputs and their summed wall time."""
    median = sorted(runs, key=lambda r: r["tok_s"])[len(runs) // 2]
    return median | {"tok_s_runs": [r["tok_s"] for r in runs], "runs_outputs": [r["outputs"] for r in runs],
                     "wall_s_total": sum(r["wall_s"] for r in runs)}  # the span of the cell's round counters


def _summary(r, ref, max_tokens) -> dict:
    """A cell's timings (the median run) and the worst reference match over its runs."""
    ref = [x[:max_tokens] for x in ref]
    outputs = min(r.get("runs_outputs", [r["outputs"]]), key=lambda o: _match(o, ref))
    out = {k: r[k] for k in ("wall_s", "output_tokens", "tok_s", "tpot_p50_ms", "tpot_p90_ms")} | {
        "reference_match": _match(outputs, ref), "tok_s_runs": r.get("tok_s_runs", [r["tok_s"]]),
        "wall_s_total": r.get("wall_s_total", r["wall_s"])}
    if out["reference_match"] < 0.9:  # evidence for the closing note: where the outputs left the reference
        out["mismatch_heads"] = [{"output": o[:24], "reference": x[:24]} for o, x in zip(outputs, ref)][:4]
    return out


def _counters(llm, budget) -> dict:
    """vLLM's spec-decode counters, and DDTree's for a DDTree engine."""
    from ddtree_compile.integration import metrics
    from ddtree_compile.tools import harness

    return {"vllm": harness.spec_counters(llm), "ddtree": metrics.collect(llm)[0] if budget else None}


def _rounds(budget, before, after) -> dict:
    """Tokens per round and rounds (per request), and DDTree's round split.

    Fixed budgets: DDTree's counters (tree rounds). Flat DFlash and budget "auto" (whose chain steps
    vLLM verifies): vLLM's spec-decode counters, which count every verify (tree or chain) as a draft
    and its committed tokens but the bonus as accepted."""
    va, vb = after["vllm"], before["vllm"]
    drafts = va["vllm:spec_decode_num_drafts"] - vb.get("vllm:spec_decode_num_drafts", 0)
    acc = va["vllm:spec_decode_num_accepted_tokens"] - vb.get("vllm:spec_decode_num_accepted_tokens", 0)
    out = {"rounds": drafts, "tokens_per_round": 1 + acc / max(drafts, 1)}
    if budget:
        from ddtree_compile.tools import harness

        a, b = after["ddtree"], before["ddtree"]
        d = harness.counters_delta(a, b)
        split = {k: a["seconds"].get(k, 0) - b["seconds"].get(k, 0) for k in a.get("seconds", {})}
        out.update(round_split_s=split, graph_steps=d.get("graph_steps"), tree_steps=d.get("tree_steps"),
                   fallback_total=d.get("fallback_total"),
                   tree_tokens_per_round=1 + d["nodes_accepted"] / max(d["tree_requests"], 1))
        if budget != "auto":
            out.update(rounds=d["tree_requests"] + d.get("chain_steps", 0),
                       tokens_per_round=out["tree_tokens_per_round"])
        else:
            out.update(auto_chain_steps=d.get("auto_chain_steps"), auto=a.get("auto"))
    return out


def _break_even(runs) -> None:
    """Per DDTree row: flat rounds/s over DDTree rounds/s at the same profile and concurrency, i.e.
    the tree acceptance gain over the chain at which DDTree's tok/s equals flat DFlash's."""
    flat = {(r.get("pair"), r["profile"], r["concurrency"]): r for r in runs if r.get("mode") == "flat" and "rounds" in r}
    for r in runs:
        f = flat.get((r.get("pair"), r.get("profile"), r.get("concurrency")))
        if r.get("budget") and f and r.get("rounds"):
            r["break_even_gain"] = rounds_per_s(f) / rounds_per_s(r)
            r["tok_s_vs_flat"] = r["tok_s"] / f["tok_s"]
            r["measured_gain"] = r["tokens_per_round"] / f["tokens_per_round"]


def _line(r) -> str:
    return (f"{r['mode']:<9} {r['profile']:<14} c={r['concurrency']:<3} {r['tok_s']:9.1f} tok/s  "
            f"TPOT p50 {r['tpot_p50_ms']:7.2f} ms  tokens/round {r['tokens_per_round']:.2f} "
            f"(sim {r['simulated_tokens_per_round'] or float('nan'):.2f})  ref match {r['reference_match']:.2f}")


def merge(paths, out) -> dict:
    """One result from several commands' JSON files (runs and GPU profiles concatenated, break-even
    recomputed). The runs of a --side-by-side part carry `pair` (its modes, e.g. "flat+auto"): their
    ratios stay against that part's own flat runs, which ran interleaved with them."""
    parts = [json.loads(pathlib.Path(p).read_text()) for p in paths]
    result = {**parts[0], "merged_from": [str(p) for p in paths], "runs": [], "starts": {}, "gpu_profiles": []}
    for p in parts:
        if p.get("args", {}).get("side_by_side"):
            pair = "+".join(dict.fromkeys(r["mode"] for r in p["runs"]))
            p["runs"] = [{**r, "pair": pair} for r in p["runs"]]
        result["runs"] += p["runs"]
        result["starts"].update(p.get("starts", {}))
        result["gpu_profiles"] += p.get("gpu_profiles", [])
    _break_even(result["runs"])
    pathlib.Path(out).write_text(json.dumps(result, indent=1, default=str))
    return result


def main(argv=None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--merge"]:  # --merge A.json B.json ... --out ALL.json
        i = argv.index("--out")
        merge(argv[1:i], argv[i + 1])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="qwen35_4b", choices=[*SHAPES, "tiny"])
    ap.add_argument("--tiny-kind", default="qwen3", help="models.KINDS kind for --target tiny")
    ap.add_argument("--out", required=True)
    ap.add_argument("--budgets", default="16,22,32,64", type=lambda s: [int(x) for x in s.split(",") if x])
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--flat-len", type=int, default=15, help="flat DFlash's draft tokens = DDTree's draft length L")
    ap.add_argument("--auto-budget", type=int, default=32, help='budget "auto": its tree bucket')
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per cell; the median tok/s is reported")
    ap.add_argument("--profiles", default=str(ROOT / "benchmarks" / "oracle_profiles.json"))
    ap.add_argument("--profile-names", default="port_plus4,sglang_plus22,paper_1p35")
    ap.add_argument("--modes", default="nospec,flat,ddtree,auto", help="any of nospec, flat, ddtree (every "
                    "budget), ddtree<B>, auto; split a long run over several commands")
    ap.add_argument("--reference", default=None, help="JSON file of the reference outputs: read if it exists, "
                    "else written (so later commands skip computing them)")
    ap.add_argument("--repeat-reference", action="store_true", help="shaped targets: take the reference as the "
                    "last prompt token repeated (what sharpen() makes the target say) instead of a no-spec engine")
    ap.add_argument("--models-dir", default=None, help="where the config-only model folders are written "
                    "(default: a new temporary folder)")
    ap.add_argument("--gpu-profile", action="store_true", help="per mode, one more run at the first concurrency "
                    "and profile under torch.profiler: GPU busy ms per round and the top kernels (gpu_profiles)")
    ap.add_argument("--side-by-side", action="store_true", help="all speculative modes' engines up at once, "
                    "one process each (GPU memory split evenly), their runs alternating within each cell: ratios "
                    "immune to a drift of the host's speed between engines (see _side_by_side)")
    ap.add_argument("--cudagraph-mode", default="FULL_AND_PIECEWISE")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
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
    if args.side_by_side and args.gpu_profile:
        ap.error("--gpu-profile: not with --side-by-side (profile the modes one engine at a time)")
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
