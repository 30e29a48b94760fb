"""vLLM general plugin: makes the DDTree switch available in every vLLM process.

pyproject entry point (group `vllm.general_plugins`):  ddtree = "ddtree_compile.integration.plugin:register"

vLLM runs `register()` once per process (front end, engine core, workers) before the runner
classes are used. It only installs the adapter's runner hooks (adapters/: before the model loads,
when vLLM profiles memory, when it collects the layers' KV cache specs, once the KV caches exist),
which do nothing unless an engine's `additional_config` holds a "ddtree" entry. On a vLLM outside the adapters' window nothing is
patched: an engine with DDTree switched on then runs as flat DFlash, and the
reason is logged once per process and counted (metrics.PROCESS_STARTUP_FALLBACKS).
"""

from __future__ import annotations

import ddtree_compile.adapters as adapters

_DONE = False


def register() -> None:
    global _DONE
    if _DONE:
        return
    _DONE = True
    from ddtree_compile.integration import prometheus
    from ddtree_compile.integration.metrics import refuse_once

    prometheus.setup_front()  # DDTree's counters on /metrics (integration/prometheus.py)

    try:
        adapter = adapters.current()
    except adapters.UnsupportedVLLM as e:
        refuse_once(str(e), "engines with DDTree switched on (additional_config['ddtree']) run as flat DFlash")
        return
    from ddtree_compile.adapters import engine_args

    engine_args.install()  # the ddtree block added to a flat DFlash configuration is the switch
    adapter.install_model_load_hook(_on_model_load)
    adapter.install_memory_profile_hook(_on_memory_profile)
    adapter.install_kv_cache_spec_hook(_gdn_spec_blocks)
    adapter.install_kv_cache_hook(_on_kv_caches_ready)


def _on_model_load(runner) -> None:
    """Before the model loads: an engine whose graphs the tree pass rewrites defines the `ddtree::`
    mirror ops now. The pass defines them when it rewrites a graph, but a warm start loads the
    rewritten graph from vLLM's compile cache without running the pass, and that graph calls them
    (without them it fails with "'ddtree' object has no attribute ..."). That is a DDTree engine,
    and also an engine without DDTree whose compilation_config installs the pass (e.g. a flat
    DFlash engine compiled alike: the mirror ops run vLLM's op when no tree is being verified). An
    engine with op_swap "trace" points vLLM's ops at them now, before its model is traced, so its
    graphs call them from the start (tree_ops.redirect_before_trace)."""
    from ddtree_compile.integration import config, tree_ops
    from ddtree_compile.passes.entry import tree_verify_pass
    from ddtree_compile.passes.rules import load_rules

    extra, post_grad_pass = adapters.current().engine_switches(runner)
    cfg = config.parse(extra)
    if post_grad_pass is tree_verify_pass or cfg is not None:
        tree_verify_pass.engine()  # resolves the rule table, registering every active rule's mirror op
    if cfg is not None and cfg.op_swap == "trace":
        tree_ops.redirect_before_trace(runner, load_rules())


def _on_memory_profile(runner) -> None:
    """vLLM measures the memory it must leave out of the KV cache: a DDTree engine reserves its
    round's buffers now (GDN records and depth stack, tree-attention scratch: round/workspace.py);
    attach allocates them in that space."""
    from ddtree_compile.integration import config

    cfg = config.parse(adapters.current().engine_switches(runner)[0])
    if cfg is not None:
        from ddtree_compile.integration.round import workspace

        workspace.reserve(runner, cfg)


def _gdn_spec_blocks(runner) -> int | None:
    """vLLM collects the layers' KV cache specs (in the worker, before the cache is sized; the engine
    core and its scheduler take them from there): a hybrid DDTree engine that replays its GDN state
    needs L speculative state slots per request, not num_speculative_tokens (round/checks.py
    gdn_spec_blocks); None leaves vLLM's."""
    from ddtree_compile.integration import config
    from ddtree_compile.integration.round.checks import gdn_spec_blocks

    A = adapters.current()
    cfg = config.parse(A.engine_switches(runner)[0])
    return None if cfg is None else gdn_spec_blocks(A.settings_of(runner), cfg)


def _on_kv_caches_ready(runner) -> None:
    """The adapter's hook: the runner's KV caches exist; attach the round if this engine asked for it."""
    from ddtree_compile.integration import config
    from ddtree_compile.integration.round import attach

    cfg = config.parse(adapters.current().engine_switches(runner)[0])
    if cfg is None:
        return
    if adapters.current().settings_of(runner).spec_method is None:
        raise ValueError("DDTree (additional_config['ddtree']) needs a speculative_config with a DFlash drafter")
    attach(runner, cfg)
    from ddtree_compile.integration.prometheus import start_exporter

    start_exporter(runner)
