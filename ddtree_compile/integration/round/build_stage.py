"""Build: the drafter's L positions -> per-depth logits -> `build_tree` -> Pending; the scheduler
gets the node tokens of this step's bucket (B, or with budget "auto" the menu's choice: a prefix of
the B-node tree) as the request's drafts."""

from __future__ import annotations

import time

import torch

from ...core.build import build_tree
from ..metrics import logger
from .auto_budget import CHAIN, TREE, tree_kind
from .step import Pending, RoundContext

_WARM_BYTES = 1 << 30  # the largest dummy logits the warm-up allocates (once, freed after)


class BuildStage:
    def __init__(self, ctx: RoundContext):
        self.ctx = ctx
        self._captured: tuple | None = None  # (drafter logits [R*L, V], their argmax [R*L])
        self._warmed = False

    def drafter_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Stands in for the drafter's own sampling: hidden_states [R * L, H] -> logits kept, their
        argmax [R * L] handed back."""
        logits = self.ctx.view.drafter_compute_logits(hidden_states)
        top1 = logits.argmax(dim=-1)
        self._captured = (logits, top1)  # propose reuses the argmax (one read of [R*L, V] logits, not two)
        return top1

    def propose(self, run_drafter, roots: torch.Tensor) -> tuple[torch.Tensor, Pending]:
        """`run_drafter()` runs vLLM's drafter for L positions (its hidden states reach
        `drafter_logits`); roots [R] are the requests' bonus tokens. Builds the trees; returns (drafts
        [R, b], Pending) for the step's bucket of b nodes, or where budget "auto" or the scheduler's
        draft count takes the chain (drafts [R, L] = the drafter's top-1 chain, Pending)."""
        ctx = self.ctx
        t0 = time.perf_counter()
        R = roots.shape[0]
        kind = TREE
        if ctx.auto is not None:
            ctx.auto.step_ended(t0)
            kind = ctx.auto.choose(R)
        kind = self._scheduled(kind, R)
        self._captured = None
        t_draft = time.perf_counter()
        run_drafter()
        draft_s = time.perf_counter() - t_draft  # vLLM's drafter, flat DFlash's work too: not "build"
        (logits, top1), self._captured = self._captured, None
        logits, top1 = logits.view(R, ctx.L, -1), top1.view(R, ctx.L)
        if not self._warmed:
            self._warm_up(logits)
        req_ids = ctx.view.req_ids(R)
        if kind == CHAIN:  # flat DFlash's drafts, verified by vLLM: no tree built, flat's own work
            self._done(kind, R, t0, draft_s)
            return top1, Pending(req_ids, None, top1, [None] * R, auto_chain=True)
        chain = [ctx.chain_reason(r) for r in req_ids]
        tree = build_tree(logits, ctx.spec).with_root(roots)
        budget = ctx.B if ctx.auto is None else ctx.auto.budget_of(kind)
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
        return drafts, Pending(req_ids, tree, top1, chain)

    def _scheduled(self, kind: str, R: int) -> str:
        """Where the scheduler decides the next step's draft count (Model Runner V2 under async
        scheduling, adapters/draft_schedule.py), budget "auto"'s choice goes to its schedule for the
        steps after, and this proposal follows what it already gave the next step (budget "auto"'s
        schedule, or a user's whose counts fit: draft_schedule.runs_draft_schedule): L drafts the
        chain, b drafts the tree bucket of b nodes (no bucket has L nodes there: auto_budget.serveable_menu)."""
        ctx, k = self.ctx, self.ctx.view.next_draft_count()
        if k is None:
            return kind
        auto = ctx.auto
        if auto is not None and not ctx.view.choose_draft_count(R, ctx.L if kind == CHAIN else auto.budget_of(kind)):
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

    def _warm_up(self, logits: torch.Tensor) -> None:
        """Once, at the first proposal on CUDA: the top-k kernel's variants of every batch size
        compiled now (templates/draft_topk.variant_batches), not at the first step of a batch size
        not seen before, where a compile costs that step ~0.3-1 s. Dummy logits of the real dtype,
        vocabulary and row pitch, sliced from one buffer."""
        from ...templates.draft_topk import variant_batches

        self._warmed = True
        ctx = self.ctx
        if logits.device.type != "cuda":
            return
        t0 = time.perf_counter()
        _, L, V = logits.shape
        sizes = variant_batches(ctx.view.max_num_reqs, ctx.spec.depth_limit(L), V, logits.device)
        width = logits.stride(1) if logits.stride(2) == 1 and logits.stride(1) >= V else V  # the real row pitch
        row_bytes = L * width * logits.element_size()
        skipped = [r for r in sizes if r * row_bytes > _WARM_BYTES]
        sizes = [r for r in sizes if r * row_bytes <= _WARM_BYTES]
        if sizes:
            buf = torch.zeros(max(sizes), L, width, dtype=logits.dtype, device=logits.device)[..., :V]
            for r in sizes:
                build_tree(buf[:r], ctx.spec)
            del buf
        logger.info("DDTree: tree build warmed up for batch sizes %s (one per top-k kernel variant) in %.2f s%s",
                    sizes, time.perf_counter() - t0,
                    f"; not {skipped} (dummy logits over {_WARM_BYTES >> 20} MiB)" if skipped else "")

    def _done(self, kind: str, R: int, t0: float, draft_s: float) -> None:
        """The proposal's host time in two phases: "draft" (the drafter's forward and its logits, as vLLM
        runs them) and "build" (DDTree's own: the policy, the top-k, the tree)."""
        t1 = time.perf_counter()
        self.ctx.metrics.add_time("draft", draft_s)
        self.ctx.metrics.add_time("build", t1 - t0 - draft_s)
        if self.ctx.auto is not None:
            self.ctx.auto.proposed(kind, R, t0, t1)
