"""Model Runner V2's driver of the round (vLLM 0.26 and 0.32, `vllm/v1/worker/gpu/`).

V2 builds, once in `load_model`, the objects its step calls wherever the round has work: the
speculator (V2's `DFlashSpeculator`), the model state (the class `init_model_state` chose: the
default one, `MambaHybridModelState` for hybrids, ...) and the rejection sampler; and the CUDA-graph
manager with the runner. The driver makes them DDTree's: each instance is re-typed as a subclass of
the class V2 built it from (the mixins below over it), same fields and buffers, whose overrides call
the round's phases (integration/round/state.py) at V2's own points (docs/runner_v2.md has the lines):

    model_state.add_request / remove_request  the requests' SamplingParams and prompts (V2 keeps neither on the host)
    model_state.prepare_attn       the step's attention metadata and CUDA-graph mode, recorded
    model_state.prepare_inputs     V2's; round.schedule; round.verify_begin(the positions the target gets)
      (the target forward: V2's own, eager, compiled, PIECEWISE or a FULL replay)
    rejection_sampler(...)         round.verify_end; round.sample -> V2's SamplerOutput
    model_state.postprocess_state  round.commit(V2's postprocess)
    speculator.propose             round.drafter_inputs; round.propose(V2's drafter, R, roots) -> drafts
      speculator._generate_draft     V2's drafter forward and its drafts, as V2 runs and captures it (a
                                     graph or eager): the logits -> round.drafter_topk -> top-1 drafts;
                                     a chain step's: V2's own greedy drafts (flat DFlash's drafting)
      speculator.query_cudagraph_manager, capture   the drafter's graphs per kind: the trees', the chain's
    cudagraph_manager.capture      FULL uniform-decode graphs captured with a tree verify (runner_v2.py)

Why re-typed and not declared: V2's declared hooks for these (`model.get_model_state_cls()`,
`model_state.custom_sampler()`) are read in `load_model`, before the KV caches exist and the round
attaches; the first also belongs to the model's class, which a plugin does not own.
"""

from __future__ import annotations

import torch

_TYPES: dict = {}  # (mixin, V2's class) -> the re-typed class


def retype(obj, mixin, **fields):
    """`obj`, an instance V2 built, becomes an instance of a subclass of its class with `mixin`'s
    methods (same fields and buffers; `fields` added). Returns obj. The subclass has V2's class as
    its only base (a second base would change the instance layout, which `__class__` assignment
    refuses); the mixins call V2's own methods through `vllm_class(self)`."""
    base = vllm_class(obj)
    cls = _TYPES.get((mixin, base))
    if cls is None:
        ns = {k: v for m in reversed(mixin.__mro__[:-1]) for k, v in vars(m).items()
              if k not in ("__dict__", "__weakref__")}
        ns.update(vllm_class=base, ddtree_mixin=mixin)
        cls = _TYPES[(mixin, base)] = type(f"{mixin.__name__}[{base.__name__}]", (base,), ns)
    obj.__class__ = cls
    obj.__dict__.update(fields)
    return obj


def vllm_class(obj) -> type:
    """The class V2 built `obj` from, re-typed or not."""
    return type(obj).__dict__.get("vllm_class", type(obj))


def retyped_as(obj, mixin) -> bool:
    return type(obj).__dict__.get("ddtree_mixin") is mixin


