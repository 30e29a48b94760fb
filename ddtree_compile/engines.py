"""In-process vLLM engines (VLLM_ENABLE_V1_MULTIPROCESSING=0): find the runner, shut down cleanly.

Tests, the demo and `ddtree-compile dump` start several engines one after another in one process.
vLLM 0.32 leaks each compiled model there: `TorchCompileWithNoGuardsWrapper.__init__` runs twice
per model and registers two Dynamo bytecode hooks (bound methods of the model), and its cleanup
removes only the second, while LLMEngine's finalizer looks for `driver_worker.model_runner`, which
an in-process engine does not have. The model (and the CPU GEMM handles of its layers) is then
freed whenever that hook goes away, which can be inside the next engine's fake-tensor trace, where
the handles' `__del__` (a real `.item()`) fails and can leave the dispatcher state broken for
every later trace. Dynamo's caches also hold the compiled forward (a bound method of the model).
`shutdown` drops those hooks, resets Dynamo and collects the engine right away (one engine at a
time: another live engine of this process would recompile on its next trace).
"""

from __future__ import annotations

import gc


def find_runner(llm):
    """The model runner of an in-process `vllm.LLM`, else None (multiprocess engines)."""
    try:
        return llm.llm_engine.model_executor.driver_worker.worker.model_runner
    except AttributeError:
        return None


def find_state(llm):
    """The DDTree state of an in-process `vllm.LLM`, else None."""
    runner = find_runner(llm)
    return getattr(runner, "_ddtree", None) if runner is not None else None


def shutdown(llm) -> None:
    """Shut `llm` down and free its models now; the `LLM` object is unusable afterwards."""
    import torch
    from vllm.distributed import cleanup_dist_env_and_memory

    modules = _modules(find_runner(llm))
    llm.llm_engine.engine_core.shutdown()
    llm.llm_engine = None  # nothing but the caller's husk refers to the engine any more
    _drop_bytecode_hooks(modules)
    del modules
    torch._dynamo.reset()
    gc.collect()
    cleanup_dist_env_and_memory()


def _modules(runner) -> set[int]:
    """ids of every module of the target and the drafter (closes the DDTree state on the way)."""
    if runner is None:
        return set()
    state = getattr(runner, "_ddtree", None)
    if state is not None:
        state.close()
    tops = (runner.model, getattr(getattr(runner, "drafter", None), "model", None))
    return {id(m) for top in tops if top is not None for m in top.modules()}


def _drop_bytecode_hooks(modules: set[int]) -> None:
    import torch

    hooks = getattr(torch._dynamo.convert_frame, "_bytecode_hooks", {})  # private: see the module docstring
    for key in [k for k, h in hooks.items() if id(getattr(h, "__self__", None)) in modules]:
        del hooks[key]
