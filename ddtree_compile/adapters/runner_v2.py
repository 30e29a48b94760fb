"""Model Runner V2 (`vllm/v1/worker/gpu/`, vLLM 0.26 and 0.32): the round's hooks and the RunnerView.

V2 has none of V1's round members, so the hooks sit on these (docs/runner_v2.md has the lines):

    build   speculator.propose (wrapped)          the drafter drafts L positions; the scheduler gets
            speculator._generate_draft (replaced)   the tree's B nodes as drafts (vLLM's K = B)
    verify  model_state.prepare_inputs (wrapped)   the step's batch: tree metadata (positions stay flat
                                                   for the slot mapping)
            model.forward (wrapped)                tree positions and the tree context, eager
    walk    rejection_sampler (replaced)           V2's sampler output: sampled ids, num_sampled,
                                                   num_rejected (post_update keeps the accepted prefix)
    commit  start of the next speculator.propose   after V2's postprocess: K/V compaction, GDN state and
                                                   the next read column (num_accepted_tokens_gpu),
                                                   drafter inputs reordered (accepted path first)

The round's hooks keep V1's signatures (v1_runner.ROUND_HOOKS): `install_round_hooks` calls them
from V2's members and hands the round originals with V1's signatures, so build / verify / walk /
commit are the same stages on both runners. What V2 keeps only on the device or not at all (a
request's SamplingParams and prompt) is recorded when the request is added.

Served: eager engines (compilation mode NONE, no CUDA graphs), greedy and seeded sampling, chain rows
through V2's own rejection sampler with one-hot drafts (lossless: the drafts are the tree's, not
samples of the drafter's distribution), attention-only and GatedDeltaNet hybrids, M-RoPE.
Refused at attach (unsupported_features): compiled or CUDA-graph engines, async scheduling, custom
logits processors, hybrid prefix caching; budget "auto" verifies the tree every step.
"""

from __future__ import annotations

import numpy as np
import torch

from .engine import engine_settings
from .v1_runner import ROUND_HOOKS, V1RunnerView, patch_after, patch_before

_SHARED = "_ddtree_v2"  # on the runner instance: what every view of that runner reads (_Shared)


class _Shared:
    """Per runner, set by the round's hooks and read by every view of the runner (the round's, a test
    harness's): V2 keeps a request's SamplingParams and prompt nowhere on the host, and passes the
    step's InputBatch as an argument instead of holding it."""

    def __init__(self):
        self.requests: dict = {}  # req_id -> (SamplingParams, prompt token ids)
        self.batch = None  # the InputBatch of the step in flight
        self.rs_rest: tuple = ()  # the rejection sampler's arguments after draft_logits (0.32: invalid_drafts)
        self.attn_metadata: dict = {}  # layer name -> metadata of the step (model_state.prepare_attn)
        self.desc = None  # the CUDA-graph descriptor vLLM dispatched the step to
        self.full_desc = None  # set while a FULL graph replays (cudagraph_manager.run_fullgraph)
        self.positions = None  # the positions tensor vLLM hands the target (model inputs)
        self.pw = False  # set while PIECEWISE graphs run the target (cudagraph_manager.run_pw_graph)
        self.in_forward = False  # set while the round's target forward runs (re-entry guard)


def runner_v2_class():
    """Model Runner V2's class, or None on a build without it (V2 needs Triton)."""
    try:
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner as RunnerV2
    except Exception:
        return None
    return RunnerV2


def is_runner_v2(runner) -> bool:
    cls = runner_v2_class()
    return cls is not None and isinstance(runner, cls)


def patch_kv_caches_ready(on_kv_caches_ready) -> bool:
    """After Model Runner V2's `initialize_kv_cache` (0.26 `model_runner.py:411`; no profiling pass
    there) `on_kv_caches_ready(runner)` runs: the caches exist, the round may attach. False on a build
    without V2 or if already patched."""
    cls = runner_v2_class()
    return cls is not None and patch_after(cls, "initialize_kv_cache",
                                           lambda runner, args, kwargs: on_kv_caches_ready(runner))


