"""The vLLM 0.26 adapter (CUDA, V1 `GPUModelRunner`): the same API as adapters/vllm_0_32.py.

Read from the vLLM 0.26.0 source (commit ffd46bfab, `vllm/_version.py`); docs/vllm_0_26.md has the
facts with file:line. Paths below are relative to that `vllm/` package. Run on an H100 with
PIECEWISE CUDA graphs (attention-only and hybrid targets; tests/gpu, results/gpu_suite.json).

What differs from 0.32 (everything else is the same code, checked line by line):

- Runner choice: dense attention-only targets default to Model Runner V2
  (`config/vllm.py:605-622`, `not model_config.is_moe`), which has none of the seven members
  the V1 driver replaces; hybrids default to V1 (`:613-614`), except with a DFlash drafter mixing sliding and
  full attention (V2 only). `VLLM_USE_V2_MODEL_RUNNER=0` forces V1 for both (`config/vllm.py:550-553`,
  `envs.py:1922`). V2 engines get the round through runner_v2.py and v2_driver.py (what V2
  cannot serve is refused once at attach, logged and counted: `V2RunnerView.unsupported_features`).
- `initialize_kv_cache(kv_cache_config, is_profiling=False)` (`gpu_model_runner.py:7562`) is
  also called on a throw-away minimal cache for CUDA-graph memory profiling
  (`:6462`, from `profile_cudagraph_memory` `:6576`); the hook attaches on the real call only.
- The seven members the V1 driver replaces have 0.32's names and signatures (`_prepare_inputs`
  returns a 2-tuple here, `:1937-1948`; the driver passes it through). The target forward reads `positions` from
  the persistent `runner.positions` buffer under CUDA graphs (`_preprocess` `:3607`,
  `compilation/cuda_graph.py:348-354`), so `install_driver` hands the round an original
  `_model_forward` that writes the positions it is given into that buffer and restores them
  afterwards (the drafter reads the flat ones, `:5195`).
- FLASH_ATTN / TRITON_ATTN store `impl.sliding_window` as a (left, right) tuple
  (`v1/attention/backends/flash_attn.py:756-761`, `triton_attn.py:510-515`); read as a window.
- FULL CUDA graphs (FULL_AND_PIECEWISE, the O2/O3 default): the ddtree mirror ops choose tree vs
  original in Python, which a graph freezes at capture, so `install_graph_capture` makes vLLM's
  own capture of the uniform-decode graphs (1 + B tokens per request) run with a tree verify
  active, and `full_graph_batch` tells the round when a step replays one. FULL graphs of other
  uniform query lengths (the chain, smaller tree buckets) are added beside vLLM's own.
- Engines the round does not serve yet: async scheduling (ON by default for DFlash on CUDA,
  `config/vllm.py:1059-1107`), pure FULL mode (mixed batches in FULL graphs), Mamba prefix
  caching (`mamba_cache_mode != "none"`), dynamic speculative decoding, XD-RoPE, and Model Runner
  V2 engines with torch.compile or CUDA graphs (runner_v2.py).
- CPU-only parts (the CPU GDN state layout) were not ported.
"""

from __future__ import annotations

from ..core.buckets import capture_tokens
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

LINE = "0.26"
RUNNERS = ("v1", "v2")  # V1 GPUModelRunner (v1_driver.py) and Model Runner V2 (v2_driver.py)


# ---------------------------------------------------------------------------------------------
# The class patches
# ---------------------------------------------------------------------------------------------

def install_kv_cache_spec_hook(gdn_spec_blocks) -> bool:
    """GDN state slots by the chain (gdn_slots.py), and 0.26's draft-less rows resumed from the state
    the last verify committed (gdn_resume.py). False if already installed."""
    from vllm.v1.attention.backends import gdn_attn

    gdn_resume.install(gdn_attn, LINE)
    return gdn_slots.install_kv_cache_spec_hook(gdn_spec_blocks)