class V2Driver:
    def __init__(self, view, round_, draft_len: int):
        self.view, self.round, self.L = view, round_, draft_len
        self.r, self.s, self.shared = view.runner, view.speculator, view._shared
        r, s = self.r, self.s
        # The speculator drafts L positions from now on, its CUDA graphs too (re-made for 1 + L queries
        # per request before V2 captures them, `dflash/speculator.py:100-124`); the scheduler keeps
        # K = B draft slots. Where V2 samples the drafts (`_generate_draft`, inside its drafter graph)
        # the round takes their top-k; the L positions' hidden states are kept in `hidden` too, for
        # a test or benchmark drafter hook after a graph replay (`DDTreeSpeculator.propose`).
        s.num_speculative_steps, s.num_query_per_req = draft_len, 1 + draft_len
        # The drafter drafts L positions at every step, tree or chain: its graph manager must not take
        # budget "auto"'s per-batch-size draft counts (draft_schedule.py) as its query lengths (0.26
        # `cudagraph_utils.py:196-218` derives them from K, here 1 + L - K < 0: a capture of -30 requests).
        # Where vLLM's draft schedule gives steps the chain (budget "auto", a user's schedule that fits),
        # the drafter gets two sets of graphs (one graph pool): the tree steps' (the drafter, the top-k
        # of its logits, the trees) and the chain steps', flat DFlash's drafting (the drafter, V2's
        # greedy drafts); `DDTreeSpeculator.query_cudagraph_manager` is the next step's kind's.
        spec = r.vllm_config.speculative_config
        schedule, spec.num_speculative_tokens_per_batch_size = spec.num_speculative_tokens_per_batch_size, None
        mode = r.vllm_config.compilation_config.cudagraph_mode
        self.graphs: dict[bool, object] | None = None  # chain step? -> the drafter's graph manager
        try:
            s.init_cudagraph_manager(mode)
            if view.schedules_draft_counts():
                tree_graphs = s.query_cudagraph_manager
                s.init_cudagraph_manager(mode)
                self.graphs = {False: tree_graphs, True: s.query_cudagraph_manager}
        finally:
            spec.num_speculative_tokens_per_batch_size = schedule
        self.drafting_chain = False  # the drafter's forward now drafts a chain step (flat DFlash's drafting)
        self.hidden = torch.empty(r.max_num_reqs * draft_len, s.hidden_size, dtype=s.dtype, device=s.device)
        self.sampled = False  # _generate_draft's Python ran in this proposal (an eager drafter, not a graph replay)

    def install(self) -> None:
        r = self.r
        retype(r.model_state, DDTreeModelState, _ddtree=self, _ddtree_requests=self.shared)
        retype(self.s, DDTreeSpeculator, _ddtree=self)
        retype(r.rejection_sampler, DDTreeRejectionSampler, _ddtree=self)


class TrackedModelState:
    """V2's model state, keeping each live request's SamplingParams and prompt for the round (V2
    keeps neither on the host): `_ddtree_requests.requests`, req_id -> (SamplingParams, prompt ids)."""

    def add_request(self, req_index: int, new_req_data) -> None:
        vllm_class(self).add_request(self, req_index, new_req_data)
        self._ddtree_requests.requests[new_req_data.req_id] = (new_req_data.sampling_params,
                                                               prompt_ids_of(new_req_data))

    def remove_request(self, req_id: str) -> None:
        self._ddtree_requests.requests.pop(req_id, None)
        vllm_class(self).remove_request(self, req_id)


class DDTreeModelState(TrackedModelState):
    def prepare_attn(self, input_batch, cudagraph_mode, *args, **kw):
        """(0.26 `model_runner.py:1257`, 0.32 `:1915`: the step's CUDA-graph mode is the second argument)"""
        shared = self._ddtree.shared
        shared.cg_mode = (input_batch, cudagraph_mode)  # (a capture prepares dummy batches here too)
        shared.attn_metadata = vllm_class(self).prepare_attn(self, input_batch, cudagraph_mode, *args, **kw)
        return shared.attn_metadata

    def prepare_inputs(self, input_batch, req_states):
        """The last call before the target forward in all its forms (0.26 `model_runner.py:1300`, 0.32
        `:1966`): the round's verify of the step is set here, on the positions tensor the target gets
        (V2's rope state's with M-RoPE, else the batch's)."""
        d = self._ddtree
        d.shared.batch = input_batch
        out = vllm_class(self).prepare_inputs(self, input_batch, req_states)
        d.round.schedule(d.view.scheduled_drafts(input_batch), input_batch.num_scheduled_tokens)
        d.round.verify_begin(out.get("positions", input_batch.positions))
        return out

    def prepare_dummy_inputs(self, num_reqs: int, num_tokens: int):
        """V2's graph capture prepares each descriptor here: its request count for the tree context."""
        self._ddtree.shared.capture_reqs = num_reqs
        return vllm_class(self).prepare_dummy_inputs(self, num_reqs, num_tokens)

    def postprocess_state(self, *args, **kw):
        """The round's commit (K/V, GDN state in vLLM's chain layout), then V2's postprocess: accepted
        counts from the sampled tokens and, with prefix caching, align's block-boundary copies, which
        read the state the commit left."""
        return self._ddtree.round.commit(lambda: vllm_class(self).postprocess_state(self, *args, **kw))


