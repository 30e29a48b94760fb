"""The round's hooks on one Model Runner V2 instance (runner_v2.V2RunnerView.install_round_hooks).

V2 has none of V1's round members: `V2RoundHooks` wraps V2's own (docs/runner_v2.md has the table
with 0.26 / 0.32 lines) and calls the round's hooks with V1's arguments, so the stages are the same
code on both runners. What the hooks learn on the way (the step's InputBatch, attention metadata,
CUDA-graph mode) goes to the runner's `_Shared`, which every view of the runner reads.

The target forward itself is not wrapped: V2 runs it in four forms (the eager model, the compiled
model, whose code bypasses the Python `forward`, PIECEWISE graphs, a FULL replay). The tree verify
is set once the step's model inputs are prepared (`model_state.prepare_inputs`, the last call before
every form) and taken down when the verify's logits reach the rejection sampler.
"""

from __future__ import annotations

import torch

from .v1_runner import ROUND_HOOKS, VERIFY_HOOKS


class V2RoundHooks:
    def __init__(self, view, hooks: dict, draft_len: int):
        if set(hooks) != {*ROUND_HOOKS, *VERIFY_HOOKS}:
            raise ValueError(f"round hooks: expected {sorted({*ROUND_HOOKS, *VERIFY_HOOKS})}, got {sorted(hooks)}")
        self.view, self.hooks, self.L = view, hooks, draft_len
        self.r, self.s, self.shared = view.runner, view.speculator, view._shared
        r, s = self.r, self.s
        self.manager = getattr(r, "cudagraph_manager", None)
        self.orig = {"propose": s.propose, "prepare_inputs": r.model_state.prepare_inputs,
                     "prepare_attn": r.model_state.prepare_attn,
                     "postprocess_state": r.model_state.postprocess_state}
        # The speculator drafts L positions from now on, its CUDA graphs too (re-made for 1 + L queries
        # per request before V2 captures them, `dflash/speculator.py:100-124`); the scheduler keeps
        # K = B draft slots. Its forward (a graph or eager) leaves the hidden states of the L sampled
        # positions in `hidden`; the logits are computed after it, eagerly, for the tree build.
        s.num_speculative_steps, s.num_query_per_req = draft_len, 1 + draft_len
        # The drafter drafts L positions at every step, tree or chain: its graph manager must not take
        # budget "auto"'s per-batch-size draft counts (draft_schedule.py) as its query lengths (0.26
        # `cudagraph_utils.py:196-218` derives them from K, here 1 + L - K < 0: a capture of -30 requests).
        spec = r.vllm_config.speculative_config
        schedule, spec.num_speculative_tokens_per_batch_size = spec.num_speculative_tokens_per_batch_size, None
        try:
            s.init_cudagraph_manager(r.vllm_config.compilation_config.cudagraph_mode)
        finally:
            spec.num_speculative_tokens_per_batch_size = schedule
        self.hidden = torch.empty(r.max_num_reqs * draft_len, s.hidden_size, dtype=s.dtype, device=s.device)

    def install(self) -> dict:
        r, s = self.r, self.s
        track_requests(r, self.shared)
        s.propose, s._generate_draft = self.on_propose, self.on_generate_draft
        r.model_state.prepare_attn = self.on_prepare_attn
        r.model_state.postprocess_state = self.on_postprocess_state
        r.model_state.prepare_inputs = self.on_prepare_inputs
        r.rejection_sampler = _TreeRejectionSampler(self)
        # (no "model_forward": V2's forwards are not wrapped, the round's verify_begin/_end bracket them)
        return {"propose": self.original_propose, "sample_draft_tokens": None,
                "prepare_inputs": self.original_prepare_inputs, "model_forward": None,
                "rejection_sampler": self.view.vllm_sampler(),
                "update_states": lambda output_token_ids, scheduler_output: None,
                "propose_draft_token_ids": lambda *args: None}

    # -- build (and, first, the commit of the step just verified) ----------------------------------------
    def on_propose(self, input_batch, attn_metadata, slot_mappings, last_hidden_states, aux_hidden_states,
                   num_sampled, num_rejected, last_sampled, next_prefill_tokens, *args, **kw):
        call = ((input_batch, attn_metadata, slot_mappings, last_hidden_states, aux_hidden_states, num_sampled,
                 num_rejected, last_sampled, next_prefill_tokens, *args), kw)
        if kw.get("dummy_run"):
            return self.orig["propose"](*call[0], **call[1])
        self.shared.batch = input_batch
        # the round committed in V2's postprocess_state (this call is a no-op then; a V2 step that skipped
        # that postprocess would commit here); the drafter's inputs of the tree step are reordered,
        # accepted path first
        self.hooks["update_states"](None, None)
        states = [last_hidden_states, *(aux_hidden_states or ())]
        self.hooks["propose_draft_token_ids"](None, None, None, None, None, states, None, None, None)
        R = input_batch.num_reqs
        roots = last_sampled[input_batch.idx_mapping[:R]].reshape(R, -1)[:, 0]
        drafts = self.hooks["propose"](next_token_ids=roots, v2_call=call)
        self.s.draft_tokens[:R, : drafts.shape[1]] = drafts
        return self.s.draft_tokens[:R]

    def original_propose(self, num_speculative_tokens, next_token_ids, v2_call):
        """V2's propose (the drafter's graph or eager forward), then the logits of its L positions
        through the round's `sample_draft_tokens`."""
        if num_speculative_tokens != self.L:
            raise ValueError(f"the V2 speculator drafts {self.L} positions, asked for {num_speculative_tokens}")
        args, kw = v2_call
        self.orig["propose"](*args, **kw)
        self.hooks["sample_draft_tokens"](self.hidden[: next_token_ids.shape[0] * self.L], None)

    def on_generate_draft(self, num_reqs, num_tokens_padded, attn_metadata, slot_mappings, num_tokens_across_dp,
                          cudagraph_runtime_mode=None):
        """The speculator's forward as V2 runs and captures it (`_generate_draft`): the drafter, then
        its L sampled positions' hidden states into `hidden` (a fixed address for the graphs)."""
        s = self.s
        run = (num_tokens_padded, attn_metadata, slot_mappings, num_tokens_across_dp)
        out = s._run_model(*run) if cudagraph_runtime_mode is None else s._run_model(*run, cudagraph_runtime_mode)
        n = num_reqs * self.L
        self.hidden[:n].copy_(out[s.sample_indices[:n]])

    # -- commit: before V2's own state postprocess -----------------------------------------------------
    def on_postprocess_state(self, *args, **kw):
        """The round's commit (K/V, GDN state in vLLM's chain layout), then V2's postprocess: accepted
        counts from the sampled tokens and, with prefix caching, align's block-boundary copies, which
        read the state the commit left."""
        self.hooks["update_states"](None, None)
        return self.orig["postprocess_state"](*args, **kw)

    # -- verify -------------------------------------------------------------------------------------------
    def on_prepare_attn(self, input_batch, cudagraph_mode, *args, **kw):
        """(0.26 `model_runner.py:1257`, 0.32 `:1915`: the step's CUDA-graph mode is the second argument)"""
        self.shared.cg_mode = (input_batch, cudagraph_mode)  # (a capture prepares dummy batches here too)
        self.shared.attn_metadata = self.orig["prepare_attn"](input_batch, cudagraph_mode, *args, **kw)
        return self.shared.attn_metadata

    def on_prepare_inputs(self, input_batch, req_states):
        """The last call before the target forward in all its forms (0.26 `model_runner.py:1300`, 0.32
        `:1966`): the round's verify of the step is set here, on the positions tensor the target gets
        (V2's rope state's with M-RoPE, else the batch's)."""
        self.shared.batch = input_batch
        out = self.hooks["prepare_inputs"](input_batch, input_batch.num_scheduled_tokens)
        self.hooks["verify_begin"](out.get("positions", input_batch.positions))
        return out

    def original_prepare_inputs(self, input_batch, num_scheduled_tokens):
        return self.orig["prepare_inputs"](input_batch, self.r.req_states)


