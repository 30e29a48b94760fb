"""Walk: the target's token at every node (argmax, or seeded sampling), `walk_tree`, and the accepted
path + bonus handed to vLLM as an ordinary accepted prefix."""

from __future__ import annotations

import time

import torch

from ...core.sampling import sample_target_tokens
from ...core.tree import TreeBatch, WalkResult, ancestor_closure, pack_bits
from ...core.walk import drafter_order, walk_tree
from .stage_graphs import StageGraphs
from .step import RoundContext, Step


class WalkStage:
    """Serves runner.rejection_sampler: tree steps are walked here, chain steps go to vLLM's sampler."""

    def __init__(self, ctx: RoundContext):
        self.ctx = ctx
        # budget "auto"'s smaller buckets (ctx.menu is final once the stages exist), on the device once
        smaller = ctx.menu[:-1]
        self._smaller = torch.tensor(smaller, device=ctx.device).view(-1, 1, 1) if smaller else None
        # the greedy all-tree step's device work (walk kernel, padding, metrics) as one graph per shape
        self.graphs = StageGraphs(ctx, "walk", ctx.cfg.round_graphs)
        self._target = torch.zeros(ctx.view.max_num_reqs * ctx.N, dtype=torch.int64, device=ctx.device)  # argmax

    def sample(self, step: Step | None, vllm_sample, batch, logits):
        """The sampled tokens of the step ([path tokens, bonus, -1...] per request); fills step.walk.
        `vllm_sample(logits)`: vLLM's rejection sampler on the step's drafts; `batch`: the step's
        verify inputs as the runner's driver hands them (the view reads them)."""
        if step is None:
            return self._sample_chain_step(vllm_sample, batch, logits)
        ctx = self.ctx
        t0 = time.perf_counter()
        R, N = step.R, step.N
        chain_out = None
        if not step.has_tree:  # a whole-step fallback (FULL graphs): as _sample_chain_step would
            chain_out = self._sample_chain_step(vllm_sample, batch, logits.clone())
        elif any(step.chain_rows):
            chain_out = vllm_sample(logits.clone())
        logits3 = logits[: R * N].view(R, N, -1)
        temp = ctx.view.sampling_temperature(batch)
        if temp is None and chain_out is None:  # the usual step: greedy, every row a tree
            t = step.tree
            target = torch.argmax(logits3, -1, out=self._target[: R * N].view(R, N))
            tree = {"tokens": t.tokens, "parents": t.parents, "depths": t.depths, "num_nodes": t.num_nodes,
                    "ancestor_bits": t.ancestor_bits, "top1": step.top1, "tree_rows": step.tree_rows}
            # a tree at fixed addresses (built in the drafter's graph) is read in place: nothing to copy
            copied, fixed = ({}, tree) if step.fixed else (tree, {})
            fixed |= {"target": target, **ctx.metrics.device_counters()}
            # the outputs are the graph's own buffers: read by this step's commit, drafter and vLLM's
            # bookkeeping, all before the next step's walk replays the graph
            step.walk, tokens, counts = self.graphs.run(self._greedy_walk, copied, fixed)
            step.walk_fixed = self.graphs.replayed
            ctx.metrics.add_time("walk", time.perf_counter() - t0)
            return ctx.view.sampler_output(tokens, None, counts)
        if temp is None:
            target = logits3.argmax(-1)
        else:
            seeds = ctx.h2d([ctx.seed(q) for q in ctx.view.req_ids(R)], torch.int64)
            target = sample_target_tokens(logits3, temp[:R], seeds, step.positions() + 1)
        walk = walk_tree(step.tree, target, top1=step.top1)
        W = walk.accepted.shape[1]
        tokens = _pad_cols(walk.tokens, N)
        accepted, num_acc, order = walk.accepted, walk.num_accepted, walk.order
        if chain_out is not None:
            cr = ~step.tree_rows
            c_tok = ctx.view.sampled_tokens(chain_out)[0]
            tokens = torch.where(cr.unsqueeze(1), _pad_cols(c_tok.to(tokens.dtype), N), tokens)
            c_num = (c_tok != -1).sum(1)  # accepted drafts + 1 = path length including the root
            idx = torch.arange(W, device=ctx.device).expand(R, W)
            c_path = torch.where(idx < c_num.unsqueeze(1), idx, -1)
            accepted = torch.where(cr.unsqueeze(1), c_path, accepted)
            num_acc = torch.where(cr, c_num, num_acc)
            order = drafter_order(accepted, N)  # with the chain rows' paths
        # off_chain: the walk's (the metrics count tree rows only)
        step.walk = WalkResult(accepted, num_acc, walk.bonus, tokens, order, walk.off_chain)
        self._record_metrics(step.walk, step.tree_rows, step.tree.num_nodes, N)
        ctx.metrics.add_time("walk", time.perf_counter() - t0)
        logprobs = ctx.view.sampled_tokens(chain_out)[1] if chain_out is not None else None
        return ctx.view.sampler_output(tokens.to(torch.int32), logprobs)

    def _sample_chain_step(self, vllm_sample, batch, logits):
        """A plain chain verify (whole-step fallback, warm-up): vLLM's sampler, except that rows which
        sample with a temperature and need no unsupported feature are drawn by the same seeded
        sample-and-walk as tree rows, on chain-shaped trees. vLLM 0.32's CPU random rejection kernel
        is not lossless for DFlash's drafts (tests/test_e2e_sampling.py measures it), and this keeps
        a request's samples independent of how its rounds were batched."""
        ctx = self.ctx
        temp = ctx.view.sampling_temperature(batch)
        spec = ctx.view.spec_batch(batch) if temp is not None else None  # (greedy: vLLM's sampler as is)
        if spec is None:
            return vllm_sample(logits)
        ks = spec.drafts_per_request
        R = len(ks)
        host_temp = ctx.view.temperatures_host(R)
        req_ids = ctx.view.req_ids(R)
        redo = [k > 0 and float(t) > 0 and ctx.chain_reason(q) is None for k, t, q in zip(ks, host_temp, req_ids)]
        if not any(redo):
            return vllm_sample(logits)
        logits_in = logits.clone()  # vLLM's sampler may update logits in place
        out = vllm_sample(logits)
        K = max(ks)
        N = K + 1
        rows, drafts, cu = [], [], 0
        last = max(sum(ks) - 1, 0)
        for i, k in enumerate(ks):
            start = sum(ks[:i]) + i
            rows.append([start + min(j, k) for j in range(N)])
            drafts.append([min(cu + min(j, max(k - 1, 0)), last) for j in range(K)])  # padding: any draft
            cu += k
        rows_t = ctx.h2d(rows, torch.int64)
        lg = logits_in[rows_t]  # [R, N, V]
        dt = spec.draft_tokens
        tokens = torch.cat([torch.zeros(R, 1, dtype=torch.int64, device=ctx.device),
                            (dt[ctx.h2d(drafts, torch.int64)] if dt.numel() else
                             torch.zeros(R, K, dtype=torch.int64, device=ctx.device)).long()], 1)
        k_t = ctx.h2d(ks, torch.int64)
        j = torch.arange(N, device=ctx.device).expand(R, N)
        live = j <= k_t.unsqueeze(1)
        parents = torch.where(live & (j > 0), j - 1, -1)
        depths = torch.where(live, j, 0)
        tree = TreeBatch(tokens, parents, depths, torch.zeros(R, N, device=ctx.device), k_t,
                         pack_bits(ancestor_closure(parents, K)), max_depth=K)
        pos = ctx.view.verify_positions(spec.sample_rows)[rows_t] + 1
        seeds = ctx.h2d([ctx.seed(q) for q in req_ids], torch.int64)
        walk = walk_tree(tree, sample_target_tokens(lg, temp[:R], seeds, pos))
        width = ctx.view.sampled_tokens(out)[0].shape[1]
        return ctx.view.replace_sampled(out, _pad_cols(walk.tokens, width), ctx.h2d(redo, torch.bool))

    def _greedy_walk(self, target, tokens, parents, depths, num_nodes, ancestor_bits, top1, tree_rows,
                     **counters) -> tuple[WalkResult, torch.Tensor, torch.Tensor]:
        """Device work only (stage_graphs.py): the walk of the target's argmax tokens, the step's
        metrics, the tokens vLLM sees (int32) and its counts (int32 [2, R]: per row the tokens sampled,
        the path's + bonus, and the N-token query's others, rejected). `counters` (the metrics' device
        tensors, which `record_round` adds into) are passed so that their addresses key the graph."""
        N = tokens.shape[1]
        # no scores: neither walk (Triton, torch) reads them, so they are not copied into the graph
        tree = TreeBatch(tokens, parents, depths, None, num_nodes, ancestor_bits, max_depth=self.ctx.max_depth)
        walk = walk_tree(tree, target, top1=top1)
        walk.tokens = _pad_cols(walk.tokens, N)
        self._record_metrics(walk, tree_rows, num_nodes, N)
        sampled = walk.num_accepted.to(torch.int32)  # (the path's length with its root = its tokens + bonus)
        return walk, walk.tokens.to(torch.int32), torch.stack([sampled, N - sampled])

    def _record_metrics(self, walk: WalkResult, tree_rows, num_nodes, N: int) -> None:
        ctx = self.ctx
        accepted = walk.num_accepted - 1
        largest = N == ctx.N
        within = None
        if largest and self._smaller is not None:  # what each smaller bucket, a prefix of this tree, would accept
            within = _accepted_within(walk.accepted, self._smaller)
        ctx.metrics.record_round(tree_rows, num_nodes, accepted, walk.off_chain, accepted >= min(ctx.L, N - 1),
                                 within=within, largest=largest)


def _accepted_within(path: torch.Tensor, budgets: torch.Tensor) -> torch.Tensor:
    """[M, R]: accepted nodes of each request's path (slot indices [R, W], root first, -1 padded)
    within the tree's first b nodes, per budget b of `budgets` ([M, 1, 1] on the path's device).
    Slots are in build order, parents first, so the b-node tree is slots 0..b, and a walk of it (the
    same target tokens) stops where the path first leaves them: exactly its accepted path under
    greedy verification."""
    inside = (path >= 0) & (path <= budgets)  # [M, R, W]
    return inside.to(torch.int64).cumprod(-1).sum(-1) - 1


def _pad_cols(x: torch.Tensor, width: int) -> torch.Tensor:
    if x.shape[1] >= width:
        return x[:, :width]
    pad = torch.full((x.shape[0], width - x.shape[1]), -1, dtype=x.dtype, device=x.device)
    return torch.cat([x, pad], dim=1)

