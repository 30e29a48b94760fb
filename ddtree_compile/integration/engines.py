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

import ddtree_compile.adapters as adapters


def find_runner(llm):
    """The model runner of an in-process `vllm.LLM`, else None (multiprocess engines)."""
    return adapters.current().find_runner(llm)


_ATTR = "_ddtree"  # the DDTree round, on its runner instance (ours: vLLM never reads it)


def state_of(runner):
    return getattr(runner, _ATTR, None)


def set_state(runner, state) -> None:
    setattr(runner, _ATTR, state)


def find_state(llm):
    """The DDTree round of an in-process `vllm.LLM`, else None."""
    runner = find_runner(llm)
    return state_of(runner) if runner is not None else None


def on_runners(llm, fn, *args) -> list:
    """`fn(runner, *args)` on the model runner of every worker of `llm` (one per tensor-parallel
    rank), results by rank. In-process engines call it directly; multiprocess executors (TP > 1,
    or VLLM_ENABLE_V1_MULTIPROCESSING=1) go through `LLM.collective_rpc`, which ships `fn` (a
    module-level function) and so needs VLLM_ALLOW_INSECURE_SERIALIZATION=1."""
    import os

    runner = find_runner(llm)
    if runner is not None:
        return [fn(runner, *args)]
    if os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION") != "1":
        raise RuntimeError(f"{getattr(fn, '__qualname__', fn)} on the workers of a multiprocess engine needs "
                           f"VLLM_ALLOW_INSECURE_SERIALIZATION=1 (LLM.collective_rpc ships a function)")
    return llm.collective_rpc(_call_on_runner, args=(fn, args))


def _call_on_runner(worker, fn, args):
    return fn(worker.model_runner, *args)


def shutdown(llm) -> None:
    """Shut `llm` down and free its models now; the `LLM` object is unusable afterwards."""
    import torch

    A = adapters.current()
    runner = A.find_runner(llm)
    state = find_state(llm)
    if state is not None:
        state.close()
    modules = A.model_module_ids(runner) if runner is not None else set()
    del runner, state
    A.shutdown_engine(llm)
    A.drop_compiled_model_hooks(modules)
    del modules
    torch._dynamo.reset()
    gc.collect()
    A.cleanup_distributed()