def patch_profile_run(on_memory_profile) -> bool:
    """Before Model Runner V2's `profile_run` (0.26 `:673`, inside the worker's memory profile as V1's):
    the round's workspace is reserved there. False on a build without V2 or if already patched."""
    cls = runner_v2_class()
    return cls is not None and patch_before(cls, "profile_run", lambda runner, args, kwargs: on_memory_profile(runner))


class V2RunnerView(V1RunnerView):
    """The RunnerView of Model Runner V2. Forward-time reads (block tables, GDN addressing, layer
    kinds) are V1's: V2 builds the same attention metadata and binds the same caches."""

    def __init__(self, runner):
        self.runner = runner
        self.settings = engine_settings(runner.vllm_config)
        self.device = runner.device
        self.dtype = runner.model_config.dtype
        self.max_num_reqs = runner.max_num_reqs
        cc = runner.vllm_config.compilation_config
        self.eager = cc.mode == 0
        self.speculator = runner.speculator
        self._rs_original = runner.rejection_sampler  # V2's own (the view is made before the round's hooks)
        if not hasattr(runner, _SHARED):
            setattr(runner, _SHARED, _Shared())
        self._shared = getattr(runner, _SHARED)
        self._requests = self._shared.requests

    @property
    def batch(self):
        return self._shared.batch

    # -- refusals ---------------------------------------------------------------------------------
    def unsupported_features(self) -> str | None:
        vc = self.runner.vllm_config
        mc, cc = vc.model_config, vc.cache_config
        mode = vc.compilation_config.cudagraph_mode
        if mode is not None and mode.has_full_cudagraphs() and not mode.separate_routine():
            # Pure FULL also captures mixed batches as FULL graphs; the tree context is captured into
            # the uniform-decode graphs only (install_graph_capture).
            return (f"cudagraph_mode={mode.name} (FULL graphs for mixed batches); use FULL_AND_PIECEWISE, "
                    f"FULL_DECODE_ONLY or PIECEWISE")
        if getattr(getattr(self.runner, "cudagraph_manager", None), "use_breakable_cg", False):
            return "breakable CUDA graphs of Model Runner V2 (the round hooks vLLM's compiled piecewise graphs)"
        if vc.scheduler_config.async_scheduling:
            return "async scheduling (the tree round is synchronous: pass async_scheduling=False)"
        if type(self.speculator).__name__ != "DFlashSpeculator":
            return f"a {type(self.speculator).__name__} speculator (DDTree needs V2's DFlash speculator)"
        if mc.logits_processors:
            return "custom logits processors (the tree walk does not apply them)"
        if mc.is_hybrid and getattr(cc, "mamba_cache_mode", "none") != "none":
            return (f"Mamba prefix caching (mamba_cache_mode={cc.mamba_cache_mode!r}); "
                    f"run hybrids with enable_prefix_caching=False")
        return None

    def budget_auto_unsupported(self) -> str | None:
        return ("budget 'auto' on Model Runner V2: its scheduler schedules num_speculative_tokens drafts every "
                "step, so a chain step cannot take fewer")

    def has_drafter(self) -> bool:
        return self.speculator is not None

    # -- requests of the current step ---------------------------------------------------------------
    def num_reqs(self) -> int:
        return self.batch.num_reqs

    def req_ids(self, R: int) -> list[str]:
        return list(self.batch.req_ids[:R])

    def sampling_params(self, req_id: str):
        return self._requests.get(req_id, (None, ()))[0]

    def live_req_ids(self) -> set[str]:
        return set(self.runner.req_states.req_id_to_index)

    def temperatures_host(self, R: int):
        return self.runner.sampler.sampling_states.temperature.np[self.batch.idx_mapping_np[:R]]

    def scheduled_drafts(self, scheduler_output) -> dict[str, list[int]]:
        """`scheduler_output` is the InputBatch (V2's prepare-inputs hook gets no scheduler output);
        the drafts themselves live on the device, so the lists hold placeholders of the right length."""
        per_req = scheduler_output.num_draft_tokens_per_req
        if not scheduler_output.num_draft_tokens or per_req is None:
            return {}
        R = scheduler_output.num_reqs
        return {q: [-1] * int(n) for q, n in zip(scheduler_output.req_ids[:R], per_req[:R]) if n > 0}

    # -- the sampler's inputs and output ---------------------------------------------------------------
    def vllm_sampler(self):
        """V2's rejection sampler with V1's arguments, drafts one-hot (draft_logits None): the drafts
        are the tree's tokens, not samples of the drafter's distribution, so rejection against that
        distribution would not be lossless."""
        original = self._rs_original

        def sample(metadata, draft_probs, logits, sampling_metadata):
            return original(logits, metadata, None, *self._shared.rs_rest)

        return sample

    def sampling_temperature(self, sampling_metadata) -> torch.Tensor | None:
        R = self.batch.num_reqs
        host = self.temperatures_host(R)
        if not (host >= 1e-5).any():
            return None
        temp = self.runner.sampler.sampling_states.temperature.gpu[self.batch.idx_mapping[:R]]
        return torch.where(temp < 1e-5, torch.zeros_like(temp), temp)

    def spec_batch(self, spec_metadata):
        from .interface import SpecBatch

        b = spec_metadata  # the InputBatch
        if not b.num_draft_tokens or b.num_draft_tokens_per_req is None:
            return None
        R = b.num_reqs
        ks = [int(k) for k in b.num_draft_tokens_per_req[:R]]
        starts = b.query_start_loc_np[:R]
        rows = np.concatenate([np.arange(s + 1, s + 1 + k) for s, k in zip(starts, ks)] or [np.zeros(0, np.int64)])
        draft_tokens = b.input_ids[torch.from_numpy(rows.astype(np.int64)).to(b.input_ids.device)]
        return SpecBatch(ks, draft_tokens, b.logits_indices)

    def sampled_tokens(self, sampler_output) -> tuple[torch.Tensor, object]:
        """V2 leaves the columns past num_sampled unspecified: -1 there, as V1 writes them."""
        ids = sampler_output.sampled_token_ids
        col = torch.arange(ids.shape[1], device=ids.device)
        keep = col.unsqueeze(0) < sampler_output.num_sampled.to(ids.device).unsqueeze(1)
        return torch.where(keep, ids, torch.full_like(ids, -1)), sampler_output.logprobs_tensors

    def sampler_output(self, sampled_token_ids: torch.Tensor, logprobs_tensors=None):
        from vllm.v1.worker.gpu.sample.output import SamplerOutput

        b = self.batch
        R = sampled_token_ids.shape[0]
        num_sampled = (sampled_token_ids != -1).sum(1).to(torch.int32)
        query_len = (b.query_start_loc[1: R + 1] - b.query_start_loc[:R]).to(torch.int32)
        return SamplerOutput(sampled_token_ids=sampled_token_ids.to(torch.int64), logprobs_tensors=logprobs_tensors,
                             num_nans=None, num_sampled=num_sampled, num_rejected=query_len - num_sampled)

    def replace_sampled(self, sampler_output, tokens: torch.Tensor, rows: torch.Tensor, drafts: torch.Tensor):
        """V2 reads the counts, not the padding: they are replaced with the ids."""
        out = sampler_output
        ids = out.sampled_token_ids
        ids.copy_(torch.where(rows.unsqueeze(1), tokens.to(ids.dtype), ids))
        n = (tokens != -1).sum(1).to(out.num_sampled.dtype)
        out.num_sampled.copy_(torch.where(rows, n, out.num_sampled))
        rejected = (drafts.to(n.device) + 1 - n).to(out.num_rejected.dtype)
        out.num_rejected.copy_(torch.where(rows, rejected, out.num_rejected))
        return out

    def prompt_token_ids(self, req_id: str) -> list[int]:
        return list(self._requests.get(req_id, (None, ()))[1])

    # -- positions and the verify batch ----------------------------------------------------------------
    def positions(self, T: int) -> torch.Tensor:
        return self.batch.positions[:T]

    def verify_positions(self, logits_indices: torch.Tensor) -> torch.Tensor:
        return self.batch.positions[logits_indices]

    def full_graph_tokens(self) -> int | None:
        desc = self._shared.full_desc
        return None if desc is None else desc.num_tokens

    def verify_bypasses_hooks(self) -> str | None:
        """A compiled engine's eager forward (a batch past the CUDA-graph sizes) calls the compiled
        model, whose Python `forward` (where eager engines are hooked) the compiled code bypasses."""
        desc = self._shared.desc
        if self.eager or desc is None or desc.cg_mode.name != "NONE":
            return None
        return "a batch larger than the CUDA-graph capture sizes (compiled V2 engine, eager forward)"

    def input_ids(self) -> torch.Tensor:
        return self.batch.input_ids

    def set_num_accepted(self, R: int, committed: torch.Tensor) -> None:
        """Hybrids: the column the next step reads GDN state / conv at, per request slot (V2's
        `MambaHybridModelState.num_accepted_tokens_gpu`, which its postprocess set to num_sampled)."""
        acc = self.runner.model_state.num_accepted_tokens_gpu
        acc[self.batch.idx_mapping[:R].long()] = committed.to(acc.dtype)

    # -- layers and caches -------------------------------------------------------------------------------
    def layer(self, name: str):
        return self.runner.vllm_config.compilation_config.static_forward_context[name]

    def _attn_metadata(self) -> dict:
        """The step's metadata as `model_state.prepare_attn` built it: a FULL graph replays without a
        forward context (`run_fullgraph`), so it is not read from there."""
        return self._shared.attn_metadata

    def _drafter_layer_names(self) -> set[str]:
        return set(getattr(self.speculator, "draft_attn_layer_names", ()) or ())

    # -- the drafter -------------------------------------------------------------------------------------
    def drafter_draft_len(self) -> int:
        return self.speculator.num_speculative_steps  # L while the round drafts (install_round_hooks)

    def drafter_compute_logits(self, hidden_states) -> torch.Tensor:
        return self.speculator.model.compute_logits(hidden_states)

    def drafter_root_positions(self, R: int) -> torch.Tensor:
        """The DFlash query block of each request starts with its bonus token at its flat position
        (the speculator's input buffers; V2 drafts on flat positions, M-RoPE targets included)."""
        L = self.drafter_draft_len()
        return self.speculator.input_buffers.positions[: R * (1 + L)].view(R, 1 + L)[:, 0]

    def wrap_drafter_logits(self, fn) -> None:
        model = self.speculator.model
        original = model.compute_logits
        model.compute_logits = lambda hidden_states: fn(original, hidden_states)

    def unwrap_drafter_logits(self) -> None:
        self.speculator.model.__dict__.pop("compute_logits", None)

    # -- the round's hooks ---------------------------------------------------------------------------------
    def install_graph_capture(self, capture) -> bool:
        """V2 captures its graphs in `cudagraph_manager.capture(model, ...)` (0.26 `cudagraph_utils.py:
        440-565`): each FULL descriptor's warm-up and capture call `model(**inputs)` with attention
        metadata and runtime mode NONE (PIECEWISE warm-ups build none), the capture inside
        `torch.cuda.graph`. The model handed to it is wrapped so those calls run inside
        `capture(num_tokens, capturing)`'s tree context, entered outside the graph."""
        manager = getattr(self.runner, "cudagraph_manager", None)
        mode = self.runner.vllm_config.compilation_config.cudagraph_mode
        if manager is None or mode is None or not mode.has_full_cudagraphs():
            return False
        original = manager.capture

        def capture_with_trees(model, *args, **kw):
            return original(_CaptureModel(model, capture), *args, **kw)

        manager.capture = capture_with_trees
        return True

    def install_round_hooks(self, hooks: dict) -> dict:
        if set(hooks) != set(ROUND_HOOKS):
            raise ValueError(f"round hooks: expected {sorted(ROUND_HOOKS)}, got {sorted(hooks)}")
        r, s, view = self.runner, self.speculator, self
        propose, generate = s.propose, s._generate_draft
        prepare_inputs, forward = r.model_state.prepare_inputs, r.model.forward
        add_requests, remove_request = r.add_requests, r._remove_request
        drafting = []  # non-empty while the round's propose runs the drafter for L positions
        L = {"steps": s.num_speculative_steps}

        def on_add_requests(scheduler_output):
            out = add_requests(scheduler_output)
            for new in scheduler_output.scheduled_new_reqs:
                view._requests[new.req_id] = (new.sampling_params, _prompt_ids(new))
            return out

        def on_remove_request(req_id):
            view._requests.pop(req_id, None)
            return remove_request(req_id)

        def original_propose(num_speculative_tokens, next_token_ids, v2_call):
            """V2's propose with the speculator drafting `num_speculative_tokens` (= L) positions."""
            args, kw = v2_call
            K, Q = s.num_speculative_steps, s.num_query_per_req
            s.num_speculative_steps, s.num_query_per_req = num_speculative_tokens, 1 + num_speculative_tokens
            L["steps"] = num_speculative_tokens
            drafting.append(True)
            try:
                return propose(*args, **kw)
            finally:
                drafting.pop()
                s.num_speculative_steps, s.num_query_per_req = K, Q

        def on_propose(input_batch, attn_metadata, slot_mappings, last_hidden_states, aux_hidden_states,
                       num_sampled, num_rejected, last_sampled, next_prefill_tokens, *args, **kw):
            call = ((input_batch, attn_metadata, slot_mappings, last_hidden_states, aux_hidden_states, num_sampled,
                     num_rejected, last_sampled, next_prefill_tokens, *args), kw)
            if kw.get("dummy_run"):
                return propose(*call[0], **call[1])
            view._shared.batch = input_batch
            # commit of the step just verified (V2's postprocess ran: its accepted counts are in place)
            hooks["update_states"](None, None)
            hidden = [last_hidden_states, *(aux_hidden_states or ())]
            hooks["propose_draft_token_ids"](None, None, None, None, None, hidden, None, None, None)
            R = input_batch.num_reqs
            roots = last_sampled[input_batch.idx_mapping[:R]].reshape(R, -1)[:, 0]
            drafts = hooks["propose"](next_token_ids=roots, v2_call=call)
            s.draft_tokens[:R, : drafts.shape[1]] = drafts
            return s.draft_tokens[:R]

        def on_generate_draft(num_reqs, num_tokens_padded, attn_metadata, slot_mappings, num_tokens_across_dp,
                              cudagraph_runtime_mode=None, *args, **kw):
            if not drafting:
                extra = () if cudagraph_runtime_mode is None else (cudagraph_runtime_mode,)
                return generate(num_reqs, num_tokens_padded, attn_metadata, slot_mappings, num_tokens_across_dp,
                                *extra, *args, **kw)
            run = (num_tokens_padded, attn_metadata, slot_mappings, num_tokens_across_dp)
            hidden = s._run_model(*run) if cudagraph_runtime_mode is None else s._run_model(*run, cudagraph_runtime_mode)
            n = num_reqs * L["steps"]
            top1, _ = hooks["sample_draft_tokens"](hidden[s.sample_indices[:n]], None)
            s.draft_tokens[:num_reqs, : L["steps"]] = top1.view(num_reqs, L["steps"]).to(s.draft_tokens.dtype)

        shared = view._shared
        prepare_attn = r.model_state.prepare_attn
        manager = getattr(r, "cudagraph_manager", None)

        def on_prepare_attn(*args, **kw):
            shared.attn_metadata = prepare_attn(*args, **kw)
            return shared.attn_metadata

        def on_prepare_inputs(input_batch, req_states):
            shared.batch = input_batch
            out = hooks["prepare_inputs"](input_batch, input_batch.num_scheduled_tokens)
            shared.positions = out.get("positions", input_batch.positions)  # what the target gets
            return out

        def original_prepare_inputs(input_batch, num_scheduled_tokens):
            return prepare_inputs(input_batch, r.req_states)

        def on_forward(*args, **kw):
            if shared.in_forward:
                return forward(*args, **kw)
            if args:  # V2 calls model(**model_inputs)
                raise TypeError("DDTree's V2 forward hook takes keyword arguments only")
            shared.positions = kw.get("positions")
            return hooks["model_forward"](**kw)

        def original_forward(**kw):
            """The target forward vLLM chose (FULL replay, PIECEWISE graphs, eager), with the positions
            the round hands it written into the tensor vLLM passed: graphs read fixed addresses, and
            vLLM's values are put back after the forward (the drafter and the sampler read them)."""
            run = (lambda **k: run_fullgraph(shared.full_desc)) if shared.full_desc is not None else \
                (lambda **k: run_pw_graph(r.model, k)) if shared.pw else forward
            shared.in_forward = True  # a compiled model's skip path calls `forward` again: not a second hook
            try:
                return _with_positions_in(shared.positions, run, kw)
            finally:
                shared.in_forward = False

        def on_dispatch(*args, **kw):
            shared.desc = dispatch(*args, **kw)
            return shared.desc

        def on_run_fullgraph(desc):
            shared.full_desc = desc
            try:
                return hooks["model_forward"](input_ids=None, positions=shared.positions, intermediate_tensors=None,
                                              inputs_embeds=None)
            finally:
                shared.full_desc = None

        def on_run_pw_graph(model, model_inputs):
            shared.pw, shared.positions = True, model_inputs.get("positions")
            try:
                return hooks["model_forward"](**model_inputs)
            finally:
                shared.pw = False

        r.model_state.prepare_attn = on_prepare_attn
        if manager is not None:
            dispatch, run_fullgraph, run_pw_graph = manager.dispatch, manager.run_fullgraph, manager.run_pw_graph
            manager.dispatch, manager.run_fullgraph, manager.run_pw_graph = on_dispatch, on_run_fullgraph, on_run_pw_graph

        class TreeRejectionSampler:
            """runner.rejection_sampler: V2's arguments in, the round's TreeSampler with V1's."""

            def __call__(self_, logits, input_batch, draft_logits=None, *rest):
                view._shared.batch, view._shared.rs_rest = input_batch, rest
                return hooks["rejection_sampler"](input_batch, None, logits, input_batch)

            def __getattr__(self_, name):
                return getattr(view._rs_original, name)

        r.add_requests, r._remove_request = on_add_requests, on_remove_request
        s.propose, s._generate_draft = on_propose, on_generate_draft
        r.model_state.prepare_inputs, r.model.forward = on_prepare_inputs, on_forward
        r.rejection_sampler = TreeRejectionSampler()
        return {"propose": original_propose, "sample_draft_tokens": None,
                "prepare_inputs": original_prepare_inputs, "model_forward": original_forward,
                "rejection_sampler": view.vllm_sampler(),
                "update_states": lambda output_token_ids, scheduler_output: None,
                "propose_draft_token_ids": lambda *args: None}


