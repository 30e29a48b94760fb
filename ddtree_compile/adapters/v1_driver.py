"""The V1 runner's driver of the round (vLLM 0.26 and 0.32, `vllm/v1/worker/gpu_model_runner.py`).

V1 declares no extension point for a speculator's round: its step reaches the drafter, the target
and the sampler through the seven members below, which the driver replaces on the runner INSTANCE
with calls of the round's phases (integration/round/state.py) around V1's own:

    drafter.propose              round.propose(V1's drafter for L positions, R, roots) -> drafts
      drafter._sample_draft_tokens round.drafter_topk(the drafter's logits) -> top-1
    _prepare_inputs              V1's; round.schedule(scheduled drafts)
    _model_forward               round.forward(V1's forward)        (the tree verify)
    rejection_sampler            round.sample(V1's rejection sampler, ...)
    _update_states_after_model_execute   round.commit(V1's update)
    propose_draft_token_ids      round.drafter_inputs(the target's hidden states); V1's
"""

from __future__ import annotations

from .v1_runner import V1Verify

# The V1 members the driver replaces: name -> (owner path on the runner, attribute)
ROUND_MEMBERS = {
    "propose": ("drafter", "propose"),  # DFlash drafts L positions
    "sample_draft_tokens": ("drafter", "_sample_draft_tokens"),  # the drafter's logits -> tokens
    "prepare_inputs": ("", "_prepare_inputs"),  # batch layout, positions, slot mapping of a step
    "model_forward": ("", "_model_forward"),  # the target forward
    "rejection_sampler": ("", "rejection_sampler"),  # an object: verify logits -> sampled tokens
    "update_states": ("", "_update_states_after_model_execute"),  # after sampling (hybrids: accepted counts)
    "propose_draft_token_ids": ("", "propose_draft_token_ids"),  # the drafter's next-round inputs
}


class V1Driver:
    """The round's phases from V1's members, the drafter drafting `draft_len` positions per call.
    `wrap_forward(original)`: a release line's wrapper of V1's `_model_forward` (0.26: positions moved
    into the runner's persistent buffer)."""

    def __init__(self, runner, round_, view, draft_len: int, wrap_forward=None):
        self.runner, self.round, self.view, self.L = runner, round_, view, draft_len
        self.orig = {name: getattr(getattr(runner, path) if path else runner, attr)
                     for name, (path, attr) in ROUND_MEMBERS.items()}
        if wrap_forward is not None:
            self.orig["model_forward"] = wrap_forward(self.orig["model_forward"])

    def install(self) -> None:
        members = {"propose": self.propose, "sample_draft_tokens": self.sample_draft_tokens,
                   "prepare_inputs": self.prepare_inputs, "model_forward": self.model_forward,
                   "rejection_sampler": TreeSampler(self.round, self.orig["rejection_sampler"]),
                   "update_states": self.update_states, "propose_draft_token_ids": self.propose_draft_token_ids}
        for name, (path, attr) in ROUND_MEMBERS.items():
            setattr(getattr(self.runner, path) if path else self.runner, attr, members[name])

    # V1's arguments (0.32's names; 0.26's are the same for these members)
    def propose(self, num_speculative_tokens=None, **kw):  # (V1 takes the draft length per call)
        roots, sampled = kw["next_token_ids"], []

        def run_drafter(chain: bool):  # V1's drafter for L positions, either kind: its drafts are the top-1
            # (sample_draft_tokens)
            sampled.append(self.orig["propose"](num_speculative_tokens=self.L, **kw))

        proposal = self.round.propose(run_drafter, roots.shape[0], lambda: roots)
        return sampled[0] if proposal.chain else proposal.drafts

    def sample_draft_tokens(self, hidden_states, sampling_metadata):
        return self.round.drafter_topk(self.view.drafter_compute_logits(hidden_states)), None

    def prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        out = self.orig["prepare_inputs"](scheduler_output, num_scheduled_tokens)
        self.round.schedule(self.view.scheduled_drafts(scheduler_output), num_scheduled_tokens)
        return out

    def model_forward(self, **kw):
        return self.round.forward(self.orig["model_forward"], **kw)

    def update_states(self, output_token_ids, scheduler_output):
        return self.round.commit(lambda: self.orig["update_states"](output_token_ids, scheduler_output))

    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                                sample_hidden_states, aux_hidden_states, spec_decode_metadata,
                                common_attn_metadata, slot_mappings):
        self.round.drafter_inputs(aux_hidden_states)
        return self.orig["propose_draft_token_ids"](
            scheduler_output, sampled_token_ids, sampling_metadata, hidden_states, sample_hidden_states,
            aux_hidden_states, spec_decode_metadata, common_attn_metadata, slot_mappings)


class TreeSampler:
    """V1's `rejection_sampler` member: called as V1 calls it, it runs the round's `sample` with V1's
    own sampler for the chain rows; every other attribute is V1's sampler's (V1 reads some)."""

    def __init__(self, round_, original):
        self._round, self.original = round_, original

    def __call__(self, metadata, draft_probs, logits, sampling_metadata):
        def vllm_sample(lg):
            return self.original(metadata, draft_probs, lg, sampling_metadata)

        return self._round.sample(logits, V1Verify(metadata, sampling_metadata), vllm_sample)

    def __getattr__(self, name):
        return getattr(self.original, name)
