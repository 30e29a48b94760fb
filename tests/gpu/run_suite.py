"""`make test-gpu`: the GPU suite, one pytest process per module, one evidence JSON, one summary.

    python3 tests/gpu/run_suite.py [MODULE ...] [--deadline-s S] [--gpus N] [--per-gpu K] [-- PYTEST ARGS]

MODULE: names under tests/gpu without `test_` and `.py` (default: all, in ORDER). One process per
module because vLLM 0.26 crashes on a second compiled Model Runner V2 engine in one process (its own
flat DFlash too), and so that a crash or a hang costs one module, not the suite. pytest runs from /tmp:
from the repository root `ddtree_compile/` (whose passes/ and templates/ live beside it) would shadow
the installed package. Each module's tests merge their entries into $DDTREE_GPU_RESULTS (default
benchmarks/results/gpu_suite.json, tests/gpu/conftest.py); a module that crashed or was stopped gets
an entry of its own here (the entries of its tests that finished are there). With --deadline-s (the
device's 10-minute command limit), no module starts with less than MIN_START_S left and a running one
is stopped at the deadline, so the JSON and the summary always come back; $OUT (the device tool's
folder) receives a copy of the JSON and the whole log. With --per-gpu K, K modules share each GPU
(the tiny engines use a few GiB each; their start-up memory check is relaxed to match, MEMORY_SHARE).
"""

from __future__ import annotations

import argparse
import datetime
import fcntl
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import threading
import time

from conftest import commit  # beside this file (sys.path[0]): the evidence's commit, one definition

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
# the kernels first (the most basic), then the longest: with several slots (--gpus, --per-gpu) the suite
# then takes about its longest module; tp2 needs two GPUs (it skips itself on one)
ORDER = ("kernels", "load", "tp2", "fp8", "serve", "e2e", "v2", "v2_auto", "v2_eager_forward", "draftless", "align", "mrope", "layer_diff")
MIN_START_S = 90  # an engine's start alone can take this long: no module starts with less left
NEEDS_GPUS = {"tp2": 2}  # (with --gpus)
EXCLUSIVE = {"load"}  # (with --per-gpu) a GPU of its own: it reads the GPU's memory in use over two loads
MEMORY_SHARE = "0.2"  # --per-gpu > 1: gpu_memory_utilization of every engine (tests/gpu/_engines.memory_args)


def _load(path: pathlib.Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _run_module(name: str, pytest_args: list[str], env: dict, timeout: float | None, log) -> tuple[int | str, float]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfEsxX", "-p", "no:cacheprovider", str(HERE / f"test_{name}.py"),
           *pytest_args]
    print(f"\n=== {name}: {' '.join(cmd[1:])}", flush=True)
    log.write(f"\n=== {name}: {' '.join(cmd)}\n")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd="/tmp", env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", process_group=0)  # its own group: a timeout ends its engines too

    def pump():
        for line in proc.stdout:
            log.write(f"[{name}] {line}" if "CUDA_VISIBLE_DEVICES" in env else line)  # (--gpus: modules interleave)
            if not line.startswith(("INFO", "WARNING", "DEBUG", "(")):  # vLLM's own log lines: in the log only
                sys.stdout.write(line)
                sys.stdout.flush()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        rc: int | str = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        rc = "timeout"
    reader.join(timeout=30)
    log.flush()
    return rc, time.perf_counter() - t0


def _note_module(path: pathlib.Path, name: str, rc, wall: float, since: str, log_path: pathlib.Path) -> None:
    """A module whose pytest crashed or was stopped: an entry of its own (its tests' entries are written
    as each test ends, so those that finished are there)."""
    with open(pathlib.Path("/tmp") / f"{path.name}.lock", "w") as lock:  # (conftest._write's lock)
        fcntl.flock(lock, fcntl.LOCK_EX)
        _note_locked(path, name, rc, wall, since, log_path)


def _note_locked(path: pathlib.Path, name: str, rc, wall: float, since: str, log_path: pathlib.Path) -> None:
    doc = _load(path)
    tests = doc.setdefault("tests", {})
    lines = log_path.read_text(errors="replace").splitlines() if log_path.exists() else []
    tagged = [ln for ln in lines if ln.startswith(f"[{name}] ")]  # its own lines where modules ran in parallel
    tail = (tagged or lines)[-40:]
    tests[f"test_{name}.py"] = {"outcome": "timeout" if rc == "timeout" else f"crashed (rc {rc})",
                                "duration_s": round(wall, 1), "commit": commit(),
                                "finished": since, "log_tail": "\n".join(tail)[-3000:]}
    doc["tests"] = dict(sorted(tests.items()))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")