def install_kv_cache_hook(on_kv_caches_ready) -> bool:
    """Patch `GPUModelRunner.initialize_kv_cache` once per process: after the original (the caches
    exist), call `on_kv_caches_ready(runner)`. Returns False if already patched.

    0.26: profiling calls (`is_profiling=True`, a minimal cache freed right after,
    `gpu_model_runner.py:6439-6463`, `:6505-6537`) are skipped. Model Runner V2's
    `initialize_kv_cache` (`v1/worker/gpu/model_runner.py:411`) is patched the same way (runner_v2.py)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    def after(runner, args, kwargs):
        if not kwargs.get("is_profiling", args[1] if len(args) > 1 else False):
            gdn_resume.bind_accepted_counts(runner)
            on_kv_caches_ready(runner)

    if not patch_after(GPUModelRunner, "initialize_kv_cache", after):
        return False
    patch_kv_caches_ready(on_kv_caches_ready)
    return True


def install_model_load_hook(on_model_load) -> bool:
    """Patch `GPUModelRunner.load_model` once per process: `on_model_load(runner)` runs before the
    original, so before vLLM compiles the model or loads its compiled graph from the compile cache
    (a warm start: the AOT artifact calls the ddtree:: ops, and the pass that defines them does not
    run). Returns False if already patched."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if not patch_before(GPUModelRunner, "load_model", lambda runner, args, kwargs: on_model_load(runner)):
        return False
    patch_load_model(on_model_load)  # Model Runner V2's (`v1/worker/gpu/model_runner.py:276`)
    return True