class DDTreeSpeculator:
    def propose(self, input_batch, attn_metadata, slot_mappings, last_hidden_states, aux_hidden_states,
                num_sampled, num_rejected, last_sampled, next_prefill_tokens, *args, **kw):
        call = (input_batch, attn_metadata, slot_mappings, last_hidden_states, aux_hidden_states, num_sampled,
                num_rejected, last_sampled, next_prefill_tokens, *args)
        if kw.get("dummy_run"):
            return vllm_class(self).propose(self, *call, **kw)
        d = self._ddtree
        d.shared.batch = input_batch
        # the round committed in V2's postprocess_state (this call is a no-op then; a V2 step that
        # skipped that postprocess commits here); the drafter's inputs of the tree step are reordered,
        # accepted path first
        d.round.commit(lambda: None)
        d.round.drafter_inputs([last_hidden_states, *(aux_hidden_states or ())])
        R, drafts, hooked = input_batch.num_reqs, [], []

        def run_drafter(chain: bool):  # V2's drafter: its graph or eager forward, its drafts (and their top-k)
            d.sampled, d.drafting_chain = False, chain
            try:
                drafts.append(vllm_class(self).propose(self, *call, **kw))  # (draft_tokens[:R])
            finally:
                d.drafting_chain = False
            if d.sampled:  # (no graph replayed the drafter)
                d.round.metrics.drafter_eager["chain" if chain else "tree"] += 1
            if not d.sampled and d.view.drafter_hooked():
                hooked.append(True)
                # a test or benchmark drafter hook (eager Python: a graph replay skipped it), after the
                # graph: on a chain step its drafts as it rewrites flat DFlash's (the benchmark oracle:
                # the same work as for flat's step); else its own top-k lists where it has them (no
                # [R * L, V] logits), else its logits' (of the hidden states the last tree step's graph
                # kept, after a chain step's: the test harness, the one hook without lists, reads none)
                flat = d.view.drafter_hook_flat() if chain else None
                if flat is not None:
                    flat(drafts[0][:, : d.L])
                    return
                fn = d.view.drafter_hook_topk()
                top1 = d.round.hook_topk(fn, R) if fn is not None else None
                if top1 is None:
                    top1 = d.round.drafter_topk(d.view.drafter_compute_logits(d.hidden[: R * d.L]))
                drafts[0][:, : d.L] = top1.view(R, d.L)
                if not chain:
                    d.round.drafter_tree(R, bonus_tokens(self, R))  # (its trees, from the hook's lists)

        proposal = d.round.propose(run_drafter, R, lambda: bonus_tokens(self, R))
        # (a chain step's drafts are V2's, in place; a tree step's too where `_generate_draft` wrote the
        # trees it built there and no hook rewrote the drafts after the graph)
        if not proposal.chain and not (proposal.built_by_drafter and not hooked):
            drafts[0][:, : proposal.drafts.shape[1]] = proposal.drafts
        return drafts[0]

    @property
    def query_cudagraph_manager(self):
        """The drafter's graph manager V2's `propose` replays (and `capture` fills): the next step's
        kind's where the drafter has chain graphs too (V2Driver), else V2's own."""
        d = self._ddtree
        return d.graphs[d.drafting_chain] if d.graphs else self.__dict__["query_cudagraph_manager"]

    def capture(self):
        """V2's capture of the drafter's graphs (0.26 `dflash/speculator.py:126`, 0.32 `:166`), once per
        set: the tree steps', then, where there are chain steps, flat DFlash's (`_generate_draft`)."""
        d = self._ddtree
        for chain in (False, True) if d.graphs else (False,):
            d.drafting_chain = chain
            try:
                vllm_class(self).capture(self)
            finally:
                d.drafting_chain = False

    def _generate_draft(self, num_reqs, num_tokens_padded, attn_metadata, slot_mappings, num_tokens_across_dp,
                        cudagraph_runtime_mode=None):
        """The speculator's forward and drafts as V2 runs and captures them (0.26 `dflash/speculator.py:233`,
        0.32 `:282`; a FULL graph or eager): the drafter, then its L sampled positions' LM head once,
        the round's top-k of those logits (`drafter_topk`) and the round's trees (`drafter_tree`, fixed
        buffers), whose node tokens go to `draft_tokens` (where the trees are built after the graph, the
        top-1, V2's greedy drafts: the argmax, same tie rule). V2's own writes all K draft columns; a
        probabilistic draft method's sampled drafts are not made (the chain rows are verified one-hot:
        any drafts are lossless). A chain step's drafting (`drafting_chain`, its own graphs) is flat
        DFlash's, below."""
        d = self._ddtree
        d.sampled = True
        run = (num_tokens_padded, attn_metadata, slot_mappings, num_tokens_across_dp)
        out = self._run_model(*run) if cudagraph_runtime_mode is None else self._run_model(*run, cudagraph_runtime_mode)
        n = num_reqs * d.L
        if d.drafting_chain:
            # a chain step: flat DFlash's drafting, V2's greedy drafts (`sample_draft` without draft
            # logits: the LM head and its argmax, or V2's vocabulary-local argmax; the positions are
            # read only for sampled drafts), and no top-k, no tree, no hidden states kept
            drafts = self.sample_draft(out[self.sample_indices[:n]], self.sample_pos[:n], self.sample_idx_mapping[:n],
                                       self.temperature, self.seeds, self.sample_col[:n], None)
            self.draft_tokens[:num_reqs, : d.L] = drafts.view(num_reqs, d.L)
            return
        hidden = out[self.sample_indices[:n]]
        d.hidden[:n].copy_(hidden)
        top1 = d.round.drafter_topk(self.model.compute_logits(hidden))
        trees = d.round.drafter_tree(num_reqs, bonus_tokens(self, num_reqs))
        if trees is None or trees.shape[1] < d.L:
            self.draft_tokens[:num_reqs, : d.L] = top1.view(num_reqs, d.L)
        if trees is not None:  # the trees' node tokens: a tree step's drafts (a bucket's: the first b)
            self.draft_tokens[:num_reqs, : trees.shape[1]] = trees