class _TreeRejectionSampler:
    """runner.rejection_sampler: V2's arguments in, the round's TreeSampler with V1's."""

    def __init__(self, hooks: V2RoundHooks):
        self._hooks = hooks

    def __call__(self, logits, input_batch, draft_logits=None, *rest):
        self._hooks.hooks["verify_end"]()  # the verify's forward ran: its logits are here
        shared = self._hooks.shared
        shared.batch, shared.rs_rest = input_batch, rest
        return self._hooks.hooks["rejection_sampler"](input_batch, None, logits, input_batch)

    def __getattr__(self, name):
        return getattr(self._hooks.shared.rs_original, name)


def track_requests(runner, shared) -> tuple:
    """Wrap the runner's `add_requests` / `_remove_request` (on the instance, called at every step) so
    that `shared.requests` maps every live request id to (SamplingParams, prompt token ids): V2 keeps
    neither on the host; and `shared.next_drafts` holds the drafts per request the scheduler gave the
    step after this one (budget "auto": draft_schedule.py). Returns the wrapped originals (to put back)."""
    add, remove, requests = runner.add_requests, runner._remove_request, shared.requests

    def on_add(scheduler_output):
        out = add(scheduler_output)
        for new in scheduler_output.scheduled_new_reqs:
            requests[new.req_id] = (new.sampling_params, prompt_ids_of(new))
        shared.next_drafts = getattr(scheduler_output, "num_spec_tokens_to_schedule", None)
        return out

    def on_remove(req_id):
        requests.pop(req_id, None)
        return remove(req_id)

    runner.add_requests, runner._remove_request = on_add, on_remove
    return add, remove


def prompt_ids_of(new_req_data) -> list[int]:
    """The prompt of a new request (0.26 sends prompt_token_ids; 0.32 prompt_len + prefill ids)."""
    ids = getattr(new_req_data, "prompt_token_ids", None)
    if ids is not None:
        return list(ids)
    return list(new_req_data.prefill_token_ids[: new_req_data.prompt_len])