def _summary(path: pathlib.Path, names: list[str], since: str) -> int:
    tests = {k: v for k, v in _load(path).get("tests", {}).items()
             if k.split(".py")[0].removeprefix("test_") in names and v.get("finished", "") >= since}
    print(f"\n=== GPU suite: {len(tests)} results in {path}")
    first = next((v for v in tests.values() if v.get("device")), {})
    print(f"device {first.get('device')}, vLLM {first.get('vllm')}, torch {first.get('torch')}, "
          f"commit {first.get('commit')}")
    bad = 0
    for key, v in tests.items():
        outcome = v.get("outcome", "?")
        bad += outcome not in ("passed", "skipped", "xfailed")  # (xfails are strict: an xpass is a failure)
        numbers = json.dumps(v.get("numbers", {}), default=str)
        why = v.get("skip_reason") or v.get("error", "").splitlines()[-1:] or ""
        print(f"{outcome:<12} {v.get('duration_s', 0):>7.1f} s  {key}\n{'':<22}{numbers[:160]}"
              + (f"\n{'':<22}{str(why)[:160]}" if why and outcome != "passed" else ""))
    counts: dict = {}
    for v in tests.values():
        counts[v.get("outcome", "?")] = counts.get(v.get("outcome", "?"), 0) + 1
    not_run = [n for n in names if not any(k.startswith(f"test_{n}.py") for k in tests)]
    print("=== " + ", ".join(f"{n} {o}" for o, n in sorted(counts.items()))
          + (f"; modules without a result: {not_run}" if not_run else ""))
    return 1 if bad or not_run else 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    pytest_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("modules", nargs="*", help=f"any of {' '.join(ORDER)} (default: all)")
    ap.add_argument("--deadline-s", type=float, default=float(os.environ.get("GPU_DEADLINE_S") or 0),
                    help="stop starting modules / stop the running one after this many seconds (0: none)")
    ap.add_argument("--gpus", type=int, default=int(os.environ.get("GPU_PARALLEL") or 1),
                    help="GPUs to spread the modules over, one module per GPU at a time (tp2 takes two): on a "
                         "machine of several GPUs the suite takes about the time of its longest modules")
    ap.add_argument("--per-gpu", type=int, default=int(os.environ.get("GPU_PER_GPU") or 1),
                    help="modules sharing one GPU at a time (the suite's engines are tiny)")
    args = ap.parse_args(argv)
    names = [m.removeprefix("test_").removesuffix(".py") for a in args.modules for m in a.replace(",", " ").split()]
    names = names or list(ORDER)
    unknown = [n for n in names if not (HERE / f"test_{n}.py").exists()]
    if unknown:
        raise SystemExit(f"no tests/gpu/test_<name>.py for {unknown}; known: {' '.join(ORDER)}")
    results = pathlib.Path(os.environ.get("DDTREE_GPU_RESULTS") or ROOT / "benchmarks/results/gpu_suite.json")
    out = pathlib.Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    log_path = (out or pathlib.Path("/tmp/ddtree-gpu")) / "gpu_suite.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONUNBUFFERED": "1", "DDTREE_GPU_RESULTS": str(results.resolve()),
           "DDTREE_COMMIT": commit()}
    if args.per_gpu > 1:
        env["DDTREE_GPU_MEMORY_UTILIZATION"] = MEMORY_SHARE
    since = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    t_start = time.perf_counter()
    free = [g for _ in range(max(args.per_gpu, 1)) for g in range(args.gpus)]  # free slots, by GPU index
    parent = (os.environ.get("CUDA_VISIBLE_DEVICES") or ",".join(map(str, range(args.gpus)))).split(",")
    if len(parent) < args.gpus:
        raise SystemExit(f"--gpus {args.gpus}: CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']} names fewer")
    cond = threading.Condition()

    def one(name, gpus, log):
        left = None if not args.deadline_s else args.deadline_s - (time.perf_counter() - t_start)
        if left is not None and left < MIN_START_S:
            print(f"\n=== {name}: not started, {left:.0f} s left of --deadline-s {args.deadline_s:.0f}")
        else:
            tagged = args.gpus > 1 or args.per_gpu > 1  # (modules interleave in the log)
            visible = {"CUDA_VISIBLE_DEVICES": ",".join(parent[g] for g in gpus)} if tagged else {}
            rc, wall = _run_module(name, pytest_args, {**env, **visible}, left, log)
            print(f"=== {name}: rc {rc} in {wall:.0f} s" + (f" on GPU {visible['CUDA_VISIBLE_DEVICES']}"
                                                           if visible else ""), flush=True)
            if rc not in (0, 1, 5):  # 1: tests failed (their entries are written); 5: nothing selected
                _note_module(results, name, rc, wall, since, log_path)
        with cond:
            free.extend(g for g in gpus for _ in range(args.per_gpu if name in EXCLUSIVE else 1))
            cond.notify_all()

    with open(log_path, "a") as log:
        threads = []
        for name in names:  # in ORDER; with --gpus N up to N at once, each on GPUs of its own
            need = min(NEEDS_GPUS.get(name, 1), args.gpus)
            slots = args.per_gpu if name in EXCLUSIVE else 1  # slots it takes on each of its GPUs
            with cond:
                cond.wait_for(lambda: sum(free.count(g) >= slots for g in set(free)) >= need)
                gpus = sorted({g for g in free if free.count(g) >= slots}, key=lambda g: -free.count(g))[:need]
                for g in gpus:
                    for _ in range(slots):
                        free.remove(g)
            threads.append(threading.Thread(target=one, args=(name, gpus, log)))
            threads[-1].start()
        for t in threads:
            t.join()
    if out is not None and results.exists() and results.resolve() != (out / results.name).resolve():
        shutil.copy(results, out / results.name)  # (DDTREE_GPU_RESULTS may already point under $OUT)
    return _summary(results, names, since)


if __name__ == "__main__":
    raise SystemExit(main())
