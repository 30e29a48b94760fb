"""Verify: this step's requests mapped to their trees (Pending -> Step), positions start + depth, the
tree metadata the attention and GDN templates read, and the target forward with the tree context."""

from __future__ import annotations

import time

import torch

from ...core.tree import TreeBatch, ancestor_closure, pack_bits
from ..tree_context import GdnVerify, TreeVerifyMetadata, tree_verify
from .step import Pending, RoundContext, Step


class VerifyStage:
    def __init__(self, ctx: RoundContext):
        self.ctx = ctx
        self.debug_gdn_records = False  # tests: record per-node GDN inputs (snapshots too) and pre-verify states
        self._records: dict = {}  # batch size R -> the GDN record buffers (allocated once, reused every step)
        N, dev = ctx.N, ctx.device
        parents = torch.arange(-1, N - 1, device=dev)
        self._chain = (parents, torch.arange(N, device=dev), pack_bits(ancestor_closure(parents.unsqueeze(0), N))[0])

    def prepare(self, pending: Pending | None, drafts: dict, num_scheduled_tokens) -> Step | None:
        """The tree step of this batch, or None (no drafts, or a whole-step chain fallback, counted)."""
        ctx = self.ctx
        if not drafts:
            return None
        reason = self._step_fallback(pending, drafts, num_scheduled_tokens)
        if reason is not None:
            ctx.metrics.chain_steps += 1
            ctx.metrics.fallback(reason)
            ctx.log_once("step:" + reason, "DDTree: steps verified as a plain chain (lossless) because of: "
                         "%s (logged once, counted in metrics)", reason)
            return None
        return self._make_step(pending)

    def _step_fallback(self, pending, drafts, num_scheduled_tokens) -> str | None:
        R = self.ctx.view.num_reqs()
        req_ids = self.ctx.view.req_ids(R)
        if len(drafts) != R or any(int(n) != self.ctx.N for n in num_scheduled_tokens[:R]):
            return "mixed batch (prefill or partial drafts next to trees)"
        if any(len(drafts.get(r, ())) != self.ctx.B for r in req_ids):
            return "drafts truncated by the scheduler"
        if pending is None:
            return "drafts not from a tree (drafter skipped)"
        if any(r not in pending.index for r in req_ids):
            return "request without a tree (resumed)"
        return None

    def _make_step(self, pending: Pending) -> Step:
        ctx = self.ctx
        R, N = ctx.view.num_reqs(), ctx.N
        rows_host = [pending.index[q] for q in ctx.view.req_ids(R)]
        rows = ctx.h2d(rows_host, torch.int64)
        t = pending.tree
        tree = TreeBatch(t.tokens[rows], t.parents[rows], t.depths[rows], t.scores[rows], t.num_nodes[rows],
                         t.ancestor_bits[rows], max_depth=ctx.max_depth)
        chain_rows = [pending.chain[i] is not None for i in rows_host]
        reasons = [pending.chain[i] for i in rows_host if pending.chain[i] is not None]
        for reason in set(reasons):
            ctx.metrics.fallback(reason, requests=reasons.count(reason))
            ctx.log_once("req:" + reason, "DDTree: requests using %s are verified as a flat DFlash chain "
                         "by vLLM's sampler (logged once, counted in metrics)", reason)
        tree_rows = ctx.h2d([not c for c in chain_rows], torch.bool)
        if any(chain_rows):
            cr = ~tree_rows
            parents, depths, bits = self._chain
            tree.parents = torch.where(cr.unsqueeze(1), parents, tree.parents)
            tree.depths = torch.where(cr.unsqueeze(1), depths, tree.depths)
            tree.ancestor_bits = torch.where(cr.view(R, 1, 1), bits, tree.ancestor_bits)
            tree.num_nodes = torch.where(cr, ctx.B, tree.num_nodes)
        flat = ctx.view.positions(R * N).view(R, N)
        start = flat[:, 0]
        positions = (start.unsqueeze(1) + tree.depths).to(flat.dtype).reshape(-1)
        meta = TreeVerifyMetadata(ancestor_bits=tree.ancestor_bits.contiguous(), depths=tree.depths,
                                  parents=tree.parents, context_lens=start.to(torch.int32))
        return Step(R, N, tree, tree_rows, chain_rows, pending.top1[rows], start, positions, meta,
                    t0=time.perf_counter())

    # -- the target forward -----------------------------------------------------------------------
    def forward(self, step: Step, original_forward, input_ids=None, positions=None, intermediate_tensors=None,
                inputs_embeds=None, **kw):
        T = step.R * step.N
        pos = positions.clone()
        pos[..., :T] = step.positions
        self._forward_metadata(step)
        with tree_verify(step.meta):
            out = original_forward(input_ids=input_ids, positions=pos, intermediate_tensors=intermediate_tensors,
                                   inputs_embeds=inputs_embeds, **kw)
        self._check_reached(step.meta.calls)
        self.ctx.metrics.add_time("verify", time.perf_counter() - step.t0)
        return out

    def _check_reached(self, calls: dict) -> None:
        """Every attention and GDN layer must have run its tree template (never a silent causal verify)."""
        ctx = self.ctx
        attn = sum(v for k, v in calls.items() if k.endswith("attention_with_output"))
        gdn = sum(v for k, v in calls.items() if "gdn_attention_core" in k)
        if attn != len(ctx.attn_layers) or gdn != len(ctx.gdn_layers):
            raise RuntimeError(
                f"DDTree: the tree verify reached {attn}/{len(ctx.attn_layers)} attention and {gdn}/"
                f"{len(ctx.gdn_layers)} GatedDeltaNet layers through the ddtree ops ({calls}); the graph was "
                f"not rewritten (is the tree-verify pass in compilation_config.inductor_passes?)")

    def _forward_metadata(self, step: Step) -> None:
        """Block tables of the attention groups, GDN state addressing: what the templates read."""
        ctx = self.ctx
        for gid, names in ctx.kv_groups.items():
            step.block_tables[gid] = ctx.view.block_table(names[0], step.R)
        if not ctx.hybrid:
            return
        # GDN layers sit in several KV cache groups, each with its own state lines: the templates
        # read each layer's addressing from its own metadata; the commit needs it per group.
        step.gdn_groups = {gid: ctx.view.gdn_spec_addressing(names[0], step.R)
                           for gid, names in ctx.gdn_groups.items()}
        gdn = GdnVerify(write_snapshots=ctx.cfg.gdn_state == "snapshots")
        if self.debug_gdn_records:  # tests: the committed states the verify starts from
            from ... import adapters
            from ...templates.tree_gdn_ref import committed_lines

            step.debug_pre = {}
            for gid, names in ctx.gdn_groups.items():
                lines = committed_lines(*step.gdn_groups[gid])
                for n in names:
                    ssm = adapters.current().gdn_state_views(ctx.layer(n))[1]
                    step.debug_pre[n] = ssm[lines].float().clone()
        if ctx.cfg.gdn_state == "replay" or self.debug_gdn_records:
            gdn.records, step.gdn_records = self._gdn_records(step.R, step.N)
        step.meta.gdn = gdn

    def _gdn_records(self, R, N):
        """Per-node k/v and g/beta buffers: {layer prefix: (rec_kv, rec_gb)} and {group: stacked}.

        One set per batch size, kept: the verify overwrites every row it commits from and the commit
        of the same step reads them, so no step allocates (static addresses, as CUDA graphs need)."""
        if R not in self._records:
            self._records[R] = self._alloc_gdn_records(R, N)
        return self._records[R]

    def _alloc_gdn_records(self, R, N):
        from ... import adapters

        ctx = self.ctx
        A = adapters.current()
        p = A.gdn_params(ctx.layer(ctx.gdn_layers[0]))
        per_layer, per_group = {}, {}
        for gid, names in ctx.gdn_groups.items():
            nl = len(names)
            rec_kv = torch.empty(nl, R, N, p.num_k_heads * p.head_k_dim + p.num_v_heads * p.head_v_dim,
                                 dtype=ctx.view.dtype, device=ctx.device)
            rec_gb = torch.empty(nl, R, N, 2, p.num_v_heads, dtype=torch.float32, device=ctx.device)
            per_group[gid] = (rec_kv, rec_gb)
            for i, n in enumerate(names):
                per_layer[A.gdn_params(ctx.layer(n)).prefix] = (rec_kv[i], rec_gb[i])
        return per_layer, per_group
