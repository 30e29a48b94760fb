"""Build: the drafter's L positions -> their logits (vLLM's LM head) -> per-position top-k, where vLLM
samples the drafts (`drafter_topk`: inside the drafter's CUDA graph on Model Runner V2; its top-1 are
flat DFlash's drafts) -> `build_tree` -> Pending; the scheduler gets the node tokens of this step's
bucket (B, or with budget "auto" the menu's choice: a prefix of the B-node tree) as the request's
drafts, or on a chain step the drafter's top-1 as they are."""

from __future__ import annotations

import time

import torch

from ...core.build import build_tree, topk_of
from ...core.dispatch import use_triton
from ...core.tree import TreeBatch, num_mask_words
from ..metrics import logger
from .auto_budget import CHAIN, TREE, tree_kind
from .step import Pending, Proposal, RoundContext

_WARM_BYTES = 1 << 30  # the largest dummy logits the warm-up allocates (once, freed after)


class BuildStage:
    def __init__(self, ctx: RoundContext):
        self.ctx = ctx
        R, k = ctx.view.max_num_reqs, min(ctx.spec.top_k, ctx.spec.budget)
        # the drafter's top-k per position ([max requests, L, k]: log-probs fp32, token ids), written by
        # `drafter_topk` at fixed addresses (a drafter CUDA graph writes them on every replay)
        self.topk_lp = torch.zeros(R, ctx.L, k, dtype=torch.float32, device=ctx.device)
        self.topk_ids = torch.zeros(R, ctx.L, k, dtype=torch.int64, device=ctx.device)
        self._logits_like: tuple | None = None  # (dtype, vocabulary, row pitch) of the drafter's logits (warm-up)
        self._warmed = False
        # the B-node trees of the last proposal where the runner's drafter builds them (`drafter_tree`: on
        # Model Runner V2 inside the drafter's CUDA graph), at fixed addresses; on CUDA where the Triton
        # build serves the shape (made for a capture: its scratch exists before; else `propose` builds them)
        # and (budget "auto") each smaller bucket's prefix of them, copied there in the same graph, so that
        # every bucket's tree is at fixed addresses (the walk's graph reads them in place: walk_stage.py)
        depth = ctx.spec.depth_limit(ctx.L)
        self._trees = _tree_buffers(R, ctx.spec.budget, depth, ctx.device)
        self._buckets = {b: _tree_buffers(R, b, min(depth, b), ctx.device) for b in ctx.menu if b < ctx.spec.budget}
        self._in_drafter = ctx.device.type != "cuda" or use_triton(
            self.topk_lp, "auto", "tree_build", (ctx.spec.budget, k, ctx.spec.depth_limit(ctx.L)))
        self._drafter_builds = False  # the drafter built the trees (drafter_tree ran: at a capture or eagerly)

    def drafter_topk(self, logits: torch.Tensor) -> torch.Tensor:
        """Where vLLM samples the drafts from the drafter's logits [R * L, V] (its LM head's, once): their
        top-k per position into `topk_lp` / `topk_ids`, their top-1 [R * L] handed back (the argmax:
        both rank (logit desc, id asc)), which are flat DFlash's drafts. Device work only: on Model
        Runner V2 it runs inside the drafter's CUDA graph."""
        ctx = self.ctx
        R = logits.shape[0] // ctx.L
        lg = logits.view(R, ctx.L, -1)
        if self._logits_like is None:
            self._logits_like = (lg.dtype, lg.shape[-1], lg.stride(1) if lg.stride(2) == 1 else lg.shape[-1])
        topk_of(lg, ctx.spec, out=(self.topk_lp[:R], self.topk_ids[:R]))
        return self.topk_ids[:R, :, 0].reshape(-1)

    def drafter_tree(self, R: int, roots: torch.Tensor) -> torch.Tensor | None:
        """After `drafter_topk` (or a hook's lists after a graph): the B-node trees of the R requests,
        rooted at `roots` [R] (their bonus tokens), into fixed buffers. Device work only: on Model
        Runner V2 inside the drafter's CUDA graph, as flat DFlash's drafts are made there. -> [R, B]
        their node tokens (a view; every bucket b's drafts are the first b columns: TreeBatch.prefix),
        for the drafter to write where it writes its drafts; None where the trees are built after the
        drafter (`propose`)."""
        if not self._in_drafter:
            return None
        lp, ids = self._topk_to_depth(R)
        tree = build_tree((lp, ids), self.ctx.spec, out=self._trees_of(R)).with_root(roots)
        for b in self._buckets:
            tree.prefix(b, out=self._trees_of(R, b))
        self._drafter_builds = True
        return tree.tokens[:, 1:]

    def fixed_trees(self, N: int) -> TreeBatch | None:
        """The fixed buffers (every request's row) the drafter builds the trees of N slots into (a menu
        bucket's, or the largest), or None where no drafter builds them (`drafter_tree`: not reached
        on this runner, or no such bucket)."""
        if not self._in_drafter or N - 1 not in (self.ctx.spec.budget, *self._buckets):
            return None
        return self._trees_of(self.ctx.view.max_num_reqs, N - 1)

    def _trees_of(self, R: int, budget: int | None = None) -> TreeBatch:
        """The first R rows of the fixed buffers of the B-node trees, or of a smaller bucket's."""
        t = self._trees if budget in (None, self.ctx.B) else self._buckets[budget]
        return TreeBatch(t.tokens[:R], t.parents[:R], t.depths[:R], t.scores[:R], t.num_nodes[:R],
                         t.ancestor_bits[:R], max_depth=t.max_depth)

    def _topk_to_depth(self, R: int) -> tuple[torch.Tensor, torch.Tensor]:
        depth = self.ctx.spec.depth_limit(self.ctx.L)
        lp, ids = self.topk_lp[:R, :depth], self.topk_ids[:R, :depth]
        if depth < self.ctx.L:  # (rows past the depth limit are never used; the kernels read rows contiguously)
            lp, ids = lp.contiguous(), ids.contiguous()
        return lp, ids

    def hook_topk(self, fn, R: int) -> torch.Tensor | None:
        """A drafter hook's own top-k lists in place of its logits' (`drafter_topk`), where a drafter
        graph replayed past the hook: fn(R, L, k, temperature, V, dtype, device) -> (log-probs fp32,
        ids int64) [R, L, k] as `topk_of` would rank the logits it stands for, or None. -> their
        top-1 [R * L], or None (the hook has none: its logits then)."""
        if self._logits_like is None:  # (set by the drafter's first top-k: its capture or warm-up)
            return None
        dtype, V, _ = self._logits_like
        got = fn(R, self.ctx.L, self.topk_ids.shape[-1], self.ctx.spec.temperature, V, dtype, self.ctx.device)
        if got is None:
            return None
        self.topk_lp[:R].copy_(got[0])
        self.topk_ids[:R].copy_(got[1])
        return self.topk_ids[:R, :, 0].reshape(-1)

    def propose(self, run_drafter, R: int, roots) -> tuple[Proposal, Pending]:
        """`run_drafter(chain)` runs vLLM's drafter for L positions of R requests (on a tree step its
        logits reach `drafter_topk` on the way; a chain step may draft as flat DFlash does: Model
        Runner V2); `roots()` -> [R] the requests' bonus tokens (read only where the drafter did not
        build the trees: `drafter_tree`).
        Builds the trees; returns (Proposal, Pending): the drafts [R, b] of the step's bucket of b
        nodes, or where budget "auto" or the scheduler's draft count takes the chain, none: vLLM's
        drafter sampled them, the top-1 (Proposal.chain; no tensor work here)."""
        ctx = self.ctx
        t0 = time.perf_counter()
        kind, req_ids = TREE, ctx.view.req_ids(R)
        if ctx.auto is not None:
            ctx.auto.step_ended(t0)
            kind = ctx.auto.choose(R, seeded=any(ctx.own_seed(q) for q in req_ids))
        kind = self._scheduled(kind, R)
        t_draft = time.perf_counter()
        run_drafter(kind == CHAIN)
        draft_s = time.perf_counter() - t_draft  # vLLM's drafter, flat DFlash's work too: not "build"
        if not self._warmed:
            self._warm_up()
        if kind == CHAIN:  # flat DFlash's drafts, verified by vLLM: no tree built, flat's own work
            self._done(kind, R, t0, draft_s)
            return Proposal(None, chain=True), Pending(req_ids, None, None, [None] * R, auto_chain=True)
        top1 = self.topk_ids[:R, :, 0]  # [R, L] (a view: the next proposal rewrites it, after this step's walk)
        chain = [ctx.chain_reason(r) for r in req_ids]
        budget = ctx.B if ctx.auto is None else ctx.auto.budget_of(kind)
        if self._drafter_builds:  # built with the drafts (drafter_tree; views the next proposal rewrites)
            tree = self._trees_of(R, budget)
        else:
            tree = build_tree(self._topk_to_depth(R), ctx.spec).with_root(roots())
            if budget < ctx.B:
                tree = tree.prefix(budget)
        drafts = tree.tokens[:, 1:]
        if any(chain):
            rows = ctx.h2d([c is not None for c in chain], torch.bool)
            # Flat DFlash's chain first, then the tree's other nodes (verified causally: waste).
            chained = torch.cat([top1, drafts], dim=1)[:, :budget]
            drafts = torch.where(rows.unsqueeze(1), chained, drafts)
            tree.tokens[:, 1:] = drafts
        self._done(kind, R, t0, draft_s)
        built = self._drafter_builds and not any(chain)  # (the drafter's trees as it wrote them)
        return (Proposal(drafts, chain=False, built_by_drafter=built),
                Pending(req_ids, tree, top1, chain, fixed=self._drafter_builds))

    def _scheduled(self, kind: str, R: int) -> str:
        """Where the scheduler decides the next step's draft count (Model Runner V2 under async
        scheduling, adapters/draft_schedule.py), budget "auto"'s choice goes to its schedule for the
        steps after, and this proposal follows what it already gave the next step (budget "auto"'s
        schedule, or a user's whose counts fit: draft_schedule.runs_draft_schedule): L drafts the
        chain, b drafts the tree bucket of b nodes (no bucket has L nodes there: auto_setup.serveable_menu)."""
        ctx, k = self.ctx, self.ctx.view.next_draft_count()
        if k is None:
            return kind
        auto = ctx.auto
        if auto is not None and not ctx.view.choose_draft_count(R, auto.drafts[kind]):
            ctx.log_once("auto:schedule", "DDTree: budget \"auto\" found no scheduler in this process (its workers "
                         "run apart: tensor parallel); every step verifies what vLLM schedules (logged once)")
        if k == ctx.L:
            return CHAIN
        if k in ctx.menu:
            return tree_kind(k, ctx.B)
        ctx.log_once(f"auto:count:{k}", "DDTree: the scheduler gave a step %d drafts, neither the chain's %d nor a "
                     "bucket of %s: the largest tree is proposed (the verify falls back to a chain, counted)",
                     k, ctx.L, "/".join(map(str, ctx.menu)))
        return TREE

    def _warm_up(self) -> None:
        """Once, at the first proposal on CUDA: the top-k kernel's variants of every batch size (of
        all L positions, as `drafter_topk` calls it) and the tree build's compiled now
        (templates/draft_topk.variant_batches), not at the first step of a batch size not seen before,
        where a compile costs that step ~0.3-1 s (a drafter CUDA graph's batch sizes were compiled at
        its capture; an eager drafter's were not). Dummy logits of the real dtype, vocabulary and row
        pitch, sliced from one buffer."""
        from ...templates.draft_topk import variant_batches

        self._warmed = True
        ctx = self.ctx
        if ctx.device.type != "cuda" or self._logits_like is None:
            return
        t0 = time.perf_counter()
        dtype, V, width = self._logits_like
        L = ctx.L
        sizes = variant_batches(ctx.view.max_num_reqs, L, V, ctx.device)
        row_bytes = L * max(width, V) * dtype.itemsize
        skipped = [r for r in sizes if r * row_bytes > _WARM_BYTES]
        sizes = [r for r in sizes if r * row_bytes <= _WARM_BYTES]
        if sizes:
            buf = torch.zeros(max(sizes), L, max(width, V), dtype=dtype, device=ctx.device)[..., :V]
            lp, ids = torch.empty_like(self.topk_lp), torch.empty_like(self.topk_ids)
            depth = ctx.spec.depth_limit(L)
            for r in sizes:
                topk_of(buf[:r], ctx.spec, out=(lp[:r], ids[:r]))
                build_tree((lp[:r, :depth].contiguous(), ids[:r, :depth].contiguous()), ctx.spec)
            del buf
        logger.info("DDTree: tree build warmed up for batch sizes %s (one per top-k kernel variant) in %.2f s%s",
                    sizes, time.perf_counter() - t0,
                    f"; not {skipped} (dummy logits over {_WARM_BYTES >> 20} MiB)" if skipped else "")

    def _done(self, kind: str, R: int, t0: float, draft_s: float) -> None:
        """The proposal's host time in two phases: "draft" (the drafter's forward, its logits and their
        top-k, where vLLM samples its drafts) and "build" (DDTree's own: the policy, the tree)."""
        t1 = time.perf_counter()
        self.ctx.metrics.add_time("draft", draft_s)
        self.ctx.metrics.add_time("build", t1 - t0 - draft_s)
        if self.ctx.auto is not None:
            self.ctx.auto.proposed(kind, R, t0, t1)


def _tree_buffers(R: int, budget: int, max_depth: int, device) -> TreeBatch:
    """Zeroed buffers of R trees of `budget` nodes (budget + 1 slots)."""
    N, i64 = budget + 1, dict(dtype=torch.int64, device=device)
    return TreeBatch(torch.zeros(R, N, **i64), torch.zeros(R, N, **i64), torch.zeros(R, N, **i64),
                     torch.zeros(R, N, dtype=torch.float32, device=device), torch.zeros(R, **i64),
                     torch.zeros(R, N, num_mask_words(N), dtype=torch.int32, device=device), max_depth=max_depth)
