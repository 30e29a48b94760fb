"""The load-and-fault scenario (issue 52, item 2) through real `vllm serve` subprocesses on vLLM 0.26.

tests/_serve_load.py at full size: 64 streaming chat requests at once (plain text, thinking, images,
forced tool calls, JSON schema, two-turn conversations whose turn 2 must read turn 1 from the prefix
cache, two requests decoding into --max-model-len), 16 hung up mid-stream. The same code path runs on
CPU in CI (tests/test_serve_hybrid.py::test_load_and_fault, 16 requests): what is checked here is
checked there, except images, prefix caching and GPU memory.

Three servers on one GPU, started together (as tests/gpu/test_serve.py; a fixed KV cache each), all on
Model Runner V2 (VLLM_USE_V2_MODEL_RUNNER=1) with async scheduling, the tiny multimodal Qwen3.5 hybrid
with prefix caching: DDTree (`config.cli_args`, the MIXED sliding/full drafter, a fixed budget of 16:
its GPU pass was taken so; budget "auto" on V2 under this load is still to run), no speculation (the
gates' reference, each request alone), and vLLM's own flat DFlash with the same drafter (the control). Checks: _serve_load.check
on DDTree (server up and answering, nothing running, KV-cache usage back at idle, DDTree's counters
add up, every completed greedy request within the gate, or no further from the reference than the
same request under the same load on the control), the control's own gates recorded, and the DDTree
server's GPU memory (nvidia-smi, its process group) stable over a second identical load. Needs the
OpenAI server's modules (docs/serve.md, "On the GPU"): skipped without them.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time

import _engines as E
import pytest

# 600 system words: a conversation's turn 1 spans whole align blocks of the hybrid's prefix cache. 48 tokens
# of room: a cap request's trees run until its drafts are cut (on CPU 16: tests/_serve_load.Size).
SIZE = dict(requests=64, cancel=16, cap=2, max_tokens=64, images=True, prefix_cache=True, system_words=600,
            cap_room=48, tool_tokens=128)
ARGS = ["--dtype", "bfloat16", "--max-model-len", "2048", "--max-num-seqs", "32", "--max-num-batched-tokens", "4096",
        "--kv-cache-memory-bytes", str(2 << 30), "--seed", "0", "--mamba-ssm-cache-dtype", "float32",
        "--enable-prefix-caching", "--async-scheduling", "--enable-prompt-tokens-details",
        "--limit-mm-per-prompt", '{"image": 1}', "--reasoning-parser", "qwen3", "--tool-call-parser", "qwen3_coder",
        "--enable-auto-tool-choice",  # (tests/_serve_cases.py: the parsers, compact JSON and why)
        "--structured-outputs-config", '{"backend": "xgrammar", "disable_any_whitespace": true}', *E.memory_args()]
ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "HF_HUB_OFFLINE": "1", "DDTREE_METRICS_INTERVAL": "0.25",
       "VLLM_USE_V2_MODEL_RUNNER": "1"}
GDN_PREFILL = {"additional_config": {"gdn_prefill_backend": "triton"}}  # the GPU bundle has no FlashInfer
MEMORY_SLACK = 64 << 20  # bytes: a second identical load may round an allocator segment up, not grow per request


def _scenario():
    """tests/_serve_load.py, imported once the OpenAI client's modules are known to be there (httpx)."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    import _serve_load

    return _serve_load


