"""Host wall time per phase of an engine step, for every mode alike (bench_e2e_gpu --phase-timers).

A profiler slows the host so much that the GPU always waits for it, which hides what a round waits
for when it runs at speed; these are perf_counter stamps around methods of vLLM 0.26's V1 runner,
its drafter and the scheduler (about a microsecond each), so flat DFlash's phases are timed the same
way as DDTree's. A phase that grows with DDTree while the host work in it does not is a wait on the
GPU: vLLM syncs on the sampled tokens in `_bookkeeping_sync` and on the drafts in
`take_draft_token_ids` (the engine's post_step). Times are inclusive (nested phases overlap).
On Model Runner V2 (methods of its own, `vllm/v1/worker/gpu/`) the runner's `prepare_inputs`, `sample` and
`postprocess_sampled` and the speculator's `propose` are timed, and inside them the parts where DDTree's
driver adds work (its model state's `prepare_inputs`, `prepare_attn` and `postprocess_state`, the
speculator's `_generate_draft`) next to vLLM's (request states, attention inputs, the FULL graph's
replay); a method an engine lacks is skipped.
"""

from __future__ import annotations

import time
from collections import defaultdict

# (label, owner, method): owner "runner", "drafter", "speculator", "model_state", "cudagraph_manager" or "scheduler"
PHASES = [
    ("schedule", "scheduler", "schedule"),
    ("execute_model", "runner", "execute_model"),
    ("update_states", "runner", "_update_states"),
    ("prepare_inputs", "runner", "_prepare_inputs"),
    ("batch_padding", "runner", "_determine_batch_execution_and_padding"),
    ("attn_metadata", "runner", "_build_attention_metadata"),
    ("preprocess", "runner", "_preprocess"),
    ("model_forward", "runner", "_model_forward"),
    ("sample_tokens", "runner", "sample_tokens"),
    ("sample", "runner", "_sample"),
    ("update_states_after", "runner", "_update_states_after_model_execute"),
    ("propose_draft_token_ids", "runner", "propose_draft_token_ids"),
    ("copy_drafts_to_cpu", "runner", "_copy_draft_token_ids_to_cpu"),
    ("drafter.propose", "drafter", "propose"),
    ("drafter.sample", "drafter", "_sample_draft_tokens"),
    ("bookkeeping_sync", "runner", "_bookkeeping_sync"),
    ("update_from_output", "scheduler", "update_from_output"),
    ("take_draft_token_ids", "runner", "take_draft_token_ids"),
    # Model Runner V2: DDTree's round hooks sit inside these (its propose wraps the speculator's)
    ("v2.prepare_inputs", "runner", "prepare_inputs"),
    ("v2.sample", "runner", "sample"),
    ("v2.postprocess_sampled", "runner", "postprocess_sampled"),
    ("speculator.propose", "speculator", "propose"),
    # inside V2's execute_model (0.26 `model_runner.py:1151-1330`): the request states, the attention
    # inputs, the model state's metadata and inputs (DDTree's schedule and verify_begin: its
    # prepare_inputs), the FULL graph's replay; inside propose, the drafter's forward and drafts
    ("v2.add_requests", "runner", "add_requests"),
    ("v2.update_requests", "runner", "update_requests"),
    ("v2.prepare_attn", "runner", "prepare_attn"),
    ("v2.state.prepare_attn", "model_state", "prepare_attn"),
    ("v2.state.prepare_inputs", "model_state", "prepare_inputs"),
    ("v2.state.postprocess_state", "model_state", "postprocess_state"),
    ("v2.run_fullgraph", "cudagraph_manager", "run_fullgraph"),
    ("speculator.generate_draft", "speculator", "_generate_draft"),
]

_TIMERS: dict[int, dict] = {}  # id(llm) -> label -> seconds


def install(llm) -> dict:
    """Wrap the phases' methods on this in-process engine's instances; returns the running totals."""
    from ddtree_compile.integration import engines

    runner = engines.find_runner(llm)
    owners = {"runner": runner, "drafter": getattr(runner, "drafter", None),
              "speculator": getattr(runner, "speculator", None),
              "model_state": getattr(runner, "model_state", None),
              "cudagraph_manager": getattr(runner, "cudagraph_manager", None),
              "scheduler": llm.llm_engine.engine_core.engine_core.scheduler}
    totals = _TIMERS.setdefault(id(llm), defaultdict(float))
    for label, owner, name in PHASES:
        obj = owners[owner]
        if obj is not None and callable(getattr(obj, name, None)):
            setattr(obj, name, _timed(_method(obj, name), label, totals))
    return totals


def _method(obj, name):
    """What `obj.name` calls: a wrapper already on the instance (V1's round members), else the method
    of obj's class as it is at call time, so that a class given to the object later (Model Runner V2:
    DDTree's driver and the flat oracle re-type the speculator and the model state, adapters/v2_driver.py)
    is what the timer times, not bypassed by it."""
    if name in vars(obj):
        return vars(obj)[name]
    return lambda *a, **k: getattr(type(obj), name)(obj, *a, **k)


def _timed(fn, label, totals):
    def timed(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            totals[label] += time.perf_counter() - t0

    return timed


def snapshot(llm) -> dict | None:
    totals = _TIMERS.get(id(llm))
    return dict(totals) if totals is not None else None