class DDTreeRejectionSampler:
    def __call__(self, logits, input_batch, draft_logits=None, *rest):
        """(0.26: three arguments; 0.32: and `invalid_drafts`.) Chain rows go to V2's own sampler with
        one-hot drafts (draft_logits None): the drafts are the tree's tokens, not samples of the
        drafter's distribution, so rejection against that distribution would not be lossless."""
        d = self._ddtree
        d.round.verify_end()  # the verify's forward ran: its logits are here
        d.shared.batch = input_batch

        def vllm_sample(lg):
            return vllm_class(self).__call__(self, lg, input_batch, None, *rest)

        return d.round.sample(logits, input_batch, vllm_sample)


class FlatOracleSpeculator:
    """vLLM's own flat DFlash, its drafts rewritten in place after each proposal by `_ddtree_oracle(drafts)`
    (benchmark oracles: runner_v2.V2RunnerView.wrap_flat_drafts)."""

    def propose(self, input_batch, *args, **kw):
        drafts = vllm_class(self).propose(self, input_batch, *args, **kw)
        if not kw.get("dummy_run"):
            self._ddtree_shared.batch = input_batch
            self._ddtree_oracle(drafts)
        return drafts


class TreeCaptureManager:
    """V2's CUDA-graph manager, capturing with the model inside `_CaptureModel` (install_graph_capture)."""

    def capture(self, model, *args, **kw):
        capture, shared, query_len = self._ddtree_capture
        shared.capture_reqs = None  # (set by each descriptor's prepare_dummy_inputs)
        try:
            return vllm_class(self).capture(self, _CaptureModel(model, capture, shared, query_len), *args, **kw)
        finally:
            shared.capture_reqs = None


class _CaptureModel(torch.nn.Module):
    """The model as V2's graph capture calls it: a FULL descriptor's warm-up and capture forwards
    (attention metadata set, runtime mode NONE) run inside the round's tree context of that size.
    A module holding the model, so V2's reads of its submodules (0.32 `has_compiled_submodule`) see them."""

    def __init__(self, model, capture, shared, query_len: int):
        super().__init__()
        self.model = model
        self._capture, self._shared, self._q = capture, shared, query_len

    def forward(self, **inputs):
        from vllm.forward_context import get_forward_context

        fc = get_forward_context()
        cm = None
        if fc.attn_metadata is not None and fc.cudagraph_runtime_mode.name == "NONE":
            ids = inputs.get("input_ids")
            tokens = ids.shape[0] if ids is not None else inputs["positions"].shape[-1]
            # the descriptor's requests (prepare_dummy_inputs); a capture that passed none: V2's own length
            reqs = self._shared.capture_reqs or max(tokens // self._q, 1)
            cm = self._capture(tokens, reqs, torch.cuda.is_current_stream_capturing())
        if cm is None:
            return self.model(**inputs)
        with cm:
            return self.model(**inputs)


def bonus_tokens(speculator, R: int) -> torch.Tensor:
    """[R] each request's bonus token: the first of its 1 + L query tokens in the drafter's inputs
    (0.26 and 0.32 `_prepare_dflash_inputs_kernel`: query block r at r * (1 + L), the bonus first)."""
    q = speculator.num_query_per_req
    return speculator.input_buffers.input_ids[: R * q].view(R, q)[:, 0]


def prompt_ids_of(new_req_data) -> list[int]:
    """The prompt of a new request (0.26 sends prompt_token_ids; 0.32 prompt_len + prefill ids)."""
    ids = getattr(new_req_data, "prompt_token_ids", None)
    if ids is not None:
        return list(ids)
    return list(new_req_data.prefill_token_ids[: new_req_data.prompt_len])