def gpu_memory(srv) -> tuple[str, int]:
    """Bytes of GPU memory the server's processes hold (its process group: API server, engine core), from
    nvidia-smi; where its pids are not this namespace's (a container), the whole GPU's memory in use."""
    def smi(query):
        return subprocess.run(["nvidia-smi", f"--query-{query}", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, check=True).stdout.strip().splitlines()

    group, total, seen = os.getpgid(srv.proc.pid), 0, False
    for line in smi("compute-apps=pid,used_memory"):
        pid, mib = (int(x) for x in line.split(","))
        try:
            mine = os.getpgid(pid) == group
        except ProcessLookupError:
            continue
        seen |= mine
        total += mine * mib << 20
    if seen:
        return "server processes", total
    return "whole GPU", sum(int(x) for x in smi("gpu=memory.used")) << 20


@pytest.fixture(scope="module")
def servers(gpu_env, tmp_path_factory):
    E.require_server_modules()
    from concurrent.futures import ThreadPoolExecutor

    from ddtree_compile.integration import config
    from ddtree_compile.testing import models, server

    root = tmp_path_factory.mktemp("load")
    target = models.write_tiny_vl_model(root / "target", seed=4)
    drafter = models.write_tiny_dflash_drafter(target, root / "mixed", seed=4, layer_types=E.MIXED)
    switch = config.vllm_kwargs(drafter, budget=E.BUDGET, top_k=E.TOP_K, num_speculative_tokens=E.DRAFT_LEN)
    flat = {"speculative_config": {"method": "dflash", "model": str(drafter), "num_speculative_tokens": E.DRAFT_LEN}}
    flags = {"ddtree": config.merge_llm_kwargs(GDN_PREFILL, switch), "plain": GDN_PREFILL,
             "flat": {**GDN_PREFILL, **flat}}  # (merge_llm_kwargs takes DDTree's switch, not a flat config)
    srv = {name: server.Server(target, ARGS + config.cli_flags(kw), root / f"{name}.log", env=ENV, name=name)
           for name, kw in flags.items()}
    t0 = time.perf_counter()
    try:
        with ThreadPoolExecutor(len(srv)) as pool:
            list(pool.map(lambda s: s.start(540), srv.values()))
        yield {**srv, "start_s": round(time.perf_counter() - t0, 1)}
    finally:
        for s in srv.values():
            s.stop()


@pytest.fixture(scope="module")
def sl(servers):
    return _scenario()


@pytest.fixture(scope="module")
def size(sl):
    return sl.Size(**SIZE)


@pytest.fixture(scope="module")
def loads(servers, sl, size):
    refs = {}  # the no-speculation references, shared by the three loads
    tree, plain, flat = servers["ddtree"], servers["plain"], servers["flat"]
    control = sl.run(flat, plain, size, refs, ddtree=False)
    first = sl.run(tree, plain, size, refs)
    memory = [gpu_memory(tree)]  # the other servers idle meanwhile (the references are cached)
    second = sl.run(tree, plain, size, refs)
    memory.append(gpu_memory(tree))
    return {"flat": control, "first": first, "second": second, "memory": memory,
            "logs": {k: servers[k].log() for k in ("ddtree", "plain", "flat")}}


def test_servers_asked_for_v2_with_async_scheduling(servers, loads, record):
    """What each server was started with (its log's non-default args; V2 by the environment variable),
    and the DDTree server's own start-up line: the tree round on Model Runner V2 with async scheduling."""
    record(start_s=servers["start_s"])
    logs = loads["logs"]
    assert "DDTree on: budget 16" in logs["ddtree"], logs["ddtree"][-3000:]
    assert "; Model Runner V2, async scheduling" in logs["ddtree"], logs["ddtree"][-3000:]
    for name, log in logs.items():
        assert "'async_scheduling': True" in log, (name, log[-3000:])


def test_load_and_fault_on_ddtree(loads, sl, size, record):
    out, flat = loads["first"], loads["flat"]
    record(ddtree=sl.summary(out), flat=sl.summary(flat))
    sl.check(flat, size)
    sl.check(out, size, control=flat)  # every DDTree gate failure is one that flat DFlash shares


def test_a_second_identical_load_holds_memory(loads, sl, size, record):
    (what, first), (_, second) = loads["memory"]
    record(gpu_memory=what, gpu_memory_after_load_1=first, gpu_memory_after_load_2=second,
           second=sl.summary(loads["second"]))
    sl.check(loads["second"], size, control=loads["flat"])
    assert first > 0 and second - first <= MEMORY_SLACK, (first, second)