def install_memory_profile_hook(on_memory_profile) -> bool:
    """Patch `GPUModelRunner.profile_run` (`gpu_model_runner.py:6364`) once per process:
    `on_memory_profile(runner)` runs before the original. `Worker.determine_available_memory` calls
    it inside `memory_profiling` (`gpu_worker.py:484-488`), whose torch peak becomes non-KV memory
    (`:513-545`), so what the hook allocates and keeps is left out of the KV cache. Returns False
    if already patched."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if not patch_before(GPUModelRunner, "profile_run", lambda runner, args, kwargs: on_memory_profile(runner)):
        return False
    patch_profile_run(on_memory_profile)  # Model Runner V2's (`v1/worker/gpu/model_runner.py:673`)
    return True


# ---------------------------------------------------------------------------------------------
# The round's driver on one runner instance
# ---------------------------------------------------------------------------------------------


def install_driver(runner, round_, view, draft_len: int) -> None:
    """The V1 driver (v1_driver.py), whose target forward writes the positions it is called with
    into the runner's persistent buffer (CUDA graphs replay from fixed addresses) and restores the
    buffer after the forward."""
    from .v1_driver import V1Driver

    V1Driver(runner, round_, view, draft_len,
             wrap_forward=lambda original: _static_positions_forward(runner, original)).install()
    contiguous_draft_copies(runner)


def _static_positions_forward(runner, original):
    """`original` (the runner's `_model_forward`), called with positions that live in the buffer
    `_preprocess` hands the model (`:3602-3607`): `runner.positions` (`:763`), or with M-RoPE
    `runner.mrope_positions.gpu` ([3, max_tokens + 1], `:811-825`). Positions given in another
    tensor are copied in for the forward and vLLM's values put back after it:
    `propose_draft_token_ids` reads them again (`:5195`; the drafter takes M-RoPE's T row)."""

    def forward(input_ids=None, positions=None, intermediate_tensors=None, inputs_embeds=None, **kw):
        buf = runner.mrope_positions.gpu if getattr(runner, "uses_mrope", False) else runner.positions
        if (positions is None or positions.dim() != buf.dim() or positions.device != buf.device
                or positions.data_ptr() == buf.data_ptr() or positions.shape[-1] > buf.shape[-1]
                or positions.shape[:-1] != buf.shape[:-1]):
            return original(input_ids=input_ids, positions=positions, intermediate_tensors=intermediate_tensors,
                            inputs_embeds=inputs_embeds, **kw)
        n = positions.shape[-1]
        saved = buf[..., :n].clone()
        buf[..., :n].copy_(positions)
        try:
            return original(input_ids=input_ids, positions=buf[..., :n], intermediate_tensors=intermediate_tensors,
                            inputs_embeds=inputs_embeds, **kw)
        finally:
            buf[..., :n].copy_(saved)

    forward.__wrapped__ = original
    return forward


# ---------------------------------------------------------------------------------------------
# FULL CUDA graphs of the tree verify (docs/vllm_0_26.md (e))
# ---------------------------------------------------------------------------------------------

def install_graph_capture(runner, capture, query_lens=()) -> set[int]:
    """Make vLLM capture its FULL uniform-decode graphs with a tree verify active, and FULL graphs of
    the other uniform query lengths in `query_lens` beside them; returns the query lengths (tokens
    per request) that have FULL graphs (empty: the engine has none, nothing patched).

    `capture(num_tokens, num_reqs, capturing)` returns a context manager (the tree context of that
    padded batch) or None. It is entered around the FULL `CUDAGraphWrapper`'s call
    (`compilation/cuda_graph.py:233-345`), outside its `torch.cuda.graph` block, for the warm-up
    forwards (`capturing` False: eager, mode NONE) and the capture forward (`capturing` True) that
    `_warmup_and_capture` (`gpu_model_runner.py:6851-6893`) makes for a FULL uniform descriptor,
    so the ops' tree branch is what the graph records while the context's own set-up (copies into
    the bucket's metadata) stays out of the graph. The drafter's dummy runs in the same
    `_dummy_run` (`:6054-6120`) call the drafter's model, not this wrapper: no tree context.
    The wrapper's class is swapped for a subclass whose only change is that `__call__` (Python
    looks special methods up on the type); the instance, its `runnable` and `unwrap()` stay
    vLLM's, which `get_model()` and the kernel warm-ups read.

    Other query lengths (docs/vllm_0_26.md (e)): vLLM has one uniform decode length per engine,
    1 + num_speculative_tokens (`cudagraph_dispatcher.py:37`, `gpu_model_runner.py:858`).
    `_extra_query_lens` adds FULL keys for the others at vLLM's uniform batch sizes, routes their
    uniform batches to them and captures them with vLLM's own capture loop."""
    from vllm.compilation.cuda_graph import CUDAGraphWrapper
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import get_forward_context

    model = runner.model  # wrapped in load_model (:5405-5411) when the mode has FULL graphs
    if not isinstance(model, CUDAGraphWrapper) or model.runtime_mode != CUDAGraphMode.FULL:
        return set()
    lens = {runner.uniform_decode_query_len} | _extra_query_lens(runner, query_lens)
    batches: list[tuple[int, int]] = []  # the FULL uniform descriptor being warmed up / captured, if any
    warmup_and_capture = runner._warmup_and_capture

    def _warmup_and_capture(desc, cudagraph_runtime_mode, *args, **kw):
        full = cudagraph_runtime_mode == CUDAGraphMode.FULL and desc.uniform and bool(desc.num_reqs)
        own = runner.uniform_decode_query_len
        if full:
            batches.append((desc.num_tokens, desc.num_reqs))
            # `_dummy_run` builds requests of uniform_decode_query_len tokens (:5833, 5852-5857)
            runner.uniform_decode_query_len = desc.num_tokens // desc.num_reqs
        try:
            return warmup_and_capture(desc, cudagraph_runtime_mode, *args, **kw)
        finally:
            if full:
                batches.pop()
                runner.uniform_decode_query_len = own

    def tree_call(self, *args, **kw):
        cm = None
        if batches:
            capturing = get_forward_context().cudagraph_runtime_mode == CUDAGraphMode.FULL
            cm = capture(*batches[-1], capturing)
        if cm is None:
            return CUDAGraphWrapper.__call__(self, *args, **kw)
        with cm:
            return CUDAGraphWrapper.__call__(self, *args, **kw)

    runner._warmup_and_capture = _warmup_and_capture
    model.__class__ = type("DDTreeCUDAGraphWrapper", (type(model),), {"__call__": tree_call})
    return lens


def _extra_query_lens(runner, query_lens) -> set[int]:
    """FULL graphs for uniform batches of q tokens per request, q in `query_lens` other than vLLM's
    own: keys (R * q, R, uniform) for every R of vLLM's uniform FULL keys (added to the dispatcher,
    whose `get_capture_descs` then hands them to `capture_model`, largest first, one pool), and
    `_determine_batch_execution_and_padding` (`:3877-3989`) answering a uniform batch of R' <= R
    such requests with the smallest such key (padding in request units; vLLM's own dispatch pads by
    token count to sizes that are multiples of its one length, `cudagraph_dispatcher.py:132-156`).
    Not with LoRA, data parallelism or sequence parallelism (their padding and keys differ): then
    nothing is added. Returns the query lengths added."""
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import BatchDescriptor

    vc, dispatcher = runner.vllm_config, runner.cudagraph_dispatcher
    own = runner.uniform_decode_query_len
    rows = sorted({d.num_reqs for d in dispatcher.cudagraph_keys[CUDAGraphMode.FULL] if d.uniform and d.num_reqs})
    extra = {int(q) for q in query_lens
             if int(q) != own and 1 < int(q) and rows and capture_tokens(rows[-1], int(q)) <= runner.max_num_tokens}
    if (not rows or not extra or vc.lora_config is not None or vc.parallel_config.data_parallel_size > 1
            or vc.compilation_config.pass_config.enable_sp):
        return set()
    for q in extra:
        for r in rows:
            dispatcher.add_cudagraph_key(CUDAGraphMode.FULL,
                                         BatchDescriptor(num_tokens=capture_tokens(r, q), num_reqs=r, uniform=True))
    determine = runner._determine_batch_execution_and_padding

    def _determine_batch_execution_and_padding(*args, **kw):
        # Both callers (execute_model :4216, _dummy_run :5875) pass keywords: read them directly, once
        # per step (a positional call goes to vLLM's own dispatch unchanged).
        q, R = int(kw.get("max_num_scheduled_tokens", 0)), int(kw.get("num_reqs", 0))
        forced = kw.get("force_uniform_decode")
        uniform = forced if forced is not None else kw.get("num_tokens") == q * R
        pad = next((r for r in rows if r >= R), None)
        if (not args and q in extra and uniform and pad is not None and not kw.get("force_eager")
                and not kw.get("use_cascade_attn") and not kw.get("num_encoder_reqs") and not kw.get("force_has_lora")):
            desc = BatchDescriptor(num_tokens=capture_tokens(pad, q), num_reqs=pad, uniform=True)
            return CUDAGraphMode.FULL, desc, False, None, None
        return determine(*args, **kw)

    runner._determine_batch_execution_and_padding = _determine_batch_execution_and_padding
    return extra


def full_graph_batch() -> tuple[int, int] | None:
    """(padded tokens, padded requests) when the current forward replays a FULL uniform-decode graph,
    else None (PIECEWISE or eager: the ops' Python runs). Read from the forward context that
    `execute_model` sets before `_model_forward` (`gpu_model_runner.py:4377-4388`)."""
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    fc = get_forward_context()
    desc = fc.batch_descriptor
    if fc.cudagraph_runtime_mode != CUDAGraphMode.FULL or desc is None or not desc.uniform or not desc.num_reqs:
        return None
    return desc.num_tokens, desc.num_reqs


class RunnerView(V1RunnerView):
    """V1RunnerView plus 0.26's hook installation and the engine features this release's round does
    not serve."""

    def install_driver(self, round_, draft_len: int) -> None:
        install_driver(self.runner, round_, self, draft_len)

    def install_graph_capture(self, capture, query_lens=()) -> set[int]:
        return install_graph_capture(self.runner, capture, query_lens)

    def full_graph_batch(self) -> tuple[int, int] | None:
        return full_graph_batch()

    def unsupported_features(self) -> str | None:
        """An engine feature the round does not serve (the shared checks, then 0.26's own), or None."""
        r = self.runner
        vc = r.vllm_config
        if getattr(r, "use_async_scheduling", False):  # :541; default ON for dflash, config/vllm.py:1059-1107
            return ("async scheduling (the tree round runs in the synchronous V1 path; vLLM 0.26 turns it on "
                    "by default for DFlash: pass async_scheduling=False)")
        shared = super().unsupported_features()  # M-RoPE, vocab, logits processors, Mamba prefix caching
        if shared:
            return shared
        sc = vc.speculative_config
        if sc is not None and sc.uses_dynamic_speculative_decoding():  # config/speculative.py:1336
            return "dynamic speculative decoding (the scheduler picks the draft count per batch)"
        mode = vc.compilation_config.cudagraph_mode  # resolved in initialize_attn_backend (:7042)
        if mode is not None and mode.has_full_cudagraphs() and not mode.separate_routine():
            # Pure FULL also captures mixed batches as FULL graphs of their own descriptors; the
            # tree context is captured into uniform-decode graphs only (install_graph_capture).
            return (f"cudagraph_mode={mode.name} (FULL graphs for mixed batches); use FULL_AND_PIECEWISE, "
                    f"FULL_DECODE_ONLY or PIECEWISE")
        return None


# ---------------------------------------------------------------------------------------------
# Inside the replacement ops (a forward context is set)
# ---------------------------------------------------------------------------------------------

# KV-cache dtypes tree attention reads: unquantized, and FP8 e4m3 with per-layer scales (vLLM stores
# it as uint8; FLASH_ATTN / TRITON_ATTN view it as current_platform.fp8_dtype(), flash_attn.py:897-900).
_PLAIN_KV = ("auto", "bfloat16", "float16", "float32")
_FP8_KV = ("fp8", "fp8_e4m3")


def attention_params(layer) -> AttentionParams:
    impl = layer.impl
    unsupported = None
    kv_dtype = str(getattr(impl, "kv_cache_dtype", "auto"))
    kv_fp8, scales = None, ()
    if kv_dtype in _FP8_KV:
        from vllm.platforms import current_platform

        # the query arrives FP8 (scaled by _q_scale) when the backend reads FP8 queries (attention.py:466-524)
        kv_fp8, scales = current_platform.fp8_dtype(), (layer._q_scale, layer._k_scale, layer._v_scale)
    if getattr(impl, "alibi_slopes", None) is not None or getattr(impl, "sinks", None) is not None:
        unsupported = "ALiBi and attention sinks"
    elif kv_dtype not in _PLAIN_KV + _FP8_KV:
        unsupported = f"quantized KV cache {kv_dtype!r} (tree attention reads {', '.join(_PLAIN_KV + _FP8_KV)})"
    elif str(getattr(getattr(impl, "attn_type", "decoder"), "value", getattr(impl, "attn_type", "decoder"))) != "decoder":
        unsupported = f"non-causal attention ({impl.attn_type})"
    elif getattr(impl, "chunk_lookback", -1) > -1:  # triton_attn.py:501,559
        unsupported = "chunked local attention"
    window = getattr(impl, "sliding_window", None)
    if isinstance(window, tuple):
        # FLASH_ATTN / TRITON_ATTN: (-1, -1) none, (w - 1, 0) causal window w (flash_attn.py:756-761)
        window = window[0] + 1 if window[0] >= 0 else 0
    return AttentionParams(impl.num_heads, impl.num_kv_heads, impl.head_size, float(impl.scale),
                           int(window) if window is not None and window > 0 else 0,
                           float(getattr(impl, "logits_soft_cap", None) or 0.0), unsupported, kv_fp8, scales)


def gdn_state_views(layer):
    """(conv_state [lines, dim, state_len], ssm_state logical [lines, HV, V, K], conv weight [dim, W]).

    `layer.kv_cache` = [conv, ssm] strided views of one page per line (gpu_model_runner.py:7383-7404);
    conv is stored (state_len, dim) unless VLLM_SSM_CONV_STATE_LAYOUT=DS (mamba_utils.py:27-48,
    140-144), state_len = W - 1 + num_speculative_tokens; ssm is (HV, V, K) (mamba_utils.py:229-233)."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    conv, ssm = layer.kv_cache[0], layer.kv_cache[1]
    if ssm.device.type == "cpu":
        raise NotImplementedError("the vLLM 0.26 adapter covers CUDA only: the CPU GDN state layout of 0.26 "
                                  "was not read (use vLLM 0.32 on CPU)")
    conv = conv if is_conv_state_dim_first() else conv.transpose(-1, -2)
    w = layer.conv1d.weight  # [dim, 1, W] (qwen_gdn_linear_attn.py:396)
    return conv, ssm, w.view(w.size(0), w.size(-1))


# ---------------------------------------------------------------------------------------------
# CPU only
# ---------------------------------------------------------------------------------------------

def view_of(runner):
    """The RunnerView of either model runner."""
    return V2RunnerView(runner) if is_runner_v2(runner) else RunnerView(runner)
