"""Build: the drafter's L positions -> per-depth logits -> `build_tree`; the scheduler gets the B nodes."""

from __future__ import annotations

import time

import torch

from ..build import build_tree
from .checks import unsupported_reason
from .step import Pending


class DraftStage:
    """Build stage of DDTreeState (state.py): wraps the drafter's propose / _sample_draft_tokens."""

    def _sample_draft_tokens(self, hidden_states, sampling_metadata):
        logits = self.runner.drafter.model.compute_logits(hidden_states)
        self._captured = logits
        return logits.argmax(dim=-1), None

    def _propose(self, num_speculative_tokens=None, **kw):
        t0 = time.perf_counter()
        self._captured = None
        self._orig["propose"](num_speculative_tokens=self.L, **kw)
        logits = self._captured
        self._captured = None
        R = kw["next_token_ids"].shape[0]
        logits = logits.view(R, self.L, -1)
        tree = build_tree(logits, self.spec).with_root(kw["next_token_ids"])
        top1 = logits.argmax(-1)
        req_ids = list(self.runner.input_batch.req_ids[:R])
        chain = [self._reason(r) for r in req_ids]
        drafts = tree.tokens[:, 1:]
        if any(chain):
            rows = self._h2d([c is not None for c in chain], torch.bool)
            # Flat DFlash's chain first, then the tree's other nodes (verified causally: waste).
            chained = torch.cat([top1, drafts], dim=1)[:, : self.B]
            drafts = torch.where(rows.unsqueeze(1), chained, drafts)
            tree.tokens[:, 1:] = drafts
        self.pending = Pending(req_ids, tree, top1, chain)
        self.metrics.add_time("build", time.perf_counter() - t0)
        return drafts

    def _reason(self, req_id: str) -> str | None:
        if req_id not in self._reasons:
            req = self.runner.requests.get(req_id)
            self._reasons[req_id] = unsupported_reason(getattr(req, "sampling_params", None))
            if len(self._reasons) > 4 * self.runner.max_num_reqs + 64:  # forget finished requests
                live = set(self.runner.requests)
                self._reasons = {k: v for k, v in self._reasons.items() if k in live}
                self._seeds = {k: v for k, v in self._seeds.items() if k in live}
        return self._reasons[req_id]