class _CaptureModel:
    """The model as V2's graph capture calls it: a FULL descriptor's warm-up and capture forwards
    (attention metadata set, runtime mode NONE) run inside the round's tree context of that size."""

    def __init__(self, model, capture):
        self._model, self._capture = model, capture

    def __call__(self, **inputs):
        from vllm.forward_context import get_forward_context

        fc = get_forward_context()
        cm = None
        if fc.attn_metadata is not None and fc.cudagraph_runtime_mode.name == "NONE":
            ids = inputs.get("input_ids")
            tokens = ids.shape[0] if ids is not None else inputs["positions"].shape[-1]
            cm = self._capture(tokens, torch.cuda.is_current_stream_capturing())
        if cm is None:
            return self._model(**inputs)
        with cm:
            return self._model(**inputs)

    def __getattr__(self, name):
        return getattr(self._model, name)


def _with_positions_in(buf, run, kw: dict):
    """run(**kw) with kw["positions"] copied into `buf` (vLLM's positions tensor, [T] or M-RoPE
    [3, T]) for the call and vLLM's values restored after it."""
    positions = kw.get("positions")
    if buf is None or positions is None or positions is buf:
        return run(**kw)
    n = positions.shape[-1]
    saved = buf[..., :n].clone()
    buf[..., :n].copy_(positions)
    try:
        return run(**dict(kw, positions=buf))
    finally:
        buf[..., :n].copy_(saved)


def _prompt_ids(new_req_data) -> list[int]:
    """The prompt of a new request (0.26 sends prompt_token_ids; 0.32 prompt_len + prefill ids)."""
    ids = getattr(new_req_data, "prompt_token_ids", None)
    if ids is not None:
        return list(ids)
    return list(new_req_data.prefill_token_ids[: new_req_data.prompt_len])
